//! `kvreplay.Results`: what a replay, compare or sweep measured, as polars DataFrames with the
//! columns of `runs.parquet` (one row per run), per layer, and per layer, query head and decode
//! step.

use crate::errors::message;
use kvreplay::experiment::frames::{
    layers_frame, parquet_bytes, runs_frame, samples_frame, DataFrame, PolarsError,
};
use kvreplay::experiment::StoredRun;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

type PolarsResult<T> = Result<T, PolarsError>;

/// Measured runs.
#[pyclass(frozen, module = "kvreplay")]
pub struct Results {
    runs: Vec<StoredRun>,
    kv_entries: Vec<f64>,
    /// A sweep's report (markdown), when the results come from one.
    #[pyo3(get)]
    report: Option<String>,
    /// Live runs' full reports as JSON, when the results come from `live`.
    live_reports: Vec<String>,
}

impl Results {
    pub fn new(runs: Vec<StoredRun>, kv_entries: Vec<f64>, report: Option<String>) -> Self {
        Self {
            runs,
            kv_entries,
            report,
            live_reports: Vec::new(),
        }
    }

    /// The same with live runs' full reports (JSON).
    pub fn with_reports(self, live_reports: Vec<String>) -> Self {
        Self {
            live_reports,
            ..self
        }
    }
}

#[pymethods]
impl Results {
    /// One row per run: id, trace, policy, budget, mean_kept, kv_entries, every metric and, for
    /// closed-loop runs, the closed-loop columns (as `runs.parquet`).
    #[getter]
    fn runs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_polars(py, runs_frame(&self.runs, &self.kv_entries))
    }

    /// One row per run and measured layer: budget, mean kept and each metric's layer mean.
    #[getter]
    fn layers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_polars(py, layers_frame(&self.runs))
    }

    /// The standard figures with matplotlib (`kvreplay.plots.standard`): retained mass against
    /// budget per policy, and the budget per layer at the largest budget; a list of Figures.
    fn plot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (runs, layers) = (self.runs(py)?, self.layers(py)?);
        py.import("kvreplay.plots")?
            .call_method1("standard", (runs, layers))
    }

    /// One row per run, measured layer, query head and decode step: each metric's sample.
    #[getter]
    fn samples<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_polars(py, samples_frame(&self.runs))
    }

    /// For live runs, each policy's full report as a dict (`kvreplay live --format json`: every
    /// teacher-forced step, the texts, the per-layer live mass, the open-loop report); else empty.
    #[getter]
    fn reports<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let json = py.import("json")?;
        self.live_reports
            .iter()
            .map(|report| json.call_method1("loads", (report,)))
            .collect()
    }

    /// The policies' display names, in order.
    #[getter]
    fn policies(&self) -> Vec<String> {
        self.runs.iter().map(|r| r.name.clone()).collect()
    }

    fn __len__(&self) -> usize {
        self.runs.len()
    }

    fn __repr__(&self) -> String {
        format!("Results({} runs)", self.runs.len())
    }
}

/// A library DataFrame as a polars DataFrame in Python, through Parquet bytes (the two sides need
/// not share a polars version).
fn to_polars<'py>(py: Python<'py>, frame: PolarsResult<DataFrame>) -> PyResult<Bound<'py, PyAny>> {
    let mut frame = frame.map_err(|e| message(e.to_string()))?;
    let bytes = parquet_bytes(&mut frame).map_err(|e| message(e.to_string()))?;
    let buffer = py
        .import("io")?
        .getattr("BytesIO")?
        .call1((PyBytes::new(py, &bytes),))?;
    py.import("polars")?.call_method1("read_parquet", (buffer,))
}
