//! `oracle-per-step`: at every decode step the kept set is re-chosen from the *full* cache as the
//! tokens the current query attends to most (aggregated over the group). Evictions are not
//! permanent, so this is the bound no causal policy can beat at the same per-step budget (for a
//! query-head cache exactly; for a KV-head cache, on the group's mean retained mass with
//! `--agg mean`).

use super::{GroupQueries, ScoreState, Scorer};
use crate::replay::{Aggregation, LayerContext, Unit};

/// The current query's full attention, re-selected every step.
pub struct OraclePerStep {
    pub(super) agg: Aggregation,
}

struct State<'a> {
    queries: GroupQueries<'a>,
    agg: Aggregation,
}

impl Scorer for OraclePerStep {
    fn name(&self) -> &'static str {
        "oracle-per-step"
    }

    fn reselects(&self) -> bool {
        true
    }

    fn start<'a>(&self, layer: &LayerContext<'a>, unit: &Unit) -> Box<dyn ScoreState + 'a> {
        Box::new(State {
            queries: GroupQueries::new(layer, unit),
            agg: self.agg,
        })
    }
}

impl ScoreState for State<'_> {
    fn on_append(&mut self, _cache: &[usize]) {}

    fn scores(&mut self, cache: &[usize], out: &mut Vec<f32>) {
        let newest = *cache.last().expect("non-empty cache");
        *out = self.queries.aggregated(newest, cache, self.agg);
    }
}
