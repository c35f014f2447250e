//! Why a sweep, a report or a trace listing failed: one error type for the experiment module,
//! naming the file and the rule.

use crate::capture::CaptureError;
use crate::live::LiveError;
use crate::replay::PolicyError;
use std::path::PathBuf;

/// Errors of a sweep.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SweepError {
    /// A policy failed on a trace.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A result could not be written or read.
    #[error("{path}: {detail}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// A recipe could not be captured.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// A closed-loop run failed (boxed: it is the largest error, and every result carries the
    /// error type's size).
    #[error(transparent)]
    Live(Box<LiveError>),
    /// A closed-loop run's model tokenizes its recipe otherwise than the trace captured from it.
    #[error("{recipe}: model `{model}` builds a prompt that differs from the captured trace {trace} at token {position}: recapture the trace with this model (delete it and run `kvreplay sweep`)")]
    Tokenization {
        /// The recipe.
        recipe: PathBuf,
        /// The model the recipe names.
        model: String,
        /// The trace captured from the recipe.
        trace: PathBuf,
        /// The first prompt position whose token differs.
        position: usize,
    },
    /// Some runs failed on their own; the others of the sweep are stored.
    #[error("{count} of {total} runs failed (the others are stored); the first: policy `{first_name}` on {first_trace}: {first_error}; every failed run's error is in {dir}")]
    RunsFailed {
        /// How many failed.
        count: usize,
        /// How many the sweep ran.
        total: usize,
        /// The first failure's policy.
        first_name: String,
        /// Its trace.
        first_trace: PathBuf,
        /// Its error.
        first_error: String,
        /// Where the errors are kept.
        dir: PathBuf,
    },
    /// Runs are stored for another content of a trace than the one there now.
    #[error("{trace}: the trace changed since {count} stored runs were computed on it (sha256 {stored}…, now {now}…): run `kvreplay sweep` to recompute them")]
    TraceChanged {
        /// The trace file.
        trace: PathBuf,
        /// How many stored runs belong to its old content.
        count: usize,
        /// The start of the digest they were computed on.
        stored: String,
        /// The start of its digest now.
        now: String,
    },
}

impl From<LiveError> for SweepError {
    fn from(error: LiveError) -> Self {
        Self::Live(Box::new(error))
    }
}
