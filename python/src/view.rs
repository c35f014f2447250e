//! `kvreplay.view`: the page `kvreplay view` writes, as a [`Page`] (shown inline in a notebook).

use crate::errors::raised;
use crate::interrupt::interruptible;
use crate::run::Policy;
use crate::trace::Trace;
use kvreplay::assets::Assets;
use kvreplay::replay::Checkpoints;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// One self-contained HTML page of what a policy kept on a trace.
#[pyclass(frozen, module = "kvreplay")]
pub struct Page {
    /// The page's HTML.
    #[pyo3(get)]
    html: String,
}

#[pymethods]
impl Page {
    /// What a notebook shows.
    fn _repr_html_(&self) -> String {
        self.html.clone()
    }

    /// Writes the page to `path` (atomically).
    fn save(&self, path: PathBuf) -> PyResult<()> {
        kvreplay::atomic::write(&path, self.html.as_bytes()).map_err(raised)
    }
}

/// The page of the policy the keyword arguments set (as `replay` takes them) on `trace`, and of
/// `compare` (a second policy's settings, a dict) beside it.
#[pyfunction]
#[pyo3(signature = (trace, compare=None, **settings))]
pub fn view(
    py: Python<'_>,
    trace: &Bound<'_, PyAny>,
    compare: Option<Bound<'_, PyDict>>,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<Page> {
    let trace = Trace::from_arg(trace)?.into_bound(py);
    let (main, checked) = Policy::from_settings(None, settings)?;
    let mut policies = vec![(main.name, checked)];
    if let Some(other) = compare {
        let (other, checked) = Policy::from_settings(None, Some(&other))?;
        policies.push((other.name, checked));
    }
    let reader = trace.get().reader();
    let html = interruptible(py, |stop| {
        kvreplay::view::page_of(
            reader,
            &policies,
            &Assets::from_env(),
            Checkpoints::stopping(stop),
        )
    })?
    .map_err(raised)?;
    Ok(Page { html })
}
