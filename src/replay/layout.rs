//! The cache layout under grouped-query attention: which unit owns a cache (a KV head, a query
//! head, or the whole layer) and how a group's query-head scores become one score per cached
//! token.

use serde::{Deserialize, Serialize};

/// The unit that owns a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
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
    }
}
