//! What a scorer may look at: one layer's vectors, the trace geometry, and the cache unit it scores.

use crate::trace::{LayerInputs, LayerReconstruction, LayerTensors, TraceReader};
use ndarray::{s, Array3, ArrayView1, ArrayView2, ArrayView3, Axis};
use std::ops::Range;

/// One layer of a trace, as seen by scorers and metrics.
#[derive(Debug, Clone, Copy)]
pub struct LayerContext<'a> {
    /// Layer index.
    pub layer: usize,
    /// Queries `[n_heads, T, d]`.
    pub q: ArrayView3<'a, f32>,
    /// Keys `[n_kv_heads, T, d]`.
    pub k: ArrayView3<'a, f32>,
    /// Values `[n_kv_heads, T, d]`, when the trace has them.
    pub v: Option<ArrayView3<'a, f32>>,
    /// Positions `[0, prompt_len)` are the prompt.
    pub prompt_len: usize,
    /// Softmax scale.
    pub scale: f32,
    /// Logit soft-cap.
    pub softcap: Option<f32>,
    /// Base of the half-split rotary the queries and keys went through, when the trace says.
    pub rope_theta: Option<f32>,
    /// The layer's attention window: the query at position `t` attends over keys
    /// `t + 1 - window..=t` (0: every key up to its own, a global layer). Only a policy that
    /// compresses sliding-window layers (`layers = all`) is replayed on a layer with a window.
    pub window: usize,
    /// The layer's attention inputs (hidden states and projections), when the trace has them.
    pub inputs: Option<&'a LayerInputs>,
    /// The layer's rows of the reconstruction pass (KVzip's), when the trace has one.
    pub reconstruction: Option<&'a LayerReconstruction>,
}

impl<'a> LayerContext<'a> {
    /// T.
    pub fn n_positions(&self) -> usize {
        self.q.shape()[1]
    }

    /// The same layer with positions `end..` cut off: what a causal method may see when the
    /// newest token is `end - 1`.
    pub fn through(&self, end: usize) -> Self {
        Self {
            q: self.q.slice_move(s![.., ..end, ..]),
            k: self.k.slice_move(s![.., ..end, ..]),
            v: self.v.map(|v| v.slice_move(s![.., ..end, ..])),
            ..*self
        }
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.q.shape()[0] / self.k.shape()[0]
    }

    /// Query `position` of query head `head`.
    pub fn query(&self, head: usize, position: usize) -> ArrayView1<'a, f32> {
        self.q
            .index_axis_move(Axis(0), head)
            .index_axis_move(Axis(0), position)
    }

    /// The queries of `heads` at `position`, one owned row each (what `sparse_logits` takes).
    pub fn queries_at(&self, heads: Range<usize>, position: usize) -> Vec<Vec<f32>> {
        heads
            .map(|head| self.query(head, position).to_vec())
            .collect()
    }

    /// The first key the query at `position` attends to: 0 on a global layer.
    pub fn first_visible(&self, position: usize) -> usize {
        crate::attention::first_visible(position, self.window)
    }

    /// The positions a whole cache holds at the prompt's end: the prompt, or on a sliding-window
    /// layer the prompt's last `window` positions. A one-shot selection chooses among them.
    pub fn prompt_cache(&self) -> Range<usize> {
        self.first_visible(self.prompt_len.saturating_sub(1))..self.prompt_len
    }

    /// All keys of KV head `kv_head`, `[T, d]`.
    pub fn keys(&self, kv_head: usize) -> ArrayView2<'a, f32> {
        self.k.index_axis_move(Axis(0), kv_head)
    }

    /// The full causal attention of the decode queries of query heads `heads` (one GQA group or
    /// part of one), `[heads, T - prompt_len, T]`, over each query's window on a sliding-window
    /// layer: what metrics and the oracle allocator measure kept sets against.
    pub fn decode_attention(&self, heads: Range<usize>) -> Array3<f32> {
        let kv_head = heads.start / self.group_size();
        crate::attention::decode_attention(
            self.q.slice(s![heads, .., ..]),
            self.keys(kv_head),
            self.prompt_len,
            self.window,
            self.scale,
            self.softcap,
        )
    }

    /// All values of KV head `kv_head`, `[T, d]`.
    pub fn values(&self, kv_head: usize) -> Option<ArrayView2<'a, f32>> {
        self.v.map(|v| v.index_axis_move(Axis(0), kv_head))
    }
}

/// One cache: a KV head with its group of query heads, or a single query head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// Index of the cache within the layer.
    pub index: usize,
    /// The KV head whose keys it holds.
    pub kv_head: usize,
    /// The query heads that read it.
    pub query_heads: Range<usize>,
}

impl Unit {
    /// The caches of a layer under a granularity.
    pub fn all(n_heads: usize, n_kv_heads: usize, per_query_head: bool) -> Vec<Unit> {
        let group = n_heads / n_kv_heads;
        if per_query_head {
            (0..n_heads)
                .map(|head| Unit {
                    index: head,
                    kv_head: head / group,
                    query_heads: head..head + 1,
                })
                .collect()
        } else {
            (0..n_kv_heads)
                .map(|kv_head| Unit {
                    index: kv_head,
                    kv_head,
                    query_heads: kv_head * group..(kv_head + 1) * group,
                })
                .collect()
        }
    }
}

/// Layer `layer` of `trace` as scorers and metrics see it.
pub fn context<'a>(
    trace: &TraceReader,
    layer: usize,
    tensors: &'a LayerTensors,
) -> LayerContext<'a> {
    let meta = trace.meta();
    LayerContext {
        layer,
        q: tensors.q.view(),
        k: tensors.k.view(),
        v: tensors.v.as_ref().map(|v| v.view()),
        prompt_len: meta.prompt_len,
        scale: meta.scale,
        softcap: meta.softcap,
        rope_theta: meta.rope_theta_of(layer),
        window: meta.window(layer),
        inputs: tensors.inputs.as_ref(),
        reconstruction: tensors.reconstruction.as_ref(),
    }
}
