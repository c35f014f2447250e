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
            Timing::Prefill | Timing::PrefillThenStream | Timing::Decoding => Dating::PromptEnd,
        }
    }
}

/// The regions of a trace's positions: each position's region before the recent window is
/// considered (0 for the sinks, 1 + span index, `None` for neither).
#[derive(Debug, Clone)]
pub(super) struct Regions {
    fixed: Vec<Option<usize>>,
    count: usize,
}

impl Regions {
    pub fn new(n_positions: usize, spans: &[Span]) -> Self {
        let fixed = (0..n_positions)
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
            fixed,
            count: spans.len() + 3,
        }
    }

    /// The number of regions.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The region of position `j` for a query at `position`.
    pub fn of(&self, j: usize, position: usize) -> usize {
        match self.fixed[j] {
            Some(region) => region,
            None if j + RECENT > position => self.count - 2,
            None => self.count - 1,
        }
    }

    /// The full attention's mass in each region, for a query at `position` with `weights` over
    /// `0..=position` (computed once per query and shared by every policy).
    pub fn full_mass(&self, weights: &[f32], position: usize) -> Vec<f64> {
        let mut mass = vec![0.0; self.count];
        for (j, &weight) in weights.iter().enumerate().take(position + 1) {
            mass[self.of(j, position)] += weight as f64;
        }
        mass
    }
}

/// Attributes the lost mass of a cache's samples, one decode step after another, in O(kept) per
/// sample: a region's loss is its full mass (shared, [`Regions::full_mass`]) less its kept mass;
/// the loss while decoding is the mass of the positions held at an earlier step, or generated,
/// and gone now; the rest of the loss is the prompt's.
pub(super) struct LostMassCounter<'a> {
    dating: Dating,
    prompt_len: usize,
    regions: &'a Regions,
    /// Positions held at an earlier decode step of this cache, once each.
    held_before: Vec<usize>,
    is_held_before: Vec<bool>,
}

impl<'a> LostMassCounter<'a> {
    pub fn new(
        dating: Dating,
        regions: &'a Regions,
        prompt_len: usize,
        n_positions: usize,
    ) -> Self {
        Self {
            dating,
            prompt_len,
            regions,
            held_before: Vec::new(),
            is_held_before: vec![false; n_positions],
        }
    }

    /// Buckets per sample: the regions, then [`WHEN`].
    pub fn buckets(&self) -> usize {
        self.regions.count() + WHEN.len()
    }

    /// Writes the lost mass of one sample into `out` (one value per bucket): `full_mass` is the
    /// query's mass per region, `kept` its cache (`in_set` marking it).
    pub fn count(&self, sample: Sample<'_>, full_mass: &[f64], out: &mut [f64]) {
        let n_regions = self.regions.count();
        let (regions, when) = out.split_at_mut(n_regions);
        regions.copy_from_slice(full_mass);
        for &j in sample.kept {
            regions[self.regions.of(j, sample.position)] -= sample.weights[j] as f64;
        }
        for region in regions.iter_mut() {
            *region = region.max(0.0);
        }
        let lost: f64 = regions.iter().sum();
        when.fill(0.0);
        match self.dating {
            Dating::NotRead => when[3] = lost,
            dating => {
                // Held at an earlier step, or generated (a generated token never held was
                // evicted on arrival, while decoding): gone now.
                let generated =
                    (self.prompt_len..=sample.position).filter(|&j| !self.is_held_before[j]);
                let decoding: f64 = self
                    .held_before
                    .iter()
                    .copied()
                    .chain(generated)
                    .filter(|&j| !sample.in_set[j])
                    .map(|j| sample.weights[j] as f64)
                    .sum();
                when[2] = decoding;
                when[if dating == Dating::PromptEnd { 0 } else { 1 }] = (lost - decoding).max(0.0);
            }
        }
    }

    /// Marks the positions of a decode step's cache as held.
    pub fn held(&mut self, kept: &[usize]) {
        if self.dating == Dating::NotRead {
            return;
        }
        for &j in kept {
            if !self.is_held_before[j] {
                self.is_held_before[j] = true;
                self.held_before.push(j);
            }
        }
    }
}

/// One sample as the counter sees it.
#[derive(Clone, Copy)]
pub(super) struct Sample<'a> {
    /// The full attention over `0..=position`.
    pub weights: &'a [f32],
    /// The cache.
    pub kept: &'a [usize],
    /// Per position, whether it is in the cache.
    pub in_set: &'a [bool],
    /// The query's position.
    pub position: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten positions, a prompt of 8, a span `needle` at 5..7, query at 9 (RECENT = 32 covers
    /// every other position). Weights 0.1 each; kept {0, 5, 9}. Lost: sinks 1, 2, 3 (0.3), needle
    /// 6 (0.1), recent 4, 7, 8 (0.3). Position 8 was generated (and held at the previous step), so
    /// it left while decoding; the rest of the loss is the prompt's.
    #[test]
    fn by_region_and_time_by_hand() {
        let spans = [Span {
            name: "needle".into(),
            start: 5,
            end: 7,
        }];
        let regions = Regions::new(10, &spans);
        let weights = [0.1f32; 10];
        let full = regions.full_mass(&weights, 9);
        let mut in_set = [false; 10];
        for j in [0, 5, 9] {
            in_set[j] = true;
        }
        let sample = Sample {
            weights: &weights,
            kept: &[0, 5, 9],
            in_set: &in_set,
            position: 9,
        };
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-7);
        let run = |dating: Dating| {
            let mut counter = LostMassCounter::new(dating, &regions, 8, 10);
            counter.held(&[0, 5, 8]);
            let mut out = vec![0.0; counter.buckets()];
            counter.count(sample, &full, &mut out);
            out
        };
        // sinks, needle, recent, rest, then prompt end, prompt streaming, decoding, not read.
        let out = run(Dating::PromptEnd);
        assert!(
            close(&out, &[0.3, 0.1, 0.3, 0.0, 0.6, 0.0, 0.1, 0.0]),
            "{out:?}"
        );
        let out = run(Dating::PromptStreaming);
        assert!(close(&out[4..], &[0.0, 0.6, 0.1, 0.0]), "{out:?}");
        let out = run(Dating::NotRead);
        assert!(close(&out[4..], &[0.0, 0.0, 0.0, 0.7]), "{out:?}");
    }

    proptest::proptest! {
        /// Against a walk over every position: each lost position in its region, and dated by
        /// whether it was held at an earlier step or generated.
        #[test]
        fn equals_the_walk_over_every_position(
            seed in 0u64..1000,
            dating in 0usize..3,
        ) {
            let dating = [Dating::PromptEnd, Dating::PromptStreaming, Dating::NotRead][dating];
            let (prompt_len, n) = (40, 48);
            let spans = [Span { name: "a".into(), start: 10, end: 14 }];
            let regions = Regions::new(n, &spans);
            let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let mut next = || {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 33) as f64 / (1u64 << 31) as f64
            };
            let mut counter = LostMassCounter::new(dating, &regions, prompt_len, n);
            let mut held = vec![false; n];
            for position in prompt_len..n {
                let weights: Vec<f32> = (0..=position).map(|_| next() as f32).collect();
                let kept: Vec<usize> = (0..=position).filter(|_| next() < 0.4).collect();
                let mut in_set = vec![false; n];
                for &j in &kept {
                    in_set[j] = true;
                }
                let mut out = vec![0.0; counter.buckets()];
                let sample = Sample { weights: &weights, kept: &kept, in_set: &in_set, position };
                counter.count(sample, &regions.full_mass(&weights, position), &mut out);
                let mut walk = vec![0.0; counter.buckets()];
                for j in (0..=position).filter(|&j| !in_set[j]) {
                    let w = weights[j] as f64;
                    walk[regions.of(j, position)] += w;
                    let when = match dating {
                        Dating::NotRead => 3,
                        _ if held[j] || j >= prompt_len => 2,
                        Dating::PromptEnd => 0,
                        Dating::PromptStreaming => 1,
                    };
                    walk[regions.count() + when] += w;
                }
                for (a, b) in out.iter().zip(&walk) {
                    proptest::prop_assert!((a - b).abs() < 1e-9, "{out:?} vs {walk:?}");
                }
                counter.held(&kept);
                for &j in &kept {
                    held[j] = true;
                }
            }
        }
    }
}
