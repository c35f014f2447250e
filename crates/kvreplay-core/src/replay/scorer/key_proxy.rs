//! `key-proxy`: each new key used as a proxy query (the H2O-adapted rule of the VeloxQuant-MLX
//! library, the selection of its "PyramidKV-adapted"; docs/policies.md quotes its documentation).
//!
//! Token 0 is stored with score 1.0. Token i: `attn = softmax(K_stored · k_i / sqrt(d))` over
//! the stored keys, *not itself*; `scores += attn`; token i is appended with score 0. The engine
//! then evicts the lowest score (sinks and window protected). The rule works on keys only, so
//! under `--gqa query-head` every head of a group gets the same scores. Deviation: the library
//! also re-rotates survivors' keys to close position gaps; a replay keeps original positions,
//! since the measured quantity is the full model's attention. Softcap is not applied (the library
//! has none).

use super::Scored;
use super::{AlignedScores, ScoreState, Scorer, Started};
use crate::attention::{attend_positions, softmax, CausalLogits};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Unit};
use ndarray::Axis;

crate::settings! {
    /// Each new key as its own query (the VeloxQuant-MLX library's H2O-adapted rule, the
    /// selection of its PyramidKV-adapted); cumulative, new tokens enter at score 0.
    pub struct KeyProxy = "key-proxy" {}
}

#[derive(Clone)]
struct State {
    kv_head: usize,
    /// K·Kᵀ rows while the cache is the whole prefix.
    rows: CausalLogits,
    scores: AlignedScores,
}

impl Scorer for KeyProxy {
    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            kv_head: unit.kv_head,
            rows: CausalLogits::new(1, layer.k.shape()[2], layer.scale, None),
            scores: AlignedScores::default(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        let (&newest, stored) = cache
            .split_last()
            .expect("on_append sees a non-empty cache");
        if stored.is_empty() {
            self.scores.0.push(1.0);
            return Ok(());
        }
        let keys = layer.keys(self.kv_head);
        let attention = if stored.len() == newest {
            let as_queries = keys.insert_axis(Axis(0));
            softmax(&self.rows.row(as_queries, keys, 0, newest)[..newest])
        } else {
            attend_positions(keys.row(newest), keys, stored, layer.scale, None)
        };
        self.scores.accumulate(attention);
        self.scores.0.push(0.0);
        Ok(())
    }

    fn scores(
        &mut self,
        _layer: &LayerContext<'_>,
        _cache: &[usize],
        out: &mut Vec<f32>,
    ) -> Scored {
        self.scores.copy_to(out);
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        self.scores.remove(index);
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        self.scores.retain(kept);
        Ok(())
    }
}

/// The brute-force rule: the first token starts at 1, every later one at 0, and each new key's
/// attention over the keys before it (the key as the query) adds to their scores.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for KeyProxy {
    fn step(
        &self,
        layer: &reference::Layer,
        cache: &Member,
        positions: &[usize],
        running: &mut Vec<f64>,
    ) {
        let at = *positions.last().expect("a position arrived");
        if positions.len() == 1 {
            running.push(1.0);
            return;
        }
        let before = &positions[..positions.len() - 1];
        let p = layer.attention(&layer.key(cache.kv, at), cache.kv, before);
        for (score, weight) in running.iter_mut().zip(p) {
            *score += weight;
        }
        running.push(0.0);
    }

    fn scores(
        &self,
        _: &reference::Layer,
        _: &reference::Policy,
        _: &Member,
        _: &[usize],
        running: &[f64],
    ) -> Vec<f64> {
        running.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn hand_computed_scores() {
        // keys k0 = (1,0), k1 = (0,1), k2 = (1,1); scale 1.
        // token 0: score 1. token 1: softmax over {k0·k1 = 0} = [1] -> scores [2, 0].
        // token 2: logits k0·k2 = 1, k1·k2 = 1 -> [0.5, 0.5] -> scores [2.5, 0.5, 0].
        let (q, k, n) = layer_with(&[[0.0, 0.0]; 3], &[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], 3);
        let layer = context(&q, &k, n);
        let mut state = KeyProxy {}
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 3);
        assert_abs_diff_eq!(scores[0], 2.5, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], 0.5, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[2], 0.0, epsilon = 1e-6);
    }
}
