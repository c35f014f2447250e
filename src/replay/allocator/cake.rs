//! `cake`: CAKE's layer preference (Qin et al., ICLR 2025, arXiv:2503.12491; antgroup/cakekv):
//! `pref_l = H_l^(1/tau1) * V_l^(1/tau2)`, with H the window attention's entropy and V its
//! summed per-key variance across window rows ([`crate::replay::LayerProfile`]); layer l gets
//! `pref_l / sum(pref) * L * budget`. Deviations: CAKE truncates and hands the remainder out in
//! its cascade; we share by largest remainder with the same floor (`sinks + window`) and cap
//! (the prompt) as `entropy`. CAKE's own token score (mean + gamma * variance) is not a scorer
//! here yet: pair this allocator with any scorer.

use super::{positive_finite, AllocationInput, Allocator};
use crate::replay::settings::Broken;

crate::settings! {
    /// CAKE's layer preference, entropy x variance of the window attention (Qin et al., ICLR
    /// 2025, arXiv:2503.12491; antgroup/cakekv).
    pub struct Cake = "cake" {
        /// CAKE's entropy temperature tau1: `pref = H^(1/tau1) * V^(1/tau2)`.
        tau1: f64 = 1.0,
        /// CAKE's variance temperature tau2.
        tau2: f64 = 1.0,
    }
}

impl Allocator for Cake {
    fn check(&self) -> Result<(), Broken> {
        positive_finite("tau1", self.tau1)?;
        positive_finite("tau2", self.tau2)
    }

    fn needs_profile(&self) -> bool {
        true
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Vec<usize> {
        let weights: Vec<f64> = input
            .profiles
            .iter()
            .map(|p| {
                p.entropy.max(0.0).powf(1.0 / self.tau1) * p.variance.max(0.0).powf(1.0 / self.tau2)
            })
            .collect();
        input.share_by_weight(&weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::LayerProfile;

    #[test]
    fn preference_is_entropy_times_variance() {
        // pref = 2 * 1 = 2 and 1 * 1 = 1 (tau 1): 2*100 - 2*8 = 184 splits 122.67 / 61.33.
        let profiles = [
            LayerProfile {
                entropy: 2.0,
                normalized: 0.0,
                variance: 1.0,
            },
            LayerProfile {
                entropy: 1.0,
                normalized: 0.0,
                variance: 1.0,
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
        };
        assert_eq!(
            Cake {
                tau1: 1.0,
                tau2: 1.0
            }
            .allocate(&input),
            vec![131, 69]
        );
    }
}
