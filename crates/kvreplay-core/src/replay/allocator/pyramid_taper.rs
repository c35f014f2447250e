//! `pyramid-taper`: the "PyramidKV-adapted" schedule of the VeloxQuant-MLX library (the seed
//! library of docs/policies.md, whose documentation gives this formula):
//!
//! ```text
//! floor = n_sink + 1;  span = (avg - floor) * (beta - 1);  hi = avg + span;  lo = avg - span
//! b_l = hi + (lo - hi) * l / (L - 1)
//! water-fill: raise values below floor to floor, take the excess from the unclamped layers in
//! proportion to (b_l - floor), repeat up to L times;  return max(round(b_l), floor)
//! ```
//! beta is a steepness >= 1 (1 = flat), not PyramidKV's divisor. Deviation, only when a
//! protected window is set (the library has none): the floor is `max(n_sink + 1, n_sink + W)`,
//! so no layer's budget falls below the tokens it must keep. `round` is Python's
//! round-half-to-even, as in the library. With the `key-proxy` scorer and `streaming` timing this
//! is the library's PyramidKV-adapted; with beta = 1 it is its H2O-adapted.

use super::{AllocationInput, Allocator};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;

crate::settings! {
    /// The VeloxQuant-MLX library's "PyramidKV-adapted" schedule: a tapered line around the mean
    /// budget, water-filled above a floor (docs/policies.md).
    pub struct PyramidTaper = "pyramid-taper" {
        /// The library's `pyramid_beta`: a steepness >= 1 (1 = flat), not PyramidKV's divisor.
        beta: f64 = 2.0,
    }
}

impl Allocator for PyramidTaper {
    fn check(&self) -> Result<(), Broken> {
        if !self.beta.is_finite() || self.beta < 1.0 {
            return Err(Broken {
                key: "beta",
                rule: "pyramid-taper's steepness must be a finite number >= 1 (1 = flat)".into(),
            });
        }
        Ok(())
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let floor = (input.protect.sinks + 1).max(input.protect.tokens());
        Ok(taper(input.n_layers, input.budget as f64, floor, self.beta))
    }
}

/// The library's `pyramid_budgets(n_layers, avg_budget, n_sink, beta)`, with its floor
/// `n_sink + 1` passed as `floor`.
pub(crate) fn taper(layers: usize, avg: f64, floor: usize, beta: f64) -> Vec<usize> {
    let floor = floor as f64;
    if layers == 0 {
        return Vec::new();
    }
    if layers == 1 {
        return vec![avg.max(floor).round_ties_even() as usize];
    }
    let span = (avg - floor) * (beta - 1.0);
    let (hi, lo) = (avg + span, avg - span);
    let mut budgets: Vec<f64> = (0..layers)
        .map(|l| hi + (lo - hi) * l as f64 / (layers - 1) as f64)
        .collect();
    for _ in 0..layers {
        let deficit: f64 = budgets
            .iter()
            .filter(|b| **b < floor)
            .map(|b| floor - b)
            .sum();
        if deficit <= 0.0 {
            break;
        }
        let donors: f64 = budgets
            .iter()
            .filter(|b| **b > floor)
            .map(|b| b - floor)
            .sum();
        for budget in budgets.iter_mut() {
            if *budget < floor {
                *budget = floor;
            } else if *budget > floor && donors > 0.0 {
                *budget -= deficit * (*budget - floor) / donors;
            }
        }
    }
    budgets
        .into_iter()
        .map(|b| b.round_ties_even().max(floor) as usize)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_doc_example() {
        // The seed library's doc: 12 layers, avg_budget = 512, beta = 2.0 (n_sink = 4).
        assert_eq!(
            taper(12, 512.0, 5, 2.0),
            vec![1019, 927, 835, 742, 650, 558, 466, 374, 282, 189, 97, 5]
        );
    }

    #[test]
    fn beta_one_is_flat_and_steep_schedules_keep_the_floor_and_mean() {
        assert_eq!(taper(30, 128.0, 5, 1.0), vec![128; 30]);
        let steep = taper(30, 128.0, 5, 3.0);
        assert!(steep.iter().all(|b| *b >= 5));
        let mean = steep.iter().sum::<usize>() as f64 / 30.0;
        assert!((mean - 128.0).abs() < 1.0, "mean {mean}");
        assert!(steep.windows(2).all(|w| w[0] >= w[1]));
    }
}
