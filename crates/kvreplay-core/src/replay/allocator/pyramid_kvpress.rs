//! `pyramid-kvpress`: kvpress's adaptation of PyramidKV's schedule (`PyramidKVPress.get_layer_budget`,
//! kvpress 0.5.5 `kvpress/presses/pyramidkv_press.py` lines 47-86; docs/policies.md). With `B`
//! the budget (kvpress's `q_len * (1 - compression_ratio)`), `W` the protected window (the
//! press's `window_size`), `n` the prompt and `L` the layers:
//!
//! ```text
//! cap = W + B;  min = (cap - W) / beta;  max = 2 (cap - W) - min
//! if max >= n - W: max = n - W; min = 2 (cap - W) - max
//! unless n >= max >= min >= W: every layer max(1, round(B))
//! steps = (max - min) / (L - 1);   layer l keeps round(max - l * steps) tokens, window included
//! ```
//! Real division and Python's round-half-to-even, where KVCache-Factory's `pyramid` floors and
//! adds the window on top. Its fallback differs too: `min >= W` fails unless `B >= beta * W`
//! (1,280 tokens at beta 20 and window 64), so at smaller budgets kvpress's PyramidKV keeps the
//! same number of tokens in every layer.

use super::{positive_finite, AllocationInput, Allocator};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;

crate::settings! {
    /// kvpress's PyramidKV schedule (`PyramidKVPress.get_layer_budget`, kvpress 0.5.5
    /// `pyramidkv_press.py` lines 47-86): the line from `2B - B/beta` down to `B/beta`, window
    /// included, flat unless `B >= beta * W`.
    pub struct PyramidKvpress = "pyramid-kvpress" {
        /// The divisor beta (`PyramidKVPress.beta`, 20): the last layer keeps `B / beta` tokens.
        beta: f64 = 20.0,
    }
}

impl Allocator for PyramidKvpress {
    fn check(&self) -> Result<(), Broken> {
        positive_finite("beta", self.beta)
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let budget = input.budget as f64;
        let window = input.protect.window as f64;
        let n = input.prompt_len as f64;
        let layers = input.n_layers;
        let mut min = budget / self.beta;
        let mut max = 2.0 * budget - min;
        if max >= n - window {
            max = n - window;
            min = 2.0 * budget - max;
        }
        if !(n >= max && max >= min && min >= window) {
            return Ok(vec![input.budget.max(1); layers]);
        }
        let steps = if layers > 1 {
            (max - min) / (layers - 1) as f64
        } else {
            0.0
        };
        Ok((0..layers)
            .map(|l| (max - l as f64 * steps).round_ties_even() as usize)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(budget: usize, window: usize, n: usize, layers: usize) -> Vec<usize> {
        with_beta(20.0, budget, window, n, layers)
    }

    fn with_beta(beta: f64, budget: usize, window: usize, n: usize, layers: usize) -> Vec<usize> {
        let input = AllocationInput {
            n_layers: layers,
            budget,
            prompt_len: n,
            protect: crate::replay::Protection { sinks: 0, window },
            profiles: &[],
            mass_curves: &[],
            n_caches: 1,
            candidates: &[],
            prompt_scores: &[],
        };
        PyramidKvpress { beta }
            .allocate(&input)
            .expect("the library's allocators do not fail")
    }

    #[test]
    fn the_line_by_hand() {
        // B = 2000, W = 64, n = 8000, L = 30: min = 100, max = 3900, steps = 3800 / 29 =
        // 131.03...: layer 0 keeps 3900, layer 1 round(3768.97) = 3769, layer 29 keeps 100.
        let budgets = schedule(2000, 64, 8000, 30);
        assert_eq!((budgets[0], budgets[1], budgets[29]), (3900, 3769, 100));
        assert_eq!(budgets.iter().sum::<usize>(), 60_000);
        // max capped at n - W: B = 3000, n = 5000: max = 4936, min = 1064.
        let capped = schedule(3000, 64, 5000, 5);
        assert_eq!(capped, vec![4936, 3968, 3000, 2032, 1064]);
    }

    #[test]
    fn below_beta_times_the_window_it_is_flat() {
        // min = B / 20 < W = 64 unless B >= 1280: kvpress keeps B in every layer.
        assert_eq!(schedule(1279, 64, 8000, 4), vec![1279; 4]);
        assert_eq!(schedule(128, 64, 600, 30), vec![128; 30]);
        assert_ne!(schedule(1280, 64, 8000, 4), vec![1280; 4]);
    }

    #[test]
    fn halves_round_to_even() {
        // beta 4, B = 10, W = 0, n = 100, L = 2: min 2.5, max 17.5; Python's round gives 18, 2.
        assert_eq!(with_beta(4.0, 10, 0, 100, 2), vec![18, 2]);
        // L = 4: steps 5: 17.5, 12.5, 7.5, 2.5 round to 18, 12, 8, 2.
        assert_eq!(with_beta(4.0, 10, 0, 100, 4), vec![18, 12, 8, 2]);
    }
}
