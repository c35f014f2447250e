//! Runs checked policies over a trace and collects the measurements.
//!
//! Order of work: (1) for allocators that ask, a first pass computes each layer's window profile
//! or mass curve, and the allocator turns them into per-layer budgets; (2) the layers are then
//! read one at a time (so about one layer is resident, whatever the depth of the model); for each,
//! one-shot kept sets are chosen for the whole layer, then the KV groups are measured one after
//! another: a group's full decode attention is computed once and shared by every policy's
//! metrics, and the policies run in parallel with rayon (a single policy runs its groups in
//! parallel instead). Peak memory is one layer's f32 arrays plus, per thread, one group's decode
//! attention or one cache's scoring buffers (a few per cent of a layer each). Measurements are
//! summed in one fixed order, so results are bit-identical for any thread count.

use super::allocator::AllocationInput;
use super::metrics::{
    measure_unit, DecodeReference, LayerAccumulator, LayerReport, SpanReport, UnitMeasure,
};
use super::policy::{HeadBudget, Timing};
use super::scorer::{ScoreState, Scorer};
use super::select::{ranking, select_top, victim};
use super::{Kept, LayerContext, LayerProfile, PolicyError, Unit, UnitKept, ValidPolicy};
use crate::attention::decode_attention;
use crate::trace::{LayerTensors, Span, TraceReader};
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
    /// Mean retained mass over layers, heads and decode steps.
    pub retained_mass: f64,
    /// Mean top-k recall.
    pub topk_recall: f64,
    /// Mean relative output error (when the trace has values).
    pub output_error: Option<f64>,
    /// Mean cache size over layers, caches and decode steps.
    pub mean_kept: f64,
    /// Span survival, mean over layers.
    pub spans: Vec<SpanReport>,
    /// Per-layer measurements.
    pub layers: Vec<LayerReport>,
}

fn context<'a>(trace: &TraceReader, layer: usize, tensors: &'a LayerTensors) -> LayerContext<'a> {
    let meta = trace.meta();
    LayerContext {
        layer,
        q: tensors.q.view(),
        k: tensors.k.view(),
        v: tensors.v.as_ref().map(|v| v.view()),
        prompt_len: meta.prompt_len,
        scale: meta.scale,
        softcap: meta.softcap,
    }
}

/// Replays `policy` on `trace`.
pub fn replay(trace: &TraceReader, policy: &ValidPolicy) -> Result<ReplayReport, PolicyError> {
    let mut reports = replay_many(trace, std::slice::from_ref(policy), &|| {})?;
    Ok(reports.pop().expect("one report per policy"))
}

/// Replays several policies in one pass over the trace, calling `layer_done` after each layer of
/// each pass (budget passes count once per policy that needs one).
pub fn replay_many(
    trace: &TraceReader,
    policies: &[ValidPolicy],
    layer_done: &(dyn Fn() + Sync),
) -> Result<Vec<ReplayReport>, PolicyError> {
    let budgets = policies
        .iter()
        .map(|policy| layer_budgets_with_progress(trace, policy, layer_done))
        .collect::<Result<Vec<_>, _>>()?;
    let meta = trace.meta();
    let mut per_policy: Vec<Vec<LayerReport>> =
        vec![Vec::with_capacity(meta.n_layers); policies.len()];
    for layer in 0..meta.n_layers {
        let tensors = trace.layer(layer)?;
        let context = context(trace, layer, &tensors);
        let layer_budgets: Vec<usize> = budgets.iter().map(|budgets| budgets[layer]).collect();
        let reports = measure_layer(&context, policies, &layer_budgets, &meta.spans);
        for (slot, report) in per_policy.iter_mut().zip(reports) {
            slot.push(report);
        }
        drop(tensors);
        return_free_memory();
        layer_done();
    }
    Ok(policies
        .iter()
        .zip(per_policy)
        .map(|(policy, layers)| summarise(trace, policy, layers))
        .collect())
}

/// Hands the memory freed by a layer's work back to the system. glibc keeps freed blocks of its
/// per-thread arenas resident, and the reports allocated among them pin them: without this, a
/// 36-policy pass over niah-2k grew resident memory by 34 MB for 4 MB of live results; with it,
/// by 18 MB. (Only glibc's own heap is touched: harmless under another global allocator.)
fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's arenas to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether `policy` keeps one set per cache for the whole decode (prefill timing, no
/// re-selection). Those sets are chosen for the whole layer at once (AdaKV shares a budget
/// between the caches) and are small; the others change at every step and are computed group by
/// group as they are measured, so they never pile up.
fn is_one_shot(policy: &ValidPolicy) -> bool {
    policy.params().timing == Timing::Prefill && !policy.scorer.reselects()
}

/// Replays and measures every policy on one layer, KV group by KV group. With several policies,
/// each group's [`DecodeReference`] is computed once and shared by all of them while they run in
/// parallel; a single policy runs its groups in parallel instead, each choosing its kept sets
/// before computing its reference, so a thread never holds both a scorer's buffers and a
/// reference. One level of parallelism only: nested rayon loops let a waiting thread start more
/// work, and every started policy holds its scorer state, so memory would grow with the grid.
fn measure_layer(
    layer: &LayerContext<'_>,
    policies: &[ValidPolicy],
    budgets: &[usize],
    spans: &[Span],
) -> Vec<LayerReport> {
    let single = policies.len() == 1;
    let units: Vec<Vec<Unit>> = policies.iter().map(|policy| units(layer, policy)).collect();
    let one_shot: Vec<Option<Kept>> = policies
        .par_iter()
        .zip(budgets)
        .zip(&units)
        .map(|((policy, &budget), units)| {
            is_one_shot(policy).then(|| one_shot_kept(layer, units, budget, policy, single))
        })
        .collect();
    let max_top_k = policies.iter().map(|p| p.params().top_k).max().unwrap_or(1);
    // Policy `index`'s caches of KV head `kv_head`: unit, kept sets, budget.
    let group_kept = |index: usize, kv_head: usize| -> Vec<(&Unit, Cow<'_, UnitKept>, usize)> {
        match &one_shot[index] {
            Some(kept) => kept
                .units
                .iter()
                .zip(&kept.kept)
                .zip(&kept.budgets)
                .filter(|((unit, _), _)| unit.kv_head == kv_head)
                .map(|((unit, unit_kept), &budget)| (unit, Cow::Borrowed(unit_kept), budget))
                .collect(),
            None => units[index]
                .iter()
                .filter(|unit| unit.kv_head == kv_head)
                .map(|unit| {
                    let unit_kept = per_step_kept(layer, unit, budgets[index], &policies[index]);
                    (unit, Cow::Owned(unit_kept), budgets[index])
                })
                .collect(),
        }
    };
    let measure_group =
        |index: usize, kept: &[(&Unit, Cow<'_, UnitKept>, usize)], reference: &DecodeReference| {
            let top_k = policies[index].params().top_k;
            kept.iter()
                .map(|(unit, unit_kept, budget)| {
                    measure_unit(layer, unit, unit_kept, *budget, reference, spans, top_k)
                })
                .collect::<Vec<UnitMeasure>>()
        };
    let n_kv_heads = layer.k.shape()[0];
    let mut accumulators: Vec<LayerAccumulator> = policies
        .iter()
        .map(|_| LayerAccumulator::new(layer, spans.len()))
        .collect();
    if single {
        let per_group: Vec<Vec<UnitMeasure>> = (0..n_kv_heads)
            .into_par_iter()
            .map(|kv_head| {
                let kept = group_kept(0, kv_head);
                measure_group(0, &kept, &DecodeReference::new(layer, kv_head, max_top_k))
            })
            .collect();
        for measure in per_group.iter().flatten() {
            accumulators[0].add(measure);
        }
    } else {
        for kv_head in 0..n_kv_heads {
            let reference = DecodeReference::new(layer, kv_head, max_top_k);
            accumulators
                .par_iter_mut()
                .enumerate()
                .for_each(|(index, accumulator)| {
                    let kept = group_kept(index, kv_head);
                    for measure in measure_group(index, &kept, &reference) {
                        accumulator.add(&measure);
                    }
                });
        }
    }
    accumulators
        .into_iter()
        .zip(budgets)
        .map(|(accumulator, &budget)| accumulator.report(layer, budget, spans))
        .collect()
}

/// The kept sets of every cache of one layer, with the budgets of [`layer_budgets`].
pub fn kept_sets(
    trace: &TraceReader,
    policy: &ValidPolicy,
    budgets: &[usize],
    layer: usize,
) -> Result<Kept, PolicyError> {
    let tensors = trace.layer(layer)?;
    let context = context(trace, layer, &tensors);
    let units = units(&context, policy);
    let budget = budgets[layer];
    if is_one_shot(policy) {
        return Ok(one_shot_kept(&context, &units, budget, policy, true));
    }
    Ok(Kept {
        layer_budget: budget,
        budgets: vec![budget; units.len()],
        kept: map_units(&units, true, |unit| {
            per_step_kept(&context, unit, budget, policy)
        }),
        units,
    })
}

/// Per-layer budgets of `policy` on `trace`, after checking that the two fit together.
pub fn layer_budgets(trace: &TraceReader, policy: &ValidPolicy) -> Result<Vec<usize>, PolicyError> {
    layer_budgets_with_progress(trace, policy, &|| {})
}

fn units(layer: &LayerContext<'_>, policy: &ValidPolicy) -> Vec<Unit> {
    Unit::all(
        layer.q.shape()[0],
        layer.k.shape()[0],
        policy.params().gqa == super::Granularity::QueryHead,
    )
}

/// Runs `work` on every layer, one layer resident at a time, and returns the results in order.
fn for_each_layer<T: Send>(
    trace: &TraceReader,
    layer_done: &(dyn Fn() + Sync),
    work: &(dyn Fn(LayerContext<'_>) -> T + Sync),
) -> Result<Vec<T>, PolicyError> {
    (0..trace.meta().n_layers)
        .map(|layer| {
            let tensors = trace.layer(layer)?;
            let result = work(context(trace, layer, &tensors));
            layer_done();
            Ok(result)
        })
        .collect()
}

fn layer_budgets_with_progress(
    trace: &TraceReader,
    policy: &ValidPolicy,
    layer_done: &(dyn Fn() + Sync),
) -> Result<Vec<usize>, PolicyError> {
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
    if params.window + params.sinks > prompt_len {
        return Err(mismatch(format!(
            "window {} + sinks {} is longer than the prompt ({prompt_len} tokens)",
            params.window, params.sinks
        )));
    }
    let units = Unit::all(
        meta.n_heads,
        meta.n_kv_heads,
        params.gqa == super::Granularity::QueryHead,
    );
    let profiles = if policy.allocator.needs_profile() {
        for_each_layer(trace, layer_done, &|layer| {
            LayerProfile::measure(&layer, params.window.max(1))
        })?
    } else {
        Vec::new()
    };
    let mass_curves = if policy.allocator.needs_mass_curves() {
        for_each_layer(trace, layer_done, &|layer| {
            mass_curve(&layer, &units, policy)
        })?
    } else {
        Vec::new()
    };
    let budgets = policy.allocator.allocate(&AllocationInput {
        n_layers: meta.n_layers,
        budget: params.budget,
        prompt_len,
        window: params.window,
        sinks: params.sinks,
        profiles: &profiles,
        mass_curves: &mass_curves,
    });
    for (layer, &budget) in budgets.iter().enumerate() {
        if budget < params.sinks + params.window || budget == 0 {
            return Err(PolicyError::BudgetBelowProtected {
                budget,
                sinks: params.sinks,
                window: params.window,
                layer: Some(layer),
            });
        }
    }
    Ok(budgets)
}

fn summarise(trace: &TraceReader, policy: &ValidPolicy, layers: Vec<LayerReport>) -> ReplayReport {
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
    ReplayReport {
        trace: trace.path().display().to_string(),
        policy: policy.label(),
        settings: policy.settings(),
        nominal_budget: policy.params().budget,
        retained_mass: mean(&|l| l.retained_mass),
        topk_recall: mean(&|l| l.topk_recall),
        output_error: layers
            .iter()
            .map(|l| l.output_error)
            .sum::<Option<f64>>()
            .map(|total| total / n),
        mean_kept: mean(&|l| l.mean_kept),
        spans,
        layers,
    }
}

/// Feeds the prompt to a fresh state without evicting; returns its scores.
fn score_prompt<'a>(scorer: &dyn Scorer, layer: &LayerContext<'a>, unit: &Unit) -> Vec<f32> {
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
fn map_units<T: Send>(
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
fn one_shot_kept(
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
fn per_step_kept(
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
pub(crate) fn adakv_budgets(
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

/// Retained mass of a layer (mean over query heads and decode steps) against the number of prompt
/// tokens kept in the scorer's order, index b = b tokens; generated tokens are left out (they are
/// the same for every budget).
fn mass_curve(layer: &LayerContext<'_>, units: &[Unit], policy: &ValidPolicy) -> Vec<f64> {
    let params = policy.params();
    let prompt_len = layer.prompt_len;
    let n_heads = layer.q.shape()[0];
    let n_steps = layer.n_positions() - prompt_len;
    let samples = (n_heads * n_steps) as f64;
    let prompt: Vec<usize> = (0..prompt_len).collect();
    let mut curve = vec![0.0f64; prompt_len + 1];
    for unit in units {
        let scores = score_prompt(policy.scorer.as_ref(), layer, unit);
        let order = ranking(&prompt, &scores, |position| {
            position < params.sinks || position + params.window >= prompt_len
        });
        let decode = decode_attention(
            layer.q.slice(ndarray::s![unit.query_heads.clone(), .., ..]),
            layer.keys(unit.kv_head),
            prompt_len,
            layer.scale,
            layer.softcap,
        );
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
    curve
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
