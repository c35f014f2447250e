//! `output_error`: the relative error of the attention output, `|o_full - o_kept| / |o_full|`,
//! with `o_full = sum_j p_j v_j` and `o_kept` the same sum over the kept positions renormalised
//! by the kept mass (MagicPIG, arXiv:2410.16179); 1 when nothing of mass is kept. Traces without
//! values leave it out.

use super::{Metric, Sample};
use ndarray::ArrayView2;

/// Relative error of the attention output.
pub struct OutputError;

impl Metric for OutputError {
    fn id(&self) -> &'static str {
        "output_error"
    }

    fn title(&self) -> &'static str {
        "output error"
    }

    fn needs_values(&self) -> bool {
        true
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        let (Some(values), Some(full)) = (sample.values, sample.full_output) else {
            return f64::NAN;
        };
        let full_norm = full.iter().map(|x| x * x).sum::<f64>().sqrt();
        if sample.kept_mass <= 0.0 || full_norm <= 0.0 {
            return 1.0;
        }
        let partial = weighted_sum(sample.kept, sample.weights, values);
        let squared: f64 = full
            .iter()
            .zip(&partial)
            .map(|(f, p)| (f - p / sample.kept_mass).powi(2))
            .sum();
        squared.sqrt() / full_norm
    }
}

/// Per dimension, `Σ weights[j] · values[j]` over `kept` in kept order, in f64: every product and
/// sum rounded as the scalar loop rounds it (separate multiply and add, no fused multiply-add),
/// so the vector code gives the same bits.
fn weighted_sum(kept: &[usize], weights: &[f32], values: ArrayView2<f32>) -> Vec<f64> {
    let d = values.ncols();
    let mut sums = vec![0.0f64; d];
    let rows = values.as_slice().map(|all| (all, d));
    match rows {
        Some((all, d)) => {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx") {
                // SAFETY: the feature was detected just above.
                unsafe { add_rows_avx(kept, weights, all, d, &mut sums) };
                return sums;
            }
            add_rows(kept, weights, all, d, &mut sums);
        }
        None => {
            for &j in kept {
                let weight = weights[j] as f64;
                for (sum, &v) in sums.iter_mut().zip(values.row(j)) {
                    *sum += weight * v as f64;
                }
            }
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn add_rows_avx(kept: &[usize], weights: &[f32], all: &[f32], d: usize, sums: &mut [f64]) {
    add_rows(kept, weights, all, d, sums);
}

#[inline(always)]
fn add_rows(kept: &[usize], weights: &[f32], all: &[f32], d: usize, sums: &mut [f64]) {
    for &j in kept {
        let weight = weights[j] as f64;
        let row = &all[j * d..(j + 1) * d];
        for (sum, &v) in sums.iter_mut().zip(row) {
            *sum += weight * v as f64;
        }
    }
}
