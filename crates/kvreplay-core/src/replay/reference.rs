//! A slow, obviously correct replay, written from the method descriptions alone (f64, plain
//! loops, nothing shared with the engine's arithmetic), that the conformance tests compare the
//! engine with on small fixtures.
//!
//! The machinery here is common to every scorer: the caches of a layer, the timings (one-shot,
//! streaming, the prompt-end cut, per-step re-selection), protection, ties and the metrics. What
//! one scorer scores is its [`ScorerRule`], written in the scorer's own file and reached through
//! [`Scorer::reference`](super::scorer::Scorer::reference): a registered scorer without one fails
//! the conformance test, naming it.

use super::channels::ChannelPruning;
use super::merge::{DecodeMerge, Eviction, ValueMerge};
use super::quantizer::{quantize_group, Grouping, Scheme};
use super::{Aggregation, Timing, Trigger};
use ndarray::Array3;
use serde_json::Value;
use std::ops::Range;

/// A scorer's brute-force rule, and the settings it runs with on the test fixtures.
pub trait ScorerRule: Send + Sync {
    /// Settings for the fixtures (20-token prompts, head size 8) beyond the policy's common
    /// ones, where the defaults do not fit them (a kernel, a partition, a page); `seed` numbers
    /// the fixture.
    fn fixture(&self, _seed: u64) -> Vec<(&'static str, Value)> {
        Vec::new()
    }
    /// Scores of the prompt positions at the prompt's end with nothing evicted, where the rule
    /// is not its streaming rule run over the prompt (SnapKV's window vote).
    fn prompt_scores(&self, _layer: &Layer, _policy: &Policy, _cache: &Member) -> Option<Vec<f64>> {
        None
    }
    /// Updates the running scores (one per entry of `cache`, before its newest) after `cache`'s
    /// newest position arrived; the rules that keep none push nothing meaningful (a 0).
    fn step(&self, _layer: &Layer, _cache: &Member, _positions: &[usize], running: &mut Vec<f64>) {
        running.push(0.0);
    }
    /// The scores compared when the cache must choose, one per entry of `positions` (higher
    /// kept), given the running scores `step` kept.
    fn scores(
        &self,
        layer: &Layer,
        policy: &Policy,
        cache: &Member,
        positions: &[usize],
        running: &[f64],
    ) -> Vec<f64>;
    /// A rule that keeps its own cache order while decoding (CAKE): the scores that order the
    /// entries outside the window at the prompt's end.
    fn order_at_cut(&self, _layer: &Layer, _policy: &Policy, _cache: &Member) -> Option<Vec<f64>> {
        None
    }
    /// For such a rule, the decode-time scores of the entries outside the window, in its cache
    /// `order`: (position, score).
    fn ordered_scores(
        &self,
        _layer: &Layer,
        _policy: &Policy,
        _cache: &Member,
        _positions: &[usize],
        _order: &[usize],
    ) -> Vec<(usize, f64)> {
        Vec::new()
    }
}

/// One layer of a fixture, as the reference reads it.
pub struct Layer<'a> {
    /// Queries `[n_heads, T, d]`.
    pub q: &'a Array3<f32>,
    /// Keys `[n_kv_heads, T, d]`.
    pub k: &'a Array3<f32>,
    /// Values `[n_kv_heads, T, d]`.
    pub v: &'a Array3<f32>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Softmax scale.
    pub scale: f64,
    /// The layer's index (the `random` scorer's stream).
    pub index: usize,
    /// The rotary base (the scorers that turn queries back).
    pub rope_theta: f64,
    /// The layer's rows of the reconstruction pass (`kvzip`).
    pub reconstruction: Option<&'a crate::trace::LayerReconstruction>,
    /// The layer's attention inputs (`defensivekv` reads `o_proj`).
    pub inputs: Option<&'a crate::trace::LayerInputs>,
}

/// The policy's common settings, and its scorer's rule.
pub struct Policy<'a> {
    /// What the scorer scores.
    pub rule: &'a dyn ScorerRule,
    /// When it chooses.
    pub timing: Timing,
    /// Tokens per cache.
    pub budget: usize,
    /// Protected recent tokens (SnapKV's and CAKE's observation window).
    pub window: usize,
    /// Protected first tokens.
    pub sinks: usize,
    /// One cache per query head.
    pub per_query_head: bool,
    /// One kept set for the whole layer: scores are the mean over its caches.
    pub shared_layer: bool,
    /// The decode query attends before the step's eviction.
    pub attend_first: bool,
    /// Under a streaming timing, tokens the cache grows past its budget before one compression
    /// cuts it back (1: one eviction per token).
    pub interval: usize,
    /// What makes such a compression happen.
    pub trigger: Trigger,
}

/// One cache: its query heads, its KV head and its index.
pub struct Member {
    /// The query heads that read it.
    pub heads: Vec<usize>,
    /// Its KV head.
    pub kv: usize,
    /// Its index in the layer.
    pub unit: usize,
}

impl Layer<'_> {
    /// Positions in the layer.
    pub fn t(&self) -> usize {
        self.q.shape()[1]
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.q.shape()[0] / self.k.shape()[0]
    }

    /// Head size.
    pub fn head_dim(&self) -> usize {
        self.q.shape()[2]
    }

    /// Softmax of `query` over the keys at `positions` of KV head `kv`.
    pub fn attention(&self, query: &[f64], kv: usize, positions: &[usize]) -> Vec<f64> {
        let logits: Vec<f64> = positions
            .iter()
            .map(|&j| dot(query, &self.key(kv, j)) * self.scale)
            .collect();
        softmax(&logits)
    }

    /// Query head `head` at position `at`.
    pub fn query(&self, head: usize, at: usize) -> Vec<f64> {
        (0..self.head_dim())
            .map(|x| self.q[[head, at, x]] as f64)
            .collect()
    }

    /// The key of KV head `kv` at position `at`.
    pub fn key(&self, kv: usize, at: usize) -> Vec<f64> {
        (0..self.head_dim())
            .map(|x| self.k[[kv, at, x]] as f64)
            .collect()
    }

    /// The value of KV head `kv` at position `at`.
    pub fn value(&self, kv: usize, at: usize) -> Vec<f64> {
        (0..self.v.shape()[2])
            .map(|x| self.v[[kv, at, x]] as f64)
            .collect()
    }

    /// The group's attention from position `at` over `positions`, its heads combined by `agg`.
    pub fn group_attention(
        &self,
        heads: &[usize],
        kv: usize,
        at: usize,
        positions: &[usize],
        agg: Aggregation,
    ) -> Vec<f64> {
        let rows: Vec<Vec<f64>> = heads
            .iter()
            .map(|&h| self.attention(&self.query(h, at), kv, positions))
            .collect();
        (0..positions.len())
            .map(|i| combine(agg, &rows.iter().map(|r| r[i]).collect::<Vec<_>>()))
            .collect()
    }

    /// Each of the last `w` prompt queries' attention of head `head` over the keys up to it.
    pub fn window_rows(&self, head: usize, kv: usize, w: usize) -> Vec<Vec<f64>> {
        let n = self.prompt_len;
        (n - w..n)
            .map(|at| {
                let visible: Vec<usize> = (0..=at).collect();
                self.attention(&self.query(head, at), kv, &visible)
            })
            .collect()
    }

    /// One score per prompt position from a rule over each query head's last `w` rows
    /// ([`window_rows`](Self::window_rows)) that scores the keys before the window: the heads of
    /// `cache` combined by `agg`, the window's positions +inf (always kept).
    pub fn window_rule(
        &self,
        cache: &Member,
        w: usize,
        agg: Aggregation,
        rule: impl Fn(&[Vec<f64>]) -> Vec<f64>,
    ) -> Vec<f64> {
        let per_head: Vec<Vec<f64>> = cache
            .heads
            .iter()
            .map(|&h| rule(&self.window_rows(h, cache.kv, w)))
            .collect();
        combine_before_window(&per_head, self.prompt_len, w, agg)
    }

    /// The caches of the layer under `policy`.
    fn members(&self, policy: &Policy) -> Vec<Member> {
        let units = if policy.per_query_head {
            self.q.shape()[0]
        } else {
            self.k.shape()[0]
        };
        (0..units)
            .map(|unit| match policy.per_query_head {
                true => Member {
                    heads: vec![unit],
                    kv: unit / self.group(),
                    unit,
                },
                false => Member {
                    heads: (unit * self.group()..(unit + 1) * self.group()).collect(),
                    kv: unit,
                    unit,
                },
            })
            .collect()
    }
}

/// `Σ a_i b_i`.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The softmax of `logits`.
pub fn softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

/// A group's scores combined into one.
pub fn combine(agg: Aggregation, values: &[f64]) -> f64 {
    match agg {
        Aggregation::Mean => values.iter().sum::<f64>() / values.len() as f64,
        Aggregation::Max => values.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        Aggregation::Sum => values.iter().sum(),
    }
}

/// Same-length average pooling, the zero padding counted.
pub fn avg_pool(values: &[f64], kernel: usize) -> Vec<f64> {
    let half = kernel as isize / 2;
    (0..values.len() as isize)
        .map(|c| {
            (c - half..=c + half)
                .filter(|&i| i >= 0 && (i as usize) < values.len())
                .map(|i| values[i as usize])
                .sum::<f64>()
                / kernel as f64
        })
        .collect()
}

/// One score per prompt position from per-head scores of the keys before the window: the group
/// aggregated there, the window's positions +inf (always kept).
pub fn combine_before_window(
    per_head: &[Vec<f64>],
    n: usize,
    w: usize,
    agg: Aggregation,
) -> Vec<f64> {
    (0..n)
        .map(|j| match j < n - w {
            true => combine(agg, &per_head.iter().map(|p| p[j]).collect::<Vec<_>>()),
            false => f64::INFINITY,
        })
        .collect()
}

/// Keeps the `budget` best of `candidates` (protected first, then score, then lower position).
fn top(
    candidates: &[usize],
    score: &dyn Fn(usize) -> f64,
    budget: usize,
    protected: &dyn Fn(usize) -> bool,
) -> Vec<usize> {
    let mut sorted = candidates.to_vec();
    sorted.sort_by(|&a, &b| {
        protected(b)
            .cmp(&protected(a))
            .then(score(b).partial_cmp(&score(a)).unwrap())
            .then(a.cmp(&b))
    });
    sorted.truncate(budget);
    sorted.sort();
    sorted
}

/// Per cache, per decode step, the kept positions.
pub fn kept(layer: &Layer, policy: &Policy) -> Vec<Vec<Vec<usize>>> {
    let members = layer.members(policy);
    if policy.shared_layer {
        let shared = kept_by(layer, policy, &members);
        return vec![shared; members.len()];
    }
    members
        .into_iter()
        .map(|member| kept_by(layer, policy, std::slice::from_ref(&member)))
        .collect()
}

/// The kept sets of caches that choose together (one, or the whole layer's).
fn kept_by(layer: &Layer, policy: &Policy, members: &[Member]) -> Vec<Vec<usize>> {
    let n = layer.prompt_len;
    match policy.timing {
        Timing::PerStep | Timing::PerStepPrompt => (n..layer.t())
            .map(|at| reselected(layer, policy, members, at))
            .collect(),
        Timing::Streaming | Timing::PrefillThenStream | Timing::Decoding => {
            streaming(layer, policy, members)
        }
        Timing::Prefill => {
            let scores = mean_over(members, |_, member| {
                policy
                    .rule
                    .prompt_scores(layer, policy, member)
                    .unwrap_or_else(|| streamed_scores(layer, policy, member))
            });
            let candidates: Vec<usize> = (0..n).collect();
            let protected = |j: usize| j < policy.sinks || j + policy.window >= n;
            let prompt = top(&candidates, &|j| scores[j], policy.budget, &protected);
            (n..layer.t())
                .map(|at| prompt.iter().cloned().chain(n..=at).collect())
                .collect()
        }
    }
}

/// The kept set at decode position `at` of a re-selecting timing: every position so far streams
/// in with nothing evicted, and the set is chosen afresh from those scores.
fn reselected(layer: &Layer, policy: &Policy, members: &[Member], at: usize) -> Vec<usize> {
    let n = layer.prompt_len;
    let positions: Vec<usize> = (0..=at).collect();
    let p = mean_over(members, |_, member| {
        let running = running_scores(layer, policy.rule, member, &positions);
        policy
            .rule
            .scores(layer, policy, member, &positions, &running)
    });
    let limit = match policy.timing {
        Timing::PerStep => at + 1,
        _ => n,
    };
    let protected = |j: usize| j < policy.sinks || j + policy.window >= limit;
    let mut kept = top(&positions[..limit], &|j| p[j], policy.budget, &protected);
    kept.extend(limit..=at);
    kept
}

/// The running scores of a cache that took `positions` one by one, evicting nothing.
fn running_scores(
    layer: &Layer,
    rule: &dyn ScorerRule,
    member: &Member,
    positions: &[usize],
) -> Vec<f64> {
    let mut running = Vec::new();
    for end in 1..=positions.len() {
        rule.step(layer, member, &positions[..end], &mut running);
    }
    running
}

/// The prompt's scores of a rule that is a stream: with no eviction its final scores are the
/// streaming rule's on the whole prompt.
fn streamed_scores(layer: &Layer, policy: &Policy, member: &Member) -> Vec<f64> {
    let positions: Vec<usize> = (0..layer.prompt_len).collect();
    let running = running_scores(layer, policy.rule, member, &positions);
    policy
        .rule
        .scores(layer, policy, member, &positions, &running)
}

/// The mean over the caches of each cache's scores.
fn mean_over(members: &[Member], scores: impl Fn(usize, &Member) -> Vec<f64>) -> Vec<f64> {
    let all: Vec<Vec<f64>> = members
        .iter()
        .enumerate()
        .map(|(index, member)| scores(index, member))
        .collect();
    (0..all[0].len())
        .map(|i| all.iter().map(|s| s[i]).sum::<f64>() / members.len() as f64)
        .collect()
}

/// The streaming timings: every position arrives, and a cache over budget evicts its first
/// minimum outside sinks and window (`prefill-then-stream` cuts the prompt at its end instead;
/// `decoding` leaves the prompt whole and, like an interval above 1, cuts back to the budget
/// when its trigger is due).
fn streaming(layer: &Layer, policy: &Policy, members: &[Member]) -> Vec<Vec<usize>> {
    let n = layer.prompt_len;
    let cut_at_prompt_end = policy.timing == Timing::PrefillThenStream;
    let streams_in_prompt = policy.timing == Timing::Streaming;
    let cuts_back = policy.interval > 1 || policy.timing == Timing::Decoding;
    let mut arrived = 0;
    let mut cache: Vec<usize> = Vec::new();
    let mut running: Vec<Vec<f64>> = vec![Vec::new(); members.len()];
    // The cache order of a rule that keeps its own (CAKE), per member, kept while decoding.
    let mut orders: Vec<Vec<usize>> = vec![Vec::new(); members.len()];
    let mut ordered = false;
    let mut steps = Vec::new();
    for at in 0..layer.t() {
        if at == n {
            for (order, member) in orders.iter_mut().zip(members) {
                if let Some(scores) = policy.rule.order_at_cut(layer, policy, member) {
                    ordered = true;
                    *order = cache.clone();
                    let split = order
                        .iter()
                        .filter(|&&j| j < n - policy.window.max(1))
                        .count();
                    order[..split].sort_by(|&a, &b| {
                        scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b))
                    });
                }
            }
        }
        cache.push(at);
        if at >= n {
            for order in orders.iter_mut() {
                order.push(at);
            }
        }
        for (member, scores) in members.iter().zip(running.iter_mut()) {
            policy.rule.step(layer, member, &cache, scores);
        }
        if at >= n && policy.attend_first {
            steps.push(cache.clone());
        }
        let streams_now = at >= n || streams_in_prompt;
        if streams_now {
            arrived += 1;
        }
        if cut_at_prompt_end && at + 1 == n {
            if cache.len() > policy.budget {
                let scores = mean_over_running(layer, policy, members, &cache, &running);
                let protected = |j: usize| j < policy.sinks || j + policy.window >= n;
                let kept = top(&cache, &|j| scores[j], policy.budget, &protected);
                for index in (0..cache.len()).rev() {
                    if !kept.contains(&cache[index]) {
                        cache.remove(index);
                        for scores in running.iter_mut() {
                            scores.remove(index);
                        }
                    }
                }
            }
        } else if streams_now && cuts_back {
            // Grown to `budget + interval` (or at a position divisible by it, or `interval`
            // tokens after it was last due): cut back to the budget's best at once, the sinks and
            // the cache's last `window` entries kept.
            let due =
                policy
                    .trigger
                    .due((cache.len(), at, arrived), policy.budget, policy.interval);
            if due {
                arrived = 0;
            }
            if due && cache.len() > policy.budget {
                let pooled =
                    ordered_pooled(layer, policy, members, &cache, &orders, ordered && at >= n);
                let scores = cache_scores(layer, policy, members, &cache, &running, &pooled);
                let first_recent = cache[cache.len() - policy.window.min(cache.len())..]
                    .first()
                    .copied()
                    .unwrap_or(usize::MAX);
                let protected = |j: usize| j < policy.sinks || j >= first_recent;
                let score_of = |j: usize| scores[cache.iter().position(|&c| c == j).unwrap()];
                let kept = top(&cache, &score_of, policy.budget, &protected);
                for index in (0..cache.len()).rev() {
                    if !kept.contains(&cache[index]) {
                        cache.remove(index);
                        for scores in running.iter_mut() {
                            scores.remove(index);
                        }
                    }
                }
                regather(&mut orders, &pooled, |p| kept.contains(&p));
            }
        } else if streams_now && cache.len() > policy.budget {
            let pooled =
                ordered_pooled(layer, policy, members, &cache, &orders, ordered && at >= n);
            let scores = cache_scores(layer, policy, members, &cache, &running, &pooled);
            let end = cache.len() - policy.window;
            // The first minimum outside sinks and window goes (argmin).
            let mut worst = policy.sinks;
            for i in policy.sinks..end {
                if scores[i] < scores[worst] {
                    worst = i;
                }
            }
            let evicted = cache.remove(worst);
            for scores in running.iter_mut() {
                scores.remove(worst);
            }
            regather(&mut orders, &pooled, |p| p != evicted);
        }
        if at >= n && !policy.attend_first {
            steps.push(cache.clone());
        }
    }
    steps
}

/// For a rule that keeps its own cache order (`ordered`, once decoding has started), each
/// member's scores of the entries outside its window along its order; empty otherwise.
fn ordered_pooled(
    layer: &Layer,
    policy: &Policy,
    members: &[Member],
    cache: &[usize],
    orders: &[Vec<usize>],
    ordered: bool,
) -> Vec<Vec<(usize, f64)>> {
    match ordered {
        true => members
            .iter()
            .zip(orders)
            .map(|(member, order)| {
                policy
                    .rule
                    .ordered_scores(layer, policy, member, cache, order)
            })
            .collect(),
        false => Vec::new(),
    }
}

/// The members' mean score of each entry of `cache`: from their ordered scores `pooled` when
/// there are any (the window +inf), from their running rule otherwise.
fn cache_scores(
    layer: &Layer,
    policy: &Policy,
    members: &[Member],
    cache: &[usize],
    running: &[Vec<f64>],
    pooled: &[Vec<(usize, f64)>],
) -> Vec<f64> {
    if pooled.is_empty() {
        return mean_over_running(layer, policy, members, cache, running);
    }
    cache
        .iter()
        .map(|j| {
            pooled
                .iter()
                .map(|scored| {
                    scored
                        .iter()
                        .find(|(p, _)| p == j)
                        .map_or(f64::INFINITY, |e| e.1)
                })
                .sum::<f64>()
                / members.len() as f64
        })
        .collect()
}

/// After an eviction from an ordered cache, each member gathers the entries outside its window
/// that `stays` keeps by descending score (`topk`'s order), its window after them.
fn regather(
    orders: &mut [Vec<usize>],
    pooled: &[Vec<(usize, f64)>],
    stays: impl Fn(usize) -> bool,
) {
    for (order, scored) in orders.iter_mut().zip(pooled) {
        let mut survivors: Vec<(usize, f64)> =
            scored.iter().cloned().filter(|&(p, _)| stays(p)).collect();
        survivors.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
        let window = order[scored.len()..].to_vec();
        *order = survivors
            .into_iter()
            .map(|(p, _)| p)
            .chain(window)
            .collect();
    }
}

/// The members' mean of their rule's scores over `cache`, given their running scores.
fn mean_over_running(
    layer: &Layer,
    policy: &Policy,
    members: &[Member],
    cache: &[usize],
    running: &[Vec<f64>],
) -> Vec<f64> {
    mean_over(members, |index, member| {
        policy
            .rule
            .scores(layer, policy, member, cache, &running[index])
    })
}

/// One query head at one decode step, and the set its cache keeps: what a metric's brute-force
/// definition reads.
pub struct Sample<'a> {
    layer: &'a Layer<'a>,
    kv: usize,
    kept: &'a [usize],
    query: Vec<f64>,
    weights: Vec<f64>,
    held: Option<&'a Held>,
    /// k of the top-k recall.
    pub top_k: usize,
}

impl<'a> Sample<'a> {
    /// The sample of query head `head` (KV head `kv`) at position `at`, keeping `kept`.
    pub fn new(
        layer: &'a Layer<'a>,
        head: usize,
        kv: usize,
        at: usize,
        kept: &'a [usize],
        top_k: usize,
    ) -> Self {
        let visible: Vec<usize> = (0..=at).collect();
        let query = layer.query(head, at);
        let weights = layer.attention(&query, kv, &visible);
        Self {
            layer,
            kv,
            kept,
            query,
            weights,
            held: None,
            top_k,
        }
    }

    /// The same sample over a cache holding `held` (quantized, or with pruned key channels).
    pub fn over(self, held: &'a Held) -> Self {
        Self {
            held: Some(held),
            ..self
        }
    }

    /// Whether the cache holds its entries as captured.
    pub fn is_captured(&self) -> bool {
        self.held.is_none()
    }

    /// The cache's own attention over the kept positions, in kept order: the full weights
    /// renormalised over them, or over a cache that stores them otherwise the softmax against the
    /// keys it holds.
    pub fn cache_weights(&self) -> Vec<f64> {
        match self.held {
            None => {
                let total: f64 = self.kept.iter().map(|&j| self.weights[j]).sum();
                self.kept.iter().map(|&j| self.weights[j] / total).collect()
            }
            Some(held) => {
                let logits: Vec<f64> = self
                    .kept
                    .iter()
                    .map(|&j| dot(&self.query, &held.keys[j]) * self.layer.scale)
                    .collect();
                softmax(&logits)
            }
        }
    }

    /// Per kept position, `min(p_j, m·p̂_j)` with `m` the kept full mass: the kept mass the
    /// cache's attention, scaled to that share, still puts where the full attention does.
    pub fn shared_weights(&self) -> Vec<f64> {
        let cache = self.cache_weights();
        let m: f64 = self.kept.iter().map(|&j| self.weights[j]).sum();
        self.kept
            .iter()
            .zip(cache)
            .map(|(&j, w)| self.weights[j].min(m * w))
            .collect()
    }

    /// `Σ_kept min(p_j, m·p̂_j)`.
    pub fn shared_mass(&self) -> f64 {
        self.shared_weights().iter().sum()
    }

    /// The cache's attention output, `Σ_kept p̂_j v̂_j`, from the values it holds.
    pub fn cache_output(&self) -> Vec<f64> {
        let d = self.layer.v.shape()[2];
        let mut output = vec![0.0; d];
        for (&j, w) in self.kept.iter().zip(self.cache_weights()) {
            let value = match self.held {
                Some(held) => held.values[j].clone(),
                None => self.value(j),
            };
            for (out, v) in output.iter_mut().zip(value) {
                *out += w * v;
            }
        }
        output
    }

    /// The kept positions.
    pub fn kept(&self) -> &[usize] {
        self.kept
    }

    /// The full causal attention over positions `0..=at`.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The positions the query sees that the cache does not keep.
    pub fn discarded(&self) -> Vec<usize> {
        (0..self.weights.len())
            .filter(|j| !self.kept.contains(j))
            .collect()
    }

    /// The value at position `j`.
    pub fn value(&self, j: usize) -> Vec<f64> {
        self.layer.value(self.kv, j)
    }

    /// The attention-weighted mean of the values at `positions` (weights renormalised over them).
    pub fn mean_value(&self, positions: &[usize]) -> Vec<f64> {
        let total: f64 = positions.iter().map(|&j| self.weights[j]).sum();
        let d = self.layer.v.shape()[2];
        (0..d)
            .map(|x| {
                positions
                    .iter()
                    .map(|&j| self.weights[j] * self.layer.v[[self.kv, j, x]] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    /// The full attention output, `Σ_j p_j v_j`.
    pub fn full_output(&self) -> Vec<f64> {
        let d = self.layer.v.shape()[2];
        (0..d)
            .map(|x| {
                (0..self.weights.len())
                    .map(|j| self.weights[j] * self.layer.v[[self.kv, j, x]] as f64)
                    .sum()
            })
            .collect()
    }
}

/// The keys and values a cache that stores its entries otherwise than captured (quantized, with
/// pruned key channels) holds at one decode step, by position (a position it never held reads as
/// captured).
pub struct Held {
    /// Keys, `[T][d]`.
    pub keys: Vec<Vec<f64>>,
    /// Values, `[T][d]`.
    pub values: Vec<Vec<f64>>,
}

/// What a cache of `scheme` over KV head `kv` holds at each decode step, given the positions it
/// held at each step (`held[s]` ascending; step `s`'s new token is `prompt_len + s`), rebuilt from
/// an empty cache at every step. The rule, from KIVI's description: at each step the entries no
/// longer held leave, the others new to the cache arrive (the kept prompt at the cut), every
/// token older than the newest `residual` full-precision ones is quantized on its own
/// (per-token), or the oldest `residual` full-precision entries are quantized per channel in
/// groups of `group_size` whenever that many have gathered (per-channel); then the step's own
/// token arrives at full precision.
pub fn held_by_step(layer: &Layer, kv: usize, scheme: &Scheme, held: &[Vec<usize>]) -> Vec<Held> {
    (0..held.len())
        .map(|step| {
            let mut keys: Vec<Vec<f32>> = (0..layer.t())
                .map(|j| (0..layer.head_dim()).map(|x| layer.k[[kv, j, x]]).collect())
                .collect();
            let mut values: Vec<Vec<f32>> = (0..layer.t())
                .map(|j| {
                    (0..layer.v.shape()[2])
                        .map(|x| layer.v[[kv, j, x]])
                        .collect()
                })
                .collect();
            let (mut key_full, mut value_full) = (Vec::new(), Vec::new());
            let mut before: Vec<usize> = Vec::new();
            for (s, now) in held.iter().enumerate().take(step + 1) {
                let newest = layer.prompt_len + s;
                key_full.retain(|j| now.contains(j));
                value_full.retain(|j| now.contains(j));
                for &j in now.iter().filter(|j| !before.contains(j) && **j != newest) {
                    key_full.push(j);
                    value_full.push(j);
                }
                settle(&mut keys, &mut key_full, scheme.keys, scheme);
                settle(&mut values, &mut value_full, scheme.values, scheme);
                if now.contains(&newest) && !before.contains(&newest) {
                    key_full.push(newest);
                    value_full.push(newest);
                }
                before = now.clone();
            }
            let wide = |rows: Vec<Vec<f32>>| -> Vec<Vec<f64>> {
                rows.into_iter()
                    .map(|row| row.into_iter().map(f64::from).collect())
                    .collect()
            };
            Held {
                keys: wide(keys),
                values: wide(values),
            }
        })
        .collect()
}

/// What a cache over KV head `kv`, read by query heads `heads`, holds at each decode step when it
/// prunes key channels as `pruning` says, given the positions it held at each step (`held[s]`
/// ascending). The rule, from ThinK's description: at the cut (step 0), each channel `c` scores
/// `mean_{h, i}(q_{h,i,c}²) · mean_j(k_{j,c}²)` over the last `window` prompt queries `i` of each
/// head `h` and the prompt positions `j` held then; the `int(d · fraction)` lowest (the lower
/// channel first among equals) are zero in every prompt key from then on; values and generated
/// keys are as captured.
pub fn pruned_by_step(
    layer: &Layer,
    (kv, heads): (usize, Range<usize>),
    pruning: &ChannelPruning,
    held: &[Vec<usize>],
) -> Vec<Held> {
    let n = layer.prompt_len;
    let d = layer.head_dim();
    let window = n.saturating_sub(pruning.window)..n;
    let prompt_held: Vec<usize> = held[0].iter().copied().filter(|&j| j < n).collect();
    let score = |c: usize| {
        let query = heads
            .clone()
            .map(|h| {
                let squares: f64 = window.clone().map(|i| layer.query(h, i)[c].powi(2)).sum();
                squares / window.len() as f64
            })
            .sum::<f64>()
            / heads.len() as f64;
        let key: f64 = prompt_held
            .iter()
            .map(|&j| layer.key(kv, j)[c].powi(2))
            .sum::<f64>()
            / prompt_held.len().max(1) as f64;
        query * key
    };
    let mut by_score: Vec<(f64, usize)> = (0..d).map(|c| (score(c), c)).collect();
    by_score.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let pruned: Vec<usize> = by_score[..pruning.pruned(d)]
        .iter()
        .map(|&(_, c)| c)
        .collect();
    let keys: Vec<Vec<f64>> = (0..layer.t())
        .map(|j| {
            let mut key = layer.key(kv, j);
            if j < n {
                pruned.iter().for_each(|&c| key[c] = 0.0);
            }
            key
        })
        .collect();
    let values: Vec<Vec<f64>> = (0..layer.t()).map(|j| layer.value(kv, j)).collect();
    held.iter()
        .map(|_| Held {
            keys: keys.clone(),
            values: values.clone(),
        })
        .collect()
}

/// What a cache over KV head `kv`, read by query heads `heads`, holds at each decode step when
/// it merges as CaM does at its compressions while decoding (`evictions`, whose selection is the
/// engine's), given the positions it held at each step (`held[s]` ascending). The rule, from
/// kvpress's `CAMPress` docstring, rebuilt from the captured values at every step: a compression
/// that took effect by step `s` (in order) merges the `merges` best-scored of the entries it
/// evicted; the running attention `A` of an entry is the sum over the decode steps before the
/// compression took effect of the mean over `heads` of each head's softmax over that step's
/// cache; a candidate's targets are the next `merge_budget` positions after it in the compressed
/// cache (the step's cache up to the triggering position); it merges, when the draw for it
/// (`DecodeMerge::draw` of cache `cache`) falls below `min(1, A_m / mean A_t)` (0/0 → 0, x/0 → 1),
/// `v_m / n` into each of its `n` targets, from values before the compression's merges. Keys are
/// as captured.
pub fn cam_by_step(
    layer: &Layer,
    (kv, heads, cache): (usize, &[usize], usize),
    merge: &DecodeMerge,
    held: &[Vec<usize>],
    evictions: &[Eviction],
) -> Vec<Held> {
    let n = layer.prompt_len;
    let keys: Vec<Vec<f64>> = (0..layer.t()).map(|j| layer.key(kv, j)).collect();
    let attention_by_step: Vec<Vec<f64>> = held
        .iter()
        .enumerate()
        .map(|(s, set)| {
            let weights = layer.group_attention(heads, kv, n + s, set, Aggregation::Mean);
            let mut by_position = vec![0.0; layer.t()];
            for (&j, &w) in set.iter().zip(&weights) {
                by_position[j] = w;
            }
            by_position
        })
        .collect();
    (0..held.len())
        .map(|s| {
            let mut values: Vec<Vec<f64>> = (0..layer.t()).map(|j| layer.value(kv, j)).collect();
            for eviction in evictions.iter().filter(|e| e.effective_step <= s) {
                let e = eviction.effective_step;
                let running =
                    |j: usize| -> f64 { attention_by_step[..e].iter().map(|a| a[j]).sum() };
                let kept: Vec<usize> = held[e]
                    .iter()
                    .copied()
                    .filter(|&j| j <= eviction.position)
                    .collect();
                let mut ranked = eviction.ranked.clone();
                ranked.truncate(eviction.merges);
                ranked.sort();
                let before = values.clone();
                for &m in &ranked {
                    let after: Vec<usize> = kept
                        .iter()
                        .copied()
                        .filter(|&t| t > m)
                        .take(merge.merge_budget)
                        .collect();
                    if after.is_empty() {
                        continue;
                    }
                    let mean = after.iter().map(|&t| running(t)).sum::<f64>() / after.len() as f64;
                    let ratio = running(m) / mean;
                    let p = if ratio.is_nan() { 0.0 } else { ratio.min(1.0) };
                    if merge.draw(layer.index, cache, eviction.position, m) < p {
                        for &t in &after {
                            for x in 0..values[t].len() {
                                values[t][x] += before[m][x] / after.len() as f64;
                            }
                        }
                    }
                }
            }
            Held {
                keys: keys.clone(),
                values,
            }
        })
        .collect()
}

/// What a cache over KV head `kv` holds at each decode step when it merges as `merge` says, given
/// the positions it held at each step (`held[s]` ascending; the `prefill` timing, so step 0's
/// prompt positions are the kept ones). The rule, from kvpress's `MergingPress` docstring: every
/// prompt position not kept finds the kept key of highest cosine similarity (norms floored at
/// 1e-6; the first among equals); it merges when that similarity reaches the threshold and, for a
/// fraction below 1, the `1 − fraction` quantile of the merging similarities (the others at −∞);
/// its weight is `max(s, 0) · |v_e| / (|v_e| + |v_t| + 1e-6)`; a kept value that received total
/// weight `W > 0` becomes `(v_t + Σ w v_e) / (1 + W)`. Keys and generated values are as captured.
pub fn merged_by_step(
    layer: &Layer,
    kv: usize,
    merge: &ValueMerge,
    held: &[Vec<usize>],
) -> Vec<Held> {
    let n = layer.prompt_len;
    let keys: Vec<Vec<f64>> = (0..layer.t()).map(|j| layer.key(kv, j)).collect();
    let mut values: Vec<Vec<f64>> = (0..layer.t()).map(|j| layer.value(kv, j)).collect();
    let kept: Vec<usize> = held[0].iter().copied().filter(|&j| j < n).collect();
    let evicted: Vec<usize> = (0..n).filter(|j| !kept.contains(j)).collect();
    let norm = |x: &[f64]| dot(x, x).sqrt();
    let cosine = |a: &[f64], b: &[f64]| dot(a, b) / (norm(a).max(1e-6) * norm(b).max(1e-6));
    let best: Vec<(f64, usize)> = evicted
        .iter()
        .map(|&e| {
            kept.iter().map(|&t| (cosine(&keys[e], &keys[t]), t)).fold(
                (f64::NEG_INFINITY, usize::MAX),
                |a, b| if b.0 > a.0 { b } else { a },
            )
        })
        .collect();
    let mut merges: Vec<bool> = best
        .iter()
        .map(|&(s, _)| s >= merge.similarity_threshold)
        .collect();
    if merge.merge_fraction < 1.0 && merges.contains(&true) {
        let mut candidates: Vec<f64> = best
            .iter()
            .zip(&merges)
            .map(|(&(s, _), &m)| if m { s } else { f64::NEG_INFINITY })
            .collect();
        candidates.sort_by(f64::total_cmp);
        let at = (1.0 - merge.merge_fraction) * (candidates.len() - 1) as f64;
        let (a, b, w) = (
            candidates[at.floor() as usize],
            candidates[at.ceil() as usize],
            at.fract(),
        );
        let cut = if w < 0.5 {
            a + w * (b - a)
        } else {
            b - (b - a) * (1.0 - w)
        };
        for (m, &(s, _)) in merges.iter_mut().zip(&best) {
            *m = *m && s >= cut;
        }
    }
    let original = values.clone();
    let mut total = vec![0.0; layer.t()];
    let mut sums = vec![vec![0.0; original[0].len()]; layer.t()];
    for ((&e, &(s, t)), &m) in evicted.iter().zip(&best).zip(&merges) {
        if m && t != usize::MAX {
            let w =
                s.max(0.0) * norm(&original[e]) / (norm(&original[e]) + norm(&original[t]) + 1e-6);
            total[t] += w;
            for (sum, x) in sums[t].iter_mut().zip(&original[e]) {
                *sum += w * x;
            }
        }
    }
    for &t in kept.iter().filter(|&&t| total[t] > 0.0) {
        values[t] = original[t]
            .iter()
            .zip(&sums[t])
            .map(|(v, s)| (v + s) / (1.0 + total[t]))
            .collect();
    }
    held.iter()
        .map(|_| Held {
            keys: keys.clone(),
            values: values.clone(),
        })
        .collect()
}

/// Quantizes what `scheme` says is due among the full-precision entries `full` (oldest first).
fn settle(vectors: &mut [Vec<f32>], full: &mut Vec<usize>, grouping: Grouping, scheme: &Scheme) {
    let (g, r) = (scheme.group_size, scheme.residual);
    match grouping {
        Grouping::PerToken => {
            while full.len() > r {
                let j = full.remove(0);
                for group in vectors[j].chunks_mut(g) {
                    quantize_group(group, scheme.bits);
                }
            }
        }
        Grouping::PerChannel => {
            while full.len() >= r {
                let block: Vec<usize> = full.drain(..r).collect();
                for members in block.chunks(g) {
                    for x in 0..vectors[members[0]].len() {
                        let mut column: Vec<f32> = members.iter().map(|&j| vectors[j][x]).collect();
                        quantize_group(&mut column, scheme.bits);
                        for (&j, value) in members.iter().zip(column) {
                            vectors[j][x] = value;
                        }
                    }
                }
            }
        }
    }
}

/// The Euclidean distance between `a` and `b`.
pub fn distance(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// SplitMix64 (the `random` scorer's stream, written out again).
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
