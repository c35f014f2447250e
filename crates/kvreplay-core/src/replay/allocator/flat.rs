//! `flat`: every layer the same budget (SnapKV, H2O, StreamingLLM as published).

use super::{AllocationInput, Allocator};

crate::settings! {
    /// Every layer the same budget (SnapKV, H2O, StreamingLLM as published).
    pub struct Flat = "flat" {}
}

impl Allocator for Flat {
    fn allocate(&self, input: &AllocationInput<'_>) -> Vec<usize> {
        vec![input.budget; input.n_layers]
    }
}
