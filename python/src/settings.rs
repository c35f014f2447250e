//! Keyword arguments as the settings map an experiment's policy table is: names, numbers and
//! booleans by key, read and checked by the library ([`kvreplay::replay::presets::from_settings`]).

use crate::errors::message;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};
use serde_json::{Map, Value};

/// The settings of `given` (a dict of keyword arguments), each value a string, a whole number, a
/// number or a boolean; the keys in `skip` are left out (the caller reads them itself).
pub fn settings_map(
    given: Option<&Bound<'_, PyDict>>,
    skip: &[&str],
) -> PyResult<Map<String, Value>> {
    let mut settings = Map::new();
    let Some(given) = given else {
        return Ok(settings);
    };
    for (key, value) in given.iter() {
        let key: String = key.extract()?;
        if skip.contains(&key.as_str()) {
            continue;
        }
        settings.insert(key.clone(), json_value(&key, &value)?);
    }
    Ok(settings)
}

/// One setting's value as a config value.
fn json_value(key: &str, value: &Bound<'_, PyAny>) -> PyResult<Value> {
    if value.is_instance_of::<PyBool>() {
        return Ok(Value::Bool(value.extract()?));
    }
    if value.is_instance_of::<PyInt>() {
        return match value.extract::<u64>() {
            Ok(whole) => Ok(Value::from(whole)),
            Err(_) => Ok(Value::from(value.extract::<i64>()?)),
        };
    }
    if value.is_instance_of::<PyFloat>() {
        return Ok(Value::from(value.extract::<f64>()?));
    }
    if value.is_instance_of::<PyString>() {
        return Ok(Value::String(value.extract()?));
    }
    Err(message(format!(
        "setting `{key}` = {}: must be a string, a whole number, a number or a boolean",
        value.repr()?
    )))
}
