//! Choosing the kept sets of one layer's caches, the scorer driven as a stream of steps: one-shot
//! selection at the end of the prompt (budgets shared among caches by the head split), streaming
//! eviction from the first token over budget or from the end of the prompt, and re-selection at
//! every decode step. Under `gqa = layer` the layer's caches choose one kept set together.

use super::allocator::LayerBudget;
use super::scorer::Scorer;
use super::select::{ranked_head, select_top};
use super::stream::{slide_out, start_group, CacheStream};
use super::{Granularity, Kept, LayerContext, Unit, UnitKept, ValidPolicy};
use super::{PolicyError, Protection, Stopped, Timing};
use crate::stop::Stop;
use rayon::prelude::*;

/// Whether `policy` keeps one set per cache for the whole decode (prefill timing). Those sets are chosen for the whole layer at once (AdaKV shares a budget
/// between the caches) and are small; the others change at every step and are computed group by
/// group as they are measured, so they never pile up.
pub(crate) fn is_one_shot(policy: &ValidPolicy) -> bool {
    policy.params().timing == Timing::Prefill
}

/// Whether `policy`'s kept sets are chosen for the whole layer at once: one-shot policies, and
/// any policy whose caches share one kept set (`gqa = layer`).
pub(crate) fn is_whole_layer(policy: &ValidPolicy) -> bool {
    is_one_shot(policy) || policy.params().gqa == Granularity::Layer
}

/// The caches that choose one kept set together: each cache alone, or under `gqa = layer` all of
/// the layer's (KV-head) caches as one.
pub fn selection_groups<'u>(units: &'u [Unit], policy: &ValidPolicy) -> Vec<&'u [Unit]> {
    if policy.params().gqa == Granularity::Layer {
        vec![units]
    } else {
        units.chunks(1).collect()
    }
}

/// Feeds the prompt to a fresh state without evicting; returns its scores, one per position of
/// [`LayerContext::prompt_cache`] (on a sliding-window layer, what slides out of the window is
/// dropped as the prompt runs). A scorer that does not declare it reads the future sees the
/// prompt only: the generated positions are cut from its layer, so looking beyond the prompt is
/// impossible, not just unused.
pub(crate) fn score_prompt(
    scorer: &dyn Scorer,
    layer: &LayerContext<'_>,
    group: &[Unit],
    protect: Protection,
    stop: Stop<'_>,
) -> Result<Vec<f32>, PolicyError> {
    let layer = if scorer.reads_future() {
        *layer
    } else {
        layer.through(layer.prompt_len)
    };
    let mut state = start_group(scorer, &layer, group, protect)?;
    let mut cache = Vec::with_capacity(layer.prompt_len);
    for position in 0..layer.prompt_len {
        asked_at(position, stop)?;
        slide_out(&layer, position, &mut cache, state.as_mut())?;
        cache.push(position);
        state.on_append(&layer, &cache)?;
    }
    let mut scores = Vec::new();
    state.scores(&layer, &cache, &mut scores)?;
    Ok(scores)
}

/// Positions a cache's stream takes between two questions whether to stop: Ctrl-C ended a replay
/// of every preset on an 8K prompt 0.01-0.02 s after the signal (CHANGELOG), and one question
/// costs an atomic load.
const STOP_EVERY: usize = 256;

/// Asks `stop` at every [`STOP_EVERY`]th position.
fn asked_at(position: usize, stop: Stop<'_>) -> Result<(), Stopped> {
    match position % STOP_EVERY {
        0 => stop(),
        _ => Ok(()),
    }
}

/// Maps over groups of caches that choose together, in parallel or not; a failure is the first
/// group's in order, whichever thread met it first.
fn map_groups<T: Send>(
    groups: &[&[Unit]],
    parallel: bool,
    work: impl Fn(&[Unit]) -> Result<T, PolicyError> + Sync + Send,
) -> Result<Vec<T>, PolicyError> {
    let results: Vec<_> = if parallel {
        groups.par_iter().map(|group| work(group)).collect()
    } else {
        groups.iter().map(|group| work(group)).collect()
    };
    results.into_iter().collect()
}

/// The prompt scores of a one-shot policy's selection groups ([`selection_groups`]), one vector
/// per group: what [`one_shot_kept`] selects from, the same for every policy with the same
/// [`ValidPolicy::score_key`].
pub(crate) fn one_shot_scores(
    layer: &LayerContext<'_>,
    units: &[Unit],
    policy: &ValidPolicy,
    parallel_units: bool,
    stop: Stop<'_>,
) -> Result<Vec<Vec<f32>>, PolicyError> {
    let protect = policy.protection();
    let groups = selection_groups(units, policy);
    map_groups(&groups, parallel_units, |group| {
        score_prompt(policy.scorer.as_ref(), layer, group, protect, stop)
    })
}

/// The kept sets of a one-shot policy ([`is_one_shot`]) for every cache of one layer, selected
/// from the groups' prompt scores.
pub(crate) fn one_shot_kept(
    layer: &LayerContext<'_>,
    units: &[Unit],
    budget: LayerBudget,
    policy: &ValidPolicy,
    scored: &[Vec<f32>],
) -> Kept {
    let protect = policy.protection();
    let prompt_len = layer.prompt_len;
    let groups = selection_groups(units, policy);
    let prompt: Vec<usize> = layer.prompt_cache().collect();
    let group_budgets = policy.heads.split(layer, budget, scored, &prompt, protect);
    let protected = |position: usize| protect.covers(position, prompt_len);
    let mut kept = Vec::with_capacity(units.len());
    let mut budgets = Vec::with_capacity(units.len());
    for ((scores, &group_budget), group) in scored.iter().zip(&group_budgets).zip(&groups) {
        let set = select_top(&prompt, scores, group_budget, protected);
        for _ in group.iter() {
            kept.push(UnitKept::Fixed(set.clone()));
            budgets.push(group_budget);
        }
    }
    Kept {
        layer_budget: budget.per_cache(),
        units: units.to_vec(),
        budgets,
        kept,
    }
}

/// The step-by-step kept sets of every cache of one layer under a policy that is not one-shot:
/// each selection group ([`selection_groups`]) streams or re-selects once, and its caches share
/// the result.
pub(crate) fn per_step_layer_kept(
    layer: &LayerContext<'_>,
    units: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
    parallel: bool,
    stop: Stop<'_>,
) -> Result<Kept, PolicyError> {
    let groups = selection_groups(units, policy);
    let per_group = map_groups(&groups, parallel, |group| {
        per_step_kept(layer, group, budget, policy, stop)
    })?;
    let kept = groups
        .iter()
        .zip(per_group)
        .flat_map(|(group, kept)| std::iter::repeat_n(kept, group.len()))
        .collect();
    Ok(Kept {
        layer_budget: budget,
        units: units.to_vec(),
        budgets: vec![budget; units.len()],
        kept,
    })
}

/// The kept sets, step by step, of one cache (or of a group of caches that choose together)
/// under a policy that is not one-shot ([`CacheStream`]), one per decode step.
pub(crate) fn per_step_kept(
    layer: &LayerContext<'_>,
    group: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
    stop: Stop<'_>,
) -> Result<UnitKept, PolicyError> {
    if policy.params().timing.reselects() {
        let kept = reselected_kept(layer, group, &[budget], policy, stop)?;
        return Ok(kept.into_iter().next().expect("one budget"));
    }
    let prompt_len = layer.prompt_len;
    let mut stream = CacheStream::start(layer, group, budget, policy)?;
    let mut steps = Vec::with_capacity(layer.n_positions() - prompt_len);
    for position in 0..layer.n_positions() {
        asked_at(position, stop)?;
        if let Some(attended) = stream.push(layer, position, position >= prompt_len)? {
            steps.push(attended.positions(position));
        }
    }
    Ok(match stream.take_evictions() {
        Some(evictions) => UnitKept::Compressing(steps, evictions),
        None => UnitKept::PerStep(steps),
    })
}

/// The step-by-step kept sets of one cache (or group of caches that choose together) under a
/// re-selecting timing, for several budgets at once, as [`CacheStream`] chooses them for each:
/// re-selection never evicts, so the scores at a step do not depend on the budget. They are
/// computed and ranked once per decode step, and each budget keeps the head of the ranking.
pub(crate) fn reselected_kept(
    layer: &LayerContext<'_>,
    group: &[Unit],
    budgets: &[usize],
    policy: &ValidPolicy,
    stop: Stop<'_>,
) -> Result<Vec<UnitKept>, PolicyError> {
    let prompt_len = layer.prompt_len;
    let protect = policy.protection();
    let timing = policy.params().timing;
    let mut state = start_group(policy.scorer.as_ref(), layer, group, protect)?;
    let mut cache = Vec::with_capacity(layer.n_positions());
    let mut scores = Vec::new();
    let mut per_budget: Vec<Vec<Vec<usize>>> = vec![Vec::new(); budgets.len()];
    let largest = budgets.iter().copied().max().unwrap_or(0);
    for position in 0..layer.n_positions() {
        asked_at(position, stop)?;
        slide_out(layer, position, &mut cache, state.as_mut())?;
        cache.push(position);
        state.on_append(layer, &cache)?;
        if position < prompt_len {
            continue;
        }
        state.scores(layer, &cache, &mut scores)?;
        let limit = match timing {
            Timing::PerStepPrompt => prompt_len,
            _ => position + 1,
        };
        // The entries a budget chooses among; those after them are always kept.
        let split = cache.partition_point(|&cached| cached < limit);
        let ranked = ranked_head(&cache[..split], &scores[..split], largest, |p| {
            protect.covers(p, limit)
        });
        for (steps, &budget) in per_budget.iter_mut().zip(budgets) {
            let chosen = budget.min(split);
            let mut kept = Vec::with_capacity(chosen + cache.len() - split);
            kept.extend_from_slice(&ranked[..chosen]);
            kept.sort_unstable();
            kept.extend_from_slice(&cache[split..]);
            steps.push(kept);
        }
    }
    Ok(per_budget.into_iter().map(UnitKept::PerStep).collect())
}

#[cfg(test)]
mod tests {
    use super::super::scorer::testing::{context, unit};
    use super::*;
    use crate::replay::{PolicyParams, Timing};
    use crate::stop::NEVER;
    use ndarray::Array3;

    /// A step-by-step stream per budget, as live mode runs one: the reference for the shared pass.
    fn streamed(layer: &LayerContext<'_>, budget: usize, policy: &ValidPolicy) -> UnitKept {
        let mut stream = CacheStream::start(layer, &[unit()], budget, policy).unwrap();
        let steps = (0..layer.n_positions())
            .filter_map(|position| {
                stream
                    .push(layer, position, position >= layer.prompt_len)
                    .unwrap()
                    .map(|attended| attended.positions(position))
            })
            .collect();
        UnitKept::PerStep(steps)
    }

    #[test]
    fn one_reselection_pass_serves_every_budget() {
        // 40 positions (30 prompt), d = 2, values from a fixed LCG.
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let q = Array3::from_shape_simple_fn((1, 40, 2), &mut next);
        let k = Array3::from_shape_simple_fn((1, 40, 2), &mut next);
        let layer = context(&q, &k, 30);
        for (scorer, timing) in [
            ("tova", Timing::PerStep),
            ("true-query", Timing::PerStepPrompt),
        ] {
            let budgets = [3, 8, 30, 50];
            let policy = PolicyParams {
                scorer: scorer.into(),
                timing,
                window: 2,
                sinks: 1,
                ..PolicyParams::default()
            }
            .check()
            .unwrap();
            let shared = reselected_kept(&layer, &[unit()], &budgets, &policy, NEVER).unwrap();
            for (kept, &budget) in shared.iter().zip(&budgets) {
                assert_eq!(
                    kept,
                    &streamed(&layer, budget, &policy),
                    "{scorer} {budget}"
                );
            }
        }
    }
}
