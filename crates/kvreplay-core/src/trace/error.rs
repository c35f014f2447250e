//! One error variant per rule of the kvtrace/1 contract, each naming the file and the tensor or
//! field it concerns, so a user knows what to fix in whoever wrote the trace.

use std::path::PathBuf;

/// Everything that can be wrong with a trace file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{path}: cannot read trace: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// The safetensors container itself is broken (bad header, offsets beyond the file...).
    #[error("{path}: not a valid safetensors file (rule: container): {detail}")]
    Container {
        /// The trace file.
        path: PathBuf,
        /// What the safetensors parser reported.
        detail: String,
    },
    /// The data section is shorter (or longer) than the header declares.
    #[error("{path}: truncated or padded file: the header's tensor offsets do not end where the file ends (rule: truncated file)")]
    Truncated {
        /// The trace file.
        path: PathBuf,
    },
    /// `__metadata__.format` is missing or not `kvtrace/1`.
    #[error("{path}: metadata `format` is {found:?}, expected \"kvtrace/1\" (rule: format)")]
    Format {
        /// The trace file.
        path: PathBuf,
        /// What the file says, if anything.
        found: Option<String>,
    },
    /// A required metadata key is absent.
    #[error("{path}: required metadata key `{key}` is missing (rule: required keys)")]
    MissingKey {
        /// The trace file.
        path: PathBuf,
        /// The key.
        key: &'static str,
    },
    /// A metadata value does not parse as the type the contract requires.
    #[error("{path}: metadata `{key}` = {value:?} is not {expected} (rule: metadata types)")]
    BadValue {
        /// The trace file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// The value found.
        value: String,
        /// What it should have been.
        expected: &'static str,
    },
    /// `n_heads % n_kv_heads != 0`, or a dimension is zero.
    #[error("{path}: n_heads = {n_heads} is not a positive multiple of n_kv_heads = {n_kv_heads} (rule: grouped-query heads)")]
    Heads {
        /// The trace file.
        path: PathBuf,
        /// Query heads.
        n_heads: usize,
        /// Key/value heads.
        n_kv_heads: usize,
    },
    /// A tensor the contract requires is absent.
    #[error("{path}: tensor `{tensor}` is missing (rule: tensors)")]
    MissingTensor {
        /// The trace file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor has a dtype the contract does not allow.
    #[error("{path}: tensor `{tensor}` has dtype {found}, expected {expected} (rule: dtype)")]
    Dtype {
        /// The trace file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype found.
        found: String,
        /// What is allowed.
        expected: String,
    },
    /// A tensor has the wrong shape (this includes layers of different length T).
    #[error("{path}: tensor `{tensor}` has shape {found:?}, expected {expected:?} (rule: {rule})")]
    Shape {
        /// The trace file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The shape found.
        found: Vec<usize>,
        /// The shape required.
        expected: Vec<usize>,
        /// Which rule: `shape` or `same T in every layer`.
        rule: &'static str,
    },
    /// `prompt_len` is 0 or beyond T.
    #[error("{path}: prompt_len = {prompt_len} is outside 1..={n_positions} (rule: 0 < prompt_len <= T)")]
    PromptLen {
        /// The trace file.
        path: PathBuf,
        /// The declared prompt length.
        prompt_len: usize,
        /// T, the number of positions.
        n_positions: usize,
    },
    /// A span is malformed or lies outside the trace.
    #[error("{path}: metadata `spans`: {detail} (rule: spans are half-open ranges inside [0, T))")]
    Spans {
        /// The trace file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The header's `reconstruction` key does not describe a reconstruction pass.
    #[error("{path}: metadata `reconstruction`: {rule} (rule: reconstruction pass)")]
    Reconstruction {
        /// The trace file.
        path: PathBuf,
        /// What is wrong.
        rule: String,
    },
    /// A tensor holds NaN or an infinity.
    #[error("{path}: tensor `{tensor}` holds a non-finite value ({value}) at flat index {index} (rule: finite values)")]
    NonFinite {
        /// The trace file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The flat element index.
        index: usize,
        /// The value, as text.
        value: String,
    },
    /// A layer index beyond `n_layers` was asked for.
    #[error("{path}: layer {layer} requested, the trace has {n_layers} layers")]
    NoSuchLayer {
        /// The trace file.
        path: PathBuf,
        /// The requested layer.
        layer: usize,
        /// Layers in the trace.
        n_layers: usize,
    },
    /// Writing a trace failed.
    #[error("{path}: cannot write trace: {detail}")]
    Write {
        /// The destination.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
}
