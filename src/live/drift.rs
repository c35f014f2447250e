//! The live attention itself: how much of each live query's attention over the whole live cache
//! (a sliding-window layer's window) falls on what the policy let it attend to. Beside the
//! open-loop retained mass of the same layer (the full run's queries over the full run's keys) it
//! shows, layer by layer, how far the model's own vectors drift once tokens are gone.

use crate::attention::{attend_positions, first_visible};
use crate::model::{AttentionMask, ChunkVectors, KvCache, ModelError, Rewrite};

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
    /// Per layer, per KV head, the live keys so far, row after row.
    keys: Vec<Vec<Vec<f32>>>,
    /// Per layer: the kept share summed over measured rows and heads, and their count.
    sums: Vec<(f64, usize)>,
}

impl<M> LiveMass<M> {
    /// Measures `inner` from a model whose cache is `cache` (its keys are the live keys so far)
    /// on its layers `layers` (numbered 0.. among themselves, as `inner` numbers them) of
    /// attention windows `windows` (0: global), with `group` query heads per KV head.
    pub fn new(
        inner: M,
        cache: &KvCache,
        (layers, windows): (&[usize], Vec<usize>),
        group: usize,
        scale: f32,
        softcap: Option<f32>,
    ) -> Result<Self, ModelError> {
        let keys = layers
            .iter()
            .map(|&layer| {
                let keys = cache.keys(layer)?;
                Ok(keys
                    .outer_iter()
                    .map(|head| head.iter().copied().collect())
                    .collect())
            })
            .collect::<Result<Vec<Vec<Vec<f32>>>, ModelError>>()?;
        Ok(Self {
            inner,
            scale,
            softcap,
            group,
            windows,
            keys,
            sums: vec![(0.0, 0); layers.len()],
        })
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
        keys.resize(chunk.k.dim().0, Vec::new());
        for (stored, new) in keys.iter_mut().zip(chunk.k.outer_iter()) {
            stored.extend(new.iter());
        }
        let mask = self.inner.layer_mask(layer, chunk)?;
        let total = chunk.past + n;
        // Query after query, as many one-token chunks add them up.
        for row in 0..n {
            for head in 0..n_heads {
                let keys =
                    ndarray::ArrayView2::from_shape((total, head_dim), &keys[head / self.group])
                        .expect("one row per position");
                let position = chunk.past + row;
                let first = first_visible(position, self.windows[layer]);
                let everything: Vec<usize> = (first..=position).collect();
                let query = chunk.q.slice(ndarray::s![head, row, ..]);
                let weights = attend_positions(query, keys, &everything, self.scale, self.softcap);
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
