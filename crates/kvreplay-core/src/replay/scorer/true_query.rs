//! `true-query`: H2O's heavy-hitter score (Zhang et al., NeurIPS 2023, arXiv:2306.14048), the
//! cumulative attention each cached token has received from the real queries seen so far.
//!
//! At each appended position its query attends over the current cache (itself included, causal);
//! the group's weights are aggregated (`--agg`) and added to the scores; a new token starts with
//! its own self-attention. Unlike the 2025-01 H2O code, whose prefill scores let rows before the
//! last window see future keys, attention here is always causal.

use super::Scored;
use super::{AlignedScores, GroupQueries, ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Unit};

crate::settings! {
    /// H2O's heavy-hitter score: the attention each cached token has received from the real
    /// queries so far (Zhang et al., NeurIPS 2023, arXiv:2306.14048).
    pub struct TrueQuery = "true-query" {
        /// How a GQA group's query-head scores become one per cached token: `mean`, `max` or
        /// `sum` (kvpress and AdaKV average the group).
        agg: Aggregation = Aggregation::Mean,
    }
}

#[derive(Clone)]
struct State {
    queries: GroupQueries,
    agg: Aggregation,
    scores: AlignedScores,
}

impl Scorer for TrueQuery {
    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            queries: GroupQueries::new(layer, unit),
            agg: self.agg,
            scores: AlignedScores::default(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        self.scores.0.push(0.0);
        self.queries
            .accumulate_aggregated(layer, newest, cache, self.agg, &mut self.scores.0);
        Ok(())
    }

    fn scores(
        &mut self,
        _layer: &LayerContext<'_>,
        _cache: &[usize],
        out: &mut Vec<f32>,
    ) -> Scored {
        self.scores.copy_to(out);
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        self.scores.remove(index);
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        self.scores.retain(kept);
        Ok(())
    }
}

/// The brute-force rule: every query's attention (its group combined by `agg`) over the cache it
/// reads adds to the scores; a new token starts at 0.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for TrueQuery {
    fn step(
        &self,
        layer: &reference::Layer,
        cache: &Member,
        positions: &[usize],
        running: &mut Vec<f64>,
    ) {
        let at = *positions.last().expect("a position arrived");
        running.push(0.0);
        let p = layer.group_attention(&cache.heads, cache.kv, at, positions, self.agg);
        for (score, weight) in running.iter_mut().zip(p) {
            *score += weight;
        }
    }

    fn scores(
        &self,
        _: &reference::Layer,
        _: &reference::Policy,
        _: &Member,
        _: &[usize],
        running: &[f64],
    ) -> Vec<f64> {
        running.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn hand_computed_scores() {
        // q0 = (0,0), q1 = (1,0); k0 = (1,0), k1 = (0,0); scale 1.
        // position 0 attends {0}: [1]. position 1: logits [1, 0] -> [e/(e+1), 1/(e+1)]
        // = [0.731059, 0.268941]. Scores: [1.731059, 0.268941].
        let (q, k, n) = layer_with(&[[0.0, 0.0], [1.0, 0.0]], &[[1.0, 0.0], [0.0, 0.0]], 2);
        let layer = context(&q, &k, n);
        let mut state = TrueQuery {
            agg: Aggregation::Mean,
        }
        .start(&layer, &unit(), Protection::default())
        .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 2);
        assert_abs_diff_eq!(scores[0], 1.731_059, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], 0.268_941, epsilon = 1e-6);
    }
}
