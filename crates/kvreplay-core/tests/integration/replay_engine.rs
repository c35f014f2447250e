//! The replay engine against a brute-force reference, hand-built cases and invariants.

use crate::common;

use common::{write_fixture, Shape};
use kvreplay_core::replay::metrics;
use kvreplay_core::replay::reference::{self, Layer};
use kvreplay_core::replay::{
    kept_masks, kept_sets, layer_budgets, replay, replay_many, scorer, Granularity, Kept,
    MethodFailed, Order, PolicyError, PolicyParams, ReplayReport, Timing, TimingSettings, Trigger,
    Unit, UnitKept, ValidPolicy,
};
use kvreplay_core::trace::TraceReader;
use ndarray::Array3;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

fn params(scorer: &str, timing: Timing, budget: usize) -> PolicyParams {
    common::fixture_policy(scorer, timing, budget, 0)
}

/// Every metric of `got` within 1e-5 of the reference's `expected` (1e-4 for the value gap: an
/// f32 engine against an f64 reference).
fn assert_metrics_agree(
    got: &kvreplay_core::replay::LayerReport,
    expected: &[(&str, f64)],
    case: &str,
) {
    for &(id, want) in expected {
        let tolerance = if id == "value_gap" { 1e-4 } else { 1e-5 };
        let value = got.metric(id).unwrap();
        assert!(
            (value - want).abs() < tolerance,
            "{case} {id}: {value} vs {want}"
        );
    }
}

/// A scorer for each timing: SnapKV one-shot, TOVA under the others.
const EVERY_TIMING: [(&str, Timing); 5] = [
    ("snapkv", Timing::Prefill),
    ("tova", Timing::Streaming),
    ("tova", Timing::PrefillThenStream),
    ("tova", Timing::PerStep),
    ("tova", Timing::PerStepPrompt),
];

/// Checks layer `index` of `report` (a policy that stores its entries otherwise than captured)
/// against every metric's brute-force definition over caches whose contents `held` rebuilds from
/// the positions each cache holds at each step (its kept sets, or under a re-selecting timing
/// every position it sees); returns the caches and those positions.
fn stored_layer_agrees(
    trace: &TraceReader,
    policy: &ValidPolicy,
    (layer, index, shape): (&Layer, usize, Shape),
    (report, case): (&ReplayReport, &str),
    held: impl Fn(&Unit, &[Vec<usize>]) -> Vec<reference::Held>,
) -> (Kept, Vec<Vec<Vec<usize>>>) {
    let budgets = layer_budgets(trace, policy).unwrap();
    let kept = kept_sets(trace, policy, &budgets, index).unwrap();
    let steps = 0..shape.generated;
    let sets: Vec<Vec<Vec<usize>>> = kept
        .kept
        .iter()
        .map(|unit| {
            steps
                .clone()
                .map(|step| unit.kept_positions(step, shape.prompt_len))
                .collect()
        })
        .collect();
    let histories: Vec<Vec<Vec<usize>>> = sets
        .iter()
        .map(|unit_sets| match policy.params().timing.reselects() {
            true => steps
                .clone()
                .map(|step| (0..=shape.prompt_len + step).collect())
                .collect(),
            false => unit_sets.clone(),
        })
        .collect();
    let contents: Vec<Vec<reference::Held>> = kept
        .units
        .iter()
        .zip(&histories)
        .map(|(unit, history)| held(unit, history))
        .collect();
    let per_query_head = policy.params().gqa == Granularity::QueryHead;
    let top_k = policy.params().top_k;
    let expected =
        metrics::reference_means(layer, &sets, (per_query_head, top_k), Some(&contents)).unwrap();
    assert_metrics_agree(&report.layers[index], &expected, case);
    (kept, histories)
}

/// Layer `index` of a fixture of `shape` as the reference reads it.
fn fixture_layer<'a>(
    (q, k, v): (&'a Array3<f32>, &'a Array3<f32>, &'a Array3<f32>),
    shape: Shape,
    (index, pass, inputs): (
        usize,
        &'a [kvreplay_core::trace::LayerReconstruction],
        &'a [kvreplay_core::trace::LayerInputs],
    ),
) -> Layer<'a> {
    Layer {
        q,
        k,
        v,
        prompt_len: shape.prompt_len,
        scale: common::meta(shape).scale as f64,
        index,
        rope_theta: common::ROPE_THETA as f64,
        reconstruction: pass.get(index),
        inputs: inputs.get(index),
    }
}

/// Every registered scorer, every timing it supports (streaming ones in both orders of attend and
/// evict), all three cache granularities and all aggregations (for the scorers that aggregate a
/// group) agree with the scorer's own brute-force rule (`Scorer::reference`, run by the f64
/// machinery of `kvreplay_core::replay::reference`) on kept sets, and with every registered metric's
/// brute-force definition (`Metric::reference`) on the metrics (tolerance 1e-5, 1e-4 for the
/// value gap: f32 engine against f64 reference). The scorers, metrics and timings come from the
/// registries: a new method is compared as soon as it is registered, and fails here, naming it,
/// until it has its reference.
#[test]
fn engine_matches_brute_force_reference() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    // Comparisons per scorer: one that supports no timing would never be compared.
    let mut compared: std::collections::BTreeMap<&str, usize> = Default::default();
    for seed in 0..4u64 {
        let path = dir.path().join(format!("fixture-{seed}.safetensors"));
        let layers = write_fixture(&path, shape, seed);
        let pass = common::fixture_pass(shape, seed, shape.prompt_len);
        let inputs = common::fixture_inputs(shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        for method in scorer::REGISTRY {
            let scorer = method.name;
            let timed = Timing::ALL.into_iter().flat_map(|timing| {
                let (orders, intervals): (&[Order], &[(usize, Trigger)]) = if timing.streams() {
                    (
                        &[Order::EvictFirst, Order::AttendFirst],
                        &[
                            (1, Trigger::Growth),
                            (3, Trigger::Growth),
                            (3, Trigger::Position),
                            (3, Trigger::Steps),
                        ],
                    )
                } else {
                    (&[Order::EvictFirst], &[(1, Trigger::Growth)])
                };
                orders.iter().flat_map(move |&order| {
                    intervals
                        .iter()
                        .map(move |&(interval, trigger)| (timing, order, interval, trigger))
                })
            });
            for (timing, order, interval, trigger) in timed {
                for (gqa, agg) in [
                    (Granularity::KvHead, "mean"),
                    (Granularity::KvHead, "max"),
                    (Granularity::QueryHead, "sum"),
                    (Granularity::Layer, "mean"),
                ] {
                    let budget = 6 + seed as usize;
                    let own = TimingSettings {
                        order,
                        interval,
                        trigger,
                    };
                    let mut params = PolicyParams {
                        gqa,
                        sinks: (seed % 2) as usize,
                        ..common::fixture_policy(scorer, timing, budget, seed)
                    }
                    .timed(timing, &own);
                    if method.takes("agg") {
                        params = params.with("agg", agg);
                    }
                    let rule = common::scorer_rule(&params);
                    let policy = match params.check() {
                        Ok(policy) => policy,
                        Err(PolicyError::Unsupported { .. }) => continue,
                        Err(other) => panic!("{scorer} {timing:?}: {other}"),
                    };
                    let report = replay(&trace, &policy).unwrap();
                    let budgets = layer_budgets(&trace, &policy).unwrap();
                    for (index, (q, k, v)) in layers.iter().enumerate() {
                        let layer = fixture_layer((q, k, v), shape, (index, &pass, &inputs));
                        let reference_policy = reference::Policy {
                            rule: rule.as_ref(),
                            timing,
                            budget,
                            window: 2,
                            sinks: (seed % 2) as usize,
                            per_query_head: gqa == Granularity::QueryHead,
                            shared_layer: gqa == Granularity::Layer,
                            attend_first: order == Order::AttendFirst,
                            interval,
                            trigger,
                        };
                        let expected = reference::kept(&layer, &reference_policy);
                        let kept = kept_sets(&trace, &policy, &budgets, index).unwrap();
                        for (unit, unit_kept) in kept.kept.iter().enumerate() {
                            assert_eq!(expected[unit].len(), shape.generated);
                            for (step, expected) in expected[unit].iter().enumerate() {
                                assert_eq!(
                                    unit_kept.kept_positions(step, shape.prompt_len),
                                    *expected,
                                    "{scorer} {timing:?} {order:?} every {interval} by {trigger:?} {gqa:?} {agg:?} seed {seed} layer {index} unit {unit} step {step}"
                                );
                            }
                        }
                        let expected = metrics::reference_means(
                            &layer,
                            &expected,
                            (gqa == Granularity::QueryHead, 10),
                            None,
                        )
                        .unwrap_or_else(|missing| panic!("{missing}"));
                        let got = &report.layers[index];
                        assert_metrics_agree(got, &expected, scorer);
                        // The lost mass, by region and by time, adds up to what was not kept;
                        // only the timing's own kinds of loss occur.
                        let retained = expected.iter().find(|(id, _)| *id == "retained_mass");
                        let lost = 1.0 - retained.expect("retained mass is registered").1;
                        let by_region: f64 = got.lost_by_region.iter().map(|s| s.mass).sum();
                        let by_when: Vec<f64> = got.lost_by_when.iter().map(|s| s.mass).collect();
                        assert!(
                            (by_region - lost).abs() < 1e-5,
                            "{scorer}: {by_region} vs {lost}"
                        );
                        assert!(
                            (by_when.iter().sum::<f64>() - lost).abs() < 1e-5,
                            "{scorer}: {by_when:?} vs {lost}"
                        );
                        let possible = match timing {
                            Timing::Prefill => [true, false, false, false],
                            Timing::PrefillThenStream | Timing::Decoding => {
                                [true, false, true, false]
                            }
                            Timing::Streaming => [false, true, true, false],
                            Timing::PerStep | Timing::PerStepPrompt => [false, false, false, true],
                        };
                        for (mass, possible) in by_when.iter().zip(possible) {
                            assert!(possible || *mass == 0.0, "{scorer} {timing:?}: {by_when:?}");
                        }
                        *compared.entry(scorer).or_default() += 1;
                    }
                }
            }
        }
    }
    // Every scorer ran under at least one timing and layout, on both layers of 4 fixtures.
    for method in scorer::REGISTRY {
        let count = compared.get(method.name).copied().unwrap_or(0);
        assert!(
            count >= 4 * 2,
            "scorer `{}` was compared with its reference {count} times: under no timing it supports",
            method.name
        );
    }
}

/// `interval` by hand: under `prefill-then-stream` with budget 6 and interval 3, the prompt is cut
/// to 6 at its end and the cache then grows by one token a step until it holds 9, when one
/// compression cuts it back to 6: with `attend-first` (kvpress's `DecodingPress`, which
/// compresses after the step's attention) the decode queries read 7, 8, 9, 7, 8 entries; with
/// `evict-first` 7, 8, 6, 7, 8. StreamingLLM's rule keeps the newest, so after the cut the cache
/// is the last 6 positions. `interval = 1` is the one-at-a-time stream. With `trigger =
/// position` (R-KV's schedule) the compressions fall at positions 21 and 24 of the 20-token
/// prompt's decode steps 20..25 instead: 7, 8, 7, 8, 9 entries read attending first, 7, 6, 7, 8, 6
/// evicting first. `trigger = steps` counts the generated tokens: after a cut to the budget it is
/// `growth`. Under `decoding` the prompt is never cut: with `steps` the first compression falls
/// on the third generated token (21, 22, 23 entries read attending first, then 7, 8), with
/// `growth` on the first (the cache is already past 9), with `position` at 21; at interval 1
/// every step cuts back to 6.
#[test]
fn an_interval_lets_the_cache_grow_then_cuts_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let path = dir.path().join("fixture.safetensors");
    write_fixture(&path, shape, 3);
    let trace = TraceReader::open(&path).unwrap();
    let sizes = |timing: Timing, order: Order, interval: usize, trigger: Trigger| -> Vec<usize> {
        let own = TimingSettings {
            order,
            interval,
            trigger,
        };
        let policy = PolicyParams {
            sinks: 0,
            window: 0,
            ..params("recency", timing, 6)
        }
        .timed(timing, &own)
        .check()
        .unwrap();
        let budgets = layer_budgets(&trace, &policy).unwrap();
        let kept = kept_sets(&trace, &policy, &budgets, 0).unwrap();
        (0..shape.generated)
            .map(|step| kept.kept[0].kept_positions(step, shape.prompt_len).len())
            .collect()
    };
    assert_eq!(shape.prompt_len, 20);
    let (cut, decoding) = (Timing::PrefillThenStream, Timing::Decoding);
    let (attend, evict) = (Order::AttendFirst, Order::EvictFirst);
    let (growth, position, steps) = (Trigger::Growth, Trigger::Position, Trigger::Steps);
    let cases: [(Timing, Order, usize, Trigger, [usize; 5]); 11] = [
        (cut, attend, 3, growth, [7, 8, 9, 7, 8]),
        (cut, evict, 3, growth, [7, 8, 6, 7, 8]),
        (cut, evict, 1, growth, [6; 5]),
        (cut, attend, 3, position, [7, 8, 7, 8, 9]),
        (cut, evict, 3, position, [7, 6, 7, 8, 6]),
        (cut, attend, 3, steps, [7, 8, 9, 7, 8]),
        (decoding, attend, 3, steps, [21, 22, 23, 7, 8]),
        (decoding, evict, 3, steps, [21, 22, 6, 7, 8]),
        (decoding, attend, 3, growth, [21, 7, 8, 9, 7]),
        (decoding, attend, 3, position, [21, 22, 7, 8, 9]),
        (decoding, evict, 1, growth, [6; 5]),
    ];
    for (timing, order, interval, trigger, expected) in cases {
        assert_eq!(
            sizes(timing, order, interval, trigger),
            expected,
            "{timing:?} {order:?} every {interval} by {trigger:?}"
        );
    }
    let policy = PolicyParams {
        sinks: 0,
        window: 0,
        ..params("recency", Timing::PrefillThenStream, 6)
    }
    .with("interval", 3)
    .check()
    .unwrap();
    let budgets = layer_budgets(&trace, &policy).unwrap();
    let kept = kept_sets(&trace, &policy, &budgets, 0).unwrap();
    let n = shape.prompt_len;
    assert_eq!(
        kept.kept[0].kept_positions(2, n),
        (n - 3..=n + 2).collect::<Vec<_>>()
    );
    assert!(params("snapkv", Timing::Prefill, 6)
        .with("interval", 3)
        .check()
        .is_err());
}

/// A budget in bytes resolves to the most tokens that fit: half of a 20-token prompt's bytes is 10
/// tokens as captured; with 2-bit per-token integers in groups of 4 channels (head size 4, f32:
/// a token is 32 bytes as captured, 1 + 8 = 9 bytes per key or value quantized, so 18) and no
/// full-precision window, 640 · 0.5 = 320 bytes hold 17 tokens (306 bytes; 18 would take 324).
/// The report's budget is the resolved one; a fraction the protected tokens exceed is refused.
#[test]
fn a_budget_in_bytes_resolves_to_the_tokens_that_fit() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let path = dir.path().join("fixture.safetensors");
    write_fixture(&path, shape, 5);
    let trace = TraceReader::open(&path).unwrap();
    let at_half = PolicyParams {
        bytes: Some(0.5),
        ..params("knorm", Timing::Prefill, 128)
    };
    let plain = at_half.clone().check().unwrap();
    assert_eq!(
        kvreplay_core::replay::nominal_budget(&trace, &plain).unwrap(),
        10
    );
    let report = replay(&trace, &plain).unwrap();
    assert_eq!(report.nominal_budget, 10);
    assert_eq!(report.policy, "flat+knorm@prefill at 0.5 of the bytes");
    let quantized = PolicyParams {
        quantizer: "per-token".into(),
        ..at_half.clone()
    }
    .with("bits", 2)
    .with("group_size", 4)
    .check()
    .unwrap();
    assert_eq!(
        kvreplay_core::replay::nominal_budget(&trace, &quantized).unwrap(),
        17
    );
    let tiny = PolicyParams {
        bytes: Some(0.01),
        ..at_half
    }
    .check()
    .unwrap();
    assert!(matches!(
        replay(&trace, &tiny),
        Err(PolicyError::TraceMismatch { .. })
    ));
}

/// Every registered quantizer that quantizes, under every timing and two cache layouts, agrees
/// with the brute-force reference: the kept sets as without it (quantization never chooses), the
/// caches' contents rebuilt from nothing at each step (`reference::held_by_step`), and every
/// metric's definition over the cache's own attention (tolerance 1e-5, 1e-4 for the value gap).
/// At 16 bits each stores the cache as captured: the report is the plain one, bit for bit.
#[test]
fn quantized_caches_match_brute_force_reference() {
    use kvreplay_core::replay::quantizer;
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let mut compared = 0;
    for seed in 0..3u64 {
        let path = dir.path().join(format!("fixture-{seed}.safetensors"));
        let layers = write_fixture(&path, shape, seed);
        let pass = common::fixture_pass(shape, seed, shape.prompt_len);
        let inputs = common::fixture_inputs(shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        for method in quantizer::REGISTRY.iter().filter(|m| m.name != "none") {
            for (scorer, timing) in EVERY_TIMING {
                for gqa in [Granularity::KvHead, Granularity::QueryHead] {
                    let base = PolicyParams {
                        gqa,
                        sinks: (seed % 2) as usize,
                        ..params(scorer, timing, 7 + seed as usize)
                    };
                    let quantized = PolicyParams {
                        quantizer: method.name.into(),
                        ..base.clone()
                    }
                    .with("bits", if seed == 1 { 4 } else { 2 })
                    .with("group_size", 4)
                    .with("residual", 4);
                    let policy = quantized.clone().check().unwrap();
                    let scheme = policy.scheme().expect("quantizes below 16 bits");
                    let report = replay(&trace, &policy).unwrap();
                    let plain = replay(&trace, &base.clone().check().unwrap()).unwrap();
                    for (index, (q, k, v)) in layers.iter().enumerate() {
                        let layer = fixture_layer((q, k, v), shape, (index, &pass, &inputs));
                        let case =
                            format!("{} {scorer} {timing:?} {gqa:?} seed {seed}", method.name);
                        stored_layer_agrees(
                            &trace,
                            &policy,
                            (&layer, index, shape),
                            (&report, &case),
                            |unit, history| {
                                reference::held_by_step(&layer, unit.kv_head, &scheme, history)
                            },
                        );
                        let got = &report.layers[index];
                        let quantized_mass = got.metric("retained_mass").unwrap();
                        let plain_mass = plain.layers[index].metric("retained_mass").unwrap();
                        assert!(
                            quantized_mass < plain_mass,
                            "{} {scorer} {timing:?} {gqa:?} seed {seed}: {quantized_mass} vs {plain_mass}",
                            method.name
                        );
                        assert!(
                            got.kv_bytes < plain.layers[index].kv_bytes,
                            "{} {timing:?} {gqa:?} seed {seed}: {} vs {}",
                            method.name,
                            got.kv_bytes,
                            plain.layers[index].kv_bytes
                        );
                        compared += 1;
                    }
                    let at_16 = quantized.with("bits", 16).check().unwrap();
                    let unquantized = replay(&trace, &at_16).unwrap();
                    assert_eq!(unquantized.layers, plain.layers);
                    assert_eq!(unquantized.metrics, plain.metrics);
                    assert_eq!(unquantized.kv_bytes, plain.kv_bytes);
                }
            }
        }
    }
    assert_eq!(compared, 3 * 2 * 5 * 2 * shape.n_layers);
}

/// Every registered key-channel rule that prunes, under every timing and two cache layouts,
/// agrees with the brute-force reference: the kept sets as without it (pruning never chooses),
/// the keys each cache holds rebuilt from the rule (`reference::pruned_by_step`), and every
/// metric's definition over the cache's own attention (tolerance 1e-5, 1e-4 for the value gap).
/// Pruning moves the attention (retained mass below the plain cache's) and sheds bytes: the
/// report's bytes are the held entries' by hand. At ratio 0 the report is the plain one, bit for
/// bit.
#[test]
fn channel_pruned_caches_match_brute_force_reference() {
    use kvreplay_core::replay::{channels, Storage};
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        head_dim: 8,
        ..Shape::default()
    };
    let mut compared = 0;
    for seed in 0..3u64 {
        let path = dir.path().join(format!("fixture-{seed}.safetensors"));
        let layers = write_fixture(&path, shape, seed);
        let pass = common::fixture_pass(shape, seed, shape.prompt_len);
        let inputs = common::fixture_inputs(shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        for method in channels::REGISTRY.iter().filter(|m| m.name != "none") {
            for (scorer, timing) in EVERY_TIMING {
                for gqa in [Granularity::KvHead, Granularity::QueryHead] {
                    let base = PolicyParams {
                        gqa,
                        sinks: (seed % 2) as usize,
                        ..params(scorer, timing, 7 + seed as usize)
                    };
                    let pruned = PolicyParams {
                        channels: method.name.into(),
                        ..base.clone()
                    }
                    .with("key_channel_ratio", [0.5, 0.25, 0.375][seed as usize])
                    .with("query_window", 3 + 20 * (seed as usize % 2));
                    let policy = pruned.clone().check().unwrap();
                    let Storage::PrunedKeys(pruning) = policy.storage() else {
                        panic!("{}: prunes below ratio 1", method.name)
                    };
                    let report = replay(&trace, &policy).unwrap();
                    let plain = replay(&trace, &base.clone().check().unwrap()).unwrap();
                    for (index, (q, k, v)) in layers.iter().enumerate() {
                        let layer = fixture_layer((q, k, v), shape, (index, &pass, &inputs));
                        let case =
                            format!("{} {scorer} {timing:?} {gqa:?} seed {seed}", method.name);
                        let (kept, histories) = stored_layer_agrees(
                            &trace,
                            &policy,
                            (&layer, index, shape),
                            (&report, &case),
                            |unit, history| {
                                let reader = (unit.kv_head, unit.query_heads.clone());
                                reference::pruned_by_step(&layer, reader, &pruning, history)
                            },
                        );
                        let got = &report.layers[index];
                        let pruned_mass = got.metric("retained_mass").unwrap();
                        let plain_mass = plain.layers[index].metric("retained_mass").unwrap();
                        assert!(
                            pruned_mass < plain_mass,
                            "{case}: {pruned_mass} vs {plain_mass}"
                        );
                        // Bytes by hand: per cache and step, the trace's width an element,
                        // values whole, prompt keys without their pruned channels, one bit a
                        // channel for the mask; a re-selecting timing holds its whole cache once
                        // per KV head.
                        let width = trace.element_bytes();
                        let d = shape.head_dim;
                        let kept_channels = d - pruning.pruned(d);
                        let group = (shape.n_heads / shape.n_kv_heads) as f64;
                        let by_hand: f64 = kept
                            .units
                            .iter()
                            .zip(&histories)
                            .map(|(unit, history)| {
                                let share = match timing.reselects() {
                                    true => unit.query_heads.len() as f64 / group,
                                    false => 1.0,
                                };
                                history
                                    .iter()
                                    .map(|held| {
                                        let prompt =
                                            held.iter().filter(|&&j| j < shape.prompt_len).count();
                                        let elements = prompt * (d + kept_channels)
                                            + (held.len() - prompt) * 2 * d;
                                        share * ((elements * width) as f64 + d as f64 / 8.0)
                                    })
                                    .sum::<f64>()
                            })
                            .sum::<f64>()
                            / shape.generated as f64;
                        assert!(
                            (got.kv_bytes - by_hand).abs() < 1e-9 * by_hand,
                            "{case}: {} vs {by_hand}",
                            got.kv_bytes
                        );
                        assert!(got.kv_bytes < plain.layers[index].kv_bytes, "{case}");
                        compared += 1;
                    }
                    let at_zero = pruned.with("key_channel_ratio", 0.0).check().unwrap();
                    let unpruned = replay(&trace, &at_zero).unwrap();
                    assert_eq!(unpruned.layers, plain.layers);
                    assert_eq!(unpruned.metrics, plain.metrics);
                    assert_eq!(unpruned.kv_bytes, plain.kv_bytes);
                }
            }
        }
    }
    assert_eq!(compared, 3 * 5 * 2 * shape.n_layers);
}

/// Every registered merge rule, under two cache layouts and two scorers at the `prefill` cut,
/// agrees with the brute-force reference: the kept sets as without it, the values each cache holds
/// rebuilt from the rule (`reference::merged_by_step`), and every metric's definition over the
/// cache's own output (tolerance 1e-5, 1e-4 for the value gap). Keys stay as captured, so retained
/// mass and bytes are the plain run's, bit for bit, while the output moves; a threshold no
/// similarity reaches merges nothing and gives the plain report, bit for bit.
#[test]
fn merged_caches_match_brute_force_reference() {
    use kvreplay_core::replay::{merge, Storage};
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        head_dim: 8,
        ..Shape::default()
    };
    let mut compared = 0;
    for seed in 0..3u64 {
        let path = dir.path().join(format!("fixture-{seed}.safetensors"));
        let layers = write_fixture(&path, shape, seed);
        let pass = common::fixture_pass(shape, seed, shape.prompt_len);
        let inputs = common::fixture_inputs(shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        let at_the_cut = |name: &str| name != "none" && !merges_while_decoding(name);
        for method in merge::REGISTRY.iter().filter(|m| at_the_cut(m.name)) {
            for scorer in ["snapkv", "knorm"] {
                for gqa in [Granularity::KvHead, Granularity::QueryHead] {
                    let base = PolicyParams {
                        gqa,
                        sinks: (seed % 2) as usize,
                        ..params(scorer, Timing::Prefill, 7 + seed as usize)
                    };
                    let merged = PolicyParams {
                        merge: method.name.into(),
                        ..base.clone()
                    }
                    .with("similarity_threshold", [0.0, 0.2, 0.0][seed as usize])
                    .with("merge_fraction", [1.0, 1.0, 0.6][seed as usize]);
                    let policy = merged.clone().check().unwrap();
                    let Storage::Merged(rule) = policy.storage() else {
                        panic!("{}: merges", method.name)
                    };
                    let report = replay(&trace, &policy).unwrap();
                    let plain = replay(&trace, &base.clone().check().unwrap()).unwrap();
                    for (index, (q, k, v)) in layers.iter().enumerate() {
                        let layer = fixture_layer((q, k, v), shape, (index, &pass, &inputs));
                        let case = format!("{} {scorer} {gqa:?} seed {seed}", method.name);
                        stored_layer_agrees(
                            &trace,
                            &policy,
                            (&layer, index, shape),
                            (&report, &case),
                            |unit, history| {
                                reference::merged_by_step(&layer, unit.kv_head, &rule, history)
                            },
                        );
                        let got = &report.layers[index];
                        let plain_layer = &plain.layers[index];
                        assert_eq!(
                            got.metric("retained_mass"),
                            plain_layer.metric("retained_mass"),
                            "{case}"
                        );
                        assert_eq!(got.kv_bytes, plain_layer.kv_bytes, "{case}");
                        assert_ne!(
                            got.metric("output_error"),
                            plain_layer.metric("output_error"),
                            "{case}: the merge moves the output"
                        );
                        compared += 1;
                    }
                    let nothing = merged.with("similarity_threshold", 1.0).check().unwrap();
                    let unmerged = replay(&trace, &nothing).unwrap();
                    assert_eq!(unmerged.layers, plain.layers);
                    assert_eq!(unmerged.metrics, plain.metrics);
                }
            }
        }
    }
    assert_eq!(compared, 3 * 2 * 2 * shape.n_layers);
}

/// Whether the registered merge `name` merges at the compressions made while decoding.
fn merges_while_decoding(name: &str) -> bool {
    let policy = PolicyParams {
        merge: name.into(),
        ..params("knorm", Timing::Decoding, 8)
    };
    let storage = policy.check().map(|policy| policy.storage());
    matches!(
        storage,
        Ok(kvreplay_core::replay::Storage::MergedWhileDecoding(_))
    )
}

/// Every registered merge made at the compressions while decoding (CaM), under three streaming
/// timings (kvpress's own `decoding` every 3 steps attending first; one eviction per generated
/// token after the prompt-end cut; `streaming` every 4), three cache layouts and three merge
/// budgets, agrees with the brute-force reference: the kept sets as without it, the values each
/// cache holds at every step rebuilt from the rule and the compressions the engine noted
/// (`reference::cam_by_step`, with its own running attention), and every metric's definition
/// over the cache's own output (tolerance 1e-5, 1e-4 for the value gap). Keys stay as captured, so
/// retained mass and bytes are the plain run's, bit for bit; the output moves in most cases; a
/// budget no cache reaches merges nothing and gives the plain report, bit for bit.
#[test]
fn decode_merges_match_brute_force_reference() {
    use kvreplay_core::replay::{merge, Storage};
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        head_dim: 8,
        generated: 12,
        ..Shape::default()
    };
    let (mut compared, mut moved) = (0, 0);
    for seed in 0..3u64 {
        let path = dir.path().join(format!("fixture-{seed}.safetensors"));
        let layers = write_fixture(&path, shape, seed);
        let pass = common::fixture_pass(shape, seed, shape.prompt_len);
        let inputs = common::fixture_inputs(shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        for method in merge::REGISTRY
            .iter()
            .filter(|m| merges_while_decoding(m.name))
        {
            for (scorer, timing, order, interval, trigger) in [
                (
                    "knorm",
                    Timing::Decoding,
                    Order::AttendFirst,
                    3,
                    Trigger::Steps,
                ),
                (
                    "true-query",
                    Timing::PrefillThenStream,
                    Order::EvictFirst,
                    1,
                    Trigger::Growth,
                ),
                (
                    "tova",
                    Timing::Streaming,
                    Order::AttendFirst,
                    4,
                    Trigger::Growth,
                ),
            ] {
                for gqa in [
                    Granularity::KvHead,
                    Granularity::QueryHead,
                    Granularity::Layer,
                ] {
                    let own = TimingSettings {
                        order,
                        interval,
                        trigger,
                    };
                    let base = PolicyParams {
                        gqa,
                        sinks: (seed % 2) as usize,
                        ..params(scorer, timing, 7 + seed as usize)
                    }
                    .timed(timing, &own);
                    let merged = PolicyParams {
                        merge: method.name.into(),
                        ..base.clone()
                    }
                    .with("merge_budget", [2, 3, 32][seed as usize])
                    .with("merge_seed", seed);
                    let policy = merged.clone().check().unwrap();
                    let Storage::MergedWhileDecoding(rule) = policy.storage() else {
                        panic!("{}: merges while decoding", method.name)
                    };
                    let report = replay(&trace, &policy).unwrap();
                    let plain = replay(&trace, &base.clone().check().unwrap()).unwrap();
                    let budgets = layer_budgets(&trace, &policy).unwrap();
                    for (index, (q, k, v)) in layers.iter().enumerate() {
                        let layer = fixture_layer((q, k, v), shape, (index, &pass, &inputs));
                        let kept = kept_sets(&trace, &policy, &budgets, index).unwrap();
                        let case =
                            format!("{} {scorer} {timing:?} {gqa:?} seed {seed}", method.name);
                        stored_layer_agrees(
                            &trace,
                            &policy,
                            (&layer, index, shape),
                            (&report, &case),
                            |unit, history| {
                                let at = kept.units.iter().position(|u| u.index == unit.index);
                                let UnitKept::Compressing(_, evictions) = &kept.kept[at.unwrap()]
                                else {
                                    panic!("{case}: the compressions are noted")
                                };
                                let heads: Vec<usize> = unit.query_heads.clone().collect();
                                let cache = (unit.kv_head, heads.as_slice(), unit.index);
                                reference::cam_by_step(&layer, cache, &rule, history, evictions)
                            },
                        );
                        let (got, plain_layer) = (&report.layers[index], &plain.layers[index]);
                        assert_eq!(
                            got.metric("retained_mass"),
                            plain_layer.metric("retained_mass"),
                            "{case}"
                        );
                        assert_eq!(got.kv_bytes, plain_layer.kv_bytes, "{case}");
                        moved += usize::from(
                            got.metric("output_error") != plain_layer.metric("output_error"),
                        );
                        compared += 1;
                    }
                    // A cache that never compresses while decoding merges nothing: the plain
                    // run, bit for bit.
                    let roomy = |policy: PolicyParams| PolicyParams {
                        budget: shape.prompt_len + shape.generated,
                        ..policy
                    };
                    let never = replay(&trace, &roomy(merged).check().unwrap()).unwrap();
                    let plain = replay(&trace, &roomy(base).check().unwrap()).unwrap();
                    assert_eq!((never.layers, never.metrics), (plain.layers, plain.metrics));
                }
            }
        }
    }
    assert_eq!(compared, 3 * 3 * 3 * shape.n_layers);
    assert!(
        moved * 4 > compared * 3,
        "the merge moved the output in {moved} of {compared}"
    );
}

/// The `duo` tests' trace: 3 layers of 2 KV heads, a 40-token prompt, written in `dir`.
fn duo_fixture(dir: &std::path::Path) -> (Shape, std::path::PathBuf, TraceReader) {
    let shape = Shape {
        n_layers: 3,
        prompt_len: 40,
        ..Shape::default()
    };
    let path = dir.join("duo.safetensors");
    write_fixture(&path, shape, 5);
    let trace = TraceReader::open(&path).unwrap();
    (shape, path, trace)
}

/// The `duo` head split, calibrated on the trace itself: its streaming caches keep exactly their
/// sinks and recent window, its retrieval caches the whole prompt, in the number the ratio says;
/// scored by the decode attention (the oracle), its retained mass is at least the on-the-fly
/// score's at every ratio (it streams the heads whose decode queries lose least, and a retrieval
/// head loses nothing), and both fall as more heads stream.
#[test]
fn duo_streams_the_heads_the_ratio_says_and_its_oracle_loses_least() {
    let dir = tempfile::tempdir().unwrap();
    let (shape, path, trace) = duo_fixture(dir.path());
    let (sinks, window) = (2, 4);
    let policy = |ratio: f64, scores: &str| {
        PolicyParams {
            scorer: "knorm".into(),
            heads: "duo".into(),
            budget: shape.prompt_len,
            sinks,
            window,
            ..PolicyParams::default()
        }
        .with("head_compression_ratio", ratio)
        .with("calibration", path.display().to_string())
        .with("scores", scores)
        .check()
        .unwrap()
    };
    let mut last = [f64::INFINITY; 2];
    for ratio in [0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0] {
        let mut masses = [0.0; 2];
        for (i, scores) in ["on-the-fly", "decode"].into_iter().enumerate() {
            let policy = policy(ratio, scores);
            let budgets = layer_budgets(&trace, &policy).unwrap();
            let mut streaming = 0;
            for layer in 0..shape.n_layers {
                let kept = kept_sets(&trace, &policy, &budgets, layer).unwrap();
                for unit_kept in &kept.kept {
                    let UnitKept::Fixed(prompt) = unit_kept else {
                        panic!("one-shot")
                    };
                    match prompt.len() {
                        n if n == shape.prompt_len => {}
                        n if n == sinks + window => {
                            let ends: Vec<usize> = (0..sinks)
                                .chain(shape.prompt_len - window..shape.prompt_len)
                                .collect();
                            assert_eq!(prompt, &ends);
                            streaming += 1;
                        }
                        n => panic!("{scores} {ratio}: a cache of {n}"),
                    }
                }
            }
            let heads = shape.n_layers * shape.n_kv_heads;
            assert_eq!(
                streaming,
                (heads as f64 * ratio).round() as usize,
                "{scores} {ratio}"
            );
            masses[i] = replay(&trace, &policy)
                .unwrap()
                .metric("retained_mass")
                .unwrap();
            assert!(masses[i] <= last[i] + 1e-12, "{scores} {ratio}");
        }
        assert!(masses[1] >= masses[0] - 1e-12, "{ratio}: {masses:?}");
        last = masses;
    }
}

/// A budget in bytes under `duo`: the streaming heads keep their sinks and window, and the
/// retrieval heads the most tokens that keep the caches' mean within the bytes. 3 layers × 2 KV
/// heads, prompt 40, f32, d = 4 (32 bytes a token); at ratio 1/3 two of the six heads stream with
/// 2 + 4 tokens, so half the bytes (20 tokens a cache on average) gives the other four
/// (6 · 20 − 2 · 6) / 4 = 27 tokens. Every head streaming fits any budget: the whole prompt.
/// Calibrations of two models serve each its own trace; one of the wrong model is refused.
#[test]
fn duo_at_a_budget_in_bytes_gives_the_retrieval_heads_what_the_streaming_ones_leave() {
    let dir = tempfile::tempdir().unwrap();
    let (shape, path, trace) = duo_fixture(dir.path());
    let other_shape = Shape {
        head_dim: 8,
        ..shape
    };
    let other = dir.path().join("other.safetensors");
    write_fixture(&other, other_shape, 6);
    let policy = |ratio: f64, calibration: String| {
        PolicyParams {
            scorer: "knorm".into(),
            heads: "duo".into(),
            bytes: Some(0.5),
            sinks: 2,
            window: 4,
            ..PolicyParams::default()
        }
        .with("head_compression_ratio", ratio)
        .with("calibration", calibration)
        .with("scores", "decode")
        .check()
    };
    let both = format!("{}, {}", path.display(), other.display());
    let third = policy(1.0 / 3.0, both.clone()).unwrap();
    assert_eq!(
        kvreplay_core::replay::nominal_budget(&trace, &third).unwrap(),
        27
    );
    let budgets = layer_budgets(&trace, &third).unwrap();
    let kept: usize = (0..shape.n_layers)
        .map(|layer| {
            let kept = kept_sets(&trace, &third, &budgets, layer).unwrap();
            kept.budgets.iter().sum::<usize>()
        })
        .sum();
    assert_eq!(kept, 4 * 27 + 2 * 6);
    let all = policy(1.0, both.clone()).unwrap();
    assert_eq!(
        kvreplay_core::replay::nominal_budget(&trace, &all).unwrap(),
        40
    );
    let other_trace = TraceReader::open(&other).unwrap();
    assert_eq!(
        kvreplay_core::replay::nominal_budget(&other_trace, &third).unwrap(),
        27
    );
    let report = replay(&other_trace, &third).unwrap();
    assert_eq!(report.nominal_budget, 27);
    let only_other = policy(1.0 / 3.0, other.display().to_string()).unwrap();
    let err = replay(&trace, &only_other).unwrap_err().to_string();
    assert!(err.contains("it must come from the same model"), "{err}");
    let twice = policy(0.5, format!("{}, {}", path.display(), path.display())).unwrap();
    let err = replay(&trace, &twice).unwrap_err().to_string();
    assert!(err.contains("of an earlier calibration trace"), "{err}");
}

/// A tiny case by hand: one head, d = 1, keys 1, 2, 3 and a decode query 1 at position 3 with key
/// 0. Full attention of q = 1 (scale 1) over keys [1, 2, 3, 0]: softmax = e^k / (e + e^2 + e^3 + 1)
/// = [0.0871443, 0.2368828, 0.6439142, 0.0320586]. StreamingLLM with 1 sink and budget 2 keeps
/// {0, 3}: mass 0.1192029.
#[test]
fn recency_by_hand() {
    use kvreplay_core::trace::{StorageDtype, TraceMeta, TraceWriter};
    use ndarray::Array3;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hand.safetensors");
    let meta = TraceMeta {
        model: "hand".into(),
        n_layers: 1,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 1,
        prompt_len: 3,
        scale: 1.0,
        softcap: None,
        rope_theta: None,
        rope_thetas: Vec::new(),
        windows: Vec::new(),
        spans: vec![],
        extra: Default::default(),
    };
    let q = Array3::from_shape_vec((1, 4, 1), vec![0.0, 0.0, 0.0, 1.0]).unwrap();
    let k = Array3::from_shape_vec((1, 4, 1), vec![1.0, 2.0, 3.0, 0.0]).unwrap();
    let mut writer = TraceWriter::new(meta, StorageDtype::F32, vec![0, 1, 2, 3]);
    writer.push_layer(q, k, None);
    writer.write(&path).unwrap();
    let trace = TraceReader::open(&path).unwrap();
    let policy = PolicyParams {
        scorer: "recency".into(),
        timing: Timing::Streaming,
        budget: 2,
        window: 0,
        sinks: 1,
        ..PolicyParams::default()
    }
    .check()
    .unwrap();
    let report = replay(&trace, &policy).unwrap();
    assert!(
        (report.metric("retained_mass").unwrap() - 0.119_202_9).abs() < 1e-6,
        "{}",
        report.metric("retained_mass").unwrap()
    );
    assert_eq!(report.mean_kept, 2.0);
    assert_eq!(report.metric("output_error"), None);
    // The lost positions 1 and 2 (0.2368828 + 0.6439142 = 0.8807970) are sinks (the first 4
    // positions), evicted as the prompt streamed in.
    let share = |shares: &[kvreplay_core::replay::metrics::lost::LostShare], name: &str| {
        shares.iter().find(|s| s.name == name).unwrap().mass
    };
    assert!((share(&report.lost_by_region, "sinks") - 0.880_797).abs() < 1e-6);
    assert!((share(&report.lost_by_when, "prompt streaming") - 0.880_797).abs() < 1e-6);
    assert_eq!(share(&report.lost_by_region, "rest"), 0.0);
    // Top-2 of the full attention are positions 2 and 1, neither kept: recall 0.
    let top2 = PolicyParams {
        top_k: 2,
        ..policy.params().clone()
    }
    .check()
    .unwrap();
    assert_eq!(
        replay(&trace, &top2).unwrap().metric("topk_recall"),
        Some(0.0)
    );
}

/// A scorer that reads values is refused on a trace captured without them, and only it.
#[test]
fn value_scorers_need_values() {
    use kvreplay_core::trace::{StorageDtype, TraceMeta, TraceWriter};
    use ndarray::Array3;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys-only.safetensors");
    let meta = TraceMeta {
        model: "keys-only".into(),
        n_layers: 1,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 2,
        prompt_len: 6,
        scale: 1.0,
        softcap: None,
        rope_theta: None,
        rope_thetas: Vec::new(),
        windows: Vec::new(),
        spans: vec![],
        extra: Default::default(),
    };
    let q = Array3::from_shape_fn((1, 8, 2), |(_, t, x)| (t + x) as f32 / 8.0);
    let mut writer = TraceWriter::new(meta, StorageDtype::F32, (0..8).collect());
    writer.push_layer(q.clone(), q, None);
    writer.write(&path).unwrap();
    let trace = TraceReader::open(&path).unwrap();
    let policy = |scorer: &str| {
        PolicyParams {
            scorer: scorer.into(),
            budget: 3,
            window: 0,
            sinks: 0,
            ..PolicyParams::default()
        }
        .check()
        .unwrap()
    };
    let err = replay(&trace, &policy("lagkv")).unwrap_err().to_string();
    assert!(err.contains("`lagkv`") && err.contains("values"), "{err}");
    assert!(replay(&trace, &policy("knorm")).is_ok());
    let merging = PolicyParams {
        scorer: "knorm".into(),
        merge: "similarity".into(),
        budget: 3,
        window: 0,
        sinks: 0,
        ..PolicyParams::default()
    };
    let err = replay(&trace, &merging.check().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("merge `similarity` folds evicted values") && err.contains("has none"),
        "{err}"
    );
}

/// The seed library's PyramidKV-adapted with beta = 1 is its H2O-adapted, bit for bit.
#[test]
fn pyramid_taper_beta_one_is_flat_key_proxy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    write_fixture(
        &path,
        Shape {
            n_layers: 4,
            ..Shape::default()
        },
        9,
    );
    let trace = TraceReader::open(&path).unwrap();
    let adapted = |allocator: &str| PolicyParams {
        allocator: allocator.into(),
        scorer: "key-proxy".into(),
        timing: Timing::Streaming,
        budget: 8,
        sinks: 2,
        window: 0,
        ..PolicyParams::default()
    };
    let taper = adapted("pyramid-taper").with("beta", 1.0).check().unwrap();
    let taper = replay(&trace, &taper).unwrap();
    let flat = replay(&trace, &adapted("flat").check().unwrap()).unwrap();
    assert_eq!(taper.layers, flat.layers);
}

/// The library's known freeze: with grace (window) 0 a new token enters with score 0 and is
/// evicted at once, so nothing generated is ever admitted past the budget.
#[test]
fn key_proxy_reproduces_the_freeze() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    let shape = Shape {
        prompt_len: 30,
        generated: 6,
        ..Shape::default()
    };
    write_fixture(&path, shape, 3);
    let trace = TraceReader::open(&path).unwrap();
    let policy = PolicyParams {
        scorer: "key-proxy".into(),
        timing: Timing::Streaming,
        budget: 8,
        sinks: 2,
        window: 0,
        ..PolicyParams::default()
    }
    .check()
    .unwrap();
    let budgets = layer_budgets(&trace, &policy).unwrap();
    for layer in 0..shape.n_layers {
        for unit in kept_sets(&trace, &policy, &budgets, layer).unwrap().kept {
            let UnitKept::PerStep(steps) = unit else {
                panic!("streaming keeps per step")
            };
            let admitted: usize = steps
                .iter()
                .map(|kept| kept.iter().filter(|&&p| p >= shape.prompt_len).count())
                .sum();
            // At most the newest token, which is evicted before the next one arrives.
            assert!(steps.iter().all(|kept| kept
                .iter()
                .filter(|&&p| p >= shape.prompt_len)
                .count()
                <= 1));
            assert!(admitted <= steps.len());
        }
    }
}

/// Results do not depend on the number of threads.
#[test]
fn bit_identical_across_thread_counts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    write_fixture(
        &path,
        Shape {
            n_layers: 6,
            ..Shape::default()
        },
        11,
    );
    let trace = TraceReader::open(&path).unwrap();
    let policy = params("true-query", Timing::Streaming, 7).check().unwrap();
    let run = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| replay(&trace, &policy).unwrap())
    };
    assert_eq!(run(1), run(3));
}

/// The masks of `kept_masks` are the kept sets, position for position: at the prompt's end for a
/// one-shot policy, at the first decode step for a streaming one, and per step on request.
#[test]
fn kept_masks_are_the_kept_sets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    let shape = Shape::default();
    write_fixture(&path, shape, 5);
    let trace = TraceReader::open(&path).unwrap();
    for (scorer, timing) in [("snapkv", Timing::Prefill), ("recency", Timing::Streaming)] {
        let policy = params(scorer, timing, 6).check().unwrap();
        let budgets = layer_budgets(&trace, &policy).unwrap();
        let at_end = kept_masks(
            &trace,
            &policy,
            false,
            kvreplay_core::replay::Checkpoints::NONE,
        )
        .unwrap();
        let per_step = kept_masks(
            &trace,
            &policy,
            true,
            kvreplay_core::replay::Checkpoints::NONE,
        )
        .unwrap();
        assert_eq!(at_end.layers, (0..shape.n_layers).collect::<Vec<_>>());
        let per_cache: Vec<usize> = budgets.iter().map(|b| b.per_cache()).collect();
        assert_eq!(at_end.budgets, per_cache);
        for layer in 0..shape.n_layers {
            for (cache, unit) in kept_sets(&trace, &policy, &budgets, layer)
                .unwrap()
                .kept
                .iter()
                .enumerate()
            {
                for step in 0..shape.generated {
                    let kept = unit.kept_positions(step, shape.prompt_len);
                    let masked: Vec<usize> = (0..shape.prompt_len + shape.generated)
                        .filter(|&p| per_step.mask[[layer, cache, step, p].as_slice()])
                        .collect();
                    assert_eq!(
                        masked, kept,
                        "{scorer} layer {layer} cache {cache} step {step}"
                    );
                }
                let first: Vec<usize> = unit
                    .kept_positions(0, shape.prompt_len)
                    .into_iter()
                    .filter(|&p| p < shape.prompt_len)
                    .collect();
                let masked: Vec<usize> = (0..shape.prompt_len)
                    .filter(|&p| at_end.mask[[layer, cache, p].as_slice()])
                    .collect();
                assert_eq!(masked, first, "{scorer} layer {layer} cache {cache}");
            }
        }
    }
}

/// `kept_masks` asks its stop within the allocator's passes over every layer too (the `global`
/// allocator's prompt scores, before any layer's kept sets): the same policy with that pass is
/// asked more often than without it, and a stop at the first ask ends it.
#[test]
fn kept_masks_asks_its_stop_within_the_allocators_pass() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    write_fixture(&path, Shape::default(), 3);
    let trace = TraceReader::open(&path).unwrap();
    let asked = |allocator: &str, stop_at: usize| {
        let asks = AtomicUsize::new(0);
        let stop = || match asks.fetch_add(1, Ordering::SeqCst) + 1 >= stop_at {
            true => Err(kvreplay_core::stop::Stopped),
            false => Ok(()),
        };
        let policy = PolicyParams {
            allocator: allocator.into(),
            ..params("knorm", Timing::Prefill, 8)
        }
        .check()
        .unwrap();
        let checkpoints = kvreplay_core::replay::Checkpoints {
            after_layer: kvreplay_core::stop::NEVER,
            stop: &stop,
        };
        let result = kept_masks(&trace, &policy, false, checkpoints);
        (asks.into_inner(), result.is_err())
    };
    let (flat, flat_stopped) = asked("flat", usize::MAX);
    let (global, global_stopped) = asked("global", usize::MAX);
    assert!(!flat_stopped && !global_stopped);
    assert!(
        global > flat,
        "asked {global} times with the prompt-score pass, {flat} without"
    );
    let (asks, stopped) = asked("global", 1);
    assert!(stopped && asks < flat, "asked {asks} times after the stop");
}

/// A grid in one pass (one-shot policies that differ only in budget, allocator or head split share
/// one scoring pass per layer) equals each policy replayed alone, bit for bit; policies whose
/// scores differ (scorer settings, window, layout, timing) are not mixed up.
#[test]
fn one_pass_over_a_grid_equals_each_policy_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.safetensors");
    write_fixture(&path, Shape::default(), 13);
    let trace = TraceReader::open(&path).unwrap();
    let mut grid = Vec::new();
    for budget in [10, 13, 16] {
        grid.push(params("snapkv", Timing::Prefill, budget));
        grid.push(PolicyParams {
            allocator: "pyramid".into(),
            sinks: 0,
            ..params("snapkv", Timing::Prefill, budget)
        });
        grid.push(PolicyParams {
            heads: "adakv".into(),
            ..params("snapkv", Timing::Prefill, budget)
        });
        grid.push(params("snapkv", Timing::Prefill, budget).with("pool", "max"));
        grid.push(PolicyParams {
            window: 3,
            ..params("snapkv", Timing::Prefill, budget)
        });
        grid.push(PolicyParams {
            gqa: Granularity::QueryHead,
            ..params("true-query", Timing::Prefill, budget)
        });
        grid.push(params("true-query", Timing::Prefill, budget));
        grid.push(PolicyParams {
            gqa: Granularity::Layer,
            ..params("true-query", Timing::PrefillThenStream, budget)
        });
        grid.push(PolicyParams {
            gqa: Granularity::Layer,
            ..params("true-query", Timing::Prefill, budget)
        });
        // Re-selecting policies: one scoring pass per family serves every budget.
        grid.push(params("tova", Timing::PerStep, budget));
        grid.push(PolicyParams {
            allocator: "pyramid".into(),
            sinks: 0,
            ..params("tova", Timing::PerStep, budget)
        });
        grid.push(params("true-query", Timing::PerStepPrompt, budget));
        grid.push(PolicyParams {
            gqa: Granularity::QueryHead,
            ..params("oracle-static", Timing::PerStep, budget)
        });
    }
    let policies: Vec<_> = grid.into_iter().map(|p| p.check().unwrap()).collect();
    let together =
        replay_many(&trace, &policies, kvreplay_core::replay::Checkpoints::NONE).unwrap();
    for (policy, report) in policies.iter().zip(&together) {
        assert_eq!(
            &replay(&trace, policy).unwrap(),
            report,
            "{}",
            policy.label()
        );
    }
}

fn config() -> Config {
    Config {
        cases: 24,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(20261129),
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// kept <= budget (one more while an attend-first query attends), sinks and window always
    /// kept, mass in [0, 1], and the per-step oracle never beaten at the same per-step budget.
    #[test]
    fn invariants(seed in 0u64..1000, budget in 3usize..16, sinks in 0usize..2, window in 0usize..2,
                  scorer_index in 0usize..scorer::REGISTRY.len(), timing_index in 0usize..Timing::ALL.len(),
                  gqa_index in 0usize..3, attend_first in any::<bool>()) {
        let scorer = scorer::REGISTRY[scorer_index].name;
        let timing = Timing::ALL[timing_index];
        let whole_cache = timing.streams() || timing == Timing::PerStep;
        let gqa = [Granularity::KvHead, Granularity::QueryHead, Granularity::Layer][gqa_index];
        // Under `decoding`, an attend-first query reads the whole uncut cache before the first
        // compression, which no budget bounds: it runs evict-first here.
        let attends_first = attend_first && timing.streams() && timing != Timing::Decoding;
        let order = if attends_first { Order::AttendFirst } else { Order::EvictFirst };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        let shape = Shape { prompt_len: 18, generated: 4, ..Shape::default() };
        write_fixture(&path, shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        let own = TimingSettings { order, ..TimingSettings::default() };
        let given = PolicyParams { gqa, sinks, window, ..params(scorer, timing, budget) };
        let policy = match given.timed(timing, &own).check() {
            Ok(policy) => policy,
            Err(PolicyError::Unsupported { .. }) => return Ok(()),
            Err(other) => panic!("{scorer} {timing:?}: {other}"),
        };
        let report = replay(&trace, &policy).unwrap();
        // What a decode query attends over: the budget, and the newest token too under
        // attend-first.
        let attended = budget + usize::from(order == Order::AttendFirst);
        // The per-step oracle at the same per-step budget, unprotected, one cache per KV head (a
        // shared layer set is one of the sets it may choose): the current query's top tokens from
        // everything this timing may choose from.
        let oracle_timing = if whole_cache { Timing::PerStep } else { Timing::PerStepPrompt };
        let oracle_gqa = if gqa == Granularity::QueryHead { gqa } else { Granularity::KvHead };
        let oracle = PolicyParams { gqa: oracle_gqa, window: 0, sinks: 0, ..params("tova", oracle_timing, attended) };
        let oracle = replay(&trace, &oracle.check().unwrap()).unwrap();
        let budgets = layer_budgets(&trace, &policy).unwrap();
        for layer in 0..shape.n_layers {
            let kept = kept_sets(&trace, &policy, &budgets, layer).unwrap();
            for unit in &kept.kept {
                for step in 0..shape.generated {
                    let set = unit.kept_positions(step, shape.prompt_len);
                    let prompt_kept = set.iter().filter(|&&p| p < shape.prompt_len).count();
                    if whole_cache { prop_assert!(set.len() <= attended); } else { prop_assert!(prompt_kept <= budget); }
                    let mut unique = set.clone();
                    unique.dedup();
                    prop_assert_eq!(&unique, &set);
                    prop_assert!(set.iter().all(|&p| p <= shape.prompt_len + step));
                    for sink in 0..sinks { prop_assert!(set.contains(&sink)); }
                }
            }
            let layer_report = &report.layers[layer];
            prop_assert!((0.0..=1.0 + 1e-6).contains(&layer_report.metric("retained_mass").unwrap()));
            // The oracle maximises the group-mean mass at each step; compare the layer means.
            prop_assert!(oracle.layers[layer].metric("retained_mass").unwrap() + 1e-6 >= layer_report.metric("retained_mass").unwrap(),
                "{} beat the oracle: {} > {}", scorer, layer_report.metric("retained_mass").unwrap(), oracle.layers[layer].metric("retained_mass").unwrap());
        }
    }

    /// A budget that holds the whole trace keeps all the mass.
    #[test]
    fn full_budget_keeps_everything(seed in 0u64..1000, scorer_index in 0usize..scorer::REGISTRY.len(),
                                    timing_index in 0usize..Timing::ALL.len()) {
        let scorer = scorer::REGISTRY[scorer_index].name;
        let timing = Timing::ALL[timing_index];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        let shape = Shape { prompt_len: 12, generated: 3, ..Shape::default() };
        write_fixture(&path, shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        let Ok(policy) = params(scorer, timing, 15).check() else { return Ok(()) };
        let report = replay(&trace, &policy).unwrap();
        prop_assert!((report.metric("retained_mass").unwrap() - 1.0).abs() < 1e-5);
        prop_assert!((report.metric("topk_recall").unwrap() - 1.0).abs() < 1e-12);
        prop_assert!(report.metric("output_error").unwrap() < 1e-5);
    }
}

/// On a trace with sliding-window layers only the global layers are replayed: every metric equals
/// a replay of the trace made of the global layers alone, pyramids taper over the global layers,
/// and memory counts each sliding layer's window.
#[test]
fn sliding_window_layers_keep_their_window_and_only_global_layers_are_compressed() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        n_layers: 5,
        ..Shape::default()
    };
    let windows = vec![6, 0, 6, 6, 0];
    let layers = common::tensors(shape, 29);
    let t = shape.prompt_len + shape.generated;
    let write = |path: &std::path::Path, windows: Vec<usize>, keep: &[usize]| {
        let mut meta = common::meta(Shape {
            n_layers: keep.len(),
            ..shape
        });
        meta.windows = windows;
        let mut writer = kvreplay_core::trace::TraceWriter::new(
            meta,
            kvreplay_core::trace::StorageDtype::F32,
            (0..t as i64).collect(),
        );
        for &layer in keep {
            let (q, k, v) = layers[layer].clone();
            writer.push_layer(q, k, Some(v));
        }
        writer.write(path).unwrap();
        TraceReader::open(path).unwrap()
    };
    let hybrid = write(
        &dir.path().join("hybrid.safetensors"),
        windows.clone(),
        &[0, 1, 2, 3, 4],
    );
    let global = write(&dir.path().join("global.safetensors"), Vec::new(), &[1, 4]);
    for name in [
        "snapkv",
        "pyramidkv",
        "h2o",
        "streamingllm",
        "oracle",
        "cake",
    ] {
        let policy = kvreplay_core::replay::presets::preset(name, 12)
            .unwrap()
            .check()
            .unwrap();
        let (ours, alone) = (
            replay(&hybrid, &policy).unwrap(),
            replay(&global, &policy).unwrap(),
        );
        assert_eq!(
            ours.layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
            vec![1, 4],
            "{name}"
        );
        assert_eq!(ours.metrics, alone.metrics, "{name}");
        assert_eq!(ours.mean_kept, alone.mean_kept, "{name}");
        let budgets = layer_budgets(&hybrid, &policy).unwrap();
        let alone_budgets = layer_budgets(&global, &policy).unwrap();
        assert_eq!(
            (budgets[1], budgets[4]),
            (alone_budgets[0], alone_budgets[1]),
            "{name}"
        );
        let windows = [0, 2, 3].map(|layer| budgets[layer].per_cache());
        assert_eq!(windows, [6, 6, 6], "{name}");
        // Memory: the two global layers' caches plus three windows of 6 entries per KV head
        // (decode steps t = 20..25 are all past the window), over 5 layers.
        let global_entries: f64 = ours.layers.iter().map(|l| l.kv_entries).sum();
        let expected = (global_entries + 3.0 * (shape.n_kv_heads * 6) as f64) / 5.0;
        assert!(
            (ours.kv_entries - expected).abs() < 1e-12,
            "{name}: {} vs {expected}",
            ours.kv_entries
        );
    }
}

#[test]
fn a_trace_of_sliding_window_layers_only_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    let shape = Shape::default();
    let mut meta = common::meta(shape);
    meta.windows = vec![4, 4];
    let t = shape.prompt_len + shape.generated;
    let mut writer = kvreplay_core::trace::TraceWriter::new(
        meta,
        kvreplay_core::trace::StorageDtype::F32,
        (0..t as i64).collect(),
    );
    for (q, k, v) in common::tensors(shape, 1) {
        writer.push_layer(q, k, Some(v));
    }
    writer.write(&path).unwrap();
    let trace = TraceReader::open(&path).unwrap();
    let policy = params("snapkv", Timing::Prefill, 8).check().unwrap();
    let err = replay(&trace, &policy).unwrap_err().to_string();
    assert!(
        err.contains("no global layer") && err.contains("s.safetensors"),
        "{err}"
    );
}

/// `qfilter` with a calibration trace: filters from every query of that trace. A calibration
/// trace holding exactly this trace's prompt queries gives the kept sets of `calibration =
/// "prompt"`; one of another geometry is refused, naming it; the prompt's queries cannot serve a
/// streaming policy (they would be read ahead).
#[test]
fn qfilter_calibration_traces() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let path = dir.path().join("q.safetensors");
    let layers = write_fixture(&path, shape, 17);
    let write = |name: &str, shape: Shape, cut: usize| {
        let mut meta = common::meta(shape);
        meta.prompt_len = cut;
        meta.spans.clear();
        let calibration = dir.path().join(name);
        let mut writer = kvreplay_core::trace::TraceWriter::new(
            meta,
            kvreplay_core::trace::StorageDtype::F32,
            (0..cut as i64).collect(),
        );
        for (q, k, v) in &layers {
            let s = ndarray::s![.., ..cut, ..];
            writer.push_layer(
                q.slice(s).to_owned(),
                k.slice(s).to_owned(),
                Some(v.slice(s).to_owned()),
            );
        }
        writer.write(&calibration).unwrap();
        calibration.display().to_string()
    };
    let same = write("prompt-queries.safetensors", shape, shape.prompt_len);
    let trace = TraceReader::open(&path).unwrap();
    let policy = |calibration: &str| {
        params("qfilter", Timing::Prefill, 10)
            .with("calibration", calibration)
            .check()
            .unwrap()
    };
    let (prompt, external) = (policy("prompt"), policy(&same));
    for layer in 0..shape.n_layers {
        let budgets = layer_budgets(&trace, &prompt).unwrap();
        assert_eq!(
            kept_sets(&trace, &prompt, &budgets, layer).unwrap(),
            kept_sets(&trace, &external, &budgets, layer).unwrap()
        );
    }
    let other = dir.path().join("other.safetensors");
    write_fixture(
        &other,
        Shape {
            head_dim: 8,
            ..shape
        },
        3,
    );
    let err = replay(&trace, &policy(&other.display().to_string()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("other.safetensors") && err.contains("same model"),
        "{err}"
    );
    // A calibration trace that cannot be read is refused when the policy is checked, naming the
    // setting and the file, before anything runs.
    let missing = dir.path().join("missing.safetensors");
    let err = params("qfilter", Timing::Prefill, 10)
        .with("calibration", missing.display().to_string())
        .check()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("calibration") && err.contains("missing.safetensors"),
        "{err}"
    );
    let streaming = params("qfilter", Timing::Streaming, 10).check();
    assert!(streaming.is_err());
    assert!(params("qfilter", Timing::Streaming, 10)
        .with("calibration", same.as_str())
        .check()
        .is_ok());
}

/// What a step reads and what the cache holds: equal for a policy that evicts; for a re-selecting
/// timing (Quest, the per-step oracle) the cache holds every position so far, per KV head.
#[test]
fn reselecting_policies_read_part_of_a_cache_they_hold_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.safetensors");
    let shape = Shape::default();
    write_fixture(&path, shape, 23);
    let trace = TraceReader::open(&path).unwrap();
    for name in ["quest", "oracle"] {
        let policy = kvreplay_core::replay::presets::preset(name, 8)
            .unwrap()
            .check()
            .unwrap();
        let report = replay(&trace, &policy).unwrap();
        // Decode steps t = 20..25 hold t + 1 = 21..=25 positions, mean 23, per KV head (2).
        assert_eq!(report.held_entries, 2.0 * 23.0, "{name}");
        assert!(report.kv_entries < report.held_entries, "{name}");
        assert!(report.layers.iter().all(|l| l.held_entries == 46.0));
    }
    for name in ["snapkv", "h2o", "streamingllm"] {
        let policy = kvreplay_core::replay::presets::preset(name, 8)
            .unwrap()
            .check()
            .unwrap();
        let report = replay(&trace, &policy).unwrap();
        assert_eq!(report.held_entries, report.kv_entries, "{name}");
    }
}

/// Per-layer rotary bases (`layer_rope_thetas`) reach the scorers that turn queries back: each
/// layer keeps what a trace with its base as the one `rope_theta` keeps; a trace with neither is
/// refused, naming both keys.
#[test]
fn per_layer_rotary_bases_reach_the_scorers() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let layers = common::tensors(shape, 31);
    let t = shape.prompt_len + shape.generated;
    let write = |name: &str, rope_theta: Option<f32>, rope_thetas: Vec<f32>| {
        let mut meta = common::meta(shape);
        meta.rope_theta = rope_theta;
        meta.rope_thetas = rope_thetas;
        let path = dir.path().join(name);
        let mut writer = kvreplay_core::trace::TraceWriter::new(
            meta,
            kvreplay_core::trace::StorageDtype::F32,
            (0..t as i64).collect(),
        );
        for (q, k, v) in &layers {
            writer.push_layer(q.clone(), k.clone(), Some(v.clone()));
        }
        writer.write(&path).unwrap();
        TraceReader::open(&path).unwrap()
    };
    let one = write("one.safetensors", Some(10_000.0), Vec::new());
    let per_layer = write("per-layer.safetensors", None, vec![10_000.0; 2]);
    let other = write("other.safetensors", None, vec![10_000.0, 500.0]);
    let none = write("none.safetensors", None, Vec::new());
    let policy = params("expected-attention", Timing::Prefill, 8)
        .check()
        .unwrap();
    let budgets = layer_budgets(&one, &policy).unwrap();
    for layer in 0..2 {
        assert_eq!(
            kept_sets(&one, &policy, &budgets, layer).unwrap(),
            kept_sets(&per_layer, &policy, &budgets, layer).unwrap()
        );
    }
    // Layer 1 of `other` turns its queries back with base 500: what a trace of base 500 keeps.
    let base_500 = write("500.safetensors", Some(500.0), Vec::new());
    assert_eq!(
        kept_sets(&other, &policy, &budgets, 1).unwrap(),
        kept_sets(&base_500, &policy, &budgets, 1).unwrap()
    );
    assert_eq!(
        kept_sets(&other, &policy, &budgets, 0).unwrap(),
        kept_sets(&one, &policy, &budgets, 0).unwrap()
    );
    assert!(replay(&none, &policy)
        .unwrap_err()
        .to_string()
        .contains("layer_rope_thetas"));
}

/// What a [`FailingAt`] state was asked, in order: (layer, cache, call).
type CallLog = std::sync::Arc<std::sync::Mutex<Vec<(usize, usize, &'static str)>>>;

/// A scorer (recency's ranking) whose state of cache `cache` of layer `layer` fails at its
/// `nth` call of `scores`, logging every call made of every state.
#[derive(Clone)]
struct FailingAt {
    place: (usize, usize),
    nth: usize,
    log: CallLog,
}

#[derive(Clone)]
struct FailingState {
    scorer: FailingAt,
    here: (usize, usize),
    scored: usize,
}

impl FailingState {
    fn log(&self, call: &'static str) {
        let (layer, cache) = self.here;
        self.scorer.log.lock().unwrap().push((layer, cache, call));
    }
}

impl scorer::Scorer for FailingAt {
    fn start(
        &self,
        layer: &kvreplay_core::replay::LayerContext<'_>,
        unit: &Unit,
        _: kvreplay_core::replay::Protection,
    ) -> Result<scorer::Started, MethodFailed> {
        Ok(Box::new(FailingState {
            scorer: self.clone(),
            here: (layer.layer, unit.index),
            scored: 0,
        }))
    }
}

impl scorer::ScoreState for FailingState {
    fn on_append(
        &mut self,
        _: &kvreplay_core::replay::LayerContext<'_>,
        _: &[usize],
    ) -> scorer::Scored {
        self.log("append");
        Ok(())
    }

    fn scores(
        &mut self,
        _: &kvreplay_core::replay::LayerContext<'_>,
        cache: &[usize],
        out: &mut Vec<f32>,
    ) -> scorer::Scored {
        self.log("scores");
        self.scored += 1;
        if self.here == self.scorer.place && self.scored == self.scorer.nth {
            return Err(MethodFailed(format!("failed at {:?}", self.here)));
        }
        *out = cache.iter().map(|&position| position as f32).collect();
        Ok(())
    }

    fn on_evict(&mut self, _: usize) -> scorer::Scored {
        self.log("evict");
        Ok(())
    }
}

/// A scorer call that fails ends the replay there with its failure: the failing state is asked
/// nothing more, and no later layer is read. Before scorer calls returned results, a failure was
/// recorded and the engine went on with the layer (the state was called again with zeros for
/// scores) and stopped after it.
#[test]
fn a_failing_scorer_call_stops_the_replay_at_that_call() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let shape = Shape {
        n_layers: 3,
        ..Shape::default()
    };
    write_fixture(&path, shape, 11);
    let trace = TraceReader::open(&path).unwrap();
    let log = CallLog::default();
    let failing = FailingAt {
        place: (1, 0),
        nth: 3,
        log: log.clone(),
    };
    let external = kvreplay_core::replay::External {
        scorer: Some((Box::new(failing), "failing".into())),
        allocator: None,
    };
    let policy = PolicyParams {
        scorer: "failing".into(),
        ..params("tova", Timing::Streaming, 8)
    }
    .check_with(external)
    .unwrap();
    let failed = replay(&trace, &policy).unwrap_err();
    assert!(
        matches!(&failed, PolicyError::Failed(MethodFailed(message)) if message == "failed at (1, 0)"),
        "{failed:?}"
    );
    let log = log.lock().unwrap();
    let of_failing: Vec<&str> = log
        .iter()
        .filter(|(layer, cache, _)| (*layer, *cache) == (1, 0))
        .map(|(_, _, call)| *call)
        .collect();
    assert_eq!(
        of_failing.iter().filter(|&&call| call == "scores").count(),
        3
    );
    assert_eq!(of_failing.last(), Some(&"scores"), "{of_failing:?}");
    assert!(
        log.iter().all(|(layer, _, _)| *layer <= 1),
        "layer 2 was read"
    );
    assert!(log.iter().any(|(layer, _, _)| *layer == 0), "layer 0 ran");
}

/// An allocator that fails stops the replay before any layer is scored, with its failure.
#[test]
fn a_failing_allocator_stops_the_replay_with_its_failure() {
    struct Refusing;
    impl kvreplay_core::replay::allocator::Allocator for Refusing {
        fn allocate(
            &self,
            _: &kvreplay_core::replay::allocator::AllocationInput<'_>,
        ) -> Result<Vec<usize>, MethodFailed> {
            Err(MethodFailed("no budgets today".into()))
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    write_fixture(&path, Shape::default(), 12);
    let trace = TraceReader::open(&path).unwrap();
    let external = kvreplay_core::replay::External {
        scorer: None,
        allocator: Some(Box::new(Refusing)),
    };
    let policy = PolicyParams {
        allocator: "refusing".into(),
        ..params("snapkv", Timing::Prefill, 8)
    }
    .check_with(external)
    .unwrap();
    let failed = replay(&trace, &policy).unwrap_err();
    assert_eq!(failed.to_string(), "no budgets today");
}

/// The replay asks `stop` within a layer (before each KV group and every few hundred positions
/// of a cache's stream), not only after it: a stop asked for in the first layer ends the replay
/// there, before that layer is reported done.
#[test]
fn a_stop_within_a_layer_ends_the_replay_before_the_layer_is_done() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    write_fixture(&path, Shape::default(), 13);
    let trace = TraceReader::open(&path).unwrap();
    let policies = [
        params("tova", Timing::Streaming, 8).check().unwrap(),
        params("snapkv", Timing::Prefill, 8).check().unwrap(),
    ];
    let (asked, layers_done) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let stop = || match asked.fetch_add(1, Ordering::Relaxed) {
        0..=2 => Ok(()),
        _ => Err(kvreplay_core::replay::Stopped),
    };
    let after_layer = || {
        layers_done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    };
    let checkpoints = kvreplay_core::replay::Checkpoints {
        after_layer: &after_layer,
        stop: &stop,
    };
    let stopped = replay_many(&trace, &policies, checkpoints).unwrap_err();
    assert!(matches!(stopped, PolicyError::Stopped(_)), "{stopped:?}");
    assert_eq!(layers_done.load(Ordering::Relaxed), 0);
    // Never asked to stop, the same after-layer call sees every layer done.
    let go_on = kvreplay_core::replay::Checkpoints {
        after_layer: &after_layer,
        stop: &|| Ok(()),
    };
    replay_many(&trace, &policies, go_on).unwrap();
    assert_eq!(layers_done.load(Ordering::Relaxed), 2);
}

/// The `global` allocator with AdaKV's split without a floor keeps one top-k over every layer's
/// caches (kvpress's `KVzipPress(layerwise=False)`): KNorm's scores (minus each key's norm,
/// computed here from the trace's keys) of both layers and both KV heads ranked together, the
/// protected positions kept apart, ties to the lower layer, cache and position (the fixtures' keys
/// are multiples of a quarter, so norms tie, across layers too at some cut). With `uniform` each
/// layer's total is shared evenly.
#[test]
fn the_global_allocator_keeps_one_top_k_over_every_layer() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let (n, kv) = (shape.prompt_len, shape.n_kv_heads);
    let global = |heads: &str, budget| PolicyParams {
        allocator: "global".into(),
        heads: heads.into(),
        ..params("knorm", Timing::Prefill, budget)
    };
    let prompt_end = |unit: &UnitKept| -> Vec<usize> {
        let mut kept: Vec<usize> = unit
            .kept_positions(0, n)
            .into_iter()
            .filter(|&p| p < n)
            .collect();
        kept.sort_unstable();
        kept
    };
    let mut unequal_totals = 0;
    let mut ties_across_layers_at_the_cut = 0;
    for seed in 0..6 {
        let path = dir.path().join(format!("f{seed}.safetensors"));
        let layers = write_fixture(&path, shape, seed);
        let trace = TraceReader::open(&path).unwrap();
        for budget in [4, 7, 10] {
            let policy = global("adakv", budget)
                .with("alpha", 0.0)
                .with("normalize", false)
                .check()
                .unwrap();
            let (sinks, window) = (policy.params().sinks, policy.params().window);
            let protected = |j: usize| j < sinks || j + window >= n;
            let mut entries: Vec<(f64, usize, usize, usize)> = Vec::new();
            for (layer, (_, k, _)) in layers.iter().enumerate() {
                for head in 0..kv {
                    for j in (0..n).filter(|&j| !protected(j)) {
                        let squares: f64 = k
                            .slice(ndarray::s![head, j, ..])
                            .iter()
                            .map(|&x| (x as f64).powi(2))
                            .sum();
                        entries.push((-squares.sqrt(), layer, head, j));
                    }
                }
            }
            entries.sort_by(|a, b| {
                b.0.total_cmp(&a.0)
                    .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
            });
            let winners = shape.n_layers * kv * (budget - sinks - window);
            let (last, first_out) = (entries[winners - 1], entries[winners]);
            ties_across_layers_at_the_cut +=
                usize::from(last.0 == first_out.0 && last.1 != first_out.1);
            let always: Vec<usize> = (0..n).filter(|&j| protected(j)).collect();
            let mut expected = vec![vec![always; kv]; shape.n_layers];
            for &(_, layer, head, j) in &entries[..winners] {
                expected[layer][head].push(j);
            }
            let budgets = layer_budgets(&trace, &policy).unwrap();
            let totals: Vec<usize> = budgets.iter().map(|b| b.total()).collect();
            assert_eq!(totals.iter().sum::<usize>(), shape.n_layers * kv * budget);
            unequal_totals += usize::from(totals[0] != totals[1]);
            for (layer, expected) in expected.iter_mut().enumerate() {
                let kept = kept_sets(&trace, &policy, &budgets, layer).unwrap();
                for (cache, (unit, expected)) in
                    kept.kept.iter().zip(expected.iter_mut()).enumerate()
                {
                    expected.sort_unstable();
                    let case = format!("seed {seed} budget {budget} layer {layer} cache {cache}");
                    assert_eq!(&prompt_end(unit), expected, "{case}");
                }
            }
        }
    }
    assert!(
        unequal_totals > 0 && ties_across_layers_at_the_cut > 0,
        "{unequal_totals} {ties_across_layers_at_the_cut}"
    );
    let path = dir.path().join("f0.safetensors");
    let trace = TraceReader::open(&path).unwrap();
    let uniform = global("uniform", 7).check().unwrap();
    let budgets = layer_budgets(&trace, &uniform).unwrap();
    for layer in 0..shape.n_layers {
        let kept = kept_sets(&trace, &uniform, &budgets, layer).unwrap();
        let sizes: Vec<usize> = kept
            .kept
            .iter()
            .map(|unit| prompt_end(unit).len())
            .collect();
        let total = budgets[layer].total();
        assert_eq!(sizes, vec![total - total / kv, total / kv], "layer {layer}");
    }
    let streaming = PolicyParams {
        timing: Timing::Streaming,
        ..global("uniform", 7)
    }
    .check();
    assert!(
        matches!(&streaming, Err(PolicyError::Unsupported { rule, .. }) if rule.contains("--timing prefill")),
        "{streaming:?}"
    );
}
