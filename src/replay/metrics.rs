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

use super::{Kept, LayerContext};
use crate::trace::Span;
use ndarray::{s, Array3};
use serde::Serialize;

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

/// What every policy is measured against on one layer, computed once and shared: the full
/// causal attention of the decode queries, their full-cache attention outputs, and the order of
/// their largest weights.
#[derive(Debug, Clone)]
pub struct DecodeReference {
    /// `[n_heads, steps, T]` (keys after a query's position hold 0).
    pub attention: Array3<f32>,
    /// `o_full`, `[n_heads, steps, head_dim]`, when the trace has values (an f32 product
    /// `attention · V`, relative error ~1e-6, stored as f64).
    pub output: Option<Array3<f64>>,
    /// Per `head * steps + step`, the `max_top_k` largest weights' positions, largest first,
    /// ties to the lower position.
    pub top: Vec<Vec<usize>>,
}

impl DecodeReference {
    /// Computes the reference of one layer for top-k recalls up to `max_top_k`.
    pub fn new(layer: &LayerContext<'_>, max_top_k: usize) -> Self {
        let attention = crate::attention::decode_attention(
            layer.q,
            layer.k,
            layer.prompt_len,
            layer.scale,
            layer.softcap,
        );
        let (n_heads, n_steps, _) = attention.dim();
        let group = layer.group_size();
        let mut top = Vec::with_capacity(n_heads * n_steps);
        let output = layer.v.map(|v| {
            let mut output = Array3::<f64>::zeros((n_heads, n_steps, v.shape()[2]));
            for head in 0..n_heads {
                let values = v.index_axis(ndarray::Axis(0), head / group);
                let full = attention.index_axis(ndarray::Axis(0), head).dot(&values);
                output
                    .index_axis_mut(ndarray::Axis(0), head)
                    .assign(&full.mapv(f64::from));
            }
            output
        });
        for head in 0..n_heads {
            for step in 0..n_steps {
                let position = layer.prompt_len + step;
                let weights = attention.slice(s![head, step, ..=position]);
                let weights = weights.to_slice().expect("standard layout");
                let mut order: Vec<usize> = (0..weights.len()).collect();
                let by_weight =
                    |a: &usize, b: &usize| weights[*b].total_cmp(&weights[*a]).then(a.cmp(b));
                let k = max_top_k.min(order.len());
                if k < order.len() {
                    order.select_nth_unstable_by(k - 1, by_weight);
                }
                order.truncate(k);
                order.sort_by(by_weight);
                top.push(order);
            }
        }
        Self {
            attention,
            output,
            top,
        }
    }
}

/// Measures one layer's kept sets against the layer's shared [`DecodeReference`]. The cost per
/// (head, step) is O(kept · head_dim): nothing here walks the evicted positions.
pub fn measure(
    layer: &LayerContext<'_>,
    kept: &Kept,
    reference: &DecodeReference,
    spans: &[Span],
    top_k: usize,
) -> LayerReport {
    let prompt_len = layer.prompt_len;
    let n_positions = layer.n_positions();
    let n_steps = n_positions - prompt_len;
    let n_heads = layer.q.shape()[0];
    let mut retained_head_step = vec![vec![0.0f64; n_steps]; n_heads];
    let mut recall_total = 0.0f64;
    let mut error_total = 0.0f64;
    let mut span_totals = vec![(0.0f64, 0.0f64, 0.0f64); spans.len()];
    let mut kept_by_unit = Vec::with_capacity(kept.units.len());
    let mut in_set = vec![false; n_positions];
    for (unit, unit_kept) in kept.units.iter().zip(&kept.kept) {
        let values = layer.values(unit.kv_head);
        let mut kept_total = 0usize;
        for step in 0..n_steps {
            let position = prompt_len + step;
            let kept_positions = unit_kept.kept_positions(step, prompt_len);
            kept_total += kept_positions.len();
            for &j in &kept_positions {
                in_set[j] = true;
            }
            for head in unit.query_heads.clone() {
                let weights = reference
                    .attention
                    .slice(s![head, step, ..=position])
                    .to_slice()
                    .expect("standard layout");
                let retained: f64 = kept_positions.iter().map(|&j| weights[j] as f64).sum();
                retained_head_step[head][step] = retained;
                let top = &reference.top[head * n_steps + step];
                let k = top_k.min(top.len());
                recall_total += top[..k].iter().filter(|&&j| in_set[j]).count() as f64 / k as f64;
                if let (Some(values), Some(output)) = (values, reference.output.as_ref()) {
                    let full = output.slice(s![head, step, ..]);
                    let mut partial = vec![0.0f64; full.len()];
                    for &j in &kept_positions {
                        let weight = weights[j] as f64;
                        let row = values.row(j);
                        let row = row.to_slice().expect("standard layout");
                        for (acc, &x) in partial.iter_mut().zip(row) {
                            *acc += weight * x as f64;
                        }
                    }
                    let full_norm = full.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let error = if retained > 0.0 && full_norm > 0.0 {
                        full.iter()
                            .zip(&partial)
                            .map(|(f, p)| (f - p / retained).powi(2))
                            .sum::<f64>()
                            .sqrt()
                            / full_norm
                    } else {
                        1.0
                    };
                    error_total += error;
                }
                for (span, totals) in spans.iter().zip(span_totals.iter_mut()) {
                    let end = span.end.min(position + 1);
                    let (mut kept_count, mut kept_mass, mut full_mass) = (0usize, 0.0f64, 0.0f64);
                    for j in span.start..end {
                        full_mass += weights[j] as f64;
                        if in_set[j] {
                            kept_count += 1;
                            kept_mass += weights[j] as f64;
                        }
                    }
                    totals.0 += kept_count as f64 / (span.end - span.start) as f64;
                    totals.1 += kept_mass;
                    totals.2 += full_mass;
                }
            }
            for &j in &kept_positions {
                in_set[j] = false;
            }
        }
        kept_by_unit.push(kept_total as f64 / n_steps as f64);
    }
    let samples = (n_heads * n_steps) as f64;
    let retained_by_head: Vec<f64> = retained_head_step
        .iter()
        .map(|steps| steps.iter().sum::<f64>() / n_steps as f64)
        .collect();
    let retained_by_step: Vec<f64> = (0..n_steps)
        .map(|step| retained_head_step.iter().map(|h| h[step]).sum::<f64>() / n_heads as f64)
        .collect();
    LayerReport {
        layer: layer.layer,
        budget: kept.layer_budget,
        unit_budgets: kept.budgets.clone(),
        mean_kept: kept_by_unit.iter().sum::<f64>() / kept_by_unit.len() as f64,
        kept_by_unit,
        retained_mass: retained_by_head.iter().sum::<f64>() / n_heads as f64,
        topk_recall: recall_total / samples,
        output_error: layer.v.map(|_| error_total / samples),
        retained_by_head,
        retained_by_step,
        retained_head_step,
        spans: spans
            .iter()
            .zip(span_totals)
            .map(|(span, (fraction, kept_mass, full_mass))| SpanReport {
                name: span.name.clone(),
                kept_fraction: fraction / samples,
                kept_mass: kept_mass / samples,
                full_mass: full_mass / samples,
            })
            .collect(),
    }
}
