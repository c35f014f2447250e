//! Qwen2 (Qwen2.5 and its Coder and Math models, DeepSeek-R1-Distill-Qwen): Llama's block with
//! biases on the q, k and v projections, run on the Llama forward ([`Llama`]).
//!
//! Differences from Llama, as the reference implementation has them (transformers
//! `models/qwen2/modeling_qwen2.py`, `Qwen2Attention`: `q_proj`, `k_proj`, `v_proj` with
//! `bias=True`, `o_proj` without) and as llama.cpp's converter writes them
//! (`convert_hf_to_gguf.py`, `Qwen2Model`: no q/k row permutation, so the rows are already in the
//! half-split rotary's order; llama.cpp runs `qwen2` with `LLAMA_ROPE_TYPE_NEOX`). The rotary
//! base, norm epsilon and head counts come from the `qwen2.*` metadata; an `output.weight`
//! present in the file is the untied output layer. The tokenizer is the GGUF's byte-level BPE
//! with the `qwen2` pre-tokenizer and the ChatML template whose default system message the
//! GGUF's chat template states ([`ChatTokenizer`](super::ChatTokenizer)).

use super::gguf::GgufFile;
use super::llama::{Llama, Variant};
use super::ModelError;
use std::path::Path;

/// The Qwen2 family: a constructor of the [`Llama`] forward with Qwen2's [`Variant`].
pub struct Qwen2;

const QWEN2: Variant = Variant {
    architecture: "qwen2",
    permuted_qk: false,
};

impl Qwen2 {
    /// Loads a `qwen2` GGUF: its weights as f32, or, above 8 GB as f32, as the file stores them.
    pub fn load(path: &Path) -> Result<Llama, ModelError> {
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// [`load`](Self::load) from an opened GGUF.
    pub fn from_gguf(gguf: GgufFile) -> Result<Llama, ModelError> {
        Llama::from_variant(gguf, &QWEN2)
    }
}
