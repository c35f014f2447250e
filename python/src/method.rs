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
    /// The failure at the first place (layer, cache) any call failed: calls run in parallel, so
    /// the first in place, not in time, keeps the message the same from run to run.
    failure: Mutex<Option<((usize, usize), String)>>,
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

    /// Whether a call at `place` (layer, cache) or before it has failed: calls at later places
    /// are skipped, earlier ones still run, so the first place's failure is the one kept.
    pub fn failed_by(&self, place: (usize, usize)) -> bool {
        let recorded = self.failure.lock().expect("not poisoned");
        recorded.as_ref().is_some_and(|(first, _)| *first <= place)
    }

    /// The first failure, if a call failed.
    pub fn failure(&self) -> Option<String> {
        let failure = self.failure.lock().expect("not poisoned");
        failure.as_ref().map(|(_, message)| message.clone())
    }

    /// Records the failure of the call at `place` (layer, cache) unless one at an earlier place
    /// is recorded.
    pub fn record(&self, place: (usize, usize), failure: String) {
        let mut recorded = self.failure.lock().expect("not poisoned");
        if recorded.as_ref().is_none_or(|(first, _)| place < *first) {
            *recorded = Some((place, failure));
        }
    }
}
