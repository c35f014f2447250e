//! One cache's values as a merging cache holds them after the prompt's cut: the visible prompt
//! entries it does not keep folded into those it does; entries generated later as captured.

use super::ValueMerge;
use crate::replay::{LayerContext, Unit};
use ndarray::{Array2, ArrayView2};

/// A merging cache's values over one KV head.
#[derive(Debug, Clone)]
pub struct MergedValues {
    values: Array2<f32>,
}

impl MergedValues {
    /// The values of `unit` in `layer` once the cut kept the prompt positions `kept`
    /// (ascending) and `merge` folded the other visible prompt positions into them; the trace
    /// must have values (checked before any layer is read).
    pub fn new(merge: ValueMerge, layer: &LayerContext<'_>, unit: &Unit, kept: &[usize]) -> Self {
        let cut = layer.prompt_len;
        let mut values = layer
            .values(unit.kv_head)
            .expect("a merge is refused on a trace without values")
            .to_owned();
        let kept: Vec<usize> = kept.iter().copied().filter(|&j| j < cut).collect();
        let visible = layer.first_visible(cut.saturating_sub(1))..cut;
        merge.merge_into(layer.keys(unit.kv_head), &mut values, (&kept, visible));
        Self { values }
    }

    /// The values as held, `[T, d]`.
    pub fn values(&self) -> ArrayView2<'_, f32> {
        self.values.view()
    }
}
