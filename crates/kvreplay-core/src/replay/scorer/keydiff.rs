//! `keydiff`: keep the keys least like the cache's average key (Park et al., 2025,
//! arXiv:2504.15364; kvpress `KeyDiffPress`, `kvpress/presses/keydiff_press.py` lines 36-46, commit
//! 8bb29b9c): the anchor is the mean of the cached keys, each L2-normalised, and a key's score is
//! minus its cosine similarity to the anchor. The anchor is taken over the cache at the moment of
//! choosing: the whole prompt under `prefill` (kvpress's one-shot press), the current cache under
//! the streaming timings (the paper's block-wise iterative eviction, one token at a time). Keys
//! only: under `gqa = "query-head"` every head of a group gets its KV head's scores.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Unit};
use ndarray::Array1;

crate::settings! {
    /// Keep the keys least similar to the mean normalised key (Park et al., 2025,
    /// arXiv:2504.15364; kvpress `KeyDiffPress`).
    pub struct KeyDiff = "keydiff" {}
}

/// The cache's KV head: its keys come with each call.
#[derive(Clone)]
struct State {
    kv_head: usize,
}

impl Scorer for KeyDiff {
    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            kv_head: unit.kv_head,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

/// `F.normalize`'s denominator: the norm, at least 1e-12.
fn norm(key: ndarray::ArrayView1<'_, f32>) -> f32 {
    key.dot(&key).sqrt().max(1e-12)
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let keys = layer.keys(self.kv_head);
        let mut anchor = Array1::<f32>::zeros(keys.ncols());
        for &position in cache {
            let key = keys.row(position);
            anchor.scaled_add(1.0 / norm(key), &key);
        }
        anchor /= cache.len() as f32;
        let anchor_norm = anchor.dot(&anchor).sqrt();
        out.clear();
        out.extend(cache.iter().map(|&position| {
            let key = keys.row(position);
            // torch's cosine_similarity: x·y / max(|x| |y|, 1e-8).
            let denominator = (key.dot(&key).sqrt() * anchor_norm).max(1e-8);
            -key.dot(&anchor) / denominator
        }));
        Ok(())
    }
}

/// The brute-force rule: minus the cosine of each key to the mean of the cached keys, each
/// normalised.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for KeyDiff {
    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let norm = |v: &[f64]| reference::dot(v, v).sqrt();
        let keys: Vec<Vec<f64>> = positions.iter().map(|&j| layer.key(cache.kv, j)).collect();
        let anchor: Vec<f64> = (0..layer.head_dim())
            .map(|x| keys.iter().map(|k| k[x] / norm(k)).sum::<f64>() / keys.len() as f64)
            .collect();
        keys.iter()
            .map(|k| -reference::dot(k, &anchor) / (norm(k) * norm(&anchor)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn minus_cosine_to_the_mean_normalised_key() {
        // Keys (3, 0), (0, 2), (1, 1): normalised (1, 0), (0, 1), (0.7071, 0.7071); anchor
        // (0.569036, 0.569036), along (1, 1). Cosines: 0.707107, 0.707107, 1.
        let (q, k, n) = layer_with(&[[0.0, 0.0]; 3], &[[3.0, 0.0], [0.0, 2.0], [1.0, 1.0]], 3);
        let layer = context(&q, &k, n);
        let mut state = KeyDiff {}
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 3);
        assert_abs_diff_eq!(scores[0], -std::f32::consts::FRAC_1_SQRT_2, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], -std::f32::consts::FRAC_1_SQRT_2, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[2], -1.0, epsilon = 1e-6);
    }
}
