//! The cache layout: which layers a policy compresses (the global ones, or every layer of a
//! hybrid model), which unit owns a cache under grouped-query attention (a KV head, a query
//! head, or the whole layer) and how a group's query-head scores become one score per cached
//! token.

use serde::{Deserialize, Serialize};

/// The layers a policy's budget compresses, on a model with sliding-window layers (elsewhere
/// every layer is global and the two are the same).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Layers {
    /// The global layers only; a sliding-window layer keeps its window whatever the policy and
    /// is left out of the metrics (kvpress compresses only Gemma 3's global layers).
    #[default]
    Global,
    /// Every layer. A sliding-window layer's cache holds the kept tokens still inside its window:
    /// its scorer sees the window's attention, kept tokens leave when they slide out, and its
    /// reference "full cache" is the window.
    All,
}

impl crate::replay::settings::Choices for Layers {
    const ALL: &'static [Self] = &[Self::Global, Self::All];
}

impl Layers {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Layers::Global => "global",
            Layers::All => "all",
        }
    }
}

/// The unit that owns a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Granularity {
    /// One cache per KV head; the group's query-head scores are aggregated (kvpress, AdaKV).
    KvHead,
    /// One cache per query head, K/V repeated (the official SnapKV/PyramidKV code); memory is
    /// counted per query head.
    QueryHead,
    /// One kept set for the whole layer, shared by every KV head (TOVA's): the layer's score is
    /// the mean over its KV groups of each group's aggregated score (with `agg = mean`, the mean
    /// over all query heads).
    Layer,
}

impl crate::replay::settings::Choices for Granularity {
    const ALL: &'static [Self] = &[Self::KvHead, Self::QueryHead, Self::Layer];
}

impl Granularity {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Granularity::KvHead => "kv-head",
            Granularity::QueryHead => "query-head",
            Granularity::Layer => "layer",
        }
    }
}

/// How a GQA group's query-head scores become one score per cached token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Mean over the group (default; kvpress, AdaKV).
    Mean,
    /// Max over the group.
    Max,
    /// Sum over the group.
    Sum,
}

impl Aggregation {
    /// Combines one score per query head into one.
    pub fn combine(self, values: impl Iterator<Item = f32>) -> f32 {
        let mut count = 0usize;
        let mut acc = match self {
            Aggregation::Max => f32::NEG_INFINITY,
            _ => 0.0,
        };
        for value in values {
            count += 1;
            acc = match self {
                Aggregation::Max => acc.max(value),
                _ => acc + value,
            };
        }
        match self {
            Aggregation::Mean if count > 0 => acc / count as f32,
            _ => acc,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_config_spellings() {
        for granularity in [
            Granularity::KvHead,
            Granularity::QueryHead,
            Granularity::Layer,
        ] {
            let spelled = serde_json::to_value(granularity).unwrap();
            assert_eq!(spelled.as_str(), Some(granularity.name()));
        }
        for layers in [Layers::Global, Layers::All] {
            let spelled = serde_json::to_value(layers).unwrap();
            assert_eq!(spelled.as_str(), Some(layers.name()));
        }
    }
}
