//! `rkv`: R-KV's redundancy-aware score (Cai et al., 2025, arXiv:2505.24133), as the official code
//! computes it (github.com/Zefan-Cai/R-KV, commit d15c976: `rkv/compression/r1_kv.py`,
//! `R1KV.update_kv` lines 43-82; `rkv/utils.py`, `compute_attention_scores` lines 8-38 and
//! `cal_similarity` lines 42-94). For a cache of n entries and its last W queries (R-KV's query
//! cache: the W most recent positions appended, whether still cached or not):
//!
//! - importance: per query head the logits `q k / sqrt(d)` of each of the W queries over the keys
//!   of entries `0..n-W`, the maximum over the GQA group taken on the logits (its `pooling="max"`),
//!   a softmax per query row, the mean over the rows, max-pooled along the cache with `kernel`;
//! - redundancy: the cosine similarity between every two cached keys (norms + 1e-8), the diagonal
//!   set to 0, and in each row the entry of the last (`retain = "last"`) or first key whose
//!   similarity exceeds `threshold` set to 0 (entry 0 where none does, as the code's `where` with
//!   zeros gives); the mean over rows, then a softmax over all n entries;
//! - the score of entry j < n - W: `mix_lambda * importance_j - (1 - mix_lambda) * redundancy_j`;
//!   the last W entries (the policy's protected `window`, R-KV's `window_size`) are kept.
//!
//! R-KV compresses the cache back to its budget whenever it is full at a compression step: at the
//! end of the prompt and then every `divide_length` (128) tokens of the sequence. `prefill`
//! replays the first (a trace's 16-32 decode steps reach the second only where the sequence
//! length crosses a multiple of 128); `prefill-then-stream` with `order = attend-first`,
//! `interval = 128` and `trigger = position` replays them all (`rkv/modeling.py` lines 560-563,
//! 598-610: the step at a position divisible by `divide_length` compresses after its attention),
//! and with interval 1 re-scores at every decode step. A compressed cache holds the kept entries
//! in `topk`'s order (descending score), then its window, then each new token: once the prompt is
//! cut the state keeps that order, and pooling and the last redundant key follow it. Deviations:
//! f32 throughout (the code casts the mean attention to the model's dtype); ties go to the lower
//! position (kvreplay's rule, for `topk`); the model's logit soft-cap, if any, is not applied, as
//! the code does not.

use super::snapkv::{check_kernel, pool1d, Pooling};
use super::Scored;
use super::{ScoreState, Scorer, Started};
use crate::attention::{softmax_in_place, sparse_logits};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};
use ndarray::{s, Array2};
use std::collections::VecDeque;

crate::settings! {
    /// R-KV's redundancy-aware score: observation-window attention minus key redundancy (Cai et
    /// al., 2025, arXiv:2505.24133; github.com/Zefan-Cai/R-KV `rkv/compression/r1_kv.py`). The
    /// observation window is the policy's protected `window`.
    pub struct RKv = "rkv" {
        /// The max-pooling kernel over the importance (odd; `kernel_size`, 7).
        kernel: usize = 7,
        /// Weight of the importance against the redundancy (`mix_lambda`, 0.07).
        mix_lambda: f64 = 0.07,
        /// Cosine similarity above which two keys count as redundant (`threshold`, 0.5).
        threshold: f64 = 0.5,
        /// Which redundant key of each row is exempted: `last` (the code's default) or `first`
        /// (`retain_direction`).
        retain: Retain = Retain::Last,
    }
}

/// Which of a row's redundant keys `cal_similarity` zeroes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Retain {
    /// The last key above the threshold (`retain_direction = "last"`).
    Last,
    /// The first key above the threshold (`retain_direction = "first"`).
    First,
}

#[derive(Clone)]
struct State {
    unit: Unit,
    window: usize,
    settings: RKv,
    /// The most recent `window` positions appended: R-KV's query cache.
    recent: VecDeque<usize>,
    /// The engine's cache (ascending positions), mirrored: its appends in `on_append`, its
    /// evictions in `on_evict` and `on_cut`.
    cache: Vec<usize>,
    /// R-KV's own cache order once the prompt has been cut: the kept entries outside the window
    /// in `topk` order (descending score), the window, then each token as it arrives. Empty
    /// before the cut, when the cache is in position order.
    order: Vec<usize>,
    /// The entries outside the window along `order` and their scores, as last scored.
    last: Vec<(usize, f32)>,
}

impl Scorer for RKv {
    fn supports(&self, timing: Timing) -> bool {
        matches!(timing, Timing::Prefill | Timing::PrefillThenStream)
    }

    fn check(&self) -> Result<(), Broken> {
        check_kernel(self.kernel)?;
        Broken::unless_share("mix_lambda", self.mix_lambda, None)
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            unit: unit.clone(),
            window: protect.window.max(1),
            settings: self.clone(),
            recent: VecDeque::new(),
            cache: Vec::new(),
            order: Vec::new(),
            last: Vec::new(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn on_append(&mut self, _layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        self.recent.push_back(newest);
        if self.recent.len() > self.window {
            self.recent.pop_front();
        }
        self.cache.push(newest);
        if !self.order.is_empty() {
            self.order.push(newest);
        }
        Ok(())
    }

    /// Along R-KV's own order once the prompt has been cut (its pooling and its last redundant
    /// key follow the order), laid back out in the engine's.
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        let along = match self.order.is_empty() {
            true => cache,
            false => &self.order,
        };
        let scores = self.scores_along(layer, along);
        let last = along.iter().copied().zip(scores).collect();
        self.last = last;
        out.resize(cache.len(), f32::INFINITY);
        for &(position, score) in &self.last {
            out[cache.binary_search(&position).expect("cached")] = score;
        }
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        let mut marks = kept.iter();
        let dropped: Vec<usize> = self
            .cache
            .iter()
            .copied()
            .filter(|_| !*marks.next().expect("one mark per entry"))
            .collect();
        self.cache
            .retain(|position| dropped.binary_search(position).is_err());
        if self.order.is_empty() {
            // The prompt's cut: R-KV's order starts here.
            self.order = self.cache.clone();
        }
        self.regather(|position| dropped.binary_search(&position).is_err());
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        let evicted = self.cache.remove(index);
        if !self.order.is_empty() {
            self.regather(|position| position != evicted);
        }
        Ok(())
    }

    fn on_slide_out(&mut self, index: usize) -> Scored {
        // Not a compression: the entry leaves its place in the order, the others keep theirs.
        let position = self.cache.remove(index);
        self.order.retain(|&ordered| ordered != position);
        Ok(())
    }
}

impl State {
    /// The score of each entry of `along` (cache positions, in the cache's order) outside its last
    /// `window`: importance pooled along it, minus redundancy.
    fn scores_along(&self, layer: &LayerContext<'_>, along: &[usize]) -> Vec<f32> {
        let scored = along.len().saturating_sub(self.window);
        if scored == 0 {
            return Vec::new();
        }
        let importance = pool1d(
            &self.importance(layer, &along[..scored]),
            self.settings.kernel,
            Pooling::Max,
        );
        let lambda = self.settings.mix_lambda as f32;
        if lambda == 1.0 {
            // The importance alone, as R-KV's `SnapKV` scores (`snapkv-d`): no redundancy to mix.
            return importance;
        }
        let redundancy = self.redundancy(layer, along);
        importance
            .iter()
            .zip(&redundancy)
            .map(|(a, s)| a * lambda - s * (1.0 - lambda))
            .collect()
    }

    /// After a compression, R-KV's order: the entries outside the window that `stays` keeps, by
    /// descending last score (`topk`'s order; equal scores by their place in the order), then the
    /// window in its order.
    fn regather(&mut self, stays: impl Fn(usize) -> bool) {
        let survivors: Vec<(usize, f32)> = self
            .last
            .iter()
            .copied()
            .filter(|&(position, _)| stays(position))
            .collect();
        let window = self.order.len().saturating_sub(self.window);
        self.order = super::topk_order(survivors, &self.order[window..]);
        self.last.clear();
    }

    /// The mean over the window's queries of their softmax over `keys` (cache entries), the
    /// logits' maximum over the group taken first.
    fn importance(&self, layer: &LayerContext<'_>, keys: &[usize]) -> Vec<f32> {
        let scale = 1.0 / (layer.q.shape()[2] as f32).sqrt();
        let mut mean = vec![0.0f32; keys.len()];
        let mut per_head = vec![Vec::new(); self.unit.query_heads.len()];
        for &position in &self.recent {
            let queries = layer.queries_at(self.unit.query_heads.clone(), position);
            let key_rows = layer.keys(self.unit.kv_head);
            sparse_logits(&queries, key_rows, keys, scale, None, &mut per_head);
            let (first, rest) = per_head.split_first_mut().expect("a query head");
            for other in rest.iter() {
                for (logit, &o) in first.iter_mut().zip(other) {
                    *logit = logit.max(o);
                }
            }
            softmax_in_place(first);
            for (m, w) in mean.iter_mut().zip(first.iter()) {
                *m += w;
            }
        }
        let rows = self.recent.len() as f32;
        mean.iter_mut().for_each(|m| *m /= rows);
        mean
    }

    /// `cal_similarity` over the cached keys: one value per entry. The cosine matrix is taken
    /// [`SIMILARITY_ROWS`] rows at a time, so it is never held whole (n² at 32K would be 4 GB).
    fn redundancy(&self, layer: &LayerContext<'_>, cache: &[usize]) -> Vec<f32> {
        let key_rows = layer.keys(self.unit.kv_head);
        let n = cache.len();
        let mut normalised = Array2::<f32>::zeros((n, key_rows.ncols()));
        for (mut row, &position) in normalised.rows_mut().into_iter().zip(cache) {
            let key = key_rows.row(position);
            let norm = key.dot(&key).sqrt() + 1e-8;
            row.assign(&key.mapv(|x| x / norm));
        }
        let threshold = self.settings.threshold as f32;
        let mut column_sums = vec![0.0f32; n];
        for start in (0..n).step_by(SIMILARITY_ROWS) {
            let end = (start + SIMILARITY_ROWS).min(n);
            let mut block = normalised.slice(s![start..end, ..]).dot(&normalised.t());
            for (offset, mut row) in block.rows_mut().into_iter().enumerate() {
                let row = row.as_slice_mut().expect("standard layout");
                row[start + offset] = 0.0;
                let above = |j: &usize| row[*j] > threshold;
                let exempt = match self.settings.retain {
                    Retain::Last => (0..n).rev().find(above),
                    Retain::First => (0..n).find(above),
                };
                row[exempt.unwrap_or(0)] = 0.0;
                for (sum, value) in column_sums.iter_mut().zip(row.iter()) {
                    *sum += value;
                }
            }
        }
        column_sums.iter_mut().for_each(|s| *s /= n as f32);
        softmax_in_place(&mut column_sums);
        column_sums
    }
}

/// Rows of the key-similarity matrix computed at once.
const SIMILARITY_ROWS: usize = 256;

/// The brute-force rule: the last W positions up to the newest are the queries; importance = the
/// mean over them of the softmax, over the cache before its last W entries, of the group's
/// largest logit `q k / sqrt(d)`, max-pooled along the cache (`kernel`); redundancy = the softmax
/// over the cache of the column means of the keys' cosine matrix with its diagonal and each row's
/// `retain`ed entry above `threshold` (entry 0 if none) zeroed; the score is `mix_lambda` ×
/// importance − (1 − `mix_lambda`) × redundancy, and the window scores +inf. Once the prompt is
/// cut, along R-KV's own cache order: the kept entries outside the window by descending score,
/// the window, then the new tokens; after each eviction the survivors are gathered again.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for RKv {
    fn fixture(&self, seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        let retain = if seed.is_multiple_of(2) {
            "last"
        } else {
            "first"
        };
        vec![("kernel", 3.into()), ("retain", retain.into())]
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let (lambda, threshold) = (self.mix_lambda, self.threshold);
        let w = policy.window.max(1);
        let n = positions.len();
        if n <= w {
            return vec![f64::INFINITY; n];
        }
        let scored = n - w;
        let at = *positions.last().expect("a cache");
        let d = layer.head_dim() as f64;
        let mut mean = vec![0.0; scored];
        for r in at + 1 - w..=at {
            let logits: Vec<f64> = positions[..scored]
                .iter()
                .map(|&j| {
                    cache
                        .heads
                        .iter()
                        .map(|&h| {
                            reference::dot(&layer.query(h, r), &layer.key(cache.kv, j)) / d.sqrt()
                        })
                        .fold(f64::NEG_INFINITY, f64::max)
                })
                .collect();
            for (m, p) in mean.iter_mut().zip(reference::softmax(&logits)) {
                *m += p / w as f64;
            }
        }
        let half = self.kernel / 2;
        let importance: Vec<f64> = (0..scored)
            .map(|c| {
                (c.saturating_sub(half)..(c + half + 1).min(scored))
                    .map(|i| mean[i])
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .collect();
        let keys: Vec<Vec<f64>> = positions
            .iter()
            .map(|&j| {
                let k = layer.key(cache.kv, j);
                let norm = reference::dot(&k, &k).sqrt() + 1e-8;
                k.iter().map(|x| x / norm).collect()
            })
            .collect();
        let mut columns = vec![0.0; n];
        for i in 0..n {
            let mut row: Vec<f64> = (0..n)
                .map(|j| {
                    if i == j {
                        0.0
                    } else {
                        reference::dot(&keys[i], &keys[j])
                    }
                })
                .collect();
            let above = |j: &usize| row[*j] > threshold;
            let exempt = match self.retain {
                Retain::Last => (0..n).rev().find(above),
                Retain::First => (0..n).find(above),
            };
            row[exempt.unwrap_or(0)] = 0.0;
            for (c, v) in columns.iter_mut().zip(&row) {
                *c += v / n as f64;
            }
        }
        let redundancy = reference::softmax(&columns);
        (0..n)
            .map(|i| match i < scored {
                true => lambda * importance[i] - (1.0 - lambda) * redundancy[i],
                false => f64::INFINITY,
            })
            .collect()
    }

    /// R-KV's cache after the prompt's cut is in `topk` order: the prompt's scores order it.
    fn order_at_cut(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Option<Vec<f64>> {
        let prompt: Vec<usize> = (0..layer.prompt_len).collect();
        Some(self.scores(layer, policy, cache, &prompt, &[]))
    }

    /// The same rule run along R-KV's cache order.
    fn ordered_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        _positions: &[usize],
        order: &[usize],
    ) -> Vec<(usize, f64)> {
        let scores = self.scores(layer, policy, cache, order, &[]);
        let outside = order.len().saturating_sub(policy.window.max(1));
        order[..outside].iter().copied().zip(scores).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    /// Keys (1, 0), (1, 0), (0, 1), (0, 1) [the window: the last entry], window 1, kernel 1,
    /// lambda 0.5. Importance: query (0, 0) weighs the 3 scored keys equally, 1/3 each.
    /// Similarity rows (diagonal 0): row 0 = [0, 1, 0, 0], row 1 = [1, 0, 0, 0], rows 2, 3 =
    /// [0, 0, 0, 1], [0, 0, 1, 0]; each row's last key above 0.5 is zeroed, so every row becomes
    /// 0 and the column means are [0, 0, 0, 0]: redundancy = softmax = 1/4 each.
    /// Score = 0.5/3 - 0.5/4 = 0.041667 for entries 0..3.
    #[test]
    fn exact_duplicates_are_exempted_by_hand() {
        let (q, k, n) = layer_with(
            &[[0.0, 0.0]; 4],
            &[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]],
            4,
        );
        let layer = context(&q, &k, n);
        let scorer = RKv {
            kernel: 1,
            mix_lambda: 0.5,
            threshold: 0.5,
            retain: Retain::Last,
        };
        let protect = Protection {
            sinks: 0,
            window: 1,
        };
        let mut state = scorer.start(&layer, &unit(), protect).unwrap();
        let scores = scores_after(state.as_mut(), &layer, 4);
        for score in &scores[..3] {
            assert_abs_diff_eq!(*score, 0.5 / 3.0 - 0.5 / 4.0, epsilon = 1e-6);
        }
        assert!(scores[3].is_infinite());
    }

    /// Keys (1, 0), (0.6, 0.8), (0, 1), window 1 (entry 2), threshold 0.9: no pair is above it, so
    /// every row zeroes its entry 0. Similarities: s01 = 0.6, s02 = 0, s12 = 0.8. Rows with entry
    /// 0 zeroed: [0, 0.6, 0], [0, 0, 0.8], [0, 0.8, 0]; column means [0, 1.4/3, 0.8/3];
    /// redundancy = softmax([0, 0.466667, 0.266667]) = [0.270478, 0.431264, 0.353086]... of which
    /// entries 0, 1 are scored. Query (ln 2, 0) at position 2, scale 1/sqrt(2): logits over keys
    /// 0, 1 = [0.490129, 0.294077], softmax [0.548857, 0.451143]; max pooling with kernel 1 is the
    /// identity. lambda 0: score = -redundancy.
    #[test]
    fn redundancy_by_hand() {
        let ln2 = std::f32::consts::LN_2;
        let (q, k, n) = layer_with(
            &[[0.0, 0.0], [0.0, 0.0], [ln2, 0.0]],
            &[[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]],
            3,
        );
        let layer = context(&q, &k, n);
        let protect = Protection {
            sinks: 0,
            window: 1,
        };
        let only_redundancy = RKv {
            kernel: 1,
            mix_lambda: 0.0,
            threshold: 0.9,
            retain: Retain::Last,
        };
        let mut state = only_redundancy.start(&layer, &unit(), protect).unwrap();
        let scores = scores_after(state.as_mut(), &layer, 3);
        let exp = [0.0f32.exp(), (1.4f32 / 3.0).exp(), (0.8f32 / 3.0).exp()];
        let total: f32 = exp.iter().sum();
        assert_abs_diff_eq!(scores[0], -exp[0] / total, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], -exp[1] / total, epsilon = 1e-6);
        let only_importance = RKv {
            mix_lambda: 1.0,
            ..only_redundancy
        };
        let mut state = only_importance.start(&layer, &unit(), protect).unwrap();
        let scores = scores_after(state.as_mut(), &layer, 3);
        let logits = [ln2 / 2f32.sqrt(), ln2 * 0.6 / 2f32.sqrt()];
        let e = [logits[0].exp(), logits[1].exp()];
        assert_abs_diff_eq!(scores[0], e[0] / (e[0] + e[1]), epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], e[1] / (e[0] + e[1]), epsilon = 1e-6);
    }
}
