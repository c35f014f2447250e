//! `adakv`: AdaKV's head-wise budgets (Feng et al., 2024, arXiv:2407.11550; FFY0/AdaKV, the same
//! rule as KVCache-Factory's `AdaKVCluster`, `pyramidkv/pyramidkv_utils.py` lines 1041-1053):
//! with `B = cap - protected` and floor `F = int(B * alpha)`, the top `H * B` scores of all caches
//! together are counted per cache (`cnt_h`), and cache h gets `round(cnt_h * (1 - alpha) + F)`
//! plus the protected tokens. With `normalize` (KVCache-Factory's default, lines 1043-1045) each
//! cache's scores are first multiplied by the share of its score mass its own top B hold. Protected
//! positions (sinks, window) do not compete. Ties: higher score first, then the lower cache (the
//! lower flat index of the official code's `topk` over caches' sorted scores), then the lower
//! position. torch.round rounds half to even, and so does this.

use super::HeadSplit;
use crate::replay::allocator::LayerBudget;
use crate::replay::settings::Broken;
use crate::replay::{LayerContext, Protection};

crate::settings! {
    /// AdaKV's head-wise budgets: a cache's share follows how many of the layer's top scores it
    /// holds, above a guaranteed floor (Feng et al., 2024, arXiv:2407.11550).
    pub struct AdaKv = "adakv" {
        /// The floor: the share of each cache's budget guaranteed to it (`floor_ratio`, 0.2 in
        /// KVCache-Factory's `init_adakv`, `pyramidkv_utils.py` line 1421).
        alpha: f64 = 0.2,
        /// Weight each cache's scores by the share of its score mass its top `B` hold before they
        /// compete (`normalize`, True in KVCache-Factory's `init_adakv`, line 1423).
        normalize: bool = true,
    }
}

impl HeadSplit for AdaKv {
    fn check(&self) -> Result<(), Broken> {
        Broken::unless_share("alpha", self.alpha, None)
    }

    fn needs_scores(&self) -> bool {
        true
    }

    fn split(
        &self,
        _layer: &LayerContext<'_>,
        budget: LayerBudget,
        scores: &[Vec<f32>],
        candidates: &[usize],
        protect: Protection,
    ) -> Vec<usize> {
        let prompt_len = candidates.last().map_or(0, |&last| last + 1);
        let protected = protect.tokens();
        let selectable = budget.per_cache().saturating_sub(protected);
        let competing_total = budget.total().saturating_sub(protected * budget.caches());
        let floor = (selectable as f64 * self.alpha) as usize;
        let competing = |unit_scores: &[f32]| -> Vec<(usize, f32)> {
            let mut entries: Vec<(usize, f32)> = candidates
                .iter()
                .copied()
                .zip(unit_scores.iter().copied())
                .filter(|(position, _)| !protect.covers(*position, prompt_len))
                .collect();
            if self.normalize {
                let weight = top_share(&entries, selectable);
                for entry in entries.iter_mut() {
                    entry.1 *= weight;
                }
            }
            entries
        };
        let mut all: Vec<(f32, usize, usize)> = scores
            .iter()
            .enumerate()
            .flat_map(|(unit, unit_scores)| {
                competing(unit_scores)
                    .into_iter()
                    .map(move |(position, score)| (score, unit, position))
            })
            .collect();
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut counts = vec![0usize; scores.len()];
        for (_, unit, _) in all.iter().take(competing_total) {
            counts[*unit] += 1;
        }
        counts
            .into_iter()
            .map(|count| {
                (count as f64 * (1.0 - self.alpha) + floor as f64).round_ties_even() as usize
                    + protected
            })
            .collect()
    }
}

/// The share of a cache's score mass its `top` best scores hold (`ratio_weight`), both sums in
/// f32 as the official code computes them.
fn top_share(entries: &[(usize, f32)], top: usize) -> f32 {
    let mut sorted: Vec<f32> = entries.iter().map(|entry| entry.1).collect();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let total: f32 = sorted.iter().sum();
    let kept: f32 = sorted.iter().take(top).sum();
    kept / total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adakv_by_hand() {
        // Two caches, prompt 6, no protection, cap 3, alpha 0.2: B = 3, F = 0. The top 6 of all
        // scores: cache 0 has 4 of them (0.9, 0.8, 0.7, 0.6), cache 1 has 2 (0.95, 0.5).
        // cap_0 = round(4 * 0.8) = 3, cap_1 = round(2 * 0.8) = 2 (1.6).
        let scores = vec![
            vec![0.9, 0.8, 0.7, 0.6, 0.1, 0.0],
            vec![0.95, 0.5, 0.2, 0.3, 0.05, 0.0],
        ];
        let none = Protection::default();
        let (q, k) = (
            ndarray::Array3::zeros((2, 6, 2)),
            ndarray::Array3::zeros((2, 6, 2)),
        );
        let layer = crate::replay::scorer::testing::context(&q, &k, 6);
        let plain = |alpha| AdaKv {
            alpha,
            normalize: false,
        };
        assert_eq!(
            plain(0.2).split(
                &layer,
                LayerBudget::uniform(3, 2),
                &scores,
                &[0, 1, 2, 3, 4, 5],
                none
            ),
            vec![3, 2]
        );
        // With alpha 1 every cache gets exactly the floor: B.
        assert_eq!(
            plain(1.0).split(
                &layer,
                LayerBudget::uniform(3, 2),
                &scores,
                &[0, 1, 2, 3, 4, 5],
                none
            ),
            vec![3, 3]
        );
    }

    #[test]
    fn normalize_weights_by_the_top_share() {
        // cap 1, alpha 0, no protection: B = 1, the top 2 scores of both caches compete.
        // Cache 0 [0.4, 0.4, 0.2, 0.0]: its top 1 holds 0.4 of 1.0 -> [0.16, 0.16, 0.08, 0].
        // Cache 1 [0.3, 0, 0, 0]: its top 1 holds all of it -> unchanged.
        // Normalised, the top 2 are 0.3 (cache 1) and 0.16 (cache 0): caps [1, 1].
        // Unnormalised they are 0.4 and 0.4, both cache 0: caps [2, 0].
        let scores = vec![vec![0.4, 0.4, 0.2, 0.0], vec![0.3, 0.0, 0.0, 0.0]];
        let (q, k) = (
            ndarray::Array3::zeros((2, 4, 2)),
            ndarray::Array3::zeros((2, 4, 2)),
        );
        let layer = crate::replay::scorer::testing::context(&q, &k, 4);
        let split = |normalize| {
            AdaKv {
                alpha: 0.0,
                normalize,
            }
            .split(
                &layer,
                LayerBudget::uniform(1, 2),
                &scores,
                &[0, 1, 2, 3],
                Protection::default(),
            )
        };
        assert_eq!(split(true), vec![1, 1]);
        assert_eq!(split(false), vec![2, 0]);
    }
}
