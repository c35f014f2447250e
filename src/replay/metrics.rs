//! What a kept set costs, measured on the full model's decode queries.
//!
//! For layer l, query head h and decode step t (query position `prompt_len + t`), with `p` the
//! full causal softmax over keys `0..=position` and `S` the positions h's cache keeps:
//! - retained mass `sum_{j in S} p_j` (attention recall; CateKV);
//! - top-k recall: the share of `p`'s k largest (ties to the lower position) that are in S (Quest);
//! - output error `|o_full - o_kept| / |o_full|`, `o_full = sum_j p_j v_j`, `o_kept` the same over
//!   S renormalised by the retained mass (MagicPIG); 1 when nothing of mass is kept;
//! - span survival: the share of a span's tokens in S, and the full attention mass on the span
//!   that S keeps, next to the mass on the whole span;
//! - memory: the cache's size at each decode step.
//!
//! Layer figures are means over query heads and decode steps; overall figures are means over
//! layers (every layer has the same number of heads and steps, so this is the grand mean).

use super::{LayerContext, Unit, UnitKept};
use crate::trace::Span;
use ndarray::{s, Array3, Axis};
use serde::Serialize;
use std::ops::Range;

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
    /// Mean retained mass.
    pub retained_mass: f64,
    /// Mean top-k recall.
    pub topk_recall: f64,
    /// Mean relative output error, when the trace has values.
    pub output_error: Option<f64>,
    /// Retained mass per query head (mean over steps).
    pub retained_by_head: Vec<f64>,
    /// Retained mass per decode step (mean over heads).
    pub retained_by_step: Vec<f64>,
    /// Retained mass per query head and decode step.
    pub retained_head_step: Vec<Vec<f64>>,
    /// Span survival.
    pub spans: Vec<SpanReport>,
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
    /// `o_full`, `[heads, steps, head_dim]`, when the trace has values (an f32 product
    /// `attention · V`, relative error ~1e-6, stored as f64).
    pub output: Option<Array3<f64>>,
    /// Per `(head - heads.start) * steps + step`, the `max_top_k` largest weights' positions,
    /// largest first, ties to the lower position.
    pub top: Vec<Vec<usize>>,
}

impl DecodeReference {
    /// Computes the reference of KV head `kv_head`'s query heads for top-k recalls up to
    /// `max_top_k`.
    pub fn new(layer: &LayerContext<'_>, kv_head: usize, max_top_k: usize) -> Self {
        let group = layer.group_size();
        let heads = kv_head * group..(kv_head + 1) * group;
        let attention = layer.decode_attention(heads.clone());
        let n_steps = attention.dim().1;
        let output = layer.values(kv_head).map(|values| {
            let mut output = Array3::<f64>::zeros((group, n_steps, values.ncols()));
            for head in 0..group {
                let full = attention.index_axis(Axis(0), head).dot(&values);
                output
                    .index_axis_mut(Axis(0), head)
                    .assign(&full.mapv(f64::from));
            }
            output
        });
        let mut top = Vec::with_capacity(group * n_steps);
        let mut order: Vec<usize> = Vec::with_capacity(layer.n_positions());
        for head in 0..group {
            for step in 0..n_steps {
                let position = layer.prompt_len + step;
                let weights = attention.slice(s![head, step, ..=position]);
                let weights = weights.to_slice().expect("standard layout");
                order.clear();
                order.extend(0..weights.len());
                let by_weight =
                    |a: &usize, b: &usize| weights[*b].total_cmp(&weights[*a]).then(a.cmp(b));
                let k = max_top_k.min(order.len());
                if k < order.len() {
                    order.select_nth_unstable_by(k - 1, by_weight);
                }
                order.truncate(k);
                order.sort_by(by_weight);
                top.push(order.clone());
            }
        }
        Self {
            heads,
            attention,
            output,
            top,
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
    /// Per (step, head): retained mass, top-k recall, output error.
    retained: Vec<f64>,
    recall: Vec<f64>,
    error: Vec<f64>,
    /// Per (step, head, span): share of the span's tokens kept, kept mass, full mass.
    spans: Vec<(f64, f64, f64)>,
}

/// Measures one cache's kept sets against its group's shared [`DecodeReference`]. The cost per
/// (head, step) is O(kept · head_dim): nothing here walks the evicted positions.
pub fn measure_unit(
    layer: &LayerContext<'_>,
    unit: &Unit,
    unit_kept: &UnitKept,
    budget: usize,
    reference: &DecodeReference,
    spans: &[Span],
    top_k: usize,
) -> UnitMeasure {
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let n_steps = n_positions - prompt_len;
    let values = layer.values(unit.kv_head);
    let samples = n_steps * unit.query_heads.len();
    let mut measure = UnitMeasure {
        heads: unit.query_heads.clone(),
        budget,
        kept_total: 0,
        retained: Vec::with_capacity(samples),
        recall: Vec::with_capacity(samples),
        error: Vec::with_capacity(samples),
        spans: Vec::with_capacity(samples * spans.len()),
    };
    let mut in_set = vec![false; n_positions];
    let mut partial = Vec::new();
    for step in 0..n_steps {
        let position = prompt_len + step;
        let kept_positions = unit_kept.kept_positions(step, prompt_len);
        measure.kept_total += kept_positions.len();
        for &j in &kept_positions {
            in_set[j] = true;
        }
        for head in unit.query_heads.clone() {
            let weights = reference.weights(head, step, position);
            let retained: f64 = kept_positions.iter().map(|&j| weights[j] as f64).sum();
            let local = head - reference.heads.start;
            let top = &reference.top[local * n_steps + step];
            let k = top_k.min(top.len());
            measure.retained.push(retained);
            measure
                .recall
                .push(top[..k].iter().filter(|&&j| in_set[j]).count() as f64 / k as f64);
            let mut error = 0.0;
            if let (Some(values), Some(output)) = (values, reference.output.as_ref()) {
                let full = output.slice(s![local, step, ..]);
                partial.clear();
                partial.resize(full.len(), 0.0f64);
                for &j in &kept_positions {
                    let weight = weights[j] as f64;
                    let row = values.row(j);
                    let row = row.to_slice().expect("standard layout");
                    for (acc, &x) in partial.iter_mut().zip(row) {
                        *acc += weight * x as f64;
                    }
                }
                let full_norm = full.iter().map(|x| x * x).sum::<f64>().sqrt();
                error = if retained > 0.0 && full_norm > 0.0 {
                    full.iter()
                        .zip(&partial)
                        .map(|(f, p)| (f - p / retained).powi(2))
                        .sum::<f64>()
                        .sqrt()
                        / full_norm
                } else {
                    1.0
                };
            }
            measure.error.push(error);
            for span in spans {
                let end = span.end.min(position + 1);
                let (mut kept_count, mut kept_mass, mut full_mass) = (0usize, 0.0f64, 0.0f64);
                for j in span.start..end {
                    full_mass += weights[j] as f64;
                    if in_set[j] {
                        kept_count += 1;
                        kept_mass += weights[j] as f64;
                    }
                }
                measure.spans.push((
                    kept_count as f64 / (span.end - span.start) as f64,
                    kept_mass,
                    full_mass,
                ));
            }
        }
        for &j in &kept_positions {
            in_set[j] = false;
        }
    }
    measure
}

/// A layer's measurements being summed, cache by cache in cache order.
#[derive(Debug, Clone)]
pub struct LayerAccumulator {
    n_steps: usize,
    retained_head_step: Vec<Vec<f64>>,
    recall_total: f64,
    error_total: f64,
    span_totals: Vec<(f64, f64, f64)>,
    unit_budgets: Vec<usize>,
    kept_by_unit: Vec<f64>,
}

impl LayerAccumulator {
    /// An empty sum for a layer of `layer`'s geometry with `n_spans` spans.
    pub fn new(layer: &LayerContext<'_>, n_spans: usize) -> Self {
        let n_steps = layer.n_positions() - layer.prompt_len;
        Self {
            n_steps,
            retained_head_step: vec![vec![0.0; n_steps]; layer.q.shape()[0]],
            recall_total: 0.0,
            error_total: 0.0,
            span_totals: vec![(0.0, 0.0, 0.0); n_spans],
            unit_budgets: Vec::new(),
            kept_by_unit: Vec::new(),
        }
    }

    /// Adds the next cache's measurements.
    pub fn add(&mut self, unit: &UnitMeasure) {
        let n_heads = unit.heads.len();
        let n_spans = self.span_totals.len();
        for step in 0..self.n_steps {
            for (offset, head) in unit.heads.clone().enumerate() {
                let sample = step * n_heads + offset;
                self.retained_head_step[head][step] = unit.retained[sample];
                self.recall_total += unit.recall[sample];
                self.error_total += unit.error[sample];
                let spans = &unit.spans[sample * n_spans..(sample + 1) * n_spans];
                for (totals, span) in self.span_totals.iter_mut().zip(spans) {
                    totals.0 += span.0;
                    totals.1 += span.1;
                    totals.2 += span.2;
                }
            }
        }
        self.unit_budgets.push(unit.budget);
        self.kept_by_unit
            .push(unit.kept_total as f64 / self.n_steps as f64);
    }

    /// The layer's report.
    pub fn report(
        self,
        layer: &LayerContext<'_>,
        layer_budget: usize,
        spans: &[Span],
    ) -> LayerReport {
        let n_steps = self.n_steps;
        let n_heads = self.retained_head_step.len();
        let samples = (n_heads * n_steps) as f64;
        let retained_by_head: Vec<f64> = self
            .retained_head_step
            .iter()
            .map(|steps| steps.iter().sum::<f64>() / n_steps as f64)
            .collect();
        let retained_by_step: Vec<f64> = (0..n_steps)
            .map(|step| {
                self.retained_head_step.iter().map(|h| h[step]).sum::<f64>() / n_heads as f64
            })
            .collect();
        LayerReport {
            layer: layer.layer,
            budget: layer_budget,
            unit_budgets: self.unit_budgets,
            mean_kept: self.kept_by_unit.iter().sum::<f64>() / self.kept_by_unit.len() as f64,
            kept_by_unit: self.kept_by_unit,
            retained_mass: retained_by_head.iter().sum::<f64>() / n_heads as f64,
            topk_recall: self.recall_total / samples,
            output_error: layer.v.map(|_| self.error_total / samples),
            retained_by_head,
            retained_by_step,
            retained_head_step: self.retained_head_step,
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
