//! The attention arithmetic every part of kvreplay shares, in one place so that inspect, the
//! scorers and the metrics cannot disagree: scaled (optionally soft-capped) dot-product logits,
//! a numerically stable softmax, entropy. All in f32 with f64 accumulation where sums are long.

mod product;
mod row_dots;
mod softmax;

pub use product::{scaled_product, PackedKeys};
pub use softmax::{softmax, softmax_f64, softmax_in_place, softmax_into};

use ndarray::{s, Array2, ArrayView1, ArrayView2, ArrayView3};

/// The first key a query at `position` attends to in a layer of attention window `window` (keys
/// `position + 1 - window..=position`; 0: every key, a global layer).
pub fn first_visible(position: usize, window: usize) -> usize {
    match window {
        0 => 0,
        window => (position + 1).saturating_sub(window),
    }
}

/// Logits of one query against rows of `keys`: `scale * q·k_j`, soft-capped when asked
/// (`softcap * tanh(x / softcap)`, Gemma-2's rule).
pub fn logits(
    query: ArrayView1<f32>,
    keys: ArrayView2<f32>,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let raw = row_dots::row_dots(keys, query);
    raw.iter()
        .map(|dot| {
            let logit = dot * scale;
            match softcap {
                Some(cap) => cap * (logit / cap).tanh(),
                None => logit,
            }
        })
        .collect()
}

/// Softmax attention of one query over rows of `keys`.
pub fn attend(
    query: ArrayView1<f32>,
    keys: ArrayView2<f32>,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let mut weights = logits(query, keys, scale, softcap);
    softmax_in_place(&mut weights);
    weights
}

/// Shannon entropy in nats of a probability vector (zeros contribute nothing).
pub fn entropy(probabilities: &[f32]) -> f64 {
    probabilities
        .iter()
        .filter(|p| **p > 0.0)
        .map(|p| {
            let p = *p as f64;
            -p * p.ln()
        })
        .sum()
}

/// Dot product with sixteen independent accumulators, so it vectorises without fast-math.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let (a_chunks, b_chunks) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..16 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    // A tree reduction: vector adds, not sixteen dependent scalar ones.
    let mut width = 8;
    while width > 0 {
        for lane in 0..width {
            lanes[lane] += lanes[lane + width];
        }
        width /= 2;
    }
    lanes[0] + tail
}

/// Logits of several queries against the keys at `positions`: `out[q][i] = scale * queries[q] ·
/// keys[positions[i]]`, soft-capped when asked. One pass over the keys serves every query (a GQA
/// group); AVX2/FMA code where the processor has it.
pub fn sparse_logits(
    queries: &[Vec<f32>],
    keys: ArrayView2<f32>,
    positions: &[usize],
    scale: f32,
    softcap: Option<f32>,
    out: &mut [Vec<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected just above.
        return unsafe { sparse_logits_avx2(queries, keys, positions, scale, softcap, out) };
    }
    sparse_logits_portable(queries, keys, positions, scale, softcap, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sparse_logits_avx2(
    queries: &[Vec<f32>],
    keys: ArrayView2<f32>,
    positions: &[usize],
    scale: f32,
    softcap: Option<f32>,
    out: &mut [Vec<f32>],
) {
    sparse_logits_portable(queries, keys, positions, scale, softcap, out);
}

#[inline(always)]
fn sparse_logits_portable(
    queries: &[Vec<f32>],
    keys: ArrayView2<f32>,
    positions: &[usize],
    scale: f32,
    softcap: Option<f32>,
    out: &mut [Vec<f32>],
) {
    for row in out.iter_mut() {
        row.clear();
    }
    for &position in positions {
        let key = keys.row(position);
        let key = key.to_slice().expect("standard layout");
        for (row, query) in out.iter_mut().zip(queries) {
            let logit = dot(key, query) * scale;
            row.push(match softcap {
                Some(cap) => cap * (logit / cap).tanh(),
                None => logit,
            });
        }
    }
}

/// Softmax attention of one query over the keys at `positions` (rows of `keys`, in that order).
/// When `positions` is the prefix `0..n`, the keys are read as one contiguous block.
pub fn attend_positions(
    query: ArrayView1<f32>,
    keys: ArrayView2<f32>,
    positions: &[usize],
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let n = positions.len();
    if n > 0 && positions[n - 1] + 1 == n {
        return attend(query, keys.slice(ndarray::s![..n, ..]), scale, softcap);
    }
    let mut weights = vec![Vec::with_capacity(n)];
    sparse_logits(
        &[query.to_vec()],
        keys,
        positions,
        scale,
        softcap,
        &mut weights,
    );
    let mut weights = weights.pop().expect("one query");
    softmax_in_place(&mut weights);
    weights
}

/// Causal logits `scale * q_{h,t} · k_j` (soft-capped when asked), `j <= t`, of the query heads of
/// one GQA group over their shared keys, served one (head, position) row at a time but computed
/// by matrix multiplication ([`scaled_product`]): the group's queries for a block of positions
/// are stacked into one product of [`CausalLogits::BLOCK_ROWS`] rows (full register tiles
/// whatever the group size), whose output buffer is reused from block to block. That buffer and
/// the packed keys are a prefix scorer's working memory: `(BLOCK_ROWS + d) · T` floats per cache
/// being scored at most, a few per cent of a layer.
#[derive(Debug)]
pub struct CausalLogits {
    /// The keys, packed for the product as blocks need them.
    keys: PackedKeys,
    scale: f32,
    softcap: Option<f32>,
    positions_per_block: usize,
    block_start: usize,
    /// Positions and keys of the current block.
    block_positions: usize,
    block_keys: usize,
    /// The current block's queries, head-major: `[heads * block_positions, d]`.
    stacked: Array2<f32>,
    /// The current block's logits, `[heads * block_positions, block_keys]`.
    logits: Vec<f32>,
}

/// A copy without the current block (a policy's streams forked at the prompt's end would copy
/// the prompt's last block of logits for nothing): its next row computes its block again, with
/// the same values.
impl Clone for CausalLogits {
    fn clone(&self) -> Self {
        Self {
            keys: self.keys.clone(),
            stacked: self.stacked.clone(),
            logits: Vec::new(),
            block_start: usize::MAX,
            ..*self
        }
    }
}

impl CausalLogits {
    /// Rows (heads × positions) computed per matrix multiplication: a multiple of the product's
    /// 6-row tile for groups of 1, 2, 3, 4, 6, 9 or 12 heads, and small enough that a cache's
    /// block (`BLOCK_ROWS · T` logits) stays a few per cent of a layer while several caches are
    /// scored side by side.
    pub const BLOCK_ROWS: usize = 36;

    /// Logits of `heads` query heads of size `head_dim` against their shared keys; the queries
    /// `[heads, T, d]` and keys `[T, d]` come with each [`row`](Self::row) call.
    pub fn new(heads: usize, head_dim: usize, scale: f32, softcap: Option<f32>) -> Self {
        let positions_per_block = (Self::BLOCK_ROWS / heads.max(1)).max(1);
        Self {
            keys: PackedKeys::new(head_dim),
            scale,
            softcap,
            positions_per_block,
            block_start: usize::MAX,
            block_positions: 0,
            block_keys: 0,
            stacked: Array2::zeros((heads * positions_per_block, head_dim)),
            logits: Vec::new(),
        }
    }

    /// Frees the working memory (the current block and the packed keys); a later row computes
    /// them again, with the same values.
    pub fn release(&mut self) {
        self.logits = Vec::new();
        self.keys.release();
        self.block_start = usize::MAX;
    }

    /// Positions per block (`BLOCK_ROWS` shared by the heads).
    pub fn positions_per_block(&self) -> usize {
        self.positions_per_block
    }

    /// The logits of head `head`'s query at `position` over keys `0..=position`. A block covers
    /// the positions of `queries` there are: when they grow between calls (a live model), a row
    /// past the block's end computes the block again.
    pub fn row(
        &mut self,
        queries: ArrayView3<f32>,
        keys: ArrayView2<f32>,
        head: usize,
        position: usize,
    ) -> &[f32] {
        let start = position / self.positions_per_block * self.positions_per_block;
        if start != self.block_start || position >= start + self.block_positions {
            self.compute_block(queries, keys, start);
        }
        let offset = (head * self.block_positions + position - start) * self.block_keys;
        &self.logits[offset..=offset + position]
    }

    fn compute_block(&mut self, queries: ArrayView3<f32>, keys: ArrayView2<f32>, start: usize) {
        let (heads, n_positions, head_dim) = queries.dim();
        let end = (start + self.positions_per_block).min(n_positions);
        let positions = end - start;
        let rows = heads * positions;
        for head in 0..heads {
            self.stacked
                .slice_mut(s![head * positions..(head + 1) * positions, ..])
                .assign(&queries.slice(s![head, start..end, ..]));
        }
        let needed = rows * end;
        if self.logits.len() < needed {
            // Grow without copying (the old block is not needed), at most to the last block's size.
            let largest = heads * self.positions_per_block * n_positions;
            let size = needed.max(2 * self.logits.len()).min(largest);
            self.logits = Vec::new();
            self.logits = vec![0.0; size];
        }
        let block = &mut self.logits[..needed];
        scaled_product(
            self.stacked.slice(s![..rows, ..head_dim]),
            keys,
            &mut self.keys,
            end,
            self.scale,
            block,
        );
        if let Some(cap) = self.softcap {
            for logit in block.iter_mut() {
                *logit = cap * (*logit / cap).tanh();
            }
        }
        self.block_start = start;
        self.block_positions = positions;
        self.block_keys = end;
    }
}

/// The full causal attention of the decode queries of some query heads over their shared keys,
/// `[heads, T - prompt_len, T]` (keys after a query's position hold 0): `queries` `[heads, T, d]`,
/// `keys` `[T, d]`. With a `window` (0: none), the query at `t` attends over keys
/// `t + 1 - window..=t` only and the keys before hold 0, as a sliding-window layer computes it.
/// The replay engine computes it once per KV group and layer and shares it between every
/// policy's metrics.
pub fn decode_attention(
    queries: ArrayView3<f32>,
    keys: ArrayView2<f32>,
    prompt_len: usize,
    window: usize,
    scale: f32,
    softcap: Option<f32>,
) -> ndarray::Array3<f32> {
    let (n_heads, n_positions, _) = queries.dim();
    let steps = n_positions - prompt_len;
    let mut out = ndarray::Array3::<f32>::zeros((n_heads, steps, n_positions));
    let mut packed = PackedKeys::new(keys.ncols());
    for head in 0..n_heads {
        let mut rows = out.index_axis_mut(ndarray::Axis(0), head);
        scaled_product(
            queries.slice(s![head, prompt_len.., ..]),
            keys,
            &mut packed,
            n_positions,
            scale,
            rows.as_slice_mut().expect("standard layout"),
        );
        for (step, mut row) in rows.outer_iter_mut().enumerate() {
            let row = row.as_slice_mut().expect("standard layout");
            let (seen, future) = row.split_at_mut(prompt_len + step + 1);
            let (slid_out, visible) = seen.split_at_mut(first_visible(prompt_len + step, window));
            slid_out.fill(0.0);
            if let Some(cap) = softcap {
                for logit in visible.iter_mut() {
                    *logit = cap * (*logit / cap).tanh();
                }
            }
            softmax_in_place(visible);
            future.fill(0.0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;
    use ndarray::array;

    #[test]
    fn attend_matches_hand_computation() {
        // q = [1, 0], keys (1,0), (0,1), (2,0); scale 1: logits 1, 0, 2.
        // softmax = e^(x-2) / (e^-1 + e^-2 + 1) = [0.244728, 0.090031, 0.665241].
        let keys = array![[1.0f32, 0.0], [0.0, 1.0], [2.0, 0.0]];
        let query = array![1.0f32, 0.0];
        let weights = attend(query.view(), keys.view(), 1.0, None);
        assert_abs_diff_eq!(weights[0], 0.244_728, epsilon = 1e-6);
        assert_abs_diff_eq!(weights[1], 0.090_031, epsilon = 1e-6);
        assert_abs_diff_eq!(weights[2], 0.665_241, epsilon = 1e-6);
    }

    #[test]
    fn softcap_bounds_logits() {
        let keys = array![[100.0f32]];
        let query = array![1.0f32];
        let capped = logits(query.view(), keys.view(), 1.0, Some(30.0));
        assert_abs_diff_eq!(capped[0], 30.0 * (100.0f32 / 30.0).tanh(), epsilon = 1e-5);
        assert!(capped[0] < 30.0);
    }

    #[test]
    fn causal_logits_match_row_by_row_dots() {
        let queries = ndarray::Array2::from_shape_fn((150, 3), |(t, d)| {
            ((t * 7 + d * 3) % 11) as f32 * 0.1 - 0.5
        });
        let keys = ndarray::Array2::from_shape_fn((150, 3), |(t, d)| {
            ((t * 5 + d) % 13) as f32 * 0.1 - 0.6
        });
        // Three heads share the keys: 12 positions per block, so the positions below cross
        // block edges, go back to an earlier block, and end in the short last block; a release
        // in between changes nothing.
        let heads = ndarray::Array3::from_shape_fn((3, 150, 3), |(h, t, d)| {
            queries[[t, d]] * (h as f32 + 1.0) - 0.1 * h as f32
        });
        let mut rows = CausalLogits::new(3, 3, 0.5, Some(2.0));
        assert_eq!(rows.positions_per_block(), 12);
        for position in [0, 1, 23, 24, 25, 71, 72, 73, 149, 145, 3] {
            if position == 72 {
                rows.release();
            }
            for head in [2, 0, 1] {
                let direct = logits(
                    heads.slice(ndarray::s![head, position, ..]),
                    keys.slice(ndarray::s![..=position, ..]),
                    0.5,
                    Some(2.0),
                );
                let served = rows.row(heads.view(), keys.view(), head, position);
                assert_eq!(served.len(), position + 1);
                for (a, b) in served.iter().zip(&direct) {
                    assert_abs_diff_eq!(a, b, epsilon = 1e-5);
                }
            }
        }
    }

    /// Queries of two heads `[2, 40, 4]` and their keys `[40, 4]`.
    fn two_heads_over_40_keys() -> (ndarray::Array3<f32>, ndarray::Array2<f32>) {
        let queries = ndarray::Array3::from_shape_fn((2, 40, 4), |(h, t, d)| {
            ((h * 5 + t * 3 + d) % 11) as f32 * 0.2 - 1.0
        });
        let keys =
            ndarray::Array2::from_shape_fn((40, 4), |(t, d)| ((t * 7 + d) % 13) as f32 * 0.1);
        (queries, keys)
    }

    #[test]
    fn rows_of_a_growing_prefix_equal_those_of_the_whole() {
        // A live model hands over one more position at each step: every row must equal the row
        // served from the whole array, bit for bit, although blocks were cut short.
        let (queries, keys) = two_heads_over_40_keys();
        let (mut whole, mut growing) = (
            CausalLogits::new(2, 4, 0.5, None),
            CausalLogits::new(2, 4, 0.5, None),
        );
        for position in 0..40 {
            let (q, k) = (
                queries.slice(ndarray::s![.., ..=position, ..]),
                keys.slice(ndarray::s![..=position, ..]),
            );
            for head in 0..2 {
                let want = whole
                    .row(queries.view(), keys.view(), head, position)
                    .to_vec();
                assert_eq!(growing.row(q, k, head, position), want.as_slice());
            }
        }
    }

    #[test]
    fn a_copy_serves_the_rows_its_original_serves() {
        // The copy leaves the block behind and computes it again: the same rows, bit for bit,
        // in the block the original had and after it.
        let (queries, keys) = two_heads_over_40_keys();
        let mut original = CausalLogits::new(2, 4, 0.5, None);
        original.row(queries.view(), keys.view(), 1, 20);
        let mut copy = original.clone();
        assert!(copy.logits.is_empty());
        for position in [20, 19, 39] {
            for head in 0..2 {
                let want = original
                    .row(queries.view(), keys.view(), head, position)
                    .to_vec();
                let got = copy.row(queries.view(), keys.view(), head, position);
                assert_eq!(got, want.as_slice());
            }
        }
    }

    #[test]
    fn decode_attention_matches_attend_over_each_querys_window() {
        let q =
            ndarray::Array3::from_shape_fn((2, 9, 2), |(h, t, d)| (h + t * d) as f32 * 0.3 - 1.0);
        let k = ndarray::Array2::from_shape_fn((9, 2), |(t, d)| (t + d) as f32 * 0.2 - 0.7);
        // Window 0 is global; window 4 lets position 6 see keys 3..=6; 20 is wider than T.
        for (window, first_of_6) in [(0, 0), (4, 3), (20, 0)] {
            let all = decode_attention(q.view(), k.view(), 6, window, 0.7, None);
            assert_eq!(all.dim(), (2, 3, 9));
            for head in 0..2 {
                for step in 0..3 {
                    let position = 6 + step;
                    let first = first_of_6 + if window == 4 { step } else { 0 };
                    let want = attend(
                        q.slice(ndarray::s![head, position, ..]),
                        k.slice(ndarray::s![first..=position, ..]),
                        0.7,
                        None,
                    );
                    for j in 0..9usize {
                        let expected = match j.checked_sub(first) {
                            Some(index) => want.get(index).copied().unwrap_or(0.0),
                            None => 0.0,
                        };
                        assert_abs_diff_eq!(all[[head, step, j]], expected, epsilon = 1e-6);
                    }
                }
            }
        }
    }

    #[test]
    fn dot_matches_the_plain_sum() {
        let a: Vec<f32> = (0..67).map(|i| i as f32 * 0.25 - 3.0).collect();
        let b: Vec<f32> = (0..67).map(|i| 1.0 - i as f32 * 0.125).collect();
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_abs_diff_eq!(dot(&a, &b), plain, epsilon = 1e-3);
    }

    #[test]
    fn entropy_of_uniform_is_log_n() {
        assert_abs_diff_eq!(entropy(&[0.25; 4]), 4f64.ln(), epsilon = 1e-7);
        assert_abs_diff_eq!(entropy(&[1.0, 0.0]), 0.0, epsilon = 1e-12);
    }
}
