//! Which cached positions each query attends over, decided layer by layer while the forward pass
//! runs: how a KV-cache policy holds the model's real cache. The cache keeps every key; a policy's
//! evictions are masks, so each query head can keep its own set and positions keep their rotation.
//! A policy that stores its entries otherwise than captured (quantized, pruned, merged) also
//! rewrites them in the cache before a chunk attends ([`Rewrite`]).

use super::ModelError;
use ndarray::{Array3, ArrayView3};

/// Entries of one layer's cache that a policy stores otherwise than the model wrote them (a
/// quantizing cache's dequantized vectors, keys without their pruned channels, merged values):
/// the new contents of `positions` (ascending, each before the chunk being run), keys and values
/// `[n_kv_heads, positions.len(), d]` for every KV head.
#[derive(Debug, Clone, PartialEq)]
pub struct Rewrite {
    /// The positions rewritten, ascending.
    pub positions: Vec<usize>,
    /// Their keys as stored.
    pub keys: Array3<f32>,
    /// Their values as stored.
    pub values: Array3<f32>,
}

/// A chunk's vectors at one layer, as attention is about to use them: post-rotary queries
/// `[n_heads, n, d]`, post-rotary keys and values `[n_kv_heads, n, d]`, for positions
/// `past..past + n`.
pub struct ChunkVectors<'a> {
    /// The positions before the chunk (all of them cached).
    pub past: usize,
    /// Queries.
    pub q: ArrayView3<'a, f32>,
    /// Keys.
    pub k: ArrayView3<'a, f32>,
    /// Values.
    pub v: ArrayView3<'a, f32>,
}

/// A policy deciding, at each layer of a forward pass, what every query of the chunk attends
/// over. (The rows of a batched pass attend on worker threads, each with its own mask.)
pub trait AttentionMask: Send {
    /// The additive mask `[n_heads, n, past + n]` of layer `layer` (0 where a query attends,
    /// −∞ elsewhere, never a position after the query's own), or `None` for the causal mask.
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError>;

    /// What the chunk whose mask [`layer_mask`](Self::layer_mask) just gave for layer `layer`
    /// reads from the cache otherwise than the model wrote it: written over those entries before
    /// the chunk's queries attend. `None` (the default): the cache as the model wrote it.
    fn rewrite(&mut self, _layer: usize) -> Option<Rewrite> {
        None
    }
}

/// What `policy` (when there is one) decides for layer `layer` of a chunk whose first position is
/// `past`, given its q, k, v as the forward pass made them.
pub(crate) fn policy_mask(
    policy: Option<&mut (dyn AttentionMask + '_)>,
    layer: usize,
    past: usize,
    (q, k, v): (
        &candle_core::Tensor,
        &candle_core::Tensor,
        &candle_core::Tensor,
    ),
) -> Result<Option<Vec<f32>>, ModelError> {
    let Some(policy) = policy else {
        return Ok(None);
    };
    let (q, k, v) = (to_array(q)?, to_array(k)?, to_array(v)?);
    let chunk = ChunkVectors {
        past,
        q: q.view(),
        k: k.view(),
        v: v.view(),
    };
    policy.layer_mask(layer, &chunk)
}

/// Per layer, per query head, the positions a policy has evicted: a fixed set, masked in every
/// query of every chunk (a prefill-time eviction, applied while decoding).
pub type Evicted = Vec<Vec<Vec<usize>>>;

impl AttentionMask for Evicted {
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(heads) = self.get(layer) else {
            return Ok(None);
        };
        let (n_heads, n, _) = chunk.q.dim();
        let total = chunk.past + n;
        let mut mask = causal_mask(n_heads, chunk.past, n);
        for (head, evicted) in heads.iter().enumerate().take(n_heads) {
            for &position in evicted {
                for row in 0..n {
                    mask[(head * n + row) * total + position] = f32::NEG_INFINITY;
                }
            }
        }
        Ok(Some(mask))
    }
}

/// The causal mask `[n_heads, n, past + n]`: row `i` (position `past + i`) sees positions
/// `0..=past + i`.
pub fn causal_mask(n_heads: usize, past: usize, n: usize) -> Vec<f32> {
    let total = past + n;
    let mut mask = super::mask_buffers::with_capacity(n_heads * n * total);
    for _ in 0..n_heads {
        for row in 0..n {
            mask.extend((0..total).map(|j| {
                if j > past + row {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            }));
        }
    }
    mask
}

/// The mask `[n, total - first]` of a chunk of `n` queries at positions `past..past + n` over
/// cached positions `first..past + n` in a layer that attends over its last `window` positions
/// (its own included; `window = 0` is global): row `i` sees position `j` when
/// `j <= past + i` and `past + i - j < window`. The reference the fused softmax passes are held
/// to ([`ChunkMask`](super::masked_softmax::ChunkMask)'s tensor).
#[cfg(test)]
pub fn window_mask(past: usize, n: usize, window: usize, first: usize) -> Vec<f32> {
    let total = past + n;
    let mut mask = Vec::with_capacity(n * (total - first));
    for row in 0..n {
        let position = past + row;
        mask.extend((first..total).map(|j| {
            let seen = j <= position && (window == 0 || position - j < window);
            if seen {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        }));
    }
    mask
}

/// A tensor of `[heads, n, d]` as an ndarray, for [`ChunkVectors`].
pub(crate) fn to_array(tensor: &candle_core::Tensor) -> Result<Array3<f32>, ModelError> {
    let dims = tensor.dims3()?;
    let values = tensor.flatten_all()?.to_vec1::<f32>()?;
    Ok(Array3::from_shape_vec(dims, values).expect("dims match the values"))
}
