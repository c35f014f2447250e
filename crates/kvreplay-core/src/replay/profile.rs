//! Per-layer statistics of the observation window's attention over the prompt, the input of the
//! data-driven allocators (`entropy`, `cake`), and the entropy profile over a trace's layers (the
//! "pyramidal information funneling" of the PyramidKV paper, arXiv:2406.02069, §3) that
//! `kvreplay inspect` and the funneling reports show.
//!
//! For layer l, each query head h and each of the last W prompt queries t, `A[t]` is the causal
//! softmax over keys `0..=t`. Entropy: the mean over heads and rows of `-sum_j A ln A` (nats);
//! normalised entropy: the same with each row's entropy divided by ln(t + 1), the entropy of a
//! uniform row (1 for the first position).
//! Variance: per head, `sum_j Var_t A[t, j]` over the W rows (population variance, keys beyond a
//! row's position counting as 0), then the mean over heads.
//! CAKE's own statistics (antgroup/cakekv `cake/model/modify_llama.py` lines 105-106, `calculate_entropy`
//! in `cake/utils.py` lines 15-19) look only at the keys before the window, `j < n - W`, and are
//! sums over heads: dispersion `-sum_{h,t,j} A ln(A + 1e-10)` and variance
//! `sum_{h,j} Var_t A[t, j]` with torch.var's unbiased (W - 1) denominator.

use super::{context, LayerContext};
use crate::attention::{attend, entropy};
use crate::trace::{TraceError, TraceReader};
use ndarray::s;
use rayon::prelude::*;
use serde::Serialize;

/// Window-attention statistics of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerProfile {
    /// Mean row entropy, nats.
    pub entropy: f64,
    /// Mean row entropy over the uniform row's, ln(keys attended): 1 = uniform.
    pub normalized: f64,
    /// Mean over heads of the summed per-key variance across window rows.
    pub variance: f64,
    /// CAKE's dispersion: `-sum A ln(A + 1e-10)` over heads, window rows and keys before the
    /// window.
    pub cake_entropy: f64,
    /// CAKE's variance: the unbiased variance across window rows, summed over heads and keys
    /// before the window.
    pub cake_variance: f64,
}

impl LayerProfile {
    /// Computes the profile with the last `window` prompt queries of a global layer.
    pub fn measure(layer: &LayerContext<'_>, window: usize) -> Self {
        Self::measure_windowed(layer, window, 0)
    }

    /// [`LayerProfile::measure`] for a layer whose queries attend over the last `attention_window`
    /// keys only (0: all keys, a global layer): each row is the softmax over the keys that query
    /// attended, and its normalised entropy divides by ln of their count.
    pub fn measure_windowed(
        layer: &LayerContext<'_>,
        window: usize,
        attention_window: usize,
    ) -> Self {
        let first_key = |position: usize| match attention_window {
            0 => 0,
            w => (position + 1).saturating_sub(w),
        };
        let prompt_len = layer.prompt_len;
        let window = window.clamp(1, prompt_len);
        let n_heads = layer.q.shape()[0];
        let group = layer.group_size();
        let before_window = prompt_len - window;
        // Heads on worker threads; their sums are then added in the order of one thread (head by
        // head, row by row), so the profile is the same to the bit whatever the thread count.
        let heads: Vec<HeadSums> = (0..n_heads)
            .into_par_iter()
            .map(|head| {
                let keys = layer.keys(head / group);
                let mut sum = vec![0.0f64; prompt_len];
                let mut sum_sq = vec![0.0f64; prompt_len];
                let mut rows = Vec::with_capacity(window);
                for position in prompt_len - window..prompt_len {
                    let first = first_key(position);
                    let weights = attend(
                        layer.query(head, position),
                        keys.slice(s![first..=position, ..]),
                        layer.scale,
                        layer.softcap,
                    );
                    let row_entropy = entropy(&weights);
                    let attended = position + 1 - first;
                    let normalized = if attended > 1 {
                        row_entropy / (attended as f64).ln()
                    } else {
                        1.0
                    };
                    for (j, &weight) in weights.iter().enumerate() {
                        sum[first + j] += weight as f64;
                        sum_sq[first + j] += (weight as f64).powi(2);
                    }
                    let cake_entropy = weights[..before_window.saturating_sub(first)]
                        .iter()
                        .map(|&w| w as f64 * (w as f64 + 1e-10).ln())
                        .sum::<f64>();
                    rows.push([row_entropy, normalized, cake_entropy]);
                }
                let n_rows = window as f64;
                let variances = sum
                    .iter()
                    .zip(&sum_sq)
                    .map(|(s, sq)| (sq / n_rows - (s / n_rows).powi(2)).max(0.0));
                let variance = variances.clone().sum::<f64>();
                let cake_variance = match window > 1 {
                    true => {
                        Some(variances.take(before_window).sum::<f64>() * n_rows / (n_rows - 1.0))
                    }
                    false => None,
                };
                HeadSums {
                    rows,
                    variance,
                    cake_variance,
                }
            })
            .collect();
        let (mut entropy_total, mut normalized_total, mut variance_total) = (0.0f64, 0.0, 0.0);
        let (mut cake_entropy, mut cake_variance) = (0.0f64, 0.0f64);
        for head in heads {
            for [row_entropy, normalized, row_cake_entropy] in head.rows {
                entropy_total += row_entropy;
                normalized_total += normalized;
                cake_entropy -= row_cake_entropy;
            }
            variance_total += head.variance;
            if let Some(variance) = head.cake_variance {
                cake_variance += variance;
            }
        }
        Self {
            entropy: entropy_total / (n_heads * window) as f64,
            normalized: normalized_total / (n_heads * window) as f64,
            variance: variance_total / n_heads as f64,
            cake_entropy,
            cake_variance,
        }
    }
}

/// One head's share of a [`LayerProfile`]: per window row its entropy, normalised entropy and
/// CAKE's dispersion sum, and its variance sums.
struct HeadSums {
    rows: Vec<[f64; 3]>,
    variance: f64,
    cake_variance: Option<f64>,
}

/// Entropy of one layer's observation-window attention.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerEntropy {
    /// Layer index.
    pub layer: usize,
    /// Mean entropy in nats over query heads and window queries.
    pub entropy: f64,
    /// The same divided by ln(keys attended), 1 = uniform.
    pub normalized: f64,
    /// The layer's attention window (0: global, every key before the query).
    pub window: usize,
}

/// The per-layer entropy of the last `window` prompt queries' causal attention over the prompt,
/// averaged over query heads and queries ([`LayerProfile`], the statistics the data-driven
/// allocators use), for every layer: a sliding-window layer's rows attend over its window.
pub fn entropy_profile(
    trace: &TraceReader,
    window: usize,
) -> Result<Vec<LayerEntropy>, TraceError> {
    let meta = trace.meta();
    (0..meta.n_layers)
        .map(|layer| {
            let tensors = trace.layer(layer)?;
            let attention_window = meta.window(layer);
            let profile = LayerProfile::measure_windowed(
                &context(trace, layer, &tensors),
                window,
                attention_window,
            );
            Ok(LayerEntropy {
                layer,
                entropy: profile.entropy,
                normalized: profile.normalized,
                window: attention_window,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array3;

    fn layer<'a>(q: &'a Array3<f32>, k: &'a Array3<f32>) -> LayerContext<'a> {
        LayerContext {
            layer: 0,
            q: q.view(),
            k: k.view(),
            v: None,
            prompt_len: q.shape()[1],
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            window: 0,
            inputs: None,
            reconstruction: None,
        }
    }

    /// Zero queries attend uniformly: a row over n keys has entropy ln n, normalised 1. With a
    /// window of 2 every row after the first attends 2 keys.
    #[test]
    fn uniform_rows_by_hand() {
        let q = Array3::<f32>::zeros((1, 4, 2));
        let k = Array3::<f32>::from_shape_fn((1, 4, 2), |(_, t, c)| (t + c) as f32);
        let global = LayerProfile::measure(&layer(&q, &k), 2);
        // Rows 2 and 3: ln 3 and ln 4.
        approx::assert_abs_diff_eq!(
            global.entropy,
            (3f64.ln() + 4f64.ln()) / 2.0,
            epsilon = 1e-6
        );
        approx::assert_abs_diff_eq!(global.normalized, 1.0, epsilon = 1e-6);
        let windowed = LayerProfile::measure_windowed(&layer(&q, &k), 2, 2);
        approx::assert_abs_diff_eq!(windowed.entropy, 2f64.ln(), epsilon = 1e-6);
        approx::assert_abs_diff_eq!(windowed.normalized, 1.0, epsilon = 1e-6);
        // Variance: rows put 1/2 on keys 1..=2 and 2..=3: key 2 has variance 0, keys 1 and 3
        // have (1/4 + 0)/2 - (1/4)^2 = 1/16 each.
        approx::assert_abs_diff_eq!(windowed.variance, 0.125, epsilon = 1e-6);
        // A window at least the prompt's length is the global layer.
        assert_eq!(LayerProfile::measure_windowed(&layer(&q, &k), 2, 4), global);
    }
}
