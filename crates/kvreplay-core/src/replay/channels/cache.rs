//! One cache's keys as a channel-pruning cache holds them, step by step: at the first decode step
//! (the prompt's cut) the channels are chosen from the prompt entries the cache then holds, and
//! those channels of every prompt key read as zero from then on (what a query gets from a
//! channel that is not stored); keys that arrive later keep every channel.

use super::{mask_bytes, ChannelPruning};
use crate::replay::{LayerContext, Unit};
use ndarray::{s, Array2, ArrayView2};

/// A channel-pruning cache over one KV head's keys and (when the trace has them) values; the
/// values are the trace's, read in place.
#[derive(Debug, Clone)]
pub struct PrunedKeys<'a> {
    pruning: ChannelPruning,
    /// The scoring queries, one `[window, d]` block per query head reading the cache.
    queries: Vec<Array2<f32>>,
    keys: Array2<f32>,
    values: Option<ArrayView2<'a, f32>>,
    /// Where the prompt ends: positions before it are the prompt's.
    cut: usize,
    /// The pruned channels, once chosen at the cut.
    pruned: Option<Vec<usize>>,
    /// Held positions before the cut, and after it.
    held: (usize, usize),
}

impl<'a> PrunedKeys<'a> {
    /// An empty cache of `unit` in `layer`, pruning as `pruning` says at the layer's cut.
    pub fn new(pruning: ChannelPruning, layer: &LayerContext<'a>, unit: &Unit) -> Self {
        let cut = layer.prompt_len;
        let first = cut.saturating_sub(pruning.window);
        let queries = unit
            .query_heads
            .clone()
            .map(|head| layer.q.slice(s![head, first..cut, ..]).to_owned())
            .collect();
        Self {
            pruning,
            queries,
            keys: layer.keys(unit.kv_head).to_owned(),
            values: layer.values(unit.kv_head),
            cut,
            pruned: None,
            held: (0, 0),
        }
    }

    /// Brings the cache to hold `held` (ascending); at the first call the channels are chosen
    /// from the prompt positions among `held` and pruned from every prompt key.
    pub fn step(&mut self, held: &[usize]) {
        let prompt = held.partition_point(|&j| j < self.cut);
        if self.pruned.is_none() {
            let queries: Vec<ArrayView2<f32>> = self.queries.iter().map(Array2::view).collect();
            let prompt_keys = self.keys.slice_mut(s![..self.cut, ..]);
            let channels = self
                .pruning
                .prune_prompt(&queries, prompt_keys, &held[..prompt]);
            self.pruned = Some(channels);
        }
        self.held = (prompt, held.len() - prompt);
    }

    /// The channels pruned at the cut (empty before it).
    pub fn pruned_channels(&self) -> &[usize] {
        self.pruned.as_deref().unwrap_or_default()
    }

    /// The keys as held, `[T, d]`.
    pub fn keys(&self) -> ArrayView2<'_, f32> {
        self.keys.view()
    }

    /// The values as held (as captured), when the trace has them.
    pub fn values(&self) -> Option<ArrayView2<'_, f32>> {
        self.values.as_ref().map(ArrayView2::view)
    }

    /// Bytes the cache holds: values whole, prompt keys without their pruned channels, later keys
    /// whole, at `width` bytes an element, and the channel mask.
    pub fn bytes(&self, d: usize, width: usize) -> f64 {
        let (prompt, later) = self.held;
        let kept_channels = d - self.pruned_channels().len();
        ((prompt * (d + kept_channels) + later * 2 * d) * width) as f64 + mask_bytes(d)
    }
}
