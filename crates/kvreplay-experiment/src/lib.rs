//! kvreplay's experiments over the models and the core: declarative experiment files, sweeps that
//! store every run (resumable, sharded, on Slurm), the reports their tables, statistics and plots
//! make, the exporters (Markdown, CSV, JSON) and the HTML page that shows what a policy kept. No
//! command line, progress bars or Python: the `kvreplay` crate above it is the command line, and
//! the binding builds on that.

#![warn(missing_docs)]

pub use kvreplay_core::{atomic, attention, replay, splitmix, stop, trace};
pub use kvreplay_model::{assets, capture, live, model, recipe, sys};

pub mod experiment;
pub mod export;
pub mod view;

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
