//! `value-aware`: any scorer's scores multiplied by the L1 norm of each token's value vector
//! (VATP, Guo et al., 2024, arXiv:2406.12335: "attention is not the only choice", a token's
//! importance is its accumulated attention times ‖v‖₁). The `inner` scorer (with its default
//! settings) ranks as it does under every timing it supports; before each choice its scores are
//! scaled by the values of the cache's KV head. Scores are taken as they come: a scorer whose
//! scores can be negative (`knorm`, `keydiff`) reverses its order there, so the modifier is meant
//! for the attention scorers (`true-query`, `snapkv`, `tova`, `cake`). Needs the trace's values.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};

crate::settings! {
    /// VATP: an inner scorer's scores times each token's value L1 norm (arXiv:2406.12335).
    pub struct ValueAware = "value-aware" {
        /// The scorer whose scores are scaled (its default settings).
        inner: String = "true-query".to_string(),
    }
}

impl ValueAware {
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
    kv_head: usize,
}

impl Scorer for ValueAware {
    fn check(&self) -> Result<(), Broken> {
        self.inner().map(|_| ())
    }

    fn reads_future(&self) -> bool {
        self.inner_or_panic().reads_future()
    }

    fn needs_values(&self) -> bool {
        true
    }

    fn needs_rope(&self) -> bool {
        self.inner_or_panic().needs_rope()
    }

    fn supports(&self, timing: Timing) -> bool {
        self.inner_or_panic().supports(timing)
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
            kv_head: unit.kv_head,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        let inner = super::inner_scorer(&self.inner, "value-aware")
            .ok()?
            .reference()?;
        Some(Box::new(Rule { inner }))
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        self.inner.on_append(layer, cache)?;
        Ok(())
    }

    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        self.inner.scores(layer, cache, out)?;
        let values = layer
            .values(self.kv_head)
            .expect("the engine checks that value-aware's trace has values");
        for (score, &position) in out.iter_mut().zip(cache) {
            *score *= values.row(position).iter().map(|v| v.abs()).sum::<f32>();
        }
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        self.inner.on_evict(index)?;
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        self.inner.on_cut(kept)?;
        Ok(())
    }
}

/// The brute-force rule: the `inner` rule's scores times each value's L1 norm.
#[cfg(any(test, feature = "reference"))]
struct Rule {
    inner: Box<dyn ScorerRule>,
}

#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Rule {
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
        positions
            .iter()
            .zip(inner)
            .map(|(&j, score)| {
                score
                    * layer
                        .value(cache.kv, j)
                        .iter()
                        .map(|x| x.abs())
                        .sum::<f64>()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use ndarray::Array3;

    #[test]
    fn recency_times_value_norms_by_hand() {
        // Recency scores 0, 1, 2; values with L1 norms 3, 0.5, 1: scores 0, 0.5, 2.
        let (q, k, n) = layer_with(&[[0.0, 0.0]; 3], &[[0.0, 0.0]; 3], 3);
        let v = Array3::from_shape_vec((1, 3, 2), vec![1.0, -2.0, 0.25, 0.25, 0.0, -1.0]).unwrap();
        let layer = LayerContext {
            v: Some(v.view()),
            ..context(&q, &k, n)
        };
        let scorer = ValueAware {
            inner: "recency".into(),
        };
        scorer.check().unwrap();
        let mut state = scorer
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        assert_eq!(scores_after(state.as_mut(), &layer, 3), vec![0.0, 0.5, 2.0]);
    }

    #[test]
    fn inner_must_be_another_scorer_and_timings_follow_it() {
        for inner in ["value-aware", "nope"] {
            let scorer = ValueAware {
                inner: inner.into(),
            };
            assert_eq!(scorer.check().unwrap_err().key, "inner");
        }
        let snapkv = ValueAware {
            inner: "snapkv".into(),
        };
        assert!(snapkv.supports(Timing::Prefill) && !snapkv.supports(Timing::Streaming));
    }
}
