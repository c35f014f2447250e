//! Intervals over the unit of independence: the prompt. The runs of one prompt (its policies and
//! budgets, its protocols, the questions asked of one shared context) share that prompt's
//! difficulty, so they are not independent draws; every interval a report prints resamples, or
//! averages over, prompts.
//!
//! - [`rank_interval`]: a statistic of paired points (Spearman's ρ, Kendall's τ-b) with a 95%
//!   percentile **cluster bootstrap**: each resample draws as many prompts as there are, with
//!   replacement, and keeps every run of each prompt drawn (Davison and Hinkley 1997, *Bootstrap
//!   Methods and their Application*, §3.8, "case resampling" at the top stage). The runs within a
//!   prompt are the experiment's fixed grid of policies and budgets, not draws from a population,
//!   so they are not resampled a second time (a two-stage bootstrap would add their spread twice).
//! - [`mean_interval`]: a mean with a Student-t interval over the per-prompt means (the analysis of
//!   cluster means; the estimate is the mean of those means, so the interval is centred on it).
//!
//! What is not estimable says so instead of printing a number: a statistic undefined on the data
//! (one side constant); fewer prompts than an interval needs ([`MIN_BOOTSTRAP_PROMPTS`], 2 for a
//! t interval); more than [`MAX_UNDEFINED`] of the resamples undefined (left out, they would bias
//! the interval toward the resamples where it is defined); or a percentile range that excludes its
//! own estimate. Undefined resamples under that share are counted and printed beside the interval.
//! `tests` hold the coverage simulation that shows these intervals cover and the run-level ones do
//! not.

use super::stats::mean_ci;
use crate::splitmix;
use ndarray::Array1;
use ndarray_stats::interpolate::Nearest;
use ndarray_stats::Quantile1dExt;
use noisy_float::types::n64;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::fmt;

/// Resamples of the bootstrap.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// The fewest prompts a bootstrap interval is given for: with 4 there are only 35 distinct
/// resamples (multisets of prompts), too few for a 2.5% tail; with 5, 126.
pub const MIN_BOOTSTRAP_PROMPTS: usize = 5;

/// The largest share of undefined resamples an interval is still given with (5%).
pub const MAX_UNDEFINED: f64 = 0.05;

/// Which prompt each point (run) comes from: the unit [`rank_interval`] resamples and
/// [`mean_interval`] averages over.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompts {
    /// The points of each prompt, prompts in the order of their first point.
    groups: Vec<Vec<usize>>,
    /// The number of points.
    points: usize,
}

impl Prompts {
    /// The prompts of points labelled `labels` (points with equal labels share a prompt).
    pub fn of<T: Ord>(labels: impl IntoIterator<Item = T>) -> Self {
        let mut index: BTreeMap<T, usize> = BTreeMap::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut points = 0;
        for (point, label) in labels.into_iter().enumerate() {
            let next = groups.len();
            let group = *index.entry(label).or_insert(next);
            if group == groups.len() {
                groups.push(Vec::new());
            }
            groups[group].push(point);
            points += 1;
        }
        Self { groups, points }
    }

    /// Every point its own prompt: the run-level resampling that treats runs as independent.
    pub fn each_point(points: usize) -> Self {
        Self::of(0..points)
    }

    /// The number of prompts.
    pub fn count(&self) -> usize {
        self.groups.len()
    }

    /// The number of points (runs).
    pub fn points(&self) -> usize {
        self.points
    }

    /// The mean of `values` (one per point) within each prompt.
    pub fn means(&self, values: &[f64]) -> Vec<f64> {
        assert_eq!(values.len(), self.points, "one prompt label per value");
        self.groups
            .iter()
            .map(|group| group.iter().map(|&p| values[p]).sum::<f64>() / group.len() as f64)
            .collect()
    }

    /// "N prompts, M runs", as an interval's header says it.
    pub fn describe(&self) -> String {
        let plural = |n: usize, what: &str| match n {
            1 => format!("1 {what}"),
            _ => format!("{n} {what}s"),
        };
        format!(
            "{}, {}",
            plural(self.count(), "prompt"),
            plural(self.points, "run")
        )
    }
}

/// Why an interval is not given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NoInterval {
    /// The statistic is undefined on the data itself (one side constant).
    Undefined,
    /// Fewer prompts than the interval needs (that many).
    TooFewPrompts(usize),
    /// This share of the resamples gave an undefined statistic (more than [`MAX_UNDEFINED`]).
    TooManyUndefined(f64),
    /// The resamples' 95% range excludes the estimate (a biased bootstrap distribution).
    ExcludesEstimate,
}

/// A statistic, its 95% interval or why there is none, and what the interval rests on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// The statistic on all the points.
    pub estimate: f64,
    /// The interval's bounds, or why it is not estimable.
    pub bounds: Result<(f64, f64), NoInterval>,
    /// The prompts it resamples.
    pub prompts: usize,
    /// The runs (points) it rests on.
    pub runs: usize,
    /// Resamples whose statistic was undefined (0 for a t interval).
    pub undefined: usize,
}

impl Interval {
    /// Whether `value` lies within the interval (false when there is none).
    pub fn covers(&self, value: f64) -> bool {
        matches!(self.bounds, Ok((low, high)) if low <= value && value <= high)
    }

    /// The half-width of a symmetric (t) interval; `None` when there is no interval.
    pub fn half_width(&self) -> Option<f64> {
        self.bounds.ok().map(|(low, high)| (high - low) / 2.0)
    }
}

impl fmt::Display for NoInterval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoInterval::Undefined => write!(f, "one side constant"),
            NoInterval::TooFewPrompts(1) => write!(f, "1 prompt"),
            NoInterval::TooFewPrompts(n) => write!(f, "{n} prompts"),
            NoInterval::TooManyUndefined(share) => {
                write!(f, "{:.0}% of resamples undefined", 100.0 * share)
            }
            NoInterval::ExcludesEstimate => write!(f, "resamples exclude the estimate"),
        }
    }
}

/// `+0.480 [+0.310, +0.770]`, with the share of undefined resamples when there are any;
/// `+0.480 (no interval: 3 prompts)` when there is no interval; `— (one side constant)` when the
/// statistic itself is undefined.
impl fmt::Display for Interval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bounds {
            Err(NoInterval::Undefined) => write!(f, "— (one side constant)"),
            Err(why) => write!(f, "{:+.3} (no interval: {why})", self.estimate),
            Ok((low, high)) => {
                write!(f, "{:+.3} [{low:+.3}, {high:+.3}]", self.estimate)?;
                match self.undefined {
                    0 => Ok(()),
                    n => write!(
                        f,
                        " ({:.1}% undefined)",
                        100.0 * n as f64 / BOOTSTRAP_RESAMPLES as f64
                    ),
                }
            }
        }
    }
}

/// `statistic` of the points `(x, y)` and its 95% cluster-bootstrap interval over `prompts`
/// ([`BOOTSTRAP_RESAMPLES`] resamples drawn from `seed`).
pub fn rank_interval(
    x: &[f64],
    y: &[f64],
    prompts: &Prompts,
    statistic: fn(&[f64], &[f64]) -> f64,
    seed: u64,
) -> Interval {
    cluster_bootstrap(x, y, prompts, statistic, seed, BOOTSTRAP_RESAMPLES)
}

fn cluster_bootstrap(
    x: &[f64],
    y: &[f64],
    prompts: &Prompts,
    statistic: fn(&[f64], &[f64]) -> f64,
    seed: u64,
    resamples: usize,
) -> Interval {
    assert_eq!(x.len(), prompts.points(), "one prompt label per point");
    let n = prompts.count();
    let mut interval = Interval {
        estimate: statistic(x, y),
        bounds: Err(NoInterval::Undefined),
        prompts: n,
        runs: prompts.points(),
        undefined: 0,
    };
    if interval.estimate.is_nan() {
        return interval;
    }
    if n < MIN_BOOTSTRAP_PROMPTS {
        interval.bounds = Err(NoInterval::TooFewPrompts(n));
        return interval;
    }
    // The picks are drawn in one sequence, as one thread would draw them; the resamples'
    // statistics are then computed on worker threads and kept in resample order.
    let mut state = seed;
    let picks: Vec<usize> = (0..resamples * n)
        .map(|_| (splitmix::next(&mut state) % n as u64) as usize)
        .collect();
    let estimates: Vec<f64> = picks
        .par_chunks(n)
        .map(|picks| {
            let points = picks.iter().flat_map(|&pick| &prompts.groups[pick]);
            let (rx, ry): (Vec<f64>, Vec<f64>) = points.map(|&p| (x[p], y[p])).unzip();
            statistic(&rx, &ry)
        })
        .collect();
    let defined: Vec<f64> = estimates.into_iter().filter(|e| e.is_finite()).collect();
    interval.undefined = resamples - defined.len();
    let share = interval.undefined as f64 / resamples as f64;
    interval.bounds = if share > MAX_UNDEFINED {
        Err(NoInterval::TooManyUndefined(share))
    } else {
        let (low, high) = percentiles(defined, 0.025, 0.975);
        match low <= interval.estimate && interval.estimate <= high {
            true => Ok((low, high)),
            false => Err(NoInterval::ExcludesEstimate),
        }
    };
    interval
}

/// The mean of the per-prompt means of `values` and its 95% Student-t interval over those means.
pub fn mean_interval(values: &[f64], prompts: &Prompts) -> Interval {
    let means = prompts.means(values);
    let (estimate, half) = mean_ci(&means);
    let bounds = match means.len() {
        0 => Err(NoInterval::Undefined),
        _ if estimate.is_nan() => Err(NoInterval::Undefined),
        1 => Err(NoInterval::TooFewPrompts(1)),
        _ => Ok((estimate - half, estimate + half)),
    };
    Interval {
        estimate,
        bounds,
        prompts: prompts.count(),
        runs: prompts.points(),
        undefined: 0,
    }
}

/// The `low` and `high` quantiles of `values` by the nearest rank `round((n - 1) q)`
/// (ndarray-stats' `Nearest`; ties at a half go to the higher rank).
fn percentiles(values: Vec<f64>, low: f64, high: f64) -> (f64, f64) {
    let mut values = Array1::from_vec(values.into_iter().map(n64).collect());
    let mut at = |q: f64| {
        values
            .quantile_mut(n64(q), &Nearest)
            .expect("a quantile of a non-empty array")
            .raw()
    };
    (at(low), at(high))
}

#[cfg(test)]
mod tests;
