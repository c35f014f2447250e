//! `oracle-per-step`: at every decode step the kept set is re-chosen from the *full* cache as the
//! tokens the current query attends to most (aggregated over the group). Evictions are not
//! permanent, so this is the bound no causal policy can beat at the same per-step budget (for a
//! query-head cache exactly; for a KV-head cache, on the group's mean retained mass with
//! `--agg mean`).

use super::{CurrentQuery, ScoreState, Scorer};
use crate::replay::{Aggregation, LayerContext, Unit};

/// The current query's full attention, re-selected every step.
pub struct OraclePerStep {
    pub(super) agg: Aggregation,
}

impl Scorer for OraclePerStep {
    fn name(&self) -> &'static str {
        "oracle-per-step"
    }

    fn reselects(&self) -> bool {
        true
    }

    fn start<'a>(&self, layer: &LayerContext<'a>, unit: &Unit) -> Box<dyn ScoreState + 'a> {
        Box::new(CurrentQuery::new(layer, unit, self.agg))
    }
}
