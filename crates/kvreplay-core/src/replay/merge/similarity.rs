//! `similarity`: kvpress 0.5.5's merge-on-evict wrapper (`MergingPress`,
//! `kvpress/presses/merging_press.py` lines 64-175; after Token Merging, Bolya et al., ICLR 2023,
//! arXiv:2210.09461, and D2O, Wan et al., 2024, arXiv:2406.13035): at the prompt's cut each
//! evicted value is folded into the kept entry whose key is most cosine-similar, weighted by that
//! similarity and by the relative norms of the two values; keys are kept as captured (safe under
//! the rotary embedding). The rule is [`ValueMerge::merged`]. Deliberate deviations: f64
//! arithmetic where kvpress accumulates in f32, and a cache read by one query head
//! (`gqa = query-head`) merges within its own kept set.

use super::{Merge, ValueMerge};
use crate::replay::settings::Broken;

crate::settings! {
    /// Merge each evicted value into its most key-similar kept entry (kvpress `MergingPress`).
    pub struct Similarity = "similarity" {
        /// Least cosine similarity between the keys for a merge (kvpress's
        /// `similarity_threshold`), in [0, 1].
        similarity_threshold: f64 = 0.0,
        /// Share of the evicted entries, most similar first, that merge (kvpress's
        /// `merge_fraction`), in (0, 1].
        merge_fraction: f64 = 1.0,
    }
}

impl Merge for Similarity {
    fn check(&self) -> Result<(), Broken> {
        Broken::unless_share(
            "similarity_threshold",
            self.similarity_threshold,
            Some("a cosine similarity"),
        )?;
        if !(self.merge_fraction > 0.0 && self.merge_fraction <= 1.0) {
            return Err(Broken {
                key: "merge_fraction",
                rule: "must be in (0, 1]: the share of the evicted entries that merge".into(),
            });
        }
        Ok(())
    }

    fn merging(&self) -> Option<ValueMerge> {
        Some(ValueMerge {
            similarity_threshold: self.similarity_threshold,
            merge_fraction: self.merge_fraction,
        })
    }
}
