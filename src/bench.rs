//! `kvreplay bench`: how fast replay is, measured side by side in one run on this machine: a
//! matrix-multiply peak, the attention-scoring kernel against it, the replay of a fixed policy
//! grid against the NumPy replay a researcher would write (`tests/reference/replay_numpy.py`,
//! whose numbers must agree first), the streaming cost per token, peak resident memory and
//! capture speed. The library measures; the CLI prints.

use crate::attention::{softmax_in_place, CausalLogits};
use crate::replay::{presets, replay_many, PolicyError, PolicyParams, ReplayReport, Timing};
use crate::trace::TraceReader;
use ndarray::{s, Array2};
use std::time::Instant;

/// The grid of the bench: (name, budget) pairs and their policies.
pub const GRID_POLICIES: [&str; 6] = [
    "snapkv",
    "pyramidkv",
    "streamingllm",
    "h2o",
    "key-proxy",
    "oracle",
];

/// The policy of a grid name, as the NumPy reference implements it.
pub fn grid_policy(name: &str, budget: usize) -> Result<PolicyParams, PolicyError> {
    match name {
        "key-proxy" => presets::preset("h2o-adapted", budget),
        other => presets::preset(other, budget),
    }
}

/// Best GFLOP/s of single-precision matrix multiplication (ndarray/matrixmultiply, the kernel
/// kvreplay's attention uses), over square 512³ and attention-shaped 64×64·64×2048 products.
pub fn matmul_peak() -> f64 {
    let mut best = 0.0f64;
    for (m, k, n, repeats) in [(512, 512, 512, 6), (64, 64, 2048, 200)] {
        let a = Array2::from_shape_fn((m, k), |(i, j)| ((i * 31 + j * 17) % 13) as f32 * 0.01);
        let b = Array2::from_shape_fn((k, n), |(i, j)| ((i * 7 + j * 3) % 11) as f32 * 0.01);
        let mut sink = 0.0f32;
        for _ in 0..2 {
            let started = Instant::now();
            for _ in 0..repeats {
                let c = a.dot(&b);
                sink += c[[0, 0]];
            }
            let seconds = started.elapsed().as_secs_f64();
            best = best.max(2.0 * (m * k * n * repeats) as f64 / seconds / 1e9);
        }
        std::hint::black_box(sink);
    }
    best
}

/// The attention-scoring kernel (q·Kᵀ by blocks and the causal softmax of every prompt row, for
/// every layer and query head, as the prefill scorers walk it): multiply-add GFLOP/s actually
/// executed, and seconds.
pub fn scoring_throughput(trace: &TraceReader) -> Result<(f64, f64), PolicyError> {
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let mut flops = 0.0f64;
    let mut seconds = 0.0f64;
    for layer in 0..meta.n_layers {
        let tensors = trace.layer(layer)?;
        let started = Instant::now();
        let mut sink = 0.0f32;
        for head in 0..meta.n_heads {
            let queries = tensors.q.slice(s![head, .., ..]);
            let keys = tensors.k.slice(s![head / meta.group_size(), .., ..]);
            let mut rows = CausalLogits::new(queries, keys, meta.scale, meta.softcap);
            let mut buffer = Vec::with_capacity(prompt_len);
            for position in 0..prompt_len {
                buffer.clear();
                buffer.extend_from_slice(rows.row(position));
                softmax_in_place(&mut buffer);
                sink += buffer[0];
            }
            let block = CausalLogits::BLOCK;
            for start in (0..prompt_len).step_by(block) {
                let end = (start + block).min(trace.n_positions());
                flops += 2.0 * ((end - start) * end * meta.head_dim) as f64;
            }
        }
        std::hint::black_box(sink);
        seconds += started.elapsed().as_secs_f64();
    }
    Ok((flops / seconds / 1e9, seconds))
}

/// Replays the grid; returns the reports (in grid order: policies outer, budgets inner) and seconds.
pub fn replay_grid(
    trace: &TraceReader,
    budgets: &[usize],
) -> Result<(Vec<ReplayReport>, f64), PolicyError> {
    let policies = GRID_POLICIES
        .iter()
        .flat_map(|name| budgets.iter().map(move |budget| grid_policy(name, *budget)))
        .map(|params| params.and_then(|p| p.check()))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let reports = replay_many(trace, &policies, &|| {})?;
    Ok((reports, started.elapsed().as_secs_f64()))
}

/// Microseconds per token per cache of key-proxy streaming eviction at `budget`.
pub fn streaming_cost(trace: &TraceReader, budget: usize) -> Result<f64, PolicyError> {
    let policy = PolicyParams {
        timing: Timing::Streaming,
        ..grid_policy("key-proxy", budget)?
    }
    .check()?;
    let started = Instant::now();
    replay_many(trace, std::slice::from_ref(&policy), &|| {})?;
    let meta = trace.meta();
    let tokens = (trace.n_positions() * meta.n_kv_heads * meta.n_layers) as f64;
    Ok(started.elapsed().as_secs_f64() / tokens * 1e6)
}

/// Bytes of one layer's q, k and v in f32.
pub fn layer_bytes(trace: &TraceReader) -> usize {
    let meta = trace.meta();
    let values = if trace.has_values() {
        meta.n_kv_heads
    } else {
        0
    };
    (meta.n_heads + meta.n_kv_heads + values) * trace.n_positions() * meta.head_dim * 4
}

/// Peak resident memory of this process so far, in bytes.
pub fn peak_rss() -> usize {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as usize * 1024
}
