//! `output_error`: the relative error of the attention output, `|o_full - o_kept| / |o_full|`,
//! with `o_full = sum_j p_j v_j` and `o_kept` the same sum over the kept positions renormalised
//! by the kept mass (MagicPIG, arXiv:2410.16179); 1 when nothing of mass is kept. Over a
//! quantized cache `o_kept` is the cache's own output, `Σ_kept p̂_j v̂_j`, from the keys and values
//! as held. Traces without values leave it out.

use super::{Metric, Sample};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference;

/// Relative error of the attention output.
pub struct OutputError;

impl Metric for OutputError {
    fn id(&self) -> &'static str {
        "output_error"
    }

    fn title(&self) -> &'static str {
        "output error"
    }

    fn about(&self) -> &'static str {
        "`|o_full − o_kept| / |o_full|`, with `o_kept` the attention output renormalised over the kept keys (over a quantized cache, its own output from the keys and values as held); needs values."
    }

    fn needs_values(&self) -> bool {
        true
    }

    fn lower_is_better(&self) -> bool {
        true
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self, sample: &reference::Sample<'_>) -> Option<f64> {
        Some({
            let full = sample.full_output();
            let norm = reference::distance(&full, &vec![0.0; full.len()]);
            reference::distance(&full, &sample.cache_output()) / norm
        })
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        let (Some(partial), Some(full)) = (sample.kept_output, sample.full_output) else {
            return f64::NAN;
        };
        let full_norm = full.iter().map(|x| x * x).sum::<f64>().sqrt();
        if let Some(output) = sample.policy.and_then(|policy| policy.output.as_deref()) {
            return match full_norm > 0.0 {
                true => euclidean(full.as_slice().expect("a row"), output) / full_norm,
                false => 1.0,
            };
        }
        if sample.kept_mass <= 0.0 || full_norm <= 0.0 {
            return 1.0;
        }
        let squared: f64 = full
            .iter()
            .zip(partial)
            .map(|(f, p)| (f - p / sample.kept_mass).powi(2))
            .sum();
        squared.sqrt() / full_norm
    }
}

/// The Euclidean distance between two outputs.
fn euclidean(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f64>()
        .sqrt()
}
