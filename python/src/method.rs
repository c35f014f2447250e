//! What a method written in Python shares with every call: the object and its name. A call that
//! raises returns a [`MethodFailed`](kvreplay::replay::MethodFailed) naming the method, where and
//! which call, and the engine stops with it.

use pyo3::prelude::*;

/// A Python object standing for a method.
pub struct PyMethod {
    pub object: Py<PyAny>,
    /// `object.name`, or its class's name.
    pub name: String,
}

impl PyMethod {
    pub fn new(object: &Bound<'_, PyAny>) -> PyResult<Self> {
        let name: String = match object.getattr_opt("name")? {
            Some(name) => name.extract()?,
            None => object.get_type().name()?.extract()?,
        };
        Ok(Self {
            object: object.clone().unbind(),
            name,
        })
    }
}
