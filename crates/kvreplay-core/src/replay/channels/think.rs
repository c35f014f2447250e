//! `think`: ThinK's query-driven key-channel pruning (Xu et al., ICLR 2025, arXiv:2407.21018), as
//! kvpress 0.5.5 runs it (`ThinKPress`, `kvpress/presses/think_press.py` lines 71-88; reviewed
//! there by ThinK's first author): per KV head, the `key_channel_compression_ratio` of the key
//! channels with the lowest `mean(q²) · mean(k²)` are pruned, the queries being the last
//! `window_size` (32) of the prompt, their squares averaged per query head and then over the
//! heads of the KV group, the keys those the cache holds (composed after an eviction press, as
//! kvpress's `ComposedPress([SnapKVPress, ThinKPress])` runs it, the kept ones). kvpress zeroes
//! the pruned channels and keeps the tensor's shape; here the memory counts them gone, with a
//! bit a channel for the mask. Keys generated after the cut keep every channel, as there.
//! Deliberate deviations: scores in f64 where kvpress uses the model's dtype, equal scores prune
//! the lower channel first, and a cache read by one query head (`gqa = query-head`) scores with
//! its own head's queries.

use super::{ChannelPruning, KeyChannels};
use crate::replay::settings::Broken;

crate::settings! {
    /// ThinK: prune the key channels with the lowest query-weighted magnitude (arXiv:2407.21018;
    /// kvpress `ThinKPress`).
    pub struct Think = "think" {
        /// Share of each head's key channels pruned (`key_channel_compression_ratio` of
        /// kvpress), in [0, 1).
        key_channel_ratio: f64 = 0.5,
        /// The last prompt queries that score the channels (kvpress's `window_size`).
        query_window: usize = 32,
    }
}

impl KeyChannels for Think {
    fn check(&self) -> Result<(), Broken> {
        if !(0.0..1.0).contains(&self.key_channel_ratio) {
            return Err(Broken {
                key: "key_channel_ratio",
                rule: "must be in [0, 1): the share of each head's key channels pruned".into(),
            });
        }
        if self.query_window == 0 {
            return Err(Broken {
                key: "query_window",
                rule: "must be at least 1: the prompt queries that score the channels".into(),
            });
        }
        Ok(())
    }

    fn pruning(&self) -> Option<ChannelPruning> {
        (self.key_channel_ratio > 0.0).then_some(ChannelPruning {
            fraction: self.key_channel_ratio,
            window: self.query_window,
        })
    }
}
