//! What `kvreplay inspect` reports: a trace's header, spans and sizes, and per layer the
//! attention entropy of the last prompt queries over the prompt, the "pyramidal information
//! funneling" profile of the PyramidKV paper (arXiv:2406.02069, §3): near-uniform attention in
//! early layers, concentrated attention deep in the model.

use crate::replay::{context, LayerProfile};
use crate::trace::{TraceError, TraceReader};
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
/// averaged over query heads and queries ([`LayerProfile`], the statistics the data-driven
/// allocators use).
pub fn entropy_profile(
    trace: &TraceReader,
    window: usize,
) -> Result<Vec<LayerEntropy>, TraceError> {
    (0..trace.meta().n_layers)
        .map(|layer| {
            let tensors = trace.layer(layer)?;
            let profile = LayerProfile::measure(&context(trace, layer, &tensors), window);
            Ok(LayerEntropy {
                layer,
                entropy: profile.entropy,
                normalized: profile.normalized,
            })
        })
        .collect()
}
