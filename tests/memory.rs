//! Memory: a replay holds about one layer, whatever the number of layers. This test binary's
//! global allocator counts live heap bytes, so the peak of a replay above what was live before it
//! is measured exactly (one test in this file: nothing else allocates meanwhile). Trace data is
//! read with positioned reads, not mapped, so the heap is all a replay adds to resident memory;
//! `kvreplay bench` measures the resident memory itself on real traces.

mod common;

use common::{write_fixture, Shape};
use kvreplay::bench::heap::{heap_growth, CountingAllocator};
use kvreplay::replay::{
    presets, replay, replay_many, Granularity, PolicyParams, Timing, ValidPolicy,
};
use kvreplay::trace::TraceReader;

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator;

/// The working memory of `work`: its peak live heap bytes above those live before it, less what
/// is still live after it (its results, which a replay hands back and which grow with the layers
/// and the metrics: they are not what it holds while it works).
fn working_heap<T>(work: impl FnOnce() -> T) -> (T, usize) {
    let (result, growth) = heap_growth(work);
    (
        result,
        growth
            .expect("the counting allocator is installed")
            .working(),
    )
}

/// SmolLM2-135M's geometry (9 query heads, 3 KV heads, d = 64), shorter.
fn shape(n_layers: usize) -> Shape {
    Shape {
        n_layers,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        prompt_len: 700,
        generated: 16,
    }
}

fn policies() -> Vec<(String, PolicyParams)> {
    let mut params: Vec<(String, PolicyParams)> = [
        "snapkv",
        "pyramidkv",
        "adakv",
        "h2o",
        "tova",
        "h2o-adapted",
        "oracle",
    ]
    .iter()
    .map(|name| {
        (
            name.to_string(),
            presets::preset(name, 128).expect("preset"),
        )
    })
    .collect();
    let base = PolicyParams {
        budget: 128,
        ..PolicyParams::default()
    };
    for (name, allocator) in [("entropy", "entropy"), ("oracle allocator", "oracle")] {
        let policy = PolicyParams {
            allocator: allocator.into(),
            scorer: "true-query".into(),
            ..base.clone()
        };
        params.push((name.into(), policy));
    }
    params.push((
        "true-query per query head, prefill".into(),
        PolicyParams {
            scorer: "true-query".into(),
            gqa: Granularity::QueryHead,
            heads: "uniform".into(),
            timing: Timing::Prefill,
            budget: 512,
            ..base.clone()
        },
    ));
    params.push((
        "oracle-static".into(),
        PolicyParams {
            scorer: "oracle-static".into(),
            ..base
        },
    ));
    params
}

fn checked(params: &PolicyParams) -> ValidPolicy {
    params.clone().check().expect("valid policy")
}

#[test]
fn a_replay_holds_about_one_layer_whatever_the_depth() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    let shallow = dir.path().join("shallow.safetensors");
    let deep = dir.path().join("deep.safetensors");
    write_fixture(&shallow, shape(2), 7);
    write_fixture(&deep, shape(6), 7);
    let layer_bytes = (9 + 3 + 3) * 716 * 64 * 4;
    // The count itself, by hand: a block freed inside counts in the peak only; one handed back
    // stays live.
    let (_, freed) = heap_growth(|| drop(std::hint::black_box(vec![7u8; 1 << 20])));
    let freed = freed.expect("the counting allocator is installed");
    assert!(freed.peak >= 1 << 20 && freed.retained == 0, "{freed:?}");
    let (kept, growth) = heap_growth(|| std::hint::black_box(vec![7u8; 1 << 20]));
    assert_eq!(growth.map(|g| g.retained), Some(kept.len()));
    drop(kept);
    let policies = policies();
    pool.install(|| {
        for path in [&shallow, &deep] {
            let trace = TraceReader::open(path).expect("fixture opens");
            for (name, params) in &policies {
                let policy = checked(params);
                let (report, growth) = working_heap(|| replay(&trace, &policy));
                report.expect("replay runs");
                let ratio = growth as f64 / layer_bytes as f64;
                assert!(
                    ratio <= 1.5,
                    "{name} on {}: working heap {growth} B = {ratio:.2}× one layer",
                    path.display()
                );
            }
        }
        // Every policy in one pass (a sweep batch): still about one layer, and not more for a
        // deeper model.
        let mut grid_growth = Vec::new();
        for path in [&shallow, &deep] {
            let trace = TraceReader::open(path).expect("fixture opens");
            let all: Vec<ValidPolicy> = policies.iter().map(|(_, p)| checked(p)).collect();
            let (reports, growth) =
                working_heap(|| replay_many(&trace, &all, kvreplay::replay::Checkpoints::NONE));
            reports.expect("replay runs");
            let ratio = growth as f64 / layer_bytes as f64;
            assert!(ratio <= 1.5, "all policies: {ratio:.2}× one layer");
            grid_growth.push(growth);
        }
        assert!(
            grid_growth[1] < grid_growth[0] + layer_bytes / 10,
            "6 layers {} B against 2 layers {} B",
            grid_growth[1],
            grid_growth[0]
        );
    });
}
