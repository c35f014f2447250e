//! An allocator written in Python: any object with an `allocate(input)` method (or a callable)
//! turns the trace's per-layer numbers into one budget per compressed layer, and kvreplay runs it
//! in place of a registered allocator. `input` is a dict: `n_layers` (the layers it allocates, in
//! depth order), `budget` (the nominal budget per cache), `prompt_len`, `sinks`, `window`, and, for
//! an object with `needs_profile = True`, `profiles`: per layer, the window-attention profile the
//! `entropy` and `cake` allocators read (`entropy`, `normalized`, `variance`, `cake_entropy`,
//! `cake_variance`), else None.
//!
//! One that raises or returns the wrong number of budgets, or anything but whole numbers, stops
//! the run with a `KvreplayError` naming it.

use crate::errors::python_failure;
use crate::method::PyMethod;
use kvreplay::replay::allocator::{AllocationInput, Allocator};
use kvreplay::replay::MethodFailed;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// A Python object as an [`Allocator`].
pub struct PyAllocator {
    shared: Arc<PyMethod>,
    needs_profile: bool,
}

impl PyAllocator {
    pub fn new(object: &Bound<'_, PyAny>) -> PyResult<Self> {
        let needs_profile = match object.getattr_opt("needs_profile")? {
            Some(flag) => flag.extract()?,
            None => false,
        };
        Ok(Self {
            shared: Arc::new(PyMethod::new(object)?),
            needs_profile,
        })
    }

    /// The name results give it.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    fn call(&self, py: Python<'_>, input: &AllocationInput<'_>) -> Result<Vec<usize>, String> {
        let given = self.input(py, input).map_err(|e| e.to_string())?;
        let object = self.shared.object.bind(py);
        let returned = match object.getattr_opt("allocate").map_err(|e| e.to_string())? {
            Some(allocate) => allocate.call1((given,)),
            None => object.call1((given,)),
        }
        .map_err(|err| python_failure(&err))?;
        let budgets: Vec<usize> = returned.extract().map_err(|_| {
            "returned something other than a sequence of whole numbers of tokens".to_string()
        })?;
        if budgets.len() != input.n_layers {
            return Err(format!(
                "returned {} budgets for {} layers",
                budgets.len(),
                input.n_layers
            ));
        }
        Ok(budgets)
    }

    fn input<'py>(
        &self,
        py: Python<'py>,
        input: &AllocationInput<'_>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let given = PyDict::new(py);
        given.set_item("n_layers", input.n_layers)?;
        given.set_item("budget", input.budget)?;
        given.set_item("prompt_len", input.prompt_len)?;
        given.set_item("sinks", input.protect.sinks)?;
        given.set_item("window", input.protect.window)?;
        if self.needs_profile {
            let profiles = input
                .profiles
                .iter()
                .map(|p| {
                    let profile = PyDict::new(py);
                    profile.set_item("entropy", p.entropy)?;
                    profile.set_item("normalized", p.normalized)?;
                    profile.set_item("variance", p.variance)?;
                    profile.set_item("cake_entropy", p.cake_entropy)?;
                    profile.set_item("cake_variance", p.cake_variance)?;
                    Ok(profile)
                })
                .collect::<PyResult<Vec<_>>>()?;
            given.set_item("profiles", profiles)?;
        } else {
            given.set_item("profiles", py.None())?;
        }
        Ok(given)
    }
}

impl Allocator for PyAllocator {
    fn needs_profile(&self) -> bool {
        self.needs_profile
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        Python::attach(|py| self.call(py, input)).map_err(|failure| {
            MethodFailed(format!(
                "Python allocator `{}`: {failure}",
                self.shared.name
            ))
        })
    }
}
