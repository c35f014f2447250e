//! `flat`: every layer the same budget (SnapKV, H2O, StreamingLLM as published).

use super::{AllocationInput, Allocator};
use crate::replay::MethodFailed;

crate::settings! {
    /// Every layer the same budget (SnapKV, H2O, StreamingLLM as published).
    pub struct Flat = "flat" {}
}

impl Allocator for Flat {
    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        Ok(vec![input.budget; input.n_layers])
    }
}
