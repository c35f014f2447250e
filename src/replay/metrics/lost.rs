//! Where the lost mass went: a sample's full-attention mass on the positions its cache does not
//! hold (or, under a re-selecting timing, does not read), `1 - retained mass` up to the weights'
//! rounding, split two ways.
//!
//! By region of the context, each position in the first that holds it: the `sinks` (the first
//! [`SINKS`] positions, StreamingLLM's attention sinks), each named span of the trace (the needle,
//! the question), the `recent` positions (the [`RECENT`] positions up to the query's own), and the
//! `rest`.
//!
//! By when the position left: `prompt end` (cut at the end of the prompt: the prefill timings),
//! `prompt streaming` (evicted while the prompt streamed in, before its end), `decoding` (held at
//! an earlier decode step of this cache, evicted since), `not read` (re-selecting timings, which
//! evict nothing: held but not chosen at this step).

use super::super::Timing;
use crate::trace::Span;
use serde::Serialize;

/// The attention-sink positions: StreamingLLM's four.
pub const SINKS: usize = 4;

/// The recent positions: up to the query's own, this many.
pub const RECENT: usize = 32;

/// When lost positions left, in column order.
pub const WHEN: [&str; 4] = ["prompt end", "prompt streaming", "decoding", "not read"];

/// The share of a sample's attention lost in one region or at one time, mean over samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LostShare {
    /// The region (`sinks`, a span's name, `recent`, `rest`) or time (one of [`WHEN`]).
    pub name: String,
    /// Full-attention mass lost there.
    pub mass: f64,
}

/// The region names of a trace with `spans`, in column order.
pub fn regions(spans: &[Span]) -> Vec<String> {
    let mut names = vec!["sinks".to_string()];
    names.extend(spans.iter().map(|span| span.name.clone()));
    names.push("recent".into());
    names.push("rest".into());
    names
}

/// How one policy's lost positions are dated: what a loss at or before the prompt's end is
/// called under its timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dating {
    /// Prefill timings: the prompt is cut at its end.
    PromptEnd,
    /// Streaming: the prompt's tokens are evicted as it streams in.
    PromptStreaming,
    /// Re-selecting timings: nothing leaves; every loss is a position not read.
    NotRead,
}

impl Dating {
    /// The dating of a timing's losses.
    pub fn of(timing: Timing) -> Self {
        match timing {
            Timing::Streaming => Dating::PromptStreaming,
            Timing::PerStep | Timing::PerStepPrompt => Dating::NotRead,
            Timing::Prefill | Timing::PrefillThenStream => Dating::PromptEnd,
        }
    }
}

/// Attributes the lost mass of a cache's samples, one decode step after another.
pub(super) struct LostMassCounter {
    dating: Dating,
    prompt_len: usize,
    /// Per position, its region before the recent window is considered: 0 for the sinks,
    /// 1 + span index, or `None` for neither.
    fixed_region: Vec<Option<usize>>,
    n_regions: usize,
    /// Positions held at an earlier decode step of this cache.
    held_before: Vec<bool>,
}

impl LostMassCounter {
    pub fn new(dating: Dating, prompt_len: usize, n_positions: usize, spans: &[Span]) -> Self {
        let fixed_region = (0..n_positions)
            .map(|j| {
                if j < SINKS {
                    Some(0)
                } else {
                    spans
                        .iter()
                        .position(|span| (span.start..span.end).contains(&j))
                        .map(|index| 1 + index)
                }
            })
            .collect();
        Self {
            dating,
            prompt_len,
            fixed_region,
            n_regions: spans.len() + 3,
            held_before: vec![false; n_positions],
        }
    }

    /// Buckets per sample: the regions, then [`WHEN`].
    pub fn buckets(&self) -> usize {
        self.n_regions + WHEN.len()
    }

    /// Adds the lost mass of one sample (`weights` over `0..=position`, `in_set` its cache) to
    /// `out` (one value per bucket).
    pub fn count(&self, weights: &[f32], in_set: &[bool], position: usize, out: &mut [f64]) {
        let recent = self.n_regions - 2;
        for (j, &weight) in weights.iter().enumerate().take(position + 1) {
            if in_set[j] {
                continue;
            }
            let weight = weight as f64;
            let region = match self.fixed_region[j] {
                Some(region) => region,
                None if j + RECENT > position => recent,
                None => recent + 1,
            };
            let when = match self.dating {
                Dating::NotRead => 3,
                _ if self.held_before[j] || j >= self.prompt_len => 2,
                Dating::PromptEnd => 0,
                Dating::PromptStreaming => 1,
            };
            out[region] += weight;
            out[self.n_regions + when] += weight;
        }
    }

    /// Marks the positions of a decode step's cache as held.
    pub fn held(&mut self, kept: &[usize]) {
        for &j in kept {
            self.held_before[j] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten positions, a span `needle` at 5..7, prompt of 8, query at 9 (so `recent` is 0..=9 after
    /// the sinks and span: RECENT = 32 covers it). Weights 0.1 each; kept {0, 5, 9}. Lost: sinks
    /// 1, 2, 3 (0.3), needle 6 (0.1), recent 4, 7, 8 (0.3). Prompt positions 1-4, 6, 7 were cut
    /// at the prompt's end; 8 was held at the previous step, so it left while decoding.
    #[test]
    fn by_region_and_time_by_hand() {
        let spans = [Span {
            name: "needle".into(),
            start: 5,
            end: 7,
        }];
        let mut counter = LostMassCounter::new(Dating::PromptEnd, 8, 10, &spans);
        counter.held(&[0, 5, 8]);
        let weights = [0.1f32; 10];
        let mut in_set = [false; 10];
        for j in [0, 5, 9] {
            in_set[j] = true;
        }
        let mut out = vec![0.0; counter.buckets()];
        counter.count(&weights, &in_set, 9, &mut out);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-7;
        // sinks, needle, recent, rest, then prompt end, prompt streaming, decoding, not read.
        let expected = [0.3, 0.1, 0.3, 0.0, 0.6, 0.0, 0.1, 0.0];
        assert!(
            out.iter().zip(expected).all(|(a, b)| close(*a, b)),
            "{out:?}"
        );
        let mut streaming = LostMassCounter::new(Dating::PromptStreaming, 8, 10, &spans);
        let mut out = vec![0.0; streaming.buckets()];
        streaming.held(&[]);
        streaming.count(&weights, &in_set, 9, &mut out);
        assert!(close(out[5], 0.6) && close(out[6], 0.1), "{out:?}");
        let not_read = LostMassCounter::new(Dating::NotRead, 8, 10, &spans);
        let mut out = vec![0.0; not_read.buckets()];
        not_read.count(&weights, &in_set, 9, &mut out);
        assert!(close(out[7], 0.7), "{out:?}");
    }
}
