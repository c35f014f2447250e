//! kvreplay's Python package: one binding layer over the library, with no logic of its own.
//! Traces open as NumPy views of the mapped file; replay, compare, kept sets, live runs, capture,
//! sweeps, reports and view pages take the settings the TOML and the command line take, by the same names,
//! checked by the same code; results come back as polars DataFrames; errors are
//! `kvreplay.KvreplayError` carrying the command line's message; the GIL is released while Rust
//! works. A scorer or an allocator may be a Python object ([`scorer`], [`allocator`]).

// The library's error enums (`SweepError`, `LiveError`) come back once per call from the closures
// that run with the GIL released, and are turned into Python exceptions at once; clippy passes
// them in the library, whose functions are exported API, and flags the same types here.
#![allow(clippy::result_large_err)]

use pyo3::prelude::*;

mod allocator;
mod errors;
mod experiment;
mod externals;
mod interrupt;
mod live;
mod method;
mod results;
mod run;
mod scorer;
mod settings;
mod trace;
mod view;

pub use errors::KvreplayError;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    kvreplay::sys::tune_thread_pools();
    m.add("KvreplayError", m.py().get_type::<KvreplayError>())?;
    m.add_class::<trace::Trace>()?;
    m.add_class::<results::Results>()?;
    m.add_class::<scorer::Cache>()?;
    m.add_class::<scorer::Token>()?;
    m.add_class::<view::Page>()?;
    m.add_function(wrap_pyfunction!(run::replay, m)?)?;
    m.add_function(wrap_pyfunction!(run::compare, m)?)?;
    m.add_function(wrap_pyfunction!(run::kept, m)?)?;
    m.add_function(wrap_pyfunction!(run::methods, m)?)?;
    m.add_function(wrap_pyfunction!(live::live, m)?)?;
    m.add_function(wrap_pyfunction!(live::capture, m)?)?;
    m.add_function(wrap_pyfunction!(experiment::sweep, m)?)?;
    m.add_function(wrap_pyfunction!(experiment::report, m)?)?;
    m.add_function(wrap_pyfunction!(view::view, m)?)?;
    Ok(())
}
