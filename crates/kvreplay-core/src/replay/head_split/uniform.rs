//! `uniform`: every cache of a layer gets the layer's budget (SnapKV, PyramidKV, H2O as published);
//! a total its caches do not divide (the `global` allocator's) is shared evenly, the rest one token
//! each to the first caches.

use super::HeadSplit;
use crate::replay::allocator::LayerBudget;
use crate::replay::{LayerContext, Protection};

crate::settings! {
    /// Every cache of a layer gets the layer's budget.
    pub struct Uniform = "uniform" {}
}

impl HeadSplit for Uniform {
    fn split(
        &self,
        _layer: &LayerContext<'_>,
        budget: LayerBudget,
        _scores: &[Vec<f32>],
        _candidates: &[usize],
        _protect: Protection,
    ) -> Vec<usize> {
        let rest = budget.total() - budget.per_cache() * budget.caches();
        (0..budget.caches())
            .map(|cache| budget.per_cache() + usize::from(cache < rest))
            .collect()
    }
}
