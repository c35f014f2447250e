//! `tova`: Token Omission Via Attention (Oren et al., 2024, arXiv:2401.06104): each step, the
//! token with the lowest attention from the *current* query is evicted. Deviation: TOVA averages
//! the weights over all heads of a layer and keeps one set per layer; here each cache (KV head,
//! or query head) is scored by its own group's aggregated weights (`--agg`), so every scorer
//! shares the same cache layout. Under `--timing prefill` the current query is the last prompt
//! token's.

use super::{CurrentQuery, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Unit};

crate::settings! {
    /// TOVA: the current query's attention (Oren et al., 2024, arXiv:2401.06104). Under the
    /// `per-step` timing it is the per-step oracle.
    pub struct Tova = "tova" {
        /// How a GQA group's query-head scores become one per cached token: `mean`, `max` or
        /// `sum` (kvpress and AdaKV average the group).
        agg: Aggregation = Aggregation::Mean,
    }
}

impl Scorer for Tova {
    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(CurrentQuery::new(layer, unit, self.agg)))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

/// The brute-force rule: the newest query's attention (its group combined by `agg`) alone.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Tova {
    fn step(
        &self,
        layer: &reference::Layer,
        cache: &Member,
        positions: &[usize],
        running: &mut Vec<f64>,
    ) {
        let at = *positions.last().expect("a position arrived");
        *running = layer.group_attention(&cache.heads, cache.kv, at, positions, self.agg);
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
    fn only_the_current_query_counts() {
        // q1 = (0,1) over k0 = (1,0), k1 = (0,1): logits [0, 1] -> [0.268941, 0.731059].
        let (q, k, n) = layer_with(&[[5.0, 0.0], [0.0, 1.0]], &[[1.0, 0.0], [0.0, 1.0]], 2);
        let layer = context(&q, &k, n);
        let mut state = Tova {
            agg: Aggregation::Mean,
        }
        .start(&layer, &unit(), Protection::default())
        .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 2);
        assert_abs_diff_eq!(scores[0], 0.268_941, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1], 0.731_059, epsilon = 1e-6);
    }
}
