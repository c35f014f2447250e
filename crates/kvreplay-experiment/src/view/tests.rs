use super::*;
use crate::replay::PolicyParams;
use crate::trace::{Span, StorageDtype, TraceMeta, TraceWriter};
use ndarray::{Array3, IxDyn};

/// A trace of `layers` layers, 2 query heads over 1 KV head, head size 4, `prompt` prompt
/// positions and `generated` decode steps, seeded.
fn trace(dir: &std::path::Path, layers: usize, prompt: usize, generated: usize) -> TraceReader {
    let path = dir.join("view.safetensors");
    let meta = TraceMeta {
        model: "toy".into(),
        n_layers: layers,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        prompt_len: prompt,
        scale: 0.5,
        softcap: None,
        rope_theta: None,
        rope_thetas: Vec::new(),
        windows: Vec::new(),
        spans: vec![Span {
            name: "needle".into(),
            start: 2,
            end: 4,
        }],
        extra: Default::default(),
    };
    let n = prompt + generated;
    let mut state = 7u64;
    let mut draw = |shape: (usize, usize, usize)| {
        Array3::from_shape_simple_fn(shape, || {
            (crate::splitmix::next(&mut state) % 2001) as f32 / 1000.0 - 1.0
        })
    };
    let mut writer = TraceWriter::new(meta, StorageDtype::F32, (0..n as i64).collect());
    for _ in 0..layers {
        let (q, k, v) = (draw((2, n, 4)), draw((1, n, 4)), draw((1, n, 4)));
        writer.push_layer(q, k, Some(v));
    }
    writer.write(&path).unwrap();
    TraceReader::open(&path).unwrap()
}

fn policy(scorer: &str, timing: Timing, budget: usize) -> ValidPolicy {
    PolicyParams {
        scorer: scorer.into(),
        timing,
        budget,
        window: 1,
        ..PolicyParams::default()
    }
    .check()
    .unwrap()
}

fn bins(size: usize, count: usize) -> Bins {
    Bins { size, count }
}

#[test]
fn bins_bound_the_columns_and_the_cells() {
    assert_eq!(Bins::for_positions(600, 90), bins(1, 600));
    // One bit a cell while positions x cells fit 24 x 2^20 = 25,165,824: 2,000 x 8,910 (SnapKV
    // and H2O per query head, 30 layers, 9 heads, 32 steps) and 2,000 x 12,582 do; 2,000 x
    // 12,583 = 25,166,000 does not, so bins of ceil(25,166,000 / 2^20) = 25 positions.
    assert_eq!(Bins::for_positions(2000, 8910), bins(1, 2000));
    assert_eq!(Bins::for_positions(2000, 12_582), bins(1, 2000));
    assert_eq!(Bins::for_positions(2000, 12_583), bins(25, 80));
    // Past 2,048 positions, bins: 32,768 / 2,048 = 16 a bin.
    assert_eq!(Bins::for_positions(32_768, 1), bins(16, 2048));
    // 4,096 cells a bin (64 steps x 32 layers x 2 caches): 2^27 / 2^20 = 128 positions a bin.
    assert_eq!(Bins::for_positions(32_768, 4096), bins(128, 256));
    assert_eq!(Bins::for_positions(10, 1).positions(9, 10), 9..10);
    assert_eq!(bins(4, 3).positions(2, 10), 8..10);
}

#[test]
fn bits_are_packed_lowest_first() {
    assert_eq!(bits(&[255, 0, 0, 255, 0, 0, 0, 0, 255]), vec![0b1001, 0b1]);
}

#[test]
fn binned_cells_are_the_kept_fraction() {
    // One layer, one cache, six positions: kept 0, 1, 3.
    let mask = ArrayD::from_shape_vec(
        IxDyn(&[1, 1, 6]),
        vec![true, true, false, true, false, false],
    )
    .unwrap();
    let ones = binned_kept(&mask, false, Bins { size: 1, count: 6 }, 6);
    assert_eq!(ones, vec![255, 255, 0, 255, 0, 0]);
    // Bins of 4: positions 0..4 keep 3 (191.25 -> 191), 4..6 keep none.
    let fours = binned_kept(&mask, false, Bins { size: 4, count: 2 }, 6);
    assert_eq!(fours, vec![191, 0]);
    // A question-agnostic cut: the mask ends at 4, positions 4 and 5 are not cut.
    let cut = ArrayD::from_shape_vec(IxDyn(&[1, 1, 4]), vec![true, false, false, false]).unwrap();
    assert_eq!(
        binned_kept(&cut, false, Bins { size: 1, count: 6 }, 6),
        vec![255, 0, 0, 0, 255, 255]
    );
}

#[test]
fn the_cells_at_one_position_a_bin_are_the_libraries_masks() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace(dir.path(), 3, 12, 3);
    for (timing, steps) in [(Timing::Prefill, 1), (Timing::PerStep, 3)] {
        let per_step = timing != Timing::Prefill;
        let masks = kept_masks(
            &trace,
            &policy("knorm", timing, 5),
            per_step,
            Checkpoints::NONE,
        )
        .unwrap();
        let view = build(
            &trace,
            &[("p".into(), policy("knorm", timing, 5))],
            None,
            Checkpoints::NONE,
        )
        .unwrap();
        let p = &view.policies[0];
        assert_eq!((p.steps, p.caches, p.layers.len()), (steps, 1, 3));
        assert!(p.packed);
        assert_eq!(view.bins, Bins { size: 1, count: 12 });
        for step in 0..steps {
            for layer in 0..3 {
                for position in 0..12 {
                    let kept = match per_step {
                        true => masks.mask[[layer, 0, step, position].as_slice()],
                        false => masks.mask[[layer, 0, position].as_slice()],
                    };
                    let at = (step * 3 + layer) * 12 + position;
                    let bit = p.kept[at / 8] >> (at % 8) & 1 == 1;
                    assert_eq!(bit, kept, "step {step} layer {layer} at {position}");
                }
            }
        }
    }
}

#[test]
fn the_mass_is_the_mean_decode_attention_by_brute_force() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace(dir.path(), 2, 7, 2);
    let view = build(
        &trace,
        &[("p".into(), policy("knorm", Timing::Prefill, 3))],
        None,
        Checkpoints::NONE,
    )
    .unwrap();
    for layer in 0..2 {
        let tensors = trace.layer(layer).unwrap();
        let mut expected = [0f64; 7];
        for head in 0..2 {
            for query in 7..9 {
                let logits: Vec<f64> = (0..=query)
                    .map(|p| {
                        (0..4)
                            .map(|d| {
                                tensors.q[[head, query, d]] as f64 * tensors.k[[0, p, d]] as f64
                            })
                            .sum::<f64>()
                            * 0.5
                    })
                    .collect();
                let top = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = logits.iter().map(|l| (l - top).exp()).sum();
                for (p, slot) in expected.iter_mut().enumerate() {
                    *slot += (logits[p] - top).exp() / total / 4.0;
                }
            }
        }
        for (p, want) in expected.iter().enumerate() {
            let got = view.mass[layer][p] as f64;
            assert!(
                (got - want).abs() < 1e-6,
                "layer {layer} position {p}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn texts_are_joined_per_bin_and_cut() {
    let texts: Vec<String> = (0..5).map(|i| format!("t{i} ")).collect();
    assert_eq!(
        bin_texts(&texts, Bins { size: 2, count: 3 }, 5),
        vec!["t0 t1 ", "t2 t3 ", "t4 "]
    );
    let long = vec!["é".repeat(100)];
    let cut = bin_texts(&long, Bins { size: 1, count: 1 }, 1);
    assert_eq!(cut[0].chars().count(), TEXT_CHARS + 1);
}

#[test]
fn a_long_trace_stays_under_the_page_bound() {
    // 32,768 prompt positions and 16 decode steps under a per-step policy, against a
    // second: every layer, cache and step is in the page, binned, under its stated bound.
    let dir = tempfile::tempdir().unwrap();
    let trace = trace(dir.path(), 2, 32_768, 16);
    let policies = [
        (
            "per-step".to_string(),
            policy("knorm", Timing::PerStep, 512),
        ),
        (
            "one-shot".to_string(),
            policy("knorm", Timing::Prefill, 512),
        ),
    ];
    let view = build(&trace, &policies, None, Checkpoints::NONE).unwrap();
    assert_eq!(view.bins, bins(16, 2048));
    assert_eq!(view.policies[0].kept.len(), 16 * 2 * 2048);
    assert_eq!(view.mass.len(), 2);
    let page = page::html(&view, "long");
    assert!(page.len() < page::MAX_PAGE_BYTES, "{} bytes", page.len());
}
