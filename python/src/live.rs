//! Runs of the native model from Python: `live` (closed loop under one policy) and `capture`.

use crate::errors::{message, raised};
use crate::run::Policy;
use crate::trace::Trace;
use kvreplay::capture::{build_prompt, capture_recipe, load_recipe_model, CaptureSummary};
use kvreplay::trace::StorageDtype;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// Runs a recipe live under one policy (the keyword arguments of `replay`; `scorer` may be a
/// Python object): the policy holds the model's real KV cache, and what the model then does
/// (next-token KL, top-1 agreement, log-probability lost, free-running text, answer score) comes
/// back as a dict beside the open-loop report, as `kvreplay live --format json` prints it.
#[pyfunction]
#[pyo3(signature = (recipe, chunk=512, **settings))]
pub fn live<'py>(
    py: Python<'py>,
    recipe: PathBuf,
    chunk: usize,
    settings: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    if recipe.extension().is_none_or(|e| e != "toml") {
        return Err(message(format!(
            "{}: live mode runs the model on a recipe (a .toml file), not on a trace",
            recipe.display()
        )));
    }
    let (policy, checked) = Policy::from_settings(None, settings)?;
    let scratch = std::env::temp_dir();
    let report = py.detach(|| -> Result<String, String> {
        let text = kvreplay::error_text;
        kvreplay::live::check_live(&checked).map_err(|e| text(&e))?;
        let model = load_recipe_model(&recipe).map_err(|e| text(&e))?;
        let prompt = build_prompt(&recipe, model.as_ref()).map_err(|e| text(&e))?;
        let report = kvreplay::live::live(model.as_ref(), &prompt, &checked, chunk, &scratch)
            .map_err(|e| text(&e))?;
        Ok(serde_json::to_string(&report).expect("reports serialise"))
    });
    policy.check_methods()?;
    let report = report.map_err(message)?;
    py.import("json")?.call_method1("loads", (report,))
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
