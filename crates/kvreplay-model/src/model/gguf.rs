//! Reading a GGUF: its metadata, the hyper-parameters of a Llama-shaped decoder, and the weights
//! dequantised to f32.

use super::weight::F32_LIMIT;
use super::ModelError;
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use memmap2::Mmap;
use rayon::prelude::*;
use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The hyper-parameters of a Llama-shaped decoder (`llama`, `qwen2`), from its GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`: the prefix of the keys below.
    pub architecture: String,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Hidden size.
    pub embedding_len: usize,
    /// Rotary base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// The model's name, from `general.name`.
    pub name: String,
}

impl LlamaConfig {
    /// Dimension of one head.
    pub fn head_dim(&self) -> usize {
        self.embedding_len / self.n_heads
    }
}

/// An open GGUF file: its parsed header and a reader for its tensors.
pub struct GgufFile {
    pub(crate) path: PathBuf,
    pub(crate) content: Content,
    /// Mapped: the header is read a few bytes at a time (a tokenizer's vocabulary is tens of
    /// thousands of strings, each a length and its bytes), two system calls each from a file;
    /// and tensors are read from it on several threads at once, each with its own cursor.
    file: Mmap,
    /// Whether its weights are to be held as the file stores them whatever their size
    /// ([`held_quantized`](Self::held_quantized)).
    quantized: bool,
}

/// Bytes a model's weights take held as f32: every tensor as f32; where the file ties the output
/// to the token embedding (no `output.weight`) and the family multiplies by a copy of it
/// (`ties_a_copy`), that copy; and, where the batched decode sums in strips (`in_strips`), a copy
/// in strips of every matrix a product reads (the 2-D weights but the token embedding, and that
/// output copy), made on its first batched decode.
fn f32_held_bytes<'a>(
    tensors: impl Iterator<Item = (&'a String, &'a TensorInfo)>,
    ties_a_copy: bool,
    in_strips: bool,
) -> usize {
    let (mut all, mut products, mut embedding, mut tied) = (0, 0, 0, true);
    for (name, info) in tensors {
        let bytes = info.shape.elem_count() * 4;
        all += bytes;
        match name.as_str() {
            "token_embd.weight" => embedding = bytes,
            "output.weight" => tied = false,
            _ => {}
        }
        if info.shape.rank() == 2 && name != "token_embd.weight" {
            products += bytes;
        }
    }
    let output_copy = if tied && ties_a_copy { embedding } else { 0 };
    let strips = if in_strips { products + output_copy } else { 0 };
    all + output_copy + strips
}

/// The metadata keys of a tokenizer's BOS and EOS token ids.
pub(crate) const BOS_KEY: &str = "tokenizer.ggml.bos_token_id";
pub(crate) const EOS_KEY: &str = "tokenizer.ggml.eos_token_id";

impl GgufFile {
    /// Opens a GGUF file and parses its header.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let io_error = |source| ModelError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        // SAFETY: the map is read-only and private to this reader; a model file modified by
        // another process while it loads is outside what any reader can defend against.
        let file = unsafe { Mmap::map(&file) }.map_err(io_error)?;
        let content =
            Content::read(&mut Cursor::new(&file[..])).map_err(|err| ModelError::Gguf {
                path: path.to_owned(),
                detail: err.to_string(),
            })?;
        Ok(Self {
            path: path.to_owned(),
            content,
            file,
            quantized: false,
        })
    }

    /// The same file, its weights to be held as it stores them whatever their size (a family
    /// that holds only f32 refuses it).
    pub(crate) fn held_quantized(self) -> Self {
        Self {
            quantized: true,
            ..self
        }
    }

    /// Whether [`held_quantized`](Self::held_quantized) asked for the weights as stored.
    pub(crate) fn asks_quantized(&self) -> bool {
        self.quantized
    }

    pub(crate) fn value(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub(crate) fn metadata_error(&self, key: &str, expected: &'static str) -> ModelError {
        ModelError::Metadata {
            path: self.path.clone(),
            key: key.to_owned(),
            expected,
        }
    }

    /// A string value, where the key holds one.
    pub(crate) fn str_value(&self, key: &str) -> Option<&str> {
        self.value(key)
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
    }

    pub(crate) fn usize_value(&self, key: &str) -> Result<usize, ModelError> {
        self.value(key)
            .and_then(|v| v.to_u32().ok())
            .map(|v| v as usize)
            .ok_or_else(|| self.metadata_error(key, "an unsigned integer"))
    }

    pub(crate) fn f32_value(&self, key: &str) -> Result<f32, ModelError> {
        self.value(key)
            .and_then(|v| v.to_f32().ok())
            .ok_or_else(|| self.metadata_error(key, "a float"))
    }

    pub(crate) fn strings(&self, key: &str) -> Result<Vec<String>, ModelError> {
        let values = self
            .value(key)
            .and_then(|v| v.to_vec().ok())
            .ok_or_else(|| self.metadata_error(key, "an array of strings"))?;
        values
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<_, _>>()
            .map_err(|_| self.metadata_error(key, "an array of strings"))
    }

    /// `general.architecture`, or an empty string.
    pub fn architecture(&self) -> String {
        self.str_value("general.architecture")
            .unwrap_or_default()
            .to_owned()
    }

    /// `general.name`, or `default`.
    pub(crate) fn name(&self, default: &str) -> String {
        self.str_value("general.name").unwrap_or(default).to_owned()
    }

    /// The hyper-parameters of a Llama-shaped decoder, read under the keys of its architecture
    /// (`llama.block_count`, `qwen2.block_count`, ...), which must be `expected`.
    pub fn llama_config(&self, expected: &'static str) -> Result<LlamaConfig, ModelError> {
        let architecture = self.architecture();
        if architecture != expected {
            return Err(self.metadata_error("general.architecture", expected));
        }
        let key = |name: &str| format!("{architecture}.{name}");
        Ok(LlamaConfig {
            n_layers: self.usize_value(&key("block_count"))?,
            n_heads: self.usize_value(&key("attention.head_count"))?,
            n_kv_heads: self.usize_value(&key("attention.head_count_kv"))?,
            embedding_len: self.usize_value(&key("embedding_length"))?,
            rope_theta: self.f32_value(&key("rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: self.f32_value(&key("attention.layer_norm_rms_epsilon"))? as f64,
            name: self.name(&architecture),
            architecture,
        })
    }

    /// Whether the file holds a tensor called `name`.
    pub(crate) fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Bytes the weights take held as f32.
    pub(crate) fn f32_bytes(&self) -> usize {
        let infos = self.content.tensor_infos.values();
        infos.map(|info| info.shape.elem_count() * 4).sum()
    }

    /// Bytes the weights take held as the file stores them.
    fn stored_bytes(&self) -> usize {
        let infos = self.content.tensor_infos.values();
        let bytes = |info: &TensorInfo| {
            let dtype = info.ggml_dtype;
            info.shape.elem_count() / dtype.block_size() * dtype.type_size()
        };
        infos.map(bytes).sum()
    }

    /// Whether a family that can hold its weights quantized does: above [`F32_LIMIT`] as f32, or
    /// when asked to ([`held_quantized`](Self::held_quantized)).
    pub(crate) fn holds_quantized(&self) -> bool {
        self.quantized || self.f32_bytes() > F32_LIMIT
    }

    /// Refuses, before any weight is read, weights that would not fit the memory the system
    /// reports available, held as f32 (with the copies [`f32_held_bytes`] counts; `ties_a_copy`:
    /// whether the family multiplies by a copy of a tied embedding, Llama's, or by the embedding
    /// itself, Gemma 3's) or (`quantized`) as stored.
    pub(crate) fn check_fits(&self, quantized: bool, ties_a_copy: bool) -> Result<(), ModelError> {
        let in_strips = super::product::strip_columns().is_some();
        let needs = match quantized {
            true => self.stored_bytes(),
            false => f32_held_bytes(self.content.tensor_infos.iter(), ties_a_copy, in_strips),
        };
        match crate::sys::memory_available() {
            Some(available) if needs > available => Err(ModelError::Memory {
                path: self.path.clone(),
                needs,
                available,
                held: match (quantized, in_strips) {
                    (true, _) => "as stored",
                    (false, false) => "as f32",
                    (false, true) => "as f32 with the batched decode's strips",
                },
            }),
            _ => Ok(()),
        }
    }

    /// The token embedding (`embedding`) and every layer's `block`, read side by side on worker
    /// threads (each tensor is dequantised on one thread). A failure is the embedding's, else the
    /// first failing layer's, in layer order.
    pub(crate) fn embedding_and_blocks<E: Send, B: Send>(
        &self,
        embedding: impl FnOnce() -> Result<E, ModelError> + Send,
        n_layers: usize,
        block: impl Fn(usize) -> Result<B, ModelError> + Sync,
    ) -> Result<(E, Vec<B>), ModelError> {
        let (embedding, blocks) = rayon::join(embedding, || {
            (0..n_layers)
                .into_par_iter()
                .map(&block)
                .collect::<Vec<_>>()
        });
        Ok((embedding?, blocks.into_iter().collect::<Result<_, _>>()?))
    }

    /// A tensor as the file stores it, in candle's (out, in) layout, read through its own file
    /// handle: the bytes pass through the page cache instead of this process's mapping, so a
    /// model held quantized costs its weights once, not twice, at its peak.
    pub(crate) fn qtensor(&self, name: &str) -> Result<Arc<QTensor>, ModelError> {
        let mut file = File::open(&self.path).map_err(|source| ModelError::Io {
            path: self.path.clone(),
            source,
        })?;
        let qtensor = self
            .content
            .tensor(&mut file, name, &Device::Cpu)
            .map_err(|err| ModelError::Gguf {
                path: self.path.clone(),
                detail: format!("tensor `{name}`: {err}"),
            })?;
        Ok(Arc::new(qtensor))
    }

    /// A tensor, dequantised to f32, in candle's (out, in) layout.
    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        let qtensor = self
            .content
            .tensor(&mut Cursor::new(&self.file[..]), name, &Device::Cpu)
            .map_err(|err| ModelError::Gguf {
                path: self.path.clone(),
                detail: format!("tensor `{name}`: {err}"),
            })?;
        Ok(qtensor.dequantize(&Device::Cpu)?)
    }
}

/// [`unpermute_rows`] on a quantized weight `[out, in]`: its rows are whole blocks, moved as bytes.
pub(crate) fn unpermute_quantized_rows(
    weight: &QTensor,
    n_head: usize,
) -> Result<Arc<QTensor>, ModelError> {
    let (out, inp) = weight.shape().dims2()?;
    let dtype = weight.dtype();
    let row_bytes = inp / dtype.block_size() * dtype.type_size();
    let (rows, half) = (weight.data()?, out / n_head / 2);
    let mut moved = Vec::with_capacity(rows.len());
    for head in 0..n_head {
        for (j, i) in (0..2).flat_map(|j| (0..half).map(move |i| (j, i))) {
            let stored = head * 2 * half + 2 * i + j;
            moved.extend_from_slice(&rows[stored * row_bytes..(stored + 1) * row_bytes]);
        }
    }
    let moved = qtensor_from_ggml(dtype, &moved, vec![out, inp], &Device::Cpu)?;
    Ok(Arc::new(moved))
}

/// Undoes llama.cpp's q/k row permutation (`reshape(n_head, 2, hd/2, in).swapaxes(1, 2)`): the
/// stored row `2i + j` of a head is the original row `j*hd/2 + i`.
pub(crate) fn unpermute_rows(weight: &Tensor, n_head: usize) -> Result<Tensor, ModelError> {
    let (out, inp) = weight.dims2()?;
    let half = out / n_head / 2;
    Ok(weight
        .reshape((n_head, half, 2, inp))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((out, inp))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::product::tests::wave;
    use candle_core::quantized::GgmlDType;

    /// A tied model of an embedding `[4, 8]`, one norm `[8]` and one matrix `[8, 8]`: f32 bytes
    /// 4 × (32 + 8 + 64) = 416; Llama's tied output copies the embedding (+128); strips copy the
    /// matrix and that output (+256 + 128).
    #[test]
    fn f32_weights_count_the_tied_output_and_the_strips() {
        let info = |dims: &[usize]| TensorInfo {
            ggml_dtype: candle_core::quantized::GgmlDType::F32,
            shape: candle_core::Shape::from(dims.to_vec()),
            offset: 0,
        };
        let mut tensors = std::collections::HashMap::new();
        tensors.insert("token_embd.weight".to_owned(), info(&[4, 8]));
        tensors.insert("blk.0.attn_norm.weight".to_owned(), info(&[8]));
        tensors.insert("blk.0.attn_q.weight".to_owned(), info(&[8, 8]));
        assert_eq!(f32_held_bytes(tensors.iter(), true, false), 416 + 128);
        assert_eq!(
            f32_held_bytes(tensors.iter(), true, true),
            416 + 128 + 256 + 128
        );
        // Gemma 3 multiplies by the embedding itself: no copy, no strips of it.
        assert_eq!(f32_held_bytes(tensors.iter(), false, true), 416 + 256);
        // Untied: its own output matrix [4, 8] is a product's, in strips too; no copy.
        tensors.insert("output.weight".to_owned(), info(&[4, 8]));
        assert_eq!(f32_held_bytes(tensors.iter(), true, false), 416 + 128);
        assert_eq!(
            f32_held_bytes(tensors.iter(), true, true),
            416 + 128 + 256 + 128
        );
    }

    #[test]
    fn quantized_rows_are_unpermuted_as_the_f32_rows_are() {
        // Two heads of 8 rows (4 rotary pairs each), 256 columns: one Q4_K block per row.
        let weight = Tensor::from_vec(wave(16 * 256, 0.7), (16, 256), &Device::Cpu).unwrap();
        let quantized = QTensor::quantize(&weight, GgmlDType::Q4K).unwrap();
        let moved = unpermute_quantized_rows(&quantized, 2).unwrap();
        let ours: Vec<Vec<f32>> = moved.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        let dequantized = quantized.dequantize(&Device::Cpu).unwrap();
        let expected: Vec<Vec<f32>> = unpermute_rows(&dequantized, 2).unwrap().to_vec2().unwrap();
        assert_eq!(ours, expected);
        // Row 1 of head 0 is stored row 2 (i = 1, j = 0); row 4 is stored row 1 (i = 0, j = 1).
        let stored: Vec<Vec<f32>> = dequantized.to_vec2().unwrap();
        assert_eq!((&ours[1], &ours[4]), (&stored[2], &stored[1]));
    }
}
