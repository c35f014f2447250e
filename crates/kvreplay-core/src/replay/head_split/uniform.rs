//! `uniform`: every cache of a layer gets the layer's budget (SnapKV, PyramidKV, H2O as published).

use super::HeadSplit;
use crate::replay::{LayerContext, Protection};

crate::settings! {
    /// Every cache of a layer gets the layer's budget.
    pub struct Uniform = "uniform" {}
}

impl HeadSplit for Uniform {
    fn split(
        &self,
        _layer: &LayerContext<'_>,
        budget: usize,
        _scores: &[Vec<f32>],
        n_caches: usize,
        _candidates: &[usize],
        _protect: Protection,
    ) -> Vec<usize> {
        vec![budget; n_caches]
    }
}
