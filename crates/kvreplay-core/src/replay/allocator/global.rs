//! `global`: one top-k over every compressed layer's caches, the layer budgets of kvpress 0.5.5's
//! `KVzipPress` under its default `layerwise = False` (`kvpress/presses/kvzip_press.py`,
//! `compress_post` lines 384-387: the `int(numel * ratio)` lowest scores of all layers are pruned,
//! counted per layer) and of DefensiveKV's global press (github.com/FFY0/DefensiveKV, commit
//! c278cd0, `kvpress/presses/efficient_ada_global_scorer_press.py`,
//! `EfficientAdaGlobalScorerPress.compress`: the top `int(n * (1 - ratio) * kv_heads * layers)` of
//! the stacked scores, counted per layer; its Layer-DefensiveKV scores its window and stage 1 at
//! the layer's largest score, where the `defensivekv` scorer ranks them above everything, so that
//! pair is not replayed exactly).
//! Every cache's scores at the prompt's end compete together, each layer's total is the number of
//! its entries among the best `L * caches * (budget - protected)`, plus its caches' protected
//! tokens (the sinks and window, which the official codes score above everything). A one-shot head
//! split then shares the total among the layer's caches: `heads = adakv`, `alpha = 0`,
//! `normalize = false` keeps exactly the global top-k (both codes' second step, a top-k over the
//! layer's flattened scores), `uniform` spreads it evenly.
//!
//! Scores of different layers compete as they are, so the rule means what the scorer's scale
//! means across layers (attention weights for KVzip and DefensiveKV). Ties: the higher score, then
//! the lower layer, cache and position (the official codes' `topk` leaves them unspecified).

use super::{AllocationInput, Allocator};
use crate::replay::MethodFailed;

crate::settings! {
    /// One top-k over every compressed layer's caches: a layer keeps what its caches' prompt
    /// scores win against every other layer's (kvpress `KVzipPress(layerwise=False)`). Prefill
    /// timing; pair with `heads = adakv`, `alpha = 0`, `normalize = false`.
    pub struct Global = "global" {}
}

impl Allocator for Global {
    fn needs_prompt_scores(&self) -> bool {
        true
    }

    fn gives_totals(&self) -> bool {
        true
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let protected = input.protect.tokens();
        let mut entries: Vec<(f32, usize)> = Vec::new();
        for (layer, (candidates, caches)) in
            input.candidates.iter().zip(input.prompt_scores).enumerate()
        {
            let prompt_len = candidates.last().map_or(0, |&last| last + 1);
            for scores in caches {
                entries.extend(
                    candidates
                        .iter()
                        .zip(scores)
                        .filter(|(&position, _)| !input.protect.covers(position, prompt_len))
                        .map(|(_, &score)| (score, layer)),
                );
            }
        }
        let selectable = input.n_layers * input.n_caches * input.budget.saturating_sub(protected);
        let winners = selectable.min(entries.len());
        if winners > 0 && winners < entries.len() {
            // Entries were pushed by layer, cache and position, so a stable order by score keeps
            // ties in that order.
            entries.sort_by(|a, b| b.0.total_cmp(&a.0));
        }
        let mut totals = vec![protected * input.n_caches; input.n_layers];
        for &(_, layer) in &entries[..winners] {
            totals[layer] += 1;
        }
        Ok(totals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::Protection;

    fn allocate(scores: &[Vec<Vec<f32>>], budget: usize, protect: Protection) -> Vec<usize> {
        let candidates: Vec<Vec<usize>> =
            scores.iter().map(|l| (0..l[0].len()).collect()).collect();
        Global {}
            .allocate(&AllocationInput {
                n_layers: scores.len(),
                budget,
                prompt_len: candidates[0].len(),
                protect,
                profiles: &[],
                mass_curves: &[],
                n_caches: scores[0].len(),
                candidates: &candidates,
                prompt_scores: scores,
            })
            .unwrap()
    }

    #[test]
    fn layers_keep_what_they_win_against_every_other_layer() {
        // Two layers of two caches, five positions, budget 2 per cache: the best 8 of 20 scores.
        // Layer 0 holds 0.9, 0.8, 0.7 (cache 0) and 0.6, 0.55 (cache 1); layer 1 holds 0.5, 0.45
        // (cache 0) and 0.4 (cache 1): 5 + 3. Its 0.3 and 0.35 lose.
        let scores = vec![
            vec![
                vec![0.9, 0.8, 0.7, 0.1, 0.0],
                vec![0.6, 0.55, 0.2, 0.1, 0.0],
            ],
            vec![
                vec![0.5, 0.45, 0.3, 0.0, 0.0],
                vec![0.4, 0.35, 0.0, 0.0, 0.0],
            ],
        ];
        assert_eq!(allocate(&scores, 2, Protection::default()), vec![5, 3]);
        // Ties go to the lower layer: equal scores everywhere, 4 winners all in layer 0; 12
        // winners fill layer 0's 10 entries and take 2 of layer 1's.
        let flat = vec![vec![vec![1.0; 5]; 2]; 2];
        assert_eq!(allocate(&flat, 1, Protection::default()), vec![4, 0]);
        assert_eq!(allocate(&flat, 3, Protection::default()), vec![10, 2]);
    }

    #[test]
    fn protected_tokens_count_in_every_cache_and_never_compete() {
        // Sinks 1, window 1: each cache keeps positions 0 and 4 and competes with 1..=3. Budget 3
        // per cache: 1 selectable per cache, 4 in all.
        let protect = Protection {
            sinks: 1,
            window: 1,
        };
        let scores = vec![
            vec![vec![9.0, 0.1, 0.2, 0.3, 9.0], vec![9.0, 0.1, 0.1, 0.1, 9.0]],
            vec![vec![0.0, 0.9, 0.8, 0.7, 0.0], vec![0.0, 0.1, 0.1, 0.1, 0.0]],
        ];
        // Best 4: 0.9, 0.8, 0.7 (layer 1), then layer 0's 0.3.
        assert_eq!(allocate(&scores, 3, protect), vec![4 + 1, 4 + 3]);
        // A budget below the protected tokens selects nothing: each layer its protected ones.
        assert_eq!(allocate(&scores, 1, protect), vec![4, 4]);
    }
}
