//! `kvzip`: KVzip's query-agnostic scores (Kim et al., 2025, arXiv:2505.23416, NeurIPS 2025;
//! snu-mllab/KVzip), as kvpress 0.5.5's `KVzipPress` computes them
//! (`kvpress/presses/kvzip_press.py`, `_compute_cross_attention` lines 250-276 and `score_kvzip`
//! lines 287-324). The model, asked to repeat its context, is fed that context again chunk by chunk
//! (the trace's reconstruction pass, `docs/trace-format.md`); a key's score is the most attention
//! any row of its chunk's repetition pays it, the maximum over the rows and over the query heads
//! of the cache. Each row's softmax runs over the first `min(sinks, chunk start)` keys (the
//! policy's `sinks`, KVzip's `n_sink`), the chunk's own context keys and the repetition's keys up
//! to its own, and nothing else of the context. Positions before the pass's span (the chat
//! template's opening) score 0, as kvpress leaves them; the sinks are kept by the policy's
//! protection, where kvpress gives them the top score.
//!
//! One-shot, at the cut the pass was run at: the trace's header names it, and a replay cutting
//! elsewhere is refused. A live run records the pass with its full run when its recipe asks for
//! one, so the policy runs live too. KVzip+'s normalisation (`kvzip_plus_normalization`) and the official
//! repository's head-level scores are not replayed. kvpress's `layerwise = True` is `flat` with
//! `heads = adakv`, `alpha = 0`, `normalize = false`; its default `layerwise = False` (one top-k
//! over all layers first) is the same with `allocator = global` (docs/policies.md).

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};
use crate::trace::{LayerReconstruction, Reconstruction, TraceMeta};
use ndarray::{s, Array2, ArrayView2, Axis};

crate::settings! {
    /// KVzip's scores: the most attention a key receives while the model repeats its context
    /// (Kim et al., 2025, arXiv:2505.23416; kvpress `kvzip_press.py`). Needs a trace captured
    /// with `reconstruction = "kvzip"`.
    pub struct Kvzip = "kvzip" {}
}

#[derive(Clone)]
struct State {
    unit: Unit,
    sinks: usize,
    scores: Option<Vec<f32>>,
}

impl Scorer for Kvzip {
    fn supports(&self, timing: Timing) -> bool {
        timing == Timing::Prefill
    }

    fn needs_reconstruction(&self) -> bool {
        true
    }

    fn check_trace(&self, meta: &TraceMeta) -> Result<(), String> {
        let pass = Reconstruction::from_meta(meta, usize::MAX)?.ok_or(
            "scorer `kvzip` scores keys by KVzip's reconstruction pass, and this trace records none (its recipe must ask for it with `reconstruction = \"kvzip\"`, for a capture or a live run)",
        )?;
        if pass.cut() != meta.prompt_len {
            return Err(format!(
                "scorer `kvzip`: the trace's reconstruction pass repeats the context up to position {}, and this replay cuts at {} (the pass is run where the question starts, for protocol `question-agnostic`, or at the prompt's end when the prompt has no question)",
                pass.cut(),
                meta.prompt_len
            ));
        }
        Ok(())
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            unit: unit.clone(),
            sinks: protect.sinks,
            scores: None,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let scores = self.scores.get_or_insert_with(|| {
            let rows = layer
                .reconstruction
                .expect("the engine checks the trace's reconstruction pass");
            pass_scores(layer, rows, &self.unit, self.sinks)
        });
        out.clear();
        out.extend(
            cache
                .iter()
                .map(|&position| scores.get(position).copied().unwrap_or(0.0)),
        );
        Ok(())
    }
}

/// One score per position up to the pass's cut: each chunk's context keys' most attention from
/// its rows, over `unit`'s query heads; 0 before the span.
fn pass_scores(
    layer: &LayerContext<'_>,
    rows: &LayerReconstruction,
    unit: &Unit,
    sinks: usize,
) -> Vec<f32> {
    let mut scores = vec![0.0f32; rows.pass.cut()];
    let offsets = rows.pass.row_offsets();
    for (chunk, offset) in rows.pass.chunks.iter().zip(offsets) {
        let span = chunk.context.clone();
        let sink = sinks.min(span.start);
        let repeat = offset..offset + chunk.rows;
        let keys = ndarray::concatenate(
            Axis(0),
            &[
                layer.k.slice(s![unit.kv_head, ..sink, ..]),
                layer.k.slice(s![unit.kv_head, span.clone(), ..]),
                rows.k.slice(s![unit.kv_head, repeat.clone(), ..]),
            ],
        )
        .expect("one head size");
        for head in unit.query_heads.clone() {
            let queries = rows.q.slice(s![head, repeat.clone(), ..]);
            let weights = row_weights(queries, keys.view(), layer, sink + span.len());
            for (score, column) in scores[span.clone()]
                .iter_mut()
                .zip(weights.slice(s![.., sink..sink + span.len()]).columns())
            {
                *score = column.iter().copied().fold(*score, f32::max);
            }
        }
    }
    scores
}

/// Each row's softmax over `keys`: the first `fixed` keys, then the repetition's keys up to the
/// row's own (row `i` sees `fixed + i + 1` keys).
fn row_weights(
    queries: ArrayView2<'_, f32>,
    keys: ArrayView2<'_, f32>,
    layer: &LayerContext<'_>,
    fixed: usize,
) -> Array2<f32> {
    let mut logits = queries.dot(&keys.t()).as_standard_layout().into_owned();
    for (i, mut row) in logits.rows_mut().into_iter().enumerate() {
        let row = row.as_slice_mut().expect("standard layout");
        let (seen, masked) = row.split_at_mut(fixed + i + 1);
        for logit in seen.iter_mut() {
            *logit *= layer.scale;
            if let Some(cap) = layer.softcap {
                *logit = cap * (*logit / cap).tanh();
            }
        }
        crate::attention::softmax_in_place(seen);
        masked.fill(0.0);
    }
    logits
}

/// The brute-force rule: per chunk, per query head of the cache, per row of the repetition, the
/// softmax over the sinks before the chunk, the chunk's keys and the repetition's keys up to the
/// row; a key's score is its largest weight; positions before the pass score 0.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Kvzip {
    fn prompt_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Option<Vec<f64>> {
        let rows = layer.reconstruction.expect("fixtures record a pass");
        let mut scores = vec![0.0; layer.prompt_len];
        let offsets = rows.pass.row_offsets();
        let key = |at: usize| -> Vec<f64> {
            (0..layer.head_dim())
                .map(|x| rows.k[[cache.kv, at, x]] as f64)
                .collect()
        };
        for (chunk, offset) in rows.pass.chunks.iter().zip(offsets) {
            let sink = policy.sinks.min(chunk.context.start);
            for &head in &cache.heads {
                for i in 0..chunk.rows {
                    let query: Vec<f64> = (0..layer.head_dim())
                        .map(|x| rows.q[[head, offset + i, x]] as f64)
                        .collect();
                    let mut logits: Vec<f64> = (0..sink)
                        .chain(chunk.context.clone())
                        .map(|j| reference::dot(&query, &layer.key(cache.kv, j)))
                        .collect();
                    logits.extend((0..=i).map(|r| reference::dot(&query, &key(offset + r))));
                    let logits: Vec<f64> = logits.iter().map(|l| l * layer.scale).collect();
                    let weights = reference::softmax(&logits);
                    for (n, j) in chunk.context.clone().enumerate() {
                        scores[j] = f64::max(scores[j], weights[sink + n]);
                    }
                }
            }
        }
        Some(scores)
    }

    /// One-shot only: the scores at the cut.
    fn scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let scores = self
            .prompt_scores(layer, policy, cache)
            .expect("always some");
        positions.iter().map(|&j| scores[j]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Chunk;
    use ndarray::Array3;

    /// By hand: one KV head, one query head, head size 1, scale 1. Keys 0..4 are 0, 0, ln 2, 0;
    /// the pass repeats [1, 3) in one chunk of 3 rows whose queries are 1 and keys 0. With one
    /// sink, row 0 sees key 0, keys 1 and 2 and its own: logits 0, 0, ln 2, 0, weights 1/5, 1/5,
    /// 2/5, 1/5; row 1 one more key at 0 (weights 1/6, 1/6, 2/6, 1/6, 1/6); row 2 (1/7, 1/7,
    /// 2/7, …). Scores: position 1 = 1/5, position 2 = 2/5; position 0 (before the span) 0.
    #[test]
    fn scores_are_the_largest_weight_of_the_repetition() {
        let q = Array3::<f32>::ones((1, 4, 1));
        let k = Array3::from_shape_vec((1, 4, 1), vec![0.0, 0.0, 2f32.ln(), 0.0]).unwrap();
        let rows = LayerReconstruction {
            pass: Reconstruction {
                chunks: vec![Chunk {
                    context: 1..3,
                    rows: 3,
                }],
            },
            q: Array3::ones((1, 3, 1)),
            k: Array3::zeros((1, 3, 1)),
        };
        let mut layer = super::super::testing::context(&q, &k, 3);
        layer.reconstruction = Some(&rows);
        let unit = super::super::testing::unit();
        let scores = pass_scores(&layer, &rows, &unit, 1);
        let expected = [0.0, 0.2, 0.4];
        for (got, want) in scores.iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{scores:?}");
        }
        // Without sinks the row's softmax loses key 0: row 0 weighs 1/4, 2/4, 1/4.
        let scores = pass_scores(&layer, &rows, &unit, 0);
        assert!((scores[1] - 0.25).abs() < 1e-6 && (scores[2] - 0.5).abs() < 1e-6);
    }
}
