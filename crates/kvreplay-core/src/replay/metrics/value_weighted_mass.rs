//! `value_weighted_mass`: the full attention's mass on the kept positions with each position
//! weighted by the L1 norm of its value, `sum_{j in S} p_j |v_j|_1 / sum_j p_j |v_j|_1`: the
//! retained mass of VATP's value-aware attention score (Guo et al., arXiv:2406.12335, eq. 3,
//! `a_j * |v_j|_1`), so a kept token counts by what it can add to the output, not by its
//! attention alone. 1 when the full cache's weighted mass is 0. Over a quantized cache each kept
//! position counts with `min(p_j, m·p̂_j)`, as retained mass does. Traces without values leave it
//! out.

use super::{Metric, Sample};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference;

/// The value-weighted full-attention mass kept.
pub struct ValueWeightedMass;

impl Metric for ValueWeightedMass {
    fn id(&self) -> &'static str {
        "value_weighted_mass"
    }

    fn title(&self) -> &'static str {
        "value-weighted mass"
    }

    fn about(&self) -> &'static str {
        "The retained mass with each position weighted by its value's L1 norm, `Σ_kept p_j‖v_j‖₁ / Σ_all p_j‖v_j‖₁` (VATP's value-aware score as a yardstick); needs values."
    }

    fn needs_values(&self) -> bool {
        true
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self, sample: &reference::Sample<'_>) -> Option<f64> {
        Some({
            let p = sample.weights();
            let l1 = |j: usize| sample.value(j).iter().map(|x| x.abs()).sum::<f64>();
            let shared = sample.shared_weights();
            let kept: f64 = sample
                .kept()
                .iter()
                .zip(shared)
                .map(|(&j, w)| w * l1(j))
                .sum();
            kept / (0..p.len()).map(|j| p[j] * l1(j)).sum::<f64>()
        })
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        let (Some(norms), Some(full)) = (sample.value_norms, sample.full_value_mass) else {
            return f64::NAN;
        };
        if full <= 0.0 {
            return 1.0;
        }
        let kept: f64 = sample.shared().map(|(j, p)| p * norms[j]).sum();
        kept / full
    }
}
