//! `duo`: DuoAttention's retrieval and streaming heads (Xiao et al., ICLR 2025, arXiv:2410.10819),
//! as kvpress 0.5.5 runs it with `on_the_fly_scoring` (`DuoAttentionPress`,
//! `kvpress/presses/duo_attention_press.py`): every KV head of every layer gets a score from a
//! calibration text, the `round(n · head_compression_ratio)` lowest over all layers become
//! streaming heads, which keep only the policy's protected sinks and recent window, and the
//! others are retrieval heads, which keep the layer's budget (the whole prompt at a budget at or
//! above its length: DuoAttention exactly; below it, retrieval heads are themselves compressed by
//! the scorer).
//!
//! The score (`duo_attention_on_the_fly`, lines 147-212): per query head, the mean pre-rotary
//! query and per KV head the mean pre-rotary key over the calibration text are repeated at
//! positions `0..q_len` (500) and rotated there; the last query's softmax over those keys, scaled
//! by `1/√d`, gives the area under its cumulative attention curve, `mean_j Σ_{i≤j} p_i`; a KV head
//! scores the mean over its query heads. The streaming heads are the lowest (lines 86-90:
//! `np.argsort` over all heads; `round` to even). kvpress scores 50 BookSum chapters; here the
//! prompt of the `calibration` trace, which may be the trace replayed itself (the prompt only, so
//! no look-ahead). On a model with sliding-window layers the ranking runs over its global layers
//! (a sliding layer's cache is its window already, and kvpress refuses such models); the sliding
//! layers' heads stay retrieval heads. Deliberate deviations: the pre-rotary vectors are the trace's post-rotary ones
//! turned back with its rotary base (f64); equal scores make the lower (layer, head) streaming
//! first; a cache read by one query head (`gqa = query-head`) follows its KV head, and a cache over
//! several KV heads (`gqa = layer`) is a streaming head only when all of them are.

use super::HeadSplit;
use crate::attention::softmax_f64;
use crate::replay::allocator::LayerBudget;
use crate::replay::rotary::{rotate, Rotary};
use crate::replay::settings::Broken;
use crate::replay::{LayerContext, Protection};
use crate::trace::{TraceMeta, TraceReader};
use ndarray::{Array1, ArrayView2, Axis};
use std::sync::{Arc, OnceLock};

crate::settings! {
    /// DuoAttention: retrieval heads keep the budget, streaming heads their sinks and recent window
    /// (arXiv:2410.10819; kvpress `DuoAttentionPress`, on-the-fly scores).
    pub struct Duo = "duo" {
        /// Share of the KV heads, over all layers, made streaming heads (kvpress's
        /// `head_compression_ratio`), in [0, 1].
        head_compression_ratio: f64 = 0.5,
        /// The kvtrace/1 file whose prompt scores the heads (kvpress: 50 BookSum chapters); it may
        /// be the trace replayed itself. Several files, comma-separated, one per model: each trace
        /// replayed is split by the one of its model (a sweep over models).
        calibration: String = String::new(),
        /// Positions the mean query and key are repeated at (kvpress's `q_len`).
        q_len: usize = 500,
        /// How the heads are scored: `on-the-fly` (kvpress's, from the calibration prompt) or
        /// `decode` (the attention the calibration trace's decode queries put beyond the sinks
        /// and recent window: an oracle bound when it is the trace replayed).
        scores: String = "on-the-fly".to_string(),
    }
    loaded {
        /// Each calibration trace's geometry and heads, read once, when the first trace is checked.
        calibrated: Arc<OnceLock<Vec<Calibrated>>>,
    }
}

/// What a calibration trace gives: its geometry, the layers the ranking runs over, and what the
/// chosen scoring reads of its heads.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibrated {
    /// (layers, heads, KV heads, head_dim).
    geometry: (usize, usize, usize, usize),
    /// The global layers, which the ranking runs over.
    global: Vec<usize>,
    evidence: Evidence,
}

/// What the chosen scoring reads of the calibration trace's heads.
#[derive(Debug, Clone, PartialEq)]
enum Evidence {
    /// `on-the-fly`: per layer, per KV head, whether it is a streaming head.
    OnTheFly(Vec<Vec<bool>>),
    /// `decode`: per layer, per KV head, per position, the decode queries' mean attention (over
    /// steps and the group's query heads), and the prompt's length; the streaming heads follow
    /// from the policy's protection.
    Decode(Vec<Vec<Vec<f64>>>, usize),
}

/// The two ways of scoring heads.
const SCORES: [&str; 2] = ["on-the-fly", "decode"];

impl HeadSplit for Duo {
    /// The settings' own rules; the calibration traces are read when the first trace is checked
    /// ([`check_trace`](HeadSplit::check_trace)), so an experiment that captures them loads first.
    fn check(&self) -> Result<(), Broken> {
        Broken::unless_share(
            "head_compression_ratio",
            self.head_compression_ratio,
            Some("the share of the KV heads made streaming heads"),
        )?;
        if !SCORES.contains(&self.scores.as_str()) {
            return Err(Broken {
                key: "scores",
                rule: "must be `on-the-fly` (kvpress's, from the calibration prompt) or `decode` (the calibration trace's decode attention)".into(),
            });
        }
        if self.q_len == 0 {
            return Err(Broken {
                key: "q_len",
                rule: "must be at least 1".into(),
            });
        }
        if self.calibration.trim().is_empty() {
            return Err(Broken {
                key: "calibration",
                rule: "must be the path of a kvtrace/1 file whose prompt scores the heads (it may be the trace replayed)".into(),
            });
        }
        Ok(())
    }

    fn needs_protection(&self) -> bool {
        true
    }

    fn needs_one_shot(&self) -> bool {
        true
    }

    /// Reads the calibration traces and scores their heads once, the first time: a file that
    /// cannot be read, or whose layers have no rotary base, is an error of the setting; then
    /// one of them must be of `meta`'s model.
    fn check_trace(&self, meta: &TraceMeta) -> Result<(), String> {
        if self.calibrated.get().is_none() {
            let calibrated = self.calibrate_each().map_err(|rule| {
                format!(
                    "head split `duo`: setting `calibration` = {}: {rule}",
                    self.calibration
                )
            })?;
            let _ = self.calibrated.set(calibrated);
        }
        let geometry = (meta.n_layers, meta.n_heads, meta.n_kv_heads, meta.head_dim);
        let calibrated = self.calibrated_each();
        match calibrated.iter().any(|c| c.geometry == geometry) {
            true => Ok(()),
            false => Err(format!(
                "head split `duo`: calibration {} has (layers, heads, KV heads, head_dim) = {}, this trace {geometry:?}: {} must come from the same model",
                self.calibration,
                calibrated.iter().map(|c| format!("{:?}", c.geometry)).collect::<Vec<_>>().join(", "),
                match calibrated.len() {
                    1 => "it",
                    _ => "one of them",
                }
            )),
        }
    }

    fn protected_only_share(
        &self,
        meta: &TraceMeta,
        layers: &[usize],
        n_caches: usize,
        protect: Protection,
    ) -> f64 {
        let calibrated = self.calibrated_for((meta.n_heads, meta.n_kv_heads, meta.head_dim));
        let streaming = calibrated.streaming(protect, self.head_compression_ratio);
        let streams: Vec<bool> = layers
            .iter()
            .flat_map(|&layer| streaming_caches(&streaming[layer], n_caches))
            .collect();
        streams.iter().filter(|&&s| s).count() as f64 / streams.len().max(1) as f64
    }

    fn split(
        &self,
        layer: &LayerContext<'_>,
        budget: LayerBudget,
        _scores: &[Vec<f32>],
        _candidates: &[usize],
        protect: Protection,
    ) -> Vec<usize> {
        let n_caches = budget.caches();
        let heads = (layer.q.shape()[0], layer.k.shape()[0], layer.q.shape()[2]);
        let calibrated = self.calibrated_for(heads);
        let streaming = calibrated.streaming(protect, self.head_compression_ratio);
        streaming_caches(&streaming[layer.layer], n_caches)
            .into_iter()
            .map(|streams| match streams {
                true => protect.tokens(),
                false => budget.per_cache(),
            })
            .collect()
    }
}

/// Whether each of a layer's `n_caches` caches is a streaming one, its layer's KV heads streaming
/// as `streaming` says: a cache read by one query head follows its KV head, a cache over several
/// KV heads streams only when all of them do.
fn streaming_caches(streaming: &[bool], n_caches: usize) -> Vec<bool> {
    let n_kv = streaming.len();
    (0..n_caches)
        .map(|cache| {
            let covered = match n_caches >= n_kv {
                true => {
                    let kv = cache * n_kv / n_caches;
                    kv..kv + 1
                }
                false => cache * n_kv / n_caches..(cache + 1) * n_kv / n_caches,
            };
            streaming[covered].iter().all(|&s| s)
        })
        .collect()
}

impl Duo {
    fn calibrated_each(&self) -> &[Calibrated] {
        self.calibrated
            .get()
            .expect("the trace is checked before a split")
    }

    /// The calibration of the model whose layers have `heads` (heads, KV heads, head_dim); the
    /// trace was checked to have one.
    fn calibrated_for(&self, heads: (usize, usize, usize)) -> &Calibrated {
        self.calibrated_each()
            .iter()
            .find(|c| (c.geometry.1, c.geometry.2, c.geometry.3) == heads)
            .expect("the trace is checked to have a calibration of its model")
    }

    /// Reads each calibration trace of the comma-separated list; two of the same heads are
    /// refused, as a layer could not tell which is its model's.
    fn calibrate_each(&self) -> Result<Vec<Calibrated>, String> {
        let mut each: Vec<Calibrated> = Vec::new();
        for path in self.calibration.split(',').map(str::trim) {
            let calibrated = self.calibrate(path)?;
            let heads = |c: &Calibrated| (c.geometry.1, c.geometry.2, c.geometry.3);
            if each.iter().any(|c| heads(c) == heads(&calibrated)) {
                return Err(format!(
                    "{path} has the (heads, KV heads, head_dim) {:?} of an earlier calibration trace: give one per model",
                    heads(&calibrated)
                ));
            }
            each.push(calibrated);
        }
        Ok(each)
    }

    /// Reads the calibration trace once, layer by layer, for what the chosen scoring needs: the
    /// on-the-fly scores (then the streaming heads), or the decode attention.
    fn calibrate(&self, path: &str) -> Result<Calibrated, String> {
        let trace = TraceReader::open(std::path::Path::new(path))
            .map_err(|err| format!("the calibration trace cannot be read: {err}"))?;
        let meta = trace.meta();
        let global = meta.global_layers();
        let evidence = match self.scores == "decode" {
            true => Evidence::Decode(each_layer(&trace, |l| Ok(decode_mass(l)))?, meta.prompt_len),
            false => {
                let scores = each_layer(&trace, |l| on_the_fly_scores(l, self.q_len))?;
                Evidence::OnTheFly(ranked_over(&scores, &global, self.head_compression_ratio))
            }
        };
        Ok(Calibrated {
            geometry: (meta.n_layers, meta.n_heads, meta.n_kv_heads, meta.head_dim),
            global,
            evidence,
        })
    }
}

impl Calibrated {
    /// Per layer, per KV head, whether it is a streaming head: as scored on the fly, or by the
    /// decode attention beyond `protect` at `ratio`.
    fn streaming(&self, protect: Protection, ratio: f64) -> std::borrow::Cow<'_, [Vec<bool>]> {
        match &self.evidence {
            Evidence::OnTheFly(streaming) => streaming.as_slice().into(),
            Evidence::Decode(..) => self.decode_streaming(protect, ratio).into(),
        }
    }

    /// The streaming heads by the decode attention: each KV head scores the mean mass its decode
    /// queries put on the prompt positions a streaming head drops (beyond `protect`'s sinks and
    /// before its recent window), and the lowest become streaming heads.
    fn decode_streaming(&self, protect: Protection, ratio: f64) -> Vec<Vec<bool>> {
        let Evidence::Decode(decode, prompt) = &self.evidence else {
            unreachable!("decode scores read the decode attention")
        };
        let dropped = protect.sinks..prompt.saturating_sub(protect.window);
        let lost: Vec<Vec<f64>> = decode
            .iter()
            .map(|heads| {
                heads
                    .iter()
                    .map(|mass| dropped.clone().map(|j| mass[j]).sum())
                    .collect()
            })
            .collect();
        ranked_over(&lost, &self.global, ratio)
    }
}

/// `read` of every layer of `trace`, each read once.
fn each_layer<T>(
    trace: &TraceReader,
    read: impl Fn(&crate::replay::LayerContext<'_>) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    (0..trace.meta().n_layers)
        .map(|layer| {
            let tensors = trace
                .layer(layer)
                .map_err(|err| format!("the calibration trace cannot be read: {err}"))?;
            read(&crate::replay::context(trace, layer, &tensors))
        })
        .collect()
}

/// Each KV head's on-the-fly score ([`head_scores`]) in `layer`, from the mean pre-rotary query
/// and key of its prompt.
fn on_the_fly_scores(
    layer: &crate::replay::LayerContext<'_>,
    q_len: usize,
) -> Result<Vec<f64>, String> {
    let theta = layer.rope_theta.ok_or_else(|| {
        format!(
            "the calibration trace's layer {} has no rotary base (`rope_theta`): its vectors cannot be turned back",
            layer.layer
        )
    })?;
    let mean = |vectors: ArrayView2<f32>| pre_rotary_mean(vectors, layer.prompt_len, theta);
    let queries: Vec<Array1<f64>> = layer.q.axis_iter(Axis(0)).map(&mean).collect();
    let keys: Vec<Array1<f64>> = layer.k.axis_iter(Axis(0)).map(&mean).collect();
    Ok(head_scores(&queries, &keys, theta, q_len))
}

/// Per KV head, per position, the mean attention of the layer's decode queries (over the steps
/// and the KV head's query heads).
fn decode_mass(layer: &crate::replay::LayerContext<'_>) -> Vec<Vec<f64>> {
    let group = layer.group_size();
    let n_kv = layer.k.shape()[0];
    (0..n_kv)
        .map(|kv| {
            let attention = layer.decode_attention(kv * group..(kv + 1) * group);
            let (heads, steps, t) = attention.dim();
            let mut mass = vec![0.0; t];
            for weights in attention.rows() {
                for (m, &w) in mass.iter_mut().zip(weights) {
                    *m += f64::from(w) / (heads * steps) as f64;
                }
            }
            mass
        })
        .collect()
}

/// [`streaming_heads`] ranked over the `global` layers only; the others' heads stay retrieval
/// heads.
fn ranked_over(scores: &[Vec<f64>], global: &[usize], ratio: f64) -> Vec<Vec<bool>> {
    let ranked: Vec<Vec<f64>> = scores
        .iter()
        .enumerate()
        .map(|(layer, heads)| match global.contains(&layer) {
            true => heads.clone(),
            false => Vec::new(),
        })
        .collect();
    let mut streaming = streaming_heads(&ranked, ratio);
    for (heads, layer_scores) in streaming.iter_mut().zip(scores) {
        heads.resize(layer_scores.len(), false);
    }
    streaming
}

/// The mean over the first `prompt` rows of `vectors` (`[T, d]`, post-rotary), each turned back
/// by the rotary of base `theta` at its position.
fn pre_rotary_mean(vectors: ArrayView2<f32>, prompt: usize, theta: f32) -> Array1<f64> {
    let rotary = Rotary::new(theta, vectors.ncols());
    let mut sum = Array1::<f64>::zeros(vectors.ncols());
    for (position, row) in vectors.rows().into_iter().take(prompt).enumerate() {
        let (cos, sin) = rotary.at(position);
        let minus_sin: Vec<f64> = sin.iter().map(|s| -s).collect();
        sum += &rotate(row.mapv(f64::from).view(), &cos, &minus_sin);
    }
    sum / prompt.max(1) as f64
}

/// DuoAttention's on-the-fly score of each KV head: the mean, over its query heads, of the area
/// under the cumulative attention curve of the mean query at position `q_len − 1` over the mean
/// key at positions `0..q_len`.
fn head_scores(
    queries: &[Array1<f64>],
    keys: &[Array1<f64>],
    theta: f32,
    q_len: usize,
) -> Vec<f64> {
    let d = keys[0].len();
    let rotary = Rotary::new(theta, d);
    let group = queries.len() / keys.len();
    let angles: Vec<(Vec<f64>, Vec<f64>)> = (0..q_len).map(|j| rotary.at(j)).collect();
    let rotated_keys: Vec<Vec<Array1<f64>>> = keys
        .iter()
        .map(|k| angles.iter().map(|(c, s)| rotate(k.view(), c, s)).collect())
        .collect();
    let (cos, sin) = &angles[q_len - 1];
    let area = |head: usize| {
        let query = rotate(queries[head].view(), cos, sin);
        let logits: Vec<f64> = rotated_keys[head / group]
            .iter()
            .map(|key| query.dot(key) / (d as f64).sqrt())
            .collect();
        let mut cumulative = 0.0;
        softmax_f64(&logits)
            .iter()
            .map(|p| {
                cumulative += p;
                cumulative
            })
            .sum::<f64>()
            / q_len as f64
    };
    (0..keys.len())
        .map(|kv| (kv * group..(kv + 1) * group).map(area).sum::<f64>() / group as f64)
        .collect()
}

/// The `round(n · ratio)` lowest-scoring heads over all layers (ties to even in the rounding, as
/// Python's `round`; the lower (layer, head) first among equal scores).
fn streaming_heads(scores: &[Vec<f64>], ratio: f64) -> Vec<Vec<bool>> {
    let flat: Vec<(f64, usize, usize)> = scores
        .iter()
        .enumerate()
        .flat_map(|(layer, heads)| heads.iter().enumerate().map(move |(h, &s)| (s, layer, h)))
        .collect();
    let n = (flat.len() as f64 * ratio).round_ties_even() as usize;
    let mut order = flat.clone();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    let mut streaming: Vec<Vec<bool>> = scores.iter().map(|h| vec![false; h.len()]).collect();
    for &(_, layer, head) in &order[..n] {
        streaming[layer][head] = true;
    }
    streaming
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn the_lowest_heads_over_all_layers_stream() {
        let scores = vec![vec![0.5, 0.1], vec![0.3, 0.9], vec![0.2, 0.7]];
        // 6 heads at 0.5: 3 streaming, the lowest 0.1, 0.2, 0.3.
        assert_eq!(
            streaming_heads(&scores, 0.5),
            [vec![false, true], vec![true, false], vec![true, false]]
        );
        // 6 · 0.25 = 1.5 rounds to 2 (even); 6 · 0.75 = 4.5 to 4.
        let count = |r: f64| {
            streaming_heads(&scores, r)
                .concat()
                .iter()
                .filter(|&&s| s)
                .count()
        };
        assert_eq!(
            (count(0.25), count(0.75), count(0.0), count(1.0)),
            (2, 4, 0, 6)
        );
    }

    #[test]
    fn a_flat_attention_has_the_area_of_a_uniform_curve() {
        // A zero query gives every key the same logit, p = 1/n; the cumulative curve is j/n
        // (j = 1..n), its mean (n + 1) / (2n) = 5/8 at n = 4.
        let key = array![1.0, 0.0];
        let area = head_scores(&[array![0.0, 0.0]], std::slice::from_ref(&key), 10_000.0, 4)[0];
        assert!((area - 5.0 / 8.0).abs() < 1e-12, "{area}");
        // Two positions, d = 2 (one pair, turning by the position in radians): the query at
        // position 1 against keys at 0 and 1: logits q·R(0)k and q·R(1)k over √2; with q = k =
        // [1, 0], R(1)q·k = cos 1 and R(1)q·R(1)k = 1, so p_0 = e^{cos 1/√2} / (e^{cos 1/√2} +
        // e^{1/√2}) and the area (p_0 + 1) / 2.
        let (a, b) = ((1f64.cos() / 2f64.sqrt()).exp(), (1.0 / 2f64.sqrt()).exp());
        let two = head_scores(&[array![1.0, 0.0]], std::slice::from_ref(&key), 10_000.0, 2)[0];
        assert!((two - (a / (a + b) + 1.0) / 2.0).abs() < 1e-12, "{two}");
        // A KV head scores the mean of its query heads: [q, q] as [q].
        let q = array![0.3, -1.2];
        let one = head_scores(
            std::slice::from_ref(&q),
            std::slice::from_ref(&key),
            10_000.0,
            50,
        )[0];
        let two = head_scores(&[q.clone(), q], &[key], 10_000.0, 50)[0];
        assert!((one - two).abs() < 1e-15);
    }

    #[test]
    fn decode_scores_stream_the_heads_that_lose_least() {
        // Prompt 4, sinks 1, window 1: a streaming head drops positions 1 and 2. Layer 0's heads
        // lose 0.5 and 0.1, layer 1's 0.3 and 0.0; layer 2 is a sliding layer, never ranked.
        let mass = |a: f64, b: f64| vec![0.1, a, b, 0.2, 0.1];
        let calibrated = Calibrated {
            geometry: (3, 2, 2, 4),
            global: vec![0, 1],
            evidence: Evidence::Decode(
                vec![
                    vec![mass(0.3, 0.2), mass(0.05, 0.05)],
                    vec![mass(0.2, 0.1), mass(0.0, 0.0)],
                    vec![mass(0.0, 0.0), mass(0.0, 0.0)],
                ],
                4,
            ),
        };
        let protect = Protection {
            sinks: 1,
            window: 1,
        };
        assert_eq!(
            calibrated.decode_streaming(protect, 0.5),
            [vec![false, true], vec![false, true], vec![false, false]]
        );
    }

    #[test]
    fn turning_back_undoes_the_rotary() {
        // A constant pre-rotary vector rotated at each position has itself as pre-rotary mean.
        let rotary = Rotary::new(10_000.0, 4);
        let x = array![0.5, -1.0, 2.0, 0.25];
        let rows: Vec<f32> = (0..6)
            .flat_map(|p| {
                let (c, s) = rotary.at(p);
                rotate(x.view(), &c, &s).mapv(|v| v as f32).to_vec()
            })
            .collect();
        let vectors = ndarray::Array2::from_shape_vec((6, 4), rows).unwrap();
        let mean = pre_rotary_mean(vectors.view(), 6, 10_000.0);
        assert!(
            mean.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-6),
            "{mean}"
        );
    }
}
