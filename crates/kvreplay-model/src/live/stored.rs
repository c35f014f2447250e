//! A policy's cache stored otherwise than captured while the model runs: quantized, with pruned
//! key channels, or with evicted values merged into kept ones ([`Storage`]). The bookkeeping is
//! the open-loop replay's ([`QuantizedCache`], [`ChannelPruning::prune_prompt`],
//! [`ValueMerge::merge_into`], [`DecodeMergedValues`]), run over the running model's own vectors:
//! at each step from the prompt's cut on, the policy's mask says which positions each KV head's
//! cache holds, and what the storage then changes (entries quantized as they age, prompt keys
//! pruned or kept values merged at the cut, kept values merged at a compression while decoding)
//! is written over the model's cache before the step's queries attend ([`Rewrite`]). As in the
//! replay, a step's newest entry reads as captured at its own step, and the model's own vectors
//! are what gets quantized, pruned or merged; a merge while decoding sums each step's attention
//! from the model's own queries and keys.

use super::{LiveError, RecordedLayers};
use crate::attention::{first_visible, softmax_f64};
use crate::model::{AttentionMask, ChunkVectors, ModelError, Rewrite};
use crate::replay::channels::ChannelPruning;
use crate::replay::merge::{DecodeMergedValues, Eviction, ValueMerge};
use crate::replay::quantizer::QuantizedCache;
use crate::replay::{Storage, ValidPolicy};
use crate::trace::TraceMeta;
use ndarray::{s, Array2, Array3, ArrayView1, ArrayView2, Axis};

/// A policy's mask, and the storage of its caches on the layers the mask numbers (none when it
/// stores them as captured).
#[derive(Clone)]
pub(super) struct Stored<M> {
    inner: M,
    store: Option<Store>,
}

impl<M> Stored<M> {
    /// `inner` over caches stored as `store` says.
    pub fn new(inner: M, store: Option<Store>) -> Self {
        Self { inner, store }
    }

    /// The policy's mask.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The policy's mask, to change.
    pub fn inner_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// The policy's mask, unwrapped.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// A copy over the same storage, its mask made from this one by `fork`.
    pub fn fork_with(&mut self, fork: impl FnOnce(&mut M) -> M) -> Self {
        Self {
            inner: fork(&mut self.inner),
            store: self.store.clone(),
        }
    }

    /// Whether the caches hold their entries as the model wrote them.
    pub fn is_captured(&self) -> bool {
        self.store.is_none()
    }
}

/// A mask that notes the compressions its caches make while decoding, for a merge that folds
/// what they evict.
pub(super) trait NotesCompressions {
    /// The compressions made on `layer` since the last call: per selection group, the KV heads
    /// of its caches and its compressions, in order.
    fn compressions(&mut self, layer: usize) -> Vec<(Vec<usize>, Vec<Eviction>)>;
}

impl<M: AttentionMask + NotesCompressions> AttentionMask for Stored<M> {
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let mask = self.inner.layer_mask(layer, chunk)?;
        if let Some(store) = &mut self.store {
            let compressions = self.inner.compressions(layer);
            store.pending[layer] = store.step(layer, chunk, mask.as_deref(), compressions)?;
        }
        Ok(mask)
    }

    fn rewrite(&mut self, layer: usize) -> Option<Rewrite> {
        self.store.as_mut()?.pending[layer].take()
    }
}

/// The caches of a policy that stores its entries otherwise than captured, one per KV head of
/// each layer it compresses.
#[derive(Clone)]
pub(super) struct Store {
    /// Where the prompt's cut falls: the steps from there on are the replay's decode steps.
    cut: usize,
    /// Query heads per KV head.
    group: usize,
    /// Whether the policy re-selects at every step from the whole cache, which then holds every
    /// visible position.
    reselects: bool,
    /// Per layer (numbered as the policy's mask numbers them), its window (0: global) and its
    /// caches.
    layers: Vec<(usize, Vec<UnitStore>)>,
    /// Per layer, the rewrite of the chunk just masked.
    pending: Vec<Option<Rewrite>>,
}

impl Store {
    /// The caches of `policy` on the model layers `compressed` of a model of header `meta`, the
    /// prompt cut at `cut`, `capacity` positions at most; `None` when the policy stores its
    /// entries as captured. The vectors of positions before `recorded.1` come from the full run's
    /// recording (where the row starts from its cache); later ones from the chunks the model runs.
    pub fn new(
        policy: &ValidPolicy,
        (meta, compressed): (&TraceMeta, &[usize]),
        (cut, capacity): (usize, usize),
        recorded: (&RecordedLayers<'_>, usize),
    ) -> Result<Option<Self>, LiveError> {
        let storage = policy.storage();
        if storage.is_captured() {
            return Ok(None);
        }
        let group = meta.n_heads / meta.n_kv_heads;
        let (recorded, until) = recorded;
        let layers = compressed
            .iter()
            .map(|&layer| {
                let caches: Vec<UnitStore> = (0..meta.n_kv_heads)
                    .map(|kv_head| UnitStore::new(storage, (capacity, cut), meta, (layer, kv_head)))
                    .collect();
                let mut stored = (meta.window(layer), caches);
                if until > 0 {
                    let tensors = recorded.layer(layer)?;
                    let values = tensors.v.as_ref().expect("a live recording holds values");
                    for position in 0..until {
                        let chunk = s![.., position, ..];
                        record(
                            &mut stored.1,
                            group,
                            position,
                            (
                                tensors.q.slice(chunk),
                                tensors.k.slice(chunk),
                                values.slice(chunk),
                            ),
                        );
                    }
                }
                Ok(stored)
            })
            .collect::<Result<Vec<_>, LiveError>>()?;
        Ok(Some(Self {
            cut,
            group,
            reselects: policy.params().timing.reselects(),
            pending: vec![None; layers.len()],
            layers,
        }))
    }

    /// Records the chunk's vectors and the compressions its caches noted; at a step from the cut
    /// on, steps every cache of `layer` to what its query head's `mask` line holds and returns
    /// what changed.
    fn step(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
        mask: Option<&[f32]>,
        compressions: Vec<(Vec<usize>, Vec<Eviction>)>,
    ) -> Result<Option<Rewrite>, ModelError> {
        let n = chunk.q.dim().1;
        let (window, caches) = &mut self.layers[layer];
        for (kv_heads, evictions) in compressions {
            for kv_head in kv_heads {
                caches[kv_head].note(&evictions);
            }
        }
        for row in 0..n {
            let vectors = s![.., row, ..];
            let qkv = (
                chunk.q.slice(vectors),
                chunk.k.slice(vectors),
                chunk.v.slice(vectors),
            );
            record(caches, self.group, chunk.past + row, qkv);
        }
        let position = chunk.past + n - 1;
        if position < self.cut {
            return Ok(None);
        }
        if n != 1 {
            return Err(ModelError::Mask(format!(
                "a cache stored otherwise than captured steps one token at a time from the \
                 prompt's cut ({}); a chunk of {n} came at position {}",
                self.cut, chunk.past
            )));
        }
        let first = first_visible(position, *window);
        let mut changed = Vec::new();
        for (kv_head, cache) in caches.iter_mut().enumerate() {
            let line = mask
                .filter(|_| !self.reselects)
                .map(|mask| &mask[kv_head * self.group * (position + 1)..][..=position]);
            let held: Vec<usize> = (first..=position)
                .filter(|&j| line.is_none_or(|line| line[j] == 0.0))
                .collect();
            changed.extend(cache.step(&held, position, self.cut, *window));
        }
        changed.sort_unstable();
        changed.dedup();
        Ok((!changed.is_empty()).then(|| rewrite(caches, changed)))
    }
}

/// Sets position `position`'s vectors (q `[n_heads, d]`, k and v `[n_kv_heads, d]`) in the
/// caches of one layer, `group` query heads per KV head.
fn record(
    caches: &mut [UnitStore],
    group: usize,
    position: usize,
    (q, k, v): (ArrayView2<f32>, ArrayView2<f32>, ArrayView2<f32>),
) {
    for (kv_head, cache) in caches.iter_mut().enumerate() {
        let queries = q.slice(s![kv_head * group..(kv_head + 1) * group, ..]);
        cache.record(position, queries, (k.row(kv_head), v.row(kv_head)));
    }
}

/// The rewrite of `positions` (ascending) from every KV head's cache of a layer.
fn rewrite(caches: &[UnitStore], positions: Vec<usize>) -> Rewrite {
    let d = caches[0].row(positions[0]).0.len();
    let shape = (caches.len(), positions.len(), d);
    let (mut keys, mut values) = (Array3::zeros(shape), Array3::zeros(shape));
    for (kv_head, cache) in caches.iter().enumerate() {
        for (index, &j) in positions.iter().enumerate() {
            let (key, value) = cache.row(j);
            keys.slice_mut(s![kv_head, index, ..]).assign(&key);
            values.slice_mut(s![kv_head, index, ..]).assign(&value);
        }
    }
    Rewrite {
        positions,
        keys,
        values,
    }
}

/// One KV head's cache of one layer.
#[derive(Clone)]
enum UnitStore {
    /// Quantized as its entries age.
    Quantized(QuantizedCache),
    /// Its held prompt keys without the pruned channels from the cut on.
    PrunedKeys {
        pruning: ChannelPruning,
        /// Per query head of the group, the last `pruning.window` prompt queries, `[window, d]`.
        queries: Vec<Array2<f32>>,
        prompt: Prompt,
    },
    /// Its kept prompt values with the evicted ones merged in from the cut on.
    Merged { merge: ValueMerge, prompt: Prompt },
    /// Its values with what each compression while decoding evicts merged in, its keys and the
    /// newest step's queries (`[group, d]`) for the running attention.
    MergedWhileDecoding {
        merging: DecodeMergedValues,
        keys: Array2<f32>,
        queries: Array2<f32>,
        softmax: (f32, Option<f32>),
    },
}

/// The prompt's keys and values of one KV head, `[cut, d]`, and whether the cut has changed them.
#[derive(Clone)]
struct Prompt {
    keys: Array2<f32>,
    values: Array2<f32>,
    cut_done: bool,
}

impl UnitStore {
    fn new(
        storage: Storage,
        (capacity, cut): (usize, usize),
        meta: &TraceMeta,
        (layer, kv_head): (usize, usize),
    ) -> Self {
        let d = meta.head_dim;
        let prompt = || Prompt {
            keys: Array2::zeros((cut, d)),
            values: Array2::zeros((cut, d)),
            cut_done: false,
        };
        match storage {
            Storage::Quantized(scheme) => {
                UnitStore::Quantized(QuantizedCache::unwritten(scheme, capacity, d))
            }
            Storage::PrunedKeys(pruning) => UnitStore::PrunedKeys {
                pruning,
                queries: Vec::new(),
                prompt: prompt(),
            },
            Storage::Merged(merge) => UnitStore::Merged {
                merge,
                prompt: prompt(),
            },
            Storage::MergedWhileDecoding(merge) => {
                let values = Array2::zeros((capacity, d));
                let ids = (layer, kv_head);
                UnitStore::MergedWhileDecoding {
                    merging: DecodeMergedValues::new(merge, values.view(), Vec::new(), ids),
                    keys: Array2::zeros((capacity, d)),
                    queries: Array2::zeros((meta.n_heads / meta.n_kv_heads, d)),
                    softmax: (meta.scale, meta.softcap),
                }
            }
            Storage::Captured => unreachable!("a captured cache has no store"),
        }
    }

    /// Notes compressions its cache made while decoding (a merge while decoding only).
    fn note(&mut self, evictions: &[Eviction]) {
        if let UnitStore::MergedWhileDecoding { merging, .. } = self {
            merging.note(evictions.iter().cloned());
        }
    }

    /// Sets position `position`'s key and value and, for ThinK's scoring window, the queries of
    /// the group `[group, d]`.
    fn record(
        &mut self,
        position: usize,
        queries: ArrayView2<f32>,
        (key, value): (ArrayView1<f32>, ArrayView1<f32>),
    ) {
        let prompt = match self {
            UnitStore::Quantized(cache) => return cache.write(position, key, value),
            UnitStore::MergedWhileDecoding {
                merging,
                keys,
                queries: newest,
                ..
            } => {
                keys.row_mut(position).assign(&key);
                merging.write(position, value);
                return newest.assign(&queries);
            }
            UnitStore::PrunedKeys {
                pruning,
                queries: window,
                prompt,
            } => {
                let cut = prompt.keys.nrows();
                let first = cut.saturating_sub(pruning.window);
                if (first..cut).contains(&position) {
                    if window.is_empty() {
                        let d = queries.ncols();
                        *window = vec![Array2::zeros((cut - first, d)); queries.nrows()];
                    }
                    for (block, query) in window.iter_mut().zip(queries.rows()) {
                        block.row_mut(position - first).assign(&query);
                    }
                }
                prompt
            }
            UnitStore::Merged { prompt, .. } => prompt,
        };
        if position < prompt.keys.nrows() {
            prompt.keys.row_mut(position).assign(&key);
            prompt.values.row_mut(position).assign(&value);
        }
    }

    /// Brings the cache to hold `held` (ascending) at the step of `newest`, the prompt cut at
    /// `cut`, in a layer of window `window` (0: global); returns the positions whose key or value
    /// changed.
    fn step(&mut self, held: &[usize], newest: usize, cut: usize, window: usize) -> Vec<usize> {
        let prompt_held = &held[..held.partition_point(|&j| j < cut)];
        match self {
            UnitStore::Quantized(cache) => cache.step(held, newest),
            UnitStore::PrunedKeys {
                pruning,
                queries,
                prompt,
            } if !prompt.cut_done => {
                let queries: Vec<ArrayView2<f32>> = queries.iter().map(Array2::view).collect();
                pruning.prune_prompt(&queries, prompt.keys.view_mut(), prompt_held);
                prompt.cut_done = true;
                prompt_held.to_vec()
            }
            UnitStore::MergedWhileDecoding {
                merging,
                keys,
                queries,
                softmax,
            } => {
                let changed = merging.at_step(newest - cut, held);
                let heads = queries.nrows() as f64;
                for query in queries.rows() {
                    let weights = attention(query, keys.view(), held, *softmax);
                    merging.attend(held, weights.into_iter().map(|w| w / heads));
                }
                changed
            }
            UnitStore::Merged { merge, prompt } if !prompt.cut_done => {
                let visible = first_visible(cut.saturating_sub(1), window)..cut;
                merge.merge_into(
                    prompt.keys.view(),
                    &mut prompt.values,
                    (prompt_held, visible),
                );
                prompt.cut_done = true;
                prompt_held.to_vec()
            }
            _ => Vec::new(),
        }
    }

    /// Position `j`'s key and value as held (before the cut for a prompt store).
    fn row(&self, j: usize) -> (ArrayView1<'_, f32>, ArrayView1<'_, f32>) {
        match self {
            UnitStore::Quantized(cache) => (
                cache.keys().index_axis_move(Axis(0), j),
                cache
                    .values()
                    .expect("a live cache holds values")
                    .index_axis_move(Axis(0), j),
            ),
            UnitStore::PrunedKeys { prompt, .. } | UnitStore::Merged { prompt, .. } => {
                (prompt.keys.row(j), prompt.values.row(j))
            }
            UnitStore::MergedWhileDecoding { merging, keys, .. } => {
                (keys.row(j), merging.values().index_axis_move(Axis(0), j))
            }
        }
    }
}

/// One query's attention over the keys at `held`, in order: `softmax(scale · q·k)` in f64 (the
/// logit soft-capped when the model caps it), as the replay measures a cache's own attention.
fn attention(
    query: ArrayView1<f32>,
    keys: ArrayView2<f32>,
    held: &[usize],
    (scale, softcap): (f32, Option<f32>),
) -> Vec<f64> {
    let logits: Vec<f64> = held
        .iter()
        .map(|&j| {
            let logit = scale as f64 * query.dot(&keys.row(j)) as f64;
            softcap.map_or(logit, |cap| cap as f64 * (logit / cap as f64).tanh())
        })
        .collect();
    softmax_f64(&logits)
}
