//! When a policy chooses its kept set: once at the end of the prompt, as tokens stream in, once
//! at the end of the prompt and then as generated tokens stream in, only while generated tokens
//! stream in, or afresh at every decode step; and the settings the timing owns
//! ([`TimingSettings`]): in a cache that evicts as tokens arrive, whether a step's query attends
//! before or after that step's eviction, and how often and on what it compresses.

use super::settings::{self, Broken};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// When the kept set is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Timing {
    /// One-shot at the end of the prompt; generated tokens are appended and never evicted
    /// (SnapKV, PyramidKV, AdaKV, CAKE).
    Prefill,
    /// From the first token over budget, every token, prefill and decode alike: evictions are
    /// permanent (StreamingLLM, the seed library's adapted methods).
    Streaming,
    /// The prompt runs with its full cache; at its end the whole prompt is scored once and cut to
    /// the budget, then every generated token over budget evicts one (H2O's and TOVA's own
    /// generation code).
    PrefillThenStream,
    /// The prompt runs and stays whole; while generated tokens arrive the cache is compressed back
    /// to the budget, every `interval` of them (kvpress's `DecodingPress`).
    Decoding,
    /// Re-chosen at every decode step from the whole cache so far, prompt and generated tokens:
    /// nothing is evicted for good (dynamic sparse attention; with the `tova` scorer, the per-step
    /// oracle).
    PerStep,
    /// Re-chosen at every decode step among the prompt tokens; generated tokens are all kept, and
    /// the budget counts prompt tokens as under `prefill`.
    PerStepPrompt,
}

impl crate::replay::settings::Choices for Timing {
    const ALL: &'static [Self] = &Timing::ALL;
}

impl Timing {
    /// Every timing, in listing order.
    pub const ALL: [Timing; 6] = [
        Timing::Prefill,
        Timing::Streaming,
        Timing::PrefillThenStream,
        Timing::Decoding,
        Timing::PerStep,
        Timing::PerStepPrompt,
    ];

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Timing::Prefill => "prefill",
            Timing::Streaming => "streaming",
            Timing::PrefillThenStream => "prefill-then-stream",
            Timing::Decoding => "decoding",
            Timing::PerStep => "per-step",
            Timing::PerStepPrompt => "per-step-prompt",
        }
    }

    /// What it does, one line (listings and help).
    pub fn about(self) -> &'static str {
        match self {
            Timing::Prefill => "once at the end of the prompt; generated tokens are kept",
            Timing::Streaming => "every token over budget evicts one, prompt and decode alike",
            Timing::PrefillThenStream => {
                "the prompt runs in full, is cut to the budget at its end, then every generated token over budget evicts one"
            }
            Timing::Decoding => {
                "the prompt runs in full and stays whole; while generating, the cache is compressed back to the budget every `interval` tokens (kvpress's DecodingPress)"
            }
            Timing::PerStep => {
                "re-chosen at every decode step from the whole cache (nothing is lost for good)"
            }
            Timing::PerStepPrompt => {
                "re-chosen at every decode step among the prompt tokens; generated tokens are kept"
            }
        }
    }

    /// Whether the kept set is re-chosen at every decode step.
    pub fn reselects(self) -> bool {
        matches!(self, Timing::PerStep | Timing::PerStepPrompt)
    }

    /// Whether the cache evicts as tokens arrive (during decoding at least): one at a time, or a
    /// compression every `interval` of them.
    pub fn streams(self) -> bool {
        matches!(
            self,
            Timing::Streaming | Timing::PrefillThenStream | Timing::Decoding
        )
    }

    /// Whether every eviction is a compression back to the budget, however far the cache has
    /// grown past it (`decoding`, whose prompt is never cut); the other streaming timings evict
    /// one entry per arriving token unless an `interval` groups them.
    pub fn compresses_to_budget(self) -> bool {
        self == Timing::Decoding
    }

    /// Whether it evicts while the prompt runs (so the prompt's own forward pass differs from the
    /// full cache's).
    pub fn evicts_in_prompt(self) -> bool {
        self == Timing::Streaming
    }

    /// Whether the prompt's end is where it chooses (a one-shot cut, the cut before streaming,
    /// or re-selection among the prompt's tokens).
    pub fn cuts_the_prompt(self) -> bool {
        matches!(
            self,
            Timing::Prefill | Timing::PrefillThenStream | Timing::PerStepPrompt
        )
    }
}

crate::settings! {
    /// The settings a timing owns: how a cache that evicts as tokens arrive does so. Every timing
    /// takes them (so one grid may cross timings with them), but only the streaming ones
    /// (`streaming`, `prefill-then-stream`, `decoding`) accept values other than their defaults;
    /// the policy's check says so, naming the timings that do.
    pub struct TimingSettings = "timing" {
        /// Under a streaming timing: whether a step's query attends before (`attend-first`) or
        /// after (`evict-first`) its eviction.
        order: Order = Order::EvictFirst,
        /// Under a streaming timing: tokens the cache grows past its budget before one
        /// compression cuts it back (1: one eviction per token; kvpress's DecodingPress, R-KV);
        /// under `decoding`, the tokens between its compressions.
        interval: usize = 1,
        /// Under an interval above 1: what makes the cache compress, its growth past the budget
        /// by the interval (`growth`, kvpress's PrefillDecodingPress), a position that is a
        /// multiple of it (`position`, R-KV's step_length) or as many tokens since it was last
        /// due (`steps`, kvpress's DecodingPress).
        trigger: Trigger = Trigger::Growth,
    }
}

impl TimingSettings {
    /// The timings whose caches stream, which alone take settings other than the defaults.
    pub const STREAMING: [Timing; 3] = [
        Timing::Streaming,
        Timing::PrefillThenStream,
        Timing::Decoding,
    ];

    /// Its rules beyond the types: an interval of at least 1.
    pub fn check(&self) -> Result<(), Broken> {
        match self.interval {
            0 => Err(Broken {
                key: "interval",
                rule: "must be at least 1".into(),
            }),
            _ => Ok(()),
        }
    }

    /// Whether `value` is the default of its setting `key`.
    pub fn is_default(key: &str, value: &Value) -> bool {
        settings::defaults::<Self>().get(key) == Some(value)
    }

    /// Its settings other than their defaults, as config values by key.
    pub fn changed(&self) -> Map<String, Value> {
        let mut values = settings::values(self);
        values.retain(|key, value| !Self::is_default(key, value));
        values
    }
}

/// In a cache that evicts as tokens arrive, what a step's query attends over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// The cache is cut back to the budget before the new query attends: it sees `budget`
    /// tokens, its own included (StreamingLLM, the seed library).
    #[default]
    EvictFirst,
    /// The new query attends over the `budget` kept tokens and itself, then one token is
    /// evicted (H2O's `H2OKVCache_LayerWise`, TOVA's `TOVACache.reduce`).
    AttendFirst,
}

impl crate::replay::settings::Choices for Order {
    const ALL: &'static [Self] = &[Self::EvictFirst, Self::AttendFirst];
}

impl Order {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Order::EvictFirst => "evict-first",
            Order::AttendFirst => "attend-first",
        }
    }
}

/// Under an `interval` above 1 (or the `decoding` timing), what makes a streaming cache compress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    /// The cache has grown `interval` tokens past its budget: in a cache cut to its budget at the
    /// prompt's end, every `interval` generated tokens, as `steps` (kvpress's
    /// `PrefillDecodingPress`).
    #[default]
    Growth,
    /// The arriving token's position is a multiple of `interval` (R-KV's `divide_method =
    /// "step_length"`: the step after the sequence's length reaches a multiple of
    /// `divide_length`).
    Position,
    /// `interval` tokens have arrived since the last time it was due, counted from the first
    /// token the timing compresses at (kvpress's `DecodingPress`, whose `layer_step_counts`
    /// count the decoding steps and restart at each compression, whatever it removes).
    Steps,
}

impl crate::replay::settings::Choices for Trigger {
    const ALL: &'static [Self] = &[Self::Growth, Self::Position, Self::Steps];
}

impl Trigger {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Trigger::Growth => "growth",
            Trigger::Position => "position",
            Trigger::Steps => "steps",
        }
    }

    /// Whether a cache of `len` entries holding `position` last, `arrived` tokens after it was
    /// last due (or after the timing began to compress), under `budget` and `interval`,
    /// compresses now.
    pub fn due(
        self,
        (len, position, arrived): (usize, usize, usize),
        budget: usize,
        interval: usize,
    ) -> bool {
        match self {
            Trigger::Growth => len >= budget + interval,
            Trigger::Position => position % interval == 0,
            Trigger::Steps => arrived >= interval,
        }
    }
}

/// Where the compression cut falls relative to the question of a prompt that has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// The question is part of the prompt the policy compresses: the cut falls at the prompt's
    /// end (the needle protocol of the PyramidKV and SnapKV papers).
    #[default]
    QuestionInPrompt,
    /// The context is compressed before the question is seen, as kvpress's pipeline does: the
    /// cut falls where the trace's `question` span starts, and the question, what follows it
    /// and the answer are appended uncompressed, their queries counted as decode queries.
    QuestionAgnostic,
}

impl crate::replay::settings::Choices for Protocol {
    const ALL: &'static [Self] = &[Self::QuestionInPrompt, Self::QuestionAgnostic];
}

impl Protocol {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::QuestionInPrompt => "question-in-prompt",
            Protocol::QuestionAgnostic => "question-agnostic",
        }
    }
}
