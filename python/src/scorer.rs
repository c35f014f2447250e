//! A scorer written in Python. Any object with a `score(cache)` method (or a callable) ranks the
//! tokens of one cache: it receives a [`Cache`] (NumPy copies of what the Rust scorers see, up to
//! the newest position, and the layer's context) and returns one score per cached position,
//! higher kept. kvreplay then applies every allocator, head split, layout, protection and metric
//! exactly as for a built-in scorer, under every timing.
//!
//! Optional attributes: `name` (default: the class name), `timings` (default: every timing),
//! `needs_values` (default False), `needs_inputs` (default False: the layer's hidden states and
//! projection weights, which the trace must hold) and `defaults` (a dict of policy settings, such
//! as `{"window": 0}`, that a policy given the object as `scorer=` runs under unless the call
//! sets them: the semantics of the method it wraps).
//!
//! The incremental protocol: an object with a `start()` method is asked for a fresh state object
//! per cache (each layer's each KV head or query head), and the state, not the object, is then
//! asked for `score(cache)` whenever the timing chooses; its optional `append(token)` sees each
//! token as it enters the cache (a [`Token`]) and `evict(positions)` the positions that leave it
//! (an eviction, a cut, or a slide out of a sliding-window layer's window), so a method that
//! updates a running statistic per token need not recompute it. A stream forked in a live run
//! (two continuations of one prompt) forks the state with `copy.deepcopy`. Without `start`, the
//! object is stateless and is asked whenever the engine chooses (under `streaming`, at every
//! token over budget).
//!
//! A scorer or state that raises, or returns the wrong length, a non-finite score or a non-float
//! dtype ends its cache's work at that call (caches scored in parallel with it run to their end,
//! then the first failure in layer and cache order is returned) with a `KvreplayError` naming
//! the scorer, layer and cache; nothing of it is stored.

use crate::errors::{message, python_failure};
use crate::method::PyMethod;
use crate::settings::settings_map;
use kvreplay::replay::scorer::{ScoreState, Scored, Scorer, Started};
use kvreplay::replay::{LayerContext, MethodFailed, Protection, Timing, Unit};
use kvreplay::trace::{LayerInputs, PROJECTIONS, QK_NORMS, QK_NORM_EPS};
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
    /// `o_proj.weight` `[d_model, n_heads·d]`, and each `….bias` the model has; for a model
    /// that normalises each head's q and k after them (Gemma 3), `q_norm.weight` and
    /// `k_norm.weight` `[d]` (the multipliers as applied) and `qk_norm_eps`; or None.
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

/// A token entering a cache, as a stateful Python scorer's `append(token)` sees it.
#[pyclass(frozen, get_all, module = "kvreplay")]
pub struct Token {
    /// Its position.
    position: usize,
    /// The cache's query heads' queries at it, `[heads, d]` float32, post-rotary.
    queries: Py<PyAny>,
    /// Its key, `[d]` float32, post-rotary.
    key: Py<PyAny>,
    /// Its value, `[d]` float32, or None (not stored or not asked: `needs_values`).
    value: Py<PyAny>,
    /// Layer index.
    layer: usize,
    /// The KV head whose keys the cache holds.
    kv_head: usize,
    /// The softmax scale.
    scale: f32,
    /// The logit soft-cap, if any.
    softcap: Option<f32>,
}

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
        if !object.hasattr("score")? && !object.hasattr("start")? && !object.is_callable() {
            return Err(message(format!(
                "Python scorer `{name}`: needs a `score(cache)` or `start()` method, or must be callable"
            )));
        }
        let timings = match object.getattr_opt("timings")? {
            None => Timing::ALL.to_vec(),
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

/// Timing `name`, by its config spelling.
fn served(scorer: &str, name: &str) -> PyResult<Timing> {
    Timing::ALL
        .into_iter()
        .find(|t| t.name() == name)
        .ok_or_else(|| {
            let valid: Vec<&str> = Timing::ALL.iter().map(|t| t.name()).collect();
            message(format!(
                "Python scorer `{scorer}`: unknown timing `{name}`; valid: {}",
                valid.join(", ")
            ))
        })
}

impl Scorer for PyScorer {
    fn needs_values(&self) -> bool {
        self.needs_values
    }

    fn needs_inputs(&self) -> bool {
        self.needs_inputs
    }

    fn supports(&self, timing: Timing) -> bool {
        self.timings.contains(&timing)
    }

    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        let mut state = State {
            shared: self.shared.clone(),
            unit: unit.clone(),
            protect,
            needs_values: self.needs_values,
            needs_inputs: self.needs_inputs,
            layer: layer.layer,
            own: None,
            held: Vec::new(),
            unforked: None,
        };
        Python::attach(|py| state.start_own(py))
            .map_err(|err| state.failed(&format!("start() {}", python_failure(&err))))?;
        Ok(Box::new(state))
    }
}

/// One cache's state: what it is and, for an object with `start()`, the Python state it made.
struct State {
    shared: Arc<PyMethod>,
    unit: Unit,
    protect: Protection,
    needs_values: bool,
    needs_inputs: bool,
    /// The layer's index, naming where a call failed.
    layer: usize,
    own: Option<OwnState>,
    /// The cache's positions in insertion order, kept for a state's `evict(positions)`.
    held: Vec<usize>,
    /// Why this fork of a stream could not copy its Python state: every call returns it.
    unforked: Option<MethodFailed>,
}

/// The Python state of one cache and which of the optional calls it answers.
struct OwnState {
    object: Py<PyAny>,
    appends: bool,
    evicts: bool,
}

impl Clone for State {
    /// Forks the stream: the Python state is deep-copied (a failure to copy is the fork's, which
    /// every call of it then returns).
    fn clone(&self) -> Self {
        let mut unforked = self.unforked.clone();
        let own = self.own.as_ref().and_then(|own| {
            Python::attach(|py| {
                let copied = py
                    .import("copy")
                    .and_then(|copy| copy.call_method1("deepcopy", (own.object.bind(py),)));
                match copied {
                    Ok(object) => Some(OwnState {
                        object: object.unbind(),
                        ..*own
                    }),
                    Err(err) => {
                        unforked = Some(self.failed(&format!(
                            "could not be forked: copy.deepcopy {}",
                            python_failure(&err)
                        )));
                        None
                    }
                }
            })
        });
        Self {
            shared: self.shared.clone(),
            unit: self.unit.clone(),
            protect: self.protect,
            needs_values: self.needs_values,
            needs_inputs: self.needs_inputs,
            layer: self.layer,
            own,
            held: self.held.clone(),
            unforked,
        }
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        self.forked()?;
        let Some(own) = &self.own else {
            return Ok(());
        };
        let position = *cache.last().expect("a token was appended");
        if own.evicts {
            self.held.push(position);
        }
        if !own.appends {
            return Ok(());
        }
        Python::attach(|py| {
            let token = self.token(py, layer, position);
            own.object.bind(py).call_method1("append", (token,))?;
            PyResult::Ok(())
        })
        .map_err(|err| self.failed(&format!("append() {}", python_failure(&err))))
    }

    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        self.forked()?;
        *out = Python::attach(|py| self.call(py, layer, cache))
            .map_err(|failure| self.failed(&failure))?;
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        self.forked()?;
        if self.own.as_ref().is_some_and(|own| own.evicts) {
            let position = self.held.remove(index);
            self.evict(&[position])?;
        }
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        self.forked()?;
        if self.own.as_ref().is_some_and(|own| own.evicts) {
            let mut marks = kept.iter();
            let (stay, gone): (Vec<usize>, Vec<usize>) = self
                .held
                .iter()
                .partition(|_| *marks.next().expect("one mark per entry"));
            self.held = stay;
            self.evict(&gone)?;
        }
        Ok(())
    }
}

impl State {
    /// Asks an object with `start()` for this cache's own state.
    fn start_own(&mut self, py: Python<'_>) -> PyResult<()> {
        let object = self.shared.object.bind(py);
        if object.getattr_opt("start")?.is_none() {
            return Ok(());
        }
        let own = object.call_method0("start")?;
        if own.getattr_opt("score")?.is_none() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "it returned a state without a `score(cache)` method",
            ));
        }
        self.own = Some(OwnState {
            appends: own.getattr_opt("append")?.is_some(),
            evicts: own.getattr_opt("evict")?.is_some(),
            object: own.unbind(),
        });
        Ok(())
    }

    /// The failure of a call of this cache's, naming the scorer and the cache.
    fn failed(&self, failure: &str) -> MethodFailed {
        MethodFailed(format!(
            "Python scorer `{}` at layer {}, cache {}: {failure}",
            self.shared.name, self.layer, self.unit.index
        ))
    }

    /// Whether this state could be forked: a fork that could not copy its Python state fails.
    fn forked(&self) -> Scored {
        self.unforked.clone().map_or(Ok(()), Err)
    }

    /// Tells the Python state that `positions` left the cache.
    fn evict(&self, positions: &[usize]) -> Scored {
        let Some(own) = self.own.as_ref() else {
            return Ok(());
        };
        Python::attach(|py| {
            let gone: Array1<i64> = positions.iter().map(|&p| p as i64).collect();
            own.object
                .bind(py)
                .call_method1("evict", (gone.into_pyarray(py),))
                .map(drop)
        })
        .map_err(|err| self.failed(&format!("evict() {}", python_failure(&err))))
    }

    /// The token at `position` as `append` sees it.
    fn token(&self, py: Python<'_>, layer: &LayerContext<'_>, position: usize) -> Token {
        let kv = self.unit.kv_head;
        let queries = layer
            .q
            .slice(s![self.unit.query_heads.clone(), position, ..]);
        let value = match (self.needs_values, layer.v) {
            (true, Some(v)) => v
                .slice(s![kv, position, ..])
                .to_owned()
                .into_pyarray(py)
                .into_any()
                .unbind(),
            _ => py.None(),
        };
        Token {
            position,
            queries: queries.to_owned().into_pyarray(py).into_any().unbind(),
            key: layer
                .k
                .slice(s![kv, position, ..])
                .to_owned()
                .into_pyarray(py)
                .into_any()
                .unbind(),
            value,
            layer: layer.layer,
            kv_head: kv,
            scale: layer.scale,
            softcap: layer.softcap,
        }
    }

    /// Calls the object (or its state) on this cache and checks what it returns.
    fn call(
        &self,
        py: Python<'_>,
        layer: &LayerContext<'_>,
        cache: &[usize],
    ) -> Result<Vec<f32>, String> {
        let view = self.view(py, layer, cache).map_err(|e| e.to_string())?;
        let object = match &self.own {
            Some(own) => own.object.bind(py),
            None => self.shared.object.bind(py),
        };
        let returned = match object.getattr_opt("score").map_err(|e| e.to_string())? {
            Some(score) => score.call1((view,)),
            None => object.call1((view,)),
        }
        .map_err(|err| python_failure(&err))?;
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

/// The hidden states at `0..=newest` and a dict of the projections' weights and biases (and the
/// per-head q/k norms' weights and ε, where the model has them).
fn inputs_of(
    py: Python<'_>,
    inputs: &LayerInputs,
    newest: usize,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let hidden = inputs.hidden.slice(s![..=newest, ..]).to_owned();
    let projections = PyDict::new(py);
    for (name, projection) in PROJECTIONS.iter().zip(&inputs.weights.projections) {
        let weight = projection.weight.clone().into_pyarray(py);
        projections.set_item(format!("{name}.weight"), weight)?;
        if let Some(bias) = &projection.bias {
            projections.set_item(format!("{name}.bias"), bias.clone().into_pyarray(py))?;
        }
    }
    if let Some(norms) = &inputs.weights.qk_norms {
        for (name, weight) in QK_NORMS.iter().zip([&norms.q, &norms.k]) {
            projections.set_item(format!("{name}.weight"), weight.clone().into_pyarray(py))?;
        }
        projections.set_item(QK_NORM_EPS, norms.eps)?;
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
