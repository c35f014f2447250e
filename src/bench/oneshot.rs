//! The one-shot grid of `kvreplay bench`: a budget sweep of one-shot policies (SnapKV, PyramidKV,
//! StreamingLLM's and H2O's prompt-end cuts, the static and per-step oracles), timed beside
//! (a) the essential work such a sweep cannot avoid, measured in the same run with the same
//! threads — reading the trace, one causal prefix pass per distinct prefix scorer at the scoring
//! kernel's speed, the decode attention once per layer and KV group, and one top-B selection per
//! (policy, budget, layer, cache) and, for the per-step oracle, per decode step — and (b) a strong
//! NumPy reference that computes every budget-independent score once and every budget's mass
//! from one cumulative sum (`src/bench/numpy/oneshot_numpy.py`).

use super::{numpy_reference, BenchError, NumpyGrid};
use crate::attention::{decode_attention, softmax_into, CausalLogits};
#[cfg(test)]
use crate::replay::Timing;
use crate::replay::{replay_many, Checkpoints, PolicyError, PolicyParams, ReplayReport};
use crate::trace::TraceReader;
use ndarray::s;
use rayon::prelude::*;
use std::path::Path;
use std::time::Instant;

/// The one-shot grid's policies, as `src/bench/numpy/oneshot_numpy.py` names them.
pub const ONESHOT_POLICIES: [&str; 6] = [
    "snapkv-kv-head",
    "pyramidkv-kv-head",
    "streamingllm-oneshot",
    "h2o-oneshot",
    "oracle-static",
    "oracle",
];

/// The policy of a one-shot grid name (one cache per KV head, the group's mean, window 8).
pub fn oneshot_policy(name: &str, budget: usize) -> Result<PolicyParams, PolicyError> {
    let base = PolicyParams {
        budget,
        ..PolicyParams::default()
    };
    let scored = |scorer: &str| PolicyParams {
        scorer: scorer.into(),
        ..base.clone()
    };
    Ok(match name {
        "streamingllm-oneshot" => PolicyParams {
            sinks: 4,
            ..scored("recency")
        },
        "h2o-oneshot" => scored("true-query"),
        "oracle-static" => scored("oracle-static"),
        other => super::grid_policy(other, budget)?,
    })
}

/// Replays the one-shot grid in one pass; returns the reports (policies outer, budgets inner)
/// and seconds.
pub fn oneshot_grid(
    trace: &TraceReader,
    budgets: &[usize],
    checkpoints: Checkpoints<'_>,
) -> Result<(Vec<ReplayReport>, f64), PolicyError> {
    let policies = ONESHOT_POLICIES
        .iter()
        .flat_map(|name| budgets.iter().map(move |&b| oneshot_policy(name, b)))
        .map(|params| params.and_then(|p| p.check()))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let reports = replay_many(trace, &policies, checkpoints)?;
    Ok((reports, started.elapsed().as_secs_f64()))
}

/// How many times [`timed_against_essential`] runs the grid and its essential work.
pub const TIMED_RUNS: usize = 3;

/// The one-shot grid and its essential work, each timed [`TIMED_RUNS`] times, alternately so
/// that a slow spell of the machine falls on both.
#[derive(Debug, Clone, PartialEq)]
pub struct GridTiming {
    /// The grid's reports (policies outer, budgets inner), from its first run: every run gives
    /// the same.
    pub reports: Vec<ReplayReport>,
    /// Seconds of each run of the grid.
    pub grid: Vec<f64>,
    /// Each run of the essential work.
    pub essential: Vec<EssentialWork>,
}

impl GridTiming {
    /// The grid's fastest run.
    pub fn best_grid(&self) -> f64 {
        self.grid.iter().copied().fold(f64::INFINITY, f64::min)
    }

    /// The essential work's fastest run (by its total).
    pub fn best_essential(&self) -> EssentialWork {
        *self
            .essential
            .iter()
            .min_by(|a, b| a.total().total_cmp(&b.total()))
            .expect("timed at least once")
    }

    /// The grid's median run.
    pub fn median_grid(&self) -> f64 {
        let mut sorted = self.grid.clone();
        sorted.sort_by(f64::total_cmp);
        sorted[sorted.len() / 2]
    }

    /// The fastest grid over the fastest essential work: what the grid adds to the work it must
    /// do, with the machine's noise kept out as far as the best of several runs does.
    pub fn ratio(&self) -> f64 {
        self.best_grid() / self.best_essential().total()
    }
}

/// Runs the one-shot grid and its essential work `runs` times each, alternately.
pub fn timed_against_essential(
    trace: &TraceReader,
    budgets: &[usize],
    runs: usize,
    checkpoints: Checkpoints<'_>,
) -> Result<GridTiming, PolicyError> {
    let mut timing = GridTiming {
        reports: Vec::new(),
        grid: Vec::with_capacity(runs),
        essential: Vec::with_capacity(runs),
    };
    for run in 0..runs.max(1) {
        let (reports, seconds) = oneshot_grid(trace, budgets, checkpoints)?;
        if run == 0 {
            timing.reports = reports;
        }
        timing.grid.push(seconds);
        timing.essential.push(essential_work(trace, budgets)?);
    }
    Ok(timing)
}

/// Runs the strong NumPy reference on the one-shot grid and checks it agrees with `reports`.
pub fn oneshot_numpy(
    python: &Path,
    trace: &Path,
    budgets: &[usize],
    reports: &[ReplayReport],
) -> Result<NumpyGrid, BenchError> {
    numpy_reference(
        python,
        "oneshot_numpy.py",
        &ONESHOT_POLICIES,
        trace,
        budgets,
        reports,
    )
}

/// Seconds of each part of the one-shot grid's essential work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EssentialWork {
    /// Reading every layer's q, k, v.
    pub read: f64,
    /// The causal prefix pass of the grid's one prefix scorer (H2O's cumulative attention):
    /// every prompt row's logits and softmax, every layer and query head.
    pub prefix: f64,
    /// The decode queries' full attention, once per layer and KV group.
    pub decode: f64,
    /// One top-B selection over the prompt per (one-shot policy, budget, layer, cache), and
    /// per decode step over the prefix for the per-step oracle.
    pub selections: f64,
}

impl EssentialWork {
    /// Their sum.
    pub fn total(&self) -> f64 {
        self.read + self.prefix + self.decode + self.selections
    }
}

/// Times the one-shot grid's essential work on `trace` for `budgets`, parallel over KV groups
/// as the replay is.
pub fn essential_work(
    trace: &TraceReader,
    budgets: &[usize],
) -> Result<EssentialWork, PolicyError> {
    let meta = trace.meta();
    let (n, group, steps) = (
        meta.prompt_len,
        meta.group_size(),
        trace.n_positions() - meta.prompt_len,
    );
    let mut work = EssentialWork {
        read: 0.0,
        prefix: 0.0,
        decode: 0.0,
        selections: 0.0,
    };
    let one_shot = ONESHOT_POLICIES.len() - 1;
    let mut sink = 0.0f32;
    for layer in 0..meta.n_layers {
        let started = Instant::now();
        let tensors = trace.layer(layer)?;
        work.read += started.elapsed().as_secs_f64();
        let (q, k) = (tensors.q.view(), tensors.k.view());
        let started = Instant::now();
        sink += (0..meta.n_kv_heads)
            .into_par_iter()
            .map(|kv| {
                let queries = q.slice(s![kv * group..(kv + 1) * group, .., ..]);
                let keys = k.slice(s![kv, .., ..]);
                let mut rows = CausalLogits::new(group, meta.head_dim, meta.scale, meta.softcap);
                let mut weights = Vec::with_capacity(n);
                let mut total = 0.0f32;
                for position in 0..n {
                    for head in 0..group {
                        softmax_into(rows.row(queries, keys, head, position), &mut weights);
                        total += weights[0];
                    }
                }
                total
            })
            .sum::<f32>();
        work.prefix += started.elapsed().as_secs_f64();
        let started = Instant::now();
        let attention: Vec<_> = (0..meta.n_kv_heads)
            .into_par_iter()
            .map(|kv| {
                decode_attention(
                    q.slice(s![kv * group..(kv + 1) * group, .., ..]),
                    k.slice(s![kv, .., ..]),
                    n,
                    0,
                    meta.scale,
                    meta.softcap,
                )
            })
            .collect();
        work.decode += started.elapsed().as_secs_f64();
        let started = Instant::now();
        sink += (0..meta.n_kv_heads)
            .into_par_iter()
            .map(|kv| {
                let row = |step: usize, end: usize| -> Vec<f32> {
                    attention[kv].slice(s![0, step, ..end]).to_vec()
                };
                let mut total = 0.0f32;
                for &budget in budgets {
                    for _ in 0..one_shot {
                        total += select(row(0, n), budget);
                    }
                    for step in 0..steps {
                        total += select(row(step, n + step + 1), budget);
                    }
                }
                total
            })
            .sum::<f32>();
        work.selections += started.elapsed().as_secs_f64();
    }
    std::hint::black_box(sink);
    Ok(work)
}

/// The best `budget` of `scores` by a partial selection, as a checksum.
fn select(mut scores: Vec<f32>, budget: usize) -> f32 {
    if budget < scores.len() {
        scores.select_nth_unstable_by(budget, |a, b| b.total_cmp(a));
    }
    scores[..budget.min(scores.len())].iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(total: f64) -> EssentialWork {
        EssentialWork {
            read: total / 2.0,
            prefix: total / 4.0,
            decode: total / 8.0,
            selections: total / 8.0,
        }
    }

    #[test]
    fn the_ratio_is_the_fastest_grid_over_the_fastest_essential_work() {
        let timing = GridTiming {
            reports: Vec::new(),
            grid: vec![3.0, 2.5, 4.0],
            essential: vec![work(2.0), work(1.6), work(1.0)],
        };
        assert_eq!(timing.best_grid(), 2.5);
        assert_eq!(timing.median_grid(), 3.0);
        assert_eq!(timing.best_essential(), work(1.0));
        assert_eq!(timing.ratio(), 2.5);
    }

    #[test]
    fn the_grid_is_one_shot_but_the_per_step_oracle() {
        for name in ONESHOT_POLICIES {
            let policy = oneshot_policy(name, 64).unwrap();
            let expected = if name == "oracle" {
                Timing::PerStep
            } else {
                Timing::Prefill
            };
            assert_eq!(policy.timing, expected, "{name}");
            policy.check().unwrap();
        }
    }
}
