//! Writes kvtrace/1 files. The file appears atomically (written beside the target, then renamed),
//! so an interrupted capture never leaves a half-written trace under the final name.

use super::{TraceError, TraceMeta};
use ndarray::Array3;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

/// How q, k and v are stored on disk. All arithmetic is f32 whatever the storage.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
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
    fn dtype(self) -> Dtype {
        match self {
            Self::F16 => Dtype::F16,
            Self::Bf16 => Dtype::BF16,
            Self::F32 => Dtype::F32,
        }
    }

    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            Self::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Self::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Self::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Collects a trace's tensors and writes them as one kvtrace/1 file.
#[derive(Debug)]
pub struct TraceWriter {
    meta: TraceMeta,
    storage: StorageDtype,
    tokens: Vec<i64>,
    layers: Vec<(Array3<f32>, Array3<f32>, Option<Array3<f32>>)>,
}

impl TraceWriter {
    /// A writer for a trace with this header and these tokens.
    pub fn new(meta: TraceMeta, storage: StorageDtype, tokens: Vec<i64>) -> Self {
        Self {
            meta,
            storage,
            tokens,
            layers: Vec::new(),
        }
    }

    /// Adds the next layer's q `[n_heads, T, d]`, k and optional v `[n_kv_heads, T, d]`.
    pub fn push_layer(&mut self, q: Array3<f32>, k: Array3<f32>, v: Option<Array3<f32>>) {
        self.layers.push((q, k, v));
    }

    /// Checks the collected data against the contract and writes the file atomically.
    pub fn write(&self, path: &Path) -> Result<(), TraceError> {
        let fail = |detail: String| TraceError::Write {
            path: path.to_owned(),
            detail,
        };
        let meta = &self.meta;
        if self.layers.len() != meta.n_layers {
            return Err(fail(format!(
                "{} layers collected, header says n_layers = {}",
                self.layers.len(),
                meta.n_layers
            )));
        }
        let n_positions = self.tokens.len();
        meta.check_positions(path, n_positions)?;
        let mut buffers: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = vec![(
            "tokens".into(),
            vec![n_positions],
            Dtype::I64,
            self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect(),
        )];
        for (layer, (q, k, v)) in self.layers.iter().enumerate() {
            let mut tensors = vec![("q", q, meta.n_heads), ("k", k, meta.n_kv_heads)];
            if let Some(v) = v {
                tensors.push(("v", v, meta.n_kv_heads));
            }
            for (kind, tensor, heads) in tensors {
                let want = [heads, n_positions, meta.head_dim];
                if tensor.shape() != want {
                    return Err(fail(format!(
                        "layers.{layer}.{kind} has shape {:?}, expected {want:?}",
                        tensor.shape()
                    )));
                }
                let values: Vec<f32> = tensor.iter().copied().collect();
                buffers.push((
                    format!("layers.{layer}.{kind}"),
                    want.to_vec(),
                    self.storage.dtype(),
                    self.storage.encode(&values),
                ));
            }
        }
        let views = buffers
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes).map(|view| (name.clone(), view))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| fail(err.to_string()))?;
        crate::atomic::write_with(path, |partial| {
            // safetensors writes through a temporary file of its own, created with mode 0600:
            // the trace gets the mode any new file gets here (0644 under the usual umask), like
            // the tool's other outputs, so it can be shared.
            let permissions = std::fs::File::create(partial)?.metadata()?.permissions();
            safetensors::serialize_to_file(views, Some(meta.to_header()), partial)
                .map_err(std::io::Error::other)?;
            std::fs::set_permissions(partial, permissions)
        })
        .map_err(|err| fail(err.to_string()))
    }
}
