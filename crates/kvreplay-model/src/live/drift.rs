//! The live attention itself: how much of each live query's attention over the whole live cache
//! (a sliding-window layer's window) falls on what the policy let it attend to. Beside the
//! open-loop retained mass of the same layer (the full run's queries over the full run's keys) it
//! shows, layer by layer, how far the model's own vectors drift once tokens are gone.

use crate::attention::{attend_positions, first_visible, logits, softmax_in_place};
use crate::model::{AttentionMask, ChunkVectors, KvCache, ModelError, Rewrite};
use std::sync::Arc;

/// Wraps a policy's mask and adds up per layer the share of each live query head's full causal
/// attention that its mask keeps.
#[derive(Clone)]
pub(crate) struct LiveMass<M> {
    inner: M,
    scale: f32,
    softcap: Option<f32>,
    group: usize,
    /// Per layer, its attention window (0: global).
    windows: Vec<usize>,
    /// Per layer, per KV head, the live keys so far.
    keys: Vec<Vec<HeadKeys>>,
    /// Per layer: the kept share summed over measured rows and heads, and their count.
    sums: Vec<(f64, usize)>,
}

/// One KV head's live keys at one layer, row after row: those of the cache the run started
/// from (shared by every run that starts from it), then the run's own.
#[derive(Clone, Default)]
struct HeadKeys {
    start: Arc<[f32]>,
    own: Vec<f32>,
}

/// The keys of a cache, per layer and KV head, row after row: what every live mass measured
/// from that cache starts with, held once however many runs start from it.
pub(crate) struct StartKeys {
    layers: Vec<Vec<Arc<[f32]>>>,
}

impl StartKeys {
    /// The keys `cache` holds in every layer.
    pub fn new(cache: &KvCache) -> Result<Self, ModelError> {
        let layers = (0..cache.n_layers())
            .map(|layer| cache.head_keys(layer))
            .collect::<Result<_, ModelError>>()?;
        Ok(Self { layers })
    }
}

impl<M> LiveMass<M> {
    /// Measures `inner` from a model whose cache held the keys `start` (the live keys so far)
    /// on its layers `layers` (numbered 0.. among themselves, as `inner` numbers them) of
    /// attention windows `windows` (0: global), with `group` query heads per KV head.
    pub fn new(
        inner: M,
        start: &StartKeys,
        (layers, windows): (&[usize], Vec<usize>),
        group: usize,
        scale: f32,
        softcap: Option<f32>,
    ) -> Self {
        let keys = layers
            .iter()
            .zip(&windows)
            .map(|(&layer, &window)| {
                let heads = start.layers.get(layer).map_or(&[][..], Vec::as_slice);
                heads
                    .iter()
                    .map(|keys| match window {
                        // A windowed layer's queries attend over a window of its rows, which
                        // `attend_positions` takes from one slice of them all.
                        0 => HeadKeys {
                            start: keys.clone(),
                            own: Vec::new(),
                        },
                        _ => HeadKeys {
                            start: Arc::from([]),
                            own: keys.to_vec(),
                        },
                    })
                    .collect()
            })
            .collect();
        Self {
            inner,
            scale,
            softcap,
            group,
            windows,
            keys,
            sums: vec![(0.0, 0); layers.len()],
        }
    }

    /// The measured mask.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The measured mask, unwrapped.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// Per layer, the mean kept share over the measured rows and heads.
    pub fn per_layer(&self) -> Vec<f64> {
        self.sums
            .iter()
            .map(|&(sum, count)| {
                if count == 0 {
                    f64::NAN
                } else {
                    sum / count as f64
                }
            })
            .collect()
    }
}

impl<M: AttentionMask> AttentionMask for LiveMass<M> {
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let (n_heads, n, head_dim) = chunk.q.dim();
        let keys = &mut self.keys[layer];
        keys.resize(chunk.k.dim().0, HeadKeys::default());
        for (stored, new) in keys.iter_mut().zip(chunk.k.outer_iter()) {
            stored.own.extend(new.iter());
        }
        let mask = self.inner.layer_mask(layer, chunk)?;
        let total = chunk.past + n;
        // Query after query, as many one-token chunks add them up.
        for row in 0..n {
            for head in 0..n_heads {
                let keys = &keys[head / self.group];
                let position = chunk.past + row;
                let first = first_visible(position, self.windows[layer]);
                let query = chunk.q.slice(ndarray::s![head, row, ..]);
                let weights = match first {
                    0 => keys.attend_first(query, position + 1, (self.scale, self.softcap)),
                    _ => {
                        // A windowed layer's rows are all its own (`LiveMass::new`).
                        let keys = ndarray::ArrayView2::from_shape((total, head_dim), &keys.own)
                            .expect("one row per position");
                        let everything: Vec<usize> = (first..=position).collect();
                        attend_positions(query, keys, &everything, self.scale, self.softcap)
                    }
                };
                let kept: f64 = match &mask {
                    None => 1.0,
                    Some(mask) => {
                        let line = &mask[(head * n + row) * total..][first..=position];
                        weights
                            .iter()
                            .zip(line)
                            .filter(|(_, &m)| m == 0.0)
                            .map(|(&w, _)| w as f64)
                            .sum()
                    }
                };
                self.sums[layer].0 += kept;
                self.sums[layer].1 += 1;
            }
        }
        Ok(mask)
    }

    fn rewrite(&mut self, layer: usize) -> Option<Rewrite> {
        self.inner.rewrite(layer)
    }
}

impl HeadKeys {
    /// Softmax attention of `query` over the first `n` live keys: the logits of the start's
    /// rows and of the run's own, each row's logit its own dot product, then one softmax over
    /// them all, so the weights are [`attend`](crate::attention::attend)'s over one slice of
    /// the `n` rows, bit for bit.
    fn attend_first(
        &self,
        query: ndarray::ArrayView1<f32>,
        n: usize,
        (scale, softcap): (f32, Option<f32>),
    ) -> Vec<f32> {
        let d = query.len();
        fn rows(keys: &[f32], (count, d): (usize, usize)) -> ndarray::ArrayView2<'_, f32> {
            ndarray::ArrayView2::from_shape((count, d), &keys[..count * d])
                .expect("one row per position")
        }
        let from_start = n.min(self.start.len() / d.max(1));
        let mut weights = logits(query, rows(&self.start, (from_start, d)), scale, softcap);
        if n > from_start {
            let own = rows(&self.own, (n - from_start, d));
            weights.extend(logits(query, own, scale, softcap));
        }
        softmax_in_place(&mut weights);
        weights
    }
}

/// A policy's masks on the model layers it compresses only (a hybrid model's global layers, or
/// every layer under `layers = all`), numbered 0.. among them as the replay numbers its budgets
/// and kept sets; the other layers attend over their window, as the model's forward pass masks
/// them (and a compressed sliding-window layer over what its mask keeps inside its window).
#[derive(Clone)]
pub(crate) struct CompressedLayers<M> {
    inner: M,
    /// Per model layer, its index among the compressed layers.
    index: Vec<Option<usize>>,
}

impl<M> CompressedLayers<M> {
    /// `inner` on layers `compressed` of a model of `n_layers` layers.
    pub fn new(inner: M, compressed: &[usize], n_layers: usize) -> Self {
        let mut index = vec![None; n_layers];
        for (position, &layer) in compressed.iter().enumerate() {
            index[layer] = Some(position);
        }
        Self { inner, index }
    }

    /// The wrapped mask.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped mask, to change.
    pub fn inner_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// The wrapped mask, unwrapped.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The same layers over the mask `wrap` makes of this one's.
    pub fn map<N>(self, wrap: impl FnOnce(M) -> N) -> CompressedLayers<N> {
        CompressedLayers {
            inner: wrap(self.inner),
            index: self.index,
        }
    }
}

impl<M: AttentionMask> AttentionMask for CompressedLayers<M> {
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        match self.index[layer] {
            Some(compressed) => self.inner.layer_mask(compressed, chunk),
            None => Ok(None),
        }
    }

    fn rewrite(&mut self, layer: usize) -> Option<Rewrite> {
        self.inner.rewrite(self.index[layer]?)
    }
}
