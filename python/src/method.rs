//! What a method written in Python shares with every call: the object, its name, and the first
//! failure, recorded where the library calls it (it cannot return an error there) and reported
//! through the method's `failure()`, which the engine checks after each layer and stops with.

use pyo3::prelude::*;
use std::sync::Mutex;

/// A Python object standing for a method.
pub struct PyMethod {
    pub object: Py<PyAny>,
    /// `object.name`, or its class's name.
    pub name: String,
    failure: Mutex<Option<String>>,
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
            failure: Mutex::new(None),
        })
    }

    /// Whether a call has failed.
    pub fn failed(&self) -> bool {
        self.failure.lock().expect("not poisoned").is_some()
    }

    /// The first failure, if a call failed.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("not poisoned").clone()
    }

    /// Records `failure` unless an earlier one is recorded.
    pub fn record(&self, failure: String) {
        self.failure
            .lock()
            .expect("not poisoned")
            .get_or_insert(failure);
    }
}
