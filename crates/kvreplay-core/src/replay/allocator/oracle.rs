//! `oracle`: the allocation across layers that maximises retained mass for the chosen scorer at
//! the same total memory, an upper reference for schedules. The engine hands it, per layer, the
//! retained mass (mean over heads and decode steps) as a function of the number of prompt tokens
//! kept in the scorer's own order. The curves are not concave (a sink token ranked late makes one
//! step worth more than the steps before it), so a token-by-token greedy can starve a layer; we
//! take each curve's upper concave envelope, starting from `sinks + window`, and hand out its
//! segments in decreasing order of slope (ties to the lower layer) until the total is
//! `L * budget`. That is optimal for the envelopes, and exact on the curves at every envelope
//! vertex; only the last, partly given segment can fall short of the envelope. It needs the
//! future decode queries, so no real policy can implement it. Prefill timing only.

use super::{AllocationInput, Allocator};
use crate::replay::MethodFailed;

crate::settings! {
    /// The allocation across layers that maximises retained mass for the chosen scorer at the
    /// same total memory (it sees the future decode queries: a reference, not a policy).
    pub struct Oracle = "oracle" {}
}

/// The vertices `(kept, mass)` of the upper concave envelope of `curve[start..]`.
fn upper_envelope(curve: &[f64], start: usize) -> Vec<(usize, f64)> {
    let mut hull: Vec<(usize, f64)> = Vec::new();
    for (x, &y) in curve.iter().enumerate().skip(start) {
        while hull.len() >= 2 {
            let (x1, y1) = hull[hull.len() - 2];
            let (x2, y2) = hull[hull.len() - 1];
            // Drop the middle point when it lies on or below the chord from (x1, y1) to (x, y).
            if (y2 - y1) * (x - x1) as f64 <= (y - y1) * (x2 - x1) as f64 {
                hull.pop();
            } else {
                break;
            }
        }
        hull.push((x, y));
    }
    hull
}

impl Allocator for Oracle {
    fn reads_future(&self) -> bool {
        true
    }

    fn needs_mass_curves(&self) -> bool {
        true
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let curves = input.mass_curves;
        let start = input.protect.tokens().min(input.prompt_len);
        let mut budgets = vec![start; curves.len()];
        let mut left = (input.budget * curves.len()).saturating_sub(start * curves.len());
        let mut segments: Vec<(f64, usize, usize)> = Vec::new();
        for (layer, curve) in curves.iter().enumerate() {
            for pair in upper_envelope(curve, start).windows(2) {
                let ((x0, y0), (x1, y1)) = (pair[0], pair[1]);
                segments.push(((y1 - y0) / (x1 - x0) as f64, layer, x1 - x0));
            }
        }
        segments.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for (_, layer, length) in segments {
            if left == 0 {
                break;
            }
            let given = length.min(left);
            budgets[layer] += given;
            left -= given;
        }
        Ok(budgets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_tokens_where_they_gain_most() {
        // Layer 0 gains 0.1 per token, layer 1 gains 0.3 for 2 tokens then nothing.
        let curves = vec![
            (0..=10).map(|b| 0.1 * b as f64).collect::<Vec<_>>(),
            vec![0.0, 0.3, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6],
        ];
        let input = AllocationInput {
            n_layers: 2,
            budget: 3,
            prompt_len: 10,
            protect: crate::replay::Protection {
                sinks: 0,
                window: 0,
            },
            profiles: &[],
            mass_curves: &curves,
            n_caches: 1,
            candidates: &[],
            prompt_scores: &[],
        };
        assert_eq!(Oracle {}.allocate(&input), Ok(vec![4, 2]));
    }

    #[test]
    fn looks_past_a_flat_start() {
        // Layer 1 gains nothing for its first token, then 0.5 at once (a late sink): greedy
        // token by token would give everything to layer 0 (0.1 per token); the envelope sees
        // 0.25 per token over two tokens and gives layer 1 its two.
        let curves = vec![
            (0..=10).map(|b| 0.1 * b as f64).collect::<Vec<_>>(),
            vec![0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
        ];
        let input = AllocationInput {
            n_layers: 2,
            budget: 2,
            prompt_len: 10,
            protect: crate::replay::Protection {
                sinks: 0,
                window: 0,
            },
            profiles: &[],
            mass_curves: &curves,
            n_caches: 1,
            candidates: &[],
            prompt_scores: &[],
        };
        assert_eq!(Oracle {}.allocate(&input), Ok(vec![2, 2]));
        assert_eq!(
            upper_envelope(&curves[1], 0),
            vec![(0, 0.0), (2, 0.5), (10, 0.5)]
        );
    }
}
