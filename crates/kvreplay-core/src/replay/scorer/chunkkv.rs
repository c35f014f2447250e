//! `chunkkv`: any scorer's scores averaged over fixed-size chunks of the prompt, so that whole
//! chunks are kept (Liu et al., 2025, arXiv:2502.00299; kvpress `ChunkKVPress`,
//! `kvpress/presses/chunkkv_press.py` lines 51-113, commit 8bb29b9c). The prompt is cut into
//! chunks of `chunk_length` tokens from its start, the remainder being one shorter chunk; every
//! token scores the mean of its chunk's scores under the `inner` scorer (with that scorer's
//! default settings). kvpress sums the scores over the KV heads before averaging, so one set of
//! chunks serves the whole layer: run it with `gqa = "layer"` for that (the mean over KV heads
//! ranks the same).
//!
//! Deviation: kvpress keeps `int(chunks × (1 − compression_ratio))` whole chunks (at least one);
//! kvreplay keeps exactly the budget, so after the best whole chunks it keeps the first tokens
//! of the next (equal scores go to the lower position). With a budget that is a multiple of
//! `chunk_length` and no shorter chunk among the best, the two keep the same tokens.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};

crate::settings! {
    /// ChunkKV: an inner scorer's scores averaged over chunks of the prompt, whole chunks kept
    /// (arXiv:2502.00299; kvpress `ChunkKVPress`).
    pub struct ChunkKv = "chunkkv" {
        /// Tokens per chunk (`chunk_length`, 20 in kvpress).
        chunk_length: usize = 20,
        /// The scorer whose scores are averaged (its default settings).
        inner: String = "snapkv".to_string(),
    }
}

impl ChunkKv {
    /// The inner scorer, when `inner` names another registered scorer.
    fn inner(&self) -> Result<Box<dyn Scorer>, Broken> {
        super::inner_scorer(
            &self.inner,
            <Self as crate::replay::settings::Declared>::NAME,
        )
    }

    fn inner_or_panic(&self) -> Box<dyn Scorer> {
        self.inner().expect("check() accepted the inner scorer")
    }
}

#[derive(Clone)]
struct State {
    inner: Started,
    chunk_length: usize,
}

impl Scorer for ChunkKv {
    fn check(&self) -> Result<(), Broken> {
        if self.chunk_length == 0 {
            return Err(Broken {
                key: "chunk_length",
                rule: "must be at least 1".into(),
            });
        }
        if self.inner()?.supports(Timing::Prefill) {
            Ok(())
        } else {
            Err(Broken {
                key: "inner",
                rule: "must be a scorer that selects at the end of the prompt (prefill timing)"
                    .into(),
            })
        }
    }

    fn reads_future(&self) -> bool {
        self.inner_or_panic().reads_future()
    }

    fn needs_values(&self) -> bool {
        self.inner_or_panic().needs_values()
    }

    fn needs_rope(&self) -> bool {
        self.inner_or_panic().needs_rope()
    }

    fn supports(&self, timing: Timing) -> bool {
        timing == Timing::Prefill
    }

    fn check_trace(&self, meta: &crate::trace::TraceMeta) -> Result<(), String> {
        self.inner_or_panic().check_trace(meta)
    }

    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            inner: self.inner_or_panic().start(layer, unit, protect)?,
            chunk_length: self.chunk_length,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        let inner = super::inner_scorer(&self.inner, "chunkkv")
            .ok()?
            .reference()?;
        Some(Box::new(Rule {
            chunk_length: self.chunk_length,
            inner,
        }))
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        self.inner.on_append(layer, cache)?;
        Ok(())
    }

    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        self.inner.scores(layer, cache, out)?;
        average_chunks(out, self.chunk_length);
        Ok(())
    }
}

/// Replaces every score by the mean of its chunk's (`chunk` entries from the start, the last
/// chunk shorter when the length does not divide), summed in f64.
fn average_chunks(scores: &mut [f32], chunk: usize) {
    for part in scores.chunks_mut(chunk) {
        let mean = part.iter().map(|&s| f64::from(s)).sum::<f64>() / part.len() as f64;
        part.fill(mean as f32);
    }
}

/// The brute-force rule: the `inner` rule's scores averaged over each chunk of `chunk_length`
/// cached tokens. The fixtures use `knorm` inside, whose scores need no window.
#[cfg(any(test, feature = "reference"))]
struct Rule {
    chunk_length: usize,
    inner: Box<dyn ScorerRule>,
}

#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Rule {
    fn fixture(&self, _seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        vec![("inner", "knorm".into()), ("chunk_length", 3.into())]
    }

    fn step(
        &self,
        layer: &reference::Layer,
        cache: &Member,
        positions: &[usize],
        running: &mut Vec<f64>,
    ) {
        self.inner.step(layer, cache, positions, running);
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        policy: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        running: &[f64],
    ) -> Vec<f64> {
        let inner = self.inner.scores(layer, policy, cache, positions, running);
        inner
            .chunks(self.chunk_length)
            .flat_map(|chunk| {
                let mean = chunk.iter().sum::<f64>() / chunk.len() as f64;
                std::iter::repeat_n(mean, chunk.len())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn chunks_score_their_mean_and_the_remainder_its_own() {
        let mut scores = vec![1.0, 3.0, 2.0, 6.0, 5.0];
        average_chunks(&mut scores, 2);
        assert_eq!(scores, vec![2.0, 2.0, 4.0, 4.0, 5.0]);
    }

    #[test]
    fn knorm_by_chunks_by_hand() {
        // Keys of norms 1, 3, 2, 2, 4: knorm scores -1, -3, -2, -2, -4; chunks of 2 score their
        // means -2, -2 and the last, alone, -4.
        let (q, k, n) = layer_with(
            &[[0.0, 0.0]; 5],
            &[[1.0, 0.0], [0.0, 3.0], [2.0, 0.0], [0.0, 2.0], [4.0, 0.0]],
            5,
        );
        let layer = context(&q, &k, n);
        let scorer = ChunkKv {
            chunk_length: 2,
            inner: "knorm".into(),
        };
        scorer.check().unwrap();
        let mut state = scorer
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        assert_eq!(
            scores_after(state.as_mut(), &layer, 5),
            vec![-2.0, -2.0, -2.0, -2.0, -4.0]
        );
    }

    #[test]
    fn inner_must_be_another_scorer_for_the_prompt_end() {
        for (inner, key_rule) in [
            ("chunkkv", "another registered"),
            ("nope", "another registered"),
            ("recency", ""),
        ] {
            let scorer = ChunkKv {
                chunk_length: 4,
                inner: inner.into(),
            };
            match scorer.check() {
                Ok(()) => assert!(key_rule.is_empty(), "{inner} accepted"),
                Err(broken) => {
                    assert_eq!(broken.key, "inner");
                    assert!(broken.rule.contains(key_rule), "{}", broken.rule);
                }
            }
        }
        let zero = ChunkKv {
            chunk_length: 0,
            inner: "knorm".into(),
        };
        assert_eq!(zero.check().unwrap_err().key, "chunk_length");
    }
}
