//! Experiments from Python: `sweep` runs an experiment file's missing runs and builds its report,
//! `report` builds the report from stored runs; both return the runs as `Results`.

use crate::errors::raised;
use crate::externals::PyExternals;
use crate::interrupt::interruptible;
use crate::results::Results;
use kvreplay::capture::ModelSlot;
use kvreplay::experiment::{
    claim_results, report as build_report, run_sweep, stored_runs, Experiment, SweepError,
    SweepProgress,
};
use kvreplay::replay::Checkpoints;
use kvreplay::replay::ExternalMethods;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Runs an experiment file (resuming: finished runs are skipped), writes its report beside its
/// runs under `results/<name>/`, and returns the runs with the report's text. `methods` names
/// Python scorers and allocators the file's policies may name (`scorer = "my-snapkv"`).
#[pyfunction]
#[pyo3(signature = (experiment, results=PathBuf::from("results"), methods=None))]
pub fn sweep(
    py: Python<'_>,
    experiment: PathBuf,
    results: PathBuf,
    methods: Option<&Bound<'_, PyDict>>,
) -> PyResult<Results> {
    run_experiment(py, &experiment, &results, methods, true)
}

/// Rebuilds an experiment's report from its stored runs, running nothing (`methods` as the sweep
/// was given them: a run's id depends on their code).
#[pyfunction]
#[pyo3(signature = (experiment, results=PathBuf::from("results"), methods=None))]
pub fn report(
    py: Python<'_>,
    experiment: PathBuf,
    results: PathBuf,
    methods: Option<&Bound<'_, PyDict>>,
) -> PyResult<Results> {
    run_experiment(py, &experiment, &results, methods, false)
}

fn run_experiment(
    py: Python<'_>,
    path: &Path,
    results_root: &Path,
    methods: Option<&Bound<'_, PyDict>>,
    run_missing: bool,
) -> PyResult<Results> {
    let externals = match methods {
        Some(methods) => Some(Arc::new(PyExternals::new(methods)?) as Arc<dyn ExternalMethods>),
        None => None,
    };
    let experiment = py
        .detach(|| Experiment::load_with(path, externals))
        .map_err(raised)?;
    let results = results_root.join(&experiment.name);
    let (runs, kv_entries, text) = interruptible(py, |stop| -> Result<_, SweepError> {
        if run_missing {
            claim_results(&results, path)?;
        }
        let traces = match run_missing {
            true => {
                let progress = (&|_, _| {}) as SweepProgress<'_>;
                let swept = run_sweep(
                    &experiment,
                    &experiment.trace_entries()?,
                    &results,
                    None,
                    (progress, Checkpoints::stopping(stop)),
                    &mut ModelSlot::default(),
                )?;
                swept.traces
            }
            false => experiment.trace_files(None)?,
        };
        let command = format!("kvreplay sweep {}", path.display());
        let text = build_report::build(&experiment, &traces, &results, &command)?;
        let runs = stored_runs(&experiment, &traces, &results)?;
        let kv_entries = runs
            .iter()
            .map(|run| build_report::kv_entries(run, &traces))
            .collect();
        Ok((runs, kv_entries, text))
    })?
    .map_err(raised)?;
    Ok(Results::new(runs, kv_entries, Some(text)))
}
