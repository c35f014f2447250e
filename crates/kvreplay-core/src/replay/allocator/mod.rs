//! Budget allocators: how many tokens each layer's caches may keep. One allocator per file, the
//! file name is the registry key. An allocator never ranks tokens; it may read the trace's own
//! window-attention profile (`entropy`, `cake`) or the scorer's per-layer mass curves (`oracle`),
//! which the engine computes for it when it asks.
//!
//! Budgets count every kept token of a cache, sinks and protected window included (PyramidKV's
//! `max_capacity_prompt`). An allocator gives each layer a budget per cache, or, where it ranks
//! every layer's caches together (`global`), the layer's total over its caches
//! ([`Allocator::gives_totals`]), which they need not divide: a [`LayerBudget`] either way. Each allocator's mean is the nominal budget unless its method's own
//! rule differs (the official PyramidKV rounding overshoots); the replay always reports the real
//! number of tokens kept.

use super::settings::Broken;
use super::{LayerProfile, MethodFailed, Protection};

mod cake;
mod entropy;
mod flat;
mod global;
mod oracle;
mod pyramid;
mod pyramid_kvpress;
mod pyramid_taper;

crate::registry! {
    Allocator:
    flat::Flat,
    pyramid::Pyramid,
    pyramid_kvpress::PyramidKvpress,
    pyramid_taper::PyramidTaper,
    entropy::Entropy,
    cake::Cake,
    oracle::Oracle,
    global::Global,
}

pub use pyramid::Rounding;

/// What an allocator may base its decision on.
#[derive(Debug, Clone)]
pub struct AllocationInput<'a> {
    /// The layers it allocates, in depth order: the trace's global layers (sliding-window layers
    /// keep their window and are not given to allocators), or every layer under `layers = all`
    /// (a sliding layer's profile and mass curve then come from its windowed attention; no
    /// allocator treats it otherwise, and a budget beyond its window keeps the window).
    pub n_layers: usize,
    /// Nominal budget per cache.
    pub budget: usize,
    /// Prompt length n.
    pub prompt_len: usize,
    /// The protected tokens (sinks and the recent window W).
    pub protect: Protection,
    /// Per-layer window-attention profile (when `needs_profile`).
    pub profiles: &'a [LayerProfile],
    /// Per-layer retained mass against kept prompt tokens, index b = b tokens kept
    /// (when `needs_mass_curves`).
    pub mass_curves: &'a [Vec<f64>],
    /// The caches of each layer that keep sets of their own (KV heads, query heads, or one per
    /// layer under `gqa = layer`).
    pub n_caches: usize,
    /// Per layer, the positions a whole cache holds at the prompt's end, ascending (the prompt,
    /// or a sliding-window layer's window; when `needs_prompt_scores`).
    pub candidates: &'a [Vec<usize>],
    /// Per layer and cache, the scorer's score of each of `candidates` at the prompt's end: the
    /// scores a one-shot selection ranks (when `needs_prompt_scores`).
    pub prompt_scores: &'a [Vec<Vec<f32>>],
}

impl AllocationInput<'_> {
    /// The total `L * budget` shared in proportion to `weights`, each layer between the
    /// protected tokens (`sinks + window`) and the prompt ([`distribute`]): the rule of the
    /// data-driven allocators.
    pub fn share_by_weight(&self, weights: &[f64]) -> Vec<usize> {
        distribute(
            weights,
            self.budget * self.n_layers,
            self.protect.tokens(),
            self.prompt_len.max(self.budget),
        )
    }
}

/// A way of splitting the memory among layers.
pub trait Allocator: Send + Sync {
    /// Rules its settings must follow beyond their types.
    fn check(&self) -> Result<(), Broken> {
        Ok(())
    }
    /// Whether it reads queries beyond the current position (an oracle): only such methods may.
    fn reads_future(&self) -> bool {
        false
    }
    /// Whether `allocate` reads `profiles`.
    fn needs_profile(&self) -> bool {
        false
    }
    /// Whether `allocate` reads `mass_curves`.
    fn needs_mass_curves(&self) -> bool {
        false
    }
    /// Whether `allocate` reads `candidates` and `prompt_scores` (then the policy must be
    /// one-shot).
    fn needs_prompt_scores(&self) -> bool {
        false
    }
    /// Whether `allocate`'s budgets are each layer's total over its `n_caches` caches instead of
    /// a budget per cache (a one-shot head split then shares the total).
    fn gives_totals(&self) -> bool {
        false
    }
    /// Per-layer budgets, per cache or ([`gives_totals`](Allocator::gives_totals)) per layer;
    /// only an allocator written outside the library (Python) fails.
    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed>;
}

/// One layer's budget: the tokens its caches keep together. Every allocator but one that ranks
/// all layers' caches together gives totals the caches divide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerBudget {
    total: usize,
    caches: usize,
}

impl LayerBudget {
    /// `per_cache` tokens for each of `caches` caches.
    pub fn uniform(per_cache: usize, caches: usize) -> Self {
        Self {
            total: per_cache * caches,
            caches,
        }
    }

    /// `total` tokens shared by `caches` caches.
    pub fn shared(total: usize, caches: usize) -> Self {
        Self { total, caches }
    }

    /// The tokens the layer's caches keep together.
    pub fn total(self) -> usize {
        self.total
    }

    /// The caches that share it.
    pub fn caches(self) -> usize {
        self.caches
    }

    /// The budget of one cache: the total over the caches, rounded down where they do not divide
    /// it (a one-shot head split gives the rest out; every other timing is given budgets the
    /// caches divide).
    pub fn per_cache(self) -> usize {
        self.total / self.caches.max(1)
    }
}

/// `value` must be a positive finite number.
pub(crate) fn positive_finite(key: &'static str, value: f64) -> Result<(), Broken> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(Broken {
            key,
            rule: "must be a positive finite number".into(),
        })
    }
}

/// Splits `total` tokens among layers in proportion to `weights`, each layer between `floor` and
/// `cap`: every layer starts at `floor`, the rest is shared by weight, layers that would pass
/// `cap` are capped and their excess re-shared among the others (water-filling), and the integer
/// parts are completed by largest remainder (ties to the lower layer). The sum is exactly `total`
/// whenever `floor * L <= total <= cap * L`.
pub(crate) fn distribute(weights: &[f64], total: usize, floor: usize, cap: usize) -> Vec<usize> {
    let n = weights.len();
    let total = total.clamp(floor * n, cap * n);
    let mut share = vec![floor as f64; n];
    let mut capped = vec![false; n];
    let mut remaining = (total - floor * n) as f64;
    for _ in 0..=n {
        let open_weight: f64 = (0..n)
            .filter(|&l| !capped[l])
            .map(|l| weights[l].max(0.0))
            .sum();
        let open: Vec<usize> = (0..n).filter(|&l| !capped[l]).collect();
        if open.is_empty() || remaining <= 0.0 {
            break;
        }
        let mut overflow = 0.0;
        for &l in &open {
            let part = if open_weight > 0.0 {
                remaining * weights[l].max(0.0) / open_weight
            } else {
                remaining / open.len() as f64
            };
            share[l] += part;
            if share[l] > cap as f64 {
                overflow += share[l] - cap as f64;
                share[l] = cap as f64;
                capped[l] = true;
            }
        }
        remaining = overflow;
    }
    let mut budgets: Vec<usize> = share.iter().map(|s| s.floor() as usize).collect();
    let mut left = total.saturating_sub(budgets.iter().sum());
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        (share[b] - share[b].floor())
            .total_cmp(&(share[a] - share[a].floor()))
            .then(a.cmp(&b))
    });
    for &l in order.iter().cycle().take(n * 2) {
        if left == 0 {
            break;
        }
        if budgets[l] < cap {
            budgets[l] += 1;
            left -= 1;
        }
    }
    budgets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distribute_hits_total_and_bounds() {
        let budgets = distribute(&[1.0, 1.0, 2.0], 100, 10, 1000);
        assert_eq!(budgets.iter().sum::<usize>(), 100);
        // 70 shared 1:1:2 on top of 10 each: 27.5, 27.5, 45 -> remainders give the .5s out.
        assert_eq!(budgets, vec![28, 27, 45]);
        let capped = distribute(&[10.0, 1.0, 1.0], 90, 5, 40);
        assert_eq!(capped.iter().sum::<usize>(), 90);
        assert_eq!(capped[0], 40);
        assert!(capped.iter().all(|b| (5..=40).contains(b)));
    }
}
