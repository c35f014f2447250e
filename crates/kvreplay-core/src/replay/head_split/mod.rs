//! Head splits: how a layer's budget is shared among its caches (KV heads, or query heads). One
//! split per file, the file name is the registry key. A split sees every cache's prompt scores
//! (the scorer's ranking at the end of the prompt) and the policy's protection; it never ranks
//! tokens itself. Splits that read scores are one-shot: they run at the end of the prompt.

use super::allocator::LayerBudget;
use super::settings::Broken;
use super::{LayerContext, Protection};
use crate::trace::TraceMeta;

mod adakv;
mod duo;
mod threshold;
mod uniform;

crate::registry! {
    HeadSplit:
    uniform::Uniform,
    adakv::AdaKv,
    threshold::Threshold,
    duo::Duo,
}

/// A way of sharing a layer's budget among its caches.
pub trait HeadSplit: Send + Sync {
    /// Rules its settings must follow beyond their types.
    fn check(&self) -> Result<(), Broken> {
        Ok(())
    }
    /// Whether `split` reads the caches' prompt scores (then the policy must be one-shot).
    fn needs_scores(&self) -> bool {
        false
    }
    /// Whether it splits the heads once, at the prompt's end, without reading scores (then the
    /// policy must be one-shot).
    fn needs_one_shot(&self) -> bool {
        false
    }
    /// Whether a cache could keep nothing unless the policy protects a position (sinks or
    /// window): the policy must then protect at least one.
    fn needs_protection(&self) -> bool {
        false
    }
    /// Whether it can split the caches of `meta`'s layers (a split calibrated on another trace
    /// needs the same model); the message names the rule.
    fn check_trace(&self, _meta: &TraceMeta) -> Result<(), String> {
        Ok(())
    }
    /// The share of the caches of the compressed `layers` of `meta`'s model (each layer split
    /// among `n_caches`) that keep only their protected positions whatever the budget
    /// (DuoAttention's streaming heads): a budget in bytes is resolved over the others. 0 by
    /// default, every cache keeping the budget.
    fn protected_only_share(
        &self,
        _meta: &TraceMeta,
        _layers: &[usize],
        _n_caches: usize,
        _protect: Protection,
    ) -> f64 {
        0.0
    }
    /// Each cache's budget in layer `layer`, given the layer's `budget` (its total over its
    /// caches, which they need not divide where the allocator ranks every layer's caches
    /// together), one score per candidate position per cache (empty when `needs_scores` is
    /// false), the candidates (the positions a whole cache holds at the prompt's end, ascending:
    /// the prompt, or a sliding-window layer's window) and the protection.
    fn split(
        &self,
        layer: &LayerContext<'_>,
        budget: LayerBudget,
        scores: &[Vec<f32>],
        candidates: &[usize],
        protect: Protection,
    ) -> Vec<usize>;
}
