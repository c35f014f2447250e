//! `kvreplay bench`: how fast replay is, measured side by side in one run on this machine: a
//! matrix-multiply peak, the attention-scoring kernel against it, the replay of a fixed policy
//! grid against the NumPy replay a researcher would write (`src/bench/numpy/replay_numpy.py`,
//! whose numbers must agree first), the streaming cost per token, peak resident memory, capture
//! speed and the closed loop's cost per token. The library measures; the CLI prints.

use crate::assets::{AssetError, Assets};
use crate::attention::{scaled_product, softmax_into, CausalLogits, PackedKeys};
use crate::capture::CaptureError;
use crate::live::streams::{AttentionShape, LiveStreams};
use crate::live::LiveError;
use crate::model::{AttentionMask, CausalLm, KvCache, Llama, ModelError, Recorder};
use crate::replay::{
    presets, replay_many, Checkpoints, PolicyError, PolicyParams, ReplayReport, Timing,
    ValidPolicy, RETAINED_MASS,
};
use crate::stop::{Stop, Stopped};
use crate::trace::{TraceError, TraceReader};
use ndarray::{s, Array2};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

mod closed_loop;
pub mod heap;
mod limits;
mod oneshot;
mod table;
pub use closed_loop::{experiment_work, RecipeWork};
pub use oneshot::{
    essential_work, oneshot_grid, oneshot_numpy, oneshot_policy, timed_against_essential,
    EssentialWork, GridTiming, ONESHOT_POLICIES, TIMED_RUNS,
};
pub use table::{essential_rows, measure, BenchRun};

/// What can stop the bench.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A replay failed.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The NumPy reference could not be set up or run, or disagrees.
    #[error("NumPy reference: {0}")]
    Reference(String),
    /// The model or the essays for the capture speed are missing.
    #[error(transparent)]
    Asset(#[from] AssetError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A trace could not be opened.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A recipe could not be read or its model loaded.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// Asked to stop (Ctrl-C) between measurements, layers, chunks or tokens.
    #[error("the bench was stopped")]
    Stopped(#[from] Stopped),
    /// A live run failed (boxed: it is the largest error).
    #[error(transparent)]
    Live(Box<LiveError>),
    /// The batched closed loop's reports differ from the unbatched ones.
    #[error("the batched closed loop's reports differ from the unbatched ones")]
    BatchedDiffers,
    /// The essential work was asked of an experiment that runs nothing live.
    #[error("{0}: `closed_loop` is not true: the essential work counts an experiment's live runs")]
    NotClosedLoop(PathBuf),
}

impl From<LiveError> for BenchError {
    fn from(error: LiveError) -> Self {
        Self::Live(Box::new(error))
    }
}

/// The NumPy reference's grid: its time and how far its retained mass is from kvreplay's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NumpyGrid {
    /// Seconds the reference took for the grid.
    pub seconds: f64,
    /// Largest |Δ retained mass| between it and kvreplay over the grid.
    pub worst_difference: f64,
}

/// Largest |Δ retained mass| the NumPy reference may differ by. f32 here, f64/f32 there, and the
/// order of sums differ; 1e-3 leaves room for a rare flipped near-tie, and nothing wrong stays
/// under it.
pub const NUMPY_TOLERANCE: f64 = 1e-3;

/// A Python with NumPy for the reference: the one given, or a venv made once under
/// `$KVREPLAY_HOME/bench-venv` with a pinned NumPy.
pub fn numpy_python(given: Option<PathBuf>) -> Result<PathBuf, BenchError> {
    if let Some(python) = given {
        return Ok(python);
    }
    Assets::from_env()
        .python_venv("bench-venv", "numpy", &["numpy==2.4.6".as_ref()])
        .map_err(BenchError::Reference)
}

/// Runs the NumPy reference (`src/bench/numpy/replay_numpy.py`) on the grid and compares its
/// retained mass with `reports` (grid order: policies outer, budgets inner).
pub fn numpy_grid(
    python: &Path,
    trace: &Path,
    budgets: &[usize],
    reports: &[ReplayReport],
) -> Result<NumpyGrid, BenchError> {
    numpy_reference(
        python,
        "replay_numpy.py",
        &GRID_POLICIES,
        trace,
        budgets,
        reports,
    )
}

/// The NumPy references, shipped inside the binary and written to a scratch folder of this
/// process for Python to run (removed when dropped).
struct NumpyScripts {
    dir: PathBuf,
}

impl NumpyScripts {
    const FILES: [(&'static str, &'static str); 2] = [
        ("replay_numpy.py", include_str!("numpy/replay_numpy.py")),
        ("oneshot_numpy.py", include_str!("numpy/oneshot_numpy.py")),
    ];

    fn write() -> Result<Self, BenchError> {
        let dir = std::env::temp_dir().join(format!("kvreplay-bench-{}", std::process::id()));
        let failed = |e: std::io::Error| {
            BenchError::Reference(format!("writing its scripts to {}: {e}", dir.display()))
        };
        std::fs::create_dir_all(&dir).map_err(failed)?;
        for (name, text) in Self::FILES {
            std::fs::write(dir.join(name), text).map_err(failed)?;
        }
        Ok(Self { dir })
    }
}

impl Drop for NumpyScripts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `src/bench/numpy/<script>` (shipped in the binary) with `--budgets` and `--policies` and compares its retained
/// mass with `reports` (policies outer, budgets inner).
fn numpy_reference(
    python: &Path,
    script: &str,
    policies: &[&str],
    trace: &Path,
    budgets: &[usize],
    reports: &[ReplayReport],
) -> Result<NumpyGrid, BenchError> {
    let scratch = NumpyScripts::write()?;
    let script = scratch.dir.join(script);
    let budget_list: Vec<String> = budgets.iter().map(|b| b.to_string()).collect();
    let output = Command::new(python)
        .arg(&script)
        .arg(trace)
        .args([
            "--budgets",
            &budget_list.join(","),
            "--policies",
            &policies.join(","),
        ])
        .output()
        .map_err(|e| BenchError::Reference(format!("running {}: {e}", script.display())))?;
    if !output.status.success() {
        return Err(BenchError::Reference(
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ));
    }
    let numpy: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| BenchError::Reference(format!("its output is not JSON: {e}")))?;
    let mut worst = 0.0f64;
    let mut index = 0;
    for name in policies {
        for budget in budgets {
            let theirs = numpy["results"][name][budget.to_string()]
                .as_f64()
                .ok_or_else(|| {
                    BenchError::Reference(format!("no result for {name} at {budget}"))
                })?;
            let ours = reports[index].metric(RETAINED_MASS).unwrap_or(f64::NAN);
            worst = worst.max((ours - theirs).abs());
            index += 1;
        }
    }
    if worst > NUMPY_TOLERANCE {
        return Err(BenchError::Reference(format!(
            "kvreplay and NumPy disagree: max |Δ retained mass| = {worst:.2e} > {NUMPY_TOLERANCE:.0e}"
        )));
    }
    Ok(NumpyGrid {
        seconds: numpy["seconds"].as_f64().unwrap_or(f64::NAN),
        worst_difference: worst,
    })
}

/// The first `tokens` tokens of two haystack essays, and the model.
fn essay_prompt(tokens: usize) -> Result<(Llama, Vec<u32>), BenchError> {
    let model = Llama::load(&Assets::from_env().require_model()?)?;
    let ids = essay_ids(&model, tokens)?;
    Ok((model, ids))
}

/// The first `tokens` tokens of the first two haystack essays, in `model`'s tokens.
fn essay_ids(model: &dyn CausalLm, tokens: usize) -> Result<Vec<u32>, BenchError> {
    let essays = Assets::from_env().require_essays()?;
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|e| {
            BenchError::Reference(format!("{}: cannot read essay: {e}", path.display()))
        })
    };
    let text = read(&essays[0])? + &read(&essays[1])?;
    let mut ids = model.tokenizer().encode(&text);
    ids.truncate(tokens);
    Ok(ids)
}

/// Prefill tokens per second of the native model recording q/k/v, on the first `tokens` tokens of
/// two haystack essays. Returns the tokens used and the speed.
/// `stop` is asked after each chunk.
pub fn capture_speed(tokens: usize, stop: Stop<'_>) -> Result<(usize, f64), BenchError> {
    let (model, ids) = essay_prompt(tokens)?;
    let started = Instant::now();
    let mut recorder = Recorder::default();
    model.generate(&ids, 0, 512, Some(&mut recorder), &mut |_| stop())?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((ids.len(), ids.len() as f64 / seconds))
}

/// Milliseconds per token of the native model, plain and with a policy holding its cache.
#[derive(Debug, Clone)]
pub struct LiveSpeed {
    /// Prompt tokens.
    pub tokens: usize,
    /// Decode steps timed.
    pub steps: usize,
    /// Per run: its label, then prefill and decode milliseconds per token. The first is the plain
    /// forward pass.
    pub runs: Vec<(String, f64, f64)>,
}

/// The closed loop's cost, side by side in one process: the plain forward pass, then the `h2o`
/// and `streamingllm` presets at budget 128 holding the cache (a prompt chunk of 512 tokens runs
/// as one masked prefill; `streamingllm` evicts from the first token over budget), each over the
/// first `tokens` tokens of the essays and 16 greedy decode steps.
/// `stop` is asked after each chunk and step.
pub fn live_speed(tokens: usize, stop: Stop<'_>) -> Result<LiveSpeed, BenchError> {
    const STEPS: usize = 16;
    let (model, ids) = essay_prompt(tokens)?;
    let config = model.config();
    let shape = AttentionShape {
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim(),
        scale: 1.0 / (config.head_dim() as f32).sqrt(),
        softcap: None,
    };
    let policies = ["h2o", "streamingllm"]
        .into_iter()
        .map(|name| Ok((name, presets::preset(name, 128)?.check()?)))
        .collect::<Result<Vec<_>, PolicyError>>()?;
    let timed = |mask: Option<&mut dyn AttentionMask>| -> Result<(f64, f64), BenchError> {
        let mut mask = mask;
        let mut cache = KvCache::default();
        let started = Instant::now();
        let mut logits = Vec::new();
        for piece in ids.chunks(512) {
            let piece_mask = mask.as_mut().map(|m| &mut **m as &mut dyn AttentionMask);
            logits = model.forward_masked(piece, &mut cache, None, piece_mask)?;
            stop()?;
        }
        let prefill = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let mut steps = 0;
        let mut next = crate::model::argmax(&logits);
        while steps < STEPS {
            let step_mask = mask.as_mut().map(|m| &mut **m as &mut dyn AttentionMask);
            logits = model.forward_masked(&[next], &mut cache, None, step_mask)?;
            next = crate::model::argmax(&logits);
            steps += 1;
            stop()?;
        }
        let decode = started.elapsed().as_secs_f64();
        Ok((
            1e3 * prefill / ids.len() as f64,
            1e3 * decode / STEPS as f64,
        ))
    };
    let (prefill, decode) = timed(None)?;
    let mut runs = vec![("plain forward".to_string(), prefill, decode)];
    for (name, policy) in &policies {
        let budgets = vec![policy.params().budget; config.n_layers];
        let thetas = vec![Some(config.rope_theta); config.n_layers];
        let windows = vec![0; config.n_layers];
        let capacity = ids.len() + STEPS + 1;
        let mut streams = LiveStreams::new(
            policy,
            (budgets, thetas, windows),
            shape,
            ids.len(),
            capacity,
        );
        let (prefill, decode) = timed(Some(&mut streams))?;
        runs.push((format!("`{name}` preset, B = 128"), prefill, decode));
    }
    Ok(LiveSpeed {
        tokens: ids.len(),
        steps: STEPS,
        runs,
    })
}

/// The grid of the bench: (name, budget) pairs and their policies.
pub const GRID_POLICIES: [&str; 6] = [
    "snapkv-kv-head",
    "pyramidkv-kv-head",
    "streamingllm-evict-first",
    "h2o-streaming",
    "h2o-adapted",
    "oracle",
];

/// The policy of a grid name, as the NumPy reference implements it (one cache per KV head, the
/// group's mean, evict-first streaming; `src/bench/numpy/replay_numpy.py`): the grid measures
/// speed on fixed policies, so the variants of SnapKV, PyramidKV, StreamingLLM and H2O that the
/// reference implements are spelled out here under names of their own (a preset of the same
/// method follows the method's own code: query-head caches, H2O's prefill-then-stream,
/// attend-first streaming); every other name is a preset.
pub fn grid_policy(name: &str, budget: usize) -> Result<PolicyParams, PolicyError> {
    let base = PolicyParams {
        budget,
        ..PolicyParams::default()
    };
    Ok(match name {
        "snapkv-kv-head" => base,
        "pyramidkv-kv-head" => PolicyParams {
            allocator: "pyramid".into(),
            ..base
        }
        .with("pool", "max"),
        "h2o-streaming" => PolicyParams {
            scorer: "true-query".into(),
            timing: Timing::Streaming,
            window: budget / 2,
            ..base
        },
        "streamingllm-evict-first" => PolicyParams {
            scorer: "recency".into(),
            timing: Timing::Streaming,
            sinks: 4.min(budget),
            window: 0,
            ..base
        },
        other => presets::preset(other, budget)?,
    })
}

/// Best GFLOP/s of single-precision matrix multiplication on one thread, for attention of
/// `head_dim` dimensions: ndarray/matrixmultiply on square 512³ and attention-shaped
/// 64×d·d×2048 products, and kvreplay's own logit product ([`scaled_product`], the scoring
/// kernel's) on 72×d·d×2048. Whichever is fastest is the peak, so the scoring kernel is measured
/// against the best multiply this machine ran at that head size, not against its own.
///
/// matrixmultiply allocates a packing buffer (~0.3–1 MiB) for every product: where the allocator
/// maps such blocks afresh on each allocation (the kvreplay binary maps blocks ≥ 128 KiB), every
/// product pays page faults (a third of its speed here); the binary lifts that threshold while
/// this runs. Returns the peak in GFLOP/s and the product that reached it.
pub fn matmul_peak(head_dim: usize) -> (f64, String) {
    let operand = |rows: usize, columns: usize, salt: usize| {
        Array2::from_shape_fn((rows, columns), |(i, j)| {
            ((i * 31 + j * 17 + salt) % 13) as f32 * 0.01
        })
    };
    let d = head_dim;
    let mut best = (0.0f64, String::new());
    let shapes = [
        (
            512,
            512,
            512,
            6,
            "matrixmultiply 512×512·512×512".to_string(),
        ),
        (
            64,
            d,
            2048,
            200 * 64 / d,
            format!("matrixmultiply 64×{d}·{d}×2048"),
        ),
    ];
    for (m, k, n, repeats, name) in shapes {
        let (a, b) = (operand(m, k, 0), operand(k, n, 5));
        let flops = 2.0 * (m * k * n) as f64;
        let speed = best_of(flops, repeats.max(1), || a.dot(&b)[[0, 0]]);
        if speed > best.0 {
            best = (speed, name);
        }
    }
    let (rows, keys) = (operand(72, d, 0), operand(2048, d, 5));
    let mut packed = PackedKeys::new(d);
    let mut out = vec![0.0f32; 72 * 2048];
    let flops = 2.0 * (72 * d * 2048) as f64;
    let own = best_of(flops, (180 * 64 / d).max(1), || {
        scaled_product(rows.view(), keys.view(), &mut packed, 2048, 1.0, &mut out);
        out[0]
    });
    if own > best.0 {
        best = (own, format!("kvreplay 72×{d}·{d}×2048"));
    }
    best
}

/// GFLOP/s of the faster of two timings of `repeats` calls of `product` (`flops` each).
fn best_of(flops: f64, repeats: usize, mut product: impl FnMut() -> f32) -> f64 {
    let mut best = 0.0f64;
    for _ in 0..2 {
        let started = Instant::now();
        let sink: f32 = (0..repeats).map(|_| product()).sum();
        std::hint::black_box(sink);
        best = best.max(flops * repeats as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The attention-scoring kernel (q·Kᵀ by blocks and the causal softmax of every prompt row, for
/// every layer and query head, as the prefill scorers walk it: the heads of a GQA group share one
/// product per block): multiply-add GFLOP/s actually executed, and seconds. Each layer is timed
/// `repeats` times ([`SCORING_REPEATS`] on the main trace) and its fastest run counts, as the
/// matmul peak is a best run: on a shared machine, other tenants otherwise decide the ratio (best
/// of three read 51–78% of the peak across runs on one day). Only global layers are scored (a
/// sliding-window layer is never compressed, so no prefix scorer walks it).
/// `checkpoints` is called after each layer and asked within it.
pub fn scoring_throughput(
    trace: &TraceReader,
    repeats: usize,
    checkpoints: Checkpoints<'_>,
) -> Result<(f64, f64), PolicyError> {
    let meta = trace.meta();
    let prompt_len = meta.prompt_len;
    let group = meta.group_size();
    let mut flops = 0.0f64;
    let mut seconds = 0.0f64;
    let mut buffer = Vec::with_capacity(prompt_len);
    for layer in meta.global_layers() {
        let tensors = trace.layer(layer)?;
        let mut fastest = f64::INFINITY;
        for repeat in 0..repeats.max(1) {
            let started = Instant::now();
            let mut sink = 0.0f32;
            for kv_head in 0..meta.n_kv_heads {
                let queries = tensors
                    .q
                    .slice(s![kv_head * group..(kv_head + 1) * group, .., ..]);
                let keys = tensors.k.slice(s![kv_head, .., ..]);
                let mut rows = CausalLogits::new(group, meta.head_dim, meta.scale, meta.softcap);
                if repeat == 0 {
                    let block = rows.positions_per_block();
                    for start in (0..prompt_len).step_by(block) {
                        let end = (start + block).min(trace.n_positions());
                        flops += 2.0 * (group * (end - start) * end * meta.head_dim) as f64;
                    }
                }
                for position in 0..prompt_len {
                    for head in 0..group {
                        softmax_into(rows.row(queries, keys, head, position), &mut buffer);
                        sink += buffer[0];
                    }
                }
            }
            std::hint::black_box(sink);
            fastest = fastest.min(started.elapsed().as_secs_f64());
        }
        seconds += fastest;
        (checkpoints.after_layer)()?;
    }
    Ok((flops / seconds / 1e9, seconds))
}

/// Timed runs per layer in [`scoring_throughput`].
pub const SCORING_REPEATS: usize = 5;

/// Replays the grid; returns the reports (in grid order: policies outer, budgets inner) and seconds.
pub fn replay_grid(
    trace: &TraceReader,
    budgets: &[usize],
    checkpoints: Checkpoints<'_>,
) -> Result<(Vec<ReplayReport>, f64), PolicyError> {
    let policies = GRID_POLICIES
        .iter()
        .flat_map(|name| budgets.iter().map(move |budget| grid_policy(name, *budget)))
        .map(|params| params.and_then(|p| p.check()))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let reports = replay_many(trace, &policies, checkpoints)?;
    Ok((reports, started.elapsed().as_secs_f64()))
}

/// The policies `kvreplay bench --long` times on the long trace, one replay each: SnapKV (its
/// observation window only), the H2O prompt-end cut (a full causal prefix pass) and the per-step
/// oracle (a ranking per decode step).
pub const LONG_POLICIES: [&str; 3] = ["snapkv-kv-head", "h2o-oneshot", "oracle"];

/// Seconds of one replay of each of [`LONG_POLICIES`] at `budget`.
pub fn long_replays(
    trace: &TraceReader,
    budget: usize,
    checkpoints: Checkpoints<'_>,
) -> Result<Vec<(&'static str, f64)>, PolicyError> {
    LONG_POLICIES
        .iter()
        .map(|name| {
            let policy = oneshot_policy(name, budget)?.check()?;
            let started = Instant::now();
            replay_many(trace, std::slice::from_ref(&policy), checkpoints)?;
            Ok((*name, started.elapsed().as_secs_f64()))
        })
        .collect()
}

/// Microseconds per token per cache of key-proxy streaming eviction at `budget`.
pub fn streaming_cost(
    trace: &TraceReader,
    budget: usize,
    checkpoints: Checkpoints<'_>,
) -> Result<f64, PolicyError> {
    let policy = PolicyParams {
        timing: Timing::Streaming,
        ..grid_policy("h2o-adapted", budget)?
    }
    .check()?;
    let started = Instant::now();
    replay_many(trace, std::slice::from_ref(&policy), checkpoints)?;
    let meta = trace.meta();
    let tokens = (trace.n_positions() * meta.n_kv_heads * meta.global_layers().len()) as f64;
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

/// Resident memory of this process, `(current, peak)` in bytes (Linux: VmRSS and VmHWM of
/// /proc/self/status).
pub fn resident() -> Option<(usize, usize)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
            .map(|kib| kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// How far some work raised this process's resident memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    /// Peak resident memory during the work, above what was resident just before it.
    pub peak: usize,
    /// What stays resident after it (for a replay: its results).
    pub retained: usize,
}

impl Growth {
    /// The peak less what stays resident after: the work's working memory.
    pub fn working(&self) -> usize {
        self.peak.saturating_sub(self.retained)
    }
}

/// Runs `work` and measures how far it raised this process's resident memory above what was
/// resident just before: the peak is reset first (writing 5 to /proc/self/clear_refs, Linux ≥
/// 4.0), so code and libraries loaded by earlier work, and memory already returned, do not count.
/// `None` where the peak cannot be reset.
pub fn resident_growth<T>(work: impl FnOnce() -> T) -> (T, Option<Growth>) {
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = resident();
    let result = work();
    let growth = match (reset, before, resident()) {
        (true, Some((before, _)), Some((after, peak))) => Some(Growth {
            peak: peak.saturating_sub(before),
            retained: after.saturating_sub(before),
        }),
        _ => None,
    };
    (result, growth)
}

/// What one replay raised: this process's resident memory ([`resident_growth`]) and its live
/// heap ([`heap::heap_growth`]; `None` unless the program counts it).
pub type MemoryGrowth = (Option<Growth>, Option<Growth>);

/// Replays each grid policy at `budget` once (loading the code it runs), then once more under
/// [`resident_growth`] and [`heap::heap_growth`]: per policy, the growth of one replay.
pub fn replay_memory(
    trace: &TraceReader,
    budget: usize,
    checkpoints: Checkpoints<'_>,
) -> Result<Vec<(&'static str, MemoryGrowth)>, PolicyError> {
    let policies = GRID_POLICIES
        .iter()
        .map(|name| Ok((*name, grid_policy(name, budget)?.check()?)))
        .collect::<Result<Vec<_>, PolicyError>>()?;
    let replay =
        |policy: &ValidPolicy| replay_many(trace, std::slice::from_ref(policy), checkpoints);
    for (_, policy) in &policies {
        replay(policy)?;
    }
    policies
        .iter()
        .map(|(name, policy)| {
            let ((report, resident), heap) =
                heap::heap_growth(|| resident_growth(|| replay(policy)));
            report.map(|_| (*name, (resident, heap)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_growth_sees_memory_touched_inside() {
        let size = 48 << 20;
        let (sum, growth) = resident_growth(|| {
            let block = vec![1u8; size];
            block.iter().map(|&b| b as usize).sum::<usize>()
        });
        assert_eq!(sum, size);
        // Where the peak can be reset (Linux), all 48 MiB were resident at once inside. The
        // kernel's resident counters are batched per thread (off by up to a few hundred KiB).
        if let Some(growth) = growth {
            assert!(growth.peak >= size - (1 << 20), "{growth:?}");
            assert!(growth.working() <= growth.peak);
        }
    }

    #[test]
    fn layer_bytes_counts_q_k_v_in_f32() {
        let meta = crate::trace::TraceMeta {
            model: "fixture".into(),
            n_layers: 1,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            prompt_len: 5,
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: Vec::new(),
            spans: Vec::new(),
            extra: Default::default(),
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fixture.safetensors");
        let mut writer =
            crate::trace::TraceWriter::new(meta, crate::trace::StorageDtype::F16, (0..7).collect());
        let zeros = |heads| ndarray::Array3::<f32>::zeros((heads, 7, 8));
        writer.push_layer(zeros(4), zeros(2), Some(zeros(2)));
        writer.write(&path).expect("fixture writes");
        let trace = TraceReader::open(&path).expect("fixture opens");
        // (4 + 2 + 2) heads × 7 positions × 8 dims × 4 bytes, whatever the storage dtype.
        assert_eq!(layer_bytes(&trace), 8 * 7 * 8 * 4);
    }
}
