//! `retained_mass`: the full attention's probability mass on the kept positions,
//! `sum_{j in S} p_j` (attention recall; CateKV, arXiv:2504.15864): 1 when nothing of the query's
//! attention was evicted.

use super::{Metric, Sample};
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
        "The full causal attention's probability mass on the kept positions, `Σ_kept p_j`: 1 when nothing the query attends to was evicted (attention recall; CateKV, arXiv:2504.15864)."
    }

    fn reference(&self, sample: &reference::Sample<'_>) -> Option<f64> {
        Some(sample.kept().iter().map(|&j| sample.weights()[j]).sum())
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        sample.kept_mass
    }
}
