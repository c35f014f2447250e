//! Errors of model loading and running, naming the file and what in it is wrong.

use std::path::PathBuf;

/// Everything that can go wrong loading or running the native model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The GGUF file cannot be opened.
    #[error("{path}: cannot open model: {source}")]
    Io {
        /// The model file.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// The GGUF container is corrupt (wrong magic, truncated tensor data...).
    #[error("{path}: not a readable GGUF file: {detail}")]
    Gguf {
        /// The model file.
        path: PathBuf,
        /// What the GGUF reader said.
        detail: String,
    },
    /// A metadata key the Llama architecture needs is missing or has the wrong type.
    #[error("{path}: GGUF metadata `{key}` is missing or not {expected}")]
    Metadata {
        /// The model file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type expected.
        expected: &'static str,
    },
    /// No registered family runs the GGUF's architecture.
    #[error("{path}: GGUF architecture `{architecture}` is not one kvreplay runs ({known})")]
    Architecture {
        /// The model file.
        path: PathBuf,
        /// Its `general.architecture`.
        architecture: String,
        /// The architectures of the registered families.
        known: String,
    },
    /// The model's weights, held as its family holds them, would not fit the memory available.
    #[error("{path}: the model needs {} GB for its weights held {held}, and {} GB of memory is available", gb(*needs), gb(*available))]
    Memory {
        /// The model file.
        path: PathBuf,
        /// Bytes its weights take.
        needs: usize,
        /// Bytes available (`MemAvailable`).
        available: usize,
        /// How they would be held (`as f32`, `as stored`).
        held: &'static str,
    },
    /// Weights held as the file stores them were asked of a family that holds them as f32 only.
    #[error("{path}: family `{family}` holds its weights as f32 only; weights held as the file stores them run on the Llama and Qwen2 families")]
    F32Only {
        /// The model file.
        path: PathBuf,
        /// The family.
        family: &'static str,
    },
    /// The tokenizer could not be built from the GGUF vocabulary.
    #[error("{path}: cannot build the tokenizer from the GGUF vocabulary: {detail}")]
    Tokenizer {
        /// The model file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// An attention mask does not fit the forward pass it was given to.
    #[error("attention mask: {0}")]
    Mask(String),
    /// A forward pass was given nothing to run.
    #[error("forward pass: {0}")]
    Input(String),
    /// A Hugging Face model could not be loaded or run through transformers.
    #[error("model `{model}`: {reason}")]
    Hf {
        /// The model, as the recipe names it.
        model: String,
        /// Why.
        reason: String,
    },
    /// A tensor operation failed during the forward pass.
    #[error("forward pass failed: {0}")]
    Compute(#[from] candle_core::Error),
    /// A policy's method failed while the model ran (a scorer written in Python raised).
    #[error(transparent)]
    Method(#[from] kvreplay_core::replay::MethodFailed),
    /// The caller asked the run to stop (Ctrl-C), between two chunks or tokens. Not transparent:
    /// the [`Stopped`](crate::stop::Stopped) stays in the chain of causes.
    #[error("{0}")]
    Stopped(#[from] crate::stop::Stopped),
}

/// Bytes in GB, one decimal.
fn gb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / 1e9)
}
