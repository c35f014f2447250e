//! What a kept set costs, measured on the full model's decode queries.
//!
//! A sample is one query head h of layer l at decode step t (query position `prompt_len + t`),
//! with `p` the full causal softmax over keys `0..=position` and `S` the positions h's cache
//! keeps. Each [`Metric`] is one file and one line of [`REGISTRY`], and is carried by its id
//! through the layer and run reports, stored runs, Parquet/CSV columns, Markdown and JSON:
//! retained mass (`retained_mass.rs`), top-k recall (`topk_recall.rs`), output error
//! (`output_error.rs`), value-weighted retained mass (`value_weighted_mass.rs`) and the value gap,
//! the output error's second factor (`value_gap.rs`). Beside them: span survival (the share of a span's tokens in S, and the full
//! attention mass on the span that S keeps, next to the mass on the whole span) and memory (the
//! cache's size at each decode step, and the KV entries a layer stores).
//!
//! Masses are order-independent sums ([`mass_sum`]), so where one scorer's one-shot kept sets of a
//! cache are nested, the nested path ([`nested`]) measures their retained mass, top-k recall and
//! span survival in one walk, with the bits each set's own sums give.
//!
//! Layer figures are means over query heads of each head's mean over decode steps; overall
//! figures are means over layers (every layer has the same number of heads and steps, so this is
//! the grand mean).

use super::merge::{DecodeMergedValues, MergedValues};
#[cfg(any(test, feature = "reference"))]
use super::reference;
use super::select::ranked_head;
use super::storage::{HeldCache, Storage};
use super::{LayerContext, Unit, UnitKept};
use crate::trace::Span;
use lost::{Dating, LostMassCounter, LostShare, Regions, WHEN};
use ndarray::{s, Array3, ArrayView1, ArrayView2, Axis};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::ops::Range;

/// Registers the metrics, one line each (`module::Type`), in column order: [`REGISTRY`] (the
/// modules are declared beside it, written out).
macro_rules! metrics {
    ($( $module:ident :: $metric:ident ),+ $(,)?) => {
        /// Every metric, in the order of the columns that show them.
        pub const REGISTRY: &[&dyn Metric] = &[ $( &$module::$metric ),+ ];
    };
}

mod kept_output;
pub mod lost;
mod mass_sum;
mod nested;
mod output_error;
mod policy_attention;
mod retained_mass;
mod topk_recall;
mod value_gap;
mod value_weighted_mass;

pub use nested::{nested_shares, CacheShares, KeptShare};
pub use policy_attention::PolicyAttention;

metrics! {
    retained_mass::RetainedMass,
    topk_recall::TopkRecall,
    output_error::OutputError,
    value_weighted_mass::ValueWeightedMass,
    value_gap::ValueGap,
}

/// The means of every registered metric over a layer's (query head, decode step) samples under
/// the kept sets `kept` (per cache, per decode step), by metric id, each sample computed from the
/// metric's brute-force definition ([`Metric::reference`]); `held`, for a cache that stores its entries otherwise than captured, is what
/// each cache holds at each step ([`reference::held_by_step`]). A metric without a definition is
/// an error naming it.
#[cfg(any(test, feature = "reference"))]
pub fn reference_means(
    layer: &reference::Layer,
    kept: &[Vec<Vec<usize>>],
    (per_query_head, top_k): (bool, usize),
    held: Option<&[Vec<reference::Held>]>,
) -> Result<Vec<(&'static str, f64)>, String> {
    let n = layer.prompt_len;
    let registry = REGISTRY;
    let mut sums = vec![0.0; registry.len()];
    let mut count = 0.0;
    for head in 0..layer.q.shape()[0] {
        let kv = head / layer.group();
        let unit = if per_query_head { head } else { kv };
        for at in n..layer.t() {
            let sample = reference::Sample::new(layer, head, kv, at, &kept[unit][at - n], top_k);
            let sample = match held {
                Some(held) => sample.over(&held[unit][at - n]),
                None => sample,
            };
            for (sum, metric) in sums.iter_mut().zip(registry) {
                *sum += metric.reference(&sample).ok_or_else(|| {
                    format!("metric `{}` has no brute-force reference", metric.id())
                })?;
            }
            count += 1.0;
        }
    }
    Ok(registry
        .iter()
        .zip(sums)
        .map(|(metric, sum)| (metric.id(), sum / count))
        .collect())
}

/// The id of retained mass, the metric experiment tables and confidence intervals are built on.
pub const RETAINED_MASS: &str = "retained_mass";

/// A measurement of one sample: one query head's kept set at one decode step, against the full
/// model's attention.
pub trait Metric: Send + Sync {
    /// The id: the key in JSON, stored runs and Parquet/CSV columns.
    fn id(&self) -> &'static str;
    /// The column title in tables.
    fn title(&self) -> &'static str;
    /// What it measures, in one or two sentences (`kvreplay methods`, `docs/methods.md`).
    fn about(&self) -> &'static str;
    /// Whether it needs the trace's values (traces without them leave it out).
    fn needs_values(&self) -> bool {
        false
    }
    /// Whether a lower value is a better cache (an error), where a higher one is (a mass).
    fn lower_is_better(&self) -> bool {
        false
    }
    /// Its value on one sample.
    fn sample(&self, sample: &Sample<'_>) -> f64;
    /// Its value on one sample by its definition, in f64 over every position the query sees
    /// ([`crate::replay::reference`]): the conformance tests compare the engine with it. A metric
    /// without one fails them, naming it.
    #[cfg(any(test, feature = "reference"))]
    fn reference(&self, _sample: &crate::replay::reference::Sample<'_>) -> Option<f64> {
        None
    }
}

/// What a metric sees of one sample.
pub struct Sample<'a> {
    /// The full causal attention of the query over keys `0..=position`.
    pub weights: &'a [f32],
    /// The kept positions.
    pub kept: &'a [usize],
    /// k of the top-k recall: the policy's, or the number of keys the query sees where fewer.
    pub top_k: usize,
    /// How many of the positions of the `top_k` largest full-attention weights (ties to the lower
    /// position) are kept.
    pub top_kept: usize,
    /// The full-attention mass on the kept positions (an order-independent sum,
    /// [`mass_sum::MassSum`]).
    pub kept_mass: f64,
    /// `Σ p_j v_j` over the kept positions (not renormalised), in f64 summed in kept order, when
    /// the trace has values.
    pub kept_output: Option<&'a [f64]>,
    /// The full-cache attention output `o_full` of the query, when the trace has values.
    pub full_output: Option<ArrayView1<'a, f64>>,
    /// Per position `0..T`, the L1 norm of its value, when the trace has values.
    pub value_norms: Option<&'a [f64]>,
    /// `sum_j p_j |v_j|_1` over the full cache, when the trace has values.
    pub full_value_mass: Option<f64>,
    /// `sum_j p_j` over the full cache in f64 (1 up to the weights' rounding).
    pub total_mass: f64,
    /// The query's own attention over a cache that stores its entries otherwise than captured (a
    /// quantizer, pruned key channels); `None` for a cache that only evicts, whose attention is the full one
    /// renormalised over the kept positions.
    pub policy: Option<&'a PolicyAttention>,
}

impl<'a> Sample<'a> {
    /// The kept full-attention mass the cache's attention still puts where the full one does,
    /// `Σ_kept min(p_j, m·p̂_j)` with `m = Σ_kept p_j`: the kept mass `m` for a cache that only
    /// evicts (there `m·p̂_j = p_j`), one minus the total-variation distance between `p` and `p̂`
    /// for one that only quantizes (`m = 1`), and below `m` where quantization moves the kept
    /// weights.
    pub fn retained(&self) -> f64 {
        match self.policy {
            None => self.kept_mass,
            Some(_) => self.shared().map(|(_, shared)| shared).sum(),
        }
    }

    /// Per kept position `j`, `min(p_j, m·p̂_j)` (`p_j` where the cache only evicts).
    pub fn shared(&self) -> impl Iterator<Item = (usize, f64)> + use<'_, 'a> {
        let m = self.kept_mass;
        self.kept.iter().enumerate().map(move |(i, &j)| {
            let p = self.weights[j] as f64;
            match self.policy {
                None => (j, p),
                Some(policy) => (j, p.min(m * policy.weights[i])),
            }
        })
    }
}

/// Span survival, averaged over heads and decode steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpanReport {
    /// The span's name.
    pub name: String,
    /// Share of the span's tokens kept.
    pub kept_fraction: f64,
    /// Full-attention mass on the kept tokens of the span.
    pub kept_mass: f64,
    /// Full-attention mass on the whole span.
    pub full_mass: f64,
}

/// One layer's measurements.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerReport {
    /// Layer index.
    pub layer: usize,
    /// The allocator's budget for this layer's caches.
    pub budget: usize,
    /// Budget of each cache (differs from `budget` under AdaKV).
    pub unit_budgets: Vec<usize>,
    /// Mean cache size over caches and decode steps (generated tokens included).
    pub mean_kept: f64,
    /// Mean cache size of each cache.
    pub kept_by_unit: Vec<f64>,
    /// KV entries the layer stores, mean over decode steps: the sum of its caches' sizes (a
    /// query-head cache holds its own copy of the repeated K/V; under `gqa = layer` every KV head
    /// holds the shared set), each entry one key and one value of `head_dim`.
    pub kv_entries: f64,
    /// KV entries the layer holds, mean over decode steps: `kv_entries` for a policy that evicts;
    /// for a re-selecting timing (dynamic sparse attention: Quest, the per-step oracle), which
    /// evicts nothing and reads `kv_entries` of the cache at each step, the whole cache, one
    /// entry per position and KV head.
    pub held_entries: f64,
    /// Bytes the layer's caches hold, mean over decode steps: `held_entries` keys and values at
    /// the trace's width, or as its storage holds them (integers at their bits, a scale and a
    /// minimum per group at the trace's width, the full-precision window; keys without their
    /// pruned channels, and the channel mask).
    pub kv_bytes: f64,
    /// Each metric's mean over query heads (of its mean over decode steps), by id; a metric that
    /// needs values is absent from traces without them.
    #[serde(flatten)]
    pub metrics: BTreeMap<String, f64>,
    /// Each metric per query head and decode step, by id.
    pub samples: BTreeMap<String, Vec<Vec<f64>>>,
    /// Span survival.
    pub spans: Vec<SpanReport>,
    /// The lost mass by region of the context ([`lost`]), mean over query heads and steps.
    pub lost_by_region: Vec<LostShare>,
    /// The lost mass by when it left the cache ([`lost::WHEN`]), mean over query heads and steps.
    pub lost_by_when: Vec<LostShare>,
}

impl LayerReport {
    /// The mean of metric `id`, if it was measured.
    pub fn metric(&self, id: &str) -> Option<f64> {
        self.metrics.get(id).copied()
    }
}

/// `f` of each decode query's full attention (over `0..=position`) and position, for
/// `attention` `[heads, steps, T]`, in (head, step) order.
fn per_query<T: Send>(
    attention: &Array3<f32>,
    prompt_len: usize,
    parallel: bool,
    f: impl Fn(&[f32], usize) -> T + Sync,
) -> Vec<T> {
    let (heads, steps, _) = attention.dim();
    let one = |index: usize| {
        let (head, step) = (index / steps, index % steps);
        let position = prompt_len + step;
        let weights = attention.slice(s![head, step, ..=position]);
        f(weights.to_slice().expect("standard layout"), position)
    };
    match parallel {
        true => (0..heads * steps).into_par_iter().map(one).collect(),
        false => (0..heads * steps).map(one).collect(),
    }
}

/// Positions per block of the full outputs' sums.
const OUTPUT_BLOCK: usize = 64;

/// `o_full` of each row of weights (over every position, those after its query holding 0) into
/// `out` (`rows × d`, zero): by blocks of [`OUTPUT_BLOCK`] positions, each block summed on its
/// own (each lane in position order, in f64) and then added to the output — the summation order
/// of the f64 matrix product that defines the stored results.
fn full_outputs(rows: &[&[f32]], values: ArrayView2<f32>, out: &mut [f64]) {
    let mut block_sums = vec![0.0f64; out.len()];
    let positions: Vec<usize> = (0..values.nrows()).collect();
    for block in positions.chunks(OUTPUT_BLOCK) {
        block_sums.fill(0.0);
        kept_output::add_kept_outputs(block, rows, values, &mut block_sums);
        for (sum, block) in out.iter_mut().zip(&block_sums) {
            *sum += block;
        }
    }
}

/// What every policy is measured against, for the query heads of one KV group: the full causal
/// attention of their decode queries, their full-cache attention outputs, and the order of their
/// largest weights. The engine computes it once per group and layer and shares it between all
/// policies; groups are done one after another, so only a group's share of a layer's decode
/// attention is ever held.
#[derive(Debug, Clone)]
pub struct DecodeReference {
    /// The query heads covered (one KV group).
    pub heads: Range<usize>,
    /// `[heads, steps, T]` (keys after a query's position hold 0).
    pub attention: Array3<f32>,
    /// `o_full`, `[heads, steps, head_dim]`, when the trace has values: `attention · V` as an f64
    /// product of the f32 weights and values (each term exact, so the output of what a policy
    /// discards, `o_full` less the kept share, keeps its digits even when that share is tiny).
    pub output: Option<Array3<f64>>,
    /// Per `(head - heads.start) * steps + step`, the `max_top_k` largest weights' positions
    /// among the keys its query sees, largest first, ties to the lower position.
    pub top: Vec<Vec<usize>>,
    /// Per position, the L1 norm of its value, when the trace has values.
    pub value_norms: Option<Vec<f64>>,
    /// Per `(head - heads.start) * steps + step`, `sum_j p_j |v_j|_1` over the full cache (empty
    /// without values).
    pub value_mass: Vec<f64>,
    /// Per `(head - heads.start) * steps + step`, `sum_j p_j` over the full cache in f64 (1 up to
    /// the f32 weights' rounding).
    pub total_mass: Vec<f64>,
    /// The trace's regions ([`lost`]).
    regions: Regions,
    /// Per `(head - heads.start) * steps + step`, the full mass in each region.
    region_mass: Vec<Vec<f64>>,
    /// Per `(head - heads.start) * steps + step`, the full mass on each span of the trace (up to
    /// the query's own position), summed in position order.
    span_mass: Vec<Vec<f64>>,
}

impl DecodeReference {
    /// Computes the reference of KV head `kv_head`'s query heads for top-k recalls up to
    /// `max_top_k`, its per-head parts in parallel when `parallel` (only where no other task of
    /// the caller waits to start: a thread waiting inside would start it, and hold its memory).
    pub fn new(
        layer: &LayerContext<'_>,
        kv_head: usize,
        max_top_k: usize,
        spans: &[Span],
        parallel: bool,
    ) -> Self {
        let group = layer.group_size();
        let heads = kv_head * group..(kv_head + 1) * group;
        let attention = layer.decode_attention(heads.clone());
        let n_steps = attention.dim().1;
        let output = layer.values(kv_head).map(|values| {
            let mut output = Array3::<f64>::zeros((group, n_steps, values.ncols()));
            // One task per head, all its steps at once.
            let head_output = |(head, mut out): (usize, ndarray::ArrayViewMut2<f64>)| {
                let rows: Vec<&[f32]> = (0..n_steps)
                    .map(|step| {
                        let row = attention.slice(s![head, step, ..]);
                        row.to_slice().expect("standard layout")
                    })
                    .collect();
                let out = out.as_slice_mut().expect("standard layout");
                full_outputs(&rows, values, out);
            };
            let heads = output.axis_iter_mut(Axis(0)).enumerate();
            match parallel {
                true => heads.par_bridge().for_each(head_output),
                false => heads.for_each(head_output),
            }
            output
        });
        let top = per_query(
            &attention,
            layer.prompt_len,
            parallel,
            |weights, position| {
                // Among the keys the query sees: on a sliding-window layer, its window.
                let first = layer.first_visible(position);
                let visible: Vec<usize> = (first..weights.len()).collect();
                ranked_head(&visible, &weights[first..], max_top_k, |_| false)
            },
        );
        let value_norms: Option<Vec<f64>> = layer.values(kv_head).map(|values| {
            values
                .rows()
                .into_iter()
                .map(|row| row.iter().map(|x| x.abs() as f64).sum())
                .collect()
        });
        let prompt_len = layer.prompt_len;
        let value_mass = value_norms.as_ref().map_or_else(Vec::new, |norms| {
            per_query(&attention, prompt_len, parallel, |weights, _| {
                weights.iter().zip(norms).map(|(&p, n)| p as f64 * n).sum()
            })
        });
        let total_mass = per_query(&attention, prompt_len, parallel, |weights, _| {
            weights.iter().map(|&p| p as f64).sum()
        });
        let regions = Regions::new(layer.n_positions(), spans);
        let region_mass = per_query(&attention, prompt_len, parallel, |weights, position| {
            regions.full_mass(weights, position)
        });
        let span_mass = per_query(&attention, prompt_len, parallel, |weights, position| {
            let seen = |span: &Span| {
                let end = span.end.min(position + 1);
                span.start.min(end)..end
            };
            let mass = |span: &Span| weights[seen(span)].iter().map(|&p| p as f64).sum();
            spans.iter().map(mass).collect()
        });
        Self {
            heads,
            attention,
            output,
            top,
            value_norms,
            value_mass,
            total_mass,
            regions,
            region_mass,
            span_mass,
        }
    }

    /// The full attention of query head `head` at decode step `step` over keys `0..=position`.
    fn weights(&self, head: usize, step: usize, position: usize) -> &[f32] {
        self.attention
            .slice(s![head - self.heads.start, step, ..=position])
            .to_slice()
            .expect("standard layout")
    }
}

/// One cache's measurements, kept per decode step and query head (step-major), so that a
/// layer's figures are summed in one fixed order whatever order its caches were measured in.
#[derive(Debug, Clone)]
pub struct UnitMeasure {
    /// The query heads reading the cache.
    heads: Range<usize>,
    /// The cache's budget.
    budget: usize,
    /// Cache size summed over decode steps.
    kept_total: usize,
    /// Bytes held summed over decode steps, for a cache that stores its entries otherwise than
    /// captured.
    bytes_total: f64,
    /// Per metric of [`REGISTRY`] (empty for one not measured), per (step, head), its value.
    metrics: Vec<Vec<f64>>,
    /// Per (step, head, span): share of the span's tokens kept, kept mass, full mass.
    spans: Vec<(f64, f64, f64)>,
    /// Per (step, head), the lost mass in each bucket of [`LostMassCounter`].
    lost: Vec<f64>,
}

/// What measuring a cache needs besides the cache: the trace's spans, the k of top-k recall, and
/// how the policy's losses are dated.
#[derive(Debug, Clone, Copy)]
pub struct MeasureSettings<'a> {
    /// The trace's named spans.
    pub spans: &'a [Span],
    /// k of the top-k recall.
    pub top_k: usize,
    /// How the policy's lost positions are dated.
    pub dating: Dating,
    /// How the caches store their entries.
    pub storage: Storage,
    /// Whether the kept sets are read from a cache that holds every position (a re-selecting
    /// timing), which its storage then holds whole.
    pub reselects: bool,
    /// Bytes of one element at full precision (the trace's storage width).
    pub width: usize,
}

/// Measures one cache's kept sets against its group's shared [`DecodeReference`]; `nested`, when
/// given, holds its kept shares from the nested path ([`nested_shares`]), which are otherwise
/// computed here. The cost per (head, step) is O(kept · head_dim): nothing here walks the evicted
/// positions.
pub fn measure_unit(
    layer: &LayerContext<'_>,
    unit: &Unit,
    unit_kept: &UnitKept,
    budget: usize,
    reference: &DecodeReference,
    settings: MeasureSettings<'_>,
    nested: Option<&CacheShares>,
) -> UnitMeasure {
    let MeasureSettings {
        spans,
        top_k,
        dating,
        storage,
        reselects,
        width,
    } = settings;
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let n_steps = n_positions - prompt_len;
    let merged = merged_values(storage, layer, unit, unit_kept);
    let mut merged_while_decoding = decode_merged_values(storage, layer, unit, unit_kept);
    let values: Option<ArrayView2<f32>> = match &merged {
        Some(merged) => Some(merged.values()),
        None => layer.values(unit.kv_head).map(|values| values.reborrow()),
    };
    let samples = n_steps * unit.query_heads.len();
    let has_values = values.is_some();
    let measured = move |metric: &&dyn Metric| has_values || !metric.needs_values();
    let mut measure = UnitMeasure {
        heads: unit.query_heads.clone(),
        budget,
        kept_total: 0,
        bytes_total: 0.0,
        metrics: REGISTRY
            .iter()
            .map(|metric| Vec::with_capacity(if measured(metric) { samples } else { 0 }))
            .collect(),
        spans: Vec::with_capacity(samples * spans.len()),
        lost: Vec::new(),
    };
    let mut lost = LostMassCounter::new(dating, &reference.regions, prompt_len, n_positions);
    let buckets = lost.buckets();
    measure.lost = vec![0.0; samples * buckets];
    let mut in_set = vec![false; n_positions];
    let shared_prompt = shared_prompt_outputs(layer, unit, unit_kept, reference, values);
    // A fixed prompt set grows by one generated position per step: one buffer, extended.
    let mut fixed = match unit_kept {
        UnitKept::Fixed(prompt) => prompt.clone(),
        UnitKept::PerStep(_) | UnitKept::Compressing(..) => Vec::new(),
    };
    let mut general = GeneralShare::default();
    let d = layer.q.shape()[2];
    let mut stored = HeldCache::new(storage, layer, unit);
    let mut held = Vec::new();
    for step in 0..n_steps {
        let position = prompt_len + step;
        let kept_positions: &[usize] = match unit_kept {
            UnitKept::Fixed(_) => {
                // On a sliding-window layer, what slides out leaves the cache.
                let gone = fixed.partition_point(|&j| j < layer.first_visible(position));
                fixed.drain(..gone);
                fixed.push(position);
                &fixed
            }
            UnitKept::PerStep(steps) | UnitKept::Compressing(steps, _) => &steps[step],
        };
        measure.kept_total += kept_positions.len();
        if let Some(merging) = &mut merged_while_decoding {
            merging.at_step(step, kept_positions);
        }
        let step_values = match &merged_while_decoding {
            Some(merging) => Some(merging.values()),
            None => values.as_ref().map(|values| values.view()),
        };
        if let Some(cache) = &mut stored {
            held.clear();
            match reselects {
                true => held.extend(layer.first_visible(position)..=position),
                false => held.extend_from_slice(kept_positions),
            }
            cache.step(&held, position);
            // A re-selecting timing reads from one whole cache per KV head, which the query-head
            // caches of a group share.
            let share = match reselects {
                true => unit.query_heads.len() as f64 / layer.group_size() as f64,
                false => 1.0,
            };
            measure.bytes_total += cache.bytes(d, width) * share;
        }
        for &j in kept_positions {
            in_set[j] = true;
        }
        let kept_outputs = step_values.as_ref().map(|values| {
            let rows: Vec<&[f32]> = unit
                .query_heads
                .clone()
                .map(|head| reference.weights(head, step, position))
                .collect();
            let (mut sums, rest) = match &shared_prompt {
                Some((prompt_len, shared)) => {
                    let size = rows.len() * values.ncols();
                    let sums = shared[step * size..(step + 1) * size].to_vec();
                    (sums, &kept_positions[*prompt_len..])
                }
                None => (vec![0.0; rows.len() * values.ncols()], kept_positions),
            };
            kept_output::add_kept_outputs(rest, &rows, values.view(), &mut sums);
            sums
        });
        for (index, head) in unit.query_heads.clone().enumerate() {
            let weights = reference.weights(head, step, position);
            let local = head - reference.heads.start;
            let top = &reference.top[local * n_steps + step];
            let top_k = top_k.min(top.len());
            let sample = step * unit.query_heads.len() + index;
            let share = match nested {
                Some(shares) => &shares[sample],
                None => general.of(
                    weights,
                    kept_positions,
                    &in_set,
                    &top[..top_k],
                    spans,
                    position,
                ),
            };
            let policy = stored
                .as_ref()
                .map(|cache| PolicyAttention::new(layer, head, position, kept_positions, cache));
            let metric_sample = Sample {
                weights,
                kept: kept_positions,
                top_k,
                top_kept: share.top_kept,
                kept_mass: share.mass,
                kept_output: kept_outputs
                    .as_deref()
                    .map(|outputs| &outputs[index * d..(index + 1) * d]),
                full_output: reference
                    .output
                    .as_ref()
                    .map(|output| output.slice(s![local, step, ..])),
                value_norms: reference.value_norms.as_deref(),
                full_value_mass: reference.value_mass.get(local * n_steps + step).copied(),
                total_mass: reference.total_mass[local * n_steps + step],
                policy: policy.as_ref(),
            };
            for (metric, out) in REGISTRY.iter().zip(&mut measure.metrics) {
                if measured(metric) {
                    out.push(metric.sample(&metric_sample));
                }
            }
            let full_masses = &reference.span_mass[local * n_steps + step];
            for ((span, &(kept_count, kept_mass)), &full_mass) in
                spans.iter().zip(&share.spans).zip(full_masses)
            {
                let fraction = kept_count as f64 / (span.end - span.start) as f64;
                measure.spans.push((fraction, kept_mass, full_mass));
            }
            lost.count(
                lost::Sample {
                    weights,
                    kept: kept_positions,
                    in_set: &in_set,
                    position,
                },
                &reference.region_mass[local * n_steps + step],
                &mut measure.lost[sample * buckets..(sample + 1) * buckets],
            );
        }
        lost.held(kept_positions);
        for &j in kept_positions {
            in_set[j] = false;
        }
        if let Some(merging) = &mut merged_while_decoding {
            attend(merging, reference, unit, (step, position), kept_positions);
        }
    }
    measure
}

/// Adds decode step `step`'s attention over its cache `kept` to a merging cache's running sums:
/// the mean over the cache's query heads of each head's attention renormalised over `kept`.
fn attend(
    merging: &mut DecodeMergedValues,
    reference: &DecodeReference,
    unit: &Unit,
    (step, position): (usize, usize),
    kept: &[usize],
) {
    let heads = unit.query_heads.len() as f64;
    for head in unit.query_heads.clone() {
        let weights = reference.weights(head, step, position);
        let mass: f64 = kept.iter().map(|&j| weights[j] as f64).sum();
        merging.attend(kept, kept.iter().map(|&j| weights[j] as f64 / mass / heads));
    }
}

/// Under a merge at the compressions made while decoding, the cache's values and running
/// attention, as its compressions change them step by step.
fn decode_merged_values(
    storage: Storage,
    layer: &LayerContext<'_>,
    unit: &Unit,
    unit_kept: &UnitKept,
) -> Option<DecodeMergedValues> {
    let (Storage::MergedWhileDecoding(merge), UnitKept::Compressing(_, evictions)) =
        (storage, unit_kept)
    else {
        return None;
    };
    let values = layer
        .values(unit.kv_head)
        .expect("a merge is refused on a trace without values");
    Some(DecodeMergedValues::new(
        merge,
        values,
        evictions.clone(),
        (layer.layer, unit.index),
    ))
}

/// The general path's [`KeptShare`] of one sample at a time, with its sum's buffer.
#[derive(Default)]
struct GeneralShare {
    sum: mass_sum::MassSum,
    share: KeptShare,
}

impl GeneralShare {
    /// The mass of `kept`, how many of `top` it keeps, and per span its kept tokens and their
    /// mass, up to the query's `position`.
    fn of(
        &mut self,
        weights: &[f32],
        kept: &[usize],
        in_set: &[bool],
        top: &[usize],
        spans: &[Span],
        position: usize,
    ) -> &KeptShare {
        let Self { sum, share } = self;
        sum.clear();
        kept.iter().for_each(|&j| sum.add(weights[j]));
        share.mass = sum.total();
        share.top_kept = top.iter().filter(|&&j| in_set[j]).count();
        share.spans.clear();
        for span in spans {
            sum.clear();
            let mut count = 0;
            for j in (span.start..span.end.min(position + 1)).filter(|&j| in_set[j]) {
                count += 1;
                sum.add(weights[j]);
            }
            share.spans.push((count, sum.total()));
        }
        share
    }
}

/// Under a merge, the cache's values after the cut merged the evicted ones into its kept prompt
/// set (the `prefill` timing's fixed set); its keys are as captured, so its attention is the full
/// one renormalised and only the values it reads differ.
fn merged_values(
    storage: Storage,
    layer: &LayerContext<'_>,
    unit: &Unit,
    unit_kept: &UnitKept,
) -> Option<MergedValues> {
    let (Storage::Merged(merge), UnitKept::Fixed(prompt)) = (storage, unit_kept) else {
        return None;
    };
    Some(MergedValues::new(merge, layer, unit, prompt))
}

/// Under prefill timing, where nothing slides out while the model decodes, every step keeps the
/// same prompt positions: their share of every step's kept outputs (`[steps × heads × d]`),
/// summed in one pass, with the number of kept prompt positions. Each step's sums then continue
/// over its generated positions, in the order a step-by-step sum would take.
fn shared_prompt_outputs(
    layer: &LayerContext<'_>,
    unit: &Unit,
    unit_kept: &UnitKept,
    reference: &DecodeReference,
    values: Option<ArrayView2<f32>>,
) -> Option<(usize, Vec<f64>)> {
    let UnitKept::Fixed(prompt) = unit_kept else {
        return None;
    };
    let last = layer.n_positions() - 1;
    if prompt
        .first()
        .is_some_and(|&first| first < layer.first_visible(last))
    {
        return None;
    }
    let values = values?;
    let prompt_len = layer.prompt_len;
    let rows: Vec<&[f32]> = (prompt_len..=last)
        .flat_map(|position| {
            unit.query_heads
                .clone()
                .map(move |head| reference.weights(head, position - prompt_len, position))
        })
        .collect();
    let mut sums = vec![0.0; rows.len() * values.ncols()];
    kept_output::add_kept_outputs(prompt, &rows, values.view(), &mut sums);
    Some((prompt.len(), sums))
}

/// A layer's measurements being summed, cache by cache in cache order.
#[derive(Debug, Clone)]
pub struct LayerAccumulator {
    n_steps: usize,
    n_heads: usize,
    /// Per metric of [`REGISTRY`] (empty for one not measured), per query head and step.
    metrics: Vec<Vec<Vec<f64>>>,
    span_totals: Vec<(f64, f64, f64)>,
    /// Per bucket of [`LostMassCounter`], the lost mass summed over samples.
    lost_totals: Vec<f64>,
    unit_budgets: Vec<usize>,
    kept_by_unit: Vec<f64>,
    /// Bytes held, summed over caches of their mean over decode steps.
    bytes: f64,
}

impl LayerAccumulator {
    /// An empty sum for a layer of `layer`'s geometry with `n_spans` spans.
    pub fn new(layer: &LayerContext<'_>, n_spans: usize) -> Self {
        let n_steps = layer.n_positions() - layer.prompt_len;
        let n_heads = layer.q.shape()[0];
        Self {
            n_steps,
            n_heads,
            metrics: vec![Vec::new(); REGISTRY.len()],
            span_totals: vec![(0.0, 0.0, 0.0); n_spans],
            lost_totals: vec![0.0; n_spans + 3 + WHEN.len()],
            unit_budgets: Vec::new(),
            kept_by_unit: Vec::new(),
            bytes: 0.0,
        }
    }

    /// Adds the next cache's measurements.
    pub fn add(&mut self, unit: &UnitMeasure) {
        let n_heads = unit.heads.len();
        let n_spans = self.span_totals.len();
        for (matrix, samples) in self.metrics.iter_mut().zip(&unit.metrics) {
            if samples.is_empty() {
                continue;
            }
            if matrix.is_empty() {
                *matrix = vec![vec![0.0; self.n_steps]; self.n_heads];
            }
            for step in 0..self.n_steps {
                for (offset, head) in unit.heads.clone().enumerate() {
                    matrix[head][step] = samples[step * n_heads + offset];
                }
            }
        }
        for sample in 0..self.n_steps * n_heads {
            let spans = &unit.spans[sample * n_spans..(sample + 1) * n_spans];
            for (totals, span) in self.span_totals.iter_mut().zip(spans) {
                totals.0 += span.0;
                totals.1 += span.1;
                totals.2 += span.2;
            }
        }
        let buckets = self.lost_totals.len();
        for sample in unit.lost.chunks(buckets) {
            for (total, value) in self.lost_totals.iter_mut().zip(sample) {
                *total += value;
            }
        }
        self.unit_budgets.push(unit.budget);
        self.kept_by_unit
            .push(unit.kept_total as f64 / self.n_steps as f64);
        self.bytes += unit.bytes_total / self.n_steps as f64;
    }

    /// The layer's report.
    pub fn report(
        self,
        layer: &LayerContext<'_>,
        layer_budget: usize,
        spans: &[Span],
    ) -> LayerReport {
        let (n_steps, n_heads) = (self.n_steps, self.n_heads);
        let samples = (n_heads * n_steps) as f64;
        let mut metrics = BTreeMap::new();
        let mut per_sample = BTreeMap::new();
        for (metric, matrix) in REGISTRY.iter().zip(self.metrics) {
            if matrix.is_empty() {
                continue;
            }
            let by_head = matrix
                .iter()
                .map(|steps| steps.iter().sum::<f64>() / n_steps as f64);
            metrics.insert(
                metric.id().to_owned(),
                by_head.sum::<f64>() / n_heads as f64,
            );
            per_sample.insert(metric.id().to_owned(), matrix);
        }
        LayerReport {
            layer: layer.layer,
            budget: layer_budget,
            unit_budgets: self.unit_budgets,
            mean_kept: self.kept_by_unit.iter().sum::<f64>() / self.kept_by_unit.len() as f64,
            kv_entries: self.kept_by_unit.iter().sum::<f64>(),
            held_entries: self.kept_by_unit.iter().sum::<f64>(),
            kv_bytes: self.bytes,
            kept_by_unit: self.kept_by_unit,
            metrics,
            samples: per_sample,
            lost_by_region: lost::regions(spans)
                .into_iter()
                .zip(&self.lost_totals)
                .map(|(name, total)| LostShare {
                    name,
                    mass: total / samples,
                })
                .collect(),
            lost_by_when: WHEN
                .iter()
                .zip(&self.lost_totals[spans.len() + 3..])
                .map(|(name, total)| LostShare {
                    name: name.to_string(),
                    mass: total / samples,
                })
                .collect(),
            spans: spans
                .iter()
                .zip(self.span_totals)
                .map(|(span, (fraction, kept_mass, full_mass))| SpanReport {
                    name: span.name.clone(),
                    kept_fraction: fraction / samples,
                    kept_mass: kept_mass / samples,
                    full_mass: full_mass / samples,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::scorer::testing::{global_layer, group_unit, hashed_group};
    use super::*;
    use ndarray::Array2;

    #[test]
    fn a_prefill_set_measures_as_the_same_sets_listed_step_by_step() {
        // Two query heads on one KV head, d = 40 (a vector block and a remainder), 50 prompt
        // positions and 10 decode steps: the prompt outputs shared by every step, continued over
        // its generated positions, give the bits of summing each step's whole set afresh.
        let (heads, t, d, prompt_len) = (2, 60, 40, 50);
        let (q, k, v) = hashed_group(heads, t, d);
        let layer = global_layer(&q, &k, Some(&v), prompt_len);
        let unit = group_unit(heads);
        let fixed = UnitKept::Fixed((0..prompt_len).filter(|j| j % 3 != 1).collect());
        let steps = (0..t - prompt_len)
            .map(|step| fixed.kept_positions(step, prompt_len))
            .collect();
        let listed = UnitKept::PerStep(steps);
        let reference = DecodeReference::new(&layer, 0, 5, &[], false);
        let settings = MeasureSettings {
            spans: &[],
            top_k: 5,
            dating: Dating::of(crate::replay::Timing::Prefill),
            storage: Storage::Captured,
            reselects: false,
            width: 2,
        };
        let shared = measure_unit(&layer, &unit, &fixed, 34, &reference, settings, None);
        let afresh = measure_unit(&layer, &unit, &listed, 34, &reference, settings, None);
        assert_eq!(shared.metrics, afresh.metrics);
        let error = REGISTRY
            .iter()
            .position(|m| m.id() == "output_error")
            .unwrap();
        assert!(shared.metrics[error].iter().all(|&e| e > 0.0));
    }

    #[test]
    fn full_outputs_are_the_blocked_f64_matrix_product_bit_for_bit() {
        // The reference: ndarray's f64 product (matrixmultiply) of each block of positions,
        // added block after block; shapes of SmolLM2 (d = 64) and Gemma 3 (d = 256), partial
        // blocks and lanes that are not a multiple of a vector.
        for (steps, t, d) in [(32, 2032, 64), (16, 300, 256), (3, 70, 40), (33, 129, 64)] {
            let unit = |i: usize| (((i * 2654435761) % 100003) as f32 / 100003.0 - 0.5) * 1.7;
            let values = Array2::from_shape_fn((t, d), |(r, c)| unit(r * d + c + 7) * 3.0);
            let weights =
                Array2::from_shape_fn((steps, t), |(r, c)| unit(r * 31 + c * 7 + 3).abs() / 100.0);
            let mut product = Array2::<f64>::zeros((steps, d));
            for start in (0..t).step_by(OUTPUT_BLOCK) {
                let end = (start + OUTPUT_BLOCK).min(t);
                let block = values.slice(s![start..end, ..]).mapv(f64::from);
                product += &weights
                    .slice(s![.., start..end])
                    .mapv(f64::from)
                    .dot(&block);
            }
            let rows: Vec<&[f32]> = weights
                .rows()
                .into_iter()
                .map(|r| r.to_slice().unwrap())
                .collect();
            let mut outputs = vec![0.0; steps * d];
            full_outputs(&rows, values.view(), &mut outputs);
            assert_eq!(
                product.as_slice().unwrap(),
                &outputs[..],
                "{steps} steps, T = {t}, d = {d}"
            );
        }
    }
}
