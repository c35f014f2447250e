//! How a policy's caches store their kept entries ([`Storage`]): as captured, quantized (a
//! [`quantizer`](super::quantizer)), with pruned key channels ([`channels`](super::channels)), or
//! with evicted values merged into them ([`merge`](super::merge)),
//! the bytes each takes at the prompt's cut, and what a cache that stores otherwise than captured
//! holds step by step ([`HeldCache`]), which the metrics read their attention from.

use super::channels::{ChannelPruning, PrunedKeys};
use super::merge::{DecodeMerge, ValueMerge};
use super::quantizer::{self, QuantizedCache, Scheme};
use super::{LayerContext, Unit};
use ndarray::ArrayView2;

/// How a policy's caches store their kept entries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Storage {
    /// Keys and values as captured.
    Captured,
    /// Quantized by a scheme.
    Quantized(Scheme),
    /// Keys without some channels.
    PrunedKeys(ChannelPruning),
    /// Evicted values merged into kept ones at the prompt's cut.
    Merged(ValueMerge),
    /// Evicted values merged into kept ones at each compression while decoding.
    MergedWhileDecoding(DecodeMerge),
}

impl Storage {
    /// Whether the cache holds its entries as captured.
    pub fn is_captured(&self) -> bool {
        *self == Storage::Captured
    }

    /// Whether its attention is the full one renormalised over the kept positions and its bytes
    /// those of its entries as captured: as captured, or with merged values (keys as captured,
    /// nothing stored beside the entries).
    pub fn keeps_captured_keys(&self) -> bool {
        matches!(
            self,
            Storage::Captured | Storage::Merged(_) | Storage::MergedWhileDecoding(_)
        )
    }

    /// Whether it folds evicted values into kept ones (so the trace must hold values).
    pub fn merges(&self) -> bool {
        matches!(self, Storage::Merged(_) | Storage::MergedWhileDecoding(_))
    }

    /// Bytes one cache holds right after the prompt's cut when it keeps `n` entries of head size
    /// `d` at full-precision width `width` (bytes): what a budget in bytes is resolved against
    /// ([`HeldCache::bytes`] counts the same while decoding).
    pub fn bytes_at_cut(&self, n: usize, d: usize, width: usize) -> f64 {
        match self {
            Storage::Captured | Storage::Merged(_) | Storage::MergedWhileDecoding(_) => {
                quantizer::bytes_at_cut(None, n, d, width)
            }
            Storage::Quantized(scheme) => quantizer::bytes_at_cut(Some(scheme), n, d, width),
            Storage::PrunedKeys(pruning) => pruning.bytes_at_cut(n, d, width),
        }
    }
}

/// What one cache holds, step by step, when it stores its entries otherwise than captured.
#[derive(Debug, Clone)]
pub enum HeldCache<'a> {
    /// A quantizing cache.
    Quantized(QuantizedCache),
    /// A channel-pruning cache.
    PrunedKeys(PrunedKeys<'a>),
}

impl<'a> HeldCache<'a> {
    /// An empty cache of `unit` in `layer` under `storage`; `None` for a cache whose keys are as
    /// captured (as captured, or merging: the metrics read its merged values directly).
    pub fn new(storage: Storage, layer: &LayerContext<'a>, unit: &Unit) -> Option<Self> {
        match storage {
            Storage::Captured | Storage::Merged(_) | Storage::MergedWhileDecoding(_) => None,
            Storage::Quantized(scheme) => Some(HeldCache::Quantized(QuantizedCache::new(
                scheme,
                layer.keys(unit.kv_head),
                layer.values(unit.kv_head),
            ))),
            Storage::PrunedKeys(pruning) => {
                Some(HeldCache::PrunedKeys(PrunedKeys::new(pruning, layer, unit)))
            }
        }
    }

    /// Brings the cache to hold `held` (ascending) at the step whose new token is `newest`.
    pub fn step(&mut self, held: &[usize], newest: usize) {
        match self {
            HeldCache::Quantized(cache) => {
                cache.step(held, newest);
            }
            HeldCache::PrunedKeys(cache) => cache.step(held),
        }
    }

    /// The keys as held, `[T, d]`.
    pub fn keys(&self) -> ArrayView2<'_, f32> {
        match self {
            HeldCache::Quantized(cache) => cache.keys(),
            HeldCache::PrunedKeys(cache) => cache.keys(),
        }
    }

    /// The values as held, when the trace has them.
    pub fn values(&self) -> Option<ArrayView2<'_, f32>> {
        match self {
            HeldCache::Quantized(cache) => cache.values(),
            HeldCache::PrunedKeys(cache) => cache.values(),
        }
    }

    /// Bytes the cache holds: keys and values of head size `d`, full precision at `width` bytes.
    pub fn bytes(&self, d: usize, width: usize) -> f64 {
        match self {
            HeldCache::Quantized(cache) => cache.bytes(d, width),
            HeldCache::PrunedKeys(cache) => cache.bytes(d, width),
        }
    }
}
