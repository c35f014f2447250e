//! `cake`: CAKE's layer budgets (Qin et al., ICLR 2025, arXiv:2503.12491; antgroup/cakekv, commit
//! c4675ce2): each layer's preference `pref_l = D_l^(1/tau1) * V_l^(1/tau2)` from the window
//! attention's dispersion D and variance V over the keys before the window
//! ([`crate::replay::LayerProfile`]'s `cake_entropy`, `cake_variance`; `cake/model/modify_llama.py`
//! lines 91-108), and the pool `(budget - W) * L` shared in proportion, truncated and corrected by
//! `adjust_budgets` (`cake/utils.py` lines 21-68) as `CakeprefillKVCache.__call__` does
//! (`cake/cake_cache.py` lines 218-247); each layer keeps its share plus the window. The authors'
//! tau per model and budget is `experiments/LongBench/config/model2tau.json`; for a model it does
//! not list, `pred_cake.py` falls back to its argument defaults, tau1 = tau2 = 1.
//! Deviation: CAKE does not cut a prompt of at most `budget + W` tokens (line 219); its first
//! decode step then evicts every layer down to `budget` by the newest query's attention. Here
//! every layer gets `budget`, cut at the prompt's end by the scorer.

use super::{positive_finite, AllocationInput, Allocator};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;

crate::settings! {
    /// CAKE's layer preference, dispersion x variance of the window attention (Qin et al., ICLR
    /// 2025, arXiv:2503.12491; antgroup/cakekv).
    pub struct Cake = "cake" {
        /// CAKE's dispersion temperature tau1: `pref = D^(1/tau1) * V^(1/tau2)` (1.0, the
        /// `pred_cake.py` default for models `model2tau.json` does not list).
        tau1: f64 = 1.0,
        /// CAKE's variance temperature tau2 (1.0, the same fallback).
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

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let protected = input.protect.tokens();
        let window = input.protect.window;
        if input.prompt_len <= input.budget + window {
            return Ok(vec![input.budget; input.n_layers]);
        }
        let preferences: Vec<f64> = input
            .profiles
            .iter()
            .map(|p| p.cake_entropy.powf(1.0 / self.tau1) * p.cake_variance.powf(1.0 / self.tau2))
            .collect();
        let sum: f64 = preferences.iter().sum();
        let total = (input.budget - protected) * input.n_layers;
        let shares: Vec<f64> = preferences
            .iter()
            .map(|pref| pref / sum * total as f64)
            .collect();
        let cap = input.prompt_len - protected;
        Ok(adjust_budgets(&shares, total, cap)
            .into_iter()
            .map(|budget| budget.min(cap) + protected)
            .collect())
    }
}

/// CAKE's `adjust_budgets` (`cake/utils.py` lines 21-68), line by line: truncate each share, cap
/// it at `cap` and hand the excess to the layers under the cap (evenly, the remainder to the
/// first), then correct the total to `total` the same way (adding to layers under the cap, or
/// taking from layers above 1).
fn adjust_budgets(shares: &[f64], total: usize, cap: usize) -> Vec<usize> {
    let cap = cap as i64;
    let mut budgets: Vec<i64> = shares.iter().map(|&share| share as i64).collect();
    let total_excess: i64 = budgets.iter().map(|&b| (b - cap).max(0)).sum();
    for budget in budgets.iter_mut() {
        *budget = (*budget).min(cap);
    }
    if total_excess > 0 {
        spread(&mut budgets, total_excess, |b| b < cap);
    }
    let diff = total as i64 - budgets.iter().sum::<i64>();
    if diff > 0 {
        spread(&mut budgets, diff, |b| b < cap);
    } else if diff < 0 {
        spread(&mut budgets, diff, |b| b > 1);
    }
    budgets.into_iter().map(|b| b.max(0) as usize).collect()
}

/// Adds `amount` (or takes it, when negative) evenly over the budgets `valid` picks, the remainder
/// one each to the first of them; nothing when none is valid.
fn spread(budgets: &mut [i64], amount: i64, valid: impl Fn(i64) -> bool) {
    let picked: Vec<usize> = (0..budgets.len()).filter(|&i| valid(budgets[i])).collect();
    if picked.is_empty() {
        return;
    }
    let count = picked.len() as i64;
    let (each, remainder) = (amount.abs() / count, amount.abs() % count);
    let sign = amount.signum();
    for (rank, &index) in picked.iter().enumerate() {
        budgets[index] += sign * (each + i64::from((rank as i64) < remainder));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::LayerProfile;

    fn profile(cake_entropy: f64, cake_variance: f64) -> LayerProfile {
        LayerProfile {
            entropy: 0.0,
            normalized: 0.0,
            variance: 0.0,
            cake_entropy,
            cake_variance,
        }
    }

    #[test]
    fn preference_is_dispersion_times_variance() {
        // pref = 2 * 1 and 1 * 1 (tau 1); pool (100 - 8) * 2 = 184 -> shares 122.67 and 61.33,
        // truncated to 122 and 61, the missing 1 to the first layer: 123 + 8, 61 + 8.
        let profiles = [profile(2.0, 1.0), profile(1.0, 1.0)];
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
        let cake = Cake {
            tau1: 1.0,
            tau2: 1.0,
        };
        assert_eq!(cake.allocate(&input), Ok(vec![131, 69]));
        // A prompt no longer than budget + window: every layer gets the budget.
        let short = AllocationInput {
            prompt_len: 108,
            ..input
        };
        assert_eq!(cake.allocate(&short), Ok(vec![100, 100]));
    }

    #[test]
    fn adjust_budgets_by_hand() {
        // cap 50: [80.9, 10.2, 9.9] -> [80, 10, 9]; 30 excess over the two under the cap: +15
        // each -> [50, 25, 24] = 99; 1 missing -> to the first under the cap: [50, 26, 24].
        assert_eq!(
            adjust_budgets(&[80.9, 10.2, 9.9], 100, 50),
            vec![50, 26, 24]
        );
        // Too many: [40.0, 40.0, 40.0] with total 100 -> 20 to take from those above 1:
        // 6 each, the remainder 2 from the first two -> [33, 33, 34].
        assert_eq!(
            adjust_budgets(&[40.0, 40.0, 40.0], 100, 50),
            vec![33, 33, 34]
        );
    }
}
