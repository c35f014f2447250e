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

/// Measures one layer's kept sets.
/// `decode` is the full attention of the decode queries, `[n_heads, steps, T]`
/// ([`crate::attention::decode_attention`]), shared by every policy measured on this layer.
pub fn measure(
    layer: &LayerContext<'_>,
    kept: &Kept,
    decode: &Array3<f32>,
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
    let mut order: Vec<usize> = Vec::with_capacity(n_positions);
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
                let weights = decode
                    .slice(s![head, step, ..=position])
                    .to_slice()
                    .expect("standard layout");
                let retained: f64 = kept_positions.iter().map(|&j| weights[j] as f64).sum();
                retained_head_step[head][step] = retained;
                let k = top_k.min(weights.len());
                order.clear();
                order.extend(0..weights.len());
                let by_weight =
                    |a: &usize, b: &usize| weights[*b].total_cmp(&weights[*a]).then(a.cmp(b));
                if k < order.len() {
                    order.select_nth_unstable_by(k - 1, by_weight);
                }
                recall_total += order[..k].iter().filter(|&&j| in_set[j]).count() as f64 / k as f64;
                if let Some(values) = values {
                    let dim = values.shape()[1];
                    let mut full = vec![0.0f64; dim];
                    let mut partial = vec![0.0f64; dim];
                    for (j, &weight) in weights.iter().enumerate() {
                        let target = if in_set[j] { &mut partial } else { &mut full };
                        for (acc, &x) in target.iter_mut().zip(values.row(j)) {
                            *acc += weight as f64 * x as f64;
                        }
                    }
                    // `full` holds the evicted part so far; add the kept part to complete it.
                    for (f, p) in full.iter_mut().zip(&partial) {
                        *f += p;
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
