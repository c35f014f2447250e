//! `retained_mass`: the full attention's probability mass on the kept positions,
//! `sum_{j in S} p_j` (attention recall; CateKV, arXiv:2504.15864): 1 when nothing of the query's
//! attention was evicted. Over a quantized cache, whose attention `p̂` over the kept positions is
//! not the full one renormalised, it is `Σ_{j in S} min(p_j, m·p̂_j)` with `m = Σ_{j in S} p_j`:
//! the same number for a cache that only evicts (`m·p̂_j = p_j`), one minus the total-variation
//! distance between `p` and `p̂` for a cache that keeps every position, and below `m` wherever
//! quantization moves the kept weights.

use super::{Metric, Sample};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference;

/// The full-attention mass kept.
pub struct RetainedMass;

impl Metric for RetainedMass {
    fn id(&self) -> &'static str {
        super::RETAINED_MASS
    }

    fn title(&self) -> &'static str {
        "retained mass"
    }

    fn about(&self) -> &'static str {
        "The full causal attention's probability mass on the kept positions, `Σ_kept p_j`: 1 when nothing the query attends to was evicted (attention recall; CateKV, arXiv:2504.15864). Over a quantized cache, `Σ_kept min(p_j, m·p̂_j)` with `p̂` its own attention and `m` the kept mass: one minus their total-variation distance when every position is kept."
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self, sample: &reference::Sample<'_>) -> Option<f64> {
        Some(sample.shared_mass())
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        sample.retained()
    }
}
