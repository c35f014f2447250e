//! `kvreplay.Trace`: an open trace, its header, and each layer's q, k and v as NumPy arrays that
//! view the mapped file (no copy: F16 and F32 stay as stored; BF16, which NumPy has no type for,
//! is widened to a float32 copy); or a trace built from NumPy arrays, held in memory
//! (`Trace.from_arrays`), which every function takes as it takes a file.

use crate::errors::{message, raised};
use kvreplay::experiment::TraceFile;
use kvreplay::trace::{StorageDtype, TensorLocation, TraceMeta, TraceReader, TraceWriter};
use memmap2::Mmap;
use ndarray::{ArrayView, IxDyn};
use numpy::{IntoPyArray, PyArrayDyn, PyReadonlyArray3};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// An open, validated kvtrace/1 trace: a file, or bytes in memory.
#[pyclass(frozen, module = "kvreplay")]
pub struct Trace {
    reader: TraceReader,
    /// The trace's bytes, which its arrays view.
    held: Held,
    /// The trace's identity (content sha256), computed once when a result needs run ids.
    identity: OnceLock<TraceFile>,
}

/// A trace's bytes: a file mapped read-only (pages are read only when an array's elements are),
/// or bytes in memory.
enum Held {
    Map(Mmap),
    Memory(Arc<Vec<u8>>),
}

impl Held {
    fn bytes(&self) -> &[u8] {
        match self {
            Held::Map(map) => map,
            Held::Memory(bytes) => bytes,
        }
    }
}

/// What a trace built from arrays is called where a file's path would be.
const FROM_ARRAYS: &str = "<arrays>";

impl Trace {
    pub fn reader(&self) -> &TraceReader {
        &self.reader
    }

    /// The file identified by its content, as a sweep identifies it (run ids name it).
    pub fn identity(&self, py: Python<'_>) -> PyResult<&TraceFile> {
        if let Some(identity) = self.identity.get() {
            return Ok(identity);
        }
        let path = self.reader.path().to_owned();
        let identity = match &self.held {
            Held::Map(_) => py.detach(|| TraceFile::identify(&path)).map_err(raised)?,
            Held::Memory(bytes) => py.detach(|| TraceFile::of_bytes(&path, bytes)),
        };
        Ok(self.identity.get_or_init(|| identity))
    }

    /// A trace given as a `Trace` or as a path.
    pub fn from_arg(trace: &Bound<'_, PyAny>) -> PyResult<Py<Trace>> {
        match trace.extract::<Py<Trace>>() {
            Ok(open) => Ok(open),
            Err(_) => {
                let path: PathBuf = trace.extract()?;
                Py::new(trace.py(), Trace::open_path(path)?)
            }
        }
    }

    pub fn open_path(path: PathBuf) -> PyResult<Self> {
        let reader = TraceReader::open(&path).map_err(raised)?;
        let file = std::fs::File::open(&path)
            .map_err(|e| message(format!("{}: cannot open: {e}", path.display())))?;
        // SAFETY: the file is mapped read-only; a trace is written once (to a temporary name,
        // then renamed), so the mapped bytes do not change under the arrays that view them.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| message(format!("{}: cannot map: {e}", path.display())))?;
        Ok(Self {
            reader,
            held: Held::Map(map),
            identity: OnceLock::new(),
        })
    }

    /// Tensor `name` of layer `layer` as an array viewing the map (owned by `this`).
    fn tensor<'py>(
        this: &Bound<'py, Self>,
        layer: usize,
        name: &str,
        dtype: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let trace = this.get();
        let location = trace.reader.layer_location(layer, name).map_err(raised)?;
        let array = view(this, &location)?;
        match dtype {
            None => Ok(array),
            Some(dtype) => array.call_method1("astype", (dtype,)),
        }
    }
}

/// Each array of `given` (argument `name`, one per layer) as float32 `[heads, T, head_dim]`.
fn f32_arrays(name: &str, given: &[Bound<'_, PyAny>]) -> PyResult<Vec<ndarray::Array3<f32>>> {
    let numpy = given
        .first()
        .map(|first| first.py().import("numpy"))
        .transpose()?;
    given
        .iter()
        .enumerate()
        .map(|(layer, array)| {
            let numpy = numpy.as_ref().expect("a first array");
            let converted = numpy.call_method1("asarray", (array, "float32"))?;
            let array: PyReadonlyArray3<f32> = converted.extract().map_err(|_| {
                message(format!(
                    "{name}[{layer}]: must be a 3-D array [heads, T, head_dim]"
                ))
            })?;
            Ok(array.as_array().to_owned())
        })
        .collect()
}

/// The array at `location` of `this`'s bytes: a view for F16 and F32, a float32 copy for BF16.
fn view<'py>(this: &Bound<'py, Trace>, location: &TensorLocation) -> PyResult<Bound<'py, PyAny>> {
    let bytes = &this.get().held.bytes()[location.bytes.clone()];
    let shape = IxDyn(&location.shape);
    let py = this.py();
    macro_rules! borrowed {
        ($element:ty) => {{
            let width = std::mem::size_of::<$element>();
            if bytes.as_ptr() as usize % width != 0 {
                return Err(message(format!(
                    "{}: tensor data not aligned to its element size",
                    this.get().reader.path().display()
                )));
            }
            // SAFETY: the bytes are `shape`'s elements, little-endian (checked at open), aligned
            // (checked above) and alive as long as the map, which `this` owns and the array keeps
            // alive as its base; NumPy sees them read-only.
            let view =
                unsafe { ArrayView::from_shape_ptr(shape, bytes.as_ptr().cast::<$element>()) };
            let array = unsafe {
                PyArrayDyn::<$element>::borrow_from_array(&view, this.clone().into_any())
            };
            array.call_method1("setflags", (false,))?;
            Ok(array.into_any())
        }};
    }
    match location.dtype.as_str() {
        "F16" => borrowed!(half::f16),
        "F32" => borrowed!(f32),
        "BF16" => {
            let values: Vec<f32> = bytes
                .chunks_exact(2)
                .map(|pair| half::bf16::from_le_bytes([pair[0], pair[1]]).to_f32())
                .collect();
            let array = ndarray::ArrayD::from_shape_vec(shape, values)
                .map_err(|e| message(e.to_string()))?;
            Ok(array.into_pyarray(py).into_any())
        }
        other => Err(message(format!("a q, k or v tensor of dtype {other}"))),
    }
}

#[pymethods]
impl Trace {
    /// Opens and validates a trace (the same checks as the command line).
    #[new]
    fn py_new(path: PathBuf) -> PyResult<Self> {
        Self::open_path(path)
    }

    /// A trace of NumPy arrays, held in memory: per layer queries `q[l]` `[n_heads, T, head_dim]`,
    /// post-rotary keys `k[l]` and values `v[l]` `[n_kv_heads, T, head_dim]` (any float dtype),
    /// positions `[0, prompt_len)` the prompt. Stored as `dtype` (`f16`, `bf16` or `f32`) and
    /// checked as a file is; `tokens` (zeros when not given) and the header's other keys as
    /// `kvreplay capture` writes them.
    #[staticmethod]
    #[pyo3(signature = (q, k, v=None, *, prompt_len, tokens=None, model="arrays", scale=None, softcap=None, rope_theta=None, layer_windows=None, dtype="f32"))]
    #[allow(clippy::too_many_arguments)]
    fn from_arrays(
        py: Python<'_>,
        q: Vec<Bound<'_, PyAny>>,
        k: Vec<Bound<'_, PyAny>>,
        v: Option<Vec<Bound<'_, PyAny>>>,
        prompt_len: usize,
        tokens: Option<Vec<i64>>,
        model: &str,
        scale: Option<f32>,
        softcap: Option<f32>,
        rope_theta: Option<f32>,
        layer_windows: Option<Vec<usize>>,
        dtype: &str,
    ) -> PyResult<Self> {
        let storage = StorageDtype::parse(dtype).map_err(message)?;
        let (q, k) = (f32_arrays("q", &q)?, f32_arrays("k", &k)?);
        let v = v.map(|v| f32_arrays("v", &v)).transpose()?;
        let (Some(first_q), Some(first_k)) = (q.first(), k.first()) else {
            return Err(message("q and k: give at least one layer"));
        };
        let (n_heads, n_positions, head_dim) = first_q.dim();
        let meta = TraceMeta {
            model: model.to_owned(),
            n_layers: q.len(),
            n_heads,
            n_kv_heads: first_k.dim().0,
            head_dim,
            prompt_len,
            scale: scale.unwrap_or(1.0 / (head_dim as f32).sqrt()),
            softcap,
            rope_theta,
            rope_thetas: Vec::new(),
            windows: layer_windows.unwrap_or_default(),
            spans: Vec::new(),
            extra: Default::default(),
        };
        let tokens = tokens.unwrap_or_else(|| vec![0; n_positions]);
        let mut writer = TraceWriter::new(meta, storage, tokens);
        let mut values = v.map(Vec::into_iter);
        for (q, k) in q.into_iter().zip(k) {
            writer.push_layer(q, k, values.as_mut().and_then(Iterator::next));
        }
        let label = Path::new(FROM_ARRAYS);
        let bytes = Arc::new(py.detach(|| writer.to_bytes(label)).map_err(raised)?);
        let reader = TraceReader::from_bytes(label, bytes.clone()).map_err(raised)?;
        Ok(Self {
            reader,
            held: Held::Memory(bytes),
            identity: OnceLock::new(),
        })
    }

    /// The file (`<arrays>` for a trace built from arrays).
    #[getter]
    fn path(&self) -> PathBuf {
        self.reader.path().to_owned()
    }

    /// Every key of the header, as stored (strings).
    #[getter]
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (key, value) in self.reader.meta().to_header() {
            dict.set_item(key, value)?;
        }
        Ok(dict)
    }

    /// The model id the header gives.
    #[getter]
    fn model(&self) -> String {
        self.reader.meta().model.clone()
    }

    #[getter]
    fn n_layers(&self) -> usize {
        self.reader.meta().n_layers
    }

    #[getter]
    fn n_heads(&self) -> usize {
        self.reader.meta().n_heads
    }

    #[getter]
    fn n_kv_heads(&self) -> usize {
        self.reader.meta().n_kv_heads
    }

    #[getter]
    fn head_dim(&self) -> usize {
        self.reader.meta().head_dim
    }

    /// Positions `[0, prompt_len)` are the prompt.
    #[getter]
    fn prompt_len(&self) -> usize {
        self.reader.meta().prompt_len
    }

    /// Prompt and generated positions together.
    #[getter]
    fn n_positions(&self) -> usize {
        self.reader.n_positions()
    }

    /// The softmax scale.
    #[getter]
    fn scale(&self) -> f32 {
        self.reader.meta().scale
    }

    /// The attention logit soft-cap, if any.
    #[getter]
    fn softcap(&self) -> Option<f32> {
        self.reader.meta().softcap
    }

    /// The rotary base of each layer (None where the header does not say).
    #[getter]
    fn rope_thetas(&self) -> Vec<Option<f32>> {
        let meta = self.reader.meta();
        (0..meta.n_layers).map(|l| meta.rope_theta_of(l)).collect()
    }

    /// Each layer's attention window (0: global attention).
    #[getter]
    fn layer_windows(&self) -> Vec<usize> {
        let meta = self.reader.meta();
        (0..meta.n_layers).map(|l| meta.window(l)).collect()
    }

    /// The layers a policy compresses by default (the global ones).
    #[getter]
    fn global_layers(&self) -> Vec<usize> {
        self.reader.meta().global_layers()
    }

    /// Named spans as `(name, start, end)`, end exclusive.
    #[getter]
    fn spans(&self) -> Vec<(String, usize, usize)> {
        self.reader
            .meta()
            .spans
            .iter()
            .map(|s| (s.name.clone(), s.start, s.end))
            .collect()
    }

    /// `F16`, `BF16` or `F32`.
    #[getter]
    fn dtype(&self) -> String {
        self.reader.storage_dtype()
    }

    /// Whether the trace stores values.
    #[getter]
    fn has_values(&self) -> bool {
        self.reader.has_values()
    }

    /// Whether the trace holds each layer's attention inputs (hidden states and projections).
    #[getter]
    fn has_inputs(&self) -> bool {
        self.reader.has_inputs()
    }

    /// KVzip's reconstruction pass, when the trace records one: each chunk's `(start, end, rows)`,
    /// the context span it repeats and its rows (None without one).
    #[getter]
    fn reconstruction(&self) -> Option<Vec<(usize, usize, usize)>> {
        let pass = self.reader.reconstruction()?;
        let chunks = pass.chunks.iter();
        Some(
            chunks
                .map(|c| (c.context.start, c.context.end, c.rows))
                .collect(),
        )
    }

    /// The token ids (int64).
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let tokens = self.reader.tokens().map_err(raised)?;
        Ok(tokens.into_pyarray(py).into_any())
    }

    /// The prompt's text, when the header keeps it.
    #[getter]
    fn text(&self) -> Option<String> {
        self.reader.meta().extra.get("prompt_text").cloned()
    }

    /// Queries of layer `layer`, `[n_heads, T, head_dim]`, a read-only view of the file
    /// (`dtype="float32"` converts).
    #[pyo3(signature = (layer, dtype=None))]
    fn q<'py>(
        this: &Bound<'py, Self>,
        layer: usize,
        dtype: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::tensor(this, layer, "q", dtype)
    }

    /// Keys of layer `layer`, `[n_kv_heads, T, head_dim]`, post-rotary.
    #[pyo3(signature = (layer, dtype=None))]
    fn k<'py>(
        this: &Bound<'py, Self>,
        layer: usize,
        dtype: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::tensor(this, layer, "k", dtype)
    }

    /// Values of layer `layer`, `[n_kv_heads, T, head_dim]`, when the trace has them.
    #[pyo3(signature = (layer, dtype=None))]
    fn v<'py>(
        this: &Bound<'py, Self>,
        layer: usize,
        dtype: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::tensor(this, layer, "v", dtype)
    }

    fn __repr__(&self) -> String {
        let meta = self.reader.meta();
        format!(
            "Trace({:?}: {}, {} layers, {} + {} positions)",
            self.reader.path().display().to_string(),
            meta.model,
            meta.n_layers,
            meta.prompt_len,
            self.reader.n_positions() - meta.prompt_len
        )
    }
}
