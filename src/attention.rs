//! The attention arithmetic every part of kvreplay shares, in one place so that inspect, the
//! scorers and the metrics cannot disagree: scaled (optionally soft-capped) dot-product logits,
//! a numerically stable softmax, entropy. All in f32 with f64 accumulation where sums are long.

use ndarray::{ArrayView1, ArrayView2};

/// Logits of one query against rows of `keys`: `scale * q·k_j`, soft-capped when asked
/// (`softcap * tanh(x / softcap)`, Gemma-2's rule).
pub fn logits(
    query: ArrayView1<f32>,
    keys: ArrayView2<f32>,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let raw = keys.dot(&query);
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

/// `e^x` for `x <= 88`, within 2 ulp (Cephes' `expf` polynomial), written without branches or
/// calls so loops over it vectorise: softmax spends most of its time here. Inputs below -87
/// return ~1.6e-38 instead of underflowing, which no softmax sum can notice.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + MAGIC;
    let n = shifted - MAGIC;
    let exponent = shifted.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((exponent + 127) as u32) << 23)
}

/// In-place softmax; an empty slice stays empty. Runs AVX2/FMA code where the processor has it
/// (checked at run time), portable code elsewhere; both compute the same arithmetic.
pub fn softmax_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected just above.
        return unsafe { softmax_avx2(values) };
    }
    softmax_portable(values);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(values: &mut [f32]) {
    softmax_portable(values);
}

#[inline(always)]
fn softmax_portable(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for value in values.iter_mut() {
        *value = exp(*value - max);
    }
    let sum: f64 = values.iter().map(|v| *v as f64).sum();
    let inv = (1.0 / sum) as f32;
    for value in values.iter_mut() {
        *value *= inv;
    }
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

/// Rows of causal logits `scale * q_t · k_j` (soft-capped when asked), `j <= t`, served one query
/// position at a time but computed by matrix multiplication in blocks of [`CausalLogits::BLOCK`]
/// rows, so a scorer that walks the prompt position by position runs at GEMM speed.
#[derive(Debug)]
pub struct CausalLogits<'a> {
    queries: ArrayView2<'a, f32>,
    keys: ArrayView2<'a, f32>,
    scale: f32,
    softcap: Option<f32>,
    block_start: usize,
    block: ndarray::Array2<f32>,
}

impl<'a> CausalLogits<'a> {
    /// Rows computed per matrix multiplication.
    pub const BLOCK: usize = 64;

    /// Logits of `queries` `[T, d]` against `keys` `[T, d]`.
    pub fn new(
        queries: ArrayView2<'a, f32>,
        keys: ArrayView2<'a, f32>,
        scale: f32,
        softcap: Option<f32>,
    ) -> Self {
        Self {
            queries,
            keys,
            scale,
            softcap,
            block_start: usize::MAX,
            block: ndarray::Array2::zeros((0, 0)),
        }
    }

    /// The logits of query `position` over keys `0..=position`.
    pub fn row(&mut self, position: usize) -> &[f32] {
        let start = position / Self::BLOCK * Self::BLOCK;
        if start != self.block_start {
            let end = (start + Self::BLOCK).min(self.queries.nrows());
            let rows = self.queries.slice(ndarray::s![start..end, ..]);
            let keys = self.keys.slice(ndarray::s![..end, ..]);
            let mut block = rows.dot(&keys.t());
            let (scale, softcap) = (self.scale, self.softcap);
            block.mapv_inplace(|dot| {
                let logit = dot * scale;
                match softcap {
                    Some(cap) => cap * (logit / cap).tanh(),
                    None => logit,
                }
            });
            self.block = block;
            self.block_start = start;
        }
        let row = self
            .block
            .row(position - start)
            .to_slice()
            .expect("standard layout");
        &row[..=position]
    }
}

/// The full causal attention of the decode queries, `[n_heads, T - prompt_len, T]` (keys after a
/// query's position hold 0), computed once per layer and shared by every policy's metrics.
pub fn decode_attention(
    queries: ndarray::ArrayView3<f32>,
    keys: ndarray::ArrayView3<f32>,
    prompt_len: usize,
    scale: f32,
    softcap: Option<f32>,
) -> ndarray::Array3<f32> {
    let (n_heads, n_positions, _) = queries.dim();
    let group = n_heads / keys.shape()[0];
    let steps = n_positions - prompt_len;
    let mut out = ndarray::Array3::<f32>::zeros((n_heads, steps, n_positions));
    for head in 0..n_heads {
        let q = queries.slice(ndarray::s![head, prompt_len.., ..]);
        let k = keys.slice(ndarray::s![head / group, .., ..]);
        let logits = q.dot(&k.t());
        for step in 0..steps {
            let position = prompt_len + step;
            let mut row: Vec<f32> = logits
                .row(step)
                .iter()
                .take(position + 1)
                .map(|dot| {
                    let logit = dot * scale;
                    match softcap {
                        Some(cap) => cap * (logit / cap).tanh(),
                        None => logit,
                    }
                })
                .collect();
            softmax_in_place(&mut row);
            out.slice_mut(ndarray::s![head, step, ..=position])
                .iter_mut()
                .zip(row)
                .for_each(|(slot, weight)| *slot = weight);
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
        let mut rows = CausalLogits::new(queries.view(), keys.view(), 0.5, Some(2.0));
        for position in [0, 1, 63, 64, 65, 149, 3] {
            let direct = logits(
                queries.row(position),
                keys.slice(ndarray::s![..=position, ..]),
                0.5,
                Some(2.0),
            );
            let served = rows.row(position);
            assert_eq!(served.len(), position + 1);
            for (a, b) in served.iter().zip(&direct) {
                assert_abs_diff_eq!(a, b, epsilon = 1e-5);
            }
        }
    }

    #[test]
    fn decode_attention_matches_attend() {
        let q =
            ndarray::Array3::from_shape_fn((2, 9, 2), |(h, t, d)| (h + t * d) as f32 * 0.3 - 1.0);
        let k = ndarray::Array3::from_shape_fn((1, 9, 2), |(_, t, d)| (t + d) as f32 * 0.2 - 0.7);
        let all = decode_attention(q.view(), k.view(), 6, 0.7, None);
        assert_eq!(all.dim(), (2, 3, 9));
        for head in 0..2 {
            for step in 0..3 {
                let position = 6 + step;
                let want = attend(
                    q.slice(ndarray::s![head, position, ..]),
                    k.slice(ndarray::s![0, ..=position, ..]),
                    0.7,
                    None,
                );
                for j in 0..9 {
                    let expected = want.get(j).copied().unwrap_or(0.0);
                    assert_abs_diff_eq!(all[[head, step, j]], expected, epsilon = 1e-6);
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
    fn exp_is_within_two_ulp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (fast, exact) = (exp(x), x.exp());
            assert!(
                (fast - exact).abs() <= 2.5 * f32::EPSILON * exact,
                "exp({x}): {fast} vs {exact}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn entropy_of_uniform_is_log_n() {
        assert_abs_diff_eq!(entropy(&[0.25; 4]), 4f64.ln(), epsilon = 1e-7);
        assert_abs_diff_eq!(entropy(&[1.0, 0.0]), 0.0, epsilon = 1e-12);
    }
}
