//! `knorm`: keep the keys of *smallest* L2 norm (Devoto et al., 2024, arXiv:2406.11430; kvpress's
//! `KnormPress` scores `-keys.norm(dim=-1)`). Uses keys only, so it needs no queries at all.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Unit};

crate::settings! {
    /// Keep the keys of smallest L2 norm (Devoto et al., 2024, arXiv:2406.11430; kvpress
    /// `KnormPress`).
    pub struct Knorm = "knorm" {}
}

/// The cache's KV head: its keys come with each call.
#[derive(Clone)]
struct State {
    kv_head: usize,
}

impl Scorer for Knorm {
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

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let keys = layer.keys(self.kv_head);
        out.clear();
        out.extend(cache.iter().map(|&position| {
            let key = keys.row(position);
            -key.dot(&key).sqrt()
        }));
        Ok(())
    }
}

/// The brute-force rule: minus each key's L2 norm.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Knorm {
    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        positions
            .iter()
            .map(|&j| {
                let key = layer.key(cache.kv, j);
                -reference::dot(&key, &key).sqrt()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn negative_norm() {
        let (q, k, n) = layer_with(&[[0.0, 0.0]; 2], &[[3.0, 4.0], [0.0, 1.0]], 2);
        let layer = context(&q, &k, n);
        let mut state = Knorm {}
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        assert_eq!(scores_after(state.as_mut(), &layer, 2), vec![-5.0, -1.0]);
    }
}
