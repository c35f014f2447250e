//! `recency`: StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): keep the attention sinks (set
//! with `--sinks`; the paper uses 4) and the most recent tokens. The score is the position, so the
//! oldest unprotected token goes first.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Unit};

crate::settings! {
    /// StreamingLLM's rule: the sinks (`sinks`) and the most recent tokens (Xiao et al., 2023,
    /// arXiv:2309.17453).
    pub struct Recency = "recency" {}
}

#[derive(Clone)]
struct State;

impl Scorer for Recency {
    fn start(
        &self,
        _layer: &LayerContext<'_>,
        _unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, _layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        out.extend(cache.iter().map(|&position| position as f32));
        Ok(())
    }
}

/// The brute-force rule: a position scores itself (the newest kept).
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Recency {
    fn scores(
        &self,
        _: &reference::Layer,
        _: &reference::Policy,
        _: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        positions.iter().map(|&j| j as f64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn score_is_position() {
        let (q, k, n) = layer_with(&[[0.0, 0.0]; 3], &[[0.0, 0.0]; 3], 3);
        let layer = context(&q, &k, n);
        let mut state = Recency {}
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        assert_eq!(scores_after(state.as_mut(), &layer, 3), vec![0.0, 1.0, 2.0]);
    }
}
