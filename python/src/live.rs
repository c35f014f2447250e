//! Runs of the native model from Python: `live` (closed loop under one policy) and `capture`.

use crate::errors::{message, raised};
use crate::results::Results;
use crate::run::Policy;
use crate::trace::Trace;
use kvreplay::capture::{build_prompt, capture_recipe, load_recipe_model, CaptureSummary};
use kvreplay::experiment::{run_id, ClosedLoop, StoredRun, TraceFile};
use kvreplay::live::{LiveReport, LiveSession};
use kvreplay::replay::ValidPolicy;
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
/// `kvreplay live --format json` prints, every teacher-forced step included.
#[pyfunction]
#[pyo3(signature = (recipe, policies=None, chunk=512, **settings))]
pub fn live(
    py: Python<'_>,
    recipe: PathBuf,
    policies: Option<Vec<Bound<'_, PyDict>>>,
    chunk: usize,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<Results> {
    if recipe.extension().is_none_or(|e| e != "toml") {
        return Err(message(format!(
            "{}: live mode runs the model on a recipe (a .toml file), not on a trace",
            recipe.display()
        )));
    }
    let (policies, checked): (Vec<Policy>, Vec<ValidPolicy>) =
        Policy::all(policies, settings)?.into_iter().unzip();
    let scratch = std::env::temp_dir();
    let reports = py.detach(|| -> Result<Vec<LiveReport>, String> {
        let text = kvreplay::error_text;
        for policy in &checked {
            kvreplay::live::check_live(policy).map_err(|e| text(&e))?;
        }
        let model = load_recipe_model(&recipe).map_err(|e| text(&e))?;
        let prompt = build_prompt(&recipe, model.as_ref()).map_err(|e| text(&e))?;
        let session =
            LiveSession::start(model.as_ref(), &prompt, chunk, &scratch).map_err(|e| text(&e))?;
        session.run_many(&checked).map_err(|e| text(&e))
    });
    let reports = reports.map_err(message)?;
    let identity = py.detach(|| TraceFile::identify(&recipe)).map_err(raised)?;
    let runs = policies
        .iter()
        .zip(&reports)
        .map(|(policy, report)| {
            let id = run_id(
                &policy.name,
                &identity,
                &policy.params,
                true,
                policy.code.as_deref(),
            );
            let closed = Some(ClosedLoop::from(report));
            StoredRun::new(
                id,
                &policy.name,
                &identity,
                &policy.params,
                &report.open_loop,
                closed,
            )
        })
        .collect();
    let kv_entries = reports.iter().map(|r| r.open_loop.kv_entries).collect();
    let json = reports
        .iter()
        .map(|r| serde_json::to_string(r).expect("reports serialise"))
        .collect();
    Ok(Results::new(runs, kv_entries, None).with_reports(json))
}

/// Captures a recipe with the native model into a kvtrace/1 file (default: the recipe's path
/// with `.safetensors`) and opens it.
#[pyfunction]
#[pyo3(signature = (recipe, out=None, dtype="f16", chunk=512))]
pub fn capture(
    py: Python<'_>,
    recipe: PathBuf,
    out: Option<PathBuf>,
    dtype: &str,
    chunk: usize,
) -> PyResult<Trace> {
    let storage = match dtype {
        "f16" => StorageDtype::F16,
        "bf16" => StorageDtype::Bf16,
        "f32" => StorageDtype::F32,
        other => return Err(message(format!("dtype `{other}`: valid: f16, bf16, f32"))),
    };
    let out = out.unwrap_or_else(|| recipe.with_extension("safetensors"));
    let _: CaptureSummary = py
        .detach(|| capture_recipe(&recipe, &out, storage, chunk, &mut |_, _| {}))
        .map_err(raised)?;
    Trace::open_path(out)
}
