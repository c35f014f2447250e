//! A slow, obviously correct replay, written from the method descriptions alone (f64, plain
//! loops, no shared code with the library), for differential tests.

use ndarray::Array3;

pub struct Layer<'a> {
    pub q: &'a Array3<f32>,
    pub k: &'a Array3<f32>,
    pub v: &'a Array3<f32>,
    pub prompt_len: usize,
    pub scale: f64,
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Agg {
    Mean,
    Max,
    Sum,
}

pub struct Policy<'a> {
    pub scorer: &'a str,
    /// `prefill`, `streaming`, `per-step` or `per-step-prompt`.
    pub timing: &'a str,
    /// Layer index and seed of the `random` scorer.
    pub layer: usize,
    pub seed: u64,
    pub budget: usize,
    pub window: usize,
    pub sinks: usize,
    pub kernel: usize,
    /// LagKV's partition length (its 4 sinks are fixed here, as in its defaults).
    pub lag_size: usize,
    /// ChunkKV's chunk length (its inner scorer is `knorm` here).
    pub chunk_length: usize,
    /// Quest's page size.
    pub page_size: usize,
    pub max_pool: bool,
    pub per_query_head: bool,
    /// One kept set for the whole layer (`gqa = layer`): scores are the mean over KV groups.
    pub shared_layer: bool,
    /// The decode query attends before the step's eviction (`order = attend-first`).
    pub attend_first: bool,
    pub agg: Agg,
}

/// One cache's heads, KV head and index: a member of a group of caches that choose together.
type Member = (Vec<usize>, usize, usize);

impl Layer<'_> {
    fn t(&self) -> usize {
        self.q.shape()[1]
    }

    fn group(&self) -> usize {
        self.q.shape()[0] / self.k.shape()[0]
    }

    /// Softmax of query (head, at) over the keys at `positions` of kv head `kv`.
    fn attention(&self, query: &[f64], kv: usize, positions: &[usize]) -> Vec<f64> {
        let d = self.k.shape()[2];
        let logits: Vec<f64> = positions
            .iter()
            .map(|&j| {
                (0..d)
                    .map(|x| query[x] * self.k[[kv, j, x]] as f64)
                    .sum::<f64>()
                    * self.scale
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        exps.iter().map(|e| e / total).collect()
    }

    fn query(&self, head: usize, at: usize) -> Vec<f64> {
        (0..self.q.shape()[2])
            .map(|x| self.q[[head, at, x]] as f64)
            .collect()
    }

    fn key(&self, kv: usize, at: usize) -> Vec<f64> {
        (0..self.k.shape()[2])
            .map(|x| self.k[[kv, at, x]] as f64)
            .collect()
    }

    /// The heads of a cache and its kv head.
    fn cache_heads(&self, unit: usize, per_query_head: bool) -> (Vec<usize>, usize) {
        if per_query_head {
            (vec![unit], unit / self.group())
        } else {
            (
                (unit * self.group()..(unit + 1) * self.group()).collect(),
                unit,
            )
        }
    }

    fn combine(agg: Agg, values: &[f64]) -> f64 {
        match agg {
            Agg::Mean => values.iter().sum::<f64>() / values.len() as f64,
            Agg::Max => values.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            Agg::Sum => values.iter().sum(),
        }
    }

    /// Group attention of the query at `at` over `positions`.
    fn group_attention(
        &self,
        heads: &[usize],
        kv: usize,
        at: usize,
        positions: &[usize],
        agg: Agg,
    ) -> Vec<f64> {
        let rows: Vec<Vec<f64>> = heads
            .iter()
            .map(|&h| self.attention(&self.query(h, at), kv, positions))
            .collect();
        (0..positions.len())
            .map(|i| Self::combine(agg, &rows.iter().map(|r| r[i]).collect::<Vec<_>>()))
            .collect()
    }
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
    let units = if policy.per_query_head {
        layer.q.shape()[0]
    } else {
        layer.k.shape()[0]
    };
    let member = |unit: usize| {
        let (heads, kv) = layer.cache_heads(unit, policy.per_query_head);
        (heads, kv, unit)
    };
    if policy.shared_layer {
        let members: Vec<Member> = (0..units).map(member).collect();
        let shared = kept_by(layer, policy, &members);
        return vec![shared; units];
    }
    (0..units)
        .map(|unit| kept_by(layer, policy, &[member(unit)]))
        .collect()
}

/// The kept sets of caches that choose together (one, or the whole layer's).
fn kept_by(layer: &Layer, policy: &Policy, members: &[Member]) -> Vec<Vec<usize>> {
    let n = layer.prompt_len;
    let t_total = layer.t();
    if policy.timing.starts_with("per-step") {
        return (n..t_total)
            .map(|at| {
                // Every position so far streams in with nothing evicted; the kept set is chosen
                // afresh from those scores.
                let mut cache = Vec::new();
                let mut running = vec![Vec::new(); members.len()];
                for j in 0..=at {
                    cache.push(j);
                    stream_step(layer, policy, members, &cache, &mut running);
                }
                let p = finish_scores(layer, policy, members, &cache, &running);
                let limit = if policy.timing == "per-step" {
                    at + 1
                } else {
                    n
                };
                let protected = |j: usize| j < policy.sinks || j + policy.window >= limit;
                let mut kept = top(&cache[..limit], &|j| p[j], policy.budget, &protected);
                kept.extend(limit..=at);
                kept
            })
            .collect();
    }
    if policy.timing == "streaming" || policy.timing == "prefill-then-stream" {
        return streaming(layer, policy, members);
    }
    let scores = prompt_scores(layer, policy, members);
    let candidates: Vec<usize> = (0..n).collect();
    let protected = |j: usize| j < policy.sinks || j + policy.window >= n;
    let prompt = top(&candidates, &|j| scores[j], policy.budget, &protected);
    (n..t_total)
        .map(|at| prompt.iter().cloned().chain(n..=at).collect())
        .collect()
}

/// The mean over members of each member's scores.
fn mean_over(members: usize, scores: impl Fn(usize) -> Vec<f64>) -> Vec<f64> {
    let all: Vec<Vec<f64>> = (0..members).map(scores).collect();
    (0..all[0].len())
        .map(|i| all.iter().map(|s| s[i]).sum::<f64>() / members as f64)
        .collect()
}

/// Scores of the prompt positions at prompt end, no eviction before (the members' mean).
fn prompt_scores(layer: &Layer, policy: &Policy, members: &[Member]) -> Vec<f64> {
    mean_over(members.len(), |i| {
        let (heads, kv, unit) = &members[i];
        member_prompt_scores(layer, policy, heads, *kv, *unit)
    })
}

fn member_prompt_scores(
    layer: &Layer,
    policy: &Policy,
    heads: &[usize],
    kv: usize,
    unit: usize,
) -> Vec<f64> {
    let n = layer.prompt_len;
    match policy.scorer {
        "cake" => cake_window_scores(layer, policy, heads, kv),
        "snapkv" => {
            let w = policy.window.max(1);
            let per_head: Vec<Vec<f64>> = heads
                .iter()
                .map(|&h| {
                    let mut sums = vec![0.0; n - w];
                    for at in n - w..n {
                        let visible: Vec<usize> = (0..=at).collect();
                        let p = layer.attention(&layer.query(h, at), kv, &visible);
                        for j in 0..n - w {
                            sums[j] += p[j];
                        }
                    }
                    let half = policy.kernel / 2;
                    (0..n - w)
                        .map(|c| {
                            let vals: Vec<f64> = (c as isize - half as isize
                                ..=c as isize + half as isize)
                                .filter(|&i| i >= 0 && (i as usize) < n - w)
                                .map(|i| sums[i as usize])
                                .collect();
                            if policy.max_pool {
                                vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
                            } else {
                                vals.iter().sum::<f64>() / policy.kernel as f64
                            }
                        })
                        .collect()
                })
                .collect();
            combine_before_window(&per_head, n, w, policy.agg)
        }
        _ => {
            // Every other scorer is a stream; with no eviction its final scores are the same
            // as the streaming rule's on the full prefix.
            let members = [(heads.to_vec(), kv, unit)];
            let mut running = vec![Vec::new()];
            let mut cache = Vec::new();
            for at in 0..n {
                cache.push(at);
                stream_step(layer, policy, &members, &cache, &mut running);
            }
            finish_scores(layer, policy, &members, &cache, &running)
        }
    }
}

/// Updates every member's running scores after `cache`'s last position arrived.
fn stream_step(
    layer: &Layer,
    policy: &Policy,
    members: &[Member],
    cache: &[usize],
    running: &mut [Vec<f64>],
) {
    for ((heads, kv, _), scores) in members.iter().zip(running.iter_mut()) {
        member_step(layer, policy, heads, *kv, cache, scores);
    }
}

fn member_step(
    layer: &Layer,
    policy: &Policy,
    heads: &[usize],
    kv: usize,
    cache: &[usize],
    scores: &mut Vec<f64>,
) {
    let at = *cache.last().unwrap();
    match policy.scorer {
        "key-proxy" => {
            if cache.len() == 1 {
                scores.push(1.0);
            } else {
                let p = layer.attention(&layer.key(kv, at), kv, &cache[..cache.len() - 1]);
                for (s, w) in scores.iter_mut().zip(p) {
                    *s += w;
                }
                scores.push(0.0);
            }
        }
        "true-query" | "value-aware" => {
            // `value-aware` runs H2O's score (its default inner scorer, the group's mean).
            let agg = if policy.scorer == "value-aware" {
                Agg::Mean
            } else {
                policy.agg
            };
            scores.push(0.0);
            let p = layer.group_attention(heads, kv, at, cache, agg);
            for (s, w) in scores.iter_mut().zip(p) {
                *s += w;
            }
        }
        "tova" => *scores = layer.group_attention(heads, kv, at, cache, policy.agg),
        _ => scores.push(0.0),
    }
}

/// The scores the engine compares, aligned with `cache`: the members' mean.
fn finish_scores(
    layer: &Layer,
    policy: &Policy,
    members: &[Member],
    cache: &[usize],
    running: &[Vec<f64>],
) -> Vec<f64> {
    mean_over(members.len(), |i| {
        let (heads, kv, unit) = &members[i];
        member_scores(layer, policy, heads, *kv, *unit, cache, &running[i])
    })
}

fn member_scores(
    layer: &Layer,
    policy: &Policy,
    heads: &[usize],
    kv: usize,
    unit: usize,
    cache: &[usize],
    running: &[f64],
) -> Vec<f64> {
    let n = layer.prompt_len;
    match policy.scorer {
        "cake" if *cache.last().unwrap() < n => cake_window_scores(layer, policy, heads, kv),
        "recency" => cache.iter().map(|&j| j as f64).collect(),
        "random" => {
            // SplitMix64 of (seed, layer, cache, position), top 24 bits as a fraction.
            let stream =
                splitmix64(splitmix64(policy.seed ^ (policy.layer as u64) << 32) ^ unit as u64);
            cache
                .iter()
                .map(|&j| (splitmix64(stream ^ j as u64) >> 40) as f64 / (1u64 << 24) as f64)
                .collect()
        }
        "knorm" => cache
            .iter()
            .map(|&j| -layer.key(kv, j).iter().map(|x| x * x).sum::<f64>().sqrt())
            .collect(),
        "keydiff" => {
            // Minus the cosine of each key to the mean of the cached keys, each normalised.
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            let keys: Vec<Vec<f64>> = cache.iter().map(|&j| layer.key(kv, j)).collect();
            let d = keys[0].len();
            let anchor: Vec<f64> = (0..d)
                .map(|x| keys.iter().map(|k| k[x] / norm(k)).sum::<f64>() / keys.len() as f64)
                .collect();
            keys.iter()
                .map(|k| {
                    let dot: f64 = k.iter().zip(&anchor).map(|(a, b)| a * b).sum();
                    -dot / (norm(k) * norm(&anchor))
                })
                .collect()
        }
        "lagkv" => lagkv_scores(layer, kv, cache, policy.lag_size),
        "quest" => {
            // Per page of cached positions (by position / page_size), per head, the sum over
            // channels of the largest q_c · k_c among its keys; heads combined with `agg`.
            let at = *cache.last().unwrap();
            let bound = |head: usize, page: &[usize]| -> f64 {
                let q = layer.query(head, at);
                (0..q.len())
                    .map(|c| {
                        page.iter()
                            .map(|&j| q[c] * layer.key(kv, j)[c])
                            .fold(f64::NEG_INFINITY, f64::max)
                    })
                    .sum()
            };
            cache
                .iter()
                .map(|&j| {
                    let page: Vec<usize> = cache
                        .iter()
                        .copied()
                        .filter(|&p| p / policy.page_size == j / policy.page_size)
                        .collect();
                    let per_head: Vec<f64> = heads.iter().map(|&h| bound(h, &page)).collect();
                    Layer::combine(policy.agg, &per_head)
                })
                .collect()
        }
        "qfilter" => {
            let filter = qfilter(layer, kv);
            cache
                .iter()
                .map(|&j| {
                    -layer
                        .key(kv, j)
                        .iter()
                        .zip(&filter)
                        .map(|(k, f)| k * f)
                        .sum::<f64>()
                })
                .collect()
        }
        "value-aware" => {
            // H2O's cumulative attention (the running scores) times each value's L1 norm.
            let d = layer.v.shape()[2];
            cache
                .iter()
                .zip(running)
                .map(|(&j, score)| {
                    score
                        * (0..d)
                            .map(|x| (layer.v[[kv, j, x]] as f64).abs())
                            .sum::<f64>()
                })
                .collect()
        }
        "chunkkv" => {
            // Each chunk of `chunk_length` cached tokens scores the mean of its keys' -norms.
            let knorm: Vec<f64> = cache
                .iter()
                .map(|&j| -layer.key(kv, j).iter().map(|x| x * x).sum::<f64>().sqrt())
                .collect();
            knorm
                .chunks(policy.chunk_length)
                .flat_map(|chunk| {
                    let mean = chunk.iter().sum::<f64>() / chunk.len() as f64;
                    std::iter::repeat_n(mean, chunk.len())
                })
                .collect()
        }
        "expected-attention" => expected_attention_scores(layer, heads, kv, cache),
        "rkv" => rkv_scores(layer, policy, heads, kv, cache),
        "oracle-static" => cache
            .iter()
            .map(|&j| {
                (n..layer.t())
                    .filter(|&at| at >= j)
                    .map(|at| {
                        let visible: Vec<usize> = (0..=at).collect();
                        layer.group_attention(heads, kv, at, &visible, policy.agg)[j]
                    })
                    .sum()
            })
            .collect(),
        _ => running.to_vec(),
    }
}

/// R-KV with its defaults (mix_lambda 0.07, threshold 0.5, the last redundant key exempted):
/// the last `window` positions up to the newest are the queries; importance = the mean over them
/// of the softmax, over the cache before its last `window` entries, of the group's largest logit
/// `q k / sqrt(d)`, max-pooled along the cache; redundancy = the softmax over the cache of the
/// column means of the keys' cosine matrix with its diagonal and each row's last entry above 0.5
/// (entry 0 if none) zeroed; the window scores infinity.
fn rkv_scores(
    layer: &Layer,
    policy: &Policy,
    heads: &[usize],
    kv: usize,
    cache: &[usize],
) -> Vec<f64> {
    let (lambda, threshold) = (0.07, 0.5);
    let w = policy.window.max(1);
    let n = cache.len();
    if n <= w {
        return vec![f64::INFINITY; n];
    }
    let scored = n - w;
    let at = *cache.last().unwrap();
    let d = layer.k.shape()[2] as f64;
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let softmax = |x: &[f64]| {
        let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
        let total: f64 = e.iter().sum();
        e.iter().map(|v| v / total).collect::<Vec<f64>>()
    };
    let mut mean = vec![0.0; scored];
    for r in at + 1 - w..=at {
        let logits: Vec<f64> = cache[..scored]
            .iter()
            .map(|&j| {
                heads
                    .iter()
                    .map(|&h| dot(&layer.query(h, r), &layer.key(kv, j)) / d.sqrt())
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .collect();
        for (m, p) in mean.iter_mut().zip(softmax(&logits)) {
            *m += p / w as f64;
        }
    }
    let half = policy.kernel / 2;
    let importance: Vec<f64> = (0..scored)
        .map(|c| {
            (c.saturating_sub(half)..(c + half + 1).min(scored))
                .map(|i| mean[i])
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect();
    let unit_key = |j: usize| {
        let k = layer.key(kv, j);
        let norm = dot(&k, &k).sqrt() + 1e-8;
        k.iter().map(|x| x / norm).collect::<Vec<f64>>()
    };
    let keys: Vec<Vec<f64>> = cache.iter().map(|&j| unit_key(j)).collect();
    let mut columns = vec![0.0; n];
    for i in 0..n {
        let mut row: Vec<f64> = (0..n)
            .map(|j| if i == j { 0.0 } else { dot(&keys[i], &keys[j]) })
            .collect();
        let exempt = (0..n).rev().find(|&j| row[j] > threshold).unwrap_or(0);
        row[exempt] = 0.0;
        for (c, v) in columns.iter_mut().zip(&row) {
            *c += v / n as f64;
        }
    }
    let redundancy = softmax(&columns);
    (0..n)
        .map(|i| {
            if i < scored {
                lambda * importance[i] - (1.0 - lambda) * redundancy[i]
            } else {
                f64::INFINITY
            }
        })
        .collect()
}

/// LagKV with 4 sinks and ranks within partitions: after the sinks, partitions of `lag` tokens;
/// each token's key and value channels are scaled into [0, 1] by the next partition's per-channel
/// range, their sample standard deviation is softmaxed over the partition, keys and values
/// averaged, and the token scores its rank in its partition / `lag`. Sinks and everything from
/// the last full partition on score 1; a short cache scores by recency after the sinks.
fn lagkv_scores(layer: &Layer, kv: usize, cache: &[usize], lag: usize) -> Vec<f64> {
    const SINKS: usize = 4;
    let n = cache.len();
    if n < SINKS + 2 * lag {
        return (0..n)
            .map(|i| {
                if i < SINKS {
                    1.0
                } else {
                    (i - SINKS) as f64 / (n - SINKS) as f64
                }
            })
            .collect();
    }
    let value = |j: usize| -> Vec<f64> {
        (0..layer.v.shape()[2])
            .map(|x| layer.v[[kv, j, x]] as f64)
            .collect()
    };
    let full = (n - SINKS) / lag;
    let mut out = vec![1.0; n];
    for p in 0..full - 1 {
        let start = SINKS + p * lag;
        let part = &cache[start..start + lag];
        let next = &cache[start + lag..start + 2 * lag];
        let key_soft = spread_softmax(part, next, &|j| layer.key(kv, j));
        let value_soft = spread_softmax(part, next, &value);
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

/// Softmax over `part` of each token's sample standard deviation of its channels, scaled by
/// `next`'s per-channel min and max.
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
    let max = stds.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = stds.iter().map(|s| (s - max).exp()).sum();
    stds.iter().map(|s| (s - max).exp() / total).collect()
}

/// Expected Attention with kvpress's defaults (4 sinks, 512 future positions, covariance and
/// value norms), from the paper's description: each head's pre-rotary queries after the sinks
/// (the stored ones turned back by -position x theta^(-2i/d) on pairs (i, i + d/2), theta =
/// `ROPE_THETA`), their mean and covariance (/N) carried by the mean of the rotary matrices of
/// the next 512 positions, built as full d x d matrices; logits mu.k / sqrt(d) + k^T S k / (2d)
/// over the keys after the sinks, softmaxed per head, averaged over heads, times |v|; the sinks
/// score the maximum + 1.
fn expected_attention_scores(
    layer: &Layer,
    heads: &[usize],
    kv: usize,
    cache: &[usize],
) -> Vec<f64> {
    const SINKS: usize = 4;
    const FUTURE: usize = 512;
    let n = cache.len();
    let d = layer.q.shape()[2];
    let half = d / 2;
    let angle = |position: usize, i: usize| {
        position as f64 / (ROPE_THETA as f64).powf(2.0 * (i % half) as f64 / d as f64)
    };
    // R(t)[i][j]: cos on the diagonal, -sin at (i, i + d/2), +sin at (i + d/2, i).
    let rotation = |t: usize| -> Vec<Vec<f64>> {
        let mut r = vec![vec![0.0; d]; d];
        for (i, row) in r.iter_mut().enumerate() {
            row[i] = angle(t, i).cos();
        }
        for i in 0..half {
            r[i][i + half] = -angle(t, i).sin();
            r[i + half][i] = angle(t, i).sin();
        }
        r
    };
    let mut mean_rotation = vec![vec![0.0; d]; d];
    for t in n..n + FUTURE {
        let r = rotation(t);
        for i in 0..d {
            for j in 0..d {
                mean_rotation[i][j] += r[i][j] / FUTURE as f64;
            }
        }
    }
    let apply = |m: &Vec<Vec<f64>>, x: &[f64]| -> Vec<f64> {
        (0..d)
            .map(|i| (0..d).map(|j| m[i][j] * x[j]).sum())
            .collect()
    };
    let mut total = vec![0.0; n - SINKS];
    for &h in heads {
        let queries: Vec<Vec<f64>> = cache[SINKS..]
            .iter()
            .map(|&p| {
                let r = rotation(p);
                // R(p) is orthogonal: its transpose turns the stored query back.
                let rt: Vec<Vec<f64>> = (0..d).map(|i| (0..d).map(|j| r[j][i]).collect()).collect();
                apply(&rt, &layer.query(h, p))
            })
            .collect();
        let m = queries.len() as f64;
        let mu: Vec<f64> = (0..d)
            .map(|i| queries.iter().map(|q| q[i]).sum::<f64>() / m)
            .collect();
        let cov: Vec<Vec<f64>> = (0..d)
            .map(|i| {
                (0..d)
                    .map(|j| {
                        queries
                            .iter()
                            .map(|q| (q[i] - mu[i]) * (q[j] - mu[j]))
                            .sum::<f64>()
                            / m
                    })
                    .collect()
            })
            .collect();
        let mu = apply(&mean_rotation, &mu);
        // S = R cov R^T.
        let rc: Vec<Vec<f64>> = (0..d)
            .map(|i| {
                (0..d)
                    .map(|j| (0..d).map(|k| mean_rotation[i][k] * cov[k][j]).sum())
                    .collect()
            })
            .collect();
        let s: Vec<Vec<f64>> = (0..d)
            .map(|i| {
                (0..d)
                    .map(|j| (0..d).map(|k| rc[i][k] * mean_rotation[j][k]).sum())
                    .collect()
            })
            .collect();
        let logits: Vec<f64> = cache[SINKS..]
            .iter()
            .map(|&j| {
                let k = layer.key(kv, j);
                let sk = apply(&s, &k);
                let linear: f64 =
                    mu.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt();
                linear + k.iter().zip(&sk).map(|(a, b)| a * b).sum::<f64>() / d as f64 / 2.0
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        for (t, l) in total.iter_mut().zip(&logits) {
            *t += (l - max).exp() / sum / heads.len() as f64;
        }
    }
    let scores: Vec<f64> = cache[SINKS..]
        .iter()
        .zip(&total)
        .map(|(&j, t)| {
            let norm = (0..d)
                .map(|x| (layer.v[[kv, j, x]] as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            t * norm
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    std::iter::repeat_n(max + 1.0, SINKS)
        .chain(scores)
        .collect()
}

/// The rotary base of the fixtures (`tests/common/mod.rs`).
pub const ROPE_THETA: f32 = 10_000.0;

/// CAKE's prompt-end score: per head, mean + 200 (its gamma) x unbiased variance of the last W
/// queries' weights on each key before the window, average-pooled, the group aggregated.
fn cake_window_scores(layer: &Layer, policy: &Policy, heads: &[usize], kv: usize) -> Vec<f64> {
    let n = layer.prompt_len;
    let w = policy.window.max(1);
    let per_head: Vec<Vec<f64>> = heads
        .iter()
        .map(|&h| {
            let rows: Vec<Vec<f64>> = (n - w..n)
                .map(|at| {
                    let visible: Vec<usize> = (0..=at).collect();
                    layer.attention(&layer.query(h, at), kv, &visible)
                })
                .collect();
            let scores: Vec<f64> = (0..n - w)
                .map(|j| {
                    let mean = rows.iter().map(|r| r[j]).sum::<f64>() / w as f64;
                    let var = if w > 1 {
                        rows.iter().map(|r| (r[j] - mean).powi(2)).sum::<f64>() / (w - 1) as f64
                    } else {
                        0.0
                    };
                    mean + 200.0 * var
                })
                .collect();
            avg_pool(&scores, policy.kernel)
        })
        .collect();
    combine_before_window(&per_head, n, w, policy.agg)
}

/// One score per prompt position from per-head scores of the keys before the window: the group
/// aggregated there, the window's positions +inf (always kept).
fn combine_before_window(per_head: &[Vec<f64>], n: usize, w: usize, agg: Agg) -> Vec<f64> {
    (0..n)
        .map(|j| {
            if j < n - w {
                Layer::combine(agg, &per_head.iter().map(|p| p[j]).collect::<Vec<_>>())
            } else {
                f64::INFINITY
            }
        })
        .collect()
}

/// Same-length average pooling, the zero padding counted.
fn avg_pool(values: &[f64], kernel: usize) -> Vec<f64> {
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

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn streaming(layer: &Layer, policy: &Policy, members: &[Member]) -> Vec<Vec<usize>> {
    let n = layer.prompt_len;
    let cut_at_prompt_end = policy.timing == "prefill-then-stream";
    let mut cache: Vec<usize> = Vec::new();
    let mut running: Vec<Vec<f64>> = vec![Vec::new(); members.len()];
    // CAKE's official cache order per member (see `cake_decode`), kept while decoding.
    let mut cake_orders: Vec<Vec<usize>> = vec![Vec::new(); members.len()];
    let mut steps = Vec::new();
    for at in 0..layer.t() {
        if policy.scorer == "cake" && at == n {
            for (order, (heads, kv, _)) in cake_orders.iter_mut().zip(members) {
                let scores = cake_window_scores(layer, policy, heads, *kv);
                *order = cache.clone();
                let split = order
                    .iter()
                    .filter(|&&j| j < n - policy.window.max(1))
                    .count();
                order[..split]
                    .sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
            }
        }
        cache.push(at);
        if at >= n {
            for order in cake_orders.iter_mut() {
                order.push(at);
            }
        }
        stream_step(layer, policy, members, &cache, &mut running);
        if at >= n && policy.attend_first {
            steps.push(cache.clone());
        }
        if cut_at_prompt_end && at + 1 == n {
            if cache.len() > policy.budget {
                // One-shot cut of the whole prompt to its best `budget`.
                let scores = finish_scores(layer, policy, members, &cache, &running);
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
            let cake_pooled: Vec<Vec<(usize, f64)>> = if policy.scorer == "cake" && at >= n {
                members
                    .iter()
                    .zip(&cake_orders)
                    .map(|((heads, kv, _), order)| {
                        cake_decode(layer, policy, heads, *kv, &cache, order)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let scores = if cake_pooled.is_empty() {
                finish_scores(layer, policy, members, &cache, &running)
            } else {
                cache
                    .iter()
                    .map(|j| {
                        cake_pooled
                            .iter()
                            .map(|pooled| {
                                pooled
                                    .iter()
                                    .find(|(p, _)| p == j)
                                    .map_or(f64::INFINITY, |e| e.1)
                            })
                            .sum::<f64>()
                            / members.len() as f64
                    })
                    .collect()
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
            // CAKE gathers the survivors outside the window by descending pooled score.
            for (order, pooled) in cake_orders.iter_mut().zip(&cake_pooled) {
                let mut survivors: Vec<(usize, f64)> = pooled
                    .iter()
                    .cloned()
                    .filter(|(p, _)| *p != evicted)
                    .collect();
                survivors.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
                let window = order[pooled.len()..].to_vec();
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

/// CAKE while decoding: the newest query's attention over the cache, the entries outside the last W
/// laid out in the official cache's order (`order`: by descending score after each cut, the window
/// after them, new tokens last), average-pooled in that order, the group aggregated; returns
/// (position, pooled score) in that order.
fn cake_decode(
    layer: &Layer,
    policy: &Policy,
    heads: &[usize],
    kv: usize,
    cache: &[usize],
    order: &[usize],
) -> Vec<(usize, f64)> {
    let at = *cache.last().unwrap();
    let outside = order.len().saturating_sub(policy.window.max(1));
    let per_head: Vec<Vec<f64>> = heads
        .iter()
        .map(|&h| {
            let weights = layer.attention(&layer.query(h, at), kv, cache);
            let laid_out: Vec<f64> = order[..outside]
                .iter()
                .map(|p| weights[cache.iter().position(|c| c == p).unwrap()])
                .collect();
            avg_pool(&laid_out, policy.kernel)
        })
        .collect();
    (0..outside)
        .map(|i| {
            let combined = Layer::combine(
                policy.agg,
                &per_head.iter().map(|p| p[i]).collect::<Vec<_>>(),
            );
            (order[i], combined)
        })
        .collect()
}

/// The means of the metrics over a layer's (query head, decode step) samples.
pub struct Metrics {
    pub retained_mass: f64,
    pub topk_recall: f64,
    pub output_error: f64,
    /// `sum_{kept} p_j |v_j|_1 / sum_j p_j |v_j|_1`.
    pub value_weighted_mass: f64,
    /// `|mean of discarded values - mean of kept values| / |o_full|`, attention-weighted means.
    pub value_gap: f64,
}

/// The metrics of a layer's kept sets, each sample computed from its definition over every
/// visible position.
pub fn metrics(
    layer: &Layer,
    kept: &[Vec<Vec<usize>>],
    per_query_head: bool,
    top_k: usize,
) -> Metrics {
    let n = layer.prompt_len;
    let (mut mass, mut recall, mut error, mut count) = (0.0, 0.0, 0.0, 0.0);
    let (mut value_mass, mut gap) = (0.0, 0.0);
    let d = layer.v.shape()[2];
    for head in 0..layer.q.shape()[0] {
        let kv = head / layer.group();
        let unit = if per_query_head { head } else { kv };
        for at in n..layer.t() {
            let set = &kept[unit][at - n];
            let visible: Vec<usize> = (0..=at).collect();
            let p = layer.attention(&layer.query(head, at), kv, &visible);
            let retained: f64 = set.iter().map(|&j| p[j]).sum();
            mass += retained;
            let mut order = visible.clone();
            order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
            let k = top_k.min(order.len());
            recall += order[..k].iter().filter(|j| set.contains(j)).count() as f64 / k as f64;
            let mean = |positions: &[usize], x: usize| -> f64 {
                let total: f64 = positions.iter().map(|&j| p[j]).sum();
                positions
                    .iter()
                    .map(|&j| p[j] * layer.v[[kv, j, x]] as f64)
                    .sum::<f64>()
                    / total
            };
            let full: Vec<f64> = (0..d)
                .map(|x| {
                    visible
                        .iter()
                        .map(|&j| p[j] * layer.v[[kv, j, x]] as f64)
                        .sum()
                })
                .collect();
            let part: Vec<f64> = (0..d).map(|x| mean(set, x)).collect();
            let norm = full.iter().map(|x| x * x).sum::<f64>().sqrt();
            let distance = |a: &[f64], b: &[f64]| {
                a.iter()
                    .zip(b)
                    .map(|(a, b)| (a - b).powi(2))
                    .sum::<f64>()
                    .sqrt()
            };
            error += distance(&full, &part) / norm;
            let discarded: Vec<usize> = visible
                .iter()
                .copied()
                .filter(|j| !set.contains(j))
                .collect();
            if discarded.iter().map(|&j| p[j]).sum::<f64>() >= 1e-9 {
                let rest: Vec<f64> = (0..d).map(|x| mean(&discarded, x)).collect();
                gap += distance(&rest, &part) / norm;
            }
            let l1 = |j: usize| {
                (0..d)
                    .map(|x| (layer.v[[kv, j, x]] as f64).abs())
                    .sum::<f64>()
            };
            value_mass += set.iter().map(|&j| p[j] * l1(j)).sum::<f64>()
                / visible.iter().map(|&j| p[j] * l1(j)).sum::<f64>();
            count += 1.0;
        }
    }
    Metrics {
        retained_mass: mass / count,
        topk_recall: recall / count,
        output_error: error / count,
        value_weighted_mass: value_mass / count,
        value_gap: gap / count,
    }
}

/// Q-Filters' filter of KV head `kv` from the prompt queries of its heads: per head, the dominant
/// eigenvector of QᵀQ by repeated squaring of the matrix (G, G², G⁴, … normalised; the column of
/// largest norm of G^(2^40) spans the dominant eigenspace), its largest entry made positive, then
/// signed by the majority sign of the projections; minus their mean.
fn qfilter(layer: &Layer, kv: usize) -> Vec<f64> {
    let n = layer.prompt_len;
    let d = layer.q.shape()[2];
    let group = layer.group();
    let mut filter = vec![0.0; d];
    for head in kv * group..(kv + 1) * group {
        let rows: Vec<Vec<f64>> = (0..n).map(|at| layer.query(head, at)).collect();
        let mut g: Vec<Vec<f64>> = (0..d)
            .map(|a| {
                (0..d)
                    .map(|b| rows.iter().map(|r| r[a] * r[b]).sum())
                    .collect()
            })
            .collect();
        for _ in 0..40 {
            let squared: Vec<Vec<f64>> = (0..d)
                .map(|a| {
                    (0..d)
                        .map(|b| (0..d).map(|c| g[a][c] * g[c][b]).sum())
                        .collect()
                })
                .collect();
            let scale = squared.iter().flatten().fold(0.0f64, |m, x| m.max(x.abs()));
            g = squared
                .into_iter()
                .map(|row| row.into_iter().map(|x| x / scale).collect())
                .collect();
        }
        let column = (0..d)
            .max_by(|&a, &b| {
                let norm = |c: usize| g.iter().map(|row| row[c] * row[c]).sum::<f64>();
                norm(a).total_cmp(&norm(b))
            })
            .unwrap();
        let norm = g
            .iter()
            .map(|row| row[column] * row[column])
            .sum::<f64>()
            .sqrt();
        let mut v: Vec<f64> = g.iter().map(|row| row[column] / norm).collect();
        let largest = v
            .iter()
            .fold(0.0f64, |m, x| if x.abs() > m.abs() { *x } else { m });
        if largest < 0.0 {
            v.iter_mut().for_each(|x| *x = -*x);
        }
        let positive = rows
            .iter()
            .filter(|r| r.iter().zip(&v).map(|(a, b)| a * b).sum::<f64>() > 0.0)
            .count();
        let sign = if 2 * positive > n { 1.0 } else { -1.0 };
        for (total, x) in filter.iter_mut().zip(&v) {
            *total -= sign * x / group as f64;
        }
    }
    filter
}
