//! Replays from Python: `replay`, `compare`, `kept` and `methods`, over the library's engine.

use crate::allocator::PyAllocator;
use crate::errors::{message, raised};
use crate::externals::code_identity;
use crate::interrupt::interruptible;
use crate::results::Results;
use crate::scorer::PyScorer;
use crate::settings::settings_map;
use crate::trace::Trace;
use kvreplay::experiment::{run_id, ClosedLoop, StoredRun, TraceFile};
use kvreplay::replay::{
    kept_masks, presets, replay_many, Checkpoints, External, PolicyParams, ReplayReport,
    ValidPolicy,
};
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use std::ffi::CString;

/// One policy from Python: its display name and parameters, and the code of its Python methods
/// (for run ids, as a sweep names them); the checked policy goes beside it.
pub struct Policy {
    pub name: String,
    pub params: PolicyParams,
    pub code: Option<String>,
}

impl Policy {
    /// The policy `given` (keyword arguments) sets over `defaults`: `name` labels it (default:
    /// its short label), `scorer` and `allocator` are registered names or Python objects,
    /// `preset` and every other key are read as an experiment's policy table reads them.
    pub fn from_settings(
        defaults: Option<&Bound<'_, PyDict>>,
        given: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<(Self, ValidPolicy)> {
        const OBJECTS: [&str; 3] = ["name", "scorer", "allocator"];
        let mut settings = settings_map(defaults, &OBJECTS)?;
        settings.extend(settings_map(given, &OBJECTS)?);
        let pick = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
            for dict in [given, defaults].into_iter().flatten() {
                if let Some(value) = dict.get_item(key)? {
                    return Ok(Some(value));
                }
            }
            Ok(None)
        };
        let name: Option<String> = pick("name")?.map(|n| n.extract()).transpose()?;
        let mut external = External::default();
        let mut code = Vec::new();
        if let Some(scorer) = pick("scorer")? {
            if scorer.is_instance_of::<PyString>() {
                settings.insert("scorer".into(), scorer.extract::<String>()?.into());
            } else {
                let python = PyScorer::new(&scorer)?;
                settings.insert("scorer".into(), python.name().into());
                for (key, value) in python.defaults() {
                    settings.entry(key.clone()).or_insert_with(|| value.clone());
                }
                code.push(code_identity(&scorer)?);
                let identity = format!("{:p}", scorer.as_ptr());
                external.scorer = Some((Box::new(python), identity));
            }
        }
        if let Some(allocator) = pick("allocator")? {
            if allocator.is_instance_of::<PyString>() {
                settings.insert("allocator".into(), allocator.extract::<String>()?.into());
            } else {
                let python = PyAllocator::new(&allocator)?;
                settings.insert("allocator".into(), python.name().into());
                code.push(code_identity(&allocator)?);
                external.allocator = Some(Box::new(python));
            }
        }
        let params = presets::from_settings(&settings).map_err(raised)?;
        let checked = params.clone().check_with(external).map_err(raised)?;
        let policy = Self {
            name: name.unwrap_or_else(|| checked.label()),
            params,
            code: (!code.is_empty()).then(|| code.join(" ")),
        };
        Ok((policy, checked))
    }

    /// The policies of a call: one from `settings`, or each of `policies` over `settings`.
    pub fn all(
        policies: Option<Vec<Bound<'_, PyDict>>>,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Vec<(Self, ValidPolicy)>> {
        match policies {
            None => Ok(vec![Self::from_settings(None, settings)?]),
            Some(list) => list
                .iter()
                .map(|given| Self::from_settings(settings, Some(given)))
                .collect(),
        }
    }
}

/// Replays `policies` on `trace` with the GIL released, on `threads` workers (default: all
/// cores), and collects their runs as a sweep stores them.
fn replay_policies(
    py: Python<'_>,
    trace: &Bound<'_, Trace>,
    (policies, checked): (Vec<Policy>, Vec<ValidPolicy>),
    threads: Option<usize>,
) -> PyResult<Results> {
    let reader = trace.get().reader();
    let reports = interruptible(py, |stop| {
        let mut builder = rayon::ThreadPoolBuilder::new();
        if let Some(threads) = threads {
            builder = builder.num_threads(threads);
        }
        let pool = builder.build().map_err(|e| e.to_string())?;
        pool.install(|| replay_many(reader, &checked, Checkpoints::stopping(stop)))
            .map_err(|e| kvreplay::error_text(&e))
    })?;
    let reports = reports.map_err(message)?;
    let identity = trace.get().identity(py)?;
    let kv_entries = reports.iter().map(|r| r.kv_entries).collect();
    let reports: Vec<(&ReplayReport, Option<ClosedLoop>)> =
        reports.iter().map(|report| (report, None)).collect();
    Ok(Results::new(
        stored_runs(&policies, identity, &reports),
        kv_entries,
        None,
    ))
}

/// The runs of `policies` on `trace` as a sweep stores them, from each one's open-loop report and
/// closed-loop outcomes (if run live).
pub fn stored_runs(
    policies: &[Policy],
    trace: &TraceFile,
    reports: &[(&ReplayReport, Option<ClosedLoop>)],
) -> Vec<StoredRun> {
    policies
        .iter()
        .zip(reports)
        .map(|(policy, (report, closed))| {
            let code = policy.code.as_deref();
            let id = run_id(&policy.name, trace, &policy.params, closed.is_some(), code);
            StoredRun::new(
                id,
                &policy.name,
                trace,
                &policy.params,
                report,
                closed.clone(),
            )
        })
        .collect()
}

/// Replays policies on a trace and measures what they keep.
///
/// One policy from the keyword arguments (`budget=64, scorer="knorm"`, `preset="snapkv"`,
/// any setting `kvreplay methods` lists), or several: `policies=[{...}, {...}]`, each a dict of
/// the same keys over the keyword arguments; `name` labels a policy. `scorer` may be a Python
/// object (`kvreplay.Cache` documents what it sees). Returns `Results`.
#[pyfunction]
#[pyo3(signature = (trace, policies=None, threads=None, **settings))]
pub fn replay(
    py: Python<'_>,
    trace: &Bound<'_, PyAny>,
    policies: Option<Vec<Bound<'_, PyDict>>>,
    threads: Option<usize>,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<Results> {
    let trace = Trace::from_arg(trace)?.into_bound(py);
    let policies = Policy::all(policies, settings)?;
    replay_policies(py, &trace, policies.into_iter().unzip(), threads)
}

/// Replays named presets of the classic methods at one budget (default: every preset the trace
/// can run, each one left out named in a warning), labelled as `kvreplay compare` labels them;
/// keyword settings (`quantizer`, `bits`, `bytes`...) are set over every preset.
#[pyfunction]
#[pyo3(signature = (trace, budget=128, presets=None, threads=None, **settings))]
pub fn compare(
    py: Python<'_>,
    trace: &Bound<'_, PyAny>,
    budget: usize,
    presets: Option<Vec<String>>,
    threads: Option<usize>,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<Results> {
    let trace = Trace::from_arg(trace)?.into_bound(py);
    let settings = settings_map(settings, &[])?;
    let labelled = match presets {
        Some(names) => presets::labelled(&names, budget, &settings).map_err(raised)?,
        None => {
            let (runnable, left_out) =
                presets::runnable_on(trace.get().reader(), budget, &settings).map_err(raised)?;
            for (name, why) in left_out {
                let warning = py.get_type::<pyo3::exceptions::PyUserWarning>();
                PyErr::warn(
                    py,
                    &warning,
                    &CString::new(format!("left out `{name}`: {why}"))?,
                    1,
                )?;
            }
            runnable
        }
    };
    let policies = labelled
        .into_iter()
        .map(|(name, checked)| {
            let params = checked.params().clone();
            let policy = Policy {
                name,
                params,
                code: None,
            };
            (policy, checked)
        })
        .unzip();
    replay_policies(py, &trace, policies, threads)
}

/// A policy's kept sets as boolean masks, with the keyword arguments of `replay`.
///
/// Returns a dict: `layers` (the compressed layers, in order), `budgets` (each one's budget per
/// cache, rounded down where the `global` allocator gives a layer a total its caches do not
/// divide), `totals` (each one's budget over its caches together) and `mask`: `[layer, cache, position]` over the prompt (True: kept at the prompt's end; for a
/// policy that chooses again later, what it keeps when the first decode step attends), or with
/// `steps=True`, `[layer, cache, step, position]` over every position, one kept set per decode
/// step.
#[pyfunction]
#[pyo3(signature = (trace, steps=false, **settings))]
pub fn kept<'py>(
    py: Python<'py>,
    trace: &Bound<'py, PyAny>,
    steps: bool,
    settings: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let trace = Trace::from_arg(trace)?.into_bound(py);
    let (policy, checked) = Policy::from_settings(None, settings)?;
    let reader = trace.get().reader();
    let kept = interruptible(py, |stop| {
        kept_masks(reader, &checked, steps, Checkpoints::stopping(stop))
    })?
    .map_err(raised)?;
    let result = PyDict::new(py);
    result.set_item("mask", kept.mask.into_pyarray(py))?;
    result.set_item("layers", kept.layers)?;
    result.set_item("budgets", kept.budgets)?;
    result.set_item("totals", kept.totals)?;
    result.set_item("policy", policy.name)?;
    Ok(result)
}

/// Every allocator, head split, scorer and timing with its settings, defaults and source, and
/// the presets, as `kvreplay methods` prints them (markdown).
#[pyfunction]
pub fn methods() -> String {
    kvreplay::export::methods_markdown()
}
