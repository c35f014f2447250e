//! Reading a GGUF: its metadata, the hyper-parameters of a Llama-shaped decoder, and the weights
//! dequantised to f32.

use super::ModelError;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};
use memmap2::Mmap;
use rayon::prelude::*;
use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};

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
}

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
        })
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

    /// The token embedding and every layer's `block`, read side by side on worker threads (each
    /// tensor is dequantised on one thread). A failure is the embedding's, else the first failing
    /// layer's, in layer order.
    pub(crate) fn embedding_and_blocks<B: Send>(
        &self,
        n_layers: usize,
        block: impl Fn(usize) -> Result<B, ModelError> + Sync,
    ) -> Result<(Tensor, Vec<B>), ModelError> {
        let (embedding, blocks) = rayon::join(
            || self.tensor("token_embd.weight"),
            || {
                (0..n_layers)
                    .into_par_iter()
                    .map(&block)
                    .collect::<Vec<_>>()
            },
        );
        Ok((embedding?, blocks.into_iter().collect::<Result<_, _>>()?))
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
