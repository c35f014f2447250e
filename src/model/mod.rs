//! A native, CPU-only forward pass of Llama-architecture GGUF models (SmolLM2-135M-Instruct is the
//! project's default), written to record what attention sees: post-rotary q and k and the v of
//! every layer and position.
//!
//! Why our own forward instead of a framework's model zoo: capture needs a hook inside attention,
//! and the same forward will later run eviction policies live. candle-core reads the GGUF and
//! supplies the tensor kernels; the weights are dequantised to f32 once at load (f32 GEMM is ~15×
//! faster than candle's quantised Q4_1 matmul on this machine, see docs/assets.md).
//!
//! Rotary convention: llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that
//! *interleaved* rotary pairs work on them. We undo that permutation at load and apply the
//! half-split (`rotate_half`) rotary of Hugging Face transformers, so stored q/k are in the same
//! dimension order as a transformers capture of the same model and compare element by element.

mod error;
mod gguf;
mod llama;
mod mask;
mod tokenizer;

pub use error::ModelError;
pub use gguf::LlamaConfig;
pub(crate) use llama::argmax;
pub use llama::{KvCache, Llama, Recorder};
pub use mask::{causal_mask, AttentionMask, ChunkVectors, Evicted};
pub use tokenizer::{ChatMessage, ChatTokenizer};
