//! `snapkv`: SnapKV's observation-window vote (Li et al., 2024, arXiv:2404.14469), as the official
//! KVCache-Factory code computes it (docs/policies.md): the last W prompt queries
//! attend over all prompt keys (causally, so only inside the window does the mask bite), their
//! weights are summed per head over the window, pooled along positions with a same-length 1-D
//! kernel, and the group's pooled scores are aggregated (`--agg`, as kvpress and AdaKV do; under
//! `--gqa query-head` each head keeps its own, as the official code's repeated K/V do).
//! The window itself is always kept (the engine protects it).
//!
//! Pooling covers the keys `[0, n - W)` only, as the official code slices them; `avg` divides by
//! the kernel including the zero padding (torch's `count_include_pad`), `max` ignores padding.
//! One-shot: defined for `--timing prefill` only.

use super::Scored;
use super::{AlignedScores, GroupQueries, ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Timing, Unit};

crate::settings! {
    /// SnapKV's observation-window vote, pooled (Li et al., 2024, arXiv:2404.14469;
    /// KVCache-Factory `pyramidkv/pyramidkv_utils.py` lines 273-299). The observation window is
    /// the policy's protected `window`.
    pub struct SnapKv = "snapkv" {
        /// The pooling kernel (odd; `kernel_size`, 7 in the PyramidKV paper's runs).
        kernel: usize = 7,
        /// `avg` (torch's avg_pool1d, zero padding counted: the class default) or `max` (the
        /// PyramidKV paper's runs).
        pool: Pooling = Pooling::Avg,
        /// How a GQA group's query-head scores become one per cached token: `mean`, `max` or
        /// `sum` (kvpress and AdaKV average the group).
        agg: Aggregation = Aggregation::Mean,
    }
}

/// SnapKV's 1-D pooling of window scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pooling {
    /// Average pooling; the zero padding counts (divides by the kernel), as torch's avg_pool1d.
    Avg,
    /// Max pooling (the PyramidKV paper's runs).
    Max,
}

#[derive(Clone)]
struct State {
    queries: GroupQueries,
    prompt_len: usize,
    window_start: usize,
    kernel: usize,
    pool: Pooling,
    agg: Aggregation,
    /// Per query head of the unit, per position, the window's summed attention.
    sums: Vec<Vec<f32>>,
    cached: AlignedScores,
}

impl Scorer for SnapKv {
    fn supports(&self, timing: Timing) -> bool {
        timing == Timing::Prefill
    }

    fn check(&self) -> Result<(), Broken> {
        check_kernel(self.kernel)
    }

    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        let prompt_len = layer.prompt_len;
        Ok(Box::new(State {
            queries: GroupQueries::new(layer, unit),
            prompt_len,
            window_start: prompt_len.saturating_sub(protect.window.max(1)),
            kernel: self.kernel,
            pool: self.pool,
            agg: self.agg,
            sums: vec![vec![0.0; prompt_len]; unit.query_heads.len()],
            cached: AlignedScores::default(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

/// The rule of a pooling `kernel` setting: odd, so that same-length pooling is centred.
pub(crate) fn check_kernel(kernel: usize) -> Result<(), Broken> {
    if kernel.is_multiple_of(2) {
        return Err(Broken {
            key: "kernel",
            rule: "must be odd (same-length pooling needs a centred kernel)".into(),
        });
    }
    Ok(())
}

/// Same-length 1-D pooling with `kernel / 2` padding on each side.
pub(crate) fn pool1d(values: &[f32], kernel: usize, pool: Pooling) -> Vec<f32> {
    let half = kernel / 2;
    (0..values.len())
        .map(|centre| {
            let lo = centre.saturating_sub(half);
            let hi = (centre + half + 1).min(values.len());
            let window = &values[lo..hi];
            match pool {
                Pooling::Avg => window.iter().sum::<f32>() / kernel as f32,
                Pooling::Max => window.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            }
        })
        .collect()
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        if newest < self.window_start || newest >= self.prompt_len {
            return Ok(());
        }
        for (sums, weights) in self
            .sums
            .iter_mut()
            .zip(self.queries.per_head(layer, newest, cache))
        {
            for (&position, weight) in cache.iter().zip(weights) {
                sums[position] += weight;
            }
        }
        self.cached.0.clear();
        Ok(())
    }

    fn scores(&mut self, _layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        if self.cached.0.is_empty() {
            let pooled: Vec<Vec<f32>> = self
                .sums
                .iter()
                .map(|sums| pool1d(&sums[..self.window_start], self.kernel, self.pool))
                .collect();
            self.cached.0 = (0..self.prompt_len)
                .map(|position| {
                    if position < self.window_start {
                        self.agg.combine(pooled.iter().map(|p| p[position]))
                    } else {
                        f32::INFINITY
                    }
                })
                .collect();
        }
        out.clear();
        out.extend(cache.iter().map(|&position| {
            self.cached
                .0
                .get(position)
                .copied()
                .unwrap_or(f32::INFINITY)
        }));
        Ok(())
    }
}

/// The brute-force rule: per query head, the attention of the last W prompt queries on each key
/// before the window, summed and pooled (`kernel`, `pool`), the group combined by `agg`; the
/// window's keys score +inf.
#[cfg(any(test, feature = "reference"))]
impl SnapKv {
    fn window_vote(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Vec<f64> {
        let (n, w) = (layer.prompt_len, policy.window.max(1));
        layer.window_rule(cache, w, self.agg, |rows| {
            let mut sums = vec![0.0; n - w];
            for row in rows {
                for (sum, weight) in sums.iter_mut().zip(row) {
                    *sum += weight;
                }
            }
            let half = self.kernel / 2;
            (0..n - w)
                .map(|c| {
                    let around = &sums[c.saturating_sub(half)..(c + half + 1).min(n - w)];
                    match self.pool {
                        Pooling::Max => around.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                        Pooling::Avg => around.iter().sum::<f64>() / self.kernel as f64,
                    }
                })
                .collect()
        })
    }
}

#[cfg(any(test, feature = "reference"))]
impl ScorerRule for SnapKv {
    fn fixture(&self, seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        let pool = if seed.is_multiple_of(2) { "avg" } else { "max" };
        vec![("kernel", 3.into()), ("pool", pool.into())]
    }

    fn prompt_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Option<Vec<f64>> {
        Some(self.window_vote(layer, policy, cache))
    }

    /// One-shot only: the window vote over the prompt.
    fn scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let vote = self.window_vote(layer, policy, cache);
        positions.iter().map(|&j| vote[j]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn avg_pool_counts_padding() {
        // torch.nn.functional.avg_pool1d([1,2,3], 3, stride 1, padding 1) = [1, 2, 5/3].
        let pooled = pool1d(&[1.0, 2.0, 3.0], 3, Pooling::Avg);
        assert_abs_diff_eq!(pooled[0], 1.0, epsilon = 1e-6);
        assert_abs_diff_eq!(pooled[1], 2.0, epsilon = 1e-6);
        assert_abs_diff_eq!(pooled[2], 5.0 / 3.0, epsilon = 1e-6);
        assert_eq!(
            pool1d(&[1.0, 5.0, 3.0, 0.0], 3, Pooling::Max),
            vec![5.0, 5.0, 5.0, 3.0]
        );
    }

    #[test]
    fn window_vote_by_hand() {
        // Prompt of 3, window 1: only query 2 = (1,0) votes over k = (1,0), (0,0), (0,0):
        // logits [1, 0, 0] -> [e/(e+2), 1/(e+2), 1/(e+2)] = [0.576117, 0.211942, 0.211942].
        // Kernel 1 (no pooling): scores of positions 0 and 1 are those weights; 2 is the window.
        let (q, k, n) = layer_with(
            &[[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]],
            &[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
            3,
        );
        let layer = context(&q, &k, n);
        let scorer = SnapKv {
            kernel: 1,
            pool: Pooling::Avg,
            agg: Aggregation::Mean,
        };
        let protect = Protection {
            sinks: 0,
            window: 1,
        };
        let mut state = scorer.start(&layer, &unit(), protect).unwrap();
        let scores = scores_after(state.as_mut(), &layer, 3);
        assert_abs_diff_eq!(scores[0], 0.576_117, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], 0.211_942, epsilon = 1e-6);
        assert!(scores[2].is_infinite());
    }
}
