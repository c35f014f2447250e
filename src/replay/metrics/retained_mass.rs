//! `retained_mass`: the full attention's probability mass on the kept positions,
//! `sum_{j in S} p_j` (attention recall; CateKV, arXiv:2504.15864): 1 when nothing of the query's
//! attention was evicted.

use super::{Metric, Sample};

/// The full-attention mass kept.
pub struct RetainedMass;

impl Metric for RetainedMass {
    fn id(&self) -> &'static str {
        super::RETAINED_MASS
    }

    fn title(&self) -> &'static str {
        "retained mass"
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        sample.kept_mass
    }
}
