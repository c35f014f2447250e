//! Choosing the kept sets of one layer's caches, the scorer driven as a stream of steps: one-shot
//! selection at the end of the prompt (with AdaKV's head-wise budgets), streaming eviction from
//! the first token over budget, and the per-step oracle's re-selection from the full cache.

use super::policy::{HeadBudget, Timing};
use super::scorer::{ScoreState, Scorer};
use super::select::{select_top, victim};
use super::{Kept, LayerContext, Unit, UnitKept, ValidPolicy};
use rayon::prelude::*;

/// Whether `policy` keeps one set per cache for the whole decode (prefill timing, no
/// re-selection). Those sets are chosen for the whole layer at once (AdaKV shares a budget
/// between the caches) and are small; the others change at every step and are computed group by
/// group as they are measured, so they never pile up.
pub(crate) fn is_one_shot(policy: &ValidPolicy) -> bool {
    policy.params().timing == Timing::Prefill && !policy.scorer.reselects()
}

/// Feeds the prompt to a fresh state without evicting; returns its scores.
pub(crate) fn score_prompt<'a>(
    scorer: &dyn Scorer,
    layer: &LayerContext<'a>,
    unit: &Unit,
) -> Vec<f32> {
    let mut state = scorer.start(layer, unit);
    let mut cache = Vec::with_capacity(layer.n_positions());
    for position in 0..layer.prompt_len {
        cache.push(position);
        state.on_append(&cache);
    }
    let mut scores = Vec::new();
    state.scores(&cache, &mut scores);
    scores
}

/// Re-chooses the kept set at every decode step from the full cache (`oracle-per-step`).
fn reselect_each_step(
    layer: &LayerContext<'_>,
    unit: &Unit,
    budget: usize,
    policy: &ValidPolicy,
) -> UnitKept {
    let prompt_len = layer.prompt_len;
    let mut state: Box<dyn ScoreState> = policy.scorer.start(layer, unit);
    let mut scores = Vec::new();
    let mut cache: Vec<usize> = (0..prompt_len).collect();
    let steps = (prompt_len..layer.n_positions())
        .map(|position| {
            cache.push(position);
            state.on_append(&cache);
            state.scores(&cache, &mut scores);
            let limit = match policy.params().timing {
                Timing::Prefill => prompt_len,
                Timing::Streaming => position + 1,
            };
            let mut kept = select_top(&cache[..limit], &scores[..limit], budget, |_| false);
            kept.extend(limit..=position);
            kept.shrink_to_fit();
            kept
        })
        .collect();
    UnitKept::PerStep(steps)
}

/// Streams every position through one cache of `budget` tokens, evicting the lowest score.
fn stream(layer: &LayerContext<'_>, unit: &Unit, budget: usize, policy: &ValidPolicy) -> UnitKept {
    let params = policy.params();
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let mut state = policy.scorer.start(layer, unit);
    let mut cache = Vec::with_capacity(budget + 1);
    let mut scores = Vec::with_capacity(budget + 1);
    let mut steps = Vec::with_capacity(n_positions - prompt_len);
    for position in 0..n_positions {
        cache.push(position);
        state.on_append(&cache);
        if cache.len() > budget {
            state.scores(&cache, &mut scores);
            if let Some(index) = victim(&cache, &scores, params.sinks, params.window) {
                cache.remove(index);
                state.on_evict(index);
            }
        }
        if position >= prompt_len {
            steps.push(cache.clone());
        }
    }
    UnitKept::PerStep(steps)
}

/// Maps over the caches, in parallel or not.
pub(crate) fn map_units<T: Send>(
    units: &[Unit],
    parallel: bool,
    work: impl Fn(&Unit) -> T + Sync + Send,
) -> Vec<T> {
    if parallel {
        units.par_iter().map(work).collect()
    } else {
        units.iter().map(work).collect()
    }
}

/// The kept sets of a one-shot policy ([`is_one_shot`]) for every cache of one layer.
pub(crate) fn one_shot_kept(
    layer: &LayerContext<'_>,
    units: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
    parallel_units: bool,
) -> Kept {
    let params = policy.params();
    let prompt_len = layer.prompt_len;
    let scored: Vec<Vec<f32>> = map_units(units, parallel_units, |unit| {
        score_prompt(policy.scorer.as_ref(), layer, unit)
    });
    let budgets = if params.heads == HeadBudget::Adakv {
        adakv_budgets(
            &scored,
            budget,
            params.sinks,
            params.window,
            params.alpha,
            prompt_len,
        )
    } else {
        vec![budget; units.len()]
    };
    let prompt: Vec<usize> = (0..prompt_len).collect();
    let protected =
        |position: usize| position < params.sinks || position + params.window >= prompt_len;
    let kept = scored
        .iter()
        .zip(&budgets)
        .map(|(scores, &unit_budget)| {
            UnitKept::Fixed(select_top(&prompt, scores, unit_budget, protected))
        })
        .collect();
    Kept {
        layer_budget: budget,
        units: units.to_vec(),
        budgets,
        kept,
    }
}

/// The kept sets, step by step, of one cache under a policy that is not one-shot: streaming
/// eviction, or re-selection at every step.
pub(crate) fn per_step_kept(
    layer: &LayerContext<'_>,
    unit: &Unit,
    budget: usize,
    policy: &ValidPolicy,
) -> UnitKept {
    if policy.scorer.reselects() {
        reselect_each_step(layer, unit, budget, policy)
    } else {
        stream(layer, unit, budget, policy)
    }
}

/// AdaKV's head-wise budgets (Feng et al., 2024, arXiv:2407.11550; FFY0/AdaKV): with
/// `B = cap - protected` and floor `F = int(B * alpha)`, the top `H * B` scores of all caches
/// together are counted per cache (`cnt_h`), and cache h gets `round(cnt_h * (1 - alpha) + F)`
/// plus the protected tokens. Protected positions (sinks, window) do not compete. Ties: higher
/// score first, then the lower cache, then the lower position.
fn adakv_budgets(
    scores: &[Vec<f32>],
    cap: usize,
    sinks: usize,
    window: usize,
    alpha: f64,
    prompt_len: usize,
) -> Vec<usize> {
    let protected = sinks + window;
    let selectable = cap.saturating_sub(protected);
    let floor = (selectable as f64 * alpha) as usize;
    let mut all: Vec<(f32, usize, usize)> = scores
        .iter()
        .enumerate()
        .flat_map(|(unit, unit_scores)| {
            unit_scores
                .iter()
                .enumerate()
                .filter(move |(position, _)| *position >= sinks && position + window < prompt_len)
                .map(move |(position, score)| (*score, unit, position))
        })
        .collect();
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut counts = vec![0usize; scores.len()];
    for (_, unit, _) in all.iter().take(scores.len() * selectable) {
        counts[*unit] += 1;
    }
    counts
        .into_iter()
        .map(|count| {
            (count as f64 * (1.0 - alpha) + floor as f64).round_ties_even() as usize + protected
        })
        .collect()
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
        assert_eq!(adakv_budgets(&scores, 3, 0, 0, 0.2, 6), vec![3, 2]);
        // With alpha 1 every cache gets exactly the floor: B.
        assert_eq!(adakv_budgets(&scores, 3, 0, 0, 1.0, 6), vec![3, 3]);
    }
}
