//! Native, CPU-only forward passes of GGUF models, written to record what attention sees:
//! post-rotary q and k and the v of every layer and position. Three families sit behind one trait
//! ([`CausalLm`]) and one registry ([`family`]): Llama (SmolLM2-135M-Instruct is the project's
//! default), Qwen2 (Llama's block with q/k/v biases, run on the Llama forward) and Gemma 3
//! (hybrid sliding-window/global attention, QK-norm, one KV head).
//!
//! Why our own forward instead of a framework's model zoo: capture needs a hook inside attention,
//! and the same forward runs eviction policies live. candle-core reads the GGUF and supplies the
//! tensor kernels. Which path holds which weights: a model whose weights take at most 8 GB as f32
//! (every model `kvreplay fetch` gets: SmolLM2-135M, Gemma 3 270M, Qwen2.5-Coder 0.5B and 1.5B)
//! has them dequantised to f32 once at load, the bit-exact path the committed results come from
//! (f32 GEMM is ~15× faster than candle's quantised Q4_1 matmul on this machine, see
//! docs/assets.md); a larger Llama or Qwen2 holds them as its GGUF stores them, in their blocks
//! (`quantized.rs`), so it costs about its file's size.
//!
//! Rotary convention: llama.cpp's converter permutes the rows of a Llama's `attn_q`/`attn_k` so
//! that *interleaved* rotary pairs work on them. We undo that permutation at load and apply the
//! half-split (`rotate_half`) rotary of Hugging Face transformers, so stored q/k are in the same
//! dimension order as a transformers capture of the same model and compare element by element.
//! (Gemma 3 GGUFs are not permuted: llama.cpp runs them with the half-split rotary already.)

mod batch;
mod cached_attention;
mod causal_lm;
mod chat_template;
mod error;
mod expf;
pub mod family;
mod gated;
mod gemma3;
mod gguf;
pub mod hf;
mod line_sum;
mod llama;
mod mask;
pub(crate) mod mask_buffers;
mod masked_softmax;
mod ops;
mod prefix_attention;
mod product;
mod prompt;
mod quantized;
mod qwen2;
mod recorder;
mod spm;
mod strips;
mod tanhf;
mod tokenizer;
mod weight;

pub use causal_lm::argmax;
pub use causal_lm::{
    CausalLm, Entry, KvCache, ModelSpec, Row, WeightProducts, F32_ENGINE, QUANTIZED_ENGINE,
};
pub use chat_template::{ChatMessage, ChatTemplate};
pub use error::ModelError;
pub use gguf::LlamaConfig;
pub use hf::HfModel;
pub use mask::{causal_mask, AttentionMask, ChunkVectors, Evicted, Rewrite};
pub use prompt::{Template, TextTokenizer};
pub use recorder::Recorder;
pub use spm::SpmTokenizer;
pub use tokenizer::ChatTokenizer;

crate::families! {
    llama::Llama = "llama",
    gemma3::Gemma3 = "gemma3",
    qwen2::Qwen2 = "qwen2",
}
