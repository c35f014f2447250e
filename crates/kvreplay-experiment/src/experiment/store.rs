//! The run store: one JSON file per finished run, written to a temporary name and renamed, so a
//! killed sweep leaves only finished runs and a rerun skips them; reading them back for reports.

use super::intervals::Prompts;
use super::SweepError;
use super::{Budget, Experiment, PlannedRun, TraceFile};
use crate::capture::shared_context;
use crate::live::LiveReport;
use crate::replay::{PolicyParams, ReplayReport};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A finished run as stored on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRun {
    /// The run id.
    pub id: String,
    /// The policy's display name.
    pub name: String,
    /// The trace file.
    pub trace: String,
    /// sha256 of the trace's content when the run was computed.
    #[serde(default)]
    pub trace_sha256: String,
    /// The measurements.
    pub report: StoredReport,
    /// What the model did under the policy, for closed-loop experiments.
    #[serde(default)]
    pub closed_loop: Option<ClosedLoop>,
    /// The rule version of each method that computed it (runs stored before versions were
    /// recorded have none).
    #[serde(default)]
    pub versions: BTreeMap<String, u32>,
}

/// The closed-loop outcomes of a run (see [`crate::live`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClosedLoop {
    /// Mean KL(p_full ‖ p_policy) over the teacher-forced steps.
    pub kl: f64,
    /// Share of teacher-forced steps whose top-1 token agrees.
    pub top1: f64,
    /// Mean log-probability lost on the full run's tokens.
    pub logprob_lost: f64,
    /// Whether the free-running text succeeds.
    pub answer_ok: bool,
    /// Whether the full-cache text succeeds.
    pub full_answer_ok: bool,
    /// The free-running text's task score (the share of expected strings found; absent in runs
    /// stored before it was kept, where it is `answer_ok` for their one-answer recipes).
    #[serde(default)]
    pub answer_score: Option<f64>,
    /// The full-cache text's task score (absent in runs stored before it was kept).
    #[serde(default)]
    pub full_answer_score: Option<f64>,
    /// The free-running text.
    pub text: String,
    /// Whether the kept sets read the full run's future queries (an oracle).
    pub uses_full_run_future: bool,
    /// The live retained mass: each live query's share of its attention over the whole live
    /// cache that its kept set holds, mean over teacher-forced steps, query heads and layers
    /// (absent in runs stored before it was measured, or where a layer had nothing to measure).
    #[serde(default)]
    pub live_retained_mass: Option<f64>,
    /// The same per layer, beside the open-loop report's per-layer retained mass.
    #[serde(default)]
    pub live_layers: Option<Vec<f64>>,
}

impl StoredRun {
    /// Run `id` of policy `name` (with `params`) on `trace`, as a sweep stores it.
    pub fn new(
        id: String,
        name: &str,
        trace: &TraceFile,
        params: &PolicyParams,
        report: &ReplayReport,
        closed_loop: Option<ClosedLoop>,
    ) -> Self {
        let mut stored_report = StoredReport::from(report);
        if trace.global_layers.is_some() {
            // Sliding-window layers hold their windows: memory is no longer the cache size times
            // the caches, so the replay's own figure is kept.
            stored_report.kv_entries = Some(report.kv_entries);
        }
        Self {
            id,
            name: name.to_owned(),
            trace: trace.path.display().to_string(),
            trace_sha256: trace.sha256.clone(),
            report: stored_report,
            closed_loop,
            versions: params.method_versions(),
        }
    }
}

impl ClosedLoop {
    /// The task score, from `answer_ok` for runs stored before scores were kept.
    pub fn answer_score(&self) -> f64 {
        self.answer_score
            .unwrap_or(f64::from(u8::from(self.answer_ok)))
    }

    /// The full cache's task score, from `full_answer_ok` for runs stored before scores were
    /// kept.
    pub fn full_answer_score(&self) -> f64 {
        self.full_answer_score
            .unwrap_or(f64::from(u8::from(self.full_answer_ok)))
    }
}

impl From<&LiveReport> for ClosedLoop {
    fn from(live: &LiveReport) -> Self {
        Self {
            kl: live.kl,
            top1: live.top1,
            logprob_lost: live.logprob_lost,
            answer_ok: live.answer_ok,
            full_answer_ok: live.full_answer_ok,
            answer_score: Some(live.answer_score),
            full_answer_score: Some(live.full_answer_score),
            text: live.text.clone(),
            uses_full_run_future: live.uses_full_run_future,
            live_retained_mass: Some(live.live_retained_mass).filter(|m| m.is_finite()),
            live_layers: Some(live.live_layers.clone())
                .filter(|layers| layers.iter().all(|m| m.is_finite())),
        }
    }
}

/// The parts of a [`ReplayReport`] the reports use: every metric's mean, per layer, and per
/// layer, query head and decode step (for confidence intervals and paired tests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredReport {
    /// Nominal budget.
    pub nominal_budget: usize,
    /// Timing, allocator, scorer... as text.
    pub settings: BTreeMap<String, String>,
    /// Each metric's mean, by id.
    #[serde(flatten)]
    pub metrics: BTreeMap<String, f64>,
    /// Mean kept tokens.
    pub mean_kept: f64,
    /// Per layer: budget and mean kept.
    pub layer_budgets: Vec<usize>,
    /// Per layer: mean kept.
    pub layer_kept: Vec<f64>,
    /// Per layer: bytes held ([`LayerReport::kv_bytes`](crate::replay::LayerReport)); empty in
    /// runs stored before they were kept.
    #[serde(default)]
    pub layer_bytes: Vec<f64>,
    /// Each metric per layer, by id.
    pub layer_metrics: BTreeMap<String, Vec<f64>>,
    /// Each metric per layer, query head and decode step, by id.
    pub samples: BTreeMap<String, Vec<Vec<Vec<f64>>>>,
    /// Span survival: name, kept fraction, kept mass, full mass.
    pub spans: Vec<(String, f64, f64, f64)>,
    /// KV entries stored per layer, mean over every layer (sliding-window layers with their
    /// window) and decode steps, kept for traces with sliding-window layers (where it is not the
    /// mean cache size times the caches).
    #[serde(default)]
    pub kv_entries: Option<f64>,
    /// Bytes held per layer, mean over every layer and decode steps ([`ReplayReport::kv_bytes`]);
    /// absent in runs stored before it was kept.
    #[serde(default)]
    pub kv_bytes: Option<f64>,
    /// Where the lost mass went, by region and then by when it left (name, mass; mean over
    /// layers); empty for runs stored before it was measured.
    #[serde(default)]
    pub lost: Vec<(String, f64)>,
}

impl StoredReport {
    /// KV entries stored per layer (mean over layers and decode steps), the same unit for every
    /// cache layout: as the replay measured it, or, for runs stored before that was kept (traces
    /// without sliding-window layers), the mean cache size times the caches per layer (one per query head under
    /// `gqa = "query-head"`, one per KV head otherwise), for a trace of `n_heads` query and
    /// `n_kv_heads` KV heads.
    pub fn kv_entries(&self, n_heads: usize, n_kv_heads: usize) -> f64 {
        if let Some(entries) = self.kv_entries {
            return entries;
        }
        let per_query_head = self.settings.get("gqa").map(String::as_str) == Some("query-head");
        self.mean_kept * if per_query_head { n_heads } else { n_kv_heads } as f64
    }

    /// The mean of metric `id`, if it was measured.
    pub fn metric(&self, id: &str) -> Option<f64> {
        self.metrics.get(id).copied()
    }
}

impl From<&ReplayReport> for StoredReport {
    fn from(report: &ReplayReport) -> Self {
        let per_layer =
            |id: &String| -> Vec<f64> { report.layers.iter().map(|l| l.metrics[id]).collect() };
        let samples = |id: &String| -> Vec<Vec<Vec<f64>>> {
            report
                .layers
                .iter()
                .map(|l| l.samples[id].clone())
                .collect()
        };
        Self {
            nominal_budget: report.nominal_budget,
            settings: report.settings.clone(),
            metrics: report.metrics.clone(),
            mean_kept: report.mean_kept,
            layer_budgets: report.layers.iter().map(|l| l.budget).collect(),
            layer_kept: report.layers.iter().map(|l| l.mean_kept).collect(),
            layer_bytes: report.layers.iter().map(|l| l.kv_bytes).collect(),
            layer_metrics: report
                .metrics
                .keys()
                .map(|id| (id.clone(), per_layer(id)))
                .collect(),
            samples: report
                .metrics
                .keys()
                .map(|id| (id.clone(), samples(id)))
                .collect(),
            spans: report
                .spans
                .iter()
                .map(|s| (s.name.clone(), s.kept_fraction, s.kept_mass, s.full_mass))
                .collect(),
            kv_entries: None,
            kv_bytes: Some(report.kv_bytes),
            lost: report
                .lost_by_region
                .iter()
                .chain(&report.lost_by_when)
                .map(|share| (share.name.clone(), share.mass))
                .collect(),
        }
    }
}

fn run_path(results: &Path, id: &str) -> PathBuf {
    results.join("runs").join(format!("{id}.json"))
}

/// Claims `results` (an experiment's results directory) for the experiment file `experiment`,
/// recorded in `results/.experiment`: two experiment files with one name (the directory is named
/// after the file) would otherwise mix their runs and reports.
pub fn claim_results(results: &Path, experiment: &Path) -> Result<(), SweepError> {
    let owner_file = results.join(".experiment");
    let this: PathBuf = experiment
        .components()
        .filter(|c| !matches!(c, std::path::Component::CurDir))
        .collect();
    let this = this.display().to_string();
    match std::fs::read_to_string(&owner_file) {
        Ok(owner) if owner.trim() == this => Ok(()),
        Ok(owner) => Err(SweepError::Io {
            path: results.to_owned(),
            detail: format!(
                "holds the runs of `{}`, not of `{this}` (same name): pass --results elsewhere, or \
                 delete {} if that experiment file was moved here",
                owner.trim(),
                owner_file.display()
            ),
        }),
        Err(_) => write_atomically(&owner_file, format!("{this}\n").as_bytes()),
    }
}

impl StoredRun {
    /// Whether the run was run at `budget`: given those tokens, or that fraction of the bytes.
    pub fn ran_at(&self, budget: Budget) -> bool {
        let bytes = self
            .report
            .settings
            .get("bytes")
            .and_then(|text| text.parse::<f64>().ok());
        match budget {
            Budget::Tokens(tokens) => bytes.is_none() && self.report.nominal_budget == tokens,
            Budget::Bytes(fraction) => bytes == Some(fraction),
        }
    }
}

/// The prompts of `runs`, the unit the report's intervals rest on: their traces, the questions
/// asked of one shared context counting as that one prompt.
pub(crate) fn prompts_of<'a>(runs: impl IntoIterator<Item = &'a StoredRun>) -> Prompts {
    Prompts::of(runs.into_iter().map(|run| shared_context(&run.trace)))
}

/// The stored run of policy `name` at `budget` on `trace`, if any.
pub(crate) fn find_run<'a>(
    runs: &'a [StoredRun],
    name: &str,
    budget: Budget,
    trace: &str,
) -> Option<&'a StoredRun> {
    runs.iter()
        .find(|r| r.name == name && r.ran_at(budget) && r.trace == trace)
}

/// Whether run `id` is stored under `results`.
pub(crate) fn is_stored(results: &Path, id: &str) -> bool {
    run_path(results, id).is_file()
}

/// Writes `bytes` to `path` through a temporary file and a rename ([`crate::atomic`]).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), SweepError> {
    crate::atomic::write(path, bytes).map_err(|e| SweepError::Io {
        path: path.to_owned(),
        detail: format!("cannot write: {e}"),
    })
}

/// Writes one finished run.
pub(crate) fn store(
    results: &Path,
    run: &PlannedRun,
    trace: &TraceFile,
    report: &ReplayReport,
    closed_loop: Option<ClosedLoop>,
) -> Result<(), SweepError> {
    let stored = StoredRun::new(
        run.id.clone(),
        &run.name,
        trace,
        &run.params,
        report,
        closed_loop,
    );
    let json = serde_json::to_vec(&stored).expect("runs serialise");
    write_atomically(&run_path(results, &run.id), &json)?;
    clear_failure(results, &run.id);
    Ok(())
}

/// Where the error of failed run `id` is kept.
fn failure_path(results: &Path, id: &str) -> PathBuf {
    results.join("failed").join(format!("{id}.txt"))
}

/// Keeps the error of a run that failed (its policy `name` on `trace`), replacing an earlier one.
pub(crate) fn record_failure(
    results: &Path,
    run: &PlannedRun,
    error: &str,
) -> Result<(), SweepError> {
    let text = format!(
        "run {}: policy `{}` on {}\n{error}\n",
        run.id,
        run.name,
        run.trace.display()
    );
    write_atomically(&failure_path(results, &run.id), text.as_bytes())
}

/// Forgets the error of run `id` once it has been stored.
pub(crate) fn clear_failure(results: &Path, id: &str) {
    let _ = std::fs::remove_file(failure_path(results, id));
}

/// The stored runs of the experiment's plan, in plan order (missing ones left out). When runs are
/// missing because their trace changed since they were stored (other runs of the same trace file
/// are stored for another content), that is an error: a report would mix or drop them silently.
pub fn stored_runs(
    experiment: &Experiment,
    traces: &[TraceFile],
    results: &Path,
) -> Result<Vec<StoredRun>, SweepError> {
    let plan = experiment.plan(traces);
    let (present, missing): (Vec<&PlannedRun>, Vec<&PlannedRun>) = plan
        .iter()
        .partition(|run| run_path(results, &run.id).is_file());
    if !missing.is_empty() {
        check_not_stale(traces, results)?;
    }
    present
        .iter()
        .map(|run| read_run(&run_path(results, &run.id)))
        .collect()
}

fn read_run(path: &Path) -> Result<StoredRun, SweepError> {
    let bytes = std::fs::read(path).map_err(|e| SweepError::Io {
        path: path.to_owned(),
        detail: e.to_string(),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| SweepError::Io {
        path: path.to_owned(),
        detail: format!("not a stored run (delete it to rerun): {e}"),
    })
}

/// Fails when stored runs of one of `traces` were computed on other content than it has now.
fn check_not_stale(traces: &[TraceFile], results: &Path) -> Result<(), SweepError> {
    let Ok(entries) = std::fs::read_dir(results.join("runs")) else {
        return Ok(());
    };
    let mut stale: Vec<(usize, String)> = vec![(0, String::new()); traces.len()];
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Ok(run) = read_run(&path) else { continue };
        for (trace, (count, stored)) in traces.iter().zip(stale.iter_mut()) {
            if run.trace == trace.path.display().to_string() && run.trace_sha256 != trace.sha256 {
                *count += 1;
                *stored = run.trace_sha256.clone();
            }
        }
    }
    match traces.iter().zip(stale).find(|(_, (count, _))| *count > 0) {
        Some((trace, (count, stored))) => Err(SweepError::TraceChanged {
            trace: trace.path.clone(),
            count,
            stored: short(&stored),
            now: short(&trace.sha256),
        }),
        None => Ok(()),
    }
}

/// The first 12 hex digits of a digest (or `none` for runs stored before digests were kept).
fn short(digest: &str) -> String {
    if digest.is_empty() {
        "none".into()
    } else {
        digest.chars().take(12).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run;

    #[test]
    fn a_run_belongs_to_the_budget_it_was_given() {
        let tokens = closed_run("a", [0.5, 0.5], None, 0.1);
        let mut bytes = tokens.clone();
        bytes.report.settings.insert("bytes".into(), "0.125".into());
        // Both resolved to 64 tokens; only the first was given 64.
        assert!(tokens.ran_at(Budget::Tokens(64)) && !bytes.ran_at(Budget::Tokens(64)));
        assert!(bytes.ran_at(Budget::Bytes(0.125)) && !bytes.ran_at(Budget::Bytes(0.25)));
        assert!(!tokens.ran_at(Budget::Bytes(0.125)));
    }

    #[test]
    fn the_questions_of_one_context_are_one_prompt() {
        let runs: Vec<StoredRun> = ["a.q1.safetensors", "a.q2.safetensors", "b.safetensors"]
            .iter()
            .map(|trace| StoredRun {
                trace: trace.to_string(),
                ..closed_run("p", [0.5, 0.5], None, 0.1)
            })
            .collect();
        assert_eq!(prompts_of(&runs).describe(), "2 prompts, 3 runs");
    }
}
