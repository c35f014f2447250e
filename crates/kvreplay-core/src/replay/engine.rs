//! Runs checked policies over a trace and collects the measurements.
//!
//! By default only global layers are replayed: on a trace whose header gives sliding-window
//! layers (`layer_windows`), those keep their window whatever the policy, are left out of the
//! metrics, and count in memory with the entries they hold; allocators spread the budget over the
//! global layers in depth order (as kvpress compresses only the global layers of Gemma 3). A
//! policy with `layers = all` compresses every layer: a sliding-window layer is replayed with its
//! window in its [`LayerContext`] (the scorer sees the window's attention, kept tokens leave as
//! they slide out, the reference is the window's attention) and allocators spread the budget over
//! all layers in depth order.
//!
//! Order of work: (1) for allocators that ask, a first pass computes each layer's window profile,
//! mass curve or prompt scores, and the allocator turns them into per-layer budgets (a
//! [`LayerBudget`]: the layer's total over its caches); (2) the layers are then
//! read one at a time (so about one layer is resident, whatever the depth of the model); for each,
//! one-shot kept sets are chosen for the whole layer (the prompt scores computed once per distinct
//! scorer, settings, protection and layout, and shared by every budget, allocator and head split
//! that selects from them, one task per cache group), then the KV groups are measured one after
//! another: a group's full decode attention is computed once and shared by every policy's
//! metrics (its parts computed in parallel, one group's reference held at a time), re-selecting
//! policies of one family share one scorer stream and one ranking per step (`reselected_kept`),
//! and the policies run in parallel with rayon (a single policy runs its groups in parallel
//! instead). Peak memory is one layer's f32 arrays plus one group's decode attention and, per
//! thread, one cache's scoring buffers (a few per cent of a layer each). Measurements are summed
//! in one fixed order, so results are bit-identical for any thread count.

use super::allocator::{AllocationInput, LayerBudget};
use super::kept::{
    is_one_shot, is_whole_layer, one_shot_kept, one_shot_scores, per_step_kept,
    per_step_layer_kept, reselected_kept, score_prompt, selection_groups,
};
use super::metrics::lost::{Dating, LostShare};
use super::metrics::{
    measure_unit, nested_shares, CacheShares, DecodeReference, LayerAccumulator, LayerReport,
    MeasureSettings, SpanReport, UnitMeasure,
};
use super::plan::Plan;
use super::select::ranking;
use super::Layers;
use super::{
    context, Kept, LayerContext, LayerProfile, PolicyError, Protocol, Storage, Unit, UnitKept,
    ValidPolicy,
};
use crate::stop::{Stop, NEVER};
use crate::trace::{Span, TraceMeta, TraceReader};
use rayon::prelude::*;
use serde::Serialize;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// The result of one replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The trace file.
    pub trace: String,
    /// Short policy name, e.g. `flat+snapkv@prefill`.
    pub policy: String,
    /// Every setting of the policy.
    pub settings: BTreeMap<String, String>,
    /// The nominal budget per cache.
    pub nominal_budget: usize,
    /// Each metric's mean over layers (of its layer means), by id.
    #[serde(flatten)]
    pub metrics: BTreeMap<String, f64>,
    /// Mean cache size over layers, caches and decode steps.
    pub mean_kept: f64,
    /// KV entries stored per layer, mean over layers and decode steps: one unit of memory for
    /// every layout (a query-head cache counts its repeated K/V).
    pub kv_entries: f64,
    /// KV entries held per layer, mean over layers and decode steps: `kv_entries` for policies
    /// that evict; the whole cache for re-selecting timings, which read `kv_entries` of it.
    pub held_entries: f64,
    /// Bytes held per layer, mean over layers and decode steps: `held_entries * 2 * head_dim *
    /// element bytes` at the trace's dtype, or with a quantizer the mean of the layers' bytes as
    /// it stores them ([`LayerReport::kv_bytes`]).
    pub kv_bytes: f64,
    /// Span survival, mean over layers.
    pub spans: Vec<SpanReport>,
    /// The lost mass by region of the context, mean over layers.
    pub lost_by_region: Vec<LostShare>,
    /// The lost mass by when it left the cache, mean over layers.
    pub lost_by_when: Vec<LostShare>,
    /// Per-layer measurements.
    pub layers: Vec<LayerReport>,
}

/// The layers `policy` compresses on a trace of header `meta`, in depth order: its global layers,
/// or every layer under `layers = all`.
pub fn compressed_layers(meta: &TraceMeta, policy: &ValidPolicy) -> Vec<usize> {
    match policy.params().layers {
        Layers::Global => meta.global_layers(),
        Layers::All => (0..meta.n_layers).collect(),
    }
}

impl ReplayReport {
    /// The mean of metric `id` over layers, if it was measured.
    pub fn metric(&self, id: &str) -> Option<f64> {
        self.metrics.get(id).copied()
    }
}

/// Replays `policy` on `trace`.
pub fn replay(trace: &TraceReader, policy: &ValidPolicy) -> Result<ReplayReport, PolicyError> {
    let mut reports = replay_many(trace, std::slice::from_ref(policy), Checkpoints::NONE)?;
    Ok(reports.pop().expect("one report per policy"))
}

/// Where long work over a trace reports and asks whether to go on: `after_layer` once each layer
/// of each pass is done and its memory freed (a progress bar, or the binary handing freed memory
/// back), `stop` between the smaller steps within a layer (each KV group, every few hundred
/// positions of a cache's stream). Either returns [`Stopped`](super::Stopped) to end the work
/// there (Ctrl-C): the call then fails with [`PolicyError::Stopped`].
#[derive(Clone, Copy)]
pub struct Checkpoints<'a> {
    /// Called after each layer of each pass.
    pub after_layer: Stop<'a>,
    /// Asked within a layer; cheap (an atomic load), since it is asked often.
    pub stop: Stop<'a>,
}

impl<'a> Checkpoints<'a> {
    /// Checkpoints that report nothing and never stop.
    pub const NONE: Checkpoints<'static> = Checkpoints {
        after_layer: NEVER,
        stop: NEVER,
    };

    /// Checkpoints that only ask `stop`, after each layer and within it.
    pub fn stopping(stop: Stop<'a>) -> Self {
        Self {
            after_layer: stop,
            stop,
        }
    }
}

/// Replays several policies in one pass over the trace, calling `checkpoints.after_layer` after
/// each layer of each pass (budget passes count once per policy that needs one) and asking
/// `checkpoints.stop` within the layers.
pub fn replay_many(
    trace: &TraceReader,
    policies: &[ValidPolicy],
    checkpoints: Checkpoints<'_>,
) -> Result<Vec<ReplayReport>, PolicyError> {
    replay_pass(trace, policies, checkpoints, &mut |_, _| {})
}

/// [`replay_many`] for one-shot (prefill-timing) policies, also returning each policy's kept sets
/// per layer: what a live run masks, chosen in the same pass that measures them; `stop` is asked
/// within and after each layer.
pub fn replay_keeping(
    trace: &TraceReader,
    policies: &[ValidPolicy],
    stop: Stop<'_>,
) -> Result<Vec<(ReplayReport, Vec<Kept>)>, PolicyError> {
    let mut kept: Vec<Vec<Kept>> = vec![Vec::new(); policies.len()];
    let reports = replay_pass(
        trace,
        policies,
        Checkpoints::stopping(stop),
        &mut |index, layer_kept| kept[index].push(layer_kept),
    )?;
    Ok(reports.into_iter().zip(kept).collect())
}

/// One pass over the trace for `policies`; `keep(index, kept)` receives policy `index`'s one-shot
/// kept sets of each layer in layer order. The question-agnostic policies read the trace cut where
/// its question starts ([`protocol_view`]), in a pass of their own.
fn replay_pass(
    trace: &TraceReader,
    policies: &[ValidPolicy],
    checkpoints: Checkpoints<'_>,
    keep: &mut dyn FnMut(usize, Kept),
) -> Result<Vec<ReplayReport>, PolicyError> {
    let (agnostic, in_prompt): (Vec<usize>, Vec<usize>) = (0..policies.len())
        .partition(|&index| policies[index].params().protocol == Protocol::QuestionAgnostic);
    let mut reports: Vec<Option<ReplayReport>> = (0..policies.len()).map(|_| None).collect();
    for indices in [in_prompt, agnostic] {
        let Some(&first) = indices.first() else {
            continue;
        };
        let view = protocol_view(trace, &policies[first])?;
        let reader = view.as_ref().unwrap_or(trace);
        let subset: Vec<&ValidPolicy> = indices.iter().map(|&index| &policies[index]).collect();
        let unread = reader.reconstruction().is_some()
            && !subset.iter().any(|p| p.scorer.needs_reconstruction());
        let lighter = unread
            .then(|| reader.without_reconstruction())
            .transpose()?;
        let reader = lighter.as_ref().unwrap_or(reader);
        let measured = measure_pass(reader, &subset, checkpoints, &mut |at, kept| {
            keep(indices[at], kept)
        })?;
        for (&index, report) in indices.iter().zip(measured) {
            reports[index] = Some(report);
        }
    }
    Ok(reports
        .into_iter()
        .map(|report| report.expect("every policy is measured in one of the passes"))
        .collect())
}

/// The trace as `policy` reads it: under the question-agnostic protocol, cut where its
/// `question` span starts (`None`: the trace as captured).
pub fn protocol_view(
    trace: &TraceReader,
    policy: &ValidPolicy,
) -> Result<Option<TraceReader>, PolicyError> {
    if policy.params().protocol != Protocol::QuestionAgnostic {
        return Ok(None);
    }
    let meta = trace.meta();
    let mismatch = |rule: String| PolicyError::TraceMismatch {
        path: trace.path().display().to_string(),
        rule,
    };
    let question = meta
        .spans
        .iter()
        .find(|span| span.name == "question")
        .ok_or_else(|| {
            mismatch(
                "protocol `question-agnostic` cuts where the question starts, and the trace has no `question` span (capture a recipe with a question)".into(),
            )
        })?;
    if question.start == 0 || question.start > meta.prompt_len {
        return Err(mismatch(format!(
            "protocol `question-agnostic` cuts where the question starts, and the `question` span starts at {}, outside the prompt (1..={})",
            question.start, meta.prompt_len
        )));
    }
    Ok(Some(trace.with_prompt_len(question.start)?))
}

/// [`replay_pass`] over policies that read the trace alike.
fn measure_pass(
    trace: &TraceReader,
    policies: &[&ValidPolicy],
    checkpoints: Checkpoints<'_>,
    keep: &mut dyn FnMut(usize, Kept),
) -> Result<Vec<ReplayReport>, PolicyError> {
    let mut passes = AllocatorPasses::default();
    let (nominal, budgets): (Vec<usize>, Vec<Vec<LayerBudget>>) = policies
        .iter()
        .map(|policy| layer_budgets_with_progress(trace, policy, checkpoints, &mut passes))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    let meta = trace.meta();
    let mut per_policy: Vec<Vec<LayerReport>> =
        vec![Vec::with_capacity(meta.n_layers); policies.len()];
    let compressed: Vec<Vec<usize>> = policies
        .iter()
        .map(|policy| compressed_layers(meta, policy))
        .collect();
    // One plan per set of policies that compress a layer together (the global layers', and on a
    // hybrid model the sliding layers' under `layers = all`), made on its first layer.
    let mut plans: BTreeMap<Vec<usize>, Plan<'_>> = BTreeMap::new();
    // Layers index every policy's budgets, the trace and the plans alike.
    #[allow(clippy::needless_range_loop)]
    for layer in 0..meta.n_layers {
        // The policies that compress this layer, by index.
        let here: Vec<usize> = compressed
            .iter()
            .enumerate()
            .filter(|(_, layers)| layers.contains(&layer))
            .map(|(index, _)| index)
            .collect();
        if here.is_empty() {
            continue;
        }
        let tensors = trace.layer(layer)?;
        let context = context(trace, layer, &tensors);
        let layer_policies: Vec<&ValidPolicy> = here.iter().map(|&index| policies[index]).collect();
        let layer_budgets: Vec<LayerBudget> =
            here.iter().map(|&index| budgets[index][layer]).collect();
        let plan = plans
            .entry(here.clone())
            .or_insert_with(|| Plan::new(&layer_policies));
        let ranked = passes.prompt_scores.take_layer(layer);
        let (reports, whole_layer) = measure_layer(
            &context,
            (plan, ranked),
            &layer_policies,
            &layer_budgets,
            &meta.spans,
            trace.element_bytes(),
            checkpoints.stop,
        )?;
        for (&index, report) in here.iter().zip(reports) {
            per_policy[index].push(report);
        }
        for (&index, kept) in here.iter().zip(whole_layer) {
            if let Some(kept) = kept {
                keep(index, kept);
            }
        }
        drop(tensors);
        (checkpoints.after_layer)()?;
    }
    Ok(policies
        .iter()
        .zip(per_policy)
        .zip(nominal)
        .map(|((policy, layers), nominal)| summarise(trace, policy, layers, nominal))
        .collect())
}

/// Replays and measures every policy on one layer, executing `plan`: the prompt scores once per
/// score key (those an allocator ranked the layer by, `ranked`, taken as they are), the whole
/// layer's kept sets, then the caches KV group by KV group. With several
/// policies, each group's [`DecodeReference`] is computed (beside the re-selecting policies'
/// choices of kept sets, which do not need it) once and shared by all of them while they run in
/// parallel; a single policy runs its groups in parallel instead, each choosing its kept sets
/// before computing its reference, so a thread never holds both a scorer's buffers and a
/// reference. One level of parallelism only: nested rayon loops let a waiting thread start more
/// work, and every started policy holds its scorer state, so memory would grow with the grid.
fn measure_layer(
    layer: &LayerContext<'_>,
    (plan, ranked): (&Plan<'_>, BTreeMap<String, Vec<Vec<f32>>>),
    policies: &[&ValidPolicy],
    budgets: &[LayerBudget],
    spans: &[Span],
    width: usize,
    stop: Stop<'_>,
) -> Result<(Vec<LayerReport>, Vec<Option<Kept>>), PolicyError> {
    let units: Vec<Vec<Unit>> = policies.iter().map(|policy| units(layer, policy)).collect();
    let scores = score_prompts(layer, (plan, ranked), policies, &units, stop)?;
    let whole_layer = whole_layer_kept(layer, (plan, stop), policies, budgets, &units, &scores)?;
    drop(scores);
    let pass = LayerPass {
        layer,
        plan,
        policies,
        budgets,
        spans,
        units: &units,
        whole_layer: &whole_layer,
        width,
        stop,
    };
    let accumulators = match plan.single {
        true => pass.measure_alone()?,
        false => pass.measure_together()?,
    };
    let reports = accumulators
        .into_iter()
        .zip(budgets)
        .map(|(accumulator, budget)| accumulator.report(layer, budget.per_cache(), spans))
        .collect();
    Ok((reports, whole_layer))
}

/// Each score key's prompt scores, per selection group: those of `ranked` as they are, the
/// others with one task per (score key, selection group), so that a heavy scorer's groups (H2O's
/// prefix pass) spread over the threads instead of running one after another on one of them.
fn score_prompts<'p>(
    layer: &LayerContext<'_>,
    (plan, mut ranked): (&Plan<'p>, BTreeMap<String, Vec<Vec<f32>>>),
    policies: &[&ValidPolicy],
    units: &[Vec<Unit>],
    stop: Stop<'_>,
) -> Result<BTreeMap<&'p str, Vec<Vec<f32>>>, PolicyError> {
    let mut scores: BTreeMap<&str, Vec<Vec<f32>>> = BTreeMap::new();
    for &(key, _) in &plan.scorers {
        if let Some(found) = ranked.remove(key) {
            scores.insert(key, found);
        }
    }
    let tasks: Vec<(&str, usize, usize)> = plan
        .scorers
        .iter()
        .filter(|(key, _)| !scores.contains_key(key))
        .flat_map(|&(key, index)| {
            let groups = selection_groups(&units[index], policies[index]).len();
            (0..groups).map(move |group| (key, index, group))
        })
        .collect();
    let scored: Vec<Result<Vec<f32>, PolicyError>> = tasks
        .par_iter()
        .map(|&(_, index, group)| {
            let policy = &policies[index];
            let groups = selection_groups(&units[index], policy);
            score_prompt(
                policy.scorer.as_ref(),
                layer,
                groups[group],
                policy.protection(),
                stop,
            )
        })
        .collect();
    for ((key, _, _), group_scores) in tasks.iter().zip(scored) {
        scores.entry(key).or_default().push(group_scores?);
    }
    Ok(scores)
}

/// The kept sets chosen for the whole layer at once: every one-shot policy's (from its score
/// key's scores) and every whole-layer re-selecting policy's; `None` for the policies that choose
/// cache by cache.
fn whole_layer_kept(
    layer: &LayerContext<'_>,
    (plan, stop): (&Plan<'_>, Stop<'_>),
    policies: &[&ValidPolicy],
    budgets: &[LayerBudget],
    units: &[Vec<Unit>],
    scores: &BTreeMap<&str, Vec<Vec<f32>>>,
) -> Result<Vec<Option<Kept>>, PolicyError> {
    let kept: Vec<Result<Option<Kept>, PolicyError>> = policies
        .par_iter()
        .zip(budgets)
        .zip(units)
        .map(|((policy, &budget), units)| {
            if is_one_shot(policy) {
                let scored = &scores[policy.score_key()];
                Ok(Some(one_shot_kept(layer, units, budget, policy, scored)))
            } else {
                let budget = budget.per_cache();
                is_whole_layer(policy)
                    .then(|| per_step_layer_kept(layer, units, budget, policy, plan.single, stop))
                    .transpose()
            }
        })
        .collect();
    kept.into_iter().collect()
}

/// One layer's caches, kept sets and policies, measured KV group by KV group.
struct LayerPass<'a, 'l> {
    layer: &'a LayerContext<'l>,
    plan: &'a Plan<'a>,
    policies: &'a [&'a ValidPolicy],
    budgets: &'a [LayerBudget],
    spans: &'a [Span],
    units: &'a [Vec<Unit>],
    whole_layer: &'a [Option<Kept>],
    /// Bytes of one element at the trace's width.
    width: usize,
    /// Asked before each KV group and within each cache's stream.
    stop: Stop<'a>,
}

/// Caches of one KV group with their kept sets and budgets.
type GroupKept<'a> = Vec<(&'a Unit, Cow<'a, UnitKept>, usize)>;

impl LayerPass<'_, '_> {
    /// The full decode attention of KV head `kv_head`, its parts in parallel when several
    /// policies share it.
    fn reference(&self, kv_head: usize) -> DecodeReference {
        let parallel = !self.plan.single;
        DecodeReference::new(
            self.layer,
            kv_head,
            self.plan.max_top_k,
            self.spans,
            parallel,
        )
    }

    /// Policy `index`'s caches of KV head `kv_head`: unit, kept sets, budget.
    fn group_kept(&self, index: usize, kv_head: usize) -> Result<GroupKept<'_>, PolicyError> {
        match &self.whole_layer[index] {
            Some(kept) => Ok(kept
                .units
                .iter()
                .zip(&kept.kept)
                .zip(&kept.budgets)
                .filter(|((unit, _), _)| unit.kv_head == kv_head)
                .map(|((unit, unit_kept), &budget)| (unit, Cow::Borrowed(unit_kept), budget))
                .collect()),
            None => self.units[index]
                .iter()
                .filter(|unit| unit.kv_head == kv_head)
                .map(|unit| {
                    let group = std::slice::from_ref(unit);
                    let budget = self.budgets[index].per_cache();
                    let policy = self.policies[index];
                    let unit_kept = per_step_kept(self.layer, group, budget, policy, self.stop)?;
                    Ok((unit, Cow::Owned(unit_kept), budget))
                })
                .collect(),
        }
    }

    /// The measures of policy `index`'s caches `kept` against `reference`.
    fn measure_group(
        &self,
        index: usize,
        kept: &GroupKept<'_>,
        reference: &DecodeReference,
        nested: &NestedShares,
    ) -> Vec<UnitMeasure> {
        let params = self.policies[index].params();
        let settings = MeasureSettings {
            spans: self.spans,
            top_k: params.top_k,
            dating: Dating::of(params.timing),
            storage: self.policies[index].storage(),
            reselects: params.timing.reselects(),
            width: self.width,
        };
        kept.iter()
            .map(|(unit, unit_kept, budget)| {
                let shares = nested.get(&(index, unit.index));
                measure_unit(
                    self.layer, unit, unit_kept, *budget, reference, settings, shares,
                )
            })
            .collect()
    }

    /// A single policy: its KV groups in parallel.
    fn measure_alone(&self) -> Result<Vec<LayerAccumulator>, PolicyError> {
        let n_kv_heads = self.layer.k.shape()[0];
        let per_group: Vec<Result<Vec<UnitMeasure>, PolicyError>> = (0..n_kv_heads)
            .into_par_iter()
            .map(|kv_head| {
                (self.stop)()?;
                let kept = self.group_kept(0, kv_head)?;
                let reference = self.reference(kv_head);
                Ok(self.measure_group(0, &kept, &reference, &NestedShares::new()))
            })
            .collect();
        let mut accumulator = LayerAccumulator::new(self.layer, self.spans.len());
        for measures in per_group {
            for measure in &measures? {
                accumulator.add(measure);
            }
        }
        Ok(vec![accumulator])
    }

    /// Several policies: the KV groups one after another, each group's reference shared by the
    /// policies, which run in parallel.
    fn measure_together(&self) -> Result<Vec<LayerAccumulator>, PolicyError> {
        let (layer, policies, budgets) = (self.layer, self.policies, self.budgets);
        let mut accumulators: Vec<LayerAccumulator> = policies
            .iter()
            .map(|_| LayerAccumulator::new(layer, self.spans.len()))
            .collect();
        for kv_head in 0..layer.k.shape()[0] {
            (self.stop)()?;
            let (current, reselected) = rayon::join(
                || self.reference(kv_head),
                || {
                    let families = &self.plan.reselecting;
                    let stop = self.stop;
                    reselect_families(
                        layer,
                        (policies, budgets, stop),
                        self.units,
                        kv_head,
                        families,
                    )
                },
            );
            let reselected = reselected?;
            let nested = nest_shares(
                layer,
                policies,
                self.whole_layer,
                &self.plan.nests,
                kv_head,
                &current,
                self.spans,
            );
            let measured: Vec<Result<(), PolicyError>> = accumulators
                .par_iter_mut()
                .enumerate()
                .map(|(index, accumulator)| {
                    let kept = match reselected.get(&index) {
                        Some(kept) => kept
                            .iter()
                            .map(|(unit, unit_kept)| {
                                let budget = budgets[index].per_cache();
                                (*unit, Cow::Borrowed(unit_kept), budget)
                            })
                            .collect(),
                        None => self.group_kept(index, kv_head)?,
                    };
                    for measure in self.measure_group(index, &kept, &current, &nested) {
                        accumulator.add(&measure);
                    }
                    Ok(())
                })
                .collect();
            measured.into_iter().collect::<Result<(), _>>()?;
        }
        Ok(accumulators)
    }
}

/// Some caches of one layer, each with its one-shot prompt set.
type PromptSets<'a> = Vec<(&'a Unit, &'a [usize])>;

/// Kept shares from the nested path, by (policy index, cache index).
type NestedShares = BTreeMap<(usize, usize), CacheShares>;

/// The nested path's kept shares of KV head `kv_head`'s caches for every family of [`Plan::nests`]
/// whose kept sets nest there; the caches where they do not are left to the general path.
fn nest_shares(
    layer: &LayerContext<'_>,
    policies: &[&ValidPolicy],
    whole_layer: &[Option<Kept>],
    families: &[Vec<usize>],
    kv_head: usize,
    reference: &DecodeReference,
    spans: &[Span],
) -> NestedShares {
    // Each member's caches of this KV head with their prompt sets, in cache order.
    let fixed = |index: usize| -> PromptSets<'_> {
        let kept = whole_layer[index].as_ref().expect("one-shot kept sets");
        kept.units
            .iter()
            .zip(&kept.kept)
            .filter(|(unit, _)| unit.kv_head == kv_head)
            .filter_map(|(unit, unit_kept)| match unit_kept {
                UnitKept::Fixed(prompt) => Some((unit, prompt.as_slice())),
                UnitKept::PerStep(_) | UnitKept::Compressing(..) => None,
            })
            .collect()
    };
    // Per family, per member, its caches.
    let caches: Vec<Vec<PromptSets>> = families
        .iter()
        .map(|members| members.iter().map(|&index| fixed(index)).collect())
        .collect();
    let tasks: Vec<(usize, usize)> = caches
        .iter()
        .enumerate()
        .flat_map(|(family, members)| (0..members[0].len()).map(move |cache| (family, cache)))
        .collect();
    let per_task: Vec<Vec<((usize, usize), CacheShares)>> = tasks
        .par_iter()
        .map(|&(family, cache)| {
            let members = &caches[family];
            let unit = members[0][cache].0;
            // The same cache under every member (one layout), or nothing to nest.
            if members
                .iter()
                .any(|m| m.get(cache).map(|c| c.0) != Some(unit))
            {
                return Vec::new();
            }
            let sets: Vec<&[usize]> = members.iter().map(|m| m[cache].1).collect();
            let indices = &families[family];
            let top_k = policies[indices[0]].params().top_k;
            nested_shares(layer, unit, &sets, reference, spans, top_k)
                .map(|shares| {
                    let keys = indices.iter().map(|&index| (index, unit.index));
                    keys.zip(shares).collect()
                })
                .unwrap_or_default()
        })
        .collect();
    per_task.into_iter().flatten().collect()
}

/// Some caches of one layer, each with its kept sets.
type CachesKept<'u> = Vec<(&'u Unit, UnitKept)>;

/// Each re-selecting policy's kept sets for the caches of KV head `kv_head`, by policy index:
/// per family and cache, one pass of the scorer serves every member's budget.
fn reselect_families<'u>(
    layer: &LayerContext<'_>,
    (policies, budgets, stop): (&[&ValidPolicy], &[LayerBudget], Stop<'_>),
    units: &'u [Vec<Unit>],
    kv_head: usize,
    families: &[Vec<usize>],
) -> Result<BTreeMap<usize, CachesKept<'u>>, PolicyError> {
    let per_family: Vec<Result<Vec<(usize, CachesKept)>, PolicyError>> = families
        .par_iter()
        .map(|members| {
            let first = members[0];
            let member_budgets: Vec<usize> = members
                .iter()
                .map(|&index| budgets[index].per_cache())
                .collect();
            let mut kept: Vec<Vec<(&Unit, UnitKept)>> = vec![Vec::new(); members.len()];
            for unit in units[first].iter().filter(|unit| unit.kv_head == kv_head) {
                let group = std::slice::from_ref(unit);
                let sets = reselected_kept(layer, group, &member_budgets, policies[first], stop)?;
                for (slot, set) in kept.iter_mut().zip(sets) {
                    slot.push((unit, set));
                }
            }
            Ok(members.iter().copied().zip(kept).collect())
        })
        .collect();
    let mut by_policy = BTreeMap::new();
    for family in per_family {
        by_policy.extend(family?);
    }
    Ok(by_policy)
}

/// The kept sets of every cache of one layer, with the budgets of [`layer_budgets`].
pub fn kept_sets(
    trace: &TraceReader,
    policy: &ValidPolicy,
    budgets: &[LayerBudget],
    layer: usize,
) -> Result<Kept, PolicyError> {
    stopping_kept_sets(trace, policy, budgets, layer, NEVER)
}

/// [`kept_sets`], asking `stop` within the layer.
pub(crate) fn stopping_kept_sets(
    trace: &TraceReader,
    policy: &ValidPolicy,
    budgets: &[LayerBudget],
    layer: usize,
    stop: Stop<'_>,
) -> Result<Kept, PolicyError> {
    let view = protocol_view(trace, policy)?;
    let trace = view.as_ref().unwrap_or(trace);
    let tensors = trace.layer(layer)?;
    let context = context(trace, layer, &tensors);
    let units = units(&context, policy);
    let budget = budgets[layer];
    Ok(if is_one_shot(policy) {
        let scored = one_shot_scores(&context, &units, policy, true, stop)?;
        one_shot_kept(&context, &units, budget, policy, &scored)
    } else {
        per_step_layer_kept(&context, &units, budget.per_cache(), policy, true, stop)?
    })
}

/// Per-layer budgets of `policy` on `trace`, after checking that the two fit together; a
/// sliding-window layer's entry is its window, which it keeps whatever the policy.
pub fn layer_budgets(
    trace: &TraceReader,
    policy: &ValidPolicy,
) -> Result<Vec<LayerBudget>, PolicyError> {
    stopping_layer_budgets(trace, policy, NEVER)
}

/// [`layer_budgets`], asking `stop` within and after each layer of the allocator's passes over
/// the trace (entropy profiles, mass curves, the prompt's scores).
pub(crate) fn stopping_layer_budgets(
    trace: &TraceReader,
    policy: &ValidPolicy,
    stop: Stop<'_>,
) -> Result<Vec<LayerBudget>, PolicyError> {
    let view = protocol_view(trace, policy)?;
    let trace = view.as_ref().unwrap_or(trace);
    let checkpoints = Checkpoints::stopping(stop);
    let mut passes = AllocatorPasses::default();
    let (_, budgets) = layer_budgets_with_progress(trace, policy, checkpoints, &mut passes)?;
    Ok(budgets)
}

/// The caches of one layer under a policy's layout.
pub fn units(layer: &LayerContext<'_>, policy: &ValidPolicy) -> Vec<Unit> {
    Unit::all(
        layer.q.shape()[0],
        layer.k.shape()[0],
        policy.params().gqa == super::Granularity::QueryHead,
    )
}

/// Runs `work` on each of `layers`, one layer resident at a time, and returns the results in
/// order.
fn for_each_layer<T: Send>(
    trace: &TraceReader,
    layers: &[usize],
    checkpoints: Checkpoints<'_>,
    work: &(dyn Fn(LayerContext<'_>) -> Result<T, PolicyError> + Sync),
) -> Result<Vec<T>, PolicyError> {
    layers
        .iter()
        .map(|&layer| {
            let tensors = trace.layer(layer)?;
            let result = work(context(trace, layer, &tensors))?;
            (checkpoints.after_layer)()?;
            Ok(result)
        })
        .collect()
}

/// The policy's nominal budget on `trace`: its `budget`, or, given `bytes`, the most tokens whose
/// cache, as its storage holds it, holds at most that fraction of the full prompt cache's bytes
/// at the prompt's end ([`Storage::bytes_at_cut`]; not monotone: a KIVI cache sheds bytes each time a block
/// of keys is quantized, so every size is tried). Where the head split gives a share of the
/// caches only their protected positions (DuoAttention's streaming heads), the caches' mean bytes
/// must fit: the budget is what the others keep.
pub fn nominal_budget(trace: &TraceReader, policy: &ValidPolicy) -> Result<usize, PolicyError> {
    let params = policy.params();
    let Some(fraction) = params.bytes else {
        return Ok(params.budget);
    };
    let meta = trace.meta();
    let (prompt_len, d, width) = (meta.prompt_len, meta.head_dim, trace.element_bytes());
    let storage = policy.storage();
    let full = Storage::Captured.bytes_at_cut(prompt_len, d, width);
    let protection = params.protection();
    let mismatch = |rule: String| PolicyError::TraceMismatch {
        path: trace.path().display().to_string(),
        rule,
    };
    policy.heads.check_trace(meta).map_err(mismatch)?;
    let streaming = policy.heads.protected_only_share(
        meta,
        &compressed_layers(meta, policy),
        caches_per_layer(meta, params.gqa),
        protection,
    );
    let streaming_bytes = streaming * storage.bytes_at_cut(protection.tokens(), d, width);
    let mean_bytes = |n| (1.0 - streaming) * storage.bytes_at_cut(n, d, width) + streaming_bytes;
    let protected = protection.tokens().max(1);
    // The mean mixes fractions: a size that fits exactly must not fail by a rounding (1e-12).
    (protected..=prompt_len)
        .rev()
        .find(|&n| mean_bytes(n) <= fraction * full * (1.0 + 1e-12))
        .ok_or_else(|| {
            mismatch(match streaming > 0.0 {
                false => format!(
                    "bytes {fraction}: a cache of {protected} tokens (the protected sinks and window, or one) already holds {} bytes, more than {fraction} of the full prompt cache's {full}",
                    mean_bytes(protected)
                ),
                true => format!(
                    "bytes {fraction}: with {streaming:.3} of the caches streaming heads of {} tokens (the protected sinks and window), caches of {protected} tokens beside them already hold {} bytes on average, more than {fraction} of the full prompt cache's {full}",
                    protection.tokens(),
                    mean_bytes(protected)
                ),
            })
        })
}

/// How many caches each layer of `meta`'s model holds under the layout `gqa`.
pub fn caches_per_layer(meta: &TraceMeta, gqa: super::Granularity) -> usize {
    match gqa {
        super::Granularity::QueryHead => meta.n_heads,
        super::Granularity::KvHead => meta.n_kv_heads,
        super::Granularity::Layer => 1,
    }
}

/// What the allocators of one pass over a trace measured, shared by the pass's policies.
#[derive(Default)]
struct AllocatorPasses {
    profiles: Profiles,
    prompt_scores: PromptScores,
}

/// The layer profiles of one trace measured so far, by observation window and compressed layers:
/// the policies of a pass that need them (CAKE's at each budget) measure them once.
#[derive(Default)]
struct Profiles(BTreeMap<(usize, Vec<usize>), Vec<LayerProfile>>);

/// The prompt scores an allocator that ranks every layer's scores together (`global`) computed,
/// by score key and layer, with each layer's candidate positions: the policies of a pass with one
/// score key (one scorer at several budgets) score each layer once for their budgets, and the
/// measuring pass takes the scores instead of scoring the layer again.
#[derive(Default)]
struct PromptScores(BTreeMap<String, BTreeMap<usize, LayerScores>>);

/// One layer's candidate positions and its selection groups' prompt scores.
type LayerScores = (Vec<usize>, Vec<Vec<f32>>);

impl PromptScores {
    /// The scores of `policy`'s score key on `layers`, computed on first use (each layer then
    /// counted done, as it is when they are computed).
    fn of(
        &mut self,
        trace: &TraceReader,
        (policy, layers): (&ValidPolicy, &[usize]),
        checkpoints: Checkpoints<'_>,
    ) -> Result<Vec<LayerScores>, PolicyError> {
        let key = policy.score_key();
        if let Some(found) = self.0.get(key) {
            if let Some(all) = layers.iter().map(|l| found.get(l).cloned()).collect() {
                for _ in layers {
                    (checkpoints.after_layer)()?;
                }
                return Ok(all);
            }
        }
        let scored = for_each_layer(trace, layers, checkpoints, &|layer| {
            let units = units(&layer, policy);
            let scores = one_shot_scores(&layer, &units, policy, true, checkpoints.stop)?;
            Ok((layer.prompt_cache().collect(), scores))
        })?;
        let stored = layers.iter().copied().zip(scored.iter().cloned());
        self.0.entry(key.to_owned()).or_default().extend(stored);
        Ok(scored)
    }

    /// Every score key's scores of `layer`, taken out.
    fn take_layer(&mut self, layer: usize) -> BTreeMap<String, Vec<Vec<f32>>> {
        self.0
            .iter_mut()
            .filter_map(|(key, layers)| Some((key.clone(), layers.remove(&layer)?.1)))
            .collect()
    }
}

impl Profiles {
    /// The profiles of `layers` with the last `window` prompt queries, measured on first use
    /// (each layer then counted done, as it is when they are measured).
    fn of(
        &mut self,
        trace: &TraceReader,
        (window, layers): (usize, &[usize]),
        checkpoints: Checkpoints<'_>,
    ) -> Result<Vec<LayerProfile>, PolicyError> {
        let key = (window, layers.to_vec());
        if let Some(profiles) = self.0.get(&key) {
            for _ in layers {
                (checkpoints.after_layer)()?;
            }
            return Ok(profiles.clone());
        }
        let profiles = for_each_layer(trace, layers, checkpoints, &|layer| {
            Ok(LayerProfile::measure_windowed(&layer, window, layer.window))
        })?;
        self.0.insert(key, profiles.clone());
        Ok(profiles)
    }
}

/// Whether `policy` can run on `trace`: the first rule of the pair it breaks (no generated
/// tokens, tensors a method reads that the trace lacks, no global layer, protection longer than
/// the prompt), or the layers it compresses.
pub fn check_fit(trace: &TraceReader, policy: &ValidPolicy) -> Result<Vec<usize>, PolicyError> {
    let params = policy.params();
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let mismatch = |rule: String| PolicyError::TraceMismatch {
        path: trace.path().display().to_string(),
        rule,
    };
    if trace.n_positions() == prompt_len {
        return Err(mismatch(
            "the trace has no generated tokens (prompt_len = T): metrics are measured on decode queries; capture with generate > 0".into(),
        ));
    }
    if policy.scorer.needs_values() && !trace.has_values() {
        return Err(mismatch(format!(
            "scorer `{}` scores the values too, and this trace has none (capture with values)",
            params.scorer
        )));
    }
    if policy.scorer.needs_inputs() && !trace.has_inputs() {
        return Err(mismatch(format!(
            "scorer `{}` reads each layer's attention inputs (hidden states and projection weights), and this trace has none (capture it with --attention-inputs; live runs do not record them)",
            params.scorer
        )));
    }
    let compressed = compressed_layers(meta, policy);
    if policy.scorer.needs_rope()
        && compressed
            .iter()
            .any(|&layer| meta.rope_theta_of(layer).is_none())
    {
        return Err(mismatch(format!(
            "scorer `{}` rotates the queries back before the rotary, and this trace has no `rope_theta` (or `layer_rope_thetas`) in its header (capture it again with this version)",
            params.scorer
        )));
    }
    policy.scorer.check_trace(meta).map_err(mismatch)?;
    policy.heads.check_trace(meta).map_err(mismatch)?;
    if policy.storage().merges() && !trace.has_values() {
        return Err(mismatch(format!(
            "merge `{}` folds evicted values into kept ones, and this trace has none (capture with values)",
            params.merge
        )));
    }
    if let Some(scheme) = policy.scheme() {
        scheme
            .check_head_dim(meta.head_dim)
            .map_err(|rule| mismatch(format!("quantizer `{}`: {rule}", params.quantizer)))?;
    }
    if compressed.is_empty() {
        return Err(mismatch(
            "every layer of the trace attends through a sliding window (`layer_windows`): there is no global layer for a budget to compress".into(),
        ));
    }
    if params.protection().tokens() > prompt_len {
        return Err(mismatch(format!(
            "window {} + sinks {} is longer than the prompt ({prompt_len} tokens)",
            params.window, params.sinks
        )));
    }
    Ok(compressed)
}

/// The policy's nominal budget on `trace` ([`nominal_budget`]) and every layer's budget.
fn layer_budgets_with_progress(
    trace: &TraceReader,
    policy: &ValidPolicy,
    checkpoints: Checkpoints<'_>,
    passes: &mut AllocatorPasses,
) -> Result<(usize, Vec<LayerBudget>), PolicyError> {
    let params = policy.params();
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let compressed = check_fit(trace, policy)?;
    let allocator = &policy.allocator;
    let profiles = if allocator.needs_profile() {
        let window = params.window.max(1);
        (passes.profiles).of(trace, (window, &compressed), checkpoints)?
    } else {
        Vec::new()
    };
    let mass_curves = if allocator.needs_mass_curves() {
        for_each_layer(trace, &compressed, checkpoints, &|layer| {
            mass_curve(&layer, policy, checkpoints.stop)
        })?
    } else {
        Vec::new()
    };
    let (candidates, prompt_scores) = if allocator.needs_prompt_scores() {
        (passes.prompt_scores)
            .of(trace, (policy, &compressed), checkpoints)?
            .into_iter()
            .unzip()
    } else {
        (Vec::new(), Vec::new())
    };
    let nominal = nominal_budget(trace, policy)?;
    let caches = caches_per_layer(meta, params.gqa);
    let allocated = allocator.allocate(&AllocationInput {
        n_layers: compressed.len(),
        budget: nominal,
        prompt_len,
        protect: params.protection(),
        profiles: &profiles,
        mass_curves: &mass_curves,
        n_caches: caches,
        candidates: &candidates,
        prompt_scores: &prompt_scores,
    })?;
    let mut budgets: Vec<LayerBudget> = (0..meta.n_layers)
        .map(|layer| LayerBudget::uniform(meta.window(layer), caches))
        .collect();
    let protected = params.protection().tokens();
    for (&layer, allocated) in compressed.iter().zip(allocated) {
        let budget = match allocator.gives_totals() {
            true => LayerBudget::shared(allocated, caches),
            false => LayerBudget::uniform(allocated, caches),
        };
        if budget.total() == 0 && protected == 0 {
            return Err(PolicyError::EmptyLayer {
                allocator: params.allocator.clone(),
                layer,
                budget: nominal,
            });
        }
        if budget.total() < protected * caches || budget.total() == 0 {
            return Err(PolicyError::BudgetBelowProtected {
                budget: budget.per_cache(),
                sinks: params.sinks,
                window: params.window,
                layer: Some(layer),
            });
        }
        budgets[layer] = budget;
    }
    Ok((nominal, budgets))
}

fn summarise(
    trace: &TraceReader,
    policy: &ValidPolicy,
    mut layers: Vec<LayerReport>,
    nominal_budget: usize,
) -> ReplayReport {
    let meta = trace.meta();
    if policy.params().timing.reselects() {
        for layer in layers.iter_mut() {
            layer.held_entries = window_entries(trace, meta.window(layer.layer));
        }
    }
    let entry_bytes = (2 * meta.head_dim * trace.element_bytes()) as f64;
    if policy.storage().keeps_captured_keys() {
        for layer in layers.iter_mut() {
            layer.kv_bytes = layer.held_entries * entry_bytes;
        }
    }
    let n = layers.len() as f64;
    let mean = |f: &dyn Fn(&LayerReport) -> f64| layers.iter().map(f).sum::<f64>() / n;
    let spans = trace
        .meta()
        .spans
        .iter()
        .enumerate()
        .map(|(index, span)| SpanReport {
            name: span.name.clone(),
            kept_fraction: mean(&|l| l.spans[index].kept_fraction),
            kept_mass: mean(&|l| l.spans[index].kept_mass),
            full_mass: mean(&|l| l.spans[index].full_mass),
        })
        .collect();
    let kv_entries = entries_with_windows(trace, &layers, |l| l.kv_entries, 1.0);
    let held_entries = entries_with_windows(trace, &layers, |l| l.held_entries, 1.0);
    let kv_bytes = match policy.storage().keeps_captured_keys() {
        true => held_entries * entry_bytes,
        false => entries_with_windows(trace, &layers, |l| l.kv_bytes, entry_bytes),
    };
    let mean_shares = |shares: &dyn Fn(&LayerReport) -> &Vec<LostShare>| -> Vec<LostShare> {
        shares(&layers[0])
            .iter()
            .enumerate()
            .map(|(index, share)| LostShare {
                name: share.name.clone(),
                mass: mean(&|l| shares(l)[index].mass),
            })
            .collect()
    };
    let lost_by_region = mean_shares(&|l| &l.lost_by_region);
    let lost_by_when = mean_shares(&|l| &l.lost_by_when);
    ReplayReport {
        trace: trace.path().display().to_string(),
        policy: policy.label(),
        settings: policy.settings(),
        nominal_budget,
        metrics: layers[0]
            .metrics
            .keys()
            .map(|id| (id.clone(), mean(&|l| l.metrics[id])))
            .collect(),
        mean_kept: mean(&|l| l.mean_kept),
        kv_entries,
        held_entries,
        kv_bytes,
        spans,
        lost_by_region,
        lost_by_when,
        layers,
    }
}

/// KV entries (or bytes) per layer, mean over every layer of the model and decode steps: `entries`
/// of the compressed layers' caches, and each sliding-window layer the policy leaves alone at its
/// own window, which the model holds and reads whatever the policy, `per_entry` each.
fn entries_with_windows(
    trace: &TraceReader,
    compressed: &[LayerReport],
    entries: impl Fn(&LayerReport) -> f64,
    per_entry: f64,
) -> f64 {
    let meta = trace.meta();
    let left_alone: f64 = (0..meta.n_layers)
        .filter(|&layer| !compressed.iter().any(|report| report.layer == layer))
        .map(|layer| window_entries(trace, meta.window(layer)) * per_entry)
        .sum();
    let held: f64 = compressed.iter().map(entries).sum();
    (held + left_alone) / meta.n_layers as f64
}

/// The entries a whole cache of attention window `window` (0: global) holds, summed over KV heads,
/// mean over decode steps: `min(window, t + 1)` per KV head at step `t`.
fn window_entries(trace: &TraceReader, window: usize) -> f64 {
    let meta = trace.meta();
    let steps = meta.prompt_len..trace.n_positions();
    let n_steps = steps.len() as f64;
    let window = if window == 0 { usize::MAX } else { window };
    let held: usize = steps.map(|t| window.min(t + 1)).sum();
    (meta.n_kv_heads * held) as f64 / n_steps
}

/// Retained mass of a layer (mean over query heads and decode steps) against the number of prompt
/// tokens kept in the scorer's order, index b = b tokens; generated tokens are left out (they are
/// the same for every budget). Caches that choose together (`gqa = layer`) share one order.
fn mass_curve(
    layer: &LayerContext<'_>,
    policy: &ValidPolicy,
    stop: Stop<'_>,
) -> Result<Vec<f64>, PolicyError> {
    let protect = policy.protection();
    let prompt_len = layer.prompt_len;
    let n_heads = layer.q.shape()[0];
    let n_steps = layer.n_positions() - prompt_len;
    let samples = (n_heads * n_steps) as f64;
    let prompt: Vec<usize> = layer.prompt_cache().collect();
    let mut curve = vec![0.0f64; prompt_len + 1];
    let units = units(layer, policy);
    for group in selection_groups(&units, policy) {
        let scores = score_prompt(policy.scorer.as_ref(), layer, group, protect, stop)?;
        let order = ranking(&prompt, &scores, |position| {
            protect.covers(position, prompt_len)
        });
        for unit in group {
            let decode = layer.decode_attention(unit.query_heads.clone());
            let mut weight = vec![0.0f64; prompt_len];
            for head in 0..unit.query_heads.len() {
                for step in 0..n_steps {
                    for (total, w) in
                        weight
                            .iter_mut()
                            .zip(decode.slice(ndarray::s![head, step, ..prompt_len]))
                    {
                        *total += *w as f64 / samples;
                    }
                }
            }
            let mut running = 0.0;
            for (rank, position) in order.iter().enumerate() {
                running += weight[*position];
                curve[rank + 1] += running;
            }
        }
    }
    // On a sliding-window layer a budget beyond the window keeps the whole window.
    let held = prompt.len();
    let whole_window = curve[held];
    curve[held + 1..].fill(whole_window);
    Ok(curve)
}
