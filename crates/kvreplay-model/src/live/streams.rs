//! A policy that evicts while the model runs (`streaming`, `prefill-then-stream`, `per-step`,
//! `per-step-prompt`), holding the live model's cache. At each layer the chunk's new q, k, v join
//! the layer's live vectors; each cache's [`CacheStream`] (the code the open-loop replay runs)
//! takes the chunk's positions one at a time, exactly as if the tokens came one by one; and each
//! query attends over what its cache held at its own step. A prompt chunk therefore costs one
//! masked prefill, not one forward pass per token: a causal policy's choices in a layer depend
//! only on that layer's vectors so far, which the chunk's earlier layers have already made.

use crate::model::{AttentionMask, ChunkVectors, ModelError};
use crate::replay::merge::Eviction;
use crate::replay::{
    selection_groups, units, Attended, CacheStream, LayerContext, MethodFailed, Unit, ValidPolicy,
};
use ndarray::{s, Array3};
use rayon::prelude::*;

/// One layer's live vectors, `[heads, capacity, d]`, filled up to `len` positions, and its
/// caches' streams (started when the layer first runs).
#[derive(Clone)]
struct LiveLayer {
    q: Array3<f32>,
    k: Array3<f32>,
    v: Array3<f32>,
    len: usize,
    /// Per selection group: its caches and their stream.
    streams: LayerStreams,
}

/// Where streams stood after some position: each layer's positions held and its streams. The
/// live vectors they read are those positions', which a run going on from there only writes
/// after.
pub struct StreamsState(Vec<(usize, LayerStreams)>);

/// A layer's streams: each one's units and its stream.
type LayerStreams = Vec<(Vec<Unit>, CacheStream)>;

/// Shapes and softmax settings of the model's attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key-value heads.
    pub n_kv_heads: usize,
    /// Size of one head's vectors.
    pub head_dim: usize,
    /// What the logits are multiplied by before the softmax.
    pub scale: f32,
    /// The attention logits' soft cap `c` (`c · tanh(x / c)`), where the model has one.
    pub softcap: Option<f32>,
}

/// A streaming or re-selecting policy holding the model's cache.
pub struct LiveStreams<'p> {
    policy: &'p ValidPolicy,
    /// The allocator's budget for each layer.
    budgets: Vec<usize>,
    /// Each layer's rotary base, when the trace gives one.
    rope_thetas: Vec<Option<f32>>,
    /// Each layer's attention window (0: global).
    windows: Vec<usize>,
    shape: AttentionShape,
    prompt_len: usize,
    layers: Vec<LiveLayer>,
}

impl<'p> LiveStreams<'p> {
    /// `policy` with each layer's budget, rotary base and attention window, for a prompt of
    /// `prompt_len` tokens and at most `capacity` positions in all.
    pub fn new(
        policy: &'p ValidPolicy,
        (budgets, rope_thetas, windows): (Vec<usize>, Vec<Option<f32>>, Vec<usize>),
        shape: AttentionShape,
        prompt_len: usize,
        capacity: usize,
    ) -> Self {
        let layer = || LiveLayer {
            q: Array3::zeros((shape.n_heads, capacity, shape.head_dim)),
            k: Array3::zeros((shape.n_kv_heads, capacity, shape.head_dim)),
            v: Array3::zeros((shape.n_kv_heads, capacity, shape.head_dim)),
            len: 0,
            streams: Vec::new(),
        };
        Self {
            policy,
            layers: budgets.iter().map(|_| layer()).collect(),
            budgets,
            rope_thetas,
            windows,
            shape,
            prompt_len,
        }
    }
}

impl<'p> LiveStreams<'p> {
    /// The policy.
    pub fn policy(&self) -> &'p ValidPolicy {
        self.policy
    }

    /// A second continuation of the prompt these streams hold (the teacher-forced one beside
    /// the free-running one): a copy of their streams, with their live vectors, which it takes
    /// from these until [`rejoin`](Self::rejoin) gives them back, so that the prompt's vectors
    /// are held and written once for both (3.8 GB for the 32 streaming calibration runs of a
    /// ~1K SmolLM2 prompt).
    pub fn fork(&mut self) -> Self {
        self.taken(|streams| streams.clone())
    }

    /// These streams, handed over whole to a continuation that replaces them: they keep neither
    /// their live vectors nor their streams' state ([`fork`](Self::fork) without the copy).
    pub fn handed_over(&mut self) -> Self {
        self.taken(std::mem::take)
    }

    /// A continuation taking these streams' live vectors, each layer's streams as `streams`
    /// gives them.
    fn taken(&mut self, streams: fn(&mut LayerStreams) -> LayerStreams) -> Self {
        let layers = self
            .layers
            .iter_mut()
            .map(|layer| LiveLayer {
                q: std::mem::take(&mut layer.q),
                k: std::mem::take(&mut layer.k),
                v: std::mem::take(&mut layer.v),
                len: layer.len,
                streams: streams(&mut layer.streams),
            })
            .collect();
        Self {
            layers,
            budgets: self.budgets.clone(),
            rope_thetas: self.rope_thetas.clone(),
            windows: self.windows.clone(),
            ..*self
        }
    }

    /// These streams as [`new`](Self::new) makes them, in the memory they hold: no position fed.
    pub fn restarted(mut self) -> Self {
        for layer in &mut self.layers {
            layer.len = 0;
            layer.streams.clear();
        }
        self
    }

    /// Where these streams stand now, to go back to ([`rewind`](Self::rewind)).
    pub fn state(&self) -> StreamsState {
        StreamsState(
            self.layers
                .iter()
                .map(|layer| (layer.len, layer.streams.clone()))
                .collect(),
        )
    }

    /// Back to `state`, taken from these streams before they ran on: the vectors appended since
    /// lie after its positions, and these write over them as they run on again.
    pub fn rewind(&mut self, state: StreamsState) {
        for (layer, (len, streams)) in self.layers.iter_mut().zip(state.0) {
            (layer.len, layer.streams) = (len, streams);
        }
    }

    /// Takes back the live vectors `fork` took, once it has run. What it appended lies after
    /// the positions these hold, and these write over it as they run on.
    pub fn rejoin(&mut self, fork: Self) {
        for (layer, forked) in self.layers.iter_mut().zip(fork.layers) {
            (layer.q, layer.k, layer.v) = (forked.q, forked.k, forked.v);
        }
    }

    /// The compressions the caches of `layer` made while decoding since the last call, each
    /// group's with the KV heads of its caches (for a merge that folds what they evict).
    pub fn take_evictions(&mut self, layer: usize) -> Vec<(Vec<usize>, Vec<Eviction>)> {
        self.layers[layer]
            .streams
            .iter_mut()
            .filter_map(|(group, stream)| {
                let evictions = stream.take_evictions()?;
                Some((group.iter().map(|unit| unit.kv_head).collect(), evictions))
            })
            .collect()
    }
}

impl LiveLayer {
    /// Appends the chunk's vectors after the `len` positions already held.
    fn append(&mut self, chunk: &ChunkVectors<'_>) -> Result<(), ModelError> {
        let n = chunk.q.dim().1;
        if chunk.past != self.len || self.len + n > self.q.dim().1 {
            return Err(ModelError::Mask(format!(
                "live layer holds {} of {} positions; a chunk of {n} came after {}",
                self.len,
                self.q.dim().1,
                chunk.past
            )));
        }
        let rows = s![.., self.len..self.len + n, ..];
        self.q.slice_mut(rows).assign(&chunk.q);
        self.k.slice_mut(rows).assign(&chunk.k);
        self.v.slice_mut(rows).assign(&chunk.v);
        self.len += n;
        Ok(())
    }
}

impl LiveStreams<'_> {
    /// Takes `chunk` (a prompt's vectors, a layer's own or recorded ones) at `layer` as
    /// [`layer_mask`](AttentionMask::layer_mask) does, without the mask: the first of its queries
    /// (its row) that loses sight of a position up to its own, if any.
    pub fn first_hiding_query(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<usize>, ModelError> {
        let attended = self.attended(layer, chunk)?;
        let rows = chunk.q.dim().1;
        Ok((0..rows).find(|&row| {
            let position = chunk.past + row;
            attended.iter().any(|group| group[row].hides_any(position))
        }))
    }

    /// Appends `chunk` at `layer` (its streams started on the first) and steps each selection
    /// group's stream through its positions: per group, what each of its queries attends over.
    fn attended(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Vec<Vec<Attended>>, ModelError> {
        let (policy, budget, shape) = (self.policy, self.budgets[layer], self.shape);
        let live = &mut self.layers[layer];
        live.append(chunk)?;
        let end = live.len;
        let context = LayerContext {
            layer,
            q: live.q.slice(s![.., ..end, ..]),
            k: live.k.slice(s![.., ..end, ..]),
            v: Some(live.v.slice(s![.., ..end, ..])),
            prompt_len: self.prompt_len,
            scale: shape.scale,
            softcap: shape.softcap,
            rope_theta: self.rope_thetas[layer],
            window: self.windows[layer],
            inputs: None,
            reconstruction: None,
        };
        if live.streams.is_empty() {
            let units = units(&context, policy);
            live.streams = selection_groups(&units, policy)
                .into_iter()
                .map(|group| {
                    let stream = CacheStream::start(&context, group, budget, policy)?;
                    Ok((group.to_vec(), stream))
                })
                .collect::<Result<_, MethodFailed>>()?;
        }
        let positions = chunk.past..end;
        let attended: Vec<Result<Vec<Attended>, MethodFailed>> = live
            .streams
            .par_iter_mut()
            .map(|(_, stream)| {
                positions
                    .clone()
                    .map(|position| {
                        let attended = stream.push(&context, position, true)?;
                        Ok(attended.expect("every step is reported when asked"))
                    })
                    .collect()
            })
            .collect();
        Ok(attended.into_iter().collect::<Result<_, _>>()?)
    }
}

impl AttentionMask for LiveStreams<'_> {
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let attended = self.attended(layer, chunk)?;
        let live = &self.layers[layer];
        let (end, n_heads) = (live.len, self.shape.n_heads);
        let n = end - chunk.past;
        let mut mask = crate::model::mask_buffers::filled(n_heads * n * end, f32::NEG_INFINITY);
        for ((group, _), rows) in live.streams.iter().zip(&attended) {
            for head in group.iter().flat_map(|unit| unit.query_heads.clone()) {
                for (row, seen) in rows.iter().enumerate() {
                    let start = (head * n + row) * end;
                    let line = &mut mask[start..start + end];
                    match seen {
                        Attended::Prefix => line[..=chunk.past + row].fill(0.0),
                        Attended::Entries(entries) => {
                            for &position in entries {
                                line[position] = 0.0;
                            }
                        }
                    }
                }
            }
        }
        Ok(Some(mask))
    }
}
