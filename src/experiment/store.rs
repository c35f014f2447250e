//! Running the planned runs and storing them: one JSON file per run, written to a temporary name
//! and renamed, so a killed sweep leaves only finished runs, and a rerun skips them.

use super::{Experiment, PlannedRun};
use crate::replay::{replay_many, PolicyError, ReplayReport};
use crate::trace::TraceReader;
use serde::{Deserialize, Serialize};
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
    /// The measurements.
    pub report: StoredReport,
}

/// The parts of a [`ReplayReport`] the reports use (retained mass per layer, head and step
/// included, for confidence intervals and paired tests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredReport {
    /// Nominal budget.
    pub nominal_budget: usize,
    /// Timing, allocator, scorer... as text.
    pub settings: std::collections::BTreeMap<String, String>,
    /// Mean retained mass.
    pub retained_mass: f64,
    /// Mean top-k recall.
    pub topk_recall: f64,
    /// Mean output error.
    pub output_error: Option<f64>,
    /// Mean kept tokens.
    pub mean_kept: f64,
    /// Per layer: budget and mean kept.
    pub layer_budgets: Vec<usize>,
    /// Per layer: mean kept.
    pub layer_kept: Vec<f64>,
    /// Per layer: retained mass.
    pub layer_retained: Vec<f64>,
    /// Retained mass per layer, query head and decode step.
    pub retained: Vec<Vec<Vec<f64>>>,
    /// Span survival: name, kept fraction, kept mass, full mass.
    pub spans: Vec<(String, f64, f64, f64)>,
}

impl From<&ReplayReport> for StoredReport {
    fn from(report: &ReplayReport) -> Self {
        Self {
            nominal_budget: report.nominal_budget,
            settings: report.settings.clone(),
            retained_mass: report.retained_mass,
            topk_recall: report.topk_recall,
            output_error: report.output_error,
            mean_kept: report.mean_kept,
            layer_budgets: report.layers.iter().map(|l| l.budget).collect(),
            layer_kept: report.layers.iter().map(|l| l.mean_kept).collect(),
            layer_retained: report.layers.iter().map(|l| l.retained_mass).collect(),
            retained: report
                .layers
                .iter()
                .map(|l| l.retained_head_step.clone())
                .collect(),
            spans: report
                .spans
                .iter()
                .map(|s| (s.name.clone(), s.kept_fraction, s.kept_mass, s.full_mass))
                .collect(),
        }
    }
}

/// Errors of a sweep.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SweepError {
    /// A policy failed on a trace.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A result could not be written or read.
    #[error("{path}: {detail}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
}

/// Progress of a sweep: `(done, total)` after each batch, done counting skipped runs.
pub type SweepProgress<'a> = &'a (dyn Fn(usize, usize) + Sync);

fn run_path(results: &Path, id: &str) -> PathBuf {
    results.join("runs").join(format!("{id}.json"))
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), SweepError> {
    let fail = |detail: String| SweepError::Io {
        path: path.to_owned(),
        detail,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| fail(format!("cannot create directory: {e}")))?;
    }
    let partial = path.with_extension(format!("partial.{}", std::process::id()));
    std::fs::write(&partial, bytes).map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        fail(format!("cannot write: {e}"))
    })?;
    std::fs::rename(&partial, path).map_err(|e| fail(format!("cannot rename into place: {e}")))
}

/// Runs every planned run not stored yet under `results` (policies of one trace in batches that
/// share each layer's reading and decode attention), storing each as it finishes. Returns how
/// many runs were run and how many were already there.
pub fn run_sweep(
    experiment: &Experiment,
    traces: &[PathBuf],
    results: &Path,
    progress: SweepProgress<'_>,
) -> Result<(usize, usize), SweepError> {
    const BATCH: usize = 12;
    let planned = experiment.plan(traces);
    let total = planned.len();
    let pending: Vec<&PlannedRun> = planned
        .iter()
        .filter(|run| !run_path(results, &run.id).is_file())
        .collect();
    let skipped = total - pending.len();
    let mut done = skipped;
    progress(done, total);
    for trace in traces {
        let of_trace: Vec<&&PlannedRun> = pending.iter().filter(|r| &r.trace == trace).collect();
        if of_trace.is_empty() {
            continue;
        }
        let reader = TraceReader::open(trace).map_err(PolicyError::from)?;
        for batch in of_trace.chunks(BATCH) {
            let policies = batch
                .iter()
                .map(|run| run.params.clone().check())
                .collect::<Result<Vec<_>, _>>()?;
            let reports = replay_many(&reader, &policies, &|| {})?;
            for (run, report) in batch.iter().zip(&reports) {
                let stored = StoredRun {
                    id: run.id.clone(),
                    name: run.name.clone(),
                    trace: trace.display().to_string(),
                    report: StoredReport::from(report),
                };
                let json = serde_json::to_vec(&stored).expect("runs serialise");
                write_atomically(&run_path(results, &run.id), &json)?;
            }
            done += batch.len();
            progress(done, total);
        }
    }
    Ok((total - skipped, skipped))
}

/// The stored runs of the experiment's plan, in plan order (missing ones left out).
pub fn stored_runs(
    experiment: &Experiment,
    traces: &[PathBuf],
    results: &Path,
) -> Result<Vec<StoredRun>, SweepError> {
    experiment
        .plan(traces)
        .iter()
        .map(|run| run_path(results, &run.id))
        .filter(|path| path.is_file())
        .map(|path| {
            let bytes = std::fs::read(&path).map_err(|e| SweepError::Io {
                path: path.clone(),
                detail: e.to_string(),
            })?;
            serde_json::from_slice(&bytes).map_err(|e| SweepError::Io {
                path: path.clone(),
                detail: format!("not a stored run (delete it to rerun): {e}"),
            })
        })
        .collect()
}
