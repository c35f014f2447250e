//! `random`: a seeded uniform score per (layer, cache, position), the floor every other scorer
//! must clear. The score is a SplitMix64 hash of those and `--seed`, so it does not depend on
//! evaluation order or thread count.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Unit};
use crate::splitmix::hash;

crate::settings! {
    /// A seeded uniform score per (layer, cache, position): the floor every scorer must clear.
    pub struct Random = "random" {
        /// The seed of the SplitMix64 hash that gives each score.
        seed: u64 = 0,
    }
}

#[derive(Clone)]
struct State {
    stream: u64,
}

impl Scorer for Random {
    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        let stream = hash(hash(self.seed ^ (layer.layer as u64) << 32) ^ unit.index as u64);
        Ok(Box::new(State { stream }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, _layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        out.extend(cache.iter().map(|&position| {
            (hash(self.stream ^ position as u64) >> 40) as f32 / (1u64 << 24) as f32
        }));
        Ok(())
    }
}

/// The brute-force rule: SplitMix64 of (seed, layer, cache, position), its top 24 bits as a
/// fraction.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Random {
    fn fixture(&self, seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        vec![("seed", seed.into())]
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        use reference::splitmix64;
        let stream =
            splitmix64(splitmix64(self.seed ^ (layer.index as u64) << 32) ^ cache.unit as u64);
        positions
            .iter()
            .map(|&j| (splitmix64(stream ^ j as u64) >> 40) as f64 / (1u64 << 24) as f64)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn seeded_and_in_unit_interval() {
        let (q, k, n) = layer_with(&[[0.0, 0.0]; 64], &[[0.0, 0.0]; 64], 64);
        let layer = context(&q, &k, n);
        let first = scores_after(
            Random { seed: 7 }
                .start(&layer, &unit(), Protection::default())
                .unwrap()
                .as_mut(),
            &layer,
            64,
        );
        let again = scores_after(
            Random { seed: 7 }
                .start(&layer, &unit(), Protection::default())
                .unwrap()
                .as_mut(),
            &layer,
            64,
        );
        let other = scores_after(
            Random { seed: 8 }
                .start(&layer, &unit(), Protection::default())
                .unwrap()
                .as_mut(),
            &layer,
            64,
        );
        assert_eq!(first, again);
        assert_ne!(first, other);
        assert!(first.iter().all(|s| (0.0..1.0).contains(s)));
    }
}
