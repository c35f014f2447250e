//! Experiments from Python: `sweep` runs an experiment file's missing runs and builds its report,
//! `report` builds the report from stored runs; both return the runs as `Results`.

use crate::errors::raised;
use crate::externals::PyExternals;
use crate::interrupt::interruptible;
use crate::results::Results;
use kvreplay::capture::{self, ModelSlot};
use kvreplay::experiment::{
    claim_results, report as build_report, run_sweep, stored_runs, Experiment, SweepError,
    SweepProgress, TraceFile,
};
use kvreplay::replay::ExternalMethods;
use kvreplay::trace::StorageDtype;
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
    let (runs, kv_entries, text) = interruptible(py, |layer_done| -> Result<_, SweepError> {
        if run_missing {
            claim_results(&results, path)?;
        }
        let mut models = ModelSlot::default();
        let traces = trace_files(&experiment, run_missing, &mut models)?;
        if run_missing {
            let progress = (&|_, _| {}) as SweepProgress<'_>;
            run_sweep(
                &experiment,
                &traces,
                &results,
                None,
                (progress, layer_done),
                &mut models,
            )?;
        }
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

/// The experiment's traces, capturing missing recipes (each once, their models from `models`)
/// when `may_capture` is set.
fn trace_files(
    experiment: &Experiment,
    may_capture: bool,
    models: &mut ModelSlot,
) -> Result<Vec<TraceFile>, SweepError> {
    let mut capture_once = |recipe: &Path, trace: &Path| {
        capture::capture_once(recipe, trace, &mut |recipe, trace| {
            let storage = (StorageDtype::F16, 512);
            capture::capture_recipe(recipe, trace, storage, models, &mut |_, _| {}).map(|_| ())
        })
    };
    experiment
        .trace_files(may_capture.then_some(&mut capture_once as kvreplay::experiment::Capture<'_>))
}
