//! Writes kvtrace/1 files. The file appears atomically (written beside the target, then renamed),
//! so an interrupted capture never leaves a half-written trace under the final name. Layers come
//! from memory or from a source asked for one layer at a time while the file is written, so a
//! long capture never holds more than a layer of the trace.

use super::{
    LayerInputs, Reconstruction, TraceError, TraceMeta, PROJECTIONS, QK_NORMS, QK_NORM_EPS,
};
use ndarray::Array3;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::path::Path;

/// One layer's q `[n_heads, T, d]`, k and optional v `[n_kv_heads, T, d]`.
pub type LayerArrays = (Array3<f32>, Array3<f32>, Option<Array3<f32>>);

/// One layer's reconstruction rows: queries `[n_heads, rows, d]` and keys `[n_kv_heads, rows, d]`.
pub type PassRows = (Array3<f32>, Array3<f32>);

/// Gives layer `l`'s arrays when the writer reaches it, or says why it cannot.
pub type LayerSource<'a> = &'a dyn Fn(usize) -> Result<LayerArrays, String>;

/// A trace's attention inputs for the writer (`docs/trace-format.md`, "Attention inputs"): their
/// shape, and each layer's when the writer reaches it. The hidden states are stored in the
/// trace's dtype, the projections in F32.
pub struct InputsSource<'a> {
    /// The model width.
    pub d_model: usize,
    /// Which of `q_proj`, `k_proj`, `v_proj`, `o_proj` have a bias.
    pub biases: [bool; 4],
    /// The ε of the per-head q/k norms every layer then has, where the model has them.
    pub qk_norm_eps: Option<f32>,
    /// Layer `l`'s inputs, or why they cannot be given.
    pub layer: &'a dyn Fn(usize) -> Result<LayerInputs, String>,
}

/// A trace's reconstruction pass for the writer (`docs/trace-format.md`, "Reconstruction pass"):
/// its chunks (written into the header), its token ids, and each layer's queries
/// `[n_heads, rows, d]` and keys `[n_kv_heads, rows, d]` when the writer reaches it, stored in the
/// trace's dtype.
pub struct ReconstructionSource<'a> {
    /// The chunks.
    pub pass: Reconstruction,
    /// The token ids of every chunk's rows, one chunk after another.
    pub tokens: Vec<i64>,
    /// Layer `l`'s queries and keys, or why they cannot be given.
    pub layer: &'a dyn Fn(usize) -> Result<PassRows, String>,
}

/// What a trace holds beyond its q, k and v, when asked.
#[derive(Default, Clone, Copy)]
pub struct Extras<'a> {
    /// Each layer's attention inputs.
    pub inputs: Option<&'a InputsSource<'a>>,
    /// KVzip's reconstruction pass.
    pub reconstruction: Option<&'a ReconstructionSource<'a>>,
}

/// Slots of one layer's encoded tensors: q, k, v, the attention input, then each projection's
/// weight and bias in [`PROJECTIONS`]' order, the q/k norms, then the reconstruction pass's q
/// and k.
const INPUT: usize = 3;
const WEIGHTS: usize = 4;
const BIASES: usize = WEIGHTS + PROJECTIONS.len();
const NORMS: usize = BIASES + PROJECTIONS.len();
const RECONSTRUCTION: usize = NORMS + QK_NORMS.len();
const SLOTS: usize = RECONSTRUCTION + 2;

/// How q, k and v are stored on disk. All arithmetic is f32 whatever the storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageDtype {
    /// IEEE half precision (default: half the size; the captured model's |q|, |k| stay far below 65504).
    #[default]
    F16,
    /// bfloat16.
    Bf16,
    /// Single precision: bit-exact round trip.
    F32,
}

impl StorageDtype {
    /// Every storage, in listing order, with what it is: the command line's `--dtype` values.
    pub const ALL: [(StorageDtype, &'static str, &'static str); 3] = [
        (
            Self::F16,
            "f16",
            "IEEE half precision (default: half the size; the captured model's |q|, |k| stay far below 65504)",
        ),
        (Self::Bf16, "bf16", "bfloat16"),
        (Self::F32, "f32", "Single precision: bit-exact round trip"),
    ];

    /// The storage called `name` (`f16`, `bf16`, `f32`), or an error listing them.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .iter()
            .find(|(_, known, _)| *known == name)
            .map(|(storage, _, _)| *storage)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|(_, known, _)| *known).collect();
                format!("dtype `{name}`: valid: {}", known.join(", "))
            })
    }
}

impl StorageDtype {
    /// Bytes of one element.
    pub fn element_bytes(self) -> usize {
        self.dtype().bitsize() / 8
    }

    fn dtype(self) -> Dtype {
        match self {
            Self::F16 => Dtype::F16,
            Self::Bf16 => Dtype::BF16,
            Self::F32 => Dtype::F32,
        }
    }

    /// The values' little-endian bytes in this dtype, in the array's logical order, converted
    /// in blocks on worker threads.
    fn encode<D: ndarray::Dimension>(self, values: &ndarray::Array<f32, D>) -> Vec<u8> {
        let values: Cow<'_, [f32]> = match values.as_slice() {
            Some(values) => Cow::Borrowed(values),
            None => Cow::Owned(values.iter().copied().collect()),
        };
        let width = self.element_bytes();
        let mut bytes = vec![0u8; values.len() * width];
        bytes
            .par_chunks_mut(ENCODE_BLOCK * width)
            .zip(values.par_chunks(ENCODE_BLOCK))
            .for_each(|(bytes, values)| {
                let slots = bytes.chunks_exact_mut(width).zip(values);
                match self {
                    Self::F16 => slots.for_each(|(slot, v)| {
                        slot.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes())
                    }),
                    Self::Bf16 => slots.for_each(|(slot, v)| {
                        slot.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes())
                    }),
                    Self::F32 => slots.for_each(|(slot, v)| slot.copy_from_slice(&v.to_le_bytes())),
                }
            });
        bytes
    }
}

/// Values converted together by one worker.
const ENCODE_BLOCK: usize = 1 << 16;

/// Collects a trace's tensors and writes them as one kvtrace/1 file.
#[derive(Debug)]
pub struct TraceWriter {
    meta: TraceMeta,
    storage: StorageDtype,
    tokens: Vec<i64>,
    layers: Vec<LayerArrays>,
    /// The reconstruction pass, its token ids and each layer's queries and keys.
    reconstruction: Option<(Reconstruction, Vec<i64>, Vec<PassRows>)>,
    /// Each layer's attention inputs.
    inputs: Vec<LayerInputs>,
}

impl TraceWriter {
    /// A writer for a trace with this header and these tokens.
    pub fn new(meta: TraceMeta, storage: StorageDtype, tokens: Vec<i64>) -> Self {
        Self {
            meta,
            storage,
            tokens,
            layers: Vec::new(),
            reconstruction: None,
            inputs: Vec::new(),
        }
    }

    /// Adds every layer's attention inputs (hidden states `[T, d_model]` and the four
    /// projections, biases as the first layer has them).
    pub fn with_inputs(mut self, layers: Vec<LayerInputs>) -> Self {
        self.inputs = layers;
        self
    }

    /// Adds a reconstruction pass: its chunks, token ids, and per layer its queries
    /// `[n_heads, rows, d]` and keys `[n_kv_heads, rows, d]`.
    pub fn with_reconstruction(
        mut self,
        pass: Reconstruction,
        tokens: Vec<i64>,
        layers: Vec<PassRows>,
    ) -> Self {
        self.reconstruction = Some((pass, tokens, layers));
        self
    }

    /// Adds the next layer's q `[n_heads, T, d]`, k and optional v `[n_kv_heads, T, d]`.
    pub fn push_layer(&mut self, q: Array3<f32>, k: Array3<f32>, v: Option<Array3<f32>>) {
        self.layers.push((q, k, v));
    }

    /// Checks the collected data against the contract and writes the file atomically.
    pub fn write(&self, path: &Path) -> Result<(), TraceError> {
        let written = self.build(Destination::File(path))?;
        debug_assert!(written.is_none(), "a file was written");
        Ok(())
    }

    /// Checks the collected data against the contract and gives the bytes [`write`](Self::write)
    /// would write, `label` naming them in errors: for a
    /// [`TraceReader::from_bytes`](super::TraceReader::from_bytes).
    pub fn to_bytes(&self, label: &Path) -> Result<Vec<u8>, TraceError> {
        let built = self.build(Destination::Memory(label))?;
        Ok(built.expect("bytes in memory"))
    }

    /// Checks the collected data and builds the trace at `destination`.
    fn build(&self, destination: Destination<'_>) -> Result<Option<Vec<u8>>, TraceError> {
        let path = destination.path();
        if self.layers.len() != self.meta.n_layers {
            return Err(TraceError::Write {
                path: path.to_owned(),
                detail: format!(
                    "{} layers collected, header says n_layers = {}",
                    self.layers.len(),
                    self.meta.n_layers
                ),
            });
        }
        let values = self.layers.iter().filter(|(_, _, v)| v.is_some()).count();
        if values != 0 && values != self.layers.len() {
            return Err(TraceError::Write {
                path: path.to_owned(),
                detail: format!(
                    "{values} of {} layers have values: either every layer has v or none",
                    self.layers.len()
                ),
            });
        }
        let source = |layer: usize| Ok(self.layers[layer].clone());
        let rows = |layer: usize| {
            let (_, _, layers) = self.reconstruction.as_ref().expect("a pass");
            layers
                .get(layer)
                .cloned()
                .ok_or_else(|| format!("no reconstruction rows for layer {layer}"))
        };
        let reconstruction =
            self.reconstruction
                .as_ref()
                .map(|(pass, tokens, _)| ReconstructionSource {
                    pass: pass.clone(),
                    tokens: tokens.clone(),
                    layer: &rows,
                });
        let given = |layer: usize| {
            self.inputs
                .get(layer)
                .cloned()
                .ok_or_else(|| format!("no attention inputs for layer {layer}"))
        };
        let inputs = self.inputs.first().map(|first| InputsSource {
            d_model: first.hidden.ncols(),
            biases: first
                .weights
                .projections
                .each_ref()
                .map(|p| p.bias.is_some()),
            qk_norm_eps: first.weights.qk_norms.as_ref().map(|norms| norms.eps),
            layer: &given,
        });
        build_trace(
            destination,
            &self.meta,
            self.storage,
            &self.tokens,
            (values != 0, &source),
            Extras {
                inputs: inputs.as_ref(),
                reconstruction: reconstruction.as_ref(),
            },
        )
    }
}

/// Writes a trace whose layers come from `source`, asked for one layer at a time as the file is
/// written (each layer once, in the file's tensor order), checked against the contract; `values`
/// says whether every layer has v; `extras` adds each layer's attention inputs and the
/// reconstruction pass, where given. The file appears atomically.
pub fn write_trace(
    path: &Path,
    meta: &TraceMeta,
    storage: StorageDtype,
    tokens: &[i64],
    layers: (bool, LayerSource<'_>),
    extras: Extras<'_>,
) -> Result<(), TraceError> {
    let written = build_trace(
        Destination::File(path),
        meta,
        storage,
        tokens,
        layers,
        extras,
    )?;
    debug_assert!(written.is_none(), "a file was written");
    Ok(())
}

/// The bytes of the trace [`write_trace`] would write (the same bytes), kept in memory, where
/// `label` names it in errors: for a [`TraceReader::from_bytes`](super::TraceReader::from_bytes).
pub fn trace_bytes(
    label: &Path,
    meta: &TraceMeta,
    storage: StorageDtype,
    tokens: &[i64],
    layers: (bool, LayerSource<'_>),
    extras: Extras<'_>,
) -> Result<Vec<u8>, TraceError> {
    let built = build_trace(
        Destination::Memory(label),
        meta,
        storage,
        tokens,
        layers,
        extras,
    )?;
    Ok(built.expect("bytes in memory"))
}

/// Where a trace goes: a file, or bytes in memory named by a label.
#[derive(Clone, Copy)]
enum Destination<'p> {
    File(&'p Path),
    Memory(&'p Path),
}

impl Destination<'_> {
    /// The file, or the label: what errors name.
    fn path(&self) -> &Path {
        match self {
            Destination::File(path) | Destination::Memory(path) => path,
        }
    }
}

/// Checks a trace against the contract and writes it to `destination`: the file (`None`), or
/// its bytes.
fn build_trace(
    destination: Destination<'_>,
    meta: &TraceMeta,
    storage: StorageDtype,
    tokens: &[i64],
    (values, source): (bool, LayerSource<'_>),
    extras: Extras<'_>,
) -> Result<Option<Vec<u8>>, TraceError> {
    let path = destination.path();
    let fail = |detail: String| TraceError::Write {
        path: path.to_owned(),
        detail,
    };
    let n_positions = tokens.len();
    meta.check_positions(path, n_positions)?;
    let Extras {
        inputs,
        reconstruction,
    } = extras;
    let mut meta = meta.clone();
    if let Some(eps) = inputs.and_then(|inputs| inputs.qk_norm_eps) {
        meta.extra.insert(QK_NORM_EPS.into(), format!("{eps:e}"));
    }
    if let Some(source) = reconstruction {
        if source.tokens.len() != source.pass.rows() {
            return Err(fail(format!(
                "the reconstruction pass has {} token ids for {} rows",
                source.tokens.len(),
                source.pass.rows()
            )));
        }
        meta.extra.insert(
            super::reconstruction::HEADER_KEY.into(),
            source.pass.header_value(),
        );
    }
    let meta = &meta;
    let loader = LayerLoader {
        meta,
        storage,
        n_positions,
        source,
        values,
        inputs,
        reconstruction,
        current: RefCell::new(None),
        error: RefCell::new(None),
    };
    let ids = |tokens: &[i64]| Tensor::Tokens {
        bytes: tokens.iter().flat_map(|t| t.to_le_bytes()).collect(),
        shape: vec![tokens.len()],
    };
    let mut tensors = vec![("tokens".to_string(), ids(tokens))];
    if let Some(source) = reconstruction {
        let name = super::reconstruction::TOKENS.to_string();
        tensors.push((name, ids(&source.tokens)));
    }
    for layer in 0..meta.n_layers {
        let kinds: &[(usize, &str, usize)] = if values {
            &[
                (0, "q", meta.n_heads),
                (1, "k", meta.n_kv_heads),
                (2, "v", meta.n_kv_heads),
            ]
        } else {
            &[(0, "q", meta.n_heads), (1, "k", meta.n_kv_heads)]
        };
        let mut layer_tensors: Vec<(usize, String, Vec<usize>, StorageDtype)> = kinds
            .iter()
            .map(|&(kind, name, heads)| {
                let shape = vec![heads, n_positions, meta.head_dim];
                (kind, name.to_string(), shape, storage)
            })
            .collect();
        if let Some(inputs) = inputs {
            layer_tensors.extend(input_tensors(meta, n_positions, inputs, storage));
        }
        if let Some(source) = reconstruction {
            layer_tensors.extend(reconstruction_tensors(meta, source, storage));
        }
        for (kind, name, shape, dtype) in layer_tensors {
            tensors.push((
                format!("layers.{layer}.{name}"),
                Tensor::Layer(Lazy {
                    loader: &loader,
                    dtype: dtype.dtype(),
                    len: shape.iter().product::<usize>() * dtype.element_bytes(),
                    shape,
                    layer,
                    kind,
                }),
            ));
        }
    }
    let views = || tensors.iter().map(|(name, tensor)| (name.clone(), tensor));
    let loaded = || match loader.error.borrow().clone() {
        Some(detail) => Err(std::io::Error::other(detail)),
        None => Ok(()),
    };
    match destination {
        Destination::File(path) => crate::atomic::write_with(path, |partial| {
            // safetensors writes through a temporary file of its own, created with mode 0600:
            // the trace gets the mode any new file gets here (0644 under the usual umask), like
            // the tool's other outputs, so it can be shared.
            let permissions = std::fs::File::create(partial)?.metadata()?.permissions();
            safetensors::serialize_to_file(views(), Some(meta.to_header()), partial)
                .map_err(std::io::Error::other)?;
            loaded()?;
            sort_header(partial)?;
            std::fs::set_permissions(partial, permissions)
        })
        .map(|()| None),
        Destination::Memory(_) => (|| {
            let mut bytes = safetensors::serialize(views(), Some(meta.to_header()))
                .map_err(std::io::Error::other)?;
            loaded()?;
            sort_header_of(&mut bytes)?;
            Ok(Some(bytes))
        })(),
    }
    .map_err(|err: std::io::Error| fail(err.to_string()))
}

/// The attention-input tensors of one layer: slot, name, shape and dtype.
fn input_tensors(
    meta: &TraceMeta,
    n_positions: usize,
    inputs: &InputsSource<'_>,
    storage: StorageDtype,
) -> Vec<(usize, String, Vec<usize>, StorageDtype)> {
    let d = inputs.d_model;
    let shapes = super::inputs::projection_shapes(meta, d);
    let mut found = vec![(INPUT, "input".to_string(), vec![n_positions, d], storage)];
    for (index, (name, shape)) in PROJECTIONS.iter().zip(shapes).enumerate() {
        let weight = format!("{name}.weight");
        found.push((WEIGHTS + index, weight, shape.to_vec(), StorageDtype::F32));
        if inputs.biases[index] {
            let bias = format!("{name}.bias");
            found.push((BIASES + index, bias, vec![shape[0]], StorageDtype::F32));
        }
    }
    if inputs.qk_norm_eps.is_some() {
        for (index, name) in QK_NORMS.iter().enumerate() {
            let weight = format!("{name}.weight");
            found.push((
                NORMS + index,
                weight,
                vec![meta.head_dim],
                StorageDtype::F32,
            ));
        }
    }
    found
}

/// The reconstruction tensors of one layer: slot, name, shape and dtype.
fn reconstruction_tensors(
    meta: &TraceMeta,
    source: &ReconstructionSource<'_>,
    storage: StorageDtype,
) -> [(usize, String, Vec<usize>, StorageDtype); 2] {
    let rows = source.pass.rows();
    let key = super::reconstruction::HEADER_KEY;
    [
        (
            RECONSTRUCTION,
            format!("{key}.q"),
            vec![meta.n_heads, rows, meta.head_dim],
            storage,
        ),
        (
            RECONSTRUCTION + 1,
            format!("{key}.k"),
            vec![meta.n_kv_heads, rows, meta.head_dim],
            storage,
        ),
    ]
}

/// Rewrites the header of the safetensors file at `path` with its keys in sorted order, so that
/// one trace is always the same bytes: safetensors writes the metadata in the order of a
/// randomly seeded hash map, different in every capture. The sorted header is as long as the
/// written one (the same compact JSON; the padding to 8 bytes kept), and a header's key order
/// means nothing to a reader (each tensor names its own offsets).
fn sort_header(path: &Path) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let (length, header) = super::read_header(&mut file)?;
    let sorted = sorted_header(length, &header)?;
    file.seek(SeekFrom::Start(8))?;
    file.write_all(&sorted)
}

/// [`sort_header`] of a trace's bytes in memory.
fn sort_header_of(bytes: &mut [u8]) -> std::io::Result<()> {
    let (length, header) = super::read_header(&mut &bytes[..])?;
    let sorted = sorted_header(length, &header)?;
    bytes[8..8 + length].copy_from_slice(&sorted);
    Ok(())
}

/// `header` written with its keys in sorted order, padded with spaces to `length` bytes.
fn sorted_header(length: usize, header: &serde_json::Value) -> std::io::Result<Vec<u8>> {
    let mut sorted = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    if sorted.len() > length {
        return Err(std::io::Error::other(
            "the sorted trace header is longer than the written one",
        ));
    }
    sorted.resize(length, b' ');
    Ok(sorted)
}

/// Asks the source for each layer once, keeps it encoded while its tensors are written, and
/// remembers the first failure (a view cannot return one: it writes zeros and the write fails).
struct LayerLoader<'a> {
    meta: &'a TraceMeta,
    storage: StorageDtype,
    n_positions: usize,
    source: LayerSource<'a>,
    values: bool,
    inputs: Option<&'a InputsSource<'a>>,
    reconstruction: Option<&'a ReconstructionSource<'a>>,
    current: RefCell<Option<(usize, Vec<Vec<u8>>)>>,
    error: RefCell<Option<String>>,
}

impl LayerLoader<'_> {
    fn bytes(&self, layer: usize, kind: usize, len: usize) -> Vec<u8> {
        let mut current = self.current.borrow_mut();
        if current.as_ref().map(|(l, _)| *l) != Some(layer) {
            *current = match self.encoded(layer) {
                Ok(encoded) => Some((layer, encoded)),
                Err(detail) => {
                    self.error.borrow_mut().get_or_insert(detail);
                    None
                }
            };
        }
        match current.as_mut() {
            Some((_, encoded)) if encoded[kind].len() == len => std::mem::take(&mut encoded[kind]),
            _ => vec![0; len],
        }
    }

    fn encoded(&self, layer: usize) -> Result<Vec<Vec<u8>>, String> {
        let meta = self.meta;
        let (q, k, v) = (self.source)(layer)?;
        if v.is_some() != self.values {
            return Err(format!(
                "layer {layer} {} values, the others {}: either every layer has v or none",
                if v.is_some() { "has" } else { "has no" },
                if self.values { "have" } else { "do not" }
            ));
        }
        let mut tensors = vec![("q", q, meta.n_heads), ("k", k, meta.n_kv_heads)];
        if let Some(v) = v {
            tensors.push(("v", v, meta.n_kv_heads));
        }
        let mut encoded: Vec<Vec<u8>> = vec![Vec::new(); SLOTS];
        for (slot, (kind, tensor, heads)) in encoded.iter_mut().zip(tensors) {
            let want = [heads, self.n_positions, meta.head_dim];
            if tensor.shape() != want {
                return Err(format!(
                    "layers.{layer}.{kind} has shape {:?}, expected {want:?}",
                    tensor.shape()
                ));
            }
            *slot = self.storage.encode(&tensor);
        }
        if let Some(inputs) = self.inputs {
            self.encode_inputs(layer, inputs, &mut encoded)?;
        }
        if let Some(source) = self.reconstruction {
            let (q, k) = (source.layer)(layer)?;
            let declared = reconstruction_tensors(meta, source, self.storage);
            for ((slot, name, shape, dtype), tensor) in declared.into_iter().zip([q, k]) {
                if tensor.shape() != shape {
                    return Err(format!(
                        "layers.{layer}.{name} has shape {:?}, expected {shape:?}",
                        tensor.shape()
                    ));
                }
                encoded[slot] = dtype.encode(&tensor);
            }
        }
        Ok(encoded)
    }

    /// Layer `layer`'s attention inputs into their slots, each checked against its declared
    /// shape.
    fn encode_inputs(
        &self,
        layer: usize,
        inputs: &InputsSource<'_>,
        encoded: &mut [Vec<u8>],
    ) -> Result<(), String> {
        let given = (inputs.layer)(layer)?;
        let (projections, norms) = (&given.weights.projections, &given.weights.qk_norms);
        let eps = norms.as_ref().map(|norms| norms.eps);
        if eps != inputs.qk_norm_eps {
            return Err(format!(
                "layer {layer}'s q/k norms (ε {eps:?}) differ from the first layer's (ε {:?}): every layer has the same kind",
                inputs.qk_norm_eps
            ));
        }
        let declared = input_tensors(self.meta, self.n_positions, inputs, self.storage);
        for (slot, name, shape, dtype) in declared {
            let missing = || format!("layers.{layer}.{name} is missing");
            let (found, bytes) = match slot {
                INPUT => (given.hidden.shape().to_vec(), dtype.encode(&given.hidden)),
                _ if slot < BIASES => {
                    let weight = &projections[slot - WEIGHTS].weight;
                    (weight.shape().to_vec(), dtype.encode(weight))
                }
                _ if slot < NORMS => match &projections[slot - BIASES].bias {
                    Some(bias) => (bias.shape().to_vec(), dtype.encode(bias)),
                    None => return Err(missing()),
                },
                _ => {
                    let norms = norms.as_ref().ok_or_else(missing)?;
                    let weight = [&norms.q, &norms.k][slot - NORMS];
                    (weight.shape().to_vec(), dtype.encode(weight))
                }
            };
            if found != shape {
                return Err(format!(
                    "layers.{layer}.{name} has shape {found:?}, expected {shape:?}"
                ));
            }
            encoded[slot] = bytes;
        }
        Ok(())
    }
}

/// A tensor of the file: the tokens, or a layer's q, k or v encoded when the file reaches it.
enum Tensor<'a> {
    Tokens { bytes: Vec<u8>, shape: Vec<usize> },
    Layer(Lazy<'a>),
}

struct Lazy<'a> {
    loader: &'a LayerLoader<'a>,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    layer: usize,
    kind: usize,
}

impl View for &Tensor<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            Tensor::Tokens { .. } => Dtype::I64,
            Tensor::Layer(lazy) => lazy.dtype,
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Tensor::Tokens { shape, .. } => shape,
            Tensor::Layer(lazy) => &lazy.shape,
        }
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            Tensor::Tokens { bytes, .. } => Cow::Borrowed(bytes),
            Tensor::Layer(lazy) => Cow::Owned(lazy.loader.bytes(lazy.layer, lazy.kind, lazy.len)),
        }
    }

    fn data_len(&self) -> usize {
        match self {
            Tensor::Tokens { bytes, .. } => bytes.len(),
            Tensor::Layer(lazy) => lazy.len,
        }
    }
}
