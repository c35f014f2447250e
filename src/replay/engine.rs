//! Runs a checked policy over a trace, layer by layer, and collects the measurements.
//!
//! Order of work: (1) when the allocator asks, a first pass computes each layer's window profile
//! or mass curve; (2) the allocator turns them into per-layer budgets; (3) each layer is replayed
//! (in parallel; results collected in layer order, so bit-identical for any thread count) and
//! measured by [`super::metrics::measure`].

use super::allocator::AllocationInput;
use super::metrics::{measure, LayerReport, SpanReport};
use super::policy::{HeadBudget, Timing};
use super::scorer::{ScoreState, Scorer};
use super::select::{ranking, select_top, victim};
use super::{Kept, LayerContext, LayerProfile, PolicyError, Unit, UnitKept, ValidPolicy};
use crate::attention::attend;
use crate::trace::{LayerTensors, TraceReader};
use ndarray::s;
use rayon::prelude::*;
use serde::Serialize;
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
    replay_with_progress(trace, policy, &|| {})
}

/// Replays `policy` on `trace`, calling `layer_done` after each layer of each pass.
pub fn replay_with_progress(
    trace: &TraceReader,
    policy: &ValidPolicy,
    layer_done: &(dyn Fn() + Sync),
) -> Result<ReplayReport, PolicyError> {
    let budgets = layer_budgets_with_progress(trace, policy, layer_done)?;
    let units = units(trace, policy);
    let meta = trace.meta();
    let layers = for_each_layer(trace, layer_done, &|layer| {
        let kept = replay_layer(&layer, &units, budgets[layer.layer], policy);
        measure(&layer, &kept, &meta.spans, policy.params().top_k)
    })?;
    Ok(summarise(trace, policy, layers))
}

/// The kept sets of every cache of one layer, with the budgets of [`layer_budgets`].
pub fn kept_sets(
    trace: &TraceReader,
    policy: &ValidPolicy,
    budgets: &[usize],
    layer: usize,
) -> Result<Kept, PolicyError> {
    let tensors = trace.layer(layer)?;
    Ok(replay_layer(
        &context(trace, layer, &tensors),
        &units(trace, policy),
        budgets[layer],
        policy,
    ))
}

/// Per-layer budgets of `policy` on `trace`, after checking that the two fit together.
pub fn layer_budgets(trace: &TraceReader, policy: &ValidPolicy) -> Result<Vec<usize>, PolicyError> {
    layer_budgets_with_progress(trace, policy, &|| {})
}

fn units(trace: &TraceReader, policy: &ValidPolicy) -> Vec<Unit> {
    let meta = trace.meta();
    Unit::all(
        meta.n_heads,
        meta.n_kv_heads,
        policy.params().gqa == super::Granularity::QueryHead,
    )
}

/// Runs `work` on every layer (in parallel) and returns the results in layer order.
fn for_each_layer<T: Send>(
    trace: &TraceReader,
    layer_done: &(dyn Fn() + Sync),
    work: &(dyn Fn(LayerContext<'_>) -> T + Sync),
) -> Result<Vec<T>, PolicyError> {
    (0..trace.meta().n_layers)
        .into_par_iter()
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
    let units = units(trace, policy);
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

/// Feeds the prompt to a fresh state without evicting; returns the state and its scores.
fn score_prompt<'a>(
    scorer: &dyn Scorer,
    layer: &LayerContext<'a>,
    unit: &Unit,
) -> (Box<dyn ScoreState + 'a>, Vec<f32>) {
    let mut state = scorer.start(layer, unit);
    let mut cache = Vec::with_capacity(layer.n_positions());
    for position in 0..layer.prompt_len {
        cache.push(position);
        state.on_append(&cache);
    }
    let mut scores = Vec::new();
    state.scores(&cache, &mut scores);
    (state, scores)
}

/// Replays one layer: the kept sets of every cache.
fn replay_layer(
    layer: &LayerContext<'_>,
    units: &[Unit],
    budget: usize,
    policy: &ValidPolicy,
) -> Kept {
    let params = policy.params();
    let scorer = policy.scorer.as_ref();
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let protected_prompt =
        |position: usize| position < params.sinks || position + params.window >= prompt_len;
    let mut budgets = vec![budget; units.len()];
    let kept = match (params.timing, scorer.reselects()) {
        (Timing::Prefill, false) => {
            let scored: Vec<Vec<f32>> = units
                .iter()
                .map(|unit| score_prompt(scorer, layer, unit).1)
                .collect();
            if params.heads == HeadBudget::Adakv {
                budgets = adakv_budgets(
                    &scored,
                    budget,
                    params.sinks,
                    params.window,
                    params.alpha,
                    prompt_len,
                );
            }
            let prompt: Vec<usize> = (0..prompt_len).collect();
            scored
                .iter()
                .zip(&budgets)
                .map(|(scores, &unit_budget)| {
                    UnitKept::Fixed(select_top(&prompt, scores, unit_budget, protected_prompt))
                })
                .collect()
        }
        (timing, true) => units
            .iter()
            .map(|unit| {
                let mut state = scorer.start(layer, unit);
                let mut scores = Vec::new();
                let steps = (prompt_len..n_positions)
                    .map(|position| {
                        let cache: Vec<usize> = (0..=position).collect();
                        state.on_append(&cache);
                        state.scores(&cache, &mut scores);
                        let limit = if timing == Timing::Prefill {
                            prompt_len
                        } else {
                            position + 1
                        };
                        let mut kept =
                            select_top(&cache[..limit], &scores[..limit], budget, |_| false);
                        kept.extend(limit..=position);
                        kept
                    })
                    .collect();
                UnitKept::PerStep(steps)
            })
            .collect(),
        (Timing::Streaming, false) => units
            .iter()
            .map(|unit| {
                let mut state = scorer.start(layer, unit);
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
            })
            .collect(),
    };
    Kept {
        layer_budget: budget,
        units: units.to_vec(),
        budgets,
        kept,
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
    let n_positions = layer.n_positions();
    let n_heads = layer.q.shape()[0];
    let samples = (n_heads * (n_positions - prompt_len)) as f64;
    let prompt: Vec<usize> = (0..prompt_len).collect();
    let mut curve = vec![0.0f64; prompt_len + 1];
    for unit in units {
        let (_, scores) = score_prompt(policy.scorer.as_ref(), layer, unit);
        let order = ranking(&prompt, &scores, |position| {
            position < params.sinks || position + params.window >= prompt_len
        });
        let mut weight = vec![0.0f64; prompt_len];
        let keys = layer.keys(unit.kv_head);
        for head in unit.query_heads.clone() {
            for position in prompt_len..n_positions {
                let weights = attend(
                    layer.query(head, position),
                    keys.slice(s![..=position, ..]),
                    layer.scale,
                    layer.softcap,
                );
                for (total, w) in weight.iter_mut().zip(&weights[..prompt_len]) {
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
