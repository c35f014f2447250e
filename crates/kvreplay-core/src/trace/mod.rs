//! The kvtrace/1 file format (`docs/trace-format.md`): one safetensors file holding, for
//! every layer, the post-rotary query, key and (optionally) value vectors of every position.
//!
//! The reader is strict: it checks every rule of the contract before handing anything out, and it
//! memory-maps the file and converts one layer at a time to f32, so replaying a trace never needs
//! more than one layer in memory. The writer is exact: what it writes, the reader accepts, and
//! the round trip is bit-identical for f32 storage.

mod error;
mod header;
mod inputs;
mod layers;
mod meta;
mod reader;
mod reconstruction;
mod writer;

pub use error::TraceError;
pub use header::read_header;
pub use inputs::{
    AttentionWeights, LayerInputs, Projection, QkNorms, PROJECTIONS, QK_NORMS, QK_NORM_EPS,
};
pub use layers::{layer_kind, layer_kinds, ranges};
pub use meta::{Span, TraceMeta, FORMAT};
pub use reader::{LayerTensors, TensorLocation, TraceReader};
pub use reconstruction::{Chunk, LayerReconstruction, Reconstruction};
pub use writer::{
    trace_bytes, write_trace, Extras, InputsSource, LayerArrays, LayerSource, PassRows,
    ReconstructionSource, StorageDtype, TraceWriter,
};
