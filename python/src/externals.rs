//! Python methods an experiment file may name: `sweep(..., methods={"my-snapkv": SnapKV()})`
//! makes `scorer = "my-snapkv"` in a `[[policy]]` table mean that object (an object with
//! `allocate` is an allocator). A run of such a policy is identified by the method's name and its
//! code (the sha256 of its class's source, or its qualified name where Python has no source), so
//! changing the code runs it again instead of reusing stored runs.

use crate::allocator::PyAllocator;
use crate::errors::message;
use crate::scorer::PyScorer;
use kvreplay::replay::{External, ExternalMethods, PolicyParams};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::BTreeMap;

/// The axis a Python method serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Axis {
    Scorer,
    Allocator,
}

/// Python methods by the names experiment files give them.
#[derive(Debug)]
pub struct PyExternals {
    /// Name → (axis, object, code identity).
    methods: BTreeMap<String, (Axis, Py<PyAny>, String)>,
}

impl PyExternals {
    /// The methods of `given` (name → object), each checked by building it once.
    pub fn new(given: &Bound<'_, PyDict>) -> PyResult<Self> {
        let mut methods = BTreeMap::new();
        for (name, object) in given.iter() {
            let name: String = name.extract()?;
            let axis = if object.hasattr("allocate")? {
                PyAllocator::new(&object)?;
                Axis::Allocator
            } else if object.hasattr("score")? || object.hasattr("start")? || object.is_callable() {
                PyScorer::new(&object)?;
                Axis::Scorer
            } else {
                return Err(message(format!(
                    "method `{name}`: needs a `score(cache)` or `start()` (a scorer) or `allocate(given)` (an allocator) method"
                )));
            };
            methods.insert(
                name,
                (axis, object.clone().unbind(), code_identity(&object)?),
            );
        }
        Ok(Self { methods })
    }

    /// The method named `name` on `axis`, if it is one of these.
    fn named(&self, name: &str, axis: Axis) -> Option<&(Axis, Py<PyAny>, String)> {
        self.methods.get(name).filter(|(of, _, _)| *of == axis)
    }
}

/// The sha256 of the source of `object`'s class (or of the function), or its qualified name.
pub fn code_identity(object: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = object.py();
    let inspect = py.import("inspect")?;
    let target = match inspect
        .call_method1("isfunction", (object,))?
        .extract::<bool>()?
    {
        true => object.clone(),
        false => object.get_type().into_any(),
    };
    match inspect.call_method1("getsource", (&target,)) {
        Ok(source) => {
            let digest = py
                .import("hashlib")?
                .call_method1("sha256", (source.call_method1("encode", ("utf-8",))?,))?
                .call_method0("hexdigest")?;
            digest.extract()
        }
        Err(_) => target.getattr("__qualname__")?.extract(),
    }
}

impl ExternalMethods for PyExternals {
    fn methods(&self, params: &PolicyParams) -> Option<External> {
        let scorer = self.named(&params.scorer, Axis::Scorer);
        let allocator = self.named(&params.allocator, Axis::Allocator);
        if scorer.is_none() && allocator.is_none() {
            return None;
        }
        Python::attach(|py| {
            let scorer = scorer.map(|(_, object, _)| {
                let built = PyScorer::new(object.bind(py)).expect("checked when given");
                let boxed: Box<dyn kvreplay::replay::scorer::Scorer> = Box::new(built);
                (boxed, format!("{:p}", object.as_ptr()))
            });
            let allocator = allocator.map(|(_, object, _)| {
                let built = PyAllocator::new(object.bind(py)).expect("checked when given");
                Box::new(built) as Box<dyn kvreplay::replay::allocator::Allocator>
            });
            Some(External { scorer, allocator })
        })
    }

    fn identity(&self, params: &PolicyParams) -> Option<String> {
        let parts: Vec<String> = [
            self.named(&params.scorer, Axis::Scorer),
            self.named(&params.allocator, Axis::Allocator),
        ]
        .into_iter()
        .flatten()
        .map(|(_, _, code)| code.clone())
        .collect();
        (!parts.is_empty()).then(|| parts.join(" "))
    }
}
