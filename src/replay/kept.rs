//! Choosing the kept sets of one layer's caches, the scorer driven as a stream of steps: one-shot
//! selection at the end of the prompt (budgets shared among caches by the head split), streaming
//! eviction from the first token over budget, and re-selection at every decode step.

use super::scorer::{ScoreState, Scorer};
use super::select::{select_top, victim};
use super::{Kept, LayerContext, Unit, UnitKept, ValidPolicy};
use super::{Protection, Timing};
use rayon::prelude::*;

/// Whether `policy` keeps one set per cache for the whole decode (prefill timing). Those sets are chosen for the whole layer at once (AdaKV shares a budget
/// between the caches) and are small; the others change at every step and are computed group by
/// group as they are measured, so they never pile up.
pub(crate) fn is_one_shot(policy: &ValidPolicy) -> bool {
    policy.params().timing == Timing::Prefill
}

/// Feeds the prompt to a fresh state without evicting; returns its scores.
/// A scorer that does not declare it reads the future sees the prompt only: the generated
/// positions are cut from its layer, so looking beyond the prompt is impossible, not just unused.
pub(crate) fn score_prompt<'a>(
    scorer: &dyn Scorer,
    layer: &LayerContext<'a>,
    unit: &Unit,
    protect: Protection,
) -> Vec<f32> {
    let layer = if scorer.reads_future() {
        *layer
    } else {
        layer.through(layer.prompt_len)
    };
    let mut state = scorer.start(&layer, unit, protect);
    let mut cache = Vec::with_capacity(layer.prompt_len);
    for position in 0..layer.prompt_len {
        cache.push(position);
        state.on_append(&cache);
    }
    let mut scores = Vec::new();
    state.scores(&cache, &mut scores);
    scores
}

/// Re-chooses the kept set at every decode step from the full cache (`per-step`), or from the
/// prompt with every generated token kept (`per-step-prompt`); the first `sinks` and the last
/// `window` of the positions it chooses from are always kept.
fn reselect_each_step(
    layer: &LayerContext<'_>,
    unit: &Unit,
    budget: usize,
    policy: &ValidPolicy,
) -> UnitKept {
    let prompt_len = layer.prompt_len;
    let protect = policy.protection();
    let mut state: Box<dyn ScoreState> = policy.scorer.start(layer, unit, protect);
    let mut scores = Vec::new();
    let mut cache: Vec<usize> = Vec::with_capacity(layer.n_positions());
    for position in 0..prompt_len {
        cache.push(position);
        state.on_append(&cache);
    }
    let steps = (prompt_len..layer.n_positions())
        .map(|position| {
            cache.push(position);
            state.on_append(&cache);
            state.scores(&cache, &mut scores);
            let limit = match policy.params().timing {
                Timing::PerStepPrompt => prompt_len,
                _ => position + 1,
            };
            let protected = |position: usize| protect.covers(position, limit);
            let mut kept = select_top(&cache[..limit], &scores[..limit], budget, protected);
            kept.extend(limit..=position);
            kept.shrink_to_fit();
            kept
        })
        .collect();
    UnitKept::PerStep(steps)
}

/// Streams every position through one cache of `budget` tokens, evicting the lowest score.
fn stream(layer: &LayerContext<'_>, unit: &Unit, budget: usize, policy: &ValidPolicy) -> UnitKept {
    let protect = policy.protection();
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let mut state = policy.scorer.start(layer, unit, protect);
    let mut cache = Vec::with_capacity(budget + 1);
    let mut scores = Vec::with_capacity(budget + 1);
    let mut steps = Vec::with_capacity(n_positions - prompt_len);
    for position in 0..n_positions {
        cache.push(position);
        state.on_append(&cache);
        if cache.len() > budget {
            state.scores(&cache, &mut scores);
            if let Some(index) = victim(&cache, &scores, protect) {
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
    let protect = policy.protection();
    let prompt_len = layer.prompt_len;
    let scored: Vec<Vec<f32>> = map_units(units, parallel_units, |unit| {
        score_prompt(policy.scorer.as_ref(), layer, unit, protect)
    });
    let budgets = policy
        .heads
        .split(budget, &scored, units.len(), prompt_len, protect);
    let prompt: Vec<usize> = (0..prompt_len).collect();
    let protected = |position: usize| protect.covers(position, prompt_len);
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
    if policy.params().timing.reselects() {
        reselect_each_step(layer, unit, budget, policy)
    } else {
        stream(layer, unit, budget, policy)
    }
}
