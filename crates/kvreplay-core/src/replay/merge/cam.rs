//! `cam`: Cache Merging (CaM, Zhang et al., ICML 2024, openreview LCTmppB165), as kvpress 0.5.5's
//! `CAMPress` runs it (`kvpress/presses/cam_press.py` lines 102-233): at every compression while
//! decoding, the evicted entries with the highest scores (as many as tokens arrived since the
//! last compression) are merge candidates; each one's value is folded, under a Bernoulli draw,
//! into the `merge_budget` kept entries that follow it in position order, each receiving
//! `v / n` (`n` of them), with probability `clamp(A_m / mean(A_targets), 0, 1)`, `A` the running
//! sum of the decode queries' attention over the cache (the mean over a KV head's query heads),
//! counted from the first generated token. The rule is [`DecodeMerge`]. Deliberate deviations:
//! the draw is kvreplay's seeded SplitMix64 ([`DecodeMerge::draw`]), not torch's global
//! generator; the running attention sums in f64 (kvpress: f32); a compression is triggered by the
//! policy's timing and trigger (kvpress's `CAMPress` compresses when `compression_interval` steps
//! have passed and the cache holds more than `target_size`: `timing = "decoding"`, `trigger =
//! "steps"`, which restarts its count at a due step where the cache is within the budget, a
//! prompt no longer than the budget); a scorer that reads values scores them as captured.

use super::{DecodeMerge, Merge, ValueMerge};
use crate::replay::settings::Broken;

crate::settings! {
    /// Fold evicted values into the kept entries that follow them while decoding, under a
    /// Bernoulli draw weighted by the running attention (CaM, kvpress `CAMPress`).
    pub struct Cam = "cam" {
        /// Kept entries after a merge candidate that receive its value (kvpress's
        /// `merge_budget`), at least 1.
        merge_budget: usize = 32,
        /// Seed of the Bernoulli draws (apart from the `random` scorer's `seed`).
        merge_seed: u64 = 0,
    }
}

impl Merge for Cam {
    fn check(&self) -> Result<(), Broken> {
        if self.merge_budget == 0 {
            return Err(Broken {
                key: "merge_budget",
                rule: "must be at least 1: the kept entries a merged value spreads over".into(),
            });
        }
        Ok(())
    }

    fn merging(&self) -> Option<ValueMerge> {
        None
    }

    fn decode_merging(&self) -> Option<DecodeMerge> {
        Some(DecodeMerge {
            merge_budget: self.merge_budget,
            seed: self.merge_seed,
        })
    }
}
