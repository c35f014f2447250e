//! The strict kvtrace/1 reader. Opening a trace checks the container, the header and the name,
//! dtype and shape of every tensor; reading a layer converts it to f32 and checks that every
//! value is finite. Nothing is read into memory before it is asked for.
//!
//! The file is memory-mapped only to validate its header, then unmapped; tensors are read with
//! positioned reads through a small buffer and converted as they arrive. Mapping the data would
//! put the page cache's folios (megabytes at a time on kernels with large folios) into the
//! process's resident memory; read this way, a layer costs its f32 arrays and nothing else,
//! while the file stays in the page cache, shared and reclaimable.

use super::inputs::{
    self, float_dtype, AttentionWeights, LayerInputs, Projection, QkNorms, PROJECTIONS, QK_NORMS,
};
use super::reconstruction::{self, LayerReconstruction, Reconstruction};
use super::{TraceError, TraceMeta};
use memmap2::Mmap;
use ndarray::{Array1, Array2, Array3};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One layer's vectors, converted to f32.
#[derive(Debug, Clone)]
pub struct LayerTensors {
    /// Queries, `[n_heads, T, head_dim]`.
    pub q: Array3<f32>,
    /// Keys, `[n_kv_heads, T, head_dim]`.
    pub k: Array3<f32>,
    /// Values, `[n_kv_heads, T, head_dim]`, when the trace has them.
    pub v: Option<Array3<f32>>,
    /// The layer's attention inputs, when the trace has them.
    pub inputs: Option<LayerInputs>,
    /// The layer's rows of the reconstruction pass, when the trace has one.
    pub reconstruction: Option<LayerReconstruction>,
}

/// Where one tensor's data lies in a trace file ([`TraceReader::tensor_location`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLocation {
    /// `F16`, `BF16`, `F32`, `I32` or `I64`.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its bytes in the file (little-endian, row-major).
    pub bytes: std::ops::Range<usize>,
}

/// Where a trace's bytes are: a file read a chunk at a time, or bytes in memory (a live run's
/// recording, written there instead of to a scratch file).
enum Source {
    File(File),
    Memory(Arc<Vec<u8>>),
}

impl Source {
    /// Another handle on the same bytes.
    fn share(&self) -> std::io::Result<Self> {
        Ok(match self {
            Source::File(file) => Source::File(file.try_clone()?),
            Source::Memory(bytes) => Source::Memory(bytes.clone()),
        })
    }

    /// Fills `buffer` from byte `offset` on.
    fn read_at(&self, buffer: &mut [u8], offset: usize) -> std::io::Result<()> {
        match self {
            Source::File(file) => file.read_exact_at(buffer, offset as u64),
            Source::Memory(bytes) => {
                let end = offset + buffer.len();
                let found = bytes.get(offset..end).ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the trace's end")
                })?;
                buffer.copy_from_slice(found);
                Ok(())
            }
        }
    }
}

/// An open, validated trace.
pub struct TraceReader {
    /// The file, or for a trace in memory the label its errors name.
    path: PathBuf,
    source: Source,
    file_len: usize,
    data_start: usize,
    header: Metadata,
    meta: TraceMeta,
    n_positions: usize,
    storage: Dtype,
    has_values: bool,
    /// The attention inputs' layout, when the trace holds them.
    inputs: Option<inputs::InputsLayout>,
    /// The reconstruction pass, when the trace records one.
    reconstruction: Option<Reconstruction>,
    /// Bytes a cache holds per element, when set apart from the file's dtype.
    cache_element_bytes: Option<usize>,
}

impl std::fmt::Debug for TraceReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceReader")
            .field("path", &self.path)
            .field("meta", &self.meta)
            .field("n_positions", &self.n_positions)
            .finish()
    }
}

impl TraceReader {
    /// Opens and validates a trace: every rule but finiteness, which is checked as layers are read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref().to_owned();
        if path.is_dir() {
            return Err(TraceError::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::IsADirectory,
                    "is a directory, not a trace file",
                ),
            });
        }
        let file = std::fs::File::open(&path).map_err(|source| TraceError::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only and private to this reader; a trace modified by another
        // process while it is replayed is outside what any reader can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| TraceError::Io {
            path: path.clone(),
            source,
        })?;
        let found = Self::validated(path, &map, Source::File(file));
        drop(map);
        found
    }

    /// A trace held in memory (the bytes a file of it would hold), validated as
    /// [`open`](Self::open) validates a file; `label` stands for a path in its errors and
    /// [`path`](Self::path).
    pub fn from_bytes(label: impl Into<PathBuf>, bytes: Arc<Vec<u8>>) -> Result<Self, TraceError> {
        let whole = bytes.clone();
        Self::validated(label.into(), &whole, Source::Memory(bytes))
    }

    /// Reads the header of `bytes`, the whole trace, and checks it and its tensors.
    fn validated(path: PathBuf, bytes: &[u8], source: Source) -> Result<Self, TraceError> {
        let (header_len, header) = SafeTensors::read_metadata(bytes).map_err(|err| match err {
            safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                TraceError::Truncated { path: path.clone() }
            }
            other => TraceError::Container {
                path: path.clone(),
                detail: other.to_string(),
            },
        })?;
        let meta = TraceMeta::from_header(&path, header.metadata().as_ref())?;
        let mut reader = Self {
            path,
            source,
            file_len: bytes.len(),
            data_start: 8 + header_len,
            header,
            meta,
            n_positions: 0,
            storage: Dtype::F32,
            has_values: false,
            inputs: None,
            reconstruction: None,
            cache_element_bytes: None,
        };
        reader.check_tensors()?;
        Ok(reader)
    }

    fn check_tensors(&mut self) -> Result<(), TraceError> {
        let tokens = self.info("tokens")?;
        if !matches!(tokens.dtype, Dtype::I32 | Dtype::I64) {
            return Err(self.dtype_error("tokens", tokens.dtype, "I32 or I64"));
        }
        if tokens.shape.len() != 1 {
            return Err(TraceError::Shape {
                path: self.path.clone(),
                tensor: "tokens".into(),
                found: tokens.shape.clone(),
                expected: vec![tokens.shape.first().copied().unwrap_or(0)],
                rule: "shape",
            });
        }
        let n_positions = tokens.shape[0];
        let meta = &self.meta;
        let storage = self.info("layers.0.q")?.dtype;
        if !float_dtype(storage) {
            return Err(self.dtype_error("layers.0.q", storage, "F16, BF16 or F32"));
        }
        let has_values = self.header.info("layers.0.v").is_some();
        for layer in 0..meta.n_layers {
            let mut expected = vec![
                (format!("layers.{layer}.q"), meta.n_heads),
                (format!("layers.{layer}.k"), meta.n_kv_heads),
            ];
            if has_values {
                expected.push((format!("layers.{layer}.v"), meta.n_kv_heads));
            }
            for (name, heads) in expected {
                let info = self.info(&name)?;
                if info.dtype != storage {
                    return Err(self.dtype_error(
                        &name,
                        info.dtype,
                        &format!("{storage:?} (the dtype of layers.0.q)"),
                    ));
                }
                let want = vec![heads, n_positions, meta.head_dim];
                if info.shape != want {
                    let same_t_only = info.shape.len() == 3
                        && info.shape[0] == heads
                        && info.shape[2] == meta.head_dim;
                    return Err(TraceError::Shape {
                        path: self.path.clone(),
                        tensor: name,
                        found: info.shape.clone(),
                        expected: want,
                        rule: if same_t_only {
                            "same T in every layer and in `tokens`"
                        } else {
                            "shape [heads, T, head_dim]"
                        },
                    });
                }
            }
        }
        self.meta.check_positions(&self.path, n_positions)?;
        self.inputs = inputs::check(&self.path, &self.header, &self.meta, n_positions)?;
        self.reconstruction =
            reconstruction::check(&self.path, &self.header, &self.meta, (n_positions, storage))?;
        self.n_positions = n_positions;
        self.storage = storage;
        self.has_values = has_values;
        Ok(())
    }

    fn info(&self, name: &str) -> Result<&TensorInfo, TraceError> {
        self.header
            .info(name)
            .ok_or_else(|| TraceError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_owned(),
            })
    }

    fn dtype_error(&self, tensor: &str, found: Dtype, expected: &str) -> TraceError {
        TraceError::Dtype {
            path: self.path.clone(),
            tensor: tensor.to_owned(),
            found: format!("{found:?}"),
            expected: expected.to_owned(),
        }
    }

    /// The data of a tensor, read in chunks of [`CHUNK`] bytes, each handed to `consume`.
    fn read_chunks(
        &self,
        info: &TensorInfo,
        mut consume: impl FnMut(&[u8]),
    ) -> Result<(), TraceError> {
        let (start, end) = info.data_offsets;
        let mut buffer = vec![0u8; CHUNK.min(end - start)];
        let mut offset = start;
        while offset < end {
            let chunk = &mut buffer[..CHUNK.min(end - offset)];
            self.source
                .read_at(chunk, self.data_start + offset)
                .map_err(|source| TraceError::Io {
                    path: self.path.clone(),
                    source,
                })?;
            consume(chunk);
            offset += chunk.len();
        }
        Ok(())
    }

    /// The same trace read with its prompt ending at `prompt_len` (from 1 to the last position)
    /// instead of where it was captured: the positions after it count as decode positions. The
    /// question-agnostic protocol cuts where the question starts.
    pub fn with_prompt_len(&self, prompt_len: usize) -> Result<Self, TraceError> {
        assert!(
            (1..self.n_positions).contains(&prompt_len),
            "a prompt of {prompt_len} positions in a trace of {}",
            self.n_positions
        );
        let mut view = self.view()?;
        view.meta.prompt_len = prompt_len;
        Ok(view)
    }

    /// The same trace read without its reconstruction pass: its layers come without the pass's
    /// rows, for a replay whose policies do not read them (they are as large as the prompt's q
    /// and k).
    pub fn without_reconstruction(&self) -> Result<Self, TraceError> {
        let mut view = self.view()?;
        view.reconstruction = None;
        Ok(view)
    }

    /// Another reader of the same file or bytes, as validated.
    fn view(&self) -> Result<Self, TraceError> {
        let source = self.source.share().map_err(|source| TraceError::Io {
            path: self.path.clone(),
            source,
        })?;
        Ok(Self {
            path: self.path.clone(),
            source,
            file_len: self.file_len,
            data_start: self.data_start,
            header: self.header.clone(),
            meta: self.meta.clone(),
            n_positions: self.n_positions,
            storage: self.storage,
            has_values: self.has_values,
            inputs: self.inputs,
            reconstruction: self.reconstruction.clone(),
            cache_element_bytes: self.cache_element_bytes,
        })
    }

    /// The file this reader reads.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn meta(&self) -> &TraceMeta {
        &self.meta
    }

    /// T: prompt and generated positions together.
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }

    /// Bytes a cache holds per full-precision element: the file's dtype's (2 for F16 and BF16, 4
    /// for F32) unless [counted otherwise](Self::counting_elements_at).
    pub fn element_bytes(&self) -> usize {
        self.cache_element_bytes.unwrap_or_else(|| {
            self.info("layers.0.k")
                .map_or(4, |info| info.dtype.bitsize() / 8)
        })
    }

    /// The same reader counting a cache's full-precision elements at `bytes` each, whatever its
    /// file stores: live mode's f32 recording counts the cache at the width a capture stores by
    /// default, so budgets in bytes resolve as on a capture of the same run.
    pub fn counting_elements_at(mut self, bytes: usize) -> Self {
        self.cache_element_bytes = Some(bytes);
        self
    }

    /// Whether the trace stores values (needed for the output-error metric).
    pub fn has_values(&self) -> bool {
        self.has_values
    }

    /// Whether the trace holds each layer's attention inputs (hidden states and projections).
    pub fn has_inputs(&self) -> bool {
        self.inputs.is_some()
    }

    /// The reconstruction pass it records, if any (KVzip's scores).
    pub fn reconstruction(&self) -> Option<&Reconstruction> {
        self.reconstruction.as_ref()
    }

    /// The model width of its attention inputs, when it holds them.
    pub fn d_model(&self) -> Option<usize> {
        self.inputs.map(|layout| layout.d_model)
    }

    /// The ε of its attention inputs' per-head q/k norms, when it holds them.
    pub fn qk_norm_eps(&self) -> Option<f32> {
        self.inputs.and_then(|layout| layout.qk_norm_eps)
    }

    /// The storage dtype of q, k and v, as safetensors names it (`F16`, `BF16`, `F32`).
    pub fn storage_dtype(&self) -> String {
        format!("{:?}", self.storage)
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> usize {
        self.file_len
    }

    /// Where tensor `name` lies in the file, for a reader that maps the file itself (the Python
    /// package's NumPy views): its dtype as safetensors names it, its shape and its byte range.
    pub fn tensor_location(&self, name: &str) -> Result<TensorLocation, TraceError> {
        let info = self.info(name)?;
        let (start, end) = info.data_offsets;
        Ok(TensorLocation {
            dtype: format!("{:?}", info.dtype),
            shape: info.shape.clone(),
            bytes: self.data_start + start..self.data_start + end,
        })
    }

    /// Where tensor `tensor` (`q`, `k` or `v`) of layer `layer` lies in the file.
    pub fn layer_location(&self, layer: usize, tensor: &str) -> Result<TensorLocation, TraceError> {
        if layer >= self.meta.n_layers {
            return Err(TraceError::NoSuchLayer {
                path: self.path.clone(),
                layer,
                n_layers: self.meta.n_layers,
            });
        }
        self.tensor_location(&format!("layers.{layer}.{tensor}"))
    }

    /// The token ids.
    pub fn tokens(&self) -> Result<Array1<i64>, TraceError> {
        self.ids("tokens")
    }

    /// An integer tensor's values.
    fn ids(&self, name: &str) -> Result<Array1<i64>, TraceError> {
        let info = self.info(name)?;
        let mut ids: Vec<i64> = Vec::with_capacity(info.shape[0]);
        self.read_chunks(info, |bytes| match info.dtype {
            Dtype::I32 => ids.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64),
            ),
            _ => ids.extend(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))),
            ),
        })?;
        Ok(Array1::from(ids))
    }

    /// Reads one layer as f32, checking that every value is finite.
    pub fn layer(&self, layer: usize) -> Result<LayerTensors, TraceError> {
        if layer >= self.meta.n_layers {
            return Err(TraceError::NoSuchLayer {
                path: self.path.clone(),
                layer,
                n_layers: self.meta.n_layers,
            });
        }
        let q = self.tensor(&format!("layers.{layer}.q"))?;
        let k = self.tensor(&format!("layers.{layer}.k"))?;
        let v = if self.has_values {
            Some(self.tensor(&format!("layers.{layer}.v"))?)
        } else {
            None
        };
        let inputs = self.layer_inputs(layer)?;
        let reconstruction = match &self.reconstruction {
            Some(pass) => {
                let [q, k] = reconstruction::layer_names(layer);
                Some(LayerReconstruction {
                    pass: pass.clone(),
                    q: self.tensor(&q)?,
                    k: self.tensor(&k)?,
                })
            }
            None => None,
        };
        Ok(LayerTensors {
            q,
            k,
            v,
            inputs,
            reconstruction,
        })
    }

    /// The token ids of the reconstruction pass, its chunks' rows one after another; `None` when
    /// the trace records none.
    pub fn reconstruction_tokens(&self) -> Result<Option<Array1<i64>>, TraceError> {
        match self.reconstruction {
            Some(_) => self.ids(reconstruction::TOKENS).map(Some),
            None => Ok(None),
        }
    }

    /// Reads one layer's attention inputs as f32, checking that every value is finite; `None`
    /// when the trace holds none.
    pub fn layer_inputs(&self, layer: usize) -> Result<Option<LayerInputs>, TraceError> {
        let Some(layout) = self.inputs else {
            return Ok(None);
        };
        if layer >= self.meta.n_layers {
            return Err(TraceError::NoSuchLayer {
                path: self.path.clone(),
                layer,
                n_layers: self.meta.n_layers,
            });
        }
        let matrix =
            |name: String| -> Result<Array2<f32>, TraceError> {
                let (values, shape) = self.floats(&name)?;
                Ok(Array2::from_shape_vec((shape[0], shape[1]), values)
                    .expect("shape checked at open"))
            };
        let projection = |name: &str| -> Result<Projection, TraceError> {
            let bias = format!("layers.{layer}.{name}.bias");
            let bias = match self.header.info(&bias) {
                Some(_) => Some(Array1::from(self.floats(&bias)?.0)),
                None => None,
            };
            Ok(Projection {
                weight: matrix(format!("layers.{layer}.{name}.weight"))?,
                bias,
            })
        };
        let norm = |name: &str| -> Result<Array1<f32>, TraceError> {
            Ok(Array1::from(
                self.floats(&format!("layers.{layer}.{name}.weight"))?.0,
            ))
        };
        let qk_norms = match layout.qk_norm_eps {
            Some(eps) => Some(QkNorms {
                q: norm(QK_NORMS[0])?,
                k: norm(QK_NORMS[1])?,
                eps,
            }),
            None => None,
        };
        Ok(Some(LayerInputs {
            hidden: matrix(format!("layers.{layer}.input"))?,
            weights: AttentionWeights {
                projections: [
                    projection(PROJECTIONS[0])?,
                    projection(PROJECTIONS[1])?,
                    projection(PROJECTIONS[2])?,
                    projection(PROJECTIONS[3])?,
                ],
                qk_norms,
            },
        }))
    }

    fn tensor(&self, name: &str) -> Result<Array3<f32>, TraceError> {
        let (values, shape) = self.floats(name)?;
        let shape = (shape[0], shape[1], shape[2]);
        Ok(Array3::from_shape_vec(shape, values).expect("shape checked at open"))
    }

    /// A float tensor's values as f32 and its shape, every value checked finite.
    fn floats(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), TraceError> {
        let info = self.info(name)?;
        let mut values = Vec::with_capacity(info.shape.iter().product());
        self.read_chunks(info, |bytes| extend_f32(&mut values, bytes, info.dtype))?;
        if let Some(index) = values.iter().position(|value| !value.is_finite()) {
            return Err(TraceError::NonFinite {
                path: self.path.clone(),
                tensor: name.to_owned(),
                index,
                value: values[index].to_string(),
            });
        }
        Ok((values, info.shape.clone()))
    }
}

/// Bytes per read: a multiple of every element size, small beside a layer.
const CHUNK: usize = 256 << 10;

/// Appends little-endian F16/BF16/F32 bytes as f32 (the data of a safetensors file need not be
/// aligned).
fn extend_f32(values: &mut Vec<f32>, bytes: &[u8], dtype: Dtype) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    match dtype {
        Dtype::F16 => {
            // Widened a slice at a time: the half crate converts 8 at once where the CPU can
            // (F16C); the bits go through a small buffer on the stack.
            let mut bits = [0u16; 1024];
            for piece in bytes.chunks(2 * bits.len()) {
                let bits = &mut bits[..piece.len() / 2];
                for (bit, c) in bits.iter_mut().zip(piece.chunks_exact(2)) {
                    *bit = u16::from_le_bytes([c[0], c[1]]);
                }
                let start = values.len();
                values.resize(start + bits.len(), 0.0);
                bits.reinterpret_cast::<half::f16>()
                    .convert_to_f32_slice(&mut values[start..]);
            }
        }
        Dtype::BF16 => values.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        _ => values.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
    }
}
