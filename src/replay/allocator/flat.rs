//! `flat`: every layer the same budget (SnapKV, H2O, StreamingLLM as published).

use super::{AllocationInput, Allocator};

/// Uniform budgets.
pub struct Flat;

impl Allocator for Flat {
    fn name(&self) -> &'static str {
        "flat"
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Vec<usize> {
        vec![input.budget; input.n_layers]
    }
}
