//! The attention a query pays over a cache that stores its kept entries otherwise than captured
//! (quantized or with pruned key channels, [`crate::replay::Storage`]): the softmax over the kept positions of the logits
//! against the keys as held, and the output from the values as held, both in f64. Metrics compare
//! it with the full model's attention; for a cache that only evicts, it is the full attention
//! renormalised over the kept positions, which the plain path measures without computing it.

use crate::attention::softmax_f64;
use crate::replay::HeldCache;
use crate::replay::LayerContext;

/// A query's attention over a cache that stores its entries otherwise than captured: weights over the kept positions (kept order) and,
/// when the trace has values, the output.
#[derive(Debug, Clone, Default)]
pub struct PolicyAttention {
    /// `p̂_j`, in kept order.
    pub weights: Vec<f64>,
    /// `Σ_j p̂_j v̂_j`, when the trace has values.
    pub output: Option<Vec<f64>>,
}

impl PolicyAttention {
    /// Query head `head` at `position` over `kept` as `cache` holds them, with the layer's scale
    /// and soft-cap.
    pub fn new(
        layer: &LayerContext<'_>,
        head: usize,
        position: usize,
        kept: &[usize],
        cache: &HeldCache<'_>,
    ) -> Self {
        let query = layer.query(head, position);
        let keys = cache.keys();
        let scale = layer.scale as f64;
        let logits: Vec<f64> = kept
            .iter()
            .map(|&j| {
                let dot: f64 = keys
                    .row(j)
                    .iter()
                    .zip(query.iter())
                    .map(|(&k, &q)| k as f64 * q as f64)
                    .sum();
                let logit = dot * scale;
                match layer.softcap {
                    Some(cap) => cap as f64 * (logit / cap as f64).tanh(),
                    None => logit,
                }
            })
            .collect();
        let weights = softmax_f64(&logits);
        let output = cache.values().map(|values| {
            let mut output = vec![0.0f64; values.ncols()];
            for (&j, &w) in kept.iter().zip(&weights) {
                for (out, &v) in output.iter_mut().zip(values.row(j).iter()) {
                    *out += w * v as f64;
                }
            }
            output
        });
        Self { weights, output }
    }
}
