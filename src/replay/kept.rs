//! Choosing the kept sets of one layer's caches, the scorer driven as a stream of steps: one-shot
//! selection at the end of the prompt (budgets shared among caches by the head split), streaming
//! eviction from the first token over budget or from the end of the prompt, and re-selection at
//! every decode step. Under `gqa = layer` the layer's caches choose one kept set together.

use super::scorer::{ScoreState, Scorer, Started};
use super::select::{select_top, victim};
use super::{Granularity, Kept, LayerContext, Order, Unit, UnitKept, ValidPolicy};
use super::{Protection, Timing};
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
pub(crate) fn selection_groups<'u>(units: &'u [Unit], policy: &ValidPolicy) -> Vec<&'u [Unit]> {
    if policy.params().gqa == Granularity::Layer {
        vec![units]
    } else {
        units.chunks(1).collect()
    }
}

/// Several caches scored as one (`gqa = layer`): an entry's score is the mean of the caches'
/// scores, summed in cache order.
struct Shared<'a> {
    states: Vec<Started<'a>>,
    buffer: Vec<f32>,
}

impl ScoreState for Shared<'_> {
    fn on_append(&mut self, cache: &[usize]) {
        for state in &mut self.states {
            state.on_append(cache);
        }
    }

    fn scores(&mut self, cache: &[usize], out: &mut Vec<f32>) {
        out.clear();
        out.resize(cache.len(), 0.0);
        for state in &mut self.states {
            state.scores(cache, &mut self.buffer);
            for (total, score) in out.iter_mut().zip(&self.buffer) {
                *total += score;
            }
        }
        let n = self.states.len() as f32;
        for total in out.iter_mut() {
            *total /= n;
        }
    }

    fn on_evict(&mut self, index: usize) {
        for state in &mut self.states {
            state.on_evict(index);
        }
    }

    fn on_cut(&mut self, kept: &[bool]) {
        for state in &mut self.states {
            state.on_cut(kept);
        }
    }
}

/// A fresh scorer state for a group of caches that choose together.
fn start_group<'a>(
    scorer: &dyn Scorer,
    layer: &LayerContext<'a>,
    group: &[Unit],
    protect: Protection,
) -> Started<'a> {
    match group {
        [unit] => scorer.start(layer, unit, protect),
        _ => Box::new(Shared {
            states: group
                .iter()
                .map(|unit| scorer.start(layer, unit, protect))
                .collect(),
            buffer: Vec::new(),
        }),
    }
}

/// Feeds the prompt to a fresh state without evicting; returns its scores.
/// A scorer that does not declare it reads the future sees the prompt only: the generated
/// positions are cut from its layer, so looking beyond the prompt is impossible, not just unused.
pub(crate) fn score_prompt<'a>(
    scorer: &dyn Scorer,
    layer: &LayerContext<'a>,
    group: &[Unit],
    protect: Protection,
) -> Vec<f32> {
    let layer = if scorer.reads_future() {
        *layer
    } else {
        layer.through(layer.prompt_len)
    };
    let mut state = start_group(scorer, &layer, group, protect);
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
    group: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
) -> UnitKept {
    let prompt_len = layer.prompt_len;
    let protect = policy.protection();
    let mut state = start_group(policy.scorer.as_ref(), layer, group, protect);
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

/// Streams every position through one cache of `budget` tokens, evicting the lowest score: from
/// the first token over budget (`streaming`), or, under `prefill-then-stream`, after the whole
/// prompt has been scored once and cut to the budget at its end. Under `order = attend-first` a
/// decode query attends over the cache before that step's eviction (`budget + 1` tokens).
fn stream(
    layer: &LayerContext<'_>,
    group: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
) -> UnitKept {
    let protect = policy.protection();
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let cut_at_prompt_end = policy.params().timing == Timing::PrefillThenStream;
    let attend_first = policy.params().order == Order::AttendFirst;
    let mut state = start_group(policy.scorer.as_ref(), layer, group, protect);
    let mut cache = Vec::with_capacity(if cut_at_prompt_end {
        prompt_len
    } else {
        budget + 1
    });
    let mut scores = Vec::with_capacity(budget + 1);
    let mut steps = Vec::with_capacity(n_positions - prompt_len);
    for position in 0..n_positions {
        cache.push(position);
        state.on_append(&cache);
        let decoding = position >= prompt_len;
        if decoding && attend_first {
            steps.push(cache.clone());
        }
        if cut_at_prompt_end && position + 1 == prompt_len {
            cut(&mut cache, state.as_mut(), &mut scores, budget, protect);
        } else if (decoding || !cut_at_prompt_end) && cache.len() > budget {
            state.scores(&cache, &mut scores);
            if let Some(index) = victim(&cache, &scores, protect) {
                cache.remove(index);
                state.on_evict(index);
            }
        }
        if decoding && !attend_first {
            steps.push(cache.clone());
        }
    }
    UnitKept::PerStep(steps)
}

/// Cuts the whole prompt to its `budget` best entries at once (the one-shot selection of
/// [`select_top`]), telling the state which entries went in one call.
fn cut(
    cache: &mut Vec<usize>,
    state: &mut dyn ScoreState,
    scores: &mut Vec<f32>,
    budget: usize,
    protect: Protection,
) {
    if cache.len() <= budget {
        return;
    }
    state.scores(cache, scores);
    let len = cache.len();
    let kept = select_top(cache, scores, budget, |position| {
        protect.covers(position, len)
    });
    let marks: Vec<bool> = cache
        .iter()
        .map(|position| kept.binary_search(position).is_ok())
        .collect();
    *cache = kept;
    state.on_cut(&marks);
}

/// Maps over groups of caches that choose together, in parallel or not.
fn map_groups<T: Send>(
    groups: &[&[Unit]],
    parallel: bool,
    work: impl Fn(&[Unit]) -> T + Sync + Send,
) -> Vec<T> {
    if parallel {
        groups.par_iter().map(|group| work(group)).collect()
    } else {
        groups.iter().map(|group| work(group)).collect()
    }
}

/// The prompt scores of a one-shot policy's selection groups ([`selection_groups`]), one vector
/// per group: what [`one_shot_kept`] selects from, the same for every policy with the same
/// [`ValidPolicy::score_key`].
pub(crate) fn one_shot_scores(
    layer: &LayerContext<'_>,
    units: &[Unit],
    policy: &ValidPolicy,
    parallel_units: bool,
) -> Vec<Vec<f32>> {
    let protect = policy.protection();
    let groups = selection_groups(units, policy);
    map_groups(&groups, parallel_units, |group| {
        score_prompt(policy.scorer.as_ref(), layer, group, protect)
    })
}

/// The kept sets of a one-shot policy ([`is_one_shot`]) for every cache of one layer, selected
/// from the groups' prompt scores.
pub(crate) fn one_shot_kept(
    layer: &LayerContext<'_>,
    units: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
    scored: &[Vec<f32>],
) -> Kept {
    let protect = policy.protection();
    let prompt_len = layer.prompt_len;
    let groups = selection_groups(units, policy);
    let group_budgets = policy
        .heads
        .split(budget, scored, groups.len(), prompt_len, protect);
    let prompt: Vec<usize> = (0..prompt_len).collect();
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
        layer_budget: budget,
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
) -> Kept {
    let groups = selection_groups(units, policy);
    let per_group = map_groups(&groups, parallel, |group| {
        per_step_kept(layer, group, budget, policy)
    });
    let kept = groups
        .iter()
        .zip(per_group)
        .flat_map(|(group, kept)| std::iter::repeat_n(kept, group.len()))
        .collect();
    Kept {
        layer_budget: budget,
        units: units.to_vec(),
        budgets: vec![budget; units.len()],
        kept,
    }
}

/// The kept sets, step by step, of one cache (or of a group of caches that choose together)
/// under a policy that is not one-shot: streaming eviction, or re-selection at every step.
pub(crate) fn per_step_kept(
    layer: &LayerContext<'_>,
    group: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
) -> UnitKept {
    if policy.params().timing.reselects() {
        reselect_each_step(layer, group, budget, policy)
    } else {
        stream(layer, group, budget, policy)
    }
}
