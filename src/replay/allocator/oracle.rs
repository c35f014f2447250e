//! `oracle`: the allocation across layers that maximises retained mass for the chosen scorer at
//! the same total memory, an upper reference for schedules. The engine hands it, per layer, the
//! retained mass (mean over heads and decode steps) as a function of the number of prompt tokens
//! kept in the scorer's own order. Starting every layer at `sinks + window`, tokens are given one
//! at a time to the layer whose curve gains most (ties to the lower layer) until the total is
//! `L * budget`. Greedy marginal allocation is optimal when the curves are concave, which they
//! are to the extent the scorer ranks tokens by their future mass; it needs the future decode
//! queries, so no real policy can implement it. Prefill timing only.

use super::{AllocationInput, Allocator};
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Greedy marginal-gain allocation on the scorer's mass curves.
pub struct Oracle;

#[derive(PartialEq)]
struct Gain {
    gain: f64,
    layer: usize,
}

impl Eq for Gain {}

impl PartialOrd for Gain {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Gain {
    fn cmp(&self, other: &Self) -> Ordering {
        self.gain
            .total_cmp(&other.gain)
            .then_with(|| other.layer.cmp(&self.layer))
    }
}

impl Allocator for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }

    fn needs_mass_curves(&self) -> bool {
        true
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Vec<usize> {
        let curves = input.mass_curves;
        let start = (input.sinks + input.window).min(input.prompt_len);
        let mut budgets = vec![start; curves.len()];
        let mut left = (input.budget * curves.len()).saturating_sub(start * curves.len());
        let gain = |layer: usize, kept: usize| curves[layer][kept + 1] - curves[layer][kept];
        let mut heap: BinaryHeap<Gain> = (0..curves.len())
            .filter(|&l| start < curves[l].len() - 1)
            .map(|layer| Gain {
                gain: gain(layer, start),
                layer,
            })
            .collect();
        while left > 0 {
            let Some(Gain { layer, .. }) = heap.pop() else {
                break;
            };
            budgets[layer] += 1;
            left -= 1;
            if budgets[layer] < curves[layer].len() - 1 {
                heap.push(Gain {
                    gain: gain(layer, budgets[layer]),
                    layer,
                });
            }
        }
        budgets
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
            window: 0,
            sinks: 0,
            profiles: &[],
            mass_curves: &curves,
        };
        assert_eq!(Oracle.allocate(&input), vec![4, 2]);
    }
}
