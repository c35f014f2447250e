//! `toy`: a scorer that exists only in the library's own tests, added exactly as
//! docs/architecture.md says (this file and one registry line), to show that a new method is then
//! replayed, named in errors, takes its settings from its declaration and is listed by
//! `kvreplay methods`. Its rule: even positions score `weight`, odd positions 0.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Unit};

crate::settings! {
    /// Keeps even positions first (a test fixture, not a method; at rule version 2 to test that
    /// a changed rule names new runs).
    pub struct Toy = "toy", version 2 {
        /// The score of an even position (> 0).
        weight: f64 = 1.0,
    }
}

#[derive(Clone)]
struct State {
    weight: f32,
}

impl Scorer for Toy {
    fn check(&self) -> Result<(), Broken> {
        if self.weight > 0.0 {
            Ok(())
        } else {
            Err(Broken {
                key: "weight",
                rule: "must be positive".into(),
            })
        }
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        _unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            weight: self.weight as f32,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, _layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        out.clear();
        out.extend(
            cache
                .iter()
                .map(|p| if p % 2 == 0 { self.weight } else { 0.0 }),
        );
        Ok(())
    }
}

/// The brute-force rule: even positions score `weight`, odd ones 0.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Toy {
    fn scores(
        &self,
        _: &reference::Layer,
        _: &reference::Policy,
        _: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        positions
            .iter()
            .map(|p| if p % 2 == 0 { self.weight } else { 0.0 })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::replay::{kept_sets, layer_budgets, replay, PolicyParams};
    use crate::trace::{StorageDtype, TraceMeta, TraceReader, TraceWriter};
    use ndarray::Array3;

    fn policy() -> PolicyParams {
        PolicyParams {
            scorer: "toy".into(),
            budget: 3,
            window: 0,
            ..PolicyParams::default()
        }
    }

    #[test]
    fn a_new_scorer_is_replayed_named_and_listed() {
        // A one-layer, one-head trace: prompt of 8, two generated tokens.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("toy.safetensors");
        let meta = TraceMeta {
            model: "toy".into(),
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            prompt_len: 8,
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: Vec::new(),
            spans: Vec::new(),
            extra: Default::default(),
        };
        let q = Array3::from_shape_fn((1, 10, 2), |(_, t, d)| (t + d) as f32 * 0.1);
        let mut writer = TraceWriter::new(meta, StorageDtype::F32, (0..10).collect());
        writer.push_layer(q.clone(), q.clone(), Some(q));
        writer.write(&path).unwrap();
        let trace = TraceReader::open(&path).unwrap();
        // Replayed: the three kept prompt positions are the first even ones.
        let checked = policy().with("weight", 2.0).check().unwrap();
        let budgets = layer_budgets(&trace, &checked).unwrap();
        let kept = kept_sets(&trace, &checked, &budgets, 0).unwrap();
        assert_eq!(kept.kept[0].kept_positions(0, 8), vec![0, 2, 4, 8]);
        assert!(replay(&trace, &checked).is_ok());
        // Its setting is checked by its own rule, and named with it.
        let err = policy()
            .with("weight", -1.0)
            .check()
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "scorer `toy`: setting `weight` = -1.0: must be positive"
        );
        // A setting it does not take names it and what it takes.
        let err = policy().with("kernel", 3).check().unwrap_err().to_string();
        assert!(err.contains("scorer `toy` (weight)"), "{err}");
        // Unknown names list it among the valid ones; the listing `kvreplay methods` prints from
        // the registries has it, with its setting and default.
        let err = PolicyParams {
            scorer: "toys".into(),
            ..policy()
        }
        .check()
        .unwrap_err()
        .to_string();
        assert!(err.contains("oracle-static, toy"), "{err}");
        // Its declared rule version reaches the policy's (run ids name it).
        assert_eq!(policy().method_versions()["scorer"], 2);
        let described = crate::replay::all_methods();
        let toy = described
            .iter()
            .find(|m| m.name == "toy")
            .expect("described");
        assert!(toy.takes("weight"));
        assert_eq!((toy.defaults)()["weight"], 1.0);
    }
}
