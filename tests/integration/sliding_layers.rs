//! Policies that compress sliding-window layers too (`layers = all`): a window wider than the
//! trace is a global layer, every scorer keeps only what its window holds, and H2O's cumulative
//! scores, one-shot and streaming, against a brute-force f64 reimplementation of windowed
//! attention.

use crate::common;

use common::{Rng, Shape};
use kvreplay::replay::{
    kept_sets, layer_budgets, replay, scorer, Layers, PolicyError, PolicyParams, Timing, UnitKept,
};
use kvreplay::trace::TraceReader;
use ndarray::Array3;

type Tensors = Vec<(Array3<f32>, Array3<f32>, Array3<f32>)>;

/// Writes `layers` with attention windows `windows` (empty: every layer global) and opens it.
fn write(
    path: &std::path::Path,
    shape: Shape,
    layers: &Tensors,
    windows: Vec<usize>,
) -> TraceReader {
    common::write_windowed(path, shape, layers, windows);
    TraceReader::open(path).unwrap()
}

/// Every registered scorer under every timing it supports, compressing every layer, with the
/// settings that make it run on a 20-token prompt.
fn every_policy(budget: usize) -> Vec<PolicyParams> {
    let mut policies = Vec::new();
    for method in scorer::REGISTRY {
        for timing in Timing::ALL {
            let params = PolicyParams {
                layers: Layers::All,
                ..common::fixture_policy(method.name, timing, budget, 0)
            };
            match params.clone().check() {
                Ok(_) => policies.push(params),
                Err(PolicyError::Unsupported { .. }) => {}
                Err(other) => panic!("{} {timing:?}: {other}", method.name),
            }
        }
    }
    policies
}

/// A window at least as long as the trace never slides: under `layers = all` such a layer
/// replays exactly as the same layer marked global, for every scorer and timing, bit for bit.
#[test]
fn a_window_wider_than_the_trace_is_a_global_layer() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let layers = common::tensors(shape, 41);
    let t = shape.prompt_len + shape.generated;
    let wide = write(
        &dir.path().join("wide.safetensors"),
        shape,
        &layers,
        vec![t + 3, 0],
    );
    let global = write(
        &dir.path().join("global.safetensors"),
        shape,
        &layers,
        Vec::new(),
    );
    let policies = every_policy(7);
    assert!(
        policies.len() >= scorer::REGISTRY.len(),
        "{}",
        policies.len()
    );
    for params in policies {
        let label = format!("{} {:?}", params.scorer, params.timing);
        let policy = params.check().unwrap();
        let (ours, reference) = (
            replay(&wide, &policy).unwrap(),
            replay(&global, &policy).unwrap(),
        );
        assert_eq!(ours.layers.len(), 2, "{label}");
        assert_eq!(ours.metrics, reference.metrics, "{label}");
        assert_eq!(ours.mean_kept, reference.mean_kept, "{label}");
        assert_eq!(ours.kv_entries, reference.kv_entries, "{label}");
    }
}

/// On a window of 7 (prompt 20, 5 decode steps) every scorer under every timing keeps only
/// positions inside each step's window; a budget of the whole window keeps all of its attention
/// (retained mass 1, output error 0, recall 1), and the default policy leaves the layer alone.
#[test]
fn every_scorer_keeps_only_what_the_window_holds() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let window = 7;
    let layers = common::tensors(shape, 43);
    let trace = write(
        &dir.path().join("w.safetensors"),
        shape,
        &layers,
        vec![window, 0],
    );
    for budget in [4, window] {
        for params in every_policy(budget) {
            let label = format!("{} {:?} budget {budget}", params.scorer, params.timing);
            let policy = params.clone().check().unwrap();
            let report = replay(&trace, &policy).unwrap();
            let sliding = &report.layers[0];
            assert_eq!(sliding.layer, 0, "{label}");
            let budgets = layer_budgets(&trace, &policy).unwrap();
            let kept = kept_sets(&trace, &policy, &budgets, 0).unwrap();
            for unit_kept in &kept.kept {
                for step in 0..shape.generated {
                    let position = shape.prompt_len + step;
                    let first = position + 1 - window;
                    let positions = unit_kept.kept_positions(step, shape.prompt_len);
                    // A one-shot set is chosen among the prompt's last `window` positions; the
                    // metrics drop what slides out after (checked by the masses below).
                    let floor = match unit_kept {
                        UnitKept::Fixed(_) => shape.prompt_len - window,
                        UnitKept::PerStep(_) | UnitKept::Compressing(..) => first,
                    };
                    assert!(
                        positions.iter().all(|&p| p >= floor),
                        "{label}: {positions:?}"
                    );
                    let in_window = positions.iter().filter(|&&p| p >= first).count();
                    assert!(
                        in_window <= window.max(budget + 1),
                        "{label}: {positions:?}"
                    );
                }
            }
            assert!(
                sliding.mean_kept <= window as f64,
                "{label}: {}",
                sliding.mean_kept
            );
            if budget == window && params.timing != Timing::Streaming {
                for (id, want) in [
                    ("retained_mass", 1.0),
                    ("output_error", 0.0),
                    ("topk_recall", 1.0),
                ] {
                    let value = sliding.metric(id).unwrap();
                    assert!((value - want).abs() < 1e-5, "{label} {id}: {value}");
                }
            }
        }
    }
    let default = PolicyParams {
        budget: 4,
        window: 2,
        ..PolicyParams::default()
    };
    let report = replay(&trace, &default.check().unwrap()).unwrap();
    assert_eq!(
        report.layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
        vec![1]
    );
}

/// One sliding-window layer, one head: H2O's scores and the retained mass from scratch in f64.
struct Windowed {
    q: Array3<f32>,
    k: Array3<f32>,
    prompt_len: usize,
    scale: f64,
    window: usize,
}

impl Windowed {
    fn t(&self) -> usize {
        self.q.shape()[1]
    }

    fn first(&self, at: usize) -> usize {
        (at + 1).saturating_sub(self.window)
    }

    /// Softmax of query `at`'s logits over `positions`.
    fn attention(&self, at: usize, positions: &[usize]) -> Vec<f64> {
        let logits: Vec<f64> = positions
            .iter()
            .map(|&j| {
                let dot: f64 = (0..self.q.shape()[2])
                    .map(|x| self.q[[0, at, x]] as f64 * self.k[[0, j, x]] as f64)
                    .sum();
                dot * self.scale
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exp: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let total: f64 = exp.iter().sum();
        exp.iter().map(|e| e / total).collect()
    }

    /// Retained mass of `attended[step]`, mean over decode steps, against each query's window.
    fn retained_mass(&self, attended: &[Vec<usize>]) -> f64 {
        let steps = self.t() - self.prompt_len;
        (0..steps)
            .map(|step| {
                let at = self.prompt_len + step;
                let visible: Vec<usize> = (self.first(at)..=at).collect();
                let weights = self.attention(at, &visible);
                visible
                    .iter()
                    .zip(&weights)
                    .filter(|(j, _)| attended[step].contains(j))
                    .map(|(_, w)| w)
                    .sum::<f64>()
            })
            .sum::<f64>()
            / steps as f64
    }

    /// The lowest score outside position 0 (`sinks = 1`) and the last `protect` entries; ties to
    /// the lower position.
    fn victim(cache: &[usize], scores: &[f64], protect: usize) -> usize {
        let start = usize::from(cache.first() == Some(&0));
        (start..cache.len() - protect)
            .min_by(|&a, &b| {
                scores[cache[a]]
                    .total_cmp(&scores[cache[b]])
                    .then(a.cmp(&b))
            })
            .unwrap()
    }
}

/// H2O (`true-query`) with sinks 1 and window 2 on a sliding-window layer of window 6: one-shot,
/// the cumulative windowed attention of the prompt's queries ranks the prompt's last 6 positions;
/// streaming, slid-out entries leave the cache and every query attends over what is left. Kept
/// sets exactly, retained mass to 1e-6 (f32 engine, f64 reference), on four random layers.
#[test]
fn h2o_on_a_sliding_layer_matches_brute_force() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        n_layers: 1,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 3,
        prompt_len: 16,
        generated: 6,
    };
    let window = 6;
    for seed in 0..4u64 {
        let mut rng = Rng(seed + 100);
        let t = shape.prompt_len + shape.generated;
        let q = Array3::from_shape_simple_fn((1, t, 3), || rng.quarter() * 0.5);
        let k = Array3::from_shape_simple_fn((1, t, 3), || rng.quarter() * 0.5);
        let v = Array3::from_shape_simple_fn((1, t, 3), || rng.quarter());
        let path = dir.path().join(format!("h2o-{seed}.safetensors"));
        let trace = write(&path, shape, &vec![(q.clone(), k.clone(), v)], vec![window]);
        let layer = Windowed {
            q,
            k,
            prompt_len: shape.prompt_len,
            scale: trace.meta().scale as f64,
            window,
        };
        let prompt_len = shape.prompt_len;
        for (timing, budget) in [(Timing::Prefill, 4), (Timing::Streaming, 4)] {
            let policy = PolicyParams {
                scorer: "true-query".into(),
                timing,
                budget,
                sinks: 1,
                window: 2,
                layers: Layers::All,
                ..PolicyParams::default()
            }
            .check()
            .unwrap();
            let mut scores = vec![0.0f64; layer.t()];
            let mut cache: Vec<usize> = Vec::new();
            let mut attended: Vec<Vec<usize>> = Vec::new();
            let end = if timing == Timing::Prefill {
                prompt_len
            } else {
                layer.t()
            };
            for at in 0..end {
                cache.retain(|&j| j >= layer.first(at));
                cache.push(at);
                for (&j, w) in cache.iter().zip(layer.attention(at, &cache)) {
                    scores[j] += w;
                }
                if timing == Timing::Streaming && cache.len() > budget {
                    cache.remove(Windowed::victim(&cache, &scores, 2));
                }
                if at >= prompt_len {
                    attended.push(cache.clone());
                }
            }
            if timing == Timing::Prefill {
                // The last 2 prompt positions are protected, 0 has slid out: 2 more by score.
                let mut chosen: Vec<usize> = cache[..cache.len() - 2].to_vec();
                chosen.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                chosen.truncate(budget - 2);
                chosen.extend_from_slice(&cache[cache.len() - 2..]);
                chosen.sort_unstable();
                let kept = kept_sets(&trace, &policy, &layer_budgets(&trace, &policy).unwrap(), 0)
                    .unwrap();
                assert_eq!(kept.kept[0], UnitKept::Fixed(chosen.clone()), "seed {seed}");
                attended = (prompt_len..layer.t())
                    .map(|at| {
                        let mut set: Vec<usize> = chosen.clone();
                        set.extend(prompt_len..=at);
                        set.retain(|&j| j >= layer.first(at));
                        set
                    })
                    .collect();
            } else {
                let kept = kept_sets(&trace, &policy, &layer_budgets(&trace, &policy).unwrap(), 0)
                    .unwrap();
                assert_eq!(
                    kept.kept[0],
                    UnitKept::PerStep(attended.clone()),
                    "seed {seed}"
                );
            }
            let want = layer.retained_mass(&attended);
            let got = replay(&trace, &policy)
                .unwrap()
                .metric("retained_mass")
                .unwrap();
            assert!(
                (got - want).abs() < 1e-6,
                "{timing:?} seed {seed}: {got} vs {want}"
            );
            assert!(
                want < 0.99,
                "{timing:?} seed {seed}: the budget must cost something ({want})"
            );
        }
    }
}
