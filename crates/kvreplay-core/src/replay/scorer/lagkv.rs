//! `lagkv`: LagKV's attention-free score (Liang et al., 2025, arXiv:2504.04704; kvpress
//! `LagKVPress`, `kvpress/presses/lagkv_press.py` lines 46-98, commit 8bb29b9c). After the first
//! `n_sink` tokens the prompt is cut into partitions of `lag_size`; each partition's keys and
//! values are min-max normalised per channel by the *next* partition's range, and a token's
//! score is the softmax, over its partition, of the standard deviation of its normalised channels
//! (unbiased), keys and values averaged; by default that score becomes the token's rank within
//! its partition divided by `lag_size` (`cross_scoring = false`). The sinks and the tail (the last
//! full partition, which only serves as a reference, and what is left after it) score 1, above
//! any rank; a prompt shorter than `n_sink + 2 lag_size` is scored by recency. One-shot, as
//! kvpress presses are. Needs the trace's values.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};
use ndarray::ArrayView2;

crate::settings! {
    /// LagKV: keys and values normalised by the next partition's range, scored by the spread of
    /// their channels (Liang et al., 2025, arXiv:2504.04704; kvpress `LagKVPress`).
    pub struct LagKv = "lagkv" {
        /// Tokens per partition (`lag_size`, 128 in kvpress).
        lag_size: usize = 128,
        /// Initial tokens that score 1 (`n_sink`, 4 in kvpress).
        n_sink: usize = 4,
        /// Keep the softmax scores, comparable across partitions, instead of ranks within each
        /// (`cross_scoring`, for AdaKV-style head splits).
        cross_scoring: bool = false,
    }
}

#[derive(Clone)]
struct State {
    kv_head: usize,
    settings: LagKv,
}

impl Scorer for LagKv {
    fn check(&self) -> Result<(), Broken> {
        if self.lag_size == 0 {
            return Err(Broken {
                key: "lag_size",
                rule: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    fn needs_values(&self) -> bool {
        true
    }

    fn supports(&self, timing: Timing) -> bool {
        timing == Timing::Prefill
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            kv_head: unit.kv_head,
            settings: self.clone(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let values = layer
            .v
            .expect("the engine checks that lagkv's trace has values");
        let keys = layer.keys(self.kv_head);
        let values = values.index_axis_move(ndarray::Axis(0), self.kv_head);
        *out = lag_scores(keys, values, cache, &self.settings);
        Ok(())
    }
}

/// The scores of the entries `cache` (positions, in cache order) of one KV head.
fn lag_scores(
    keys: ArrayView2<f32>,
    values: ArrayView2<f32>,
    cache: &[usize],
    settings: &LagKv,
) -> Vec<f32> {
    let (n, lag, sinks) = (cache.len(), settings.lag_size, settings.n_sink);
    if n < sinks + 2 * lag {
        // Lines 56-63: no compression; the part after the sinks by recency.
        let rest = n.saturating_sub(sinks);
        return (0..n)
            .map(|i| {
                if i < sinks {
                    1.0
                } else {
                    (i - sinks) as f32 / rest as f32
                }
            })
            .collect();
    }
    let end = sinks + (n - sinks) / lag * lag;
    let mut out = vec![1.0f32; n];
    for start in (sinks..end - lag).step_by(lag) {
        let rows = |array: ArrayView2<f32>, from: usize| rows(array, &cache[from..from + lag]);
        let key_score = partition_score(&rows(keys, start), &rows(keys, start + lag));
        let value_score = partition_score(&rows(values, start), &rows(values, start + lag));
        let score: Vec<f32> = key_score
            .iter()
            .zip(&value_score)
            .map(|(k, v)| (k + v) / 2.0)
            .collect();
        let score = if settings.cross_scoring {
            score
        } else {
            ranks(&score)
                .into_iter()
                .map(|r| r as f32 / lag as f32)
                .collect()
        };
        out[start..start + lag].copy_from_slice(&score);
    }
    out
}

/// The rows `positions` of `array`.
fn rows(array: ArrayView2<f32>, positions: &[usize]) -> Vec<Vec<f32>> {
    positions
        .iter()
        .map(|&position| array.row(position).to_vec())
        .collect()
}

/// `_get_states_score` for one partition (lines 91-98): the tokens `target` normalised by the
/// per-channel min and max of `reference`, the unbiased standard deviation over channels, and
/// the softmax over the partition.
fn partition_score(target: &[Vec<f32>], reference: &[Vec<f32>]) -> Vec<f32> {
    let dim = target[0].len();
    let (mut low, mut high) = (vec![f32::INFINITY; dim], vec![f32::NEG_INFINITY; dim]);
    for row in reference {
        for (c, &x) in row.iter().enumerate() {
            low[c] = low[c].min(x);
            high[c] = high[c].max(x);
        }
    }
    let spread: Vec<f32> = target
        .iter()
        .map(|row| {
            let normalised: Vec<f32> = row
                .iter()
                .enumerate()
                .map(|(c, &x)| (x - low[c]) / (high[c] - low[c]))
                .collect();
            let mean = normalised.iter().sum::<f32>() / dim as f32;
            let squares: f32 = normalised.iter().map(|x| (x - mean) * (x - mean)).sum();
            (squares / (dim as f32 - 1.0)).sqrt()
        })
        .collect();
    crate::attention::softmax(&spread)
}

/// Each value's rank within `values` (`argsort().argsort()`, ties by index).
fn ranks(values: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]).then(a.cmp(&b)));
    let mut rank = vec![0; values.len()];
    for (r, index) in order.into_iter().enumerate() {
        rank[index] = r;
    }
    rank
}

/// The brute-force rule, ranks within partitions: after the `n_sink` sinks, partitions of
/// `lag_size` tokens; each token's key and value channels are scaled into [0, 1] by the next
/// partition's per-channel range, their sample standard deviation is softmaxed over the
/// partition, keys and values averaged, and the token scores its rank in its partition /
/// `lag_size`. Sinks and everything from the last full partition on score 1; a short cache
/// scores by recency after the sinks. (`cross_scoring` false, the default, only.)
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for LagKv {
    fn fixture(&self, _seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        vec![("lag_size", 3.into())]
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let (sinks, lag) = (self.n_sink, self.lag_size);
        let n = positions.len();
        if n < sinks + 2 * lag {
            return (0..n)
                .map(|i| match i < sinks {
                    true => 1.0,
                    false => (i - sinks) as f64 / (n - sinks) as f64,
                })
                .collect();
        }
        let full = (n - sinks) / lag;
        let mut out = vec![1.0; n];
        for p in 0..full - 1 {
            let start = sinks + p * lag;
            let part = &positions[start..start + lag];
            let next = &positions[start + lag..start + 2 * lag];
            let key_soft = spread_softmax(part, next, &|j| layer.key(cache.kv, j));
            let value_soft = spread_softmax(part, next, &|j| layer.value(cache.kv, j));
            let score: Vec<f64> = (0..lag)
                .map(|i| (key_soft[i] + value_soft[i]) / 2.0)
                .collect();
            for i in 0..lag {
                let below = (0..lag)
                    .filter(|&o| score[o] < score[i] || (score[o] == score[i] && o < i))
                    .count();
                out[start + i] = below as f64 / lag as f64;
            }
        }
        out
    }
}

/// The reference's softmax over `part` of each token's sample standard deviation of its
/// channels, scaled by `next`'s per-channel min and max.
#[cfg(any(test, feature = "reference"))]
fn spread_softmax(part: &[usize], next: &[usize], row: &dyn Fn(usize) -> Vec<f64>) -> Vec<f64> {
    let next_rows: Vec<Vec<f64>> = next.iter().map(|&j| row(j)).collect();
    let d = next_rows[0].len();
    let stds: Vec<f64> = part
        .iter()
        .map(|&j| {
            let r = row(j);
            let scaled: Vec<f64> = (0..d)
                .map(|x| {
                    let low = next_rows.iter().map(|n| n[x]).fold(f64::INFINITY, f64::min);
                    let high = next_rows
                        .iter()
                        .map(|n| n[x])
                        .fold(f64::NEG_INFINITY, f64::max);
                    (r[x] - low) / (high - low)
                })
                .collect();
            let mean = scaled.iter().sum::<f64>() / d as f64;
            (scaled.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (d - 1) as f64).sqrt()
        })
        .collect();
    reference::softmax(&stds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;
    use ndarray::Array2;

    fn settings(lag_size: usize, n_sink: usize, cross_scoring: bool) -> LagKv {
        LagKv {
            lag_size,
            n_sink,
            cross_scoring,
        }
    }

    #[test]
    fn short_prompts_are_scored_by_recency() {
        let zeros = Array2::<f32>::zeros((5, 2));
        let cache: Vec<usize> = (0..5).collect();
        let scores = lag_scores(zeros.view(), zeros.view(), &cache, &settings(2, 2, false));
        // 5 < 2 + 2 * 2: sinks 1, then arange(3) / 3.
        assert_eq!(scores, vec![1.0, 1.0, 0.0, 1.0 / 3.0, 2.0 / 3.0]);
    }

    #[test]
    fn a_partition_by_hand() {
        // One sink, lag 2, 6 tokens: partition [1, 2] is scored against [3, 4]; the tail 3..6
        // (the reference partition and the remainder) and the sink score 1. Three channels.
        // Reference keys rows 3, 4: (0, 0, 0) and (2, 4, 1): low (0, 0, 0), high (2, 4, 1).
        // Key 1 = (1, 1, 1) -> (0.5, 0.25, 1): mean 0.583333, unbiased std 0.381881.
        // Key 2 = (2, 0, 0) -> (1, 0, 0): std 0.577350. softmax -> [0.451288, 0.548712].
        // Values equal the keys, so the averaged score is the same; ranks 0 and 1, / 2.
        let keys = Array2::from_shape_vec(
            (6, 3),
            vec![
                9., 9., 9., 1., 1., 1., 2., 0., 0., 0., 0., 0., 2., 4., 1., 5., 5., 5.,
            ],
        )
        .unwrap();
        let cache: Vec<usize> = (0..6).collect();
        let cross = lag_scores(keys.view(), keys.view(), &cache, &settings(2, 1, true));
        assert_abs_diff_eq!(cross[1], 0.451_288, epsilon = 1e-6);
        assert_abs_diff_eq!(cross[2], 0.548_712, epsilon = 1e-6);
        assert_eq!([cross[0], cross[3], cross[4], cross[5]], [1.0; 4]);
        let ranked = lag_scores(keys.view(), keys.view(), &cache, &settings(2, 1, false));
        assert_eq!(ranked, vec![1.0, 0.0, 0.5, 1.0, 1.0, 1.0]);
    }
}
