//! What a policy kept, as data a page draws: per compressed layer and cache, which prompt
//! positions each policy holds (at the prompt's end, or at every decode step for the timings that
//! choose again), beside the full cache's attention mass on each position, the trace's spans and
//! each layer's budget, retained mass and lost mass by region and cause. [`page`] renders it as
//! one self-contained HTML file; [`report`] renders an experiment's report as a page.
//!
//! A cell is one position while the kept sets of every policy, layer, cache and step fit
//! [`MAX_BIT_CELLS`] (one bit each). Longer prompts are aggregated: positions fall into at most
//! [`MAX_BINS`] bins of equal size, and fewer where the cells would pass [`MAX_CELLS`]; a cell
//! then holds the fraction of its bin's positions kept (in 255ths, one byte each) and the page
//! says how many positions a bin holds. Nothing is dropped: every compressed layer, cache and
//! step is in the data.

pub mod page;
pub mod report;

use crate::assets::{Assets, MODELS};
use crate::replay::metrics::lost::LostShare;
use crate::replay::{
    caches_per_layer, compressed_layers, context, kept_masks, replay_many, Checkpoints,
    PolicyError, ReplayReport, SpanReport, Timing, ValidPolicy, RETAINED_MASS,
};
use crate::trace::{TraceError, TraceReader};
use ndarray::{s, ArrayD, Axis};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// The most position bins a page draws.
pub const MAX_BINS: usize = 2048;

/// The most kept-set cells (steps x layers x caches x bins, over every policy) at one position
/// a cell, one bit each.
pub const MAX_BIT_CELLS: usize = 24 << 20;

/// The most kept-set cells over every policy when positions are binned, one byte each.
pub const MAX_CELLS: usize = 1 << 20;

/// Longest text shown for one bin.
const TEXT_CHARS: usize = 80;

/// Why a view could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// A policy the trace cannot run.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// Nothing to show.
    #[error("{0}")]
    Empty(String),
}

/// Everything the page shows, serialised into it as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct View {
    /// The trace's file, model and shape.
    pub trace: TraceSummary,
    /// How positions are binned.
    pub bins: Bins,
    /// The trace's named spans (needle, question, …), in positions.
    pub spans: Vec<SpanMark>,
    /// Each bin's text (its tokens' text, cut at 80 characters), when a tokenizer was given.
    pub texts: Option<Vec<String>>,
    /// The full cache's attention mass on each bin, mean over query heads and decode steps, per
    /// trace layer (`[layer][bin]`).
    pub mass: Vec<Vec<f32>>,
    /// The policies shown, the first the main one.
    pub policies: Vec<PolicyView>,
}

/// The trace's identity and shape.
#[derive(Debug, Clone, Serialize)]
pub struct TraceSummary {
    /// The trace's file.
    pub path: String,
    /// The model that made it.
    pub model: String,
    /// Prompt positions.
    pub prompt_len: usize,
    /// Prompt and generated positions.
    pub n_positions: usize,
    /// Layers.
    pub n_layers: usize,
    /// Query heads per layer.
    pub n_heads: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
}

/// Positions `0..prompt_len` in `count` bins of `size` (the last may be shorter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bins {
    /// Positions a bin.
    pub size: usize,
    /// Bins.
    pub count: usize,
}

impl Bins {
    /// Bins for `positions` positions: one position each while `cells_per_bin * positions <=
    /// MAX_BIT_CELLS` and `positions <= MAX_BINS`; else at most `MAX_BINS` bins with
    /// `cells_per_bin * bins <= MAX_CELLS`.
    pub fn for_positions(positions: usize, cells_per_bin: usize) -> Self {
        let cells = positions * cells_per_bin.max(1);
        if positions <= MAX_BINS && cells <= MAX_BIT_CELLS {
            return Self {
                size: 1,
                count: positions,
            };
        }
        let by_bins = positions.div_ceil(MAX_BINS);
        let by_cells = cells.div_ceil(MAX_CELLS);
        let size = by_bins.max(by_cells).max(1);
        Self {
            size,
            count: positions.div_ceil(size),
        }
    }

    /// The positions of bin `bin`.
    pub fn positions(&self, bin: usize, positions: usize) -> std::ops::Range<usize> {
        bin * self.size..((bin + 1) * self.size).min(positions)
    }
}

/// A named span of the prompt.
#[derive(Debug, Clone, Serialize)]
pub struct SpanMark {
    /// Its name (`needle`, `question`).
    pub name: String,
    /// First position.
    pub start: usize,
    /// One past the last.
    pub end: usize,
}

/// One policy's decisions and what they cost.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyView {
    /// Its label (`snapkv@128`, a preset's name).
    pub label: String,
    /// Its settings, as results name them.
    pub settings: BTreeMap<String, String>,
    /// Protected first tokens.
    pub sinks: usize,
    /// Protected recent tokens.
    pub window: usize,
    /// The compressed layers, in depth order (the rows of `kept`).
    pub layers: Vec<usize>,
    /// Caches per layer.
    pub caches: usize,
    /// Kept-set snapshots: 1 (the prompt's end) or one per decode step.
    pub steps: usize,
    /// `[step][layer][cache][bin]` fractions kept, in 255ths, row-major; at one position a bin
    /// one bit each (`packed`, the first cell in the lowest bit).
    #[serde(serialize_with = "page::base64")]
    pub kept: Vec<u8>,
    /// Whether `kept` holds bits.
    pub packed: bool,
    /// The policy's mean metrics over layers (retained mass, …).
    pub metrics: BTreeMap<String, f64>,
    /// Per compressed layer: budget, retained mass, lost mass.
    pub per_layer: Vec<LayerView>,
}

/// One layer's numbers under one policy.
#[derive(Debug, Clone, Serialize)]
pub struct LayerView {
    /// Layer index.
    pub layer: usize,
    /// Its caches' budget.
    pub budget: usize,
    /// Retained mass, mean over query heads and decode steps.
    pub retained_mass: Option<f64>,
    /// Retained mass at each decode step, mean over query heads.
    pub retained_by_step: Vec<f64>,
    /// Each span's share of tokens kept and of its full-attention mass kept.
    pub spans: Vec<SpanReport>,
    /// Lost mass by region of the prompt.
    pub lost_by_region: Vec<LostShare>,
    /// Lost mass by when it left.
    pub lost_by_when: Vec<LostShare>,
}

/// The view of `policies` (label, checked policy) on `trace`, each position's text from `texts`
/// (one per trace position) where given; `checkpoints` is called after each layer of each pass
/// and asked within it.
pub fn build(
    trace: &TraceReader,
    policies: &[(String, ValidPolicy)],
    texts: Option<&[String]>,
    checkpoints: Checkpoints<'_>,
) -> Result<View, ViewError> {
    if policies.is_empty() {
        return Err(ViewError::Empty("a view needs at least one policy".into()));
    }
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let cells_per_bin = policies
        .iter()
        .map(|(_, p)| cells_per_position(trace, p))
        .sum();
    let bins = Bins::for_positions(prompt_len, cells_per_bin);
    let views = policies
        .iter()
        .map(|(label, policy)| policy_view(trace, (label, policy), bins, checkpoints))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(View {
        trace: TraceSummary {
            path: trace.path().display().to_string(),
            model: meta.model.clone(),
            prompt_len,
            n_positions: trace.n_positions(),
            n_layers: meta.n_layers,
            n_heads: meta.n_heads,
            n_kv_heads: meta.n_kv_heads,
        },
        bins,
        spans: meta
            .spans
            .iter()
            .map(|span| SpanMark {
                name: span.name.clone(),
                start: span.start,
                end: span.end,
            })
            .collect(),
        texts: texts.map(|texts| bin_texts(texts, bins, prompt_len)),
        mass: attention_mass(trace, bins, checkpoints)?,
        policies: views,
    })
}

/// The page of `policies` on `trace`, titled with the trace and the first policy, each position's
/// text read where the model's GGUF is fetched under `assets`: what `kvreplay view` writes and
/// `kvreplay.view` returns.
pub fn page_of(
    trace: &TraceReader,
    policies: &[(String, ValidPolicy)],
    assets: &Assets,
    checkpoints: Checkpoints<'_>,
) -> Result<String, ViewError> {
    let texts = token_texts(trace, assets);
    let view = build(trace, policies, texts.as_deref(), checkpoints)?;
    let title = format!("{}: {}", trace.path().display(), policies[0].0);
    Ok(page::html(&view, &title))
}

/// Each position's text, when the model that made `trace` is a model kvreplay fetches and its
/// GGUF is under `assets` (the tokenizer is read from it, not the weights); `None` otherwise.
pub fn token_texts(trace: &TraceReader, assets: &Assets) -> Option<Vec<String>> {
    let model = MODELS.iter().find(|m| {
        Path::new(m.file).file_stem().and_then(|s| s.to_str()) == Some(&trace.meta().model)
    })?;
    let tokenizer = crate::model::family::tokenizer(&assets.model_file(model)).ok()?;
    let tokens = trace.tokens().ok()?;
    Some(
        tokens
            .iter()
            .map(|&id| tokenizer.token_text(id as u32))
            .collect(),
    )
}

/// The kept-set cells `policy` has at each position: its snapshots (one at the prompt's end for
/// the one-shot timing, one per decode step for the others) x its compressed layers x caches.
fn cells_per_position(trace: &TraceReader, policy: &ValidPolicy) -> usize {
    let meta = trace.meta();
    let snapshots = match policy.params().timing {
        Timing::Prefill => 1,
        _ => (trace.n_positions() - meta.prompt_len).max(1),
    };
    snapshots * compressed_layers(meta, policy).len() * caches_per_layer(meta, policy.params().gqa)
}

/// One policy's kept sets, binned, and its report's numbers.
fn policy_view(
    trace: &TraceReader,
    (label, policy): (&str, &ValidPolicy),
    bins: Bins,
    checkpoints: Checkpoints<'_>,
) -> Result<PolicyView, ViewError> {
    let per_step = policy.params().timing != Timing::Prefill;
    let masks = kept_masks(trace, policy, per_step, checkpoints)?;
    let mut reports = replay_many(trace, std::slice::from_ref(policy), checkpoints)?;
    let report = reports.pop().expect("one report per policy");
    let cells = binned_kept(&masks.mask, per_step, bins, trace.meta().prompt_len);
    let packed = bins.size == 1;
    let kept = if packed { bits(&cells) } else { cells };
    let protect = policy.protection();
    Ok(PolicyView {
        label: label.to_owned(),
        settings: report.settings.clone(),
        sinks: protect.sinks,
        window: protect.window,
        caches: masks.mask.shape()[1],
        steps: if per_step { masks.mask.shape()[2] } else { 1 },
        layers: masks.layers,
        kept,
        packed,
        metrics: report.metrics.clone(),
        per_layer: layer_views(&report),
    })
}

/// `[step][layer][cache][bin]` fractions kept, in 255ths, from masks `[layer, cache, position]`
/// or, `per_step`, `[layer, cache, step, position]`. Positions past the mask's end (the question
/// after a question-agnostic cut) count as kept: the cut does not reach them.
pub fn binned_kept(mask: &ArrayD<bool>, per_step: bool, bins: Bins, prompt_len: usize) -> Vec<u8> {
    let (layers, caches) = (mask.shape()[0], mask.shape()[1]);
    let steps = if per_step { mask.shape()[2] } else { 1 };
    let mut out = Vec::with_capacity(steps * layers * caches * bins.count);
    for step in 0..steps {
        for layer in 0..layers {
            for cache in 0..caches {
                let row = match per_step {
                    true => mask.slice(s![layer, cache, step, ..]),
                    false => mask.slice(s![layer, cache, ..]),
                };
                let row = row.into_dimensionality::<ndarray::Ix1>().expect("one axis");
                for bin in 0..bins.count {
                    let range = bins.positions(bin, prompt_len);
                    let len = range.len();
                    let kept = range.filter(|&p| p >= row.len() || row[p]).count();
                    out.push(((kept * 255) as f64 / len as f64).round() as u8);
                }
            }
        }
    }
    out
}

/// Cells of 0 or 255 as bits, eight a byte, the first in the lowest bit.
fn bits(cells: &[u8]) -> Vec<u8> {
    cells
        .chunks(8)
        .map(|eight| {
            eight
                .iter()
                .enumerate()
                .fold(0u8, |byte, (i, &cell)| byte | (u8::from(cell != 0) << i))
        })
        .collect()
}

/// Each compressed layer's budget, retained mass and lost mass, from the replay's report.
fn layer_views(report: &ReplayReport) -> Vec<LayerView> {
    report
        .layers
        .iter()
        .map(|layer| LayerView {
            layer: layer.layer,
            budget: layer.budget,
            retained_mass: layer.metric(RETAINED_MASS),
            retained_by_step: layer
                .samples
                .get(RETAINED_MASS)
                .map(|heads| mean_over_heads(heads))
                .unwrap_or_default(),
            spans: layer.spans.clone(),
            lost_by_region: layer.lost_by_region.clone(),
            lost_by_when: layer.lost_by_when.clone(),
        })
        .collect()
}

/// The mean over heads of per-head, per-step samples.
fn mean_over_heads(heads: &[Vec<f64>]) -> Vec<f64> {
    let steps = heads.first().map_or(0, Vec::len);
    (0..steps)
        .map(|step| heads.iter().map(|h| h[step]).sum::<f64>() / heads.len() as f64)
        .collect()
}

/// The full cache's attention mass on each bin of the prompt, mean over query heads and decode
/// steps, for every layer of the trace (`[layer][bin]`).
fn attention_mass(
    trace: &TraceReader,
    bins: Bins,
    checkpoints: Checkpoints<'_>,
) -> Result<Vec<Vec<f32>>, ViewError> {
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let group = meta.n_heads / meta.n_kv_heads;
    (0..meta.n_layers)
        .map(|layer| {
            let tensors = trace.layer(layer)?;
            let ctx = context(trace, layer, &tensors);
            let mut per_position = vec![0f64; prompt_len];
            let mut samples = 0usize;
            for kv in 0..meta.n_kv_heads {
                let weights = ctx.decode_attention(kv * group..(kv + 1) * group);
                for row in weights.lanes(Axis(2)) {
                    samples += 1;
                    for (p, w) in row.iter().take(prompt_len).enumerate() {
                        per_position[p] += *w as f64;
                    }
                }
            }
            (checkpoints.after_layer)().map_err(PolicyError::from)?;
            Ok((0..bins.count)
                .map(|bin| {
                    let sum: f64 = bins
                        .positions(bin, prompt_len)
                        .map(|p| per_position[p])
                        .sum();
                    (sum / samples.max(1) as f64) as f32
                })
                .collect())
        })
        .collect()
}

/// Each bin's text: its positions' texts joined, cut at [`TEXT_CHARS`] characters.
fn bin_texts(texts: &[String], bins: Bins, prompt_len: usize) -> Vec<String> {
    (0..bins.count)
        .map(|bin| {
            let joined: String = bins
                .positions(bin, prompt_len)
                .filter_map(|p| texts.get(p))
                .map(String::as_str)
                .collect();
            match joined.char_indices().nth(TEXT_CHARS) {
                Some((cut, _)) => format!("{}…", &joined[..cut]),
                None => joined,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
