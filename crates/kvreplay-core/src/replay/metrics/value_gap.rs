//! `value_gap`: the distance between the discarded and the kept values' attention-weighted means,
//! relative to the full output, `|mean_d - mean_k| / |o_full|` with `mean_k = sum_{j in S} p_j v_j
//! / m`, `mean_d = sum_{j not in S} p_j v_j / (1 - m)` and `m` the retained mass: the second
//! factor of the output error's decomposition (arXiv:2512.07647, §3: the error of a kept set is
//! the discarded mass times how far the discarded values sit from the kept ones), since
//! `o_full - mean_k = (1 - m)(mean_d - mean_k)`, so per sample
//! `output_error = (1 - retained_mass) * value_gap`. A policy can lose output by dropping mass or
//! by dropping the values unlike what it keeps; the two columns tell which.
//!
//! The discarded mass is the full mass less the kept one and the discarded output `o_full` less
//! the kept share, all in f64 from exact products of the f32 weights and values, so the mean of
//! the discarded values keeps its digits when little is discarded. 0 when less than 1e-9 of the
//! mass is discarded (the mean of nothing; the product is then 0, as the output error); 1 when
//! nothing of mass is kept, as the output error. Over a quantized cache, where the output error is
//! not made of discarded positions alone, it is defined by the same product: the output error
//! over one minus the retained mass (`Σ_kept min(p_j, m·p̂_j)`), 0 when less than 1e-9 of the mass
//! is lost. Traces without values leave it out.

use super::{Metric, Sample};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference;

/// Discarded mass below which nothing counts as discarded.
const NOTHING_DISCARDED: f64 = 1e-9;

/// Relative distance between the discarded and the kept value means.
pub struct ValueGap;

impl Metric for ValueGap {
    fn id(&self) -> &'static str {
        "value_gap"
    }

    fn title(&self) -> &'static str {
        "value gap"
    }

    fn about(&self) -> &'static str {
        "The distance between the attention-weighted means of the discarded and the kept values over `|o_full|`: per sample, output error = (1 − retained mass) × value gap; needs values."
    }

    fn needs_values(&self) -> bool {
        true
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self, sample: &reference::Sample<'_>) -> Option<f64> {
        if !sample.is_captured() {
            let lost = 1.0 - sample.shared_mass();
            return Some(match lost < NOTHING_DISCARDED {
                true => 0.0,
                false => super::output_error::OutputError.reference(sample)? / lost,
            });
        }
        Some({
            let discarded = sample.discarded();
            let p = sample.weights();
            if discarded.iter().map(|&j| p[j]).sum::<f64>() < 1e-9 {
                return Some(0.0);
            }
            let full = sample.full_output();
            let norm = reference::distance(&full, &vec![0.0; full.len()]);
            let (rest, kept) = (
                sample.mean_value(&discarded),
                sample.mean_value(sample.kept()),
            );
            reference::distance(&rest, &kept) / norm
        })
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        let (Some(partial), Some(full)) = (sample.kept_output, sample.full_output) else {
            return f64::NAN;
        };
        if sample.policy.is_some() {
            let lost = 1.0 - sample.retained();
            return match lost < NOTHING_DISCARDED {
                true => 0.0,
                false => super::output_error::OutputError.sample(sample) / lost,
            };
        }
        let kept = sample.kept_mass;
        let discarded = sample.total_mass - kept;
        let full_norm = full.iter().map(|x| x * x).sum::<f64>().sqrt();
        if kept <= 0.0 || full_norm <= 0.0 {
            return 1.0;
        }
        if discarded < NOTHING_DISCARDED {
            return 0.0;
        }
        let squared: f64 = full
            .iter()
            .zip(partial)
            .map(|(f, p)| ((f - p) / discarded - p / kept).powi(2))
            .sum();
        squared.sqrt() / full_norm
    }
}

#[cfg(test)]
mod tests {
    use super::super::output_error::OutputError;
    use super::*;
    use ndarray::Array1;

    fn sample<'a>(
        weights: &'a [f32],
        kept: &'a [usize],
        values: &[[f64; 2]],
        partial: &'a mut Vec<f64>,
        full: &'a Array1<f64>,
    ) -> Sample<'a> {
        partial.clear();
        partial.extend((0..2).map(|x| {
            kept.iter()
                .map(|&j| weights[j] as f64 * values[j][x])
                .sum::<f64>()
        }));
        Sample {
            weights,
            kept,
            top_k: 1,
            top_kept: 0,
            kept_mass: kept.iter().map(|&j| weights[j] as f64).sum(),
            kept_output: Some(partial),
            full_output: Some(full.view()),
            value_norms: None,
            full_value_mass: None,
            total_mass: 1.0,
            policy: None,
        }
    }

    /// p = [0.5, 0.25, 0.25], values (1, 0), (0, 1), (0, 3); keep {0}. o_full = (0.5, 1.0),
    /// |o_full| = sqrt(1.25); kept mean (1, 0), discarded mean (0, 2): gap = sqrt(1 + 4) /
    /// sqrt(1.25) = 2; output error = |(0.5, 1.0) - (1, 0)| / sqrt(1.25) = 1 = (1 - 0.5) * 2.
    #[test]
    fn by_hand_and_the_product_is_the_output_error() {
        let weights = [0.5f32, 0.25, 0.25];
        let values = [[1.0, 0.0], [0.0, 1.0], [0.0, 3.0]];
        let full = Array1::from(vec![0.5, 1.0]);
        let mut partial = Vec::new();
        let s = sample(&weights, &[0], &values, &mut partial, &full);
        approx::assert_abs_diff_eq!(ValueGap.sample(&s), 2.0, epsilon = 1e-12);
        approx::assert_abs_diff_eq!(OutputError.sample(&s), 1.0, epsilon = 1e-12);
        // Everything kept: nothing discarded, gap 0 like the error.
        let mut partial = Vec::new();
        let s = sample(&weights, &[0, 1, 2], &values, &mut partial, &full);
        assert_eq!(ValueGap.sample(&s), 0.0);
        approx::assert_abs_diff_eq!(OutputError.sample(&s), 0.0, epsilon = 1e-12);
    }
}
