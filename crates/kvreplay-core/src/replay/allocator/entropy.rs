//! `entropy`: budgets from the trace's own attention, the data-driven schedule the PyramidKV paper
//! motivates with funneling (§3) but does not implement. Layer l's weight is `exp(H_l)`, with H_l
//! the mean entropy (nats) of the observation window's attention over the prompt: exp(H) is the
//! perplexity, the effective number of tokens the layer attends to. The total `L * budget` is
//! shared in proportion to the weights, each layer at least `sinks + window` and at most the
//! prompt, by water-filling and largest remainder, so the mean is exactly
//! the nominal budget whenever the prompt can hold it ([`AllocationInput::share_by_weight`]).

use super::{AllocationInput, Allocator};
use crate::replay::MethodFailed;

crate::settings! {
    /// Budgets proportional to each layer's attention perplexity exp(H) over the observation
    /// window (the funneling the PyramidKV paper describes, made data-driven).
    pub struct Entropy = "entropy" {}
}

impl Allocator for Entropy {
    fn needs_profile(&self) -> bool {
        true
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let weights: Vec<f64> = input.profiles.iter().map(|p| p.entropy.exp()).collect();
        Ok(input.share_by_weight(&weights))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::LayerProfile;

    #[test]
    fn broader_layers_get_more() {
        // Entropies ln 3 and ln 1: weights 3 and 1, so (2*100 - 2*8) = 184 splits 138 / 46.
        let profiles = [
            LayerProfile {
                entropy: 3f64.ln(),
                normalized: 0.0,
                variance: 0.0,
                cake_entropy: 0.0,
                cake_variance: 0.0,
            },
            LayerProfile {
                entropy: 0.0,
                normalized: 0.0,
                variance: 0.0,
                cake_entropy: 0.0,
                cake_variance: 0.0,
            },
        ];
        let input = AllocationInput {
            n_layers: 2,
            budget: 100,
            prompt_len: 1000,
            protect: crate::replay::Protection {
                sinks: 0,
                window: 8,
            },
            profiles: &profiles,
            mass_curves: &[],
            n_caches: 1,
            candidates: &[],
            prompt_scores: &[],
        };
        assert_eq!(Entropy {}.allocate(&input), Ok(vec![146, 54]));
    }
}
