//! Memory: a replay holds about one layer, whatever the number of layers. This test binary's
//! global allocator counts live heap bytes, so the peak of a replay above what was live before it
//! is measured exactly (one test in this file: nothing else allocates meanwhile). Trace data is
//! read with positioned reads, not mapped, so the heap is all a replay adds to resident memory;
//! `kvreplay bench` measures the resident memory itself on real traces.

mod common;

use common::{write_fixture, Shape};
use kvreplay::replay::{
    presets, replay, replay_many, Granularity, PolicyParams, Timing, ValidPolicy,
};
use kvreplay::trace::TraceReader;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Old and new blocks are both live while the data is copied.
        let live = LIVE.fetch_add(new_size, Ordering::SeqCst) + new_size;
        PEAK.fetch_max(live, Ordering::SeqCst);
        let moved = System.realloc(ptr, layout, new_size);
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        moved
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The working memory of `work`: its peak live heap bytes above those live before it, less what
/// is still live after it (its results, which a replay hands back and which grow with the layers
/// and the metrics: they are not what it holds while it works).
fn heap_growth<T>(work: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let result = work();
    let retained = LIVE.load(Ordering::SeqCst).saturating_sub(before);
    (result, PEAK.load(Ordering::SeqCst) - before - retained)
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
    let policies = policies();
    pool.install(|| {
        for path in [&shallow, &deep] {
            let trace = TraceReader::open(path).expect("fixture opens");
            for (name, params) in &policies {
                let policy = checked(params);
                let (report, growth) = heap_growth(|| replay(&trace, &policy));
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
            let (reports, growth) = heap_growth(|| replay_many(&trace, &all, &|| {}));
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
