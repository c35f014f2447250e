//! The live attention itself: how much of each live query's attention over the whole live cache
//! falls on what the policy let it attend to. Beside the open-loop retained mass of the same
//! layer (the full run's queries over the full run's keys) it shows, layer by layer, how far the
//! model's own vectors drift once tokens are gone.

use crate::attention::attend_positions;
use crate::model::{AttentionMask, ChunkVectors, KvCache, ModelError};

/// Wraps a policy's mask and adds up per layer the share of each live query head's full causal
/// attention that its mask keeps.
#[derive(Clone)]
pub(crate) struct LiveMass<M> {
    inner: M,
    scale: f32,
    softcap: Option<f32>,
    group: usize,
    /// Per layer, per KV head, the live keys so far, row after row.
    keys: Vec<Vec<Vec<f32>>>,
    /// Per layer: the kept share summed over measured rows and heads, and their count.
    sums: Vec<(f64, usize)>,
}

impl<M> LiveMass<M> {
    /// Measures `inner` from a model whose cache is `cache` (its keys are the live keys so far),
    /// with `group` query heads per KV head.
    pub fn new(
        inner: M,
        cache: &KvCache,
        n_layers: usize,
        group: usize,
        scale: f32,
        softcap: Option<f32>,
    ) -> Result<Self, ModelError> {
        let keys = (0..n_layers)
            .map(|layer| {
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
            keys,
            sums: vec![(0.0, 0); n_layers],
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
        for head in 0..n_heads {
            let keys = ndarray::ArrayView2::from_shape((total, head_dim), &keys[head / self.group])
                .expect("one row per position");
            for row in 0..n {
                let position = chunk.past + row;
                let everything: Vec<usize> = (0..=position).collect();
                let query = chunk.q.slice(ndarray::s![head, row, ..]);
                let weights = attend_positions(query, keys, &everything, self.scale, self.softcap);
                let kept: f64 = match &mask {
                    None => 1.0,
                    Some(mask) => {
                        let line = &mask[(head * n + row) * total..][..=position];
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
}
