//! `observed-attention`: kvpress's `ObservedAttentionPress` (H2O's observed attention, Zhang et
//! al., NeurIPS 2023, arXiv:2306.14048, as kvpress scores it): the mean attention a token has
//! received from the queries that saw it.
//!
//! kvpress (`kvpress/presses/observed_attention_press.py`, `score`, commit 08a43bf): per query
//! head, the prompt's attention weights summed over the queries (`attentions.sum(2)`), each key's
//! sum divided by the number of queries that attend to it (`torch.arange(n_tokens, 0, -1)`: key
//! `j` of an `n`-token prompt is seen by `n - j` queries), then the mean over the KV head's
//! group. Here each query adds its group-averaged attention over the cache it reads, and a
//! token's score is that sum over the number of queries it received it from: the same numbers at
//! the prompt's end (the group's mean commutes with the shared count). Deviation: kvpress scores
//! once, at the prompt's end; here the same running mean also serves the streaming and
//! re-selecting timings, each token's count being the queries that read it while it was cached.

use super::true_query::TrueQuery;
use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Unit};

crate::settings! {
    /// kvpress's observed attention: the mean attention a token received from the queries that
    /// saw it (kvpress `ObservedAttentionPress`; H2O, arXiv:2306.14048).
    pub struct ObservedAttention = "observed-attention" {}
}

/// H2O's cumulative attention (`true-query`, the group's mean), divided when asked.
#[derive(Clone)]
struct State {
    cumulative: Started,
}

/// H2O's score with the group's mean, kvpress's choice.
const CUMULATIVE: TrueQuery = TrueQuery {
    agg: Aggregation::Mean,
};

impl Scorer for ObservedAttention {
    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            cumulative: CUMULATIVE.start(layer, unit, protect)?,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn on_append(&mut self, layer: &LayerContext<'_>, cache: &[usize]) -> Scored {
        self.cumulative.on_append(layer, cache)?;
        Ok(())
    }

    /// A cached entry has been read by every query from its own position to the newest: an
    /// evicted entry never comes back, so one still cached was there all along.
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        self.cumulative.scores(layer, cache, out)?;
        let newest = cache.last().copied().unwrap_or_default();
        for (score, &position) in out.iter_mut().zip(cache) {
            *score /= (newest - position + 1) as f32;
        }
        Ok(())
    }

    fn on_evict(&mut self, index: usize) -> Scored {
        self.cumulative.on_evict(index)?;
        Ok(())
    }

    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        self.cumulative.on_cut(kept)?;
        Ok(())
    }
}

/// The brute-force rule: per entry, the group-averaged attention of every query that read it,
/// summed, over the number of those queries (the positions from its own to the newest).
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for ObservedAttention {
    fn step(
        &self,
        layer: &reference::Layer,
        cache: &Member,
        positions: &[usize],
        running: &mut Vec<f64>,
    ) {
        CUMULATIVE.step(layer, cache, positions, running);
    }

    fn scores(
        &self,
        _: &reference::Layer,
        _: &reference::Policy,
        _: &Member,
        positions: &[usize],
        running: &[f64],
    ) -> Vec<f64> {
        let newest = *positions.last().expect("a cache");
        positions
            .iter()
            .zip(running)
            .map(|(&j, sum)| sum / (newest - j + 1) as f64)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn hand_computed_scores() {
        // q0 = (0,0), q1 = (1,0); k0 = (1,0), k1 = (0,0); scale 1. Position 0 attends {0}: [1];
        // position 1: softmax [1, 0] = [0.731059, 0.268941]. Sums [1.731059, 0.268941] over
        // counts [2, 1]: [0.865529, 0.268941] (kvpress: attentions.sum(2) / arange(2, 0, -1)).
        let (q, k, n) = layer_with(&[[0.0, 0.0], [1.0, 0.0]], &[[1.0, 0.0], [0.0, 0.0]], 2);
        let layer = context(&q, &k, n);
        let mut state = ObservedAttention {}
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 2);
        assert_abs_diff_eq!(scores[0], 0.865_529, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], 0.268_941, epsilon = 1e-6);
    }
}
