//! Runs of the native model from Python: `live` (closed loop) and `capture`.

use crate::errors::{message, raised};
use crate::interrupt::interruptible;
use crate::results::Results;
use crate::run::{stored_runs, Policy};
use crate::trace::Trace;
use kvreplay::capture::{capture_recipe, question_trace, CaptureSummary};
use kvreplay::experiment::{ClosedLoop, TraceFile};
use kvreplay::replay::{ReplayReport, ValidPolicy};
use kvreplay::trace::StorageDtype;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// Runs a recipe live: the full-cache run once, then every policy holding the model's real KV
/// cache, decoded together (the keyword arguments of `replay`, one policy or `policies=[...]`;
/// `scorer` and `allocator` may be Python objects). Returns `Results` whose `runs` has the
/// closed-loop columns of a closed-loop sweep's `runs.parquet` (next-token KL, top-1 agreement,
/// log-probability lost, free-running text, answer score, live mass) beside the open-loop
/// metrics on the full run's recording, and whose `reports` are the reports
/// `kvreplay live --format json` prints, every teacher-forced step included. A recipe of several
/// questions gives each question's runs, its `trace` the file its capture writes
/// (`<stem>.q1.safetensors`…), the context compressed once where the policy allows.
#[pyfunction]
#[pyo3(signature = (recipe, policies=None, chunk=512, **settings))]
pub fn live(
    py: Python<'_>,
    recipe: PathBuf,
    policies: Option<Vec<Bound<'_, PyDict>>>,
    chunk: usize,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<Results> {
    let (policies, checked): (Vec<Policy>, Vec<ValidPolicy>) =
        Policy::all(policies, settings)?.into_iter().unzip();
    let scratch = std::env::temp_dir();
    let questions = interruptible(py, |stop| {
        kvreplay::live::run_recipe(&recipe, &checked, (chunk, &scratch), stop)
    })?
    .map_err(raised)?;
    let identity = py.detach(|| TraceFile::identify(&recipe)).map_err(raised)?;
    let count = questions.len();
    let mut runs = Vec::new();
    let mut kv_entries = Vec::new();
    let mut json = Vec::new();
    for (index, reports) in questions.iter().enumerate() {
        // A question's runs name the trace its capture writes.
        let path = match count {
            1 => recipe.clone(),
            _ => question_trace(&recipe.with_extension("safetensors"), index, count),
        };
        let identity = TraceFile {
            path,
            ..identity.clone()
        };
        let outcomes: Vec<(&ReplayReport, Option<ClosedLoop>)> = reports
            .iter()
            .map(|report| (&report.open_loop, Some(ClosedLoop::from(report))))
            .collect();
        runs.extend(stored_runs(&policies, &identity, &outcomes));
        kv_entries.extend(reports.iter().map(|r| r.open_loop.kv_entries));
        json.extend(
            reports
                .iter()
                .map(|r| serde_json::to_string(r).expect("reports serialise")),
        );
    }
    Ok(Results::new(runs, kv_entries, None).with_reports(json))
}

/// Captures a recipe with the native model into a kvtrace/1 file (default: the recipe's path
/// with `.safetensors`) and opens it; a recipe of several questions into one file per question
/// (`<stem>.q1.safetensors`…), opened as a list. `attention_inputs=True` also records each
/// layer's attention input and projections (and a Gemma 3 layer's q/k norms).
#[pyfunction]
#[pyo3(signature = (recipe, out=None, dtype="f16", chunk=512, attention_inputs=false))]
pub fn capture(
    py: Python<'_>,
    recipe: PathBuf,
    out: Option<PathBuf>,
    dtype: &str,
    chunk: usize,
    attention_inputs: bool,
) -> PyResult<Py<PyAny>> {
    let storage = StorageDtype::parse(dtype).map_err(message)?;
    let out = out.unwrap_or_else(|| recipe.with_extension("safetensors"));
    let summaries: Vec<CaptureSummary> = interruptible(py, |stop| {
        let mut models = Default::default();
        let storing = (storage, chunk, attention_inputs);
        capture_recipe(&recipe, &out, storing, &mut models, &mut |_, _| stop())
    })?
    .map_err(raised)?;
    let mut traces = summaries
        .into_iter()
        .map(|summary| Trace::open_path(summary.path))
        .collect::<PyResult<Vec<Trace>>>()?;
    match traces.len() {
        1 => Ok(traces.remove(0).into_pyobject(py)?.into_any().unbind()),
        _ => Ok(traces.into_pyobject(py)?.into_any().unbind()),
    }
}
