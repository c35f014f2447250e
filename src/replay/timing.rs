//! When a policy chooses its kept set: once at the end of the prompt, as tokens stream in, or
//! afresh at every decode step.

use serde::{Deserialize, Serialize};

/// When the kept set is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Timing {
    /// One-shot at the end of the prompt; generated tokens are appended and never evicted
    /// (SnapKV, PyramidKV, AdaKV, CAKE).
    Prefill,
    /// From the first token over budget, every token, prefill and decode alike: evictions are
    /// permanent (H2O, StreamingLLM, TOVA, the seed library's adapted methods).
    Streaming,
    /// Re-chosen at every decode step from the whole cache so far, prompt and generated tokens:
    /// nothing is evicted for good (dynamic sparse attention; with the `tova` scorer, the per-step
    /// oracle).
    PerStep,
    /// Re-chosen at every decode step among the prompt tokens; generated tokens are all kept, and
    /// the budget counts prompt tokens as under `prefill`.
    PerStepPrompt,
}

impl Timing {
    /// Every timing, in listing order.
    pub const ALL: [Timing; 4] = [
        Timing::Prefill,
        Timing::Streaming,
        Timing::PerStep,
        Timing::PerStepPrompt,
    ];

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Timing::Prefill => "prefill",
            Timing::Streaming => "streaming",
            Timing::PerStep => "per-step",
            Timing::PerStepPrompt => "per-step-prompt",
        }
    }

    /// Whether the kept set is re-chosen at every decode step.
    pub fn reselects(self) -> bool {
        matches!(self, Timing::PerStep | Timing::PerStepPrompt)
    }
}
