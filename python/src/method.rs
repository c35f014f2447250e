//! What a method written in Python shares with every call: the object, its name, and the first
//! failure, recorded where the library calls it (it cannot return an error there) and raised once
//! the work is done.

use crate::errors::message;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

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

    /// Records `failure` unless an earlier one is recorded.
    pub fn record(&self, failure: String) {
        self.failure
            .lock()
            .expect("not poisoned")
            .get_or_insert(failure);
    }
}

/// A Python method's first failure, if any, once the work is done.
pub struct Failure(Arc<PyMethod>);

impl Failure {
    pub fn of(method: &Arc<PyMethod>) -> Self {
        Self(method.clone())
    }

    /// Raises the recorded failure, if any.
    pub fn check(&self) -> PyResult<()> {
        match self.0.failure.lock().expect("not poisoned").take() {
            Some(failure) => Err(message(failure)),
            None => Ok(()),
        }
    }
}
