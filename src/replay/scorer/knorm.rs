//! `knorm`: keep the keys of *smallest* L2 norm (Devoto et al., 2024, arXiv:2406.11430; kvpress's
//! `KnormPress` scores `-keys.norm(dim=-1)`). Uses keys only, so it needs no queries at all.

use super::{Started, ScoreState, Scorer};
use crate::replay::{LayerContext, Protection, Unit};
use ndarray::ArrayView2;

crate::settings! {
    /// Keep the keys of smallest L2 norm (Devoto et al., 2024, arXiv:2406.11430; kvpress
    /// `KnormPress`).
    pub struct Knorm = "knorm" {}
}

struct State<'a> {
    keys: ArrayView2<'a, f32>,
}

impl Scorer for Knorm {
    fn start<'a>(&self, layer: &LayerContext<'a>, unit: &Unit, _: Protection) -> Started<'a> {
        Box::new(State {
            keys: layer.keys(unit.kv_head),
        })
    }
}

impl ScoreState for State<'_> {
    fn on_append(&mut self, _cache: &[usize]) {}

    fn scores(&mut self, cache: &[usize], out: &mut Vec<f32>) {
        out.clear();
        out.extend(cache.iter().map(|&position| {
            let key = self.keys.row(position);
            -key.dot(&key).sqrt()
        }));
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
        let mut state = Knorm {}.start(&layer, &unit(), Protection::default());
        assert_eq!(scores_after(state.as_mut(), 2), vec![-5.0, -1.0]);
    }
}
