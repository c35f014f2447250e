//! `oracle-static`: each token scored by the attention the *future decode queries* of the full
//! model pay it (summed over decode steps, aggregated over the group). With `--timing prefill`
//! this is the best single kept set for the whole decode ranked by total mass: an upper
//! reference for one-shot scorers. It sees the future, so no real policy can implement it.

use super::Scored;
use super::{GroupQueries, ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Unit};

crate::settings! {
    /// The attention the future decode queries pay each token, summed over the decode (sees the
    /// future: a reference, not a policy).
    pub struct OracleStatic = "oracle-static" {
        /// How a GQA group's query-head scores become one per cached token: `mean`, `max` or
        /// `sum` (kvpress and AdaKV average the group).
        agg: Aggregation = Aggregation::Mean,
    }
}

#[derive(Clone)]
struct State {
    future: Vec<f32>,
}

impl Scorer for OracleStatic {
    fn reads_future(&self) -> bool {
        true
    }

    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        let n_positions = layer.n_positions();
        let mut future = vec![0.0f32; n_positions];
        let mut queries = GroupQueries::new(layer, unit);
        let mut visible: Vec<usize> = (0..layer.prompt_len).collect();
        for step in layer.prompt_len..n_positions {
            visible.push(step);
            let weights = queries.aggregated(layer, step, &visible, self.agg);
            for (total, weight) in future.iter_mut().zip(weights) {
                *total += weight;
            }
        }
        Ok(Box::new(State { future }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, _layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        out.extend(cache.iter().map(|&position| self.future[position]));
        Ok(())
    }
}

/// The brute-force rule: each position's attention from every decode query that sees it (the
/// group combined by `agg`), summed.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for OracleStatic {
    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        positions
            .iter()
            .map(|&j| {
                (layer.prompt_len..layer.t())
                    .filter(|&at| at >= j)
                    .map(|at| {
                        let visible: Vec<usize> = (0..=at).collect();
                        layer.group_attention(&cache.heads, cache.kv, at, &visible, self.agg)[j]
                    })
                    .sum()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn sums_decode_attention() {
        // Prompt of 2, one decode query q2 = (1,0) over k = (1,0), (0,0), (0,0):
        // [0.576117, 0.211942, 0.211942].
        let (q, k, n) = layer_with(
            &[[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]],
            &[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
            2,
        );
        let layer = context(&q, &k, n);
        let mut state = OracleStatic {
            agg: Aggregation::Mean,
        }
        .start(&layer, &unit(), Protection::default())
        .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 2);
        assert_abs_diff_eq!(scores[0], 0.576_117, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], 0.211_942, epsilon = 1e-6);
    }
}
