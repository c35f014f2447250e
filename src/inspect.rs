//! What `kvreplay inspect` reports: a trace's header, spans and sizes, and per layer the
//! attention entropy of the last prompt queries over the prompt, the "pyramidal information
//! funneling" profile of the PyramidKV paper (arXiv:2406.02069, §3): near-uniform attention in
//! early layers, concentrated attention deep in the model.

use crate::attention::{attend, entropy};
use crate::trace::{TraceError, TraceReader};
use ndarray::s;
use serde::Serialize;

/// Entropy of one layer's observation-window attention.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerEntropy {
    /// Layer index.
    pub layer: usize,
    /// Mean entropy in nats over query heads and window queries.
    pub entropy: f64,
    /// The same divided by ln(keys attended), 1 = uniform.
    pub normalized: f64,
}

/// The per-layer entropy of the last `window` prompt queries' causal attention over the prompt,
/// averaged over query heads and queries.
pub fn entropy_profile(
    trace: &TraceReader,
    window: usize,
) -> Result<Vec<LayerEntropy>, TraceError> {
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let window = window.min(prompt_len);
    let mut profile = Vec::with_capacity(meta.n_layers);
    for layer in 0..meta.n_layers {
        let tensors = trace.layer(layer)?;
        let (mut total, mut total_normalized, mut count) = (0.0, 0.0, 0usize);
        for head in 0..meta.n_heads {
            let kv_head = head / meta.group_size();
            for position in prompt_len - window..prompt_len {
                let query = tensors.q.slice(s![head, position, ..]);
                let keys = tensors.k.slice(s![kv_head, ..=position, ..]);
                let weights = attend(query, keys, meta.scale, meta.softcap);
                let value = entropy(&weights);
                total += value;
                if position > 0 {
                    total_normalized += value / ((position + 1) as f64).ln();
                } else {
                    total_normalized += 1.0;
                }
                count += 1;
            }
        }
        profile.push(LayerEntropy {
            layer,
            entropy: total / count as f64,
            normalized: total_normalized / count as f64,
        });
    }
    Ok(profile)
}
