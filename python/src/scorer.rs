//! A scorer written in Python. Any object with a `score(cache)` method (or a callable) ranks the
//! tokens of one cache: it receives a [`Cache`] (NumPy copies of what the Rust scorers see, up to
//! the newest position, and the layer's context) and returns one score per cached position,
//! higher kept. kvreplay then applies every allocator, head split, layout, protection and metric
//! exactly as for a built-in scorer.
//!
//! Optional attributes: `name` (default: the class name), `timings` (default `("prefill",
//! "per-step-prompt", "per-step")`), `needs_values` (default False), `needs_inputs` (default
//! False: the layer's hidden states and projection weights, which the trace must hold) and
//! `defaults` (a dict of
//! policy settings, such as `{"window": 0}`, that a policy given the object as `scorer=` runs
//! under unless the call sets them: the semantics of the method it wraps). A Python scorer is
//! stateless: it is asked for scores whenever the engine chooses, so the streaming timings, which
//! choose at every token, are refused (one Python call per token, cache and layer).
//!
//! A scorer that raises or returns the wrong length, a non-finite score or a non-float dtype
//! stops the work after the layer with a `KvreplayError` naming the scorer, layer and cache;
//! nothing of it is stored.

use crate::errors::message;
use crate::method::PyMethod;
use crate::settings::settings_map;
use kvreplay::replay::scorer::{ScoreState, Scorer, Started};
use kvreplay::replay::{LayerContext, Protection, Timing, Unit};
use kvreplay::trace::{LayerInputs, PROJECTIONS};
use ndarray::{s, Array1};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::{Map, Value};
use std::sync::Arc;

/// What a Python scorer sees of one cache when asked for scores.
#[pyclass(frozen, get_all, module = "kvreplay")]
pub struct Cache {
    /// The cache's query heads' queries at positions `0..=newest`, `[heads, newest + 1, d]`
    /// float32, post-rotary.
    queries: Py<PyAny>,
    /// Its KV head's keys at `0..=newest`, `[newest + 1, d]` float32, post-rotary.
    keys: Py<PyAny>,
    /// Its values at `0..=newest`, `[newest + 1, d]` float32, or None (not stored or not asked).
    values: Py<PyAny>,
    /// The layer's attention input (normed hidden states) at `0..=newest`, `[newest + 1,
    /// d_model]` float32, or None (not stored or not asked: `needs_inputs`).
    hidden: Py<PyAny>,
    /// The layer's projections as `nn.Linear` stores them, float32: `q_proj.weight`
    /// `[n_heads·d, d_model]`, `k_proj.weight`, `v_proj.weight` `[n_kv_heads·d, d_model]`,
    /// `o_proj.weight` `[d_model, n_heads·d]`, and each `….bias` the model has; or None.
    projections: Py<PyAny>,
    /// With `needs_inputs`, the whole layer's queries `[n_heads, newest + 1, d]`, keys and
    /// values `[n_kv_heads, newest + 1, d]` (None without values), for a method that scores a
    /// layer at once; None otherwise.
    layer_queries: Py<PyAny>,
    layer_keys: Py<PyAny>,
    layer_values: Py<PyAny>,
    /// The cached positions to score (int64), in the cache's order: one score each.
    positions: Py<PyAny>,
    /// The newest position (the current query's).
    newest: usize,
    /// Layer index.
    layer: usize,
    /// The KV head whose keys the cache holds.
    kv_head: usize,
    /// The query heads that read it, `(start, end)`.
    query_heads: (usize, usize),
    /// Positions `0..prompt_len` are the prompt.
    prompt_len: usize,
    /// The policy's protected first tokens.
    sinks: usize,
    /// The policy's protected recent tokens (SnapKV's observation window).
    window: usize,
    /// The layer's attention window (0: global).
    layer_window: usize,
    /// The layer's rotary base, when the trace gives it.
    rope_theta: Option<f32>,
    /// The softmax scale.
    scale: f32,
    /// The logit soft-cap, if any.
    softcap: Option<f32>,
    /// Query heads of the layer.
    n_heads: usize,
    /// KV heads of the layer.
    n_kv_heads: usize,
}

/// The timings a stateless scorer can serve.
const SERVED: [Timing; 3] = [Timing::Prefill, Timing::PerStepPrompt, Timing::PerStep];

/// A Python object as a [`Scorer`].
pub struct PyScorer {
    shared: Arc<PyMethod>,
    timings: Vec<Timing>,
    needs_values: bool,
    needs_inputs: bool,
    defaults: Map<String, Value>,
}

impl PyScorer {
    /// `object` as a scorer, its attributes read and checked.
    pub fn new(object: &Bound<'_, PyAny>) -> PyResult<Self> {
        let method = PyMethod::new(object)?;
        let name = method.name.clone();
        if !object.hasattr("score")? && !object.is_callable() {
            return Err(message(format!(
                "Python scorer `{name}`: needs a `score(cache)` method or must be callable"
            )));
        }
        let timings = match object.getattr_opt("timings")? {
            None => SERVED.to_vec(),
            Some(given) => {
                let names: Vec<String> = given.extract()?;
                names
                    .iter()
                    .map(|timing| served(&name, timing))
                    .collect::<PyResult<_>>()?
            }
        };
        let flag = |name: &str| -> PyResult<bool> {
            match object.getattr_opt(name)? {
                Some(flag) => flag.extract(),
                None => Ok(false),
            }
        };
        let (needs_values, needs_inputs) = (flag("needs_values")?, flag("needs_inputs")?);
        let defaults = match object.getattr_opt("defaults")? {
            Some(given) => {
                let dict = given.cast::<PyDict>().map_err(|_| {
                    message(format!(
                        "Python scorer `{name}`: `defaults` must be a dict of policy settings"
                    ))
                })?;
                settings_map(Some(dict), &[])?
            }
            None => Map::new(),
        };
        Ok(Self {
            shared: Arc::new(method),
            timings,
            needs_values,
            needs_inputs,
            defaults,
        })
    }

    /// The name results give it.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The policy settings it runs under unless a call sets them.
    pub fn defaults(&self) -> &Map<String, Value> {
        &self.defaults
    }
}

/// Timing `name` if a Python scorer can serve it.
fn served(scorer: &str, name: &str) -> PyResult<Timing> {
    let timing = Timing::ALL.into_iter().find(|t| t.name() == name);
    match timing {
        Some(timing) if SERVED.contains(&timing) => Ok(timing),
        Some(_) => Err(message(format!(
            "Python scorer `{scorer}`: timing `{name}` chooses at every token (one Python call per token, cache and layer); a Python scorer serves prefill, per-step-prompt and per-step"
        ))),
        None => Err(message(format!(
            "Python scorer `{scorer}`: unknown timing `{name}`; valid: prefill, per-step-prompt, per-step"
        ))),
    }
}

impl Scorer for PyScorer {
    fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    fn needs_values(&self) -> bool {
        self.needs_values
    }

    fn needs_inputs(&self) -> bool {
        self.needs_inputs
    }

    fn supports(&self, timing: Timing) -> bool {
        self.timings.contains(&timing)
    }

    fn start(&self, _layer: &LayerContext<'_>, unit: &Unit, protect: Protection) -> Started {
        Box::new(State {
            shared: self.shared.clone(),
            unit: unit.clone(),
            protect,
            needs_values: self.needs_values,
            needs_inputs: self.needs_inputs,
        })
    }
}

/// One cache's state: nothing but what it is (a Python scorer is stateless).
#[derive(Clone)]
struct State {
    shared: Arc<PyMethod>,
    unit: Unit,
    protect: Protection,
    needs_values: bool,
    needs_inputs: bool,
}

impl ScoreState for State {
    fn on_append(&mut self, _layer: &LayerContext<'_>, _cache: &[usize]) {}

    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) {
        out.clear();
        let place = (layer.layer, self.unit.index);
        if !self.shared.failed_by(place) {
            match Python::attach(|py| self.call(py, layer, cache)) {
                Ok(scores) => *out = scores,
                Err(failure) => self.shared.record(
                    place,
                    format!(
                        "Python scorer `{}` at layer {}, cache {}: {failure}",
                        self.shared.name, layer.layer, self.unit.index
                    ),
                ),
            }
        }
        // After a failure, zeros until the engine stops with it after the layer.
        out.resize(cache.len(), 0.0);
    }
}

impl State {
    /// Calls the object on this cache and checks what it returns.
    fn call(
        &self,
        py: Python<'_>,
        layer: &LayerContext<'_>,
        cache: &[usize],
    ) -> Result<Vec<f32>, String> {
        let view = self.view(py, layer, cache).map_err(|e| e.to_string())?;
        let object = self.shared.object.bind(py);
        let returned = match object.getattr_opt("score").map_err(|e| e.to_string())? {
            Some(score) => score.call1((view,)),
            None => object.call1((view,)),
        }
        .map_err(|err| format!("raised {err}"))?;
        scores_of(&returned, cache.len())
    }

    /// The [`Cache`] the object sees.
    fn view(&self, py: Python<'_>, layer: &LayerContext<'_>, cache: &[usize]) -> PyResult<Cache> {
        let newest = cache.iter().copied().max().unwrap_or(0);
        let heads = self.unit.query_heads.clone();
        let kv = self.unit.kv_head;
        let queries = layer.q.slice(s![heads.clone(), ..=newest, ..]).to_owned();
        let keys = layer.k.slice(s![kv, ..=newest, ..]).to_owned();
        let values = match (self.needs_values, layer.v) {
            (true, Some(v)) => v
                .slice(s![kv, ..=newest, ..])
                .to_owned()
                .into_pyarray(py)
                .into_any()
                .unbind(),
            _ => py.None(),
        };
        let (hidden, projections) = match (self.needs_inputs, layer.inputs) {
            (true, Some(inputs)) => inputs_of(py, inputs, newest)?,
            _ => (py.None(), py.None()),
        };
        let whole = |array: Option<ndarray::ArrayView3<'_, f32>>| match (self.needs_inputs, array) {
            (true, Some(array)) => array
                .slice(s![.., ..=newest, ..])
                .to_owned()
                .into_pyarray(py)
                .into_any()
                .unbind(),
            _ => py.None(),
        };
        let (layer_queries, layer_keys, layer_values) =
            (whole(Some(layer.q)), whole(Some(layer.k)), whole(layer.v));
        let positions: Array1<i64> = cache.iter().map(|&p| p as i64).collect();
        Ok(Cache {
            queries: queries.into_pyarray(py).into_any().unbind(),
            keys: keys.into_pyarray(py).into_any().unbind(),
            values,
            hidden,
            projections,
            layer_queries,
            layer_keys,
            layer_values,
            positions: positions.into_pyarray(py).into_any().unbind(),
            newest,
            layer: layer.layer,
            kv_head: kv,
            query_heads: (heads.start, heads.end),
            prompt_len: layer.prompt_len,
            sinks: self.protect.sinks,
            window: self.protect.window,
            layer_window: layer.window,
            rope_theta: layer.rope_theta,
            scale: layer.scale,
            softcap: layer.softcap,
            n_heads: layer.q.shape()[0],
            n_kv_heads: layer.k.shape()[0],
        })
    }
}

/// The hidden states at `0..=newest` and a dict of the projections' weights and biases.
fn inputs_of(
    py: Python<'_>,
    inputs: &LayerInputs,
    newest: usize,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let hidden = inputs.hidden.slice(s![..=newest, ..]).to_owned();
    let projections = PyDict::new(py);
    for (name, projection) in PROJECTIONS.iter().zip(&inputs.projections) {
        let weight = projection.weight.clone().into_pyarray(py);
        projections.set_item(format!("{name}.weight"), weight)?;
        if let Some(bias) = &projection.bias {
            projections.set_item(format!("{name}.bias"), bias.clone().into_pyarray(py))?;
        }
    }
    Ok((
        hidden.into_pyarray(py).into_any().unbind(),
        projections.into_any().unbind(),
    ))
}

/// The scores in `returned`: a one-dimensional float32 or float64 array of `len` finite values.
fn scores_of(returned: &Bound<'_, PyAny>, len: usize) -> Result<Vec<f32>, String> {
    let scores: Vec<f32> = if let Ok(array) = returned.cast::<PyArray1<f32>>() {
        array.to_vec().map_err(|e| e.to_string())?
    } else if let Ok(array) = returned.cast::<PyArray1<f64>>() {
        let wide = array.to_vec().map_err(|e| e.to_string())?;
        wide.into_iter().map(|s| s as f32).collect()
    } else {
        let what = match returned.cast::<numpy::PyUntypedArray>() {
            Ok(array) => format!(
                "an array of dtype {} and {} dimension(s)",
                array.dtype(),
                array.ndim()
            ),
            Err(_) => format!("{}", returned.get_type().name().map_err(|e| e.to_string())?),
        };
        return Err(format!(
            "returned {what}; expected a one-dimensional float32 or float64 NumPy array"
        ));
    };
    if scores.len() != len {
        return Err(format!(
            "returned {} scores for a cache of {len} positions",
            scores.len()
        ));
    }
    if let Some(index) = scores.iter().position(|s| !s.is_finite()) {
        return Err(format!(
            "returned a non-finite score ({}) at index {index}",
            scores[index]
        ));
    }
    Ok(scores)
}
