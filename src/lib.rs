//! kvreplay: a research simulator for KV-cache compression in large language models.
//!
//! Capture once (a real model's post-rotary q, k, v of every layer and position, a kvtrace/1
//! file), then replay offline: budget allocators decide how many tokens each layer or head keeps,
//! eviction scorers decide which, and the engine measures how much of the full cache's attention
//! each policy keeps. This crate is the pure library; the `kvreplay` binary is a thin CLI over it
//! and the library never prints.

#![warn(missing_docs)]

pub use kvreplay_core::{atomic, attention, splitmix, stop, trace};
pub use kvreplay_model::{assets, capture, live, model, recipe, sys};

pub mod bench;
pub mod experiment;
pub mod export;
pub mod view;

/// The replay engine and its methods ([`kvreplay_core::replay`]), and the command line's policy
/// flags built from their registries.
pub mod replay {
    pub use kvreplay_core::replay::*;
    pub mod flags;
}

/// An error and its causes as one line, each cause once (typed errors often say their cause
/// already): what the command line prints after `error: ` and what the Python package raises.
pub fn error_text(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(next) = cause {
        let next_text = next.to_string();
        if !text.contains(&next_text) {
            text = format!("{text}: {next_text}");
        }
        cause = next.source();
    }
    text
}
