//! The softmax of a chunk's attention logits under its mask, in one pass over each query's line:
//! the window's and the policy's masks read where they lie, never added into a mask of their own,
//! and the scale, mask, maximum, exponential, sum and division of each line computed as
//! candle's chain of tensor operations computes them, bit for bit. A long prompt's prefill under
//! a policy that evicts while it runs attends every query over every earlier key; the chain's six
//! passes over `[n, P]` logits per head, each with its own allocation, took a sixth of a ~4K
//! SmolLM2 prompt's closed-loop runs.

use super::line_sum::line_sum;
use super::product::with_rows;
use super::ModelError;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Which cached positions `first..past + n` each query of a chunk at positions `past..past + n`
/// attends over: those within the layer's window (position `j` for the query at `p` when
/// `j <= p` and `p - j < window`) to which the policy's additive mask, when one decides, adds its
/// own.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkMask<'a> {
    /// The policy's mask `[heads, n, past + n]` (0 where a query attends, −∞ elsewhere).
    pub policy: Option<&'a [f32]>,
    /// The positions cached before the chunk.
    pub past: usize,
    /// The layer's window, its own position included (0: global).
    pub window: usize,
    /// The first cached position the chunk's queries read.
    pub first: usize,
}

impl ChunkMask<'_> {
    /// The columns `first..past + n` a line of the chunk's logits spans.
    #[cfg(test)]
    fn columns(&self, n: usize) -> usize {
        self.past + n - self.first
    }

    /// The columns of query `row`'s line within its window: `lo..=hi`.
    fn window_of(&self, row: usize) -> (usize, usize) {
        let position = self.past + row;
        let lo = match self.window {
            0 => self.first,
            window => (position + 1).saturating_sub(window).max(self.first),
        };
        (lo - self.first, position - self.first)
    }

    /// The additive mask as a tensor, the window's `[n, columns]` broadcast to the policy's
    /// `[heads, n, columns]` when it decides: what candle's chain of operations, which the fused
    /// passes stand for, adds.
    #[cfg(test)]
    pub fn tensor(&self, heads: usize, n: usize) -> Result<Tensor, ModelError> {
        let columns = self.columns(n);
        let window = super::mask::window_mask(self.past, n, self.window, self.first);
        let window = Tensor::from_vec(window, (n, columns), &Device::Cpu)?;
        Ok(match self.policy {
            Some(policy) => {
                let policy = policy_columns(policy, (heads, n, self.past + n), self.first);
                Tensor::from_vec(policy, (heads, n, columns), &Device::Cpu)?
                    .broadcast_add(&window)?
            }
            None => window,
        })
    }
}

/// The policy's mask `[heads, n, total]` from column `first` on.
#[cfg(test)]
fn policy_columns(
    policy: &[f32],
    (heads, n, total): (usize, usize, usize),
    first: usize,
) -> Vec<f32> {
    (0..heads * n)
        .flat_map(|line| &policy[line * total + first..(line + 1) * total])
        .copied()
        .collect()
}

/// `softmax(scale · logits + mask)` over the last axis for query head `head`'s logits
/// `[1, n, columns]`: what `((logits * scale) + mask)`, its maximum subtracted, exponentiated
/// and divided by its sum, gives in candle, bit for bit (the sum in the order of candle's
/// `sum_keepdim`, [`line_sum`]).
pub(crate) fn masked_softmax(
    logits: &Tensor,
    scale: f64,
    mask: &ChunkMask<'_>,
    head: usize,
) -> Result<Tensor, ModelError> {
    let (_, n, columns) = logits.dims3()?;
    let lines = logits.squeeze(0)?.contiguous()?;
    let weights = with_rows(&lines, |data, stride| {
        let mut weights = vec![0.0f32; n * columns];
        weights
            .par_chunks_exact_mut(columns)
            .enumerate()
            .for_each(|(row, line)| {
                let policy = mask.policy.map(|policy| {
                    let total = mask.past + n;
                    &policy[(head * n + row) * total + mask.first..][..columns]
                });
                let logits = &data[row * stride..][..columns];
                softmax_line(logits, line, (scale, policy), mask.window_of(row));
            });
        weights
    })?;
    let Some(weights) = weights else {
        return Err(ModelError::Mask(
            "attention logits outside CPU memory".into(),
        ));
    };
    Ok(Tensor::from_vec(weights, (1, n, columns), &Device::Cpu)?)
}

/// `softmax(scale · logits + mask)` of the lines `[lines, columns]` of one-query steps, each
/// query's window spanning every column and `policy(line)` its policy's mask line when it
/// decides: what [`masked_softmax`] gives each line, bit for bit, with no mask of its own built.
pub(crate) fn softmax_lines<'m>(
    logits: &[f32],
    (lines, columns): (usize, usize),
    scale: f64,
    policy: impl Fn(usize) -> Option<&'m [f32]>,
) -> Vec<f32> {
    let window = (0, columns - 1);
    softmax_windowed_lines(logits, (lines, columns), (scale, window), policy)
}

/// [`softmax_lines`] of lines that see columns `lo..=hi` of their own (a sliding-window layer's
/// query over a cache holding more than its window).
fn softmax_windowed_lines<'m>(
    logits: &[f32],
    (lines, columns): (usize, usize),
    (scale, window): (f64, (usize, usize)),
    policy: impl Fn(usize) -> Option<&'m [f32]>,
) -> Vec<f32> {
    let mut weights = vec![0.0f32; lines * columns];
    for (line, out) in weights.chunks_exact_mut(columns).enumerate() {
        let logits = &logits[line * columns..][..columns];
        softmax_line(logits, out, (scale, policy(line)), window);
    }
    weights
}

/// `softmax(scale · logits + mask)` of one query per head (a step), for query heads
/// `heads.start..` whose logits `[heads.len(), columns]` are `logits`'s lines: what
/// [`masked_softmax`] gives each head's line of a one-query chunk, bit for bit, as a tensor
/// `[heads.len(), columns]`.
pub(crate) fn one_query_softmax(
    logits: &Tensor,
    scale: f64,
    mask: &ChunkMask<'_>,
    heads: std::ops::Range<usize>,
) -> Result<Tensor, ModelError> {
    let (lines, columns) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let total = mask.past + 1;
    let policy = |line: usize| {
        let head = heads.start + line;
        mask.policy
            .map(|policy| &policy[head * total + mask.first..][..columns])
    };
    let weights = with_rows(&logits, |data, _| {
        softmax_windowed_lines(data, (lines, columns), (scale, mask.window_of(0)), policy)
    })?;
    match weights {
        Some(weights) => Ok(Tensor::from_vec(weights, (lines, columns), &Device::Cpu)?),
        None => Err(ModelError::Mask(
            "attention logits outside CPU memory".into(),
        )),
    }
}

/// One query's `exp(x − max x)` into `out`, each divided by the line's sum, where
/// `x = (logit · scale + 0) + m`: the window's mask (0 on columns `lo..=hi`, −∞ elsewhere), plus
/// the policy's entry first when it decides, as candle's affine map and broadcast additions
/// compute them, each exponential as `f32::exp` ([`exp_shifted`](super::expf::exp_shifted)), the
/// sum as its `sum_keepdim` ([`line_sum`]). A masked entry's `x` is −∞, and its weight
/// `exp(−∞ − max)` is 0 when any entry is not masked. Where the processor has AVX2 its passes
/// run eight lanes wide: each element's operations are the same.
fn softmax_line(
    logits: &[f32],
    out: &mut [f32],
    mask: (f64, Option<&[f32]>),
    window: (usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        unsafe { softmax_line_avx2(logits, out, mask, window) };
        return;
    }
    softmax_line_here(logits, out, mask, window);
}

/// [`softmax_line`] compiled for AVX2.
///
/// # Safety
/// The processor must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_line_avx2(
    logits: &[f32],
    out: &mut [f32],
    mask: (f64, Option<&[f32]>),
    window: (usize, usize),
) {
    softmax_line_here(logits, out, mask, window);
}

/// [`softmax_line`]'s passes, compiled for the processor of the function they are inlined in.
#[inline(always)]
fn softmax_line_here(
    logits: &[f32],
    out: &mut [f32],
    (scale, policy): (f64, Option<&[f32]>),
    (lo, hi): (usize, usize),
) {
    let scale = scale as f32;
    let (window, logits) = (&mut out[lo..=hi], &logits[lo..=hi]);
    match policy {
        Some(policy) => {
            for (x, (&logit, &policy)) in window.iter_mut().zip(logits.iter().zip(&policy[lo..=hi]))
            {
                *x = (logit * scale + 0.0) + (policy + 0.0);
            }
        }
        None => {
            for (x, &logit) in window.iter_mut().zip(logits) {
                *x = (logit * scale + 0.0) + 0.0;
            }
        }
    }
    let max = line_max(window);
    if max == f32::NEG_INFINITY {
        // Every entry is masked: candle's `exp(−∞ − (−∞))`, a NaN, on each (computed at run
        // time, as candle computes it, so that its bits are the same).
        out.fill((f32::NEG_INFINITY - std::hint::black_box(f32::NEG_INFINITY)).exp());
    } else {
        out[..lo].fill(0.0);
        out[hi + 1..].fill(0.0);
        super::expf::exp_shifted(&mut out[lo..=hi], max);
    }
    let total = line_sum(out);
    for weight in out {
        *weight /= total;
    }
}

/// The largest of `values`, NaNs left out, as a fold of `f32::max` gives it, compared in eight
/// lanes: a maximum does not depend on the order of its comparisons (of two zeros either may
/// come out, and `x − max` is the same for both).
#[inline(always)]
fn line_max(values: &[f32]) -> f32 {
    let larger = |max: f32, x: f32| if x > max { x } else { max };
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = values.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, x);
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |max, &x| larger(max, x))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    /// The chain of tensor operations the fused pass stands for.
    fn by_candle(logits: &Tensor, scale: f64, mask: &Tensor) -> Vec<f32> {
        let logits = (logits * scale).unwrap().broadcast_add(mask).unwrap();
        let max = logits.max_keepdim(D::Minus1).unwrap();
        let weights = logits.broadcast_sub(&max).unwrap().exp().unwrap();
        let weights = weights
            .broadcast_div(&weights.sum_keepdim(D::Minus1).unwrap())
            .unwrap();
        weights.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn the_fused_pass_is_candles_chain_bit_for_bit() {
        // Lines shorter and longer than the sum's 32-wide lanes, global and sliding windows, a
        // chunk after cached positions, with and without a policy that masks scattered keys.
        let heads = 3;
        for (past, n, window, first) in
            [(0, 5, 0, 0), (37, 9, 0, 0), (70, 40, 16, 54), (90, 6, 8, 0)]
        {
            let total = past + n;
            let columns = total - first;
            // Scattered keys masked, and head 1's first query masked whole.
            let policy: Vec<f32> = (0..heads * n * total)
                .map(|i| match ((i * 7919) % 5, i / total == n) {
                    (0, _) | (_, true) => f32::NEG_INFINITY,
                    _ => 0.0,
                })
                .collect();
            for policy in [None, Some(policy.as_slice())] {
                let mask = ChunkMask {
                    policy,
                    past,
                    window,
                    first,
                };
                let reference = mask.tensor(heads, n).unwrap();
                for head in 0..heads {
                    let logits: Vec<f32> = (0..n * columns)
                        .map(|i| ((i * 31 + head * 7) as f32 * 0.173).sin() * 9.0)
                        .collect();
                    let logits = Tensor::from_vec(logits, (1, n, columns), &Device::Cpu).unwrap();
                    let head_mask = match policy {
                        Some(_) => reference.narrow(0, head, 1).unwrap(),
                        None => reference.clone(),
                    };
                    let fused = masked_softmax(&logits, 0.125, &mask, head).unwrap();
                    let fused: Vec<f32> = fused.flatten_all().unwrap().to_vec1().unwrap();
                    let want = by_candle(&logits, 0.125, &head_mask);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&fused),
                        bits(&want),
                        "{past} {n} {window} {first} {head}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_lines_maximum_leaves_nans_out_as_a_fold_of_max_does() {
        let values: Vec<f32> = (0..37)
            .map(|i| ((i * 17) as f32 * 0.61).sin() * 5.0)
            .collect();
        let fold = |v: &[f32]| v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        assert_eq!(line_max(&values), fold(&values));
        let mut with_nans = values.clone();
        with_nans[3] = f32::NAN;
        with_nans[35] = f32::NAN;
        assert_eq!(line_max(&with_nans), fold(&with_nans));
        assert_eq!(line_max(&[f32::NEG_INFINITY; 9]), f32::NEG_INFINITY);
        assert_eq!(line_max(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn a_window_spans_the_positions_a_query_sees() {
        let mask = ChunkMask {
            policy: None,
            past: 10,
            window: 4,
            first: 7,
        };
        // Position 10 sees 7..=10; position 12 sees 9..=12; columns count from position 7.
        assert_eq!(mask.window_of(0), (0, 3));
        assert_eq!(mask.window_of(2), (2, 5));
        let global = ChunkMask {
            window: 0,
            first: 0,
            ..mask
        };
        assert_eq!(global.window_of(1), (0, 11));
    }
}
