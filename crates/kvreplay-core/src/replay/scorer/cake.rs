//! `cake`: CAKE's token score (Qin et al., ICLR 2025, arXiv:2503.12491; antgroup/cakekv, commit
//! c4675ce2, `cake/model/modify_llama.py` lines 111-120 and `cake/cake_cache.py` lines 294-324).
//!
//! At the end of the prompt, the last W queries (the policy's window) attend over the prompt
//! (causally); per query head, a key's score is the mean of its W weights plus `gamma` times their
//! unbiased variance, for the keys before the window; the scores are average-pooled (kernel 5,
//! zero padding counted) and the group's pooled scores averaged (`agg`). While decoding, the
//! cache is re-scored before each eviction by the newest query's attention over it (itself
//! included), the entries outside the last W pooled the same way in the official cache's order;
//! the last W are always kept. That order is not the positions': CAKE gathers the kept entries in
//! `topk` order, highest score first (`cake_cache.py` lines 259 and 310), so after the prompt's cut
//! and after every eviction the entries outside the window sit by descending score, the window
//! after them in position order and each new token last; pooling mixes neighbours in that order,
//! and this scorer keeps it. With W = 1 the variance is taken as 0 (torch's would be undefined).
//! Defined for the `prefill` and `prefill-then-stream` timings.

use super::snapkv::{check_kernel, pool1d};
use super::Scored;
use super::{GroupQueries, Pooling, ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Timing, Unit};

crate::settings! {
    /// CAKE's token score: mean + gamma x variance of the window's attention, pooled, and the
    /// newest query's pooled attention while decoding (Qin et al., ICLR 2025, arXiv:2503.12491).
    pub struct Cake = "cake" {
        /// The weight of the variance (`--gamma`, 200 in `experiments/LongBench/pred_cake.py`).
        gamma: f64 = 200.0,
        /// The average-pooling kernel (odd; 5 in CAKE's code).
        kernel: usize = 5,
        /// How a GQA group's query-head scores become one per cached token (CAKE averages the
        /// group after pooling).
        agg: Aggregation = Aggregation::Mean,
    }
}

#[derive(Clone)]
struct State {
    queries: GroupQueries,
    prompt_len: usize,
    window: usize,
    gamma: f64,
    kernel: usize,
    agg: Aggregation,
    /// Per query head, per key before the window: the sum of its window weights and of their
    /// squares.
    sums: Vec<Vec<(f64, f64)>>,
    /// The engine's cache (positions, ascending), mirrored append by append.
    cache: Vec<usize>,
    /// While decoding, the official cache's order of the same positions.
    order: Vec<usize>,
    /// The pooled scores of the last decode step, by entry of `order`.
    last_pooled: Vec<f32>,
    /// The prompt-end scores, made from `sums` when first asked for (the window is complete by
    /// then) and kept for the cut and the order after it.
    prompt_end: Vec<f32>,
}

impl Scorer for Cake {
    fn check(&self) -> Result<(), Broken> {
        check_kernel(self.kernel)?;
        if !self.gamma.is_finite() || self.gamma < 0.0 {
            return Err(Broken {
                key: "gamma",
                rule: "must be finite and at least 0".into(),
            });
        }
        Ok(())
    }

    fn supports(&self, timing: Timing) -> bool {
        matches!(timing, Timing::Prefill | Timing::PrefillThenStream)
    }

    fn cuts_while_decoding(&self) -> bool {
        false
    }

    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        let window = protect.window.clamp(1, layer.prompt_len);
        let before_window = layer.prompt_len - window;
        Ok(Box::new(State {
            queries: GroupQueries::new(layer, unit),
            prompt_len: layer.prompt_len,
            window,
            gamma: self.gamma,
            kernel: self.kernel,
            agg: self.agg,
            sums: vec![vec![(0.0, 0.0); before_window]; unit.query_heads.len()],
            cache: Vec::new(),
            order: Vec::new(),
            last_pooled: Vec::new(),
            prompt_end: Vec::new(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl State {
    /// Pools each head's scores and aggregates the group.
    fn pooled(&self, per_head: &[Vec<f32>]) -> Vec<f32> {
        let pooled: Vec<Vec<f32>> = per_head
            .iter()
            .map(|scores| pool1d(scores, self.kernel, Pooling::Avg))
            .collect();
        let len = pooled.first().map_or(0, Vec::len);
        (0..len)
            .map(|entry| self.agg.combine(pooled.iter().map(|p| p[entry])))
            .collect()
    }

    /// The prompt-end score of every key before the window: mean + gamma * unbiased variance,
    /// computed once (the window's sums are freed then).
    fn window_scores(&mut self) -> &[f32] {
        if self.prompt_end.is_empty() {
            self.prompt_end = self.pooled_window_scores();
            self.sums = Vec::new();
        }
        &self.prompt_end
    }

    fn pooled_window_scores(&self) -> Vec<f32> {
        let rows = self.window as f64;
        let per_head: Vec<Vec<f32>> = self
            .sums
            .iter()
            .map(|sums| {
                sums.iter()
                    .map(|&(sum, sum_sq)| {
                        let mean = sum / rows;
                        let variance = if self.window > 1 {
                            ((sum_sq - rows * mean * mean) / (rows - 1.0)).max(0.0)
                        } else {
                            0.0
                        };
                        (mean + self.gamma * variance) as f32
                    })
                    .collect()
            })
            .collect();
        self.pooled(&per_head)
    }
}

impl State {
    /// The official order of the cache the prompt's cut left: the entries before the window by
    /// descending prompt-end score (`topk` order; equal scores by position), then the window.
    fn order_after_cut(&mut self) -> Vec<usize> {
        let before_window = self.prompt_len - self.window;
        let mut order: Vec<usize> = self.cache.clone();
        let scores = self.window_scores();
        let split = order.partition_point(|&position| position < before_window);
        order[..split].sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        order
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        if newest == self.prompt_len {
            self.order = self.order_after_cut();
        }
        if newest >= self.prompt_len {
            self.order.push(newest);
        }
        // Mirrors the engine's cache: its appends here, its evictions in on_evict and on_cut.
        self.cache.push(newest);
        debug_assert_eq!(self.cache.len(), cache.len());
        let before_window = self.prompt_len - self.window;
        if newest < before_window || newest >= self.prompt_len {
            return Ok(());
        }
        let per_head = self.queries.per_head(layer, newest, cache);
        for (sums, weights) in self.sums.iter_mut().zip(per_head) {
            for (&position, &weight) in cache.iter().zip(weights) {
                if position < before_window {
                    let weight = weight as f64;
                    sums[position].0 += weight;
                    sums[position].1 += weight * weight;
                }
            }
        }
        Ok(())
    }

    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        out.clear();
        if newest < self.prompt_len {
            let scores = self.window_scores();
            out.extend(
                cache
                    .iter()
                    .map(|&position| scores.get(position).copied().unwrap_or(f32::INFINITY)),
            );
            return Ok(());
        }
        // The newest query's weights, laid out in the official order, pooled outside the window.
        let outside = self.order.len().saturating_sub(self.window);
        let per_head: Vec<Vec<f32>> = self
            .queries
            .per_head(layer, newest, cache)
            .iter()
            .map(|weights| {
                self.order[..outside]
                    .iter()
                    .map(|position| weights[cache.binary_search(position).expect("cached")])
                    .collect()
            })
            .collect();
        self.last_pooled = self.pooled(&per_head);
        out.resize(cache.len(), f32::INFINITY);
        for (position, &score) in self.order[..outside].iter().zip(&self.last_pooled) {
            out[cache.binary_search(position).expect("cached")] = score;
        }
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        // The order is made when decoding starts.
        let mut marks = kept.iter();
        self.cache
            .retain(|_| *marks.next().expect("one mark per entry"));
        Ok(())
    }

    fn on_slide_out(&mut self, index: usize) -> Scored {
        // Not a choice of CAKE's: the entry leaves its place in the order, the others keep theirs.
        let position = self.cache.remove(index);
        self.order.retain(|&ordered| ordered != position);
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        let position = self.cache.remove(index);
        if self.order.is_empty() {
            // Before decoding: the order is made when decoding starts.
            return Ok(());
        }
        // A decode eviction (never of the window): the survivors outside the window are gathered
        // in `topk` order.
        let outside = self.last_pooled.len();
        let survivors: Vec<(usize, f32)> = self.order[..outside]
            .iter()
            .copied()
            .zip(self.last_pooled.iter().copied())
            .filter(|&(p, _)| p != position)
            .collect();
        self.order = super::topk_order(survivors, &self.order[outside..]);
        self.last_pooled.clear();
        Ok(())
    }
}

/// The brute-force rule. At the prompt's end, per query head, mean + `gamma` × unbiased
/// variance of the last W queries' weights on each key before the window, average-pooled
/// (`kernel`), the group combined by `agg`; the window scores +inf. While decoding, CAKE's own
/// cache order: the entries outside the window sorted by that score at the cut, the window after
/// them, new tokens last; each step, the newest query's attention laid out in that order,
/// average-pooled in it, the group combined; after an eviction the survivors outside the window
/// are gathered by descending pooled score.
#[cfg(any(test, feature = "reference"))]
impl Cake {
    fn window_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Vec<f64> {
        let (n, w) = (layer.prompt_len, policy.window.max(1));
        layer.window_rule(cache, w, self.agg, |rows| {
            let scores: Vec<f64> = (0..n - w)
                .map(|j| {
                    let mean = rows.iter().map(|r| r[j]).sum::<f64>() / w as f64;
                    let var = match w > 1 {
                        true => {
                            rows.iter().map(|r| (r[j] - mean).powi(2)).sum::<f64>() / (w - 1) as f64
                        }
                        false => 0.0,
                    };
                    mean + self.gamma * var
                })
                .collect();
            reference::avg_pool(&scores, self.kernel)
        })
    }
}

#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Cake {
    fn fixture(&self, _seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        vec![("kernel", 3.into())]
    }

    fn prompt_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Option<Vec<f64>> {
        Some(self.window_scores(layer, policy, cache))
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        running: &[f64],
    ) -> Vec<f64> {
        match positions.last().is_some_and(|&at| at < layer.prompt_len) {
            true => self.window_scores(layer, policy, cache),
            false => running.to_vec(),
        }
    }

    fn order_at_cut(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Option<Vec<f64>> {
        Some(self.window_scores(layer, policy, cache))
    }

    fn ordered_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        order: &[usize],
    ) -> Vec<(usize, f64)> {
        let at = *positions.last().expect("a cache");
        let outside = order.len().saturating_sub(policy.window.max(1));
        let per_head: Vec<Vec<f64>> = cache
            .heads
            .iter()
            .map(|&h| {
                let weights = layer.attention(&layer.query(h, at), cache.kv, positions);
                let laid_out: Vec<f64> = order[..outside]
                    .iter()
                    .map(|p| weights[positions.iter().position(|c| c == p).expect("cached")])
                    .collect();
                reference::avg_pool(&laid_out, self.kernel)
            })
            .collect();
        (0..outside)
            .map(|i| {
                let heads: Vec<f64> = per_head.iter().map(|p| p[i]).collect();
                (order[i], reference::combine(self.agg, &heads))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn mean_plus_gamma_variance_by_hand() {
        // Prompt of 4, window 2: queries 2 = (1,0) and 3 = (0,0) over keys k0 = (1,0), k1 = k2 =
        // k3 = (0,0). Query 2 over keys 0..=2: logits [1, 0, 0] -> [e/(e+2), 1/(e+2), ...] =
        // [0.576117, 0.211942]; query 3 over keys 0..=3: uniform, 0.25 each.
        // Key 0: mean 0.413059, unbiased variance (0.576117 - 0.25)^2 / 2 = 0.053176.
        // Key 1: mean 0.230971, variance (0.211942 - 0.25)^2 / 2 = 0.000724.
        // gamma 1, kernel 1: [0.466235, 0.231695]; the window scores +inf.
        let (q, k, n) = layer_with(
            &[[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]],
            &[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
            4,
        );
        let layer = context(&q, &k, n);
        let scorer = Cake {
            gamma: 1.0,
            kernel: 1,
            agg: Aggregation::Mean,
        };
        let protect = Protection {
            sinks: 0,
            window: 2,
        };
        let mut state = scorer.start(&layer, &unit(), protect).unwrap();
        let scores = scores_after(state.as_mut(), &layer, 4);
        assert_abs_diff_eq!(scores[0], 0.466_235, epsilon = 1e-5);
        assert_abs_diff_eq!(scores[1], 0.231_695, epsilon = 1e-5);
        assert!(scores[2].is_infinite() && scores[3].is_infinite());
    }
}
