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

/// In-place softmax; an empty slice stays empty.
pub fn softmax_in_place(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for value in values.iter_mut() {
        *value = (*value - max).exp();
        sum += *value as f64;
    }
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
    let mut weights: Vec<f32> = positions
        .iter()
        .map(|&position| {
            let logit = keys.row(position).dot(&query) * scale;
            match softcap {
                Some(cap) => cap * (logit / cap).tanh(),
                None => logit,
            }
        })
        .collect();
    softmax_in_place(&mut weights);
    weights
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
    fn entropy_of_uniform_is_log_n() {
        assert_abs_diff_eq!(entropy(&[0.25; 4]), 4f64.ln(), epsilon = 1e-7);
        assert_abs_diff_eq!(entropy(&[1.0, 0.0]), 0.0, epsilon = 1e-12);
    }
}
