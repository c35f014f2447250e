//! kvreplay: a research simulator for KV-cache compression in large language models.
//!
//! Capture once (a real model's post-rotary q, k, v of every layer and position, a kvtrace/1
//! file), then replay offline: budget allocators decide how many tokens each layer or head keeps,
//! eviction scorers decide which, and the engine measures how much of the full cache's attention
//! each policy keeps. This crate gathers the workspace's crates into one library (the core, the
//! models, the experiments: their modules re-exported here) and adds the benchmarks and the
//! command line's policy flags; the `kvreplay` binary is a thin CLI over it and the library never
//! prints.

#![warn(missing_docs)]

pub use kvreplay_core::{atomic, attention, splitmix, stop, trace};
pub use kvreplay_experiment::{error_text, experiment, export, view};
pub use kvreplay_model::{assets, capture, live, model, recipe, sys};

pub mod bench;

/// The replay engine and its methods ([`kvreplay_core::replay`]), and the command line's policy
/// flags built from their registries.
pub mod replay {
    pub use kvreplay_core::replay::*;
    pub mod flags;
}
