//! A slow, obviously correct replay, written from the method descriptions alone (f64, plain
//! loops, nothing shared with the engine's arithmetic), that the conformance tests compare the
//! engine with on small fixtures.
//!
//! The machinery here is common to every scorer: the caches of a layer, the timings (one-shot,
//! streaming, the prompt-end cut, per-step re-selection), protection, ties and the metrics. What
//! one scorer scores is its [`ScorerRule`], written in the scorer's own file and reached through
//! [`Scorer::reference`](super::scorer::Scorer::reference): a registered scorer without one fails
//! the conformance test, naming it.

use super::{Aggregation, Timing};
use ndarray::Array3;
use serde_json::Value;

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
        Timing::Streaming | Timing::PrefillThenStream => streaming(layer, policy, members),
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
/// minimum outside sinks and window (`prefill-then-stream` cuts the prompt at its end instead).
fn streaming(layer: &Layer, policy: &Policy, members: &[Member]) -> Vec<Vec<usize>> {
    let n = layer.prompt_len;
    let cut_at_prompt_end = policy.timing == Timing::PrefillThenStream;
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
        } else if (at >= n || !cut_at_prompt_end) && cache.len() > policy.budget {
            let pooled: Vec<Vec<(usize, f64)>> = match ordered && at >= n {
                true => members
                    .iter()
                    .zip(&orders)
                    .map(|(member, order)| {
                        policy
                            .rule
                            .ordered_scores(layer, policy, member, &cache, order)
                    })
                    .collect(),
                false => Vec::new(),
            };
            let scores = match pooled.is_empty() {
                true => mean_over_running(layer, policy, members, &cache, &running),
                false => cache
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
                    .collect(),
            };
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
            // An ordered cache gathers the survivors outside the window by descending score.
            for (order, scored) in orders.iter_mut().zip(&pooled) {
                let mut survivors: Vec<(usize, f64)> = scored
                    .iter()
                    .cloned()
                    .filter(|(p, _)| *p != evicted)
                    .collect();
                survivors.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
                let window = order[scored.len()..].to_vec();
                *order = survivors
                    .into_iter()
                    .map(|(p, _)| p)
                    .chain(window)
                    .collect();
            }
        }
        if at >= n && !policy.attend_first {
            steps.push(cache.clone());
        }
    }
    steps
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
    weights: Vec<f64>,
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
        let weights = layer.attention(&layer.query(head, at), kv, &visible);
        Self {
            layer,
            kv,
            kept,
            weights,
            top_k,
        }
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
