//! What a capture keeps of a forward pass: per layer, the post-rotary q and k and the v of every
//! position, chunk by chunk, in memory or spilled to files beside the trace (so a long capture
//! holds the model and its cache, not the trace); optionally the attention output, to check a
//! trace against the forward pass that produced it, and each layer's attention input (the normed
//! hidden states, held in memory), for a trace that stores them.

use super::ModelError;
use candle_core::{Device, Tensor};
use ndarray::{s, Array2, Array3};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// One layer's q `[n_heads, T, d]`, k and v `[n_kv_heads, T, d]`.
type Qkv = (Array3<f32>, Array3<f32>, Array3<f32>);

/// Collects every layer's q, k and v, chunk by chunk.
#[derive(Default)]
pub struct Recorder {
    q: Vec<Vec<Tensor>>,
    k: Vec<Vec<Tensor>>,
    v: Vec<Vec<Tensor>>,
    attention: Vec<Vec<Tensor>>,
    /// The chunks' hidden states entering the model's residual layer.
    residual: Vec<Tensor>,
    keep_attention: bool,
    /// Each layer's attention input `[n, d_model]`, chunk by chunk, when asked for.
    inputs: Vec<Vec<Tensor>>,
    keep_inputs: bool,
    spill: Option<Spill>,
    /// What an earlier recorder recorded of the positions before this one's (a context several
    /// runs continue from).
    prefix: Option<std::sync::Arc<Recorder>>,
}

/// Per layer, a file of its chunks (each chunk's q, then k, then v, f32 little-endian), and the
/// chunk lengths, the same in every layer.
struct Spill {
    files: Vec<(PathBuf, std::fs::File)>,
    stem: PathBuf,
    chunks: Vec<usize>,
    heads: (usize, usize, usize),
}

impl Drop for Spill {
    fn drop(&mut self) {
        for (path, _) in &self.files {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_owned(),
        source,
    }
}

impl Recorder {
    /// A recorder that also keeps each layer's attention output `[n_heads, T, head_dim]`.
    pub fn with_attention_output() -> Self {
        Self {
            keep_attention: true,
            ..Self::default()
        }
    }

    /// A recorder that writes each layer's chunks to its own file in `dir` (removed when the
    /// recorder is dropped) instead of holding them; [`layer`](Self::layer) reads one back.
    pub fn spilling(dir: &Path) -> Self {
        static RECORDERS: AtomicUsize = AtomicUsize::new(0);
        let stem = dir.join(format!(
            ".kvreplay-spill-{}-{}",
            std::process::id(),
            RECORDERS.fetch_add(1, Ordering::Relaxed)
        ));
        Self {
            spill: Some(Spill {
                files: Vec::new(),
                stem,
                chunks: Vec::new(),
                heads: (0, 0, 0),
            }),
            ..Self::default()
        }
    }

    /// The same recorder also keeping each layer's attention input (the normed hidden states
    /// entering attention), in memory.
    pub fn keeping_inputs(self, keep: bool) -> Self {
        Self {
            keep_inputs: keep,
            ..self
        }
    }

    /// Whether it keeps the layers' attention inputs.
    pub(crate) fn keeps_inputs(&self) -> bool {
        self.keep_inputs
    }

    /// Keeps layer `layer`'s attention input `[n, d_model]` of one chunk, if asked to.
    pub(crate) fn record_input(&mut self, layer: usize, hidden: &Tensor) {
        if self.keep_inputs {
            Self::push(&mut self.inputs, layer, hidden);
        }
    }

    /// Layer `layer`'s attention input `[T, d_model]`, its prefix's positions first; `None`
    /// where it keeps none.
    pub fn layer_input(&self, layer: usize) -> Result<Option<Array2<f32>>, ModelError> {
        if !self.keep_inputs {
            return Ok(None);
        }
        let mut parts: Vec<Tensor> = match &self.prefix {
            Some(prefix) => prefix
                .layer_input(layer)?
                .map(|before| {
                    let shape = before.dim();
                    Tensor::from_vec(before.into_raw_vec_and_offset().0, shape, &Device::Cpu)
                })
                .transpose()?
                .into_iter()
                .collect(),
            None => Vec::new(),
        };
        parts.extend(self.inputs.get(layer).into_iter().flatten().cloned());
        let tensor = Tensor::cat(&parts, 0)?;
        let (positions, width) = tensor.dims2()?;
        let flat = tensor.flatten_all()?.to_vec1::<f32>()?;
        Ok(Some(
            Array2::from_shape_vec((positions, width), flat).expect("candle shape matches"),
        ))
    }

    /// This recorder after `prefix`, which recorded the positions before the ones it will record:
    /// its layers are the prefix's, then its own.
    pub fn continuing(self, prefix: std::sync::Arc<Recorder>) -> Self {
        Self {
            prefix: Some(prefix),
            ..self
        }
    }

    /// Keeps layer `layer`'s post-rotary q `[n_heads, n, d]`, k and v `[n_kv_heads, n, d]` of
    /// one chunk.
    pub(crate) fn record(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), ModelError> {
        let Some(spill) = self.spill.as_mut() else {
            Self::push(&mut self.q, layer, q);
            Self::push(&mut self.k, layer, k);
            Self::push(&mut self.v, layer, v);
            return Ok(());
        };
        let (n_heads, n, d) = q.dims3()?;
        if layer == 0 {
            spill.chunks.push(n);
            spill.heads = (n_heads, k.dims()[0], d);
        }
        if spill.files.len() <= layer {
            let path = PathBuf::from(format!("{}-{layer}", spill.stem.display()));
            let file = std::fs::File::create(&path).map_err(io_error(&path))?;
            spill.files.push((path, file));
        }
        let (path, file) = &mut spill.files[layer];
        let mut bytes = Vec::new();
        for tensor in [q, k, v] {
            for value in tensor.flatten_all()?.to_vec1::<f32>()? {
                bytes.extend_from_slice(&value.to_le_bytes());
            }
        }
        file.write_all(&bytes).map_err(io_error(path))
    }

    /// Keeps layer `layer`'s attention output of one chunk, if asked to.
    pub(crate) fn record_attention(&mut self, layer: usize, attention: &Tensor) {
        if self.keep_attention {
            Self::push(&mut self.attention, layer, attention);
        }
    }

    /// Keeps one chunk's hidden states `[n, hidden size]` entering the layer where the model
    /// records them ([`CausalLm::residual_layer`](super::CausalLm::residual_layer)).
    pub(crate) fn record_residual(&mut self, hidden: Tensor) {
        self.residual.push(hidden);
    }

    /// The hidden states entering the model's residual layer at every position recorded, its
    /// prefix's first; `None` where the model records none.
    pub fn residual(&self) -> Result<Option<Tensor>, ModelError> {
        let mut parts = match &self.prefix {
            Some(prefix) => prefix.residual()?.into_iter().collect(),
            None => Vec::new(),
        };
        parts.extend(self.residual.iter().cloned());
        match parts.is_empty() {
            true => Ok(None),
            false => Ok(Some(Tensor::cat(&parts, 0)?)),
        }
    }

    fn push(slot: &mut Vec<Vec<Tensor>>, layer: usize, value: &Tensor) {
        if slot.len() <= layer {
            slot.resize_with(layer + 1, Vec::new);
        }
        slot[layer].push(value.clone());
    }

    fn joined(slot: &[Vec<Tensor>], layer: usize) -> Result<Array3<f32>, ModelError> {
        let tensor = Tensor::cat(&slot[layer], 1)?;
        let (heads, positions, dim) = tensor.dims3()?;
        let flat = tensor.flatten_all()?.to_vec1::<f32>()?;
        Ok(Array3::from_shape_vec((heads, positions, dim), flat).expect("candle shape matches"))
    }

    /// Layer `layer`'s q `[n_heads, T, d]`, k and v `[n_kv_heads, T, d]`, its prefix's
    /// positions first.
    pub fn layer(&self, layer: usize) -> Result<Qkv, ModelError> {
        let recorded_nothing = match &self.spill {
            Some(spill) => spill.chunks.is_empty(),
            None => self.q.is_empty(),
        };
        if let (true, Some(prefix)) = (recorded_nothing, &self.prefix) {
            return prefix.layer(layer);
        }
        let own = match &self.spill {
            Some(spill) => spill.layer(layer)?,
            None => (
                Self::joined(&self.q, layer)?,
                Self::joined(&self.k, layer)?,
                Self::joined(&self.v, layer)?,
            ),
        };
        let Some(prefix) = &self.prefix else {
            return Ok(own);
        };
        let before = prefix.layer(layer)?;
        let join = |a: Array3<f32>, b: Array3<f32>| {
            ndarray::concatenate(ndarray::Axis(1), &[a.view(), b.view()])
                .expect("the same heads and head dimension")
        };
        Ok((
            join(before.0, own.0),
            join(before.1, own.1),
            join(before.2, own.2),
        ))
    }

    /// Layer `layer`'s attention output `[n_heads, T, d]`, if it was kept.
    pub fn attention_output(&self, layer: usize) -> Result<Option<Array3<f32>>, ModelError> {
        if !self.keep_attention || self.attention.len() <= layer {
            return Ok(None);
        }
        Ok(Some(Self::joined(&self.attention, layer)?))
    }
}

impl Spill {
    /// Reads layer `layer`'s file back and lays its chunks out by position.
    fn layer(&self, layer: usize) -> Result<Qkv, ModelError> {
        let (path, _) = &self.files[layer];
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut file| file.read_to_end(&mut bytes))
            .map_err(io_error(path))?;
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (n_heads, n_kv, d) = self.heads;
        let total: usize = self.chunks.iter().sum();
        let mut q = Array3::zeros((n_heads, total, d));
        let mut k = Array3::zeros((n_kv, total, d));
        let mut v = Array3::zeros((n_kv, total, d));
        let (mut at, mut start) = (0, 0);
        for &n in &self.chunks {
            for (array, heads) in [(&mut q, n_heads), (&mut k, n_kv), (&mut v, n_kv)] {
                let len = heads * n * d;
                let block = ndarray::ArrayView3::from_shape((heads, n, d), &values[at..at + len])
                    .expect("one chunk's values");
                array.slice_mut(s![.., start..start + n, ..]).assign(&block);
                at += len;
            }
            start += n;
        }
        Ok((q, k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn states(first: f32, n: usize) -> Tensor {
        let values: Vec<f32> = (0..2 * n).map(|i| first + i as f32).collect();
        Tensor::from_vec(values, (n, 2), &Device::Cpu).unwrap()
    }

    #[test]
    fn the_residual_is_the_prefixs_then_its_own_chunks() {
        assert!(Recorder::default().residual().unwrap().is_none());
        let mut context = Recorder::default();
        context.record_residual(states(0.0, 2));
        let mut question = Recorder::default().continuing(std::sync::Arc::new(context));
        question.record_residual(states(4.0, 1));
        question.record_residual(states(6.0, 2));
        let residual: Vec<Vec<f32>> = question.residual().unwrap().unwrap().to_vec2().unwrap();
        let expected: Vec<Vec<f32>> = (0..5)
            .map(|row| vec![2.0 * row as f32, 2.0 * row as f32 + 1.0])
            .collect();
        assert_eq!(residual, expected);
    }
}
