//! `defensivekv`: DefensiveKV's defensive aggregation (Feng et al., ICLR 2026, "Taming the
//! Fragility of KV Cache Eviction in LLM Inference"), as the official code computes it
//! (github.com/FFY0/DefensiveKV, commit 9251b95: `kvpress/presses/efficient_defensivekv_press.py`,
//! `compute_window_attention` lines 116-156, `score` lines 158-227, `vwl1norm` lines 32-75). For a
//! cache of n entries whose last W are the observation window (the policy's protected `window`,
//! the code's `window_size`, 32) and the m = n − W entries before it:
//!
//! - each of the last W queries of every query head attends over the keys up to its own (softmax
//!   `q k / sqrt(d)`), and its weights on the m entries before the window are kept (`A`);
//! - each row is average-pooled along the entries (`kernel`, 5; torch's zero padding counted) and
//!   rescaled to the sum the row had before pooling;
//! - **defensive aggregation**: the largest pooled weight over the cache's query heads and the W
//!   rows, clamped from below at its mean over the m entries;
//! - times the value factor borrowed from CriticalKV: for each query head, the L1 norm of each
//!   entry's value through the head's slice of `o_proj` (`‖v W_o,h‖₁`), averaged over each KV
//!   head's group and divided by its sum over the layer's KV heads, entry by entry;
//! - **stage 1** (CriticalKV's): the entries whose mean window attention (`A` averaged over the
//!   group and the rows, normalised to sum 1) reaches `0.9 − bias` cumulative mass, taken by
//!   descending attention, score above everything else — at most `int(m·B/n − W)` of them, where
//!   `B` is `stage1_budget` (the code's `int(q_len·(1 − compression_ratio) − window_size)`, its
//!   `q_len` being m and its ratio `1 − B/n`), and `bias` is the layer's mean attention (over all
//!   query heads and rows) on the W entries just before the window (the code's
//!   `attn_weights[..., -window_size:]` of the weights already cut to the first m keys).
//!
//! The window scores +inf (the code pads it with the maximum). The official press then keeps one
//! top-k over the flattened scores of a layer's KV heads (`EfficientAdaScorerPress.compress`): the
//! `defensivekv` preset pairs this scorer with `heads = adakv`, `alpha = 0`, `normalize = false`.
//!
//! Layer-DefensiveKV (`efficient_layer_defensivekv_press.py`, the same `score`, over
//! `EfficientAdaGlobalScorerPress`: one top-k over every layer's flattened scores) ranks the
//! window and stage 1 against other layers' entries at the score the code gives them, the
//! layer's largest (`scores.max()` over its KV heads after the value factor, lines 110 and 220):
//! `layer_max = true` scores them so, and `observation` sets the window's rows apart from the
//! protected window, which that press does not keep regardless. The `layer-defensivekv` preset
//! pairs it with the `global` allocator and nothing protected.
//!
//! Deviations: f32 throughout, the weights not cast to the model's dtype; ties by the lower position
//! (the code's `torch.sort` of stage 1 and its `topk` leave them unspecified); the model's logit
//! soft-cap, if any, is not applied, as the code does not; a stage-1 cap below 0 (a budget below
//! about W·n/(n − W)) forces nothing, where the code's slice `[:cap]` would force all but `|cap|`
//! entries, more than the budget holds. Under `gqa = query-head` a cache's aggregation and stage 1
//! read its own head; the value factor stays its KV head's. Only the prompt's end is defined (the
//! code asserts one compression). Needs the trace's values and attention inputs (`o_proj`).

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
use std::ops::Range;

crate::settings! {
    /// DefensiveKV: the worst case over the observation window's heads and queries, times the
    /// value's norm through `o_proj`, after CriticalKV's stage 1 (Feng et al., ICLR 2026;
    /// github.com/FFY0/DefensiveKV `efficient_defensivekv_press.py`). The observation window is
    /// the policy's protected `window`; use the `defensivekv` preset.
    pub struct DefensiveKv = "defensivekv" {
        /// The average-pooling kernel along the entries (odd; `kernel_size`, 5).
        kernel: usize = 5,
        /// The per-cache budget whose share caps stage 1 (the preset sets it to the policy's
        /// budget): at most `int((n − W)·B/n − W)` entries are forced in; 0 turns stage 1 off.
        stage1_budget: usize = 0,
        /// The cumulative attention stage 1 forces in, before the window's bias is taken off
        /// (CriticalKV's 90%, fixed in the code).
        stage1_mass: f64 = 0.9,
        /// The window and stage 1 score the layer's largest score over its KV heads instead of
        /// ranking above everything (Layer-DefensiveKV, whose one top-k over every layer
        /// ranks them against other layers' entries).
        layer_max: bool = false,
        /// Rows of the observation window, when it is not the policy's protected `window`
        /// (0: the protected window is the observation window).
        observation: usize = 0,
    }
}

/// Rows of values sent through `o_proj` at once.
const VALUE_ROWS: usize = 1024;

#[derive(Clone)]
struct State {
    unit: Unit,
    window: usize,
    settings: DefensiveKv,
}

impl Scorer for DefensiveKv {
    fn supports(&self, timing: Timing) -> bool {
        timing == Timing::Prefill
    }

    fn check(&self) -> Result<(), Broken> {
        check_kernel(self.kernel)?;
        Broken::unless_share("stage1_mass", self.stage1_mass, None)
    }

    fn needs_values(&self) -> bool {
        true
    }

    fn needs_inputs(&self) -> bool {
        true
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            unit: unit.clone(),
            window: self.observation_rows(protect.window),
            settings: self.clone(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl DefensiveKv {
    /// The observation window's rows under a protected window of `protected`.
    fn observation_rows(&self, protected: usize) -> usize {
        match self.observation {
            0 => protected.max(1),
            rows => rows,
        }
    }
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        out.resize(cache.len(), f32::INFINITY);
        let n = cache.len();
        if n <= self.window {
            return Ok(());
        }
        let m = n - self.window;
        let rows = WindowRows::of(layer, cache, self.window);
        let shares = value_shares(layer, &cache[..m]);
        let scored = |heads: Range<usize>, kv: usize| -> Vec<f32> {
            let worst = self.defensive(&rows, heads, m);
            worst.iter().zip(&shares[kv]).map(|(w, f)| w * f).collect()
        };
        let group = |kv: usize| layer.group_size() * kv..layer.group_size() * (kv + 1);
        // Under `layer_max` every KV head's scores are needed; the cache's own are among them
        // when it reads its KV head's whole group.
        let every: Vec<Vec<f32>> = match self.settings.layer_max {
            false => Vec::new(),
            true => (0..shares.len()).map(|kv| scored(group(kv), kv)).collect(),
        };
        let own = match every.get(self.unit.kv_head) {
            Some(scores) if self.unit.query_heads == group(self.unit.kv_head) => scores.clone(),
            _ => scored(self.unit.query_heads.clone(), self.unit.kv_head),
        };
        let top = match self.settings.layer_max {
            false => f32::INFINITY,
            true => every
                .iter()
                .flatten()
                .fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
        };
        out.iter_mut().for_each(|score| *score = top);
        out[..m].copy_from_slice(&own);
        let cap = stage1_cap(m, n, self.window, self.settings.stage1_budget);
        let mean = rows.mean_attention(self.unit.query_heads.clone(), m);
        let threshold = self.settings.stage1_mass - rows.bias(m);
        for index in forced(&mean, threshold, cap) {
            out[index] = top;
        }
        Ok(())
    }
}

impl State {
    /// Per entry before the window, the largest pooled and rescaled weight over query heads
    /// `heads` and the window's rows, clamped from below at its mean.
    fn defensive(&self, rows: &WindowRows, heads: Range<usize>, m: usize) -> Vec<f32> {
        let mut worst = vec![f32::NEG_INFINITY; m];
        for head in heads {
            for row in &rows.weights[head] {
                let before = &row[..m];
                let total: f32 = before.iter().sum();
                let pooled = pool1d(before, self.settings.kernel, Pooling::Avg);
                let pooled_total: f32 = pooled.iter().sum();
                for (w, p) in worst.iter_mut().zip(&pooled) {
                    *w = w.max(p / pooled_total * total);
                }
            }
        }
        let floor = worst.iter().sum::<f32>() / m as f32;
        worst.iter_mut().for_each(|w| *w = w.max(floor));
        worst
    }
}

/// Every query head's attention from each of the window's rows over the cache up to the row.
struct WindowRows {
    /// `[head][row]`: the row's weights over the cache entries up to its own.
    weights: Vec<Vec<Vec<f32>>>,
}

impl WindowRows {
    fn of(layer: &LayerContext<'_>, cache: &[usize], window: usize) -> Self {
        let (n_kv_heads, group) = (layer.k.shape()[0], layer.group_size());
        let scale = 1.0 / (layer.q.shape()[2] as f32).sqrt();
        let mut weights = vec![Vec::with_capacity(window); n_kv_heads * group];
        let mut logits = vec![Vec::new(); group];
        for end in cache.len() - window + 1..=cache.len() {
            let position = cache[end - 1];
            for kv in 0..n_kv_heads {
                let heads = kv * group..(kv + 1) * group;
                let queries = layer.queries_at(heads.clone(), position);
                sparse_logits(
                    &queries,
                    layer.keys(kv),
                    &cache[..end],
                    scale,
                    None,
                    &mut logits,
                );
                for (head, row) in heads.zip(logits.iter_mut()) {
                    let mut row = std::mem::take(row);
                    softmax_in_place(&mut row);
                    weights[head].push(row);
                }
            }
        }
        Self { weights }
    }

    /// The mean over `heads` and the rows of their weights on the first `m` entries.
    fn mean_attention(&self, heads: std::ops::Range<usize>, m: usize) -> Vec<f32> {
        let mut mean = vec![0.0f32; m];
        let mut count = 0usize;
        for head in heads {
            for row in &self.weights[head] {
                for (sum, w) in mean.iter_mut().zip(&row[..m]) {
                    *sum += w;
                }
                count += 1;
            }
        }
        mean.iter_mut().for_each(|v| *v /= count as f32);
        mean
    }

    /// The window's bias: the mean over every head and row of the weight on the last W (at most
    /// m) entries before the window.
    fn bias(&self, m: usize) -> f64 {
        let window = self.weights[0].len();
        let (sum, count) = self
            .weights
            .iter()
            .flatten()
            .fold((0.0f64, 0usize), |(s, c), row| {
                let near: f32 = row[m.saturating_sub(window)..m].iter().sum();
                (s + near as f64, c + 1)
            });
        sum / count as f64
    }
}

/// Per KV head and entry of `entries`, the head's share of the layer's value norms through
/// `o_proj`: the mean over its group's query heads of `‖v W_o,h‖₁`, divided by the sum of that
/// mean over the layer's KV heads.
fn value_shares(layer: &LayerContext<'_>, entries: &[usize]) -> Vec<Vec<f32>> {
    let n_kv_heads = layer.k.shape()[0];
    let norms: Vec<Vec<f32>> = (0..n_kv_heads)
        .map(|kv| group_value_norms(layer, entries, kv))
        .collect();
    norms
        .iter()
        .map(|own| {
            (0..entries.len())
                .map(|i| own[i] / norms.iter().map(|n| n[i]).sum::<f32>())
                .collect()
        })
        .collect()
}

/// The mean over KV head `kv`'s query heads of each entry's `‖v W_o,h‖₁`.
fn group_value_norms(layer: &LayerContext<'_>, entries: &[usize], kv: usize) -> Vec<f32> {
    let values = layer
        .values(kv)
        .expect("the engine checks that defensivekv's trace has values");
    let o_proj = &layer
        .inputs
        .expect("the engine checks that defensivekv's trace has attention inputs")
        .projection("o_proj")
        .weight;
    let (group, d) = (layer.group_size(), values.ncols());
    let mut norms = vec![0.0f32; entries.len()];
    for start in (0..entries.len()).step_by(VALUE_ROWS) {
        let block = &entries[start..(start + VALUE_ROWS).min(entries.len())];
        let gathered = Array2::from_shape_fn((block.len(), d), |(i, x)| values[[block[i], x]]);
        for head in kv * group..(kv + 1) * group {
            let slice = o_proj.slice(s![.., head * d..(head + 1) * d]);
            let through = gathered.dot(&slice.t());
            for (norm, row) in norms[start..].iter_mut().zip(through.rows()) {
                *norm += row.iter().map(|x| x.abs()).sum::<f32>() / group as f32;
            }
        }
    }
    norms
}

/// Stage 1's cap for `m` entries before a window of `window` in a cache of `n` at budget `budget`
/// (`int(m·(1 − r) − W)` with `1 − r = B/n`), none when `budget` is 0 and 0 when it is negative.
fn stage1_cap(m: usize, n: usize, window: usize, budget: usize) -> usize {
    if budget == 0 {
        return 0;
    }
    let cap = (m as f64 * (budget as f64 / n as f64) - window as f64).trunc();
    cap.max(0.0) as usize
}

/// The entries stage 1 forces in: by descending `attention` (normalised to sum 1; ties to the
/// lower entry), those before the cumulative mass first reaches `threshold` (none if it never
/// does), at most `cap`. The f32 cumulative sum is compared with the threshold rounded to f32, as
/// torch compares a float32 tensor with a Python float.
fn forced(attention: &[f32], threshold: f64, cap: usize) -> Vec<usize> {
    let threshold = threshold as f32;
    let total: f32 = attention.iter().sum();
    let normalised: Vec<f32> = attention.iter().map(|a| a / total).collect();
    let mut order: Vec<usize> = (0..attention.len()).collect();
    order.sort_by(|&a, &b| normalised[b].total_cmp(&normalised[a]));
    let mut mass = 0.0f32;
    let count = order
        .iter()
        .position(|&i| {
            mass += normalised[i];
            mass >= threshold
        })
        .unwrap_or(0);
    order.truncate(count.min(cap));
    order
}

/// The brute-force rule, in f64 from the description above: per query head and window row the
/// softmax over the cache up to the row, cut to the m entries before the window, average-pooled
/// (`kernel`, padding counted) and rescaled to its sum; the maximum over the cache's heads and
/// the rows, raised to its mean; times the KV head's share of the group-mean `‖v W_o,h‖₁`; stage
/// 1's entries and the window +inf, or under `layer_max` the largest such score over the layer's
/// KV heads.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for DefensiveKv {
    fn fixture(&self, seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        // Stage 1 off, capped by the budget's share, or stopped by a lower mass than the cap;
        // forced entries above everything or at the layer's largest score, the observation
        // window the protected one or its own.
        let (budget, mass, layer_max, observation) = [
            (0, 0.9, false, 0),
            (6, 0.9, true, 0),
            (9, 0.3, false, 0),
            (6, 0.5, true, 4),
        ][seed as usize % 4];
        vec![
            ("kernel", 3.into()),
            ("stage1_budget", budget.into()),
            ("stage1_mass", mass.into()),
            ("layer_max", layer_max.into()),
            ("observation", observation.into()),
        ]
    }

    fn prompt_scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
    ) -> Option<Vec<f64>> {
        let positions: Vec<usize> = (0..layer.prompt_len).collect();
        Some(self.rule(
            layer,
            self.observation_rows(policy.window),
            cache,
            &positions,
        ))
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        self.rule(
            layer,
            self.observation_rows(policy.window),
            cache,
            positions,
        )
    }
}

#[cfg(any(test, feature = "reference"))]
impl DefensiveKv {
    fn rule(
        &self,
        layer: &reference::Layer,
        w: usize,
        cache: &Member,
        positions: &[usize],
    ) -> Vec<f64> {
        let n = positions.len();
        if n <= w {
            return vec![f64::INFINITY; n];
        }
        let m = n - w;
        let d = layer.head_dim() as f64;
        let n_heads = layer.q.shape()[0];
        // rows[h][r][j]: head h's row r over positions[..=m + r], zero beyond.
        let rows: Vec<Vec<Vec<f64>>> = (0..n_heads)
            .map(|h| {
                (0..w)
                    .map(|r| {
                        let visible = &positions[..=m + r];
                        let query = layer.query(h, positions[m + r]);
                        let logits: Vec<f64> = visible
                            .iter()
                            .map(|&j| {
                                reference::dot(&query, &layer.key(h / layer.group(), j)) / d.sqrt()
                            })
                            .collect();
                        reference::softmax(&logits)
                    })
                    .collect()
            })
            .collect();
        let o_proj = &layer
            .inputs
            .expect("fixture inputs")
            .projection("o_proj")
            .weight;
        let group_norm = |kv: usize, j: usize| -> f64 {
            let v = layer.value(kv, j);
            let heads = kv * layer.group()..(kv + 1) * layer.group();
            heads
                .map(|h| {
                    (0..o_proj.nrows())
                        .map(|out| {
                            let through: f64 = (0..v.len())
                                .map(|x| v[x] * o_proj[[out, h * v.len() + x]] as f64)
                                .sum();
                            through.abs()
                        })
                        .sum::<f64>()
                })
                .sum::<f64>()
                / layer.group() as f64
        };
        // Heads `heads`' defensive maximum, raised to its mean, times KV head `kv`'s share.
        let scored = |heads: &[usize], kv: usize| -> Vec<f64> {
            let mut worst = vec![f64::NEG_INFINITY; m];
            for &h in heads {
                for row in &rows[h] {
                    let pooled = reference::avg_pool(&row[..m], self.kernel);
                    let scale = row[..m].iter().sum::<f64>() / pooled.iter().sum::<f64>();
                    for (x, p) in worst.iter_mut().zip(&pooled) {
                        *x = x.max(p * scale);
                    }
                }
            }
            let floor = worst.iter().sum::<f64>() / m as f64;
            (0..m)
                .map(|i| {
                    let j = positions[i];
                    let all: f64 = (0..layer.k.shape()[0]).map(|kv| group_norm(kv, j)).sum();
                    worst[i].max(floor) * group_norm(kv, j) / all
                })
                .collect()
        };
        let mut scores = scored(&cache.heads, cache.kv);
        // What the window and stage 1 score: above everything, or the layer's largest score.
        let top = match self.layer_max {
            false => f64::INFINITY,
            true => (0..layer.k.shape()[0])
                .flat_map(|kv| {
                    let group: Vec<usize> =
                        (kv * layer.group()..(kv + 1) * layer.group()).collect();
                    scored(&group, kv)
                })
                .fold(f64::NEG_INFINITY, f64::max),
        };
        let near = m.saturating_sub(w)..m;
        let bias = rows
            .iter()
            .flatten()
            .map(|row| row[near.clone()].iter().sum::<f64>())
            .sum::<f64>()
            / (n_heads * w) as f64;
        let mean: Vec<f64> = (0..m)
            .map(|i| {
                let sum: f64 = cache
                    .heads
                    .iter()
                    .flat_map(|&h| &rows[h])
                    .map(|row| row[i])
                    .sum();
                sum / (cache.heads.len() * w) as f64
            })
            .collect();
        let total: f64 = mean.iter().sum();
        let mut order: Vec<usize> = (0..m).collect();
        order.sort_by(|&a, &b| mean[b].total_cmp(&mean[a]));
        let mut cumulative = 0.0;
        let reached = order.iter().position(|&i| {
            cumulative += mean[i] / total;
            cumulative >= self.stage1_mass - bias
        });
        let cap = match self.stage1_budget {
            0 => 0,
            b => ((m as f64 * b as f64 / n as f64) - w as f64).max(0.0) as usize,
        };
        for &i in order.iter().take(reached.unwrap_or(0).min(cap)) {
            scores[i] = top;
        }
        scores.resize(n, top);
        scores
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_one_takes_the_heaviest_entries_until_the_mass_is_reached() {
        // Masses 0.1, 0.4, 0.2, 0.3: by weight 1 (0.4), 3 (0.7), 2 (0.9), 0 (1.0). The code counts
        // the entries before the one whose cumulative mass first reaches the threshold.
        let attention = [1.0, 4.0, 2.0, 3.0];
        assert_eq!(forced(&attention, 0.65, 10), vec![1]);
        assert_eq!(forced(&attention, 0.85, 10), vec![1, 3]);
        assert_eq!(forced(&attention, 0.85, 1), vec![1]);
        // A threshold at or below the heaviest entry's mass forces nothing (`argmax` is 0).
        assert_eq!(forced(&attention, 0.3, 10), Vec::<usize>::new());
    }

    #[test]
    fn the_cap_is_the_budgets_share_of_the_entries_before_the_window() {
        // int(q_len·(1 − r) − W) with q_len = m = 4064, r = 0.8 (n = 4096, B = 819.2 → 820 is
        // not exact, so take B = 1024, r = 0.75): 4064·0.25 − 32 = 984.
        assert_eq!(stage1_cap(4064, 4096, 32, 1024), 984);
        // 120·0.25 − 8 = 22; truncated toward zero; a negative cap forces nothing.
        assert_eq!(stage1_cap(120, 128, 8, 32), 22);
        assert_eq!(stage1_cap(120, 128, 8, 33), 22);
        assert_eq!(stage1_cap(120, 128, 8, 4), 0);
        assert_eq!(stage1_cap(120, 128, 8, 0), 0);
    }
}
