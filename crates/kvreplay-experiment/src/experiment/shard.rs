//! Splitting a sweep into shards that any job-array runner can execute (Slurm, Kubernetes indexed
//! jobs, GNU parallel): shard `I` of `N` runs only its own runs, chosen from the whole plan the
//! same way on every machine, so shards never overlap and together cover every run. Runs are
//! balanced by an estimate of their cost (longest first, each to the least-loaded shard). Every
//! run is stored atomically under its own id, so a shard killed mid-run leaves no partial run,
//! and a shard run again does only what is missing.

use super::{Experiment, PlannedRun, TraceFile};
use crate::replay::{PolicyParams, Timing};
use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// Shard `index` of `count` (`index` from 0), written `I/N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Which shard, from 0.
    pub index: usize,
    /// How many shards.
    pub count: usize,
}

impl FromStr for Shard {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let rule = "a shard is I/N with N ≥ 1 and 0 ≤ I < N (shards count from 0)";
        let (index, count) = text
            .split_once('/')
            .ok_or_else(|| format!("`{text}`: {rule}"))?;
        let parse = |part: &str| {
            part.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{text}`: {rule}"))
        };
        let shard = Shard {
            index: parse(index)?,
            count: parse(count)?,
        };
        if shard.count == 0 || shard.index >= shard.count {
            return Err(format!("`{text}`: {rule}"));
        }
        Ok(shard)
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// A run's estimated cost, in arbitrary units: its prompt length, squared for the policies whose
/// scorer lets every prompt query attend over its whole prefix (H2O's and the key proxy's
/// cumulative scores, the oracles) or that re-select at every step, and four times that when the
/// run also runs the model (closed loop). Only the ratios between runs matter.
pub fn estimated_cost(params: &PolicyParams, prompt_len: usize, closed_loop: bool) -> u64 {
    let tokens = prompt_len.max(1) as u64;
    let quadratic = matches!(
        params.scorer.as_str(),
        "true-query" | "key-proxy" | "oracle-static"
    ) || matches!(params.timing, Timing::PerStep | Timing::PerStepPrompt);
    let replay = if quadratic {
        tokens * tokens
    } else {
        tokens * 256
    };
    if closed_loop {
        4 * replay + tokens * tokens
    } else {
        replay
    }
}

/// The shard of each of `costs` (longest processing time first: by decreasing cost, ties by
/// position, each to the shard with the least cost so far, ties to the lowest shard).
pub fn assign(costs: &[u64], count: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; count.max(1)];
    let mut shard_of = vec![0; costs.len()];
    for run in order {
        let (lightest, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(shard, &cost)| (cost, shard))
            .expect("at least one shard");
        shard_of[run] = lightest;
        load[lightest] += costs[run];
    }
    shard_of
}

/// The plan with each run's shard, for `count` shards.
pub fn plan_shards(
    experiment: &Experiment,
    traces: &[TraceFile],
    count: usize,
) -> Vec<(PlannedRun, usize)> {
    let plan = experiment.plan(traces);
    let costs: Vec<u64> = plan
        .iter()
        .map(|run| {
            let prompt_len = traces
                .iter()
                .find(|trace| trace.path == run.trace)
                .and_then(|trace| trace.prompt_len)
                .unwrap_or(1);
            estimated_cost(&run.params, prompt_len, experiment.closed_loop)
        })
        .collect();
    let shards = assign(&costs, count);
    plan.into_iter().zip(shards).collect()
}

/// Runs done and missing in one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardStatus {
    /// The shard.
    pub shard: Shard,
    /// Its runs.
    pub runs: usize,
    /// The ids of those not stored yet.
    pub missing: Vec<String>,
}

/// What each of `count` shards has stored under `results` and what it still misses.
pub fn status(
    experiment: &Experiment,
    traces: &[TraceFile],
    results: &Path,
    count: usize,
) -> Vec<ShardStatus> {
    let mut shards: Vec<ShardStatus> = (0..count)
        .map(|index| ShardStatus {
            shard: Shard { index, count },
            runs: 0,
            missing: Vec::new(),
        })
        .collect();
    for (run, shard) in plan_shards(experiment, traces, count) {
        shards[shard].runs += 1;
        if !super::store::is_stored(results, &run.id) {
            shards[shard].missing.push(run.id);
        }
    }
    shards
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_specs_are_checked() {
        assert_eq!("2/3".parse::<Shard>(), Ok(Shard { index: 2, count: 3 }));
        for bad in ["3/3", "0/0", "1", "a/2", "-1/2", "1/"] {
            let err = bad.parse::<Shard>().unwrap_err();
            assert!(err.contains("0 ≤ I < N"), "{bad}: {err}");
        }
    }

    #[test]
    fn assignment_balances_the_longest_first_and_covers_every_run_once() {
        // Costs 5, 9, 4, 7, 6 on two shards, longest first: 9 -> 0, 7 -> 1, 6 -> 1 (7 < 9),
        // 5 -> 0 (9 < 13), 4 -> 1 (13 < 14); loads 14 and 17.
        let shards = assign(&[5, 9, 4, 7, 6], 2);
        assert_eq!(shards, vec![0, 0, 1, 1, 1]);
        // Every run in exactly one shard, whatever the count; equal costs round-robin.
        assert_eq!(assign(&[1; 7], 3), vec![0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(assign(&[3, 3], 5), vec![0, 1]);
        assert!(assign(&[], 4).is_empty());
    }
}
