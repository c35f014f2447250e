//! A trace's optional reconstruction pass (`docs/trace-format.md`, "Reconstruction pass"): what
//! KVzip (Kim et al., 2025, arXiv:2505.23416) scores keys by. After the prompt up to a cut, the
//! model is asked to repeat its context, chunk by chunk, and the repetition is teacher-forced: each
//! chunk's rows (KVzip's repeat instruction, then the chunk's own tokens) run on the full cache of
//! `[0, cut)`, every chunk from that same cache. The trace keeps each layer's queries and keys of
//! those rows; the header's `reconstruction` key says which context span each chunk repeats.
//!
//! The group is all or nothing: the header key, `reconstruction.tokens` and every layer's
//! `reconstruction.q` and `reconstruction.k`, or none of them. Every rule is checked when the
//! trace is opened; the values are read (and checked finite) only when asked for.

use super::inputs::float_dtype;
use super::{TraceError, TraceMeta};
use ndarray::Array3;
use safetensors::tensor::{Dtype, Metadata};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;

/// The header key that lists the chunks.
pub const HEADER_KEY: &str = "reconstruction";

/// One chunk of the pass: the context span it repeats and how many rows it ran (its instruction
/// and template tokens, then the span's own tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The positions of the context it repeats.
    pub context: Range<usize>,
    /// Its rows, stored one chunk after another; row `i` of a chunk sits at position `cut + i`.
    pub rows: usize,
}

/// The chunks of a trace's reconstruction pass, in order: their spans tile `[start, cut)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconstruction {
    /// The chunks.
    pub chunks: Vec<Chunk>,
}

/// The header value: `{"chunks": [[start, end, rows], ...]}`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    chunks: Vec<[usize; 3]>,
}

impl Reconstruction {
    /// The first position it repeats.
    pub fn start(&self) -> usize {
        self.chunks.first().map_or(0, |c| c.context.start)
    }

    /// The cut it was run at: the end of the last chunk's span.
    pub fn cut(&self) -> usize {
        self.chunks.last().map_or(0, |c| c.context.end)
    }

    /// All rows of all chunks.
    pub fn rows(&self) -> usize {
        self.chunks.iter().map(|c| c.rows).sum()
    }

    /// Each chunk's first row among all rows.
    pub fn row_offsets(&self) -> Vec<usize> {
        self.chunks
            .iter()
            .scan(0, |offset, chunk| {
                let at = *offset;
                *offset += chunk.rows;
                Some(at)
            })
            .collect()
    }

    /// The header value that records it.
    pub fn header_value(&self) -> String {
        let chunks = self
            .chunks
            .iter()
            .map(|c| [c.context.start, c.context.end, c.rows])
            .collect();
        serde_json::to_string(&Header { chunks }).expect("plain numbers")
    }

    /// The pass recorded in `meta`'s header, if any, checked: chunks tile a span ascending, each
    /// repeats at least one position and runs at least as many rows as it repeats, and the cut
    /// lies inside the trace's `n_positions`. The message names the rule.
    pub fn from_meta(meta: &TraceMeta, n_positions: usize) -> Result<Option<Self>, String> {
        let Some(value) = meta.extra.get(HEADER_KEY) else {
            return Ok(None);
        };
        let header: Header = serde_json::from_str(value).map_err(|err| {
            format!("`{HEADER_KEY}` must be {{\"chunks\": [[start, end, rows], ...]}}: {err}")
        })?;
        let chunks: Vec<Chunk> = header
            .chunks
            .iter()
            .map(|&[start, end, rows]| Chunk {
                context: start..end,
                rows,
            })
            .collect();
        if chunks.is_empty() {
            return Err(format!("`{HEADER_KEY}` lists no chunk"));
        }
        for (index, chunk) in chunks.iter().enumerate() {
            let follows = index == 0 || chunks[index - 1].context.end == chunk.context.start;
            if chunk.context.is_empty() || chunk.rows < chunk.context.len() || !follows {
                return Err(format!(
                    "`{HEADER_KEY}` chunk {index} [{}, {}, {}]: each chunk repeats at least one position, starts where the one before ends, and runs at least as many rows as it repeats",
                    chunk.context.start, chunk.context.end, chunk.rows
                ));
            }
        }
        let pass = Self { chunks };
        if pass.cut() >= n_positions {
            return Err(format!(
                "`{HEADER_KEY}` repeats up to position {}, and the trace has {n_positions} (the cut must leave a position to decode)",
                pass.cut()
            ));
        }
        Ok(Some(pass))
    }
}

/// One layer's reconstruction rows, converted to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReconstruction {
    /// The chunks the rows belong to.
    pub pass: Reconstruction,
    /// Queries `[n_heads, rows, head_dim]`, after the rotary.
    pub q: Array3<f32>,
    /// Keys `[n_kv_heads, rows, head_dim]`, after the rotary.
    pub k: Array3<f32>,
}

/// The names of layer `layer`'s reconstruction tensors.
pub(super) fn layer_names(layer: usize) -> [String; 2] {
    [
        format!("layers.{layer}.{HEADER_KEY}.q"),
        format!("layers.{layer}.{HEADER_KEY}.k"),
    ]
}

/// The name of the reconstruction's token ids.
pub const TOKENS: &str = "reconstruction.tokens";

/// The reconstruction pass of a trace whose header lists one, after checking every one of its
/// tensors against it; `None` when it has none.
pub(super) fn check(
    path: &Path,
    header: &Metadata,
    meta: &TraceMeta,
    (n_positions, storage): (usize, Dtype),
) -> Result<Option<Reconstruction>, TraceError> {
    let pass = Reconstruction::from_meta(meta, n_positions).map_err(|rule| {
        TraceError::Reconstruction {
            path: path.to_owned(),
            rule,
        }
    })?;
    let shape_error = |tensor: String, found: Vec<usize>, expected: Vec<usize>| {
        TraceError::Shape {
        path: path.to_owned(),
        tensor,
        found,
        expected,
        rule: "reconstruction pass: the header's `reconstruction` key, `reconstruction.tokens` [rows] and every layer's `reconstruction.q` [n_heads, rows, head_dim] and `reconstruction.k` [n_kv_heads, rows, head_dim] in the trace's dtype, or none of them",
    }
    };
    let Some(pass) = pass else {
        let stray = std::iter::once(TOKENS.to_string())
            .chain((0..meta.n_layers).flat_map(layer_names))
            .find(|name| header.info(name).is_some());
        return match stray {
            Some(name) => {
                let found = header.info(&name).map(|info| info.shape.clone());
                Err(shape_error(name, found.unwrap_or_default(), Vec::new()))
            }
            None => Ok(None),
        };
    };
    let rows = pass.rows();
    let tokens = header.info(TOKENS).ok_or_else(|| missing(path, TOKENS))?;
    if !matches!(tokens.dtype, Dtype::I32 | Dtype::I64) || tokens.shape != [rows] {
        return Err(shape_error(TOKENS.into(), tokens.shape.clone(), vec![rows]));
    }
    for layer in 0..meta.n_layers {
        let [q, k] = layer_names(layer);
        for (name, heads) in [(q, meta.n_heads), (k, meta.n_kv_heads)] {
            let info = header.info(&name).ok_or_else(|| missing(path, &name))?;
            let expected = vec![heads, rows, meta.head_dim];
            if !float_dtype(info.dtype) || info.dtype != storage || info.shape != expected {
                return Err(shape_error(name, info.shape.clone(), expected));
            }
        }
    }
    Ok(Some(pass))
}

fn missing(path: &Path, tensor: &str) -> TraceError {
    TraceError::MissingTensor {
        path: path.to_owned(),
        tensor: tensor.to_owned(),
    }
}
