//! `kvreplay bench`: every measurement of one run, as one table of rows — a matmul peak, the
//! scoring kernel against it, the replay grid against the NumPy reference, the one-shot grid
//! against its essential work, streaming cost, memory, capture and closed-loop speed. Ratios are
//! taken between runs of the same process, so a noisy machine shifts both sides alike.

use super::BenchError;
use crate::export::Table;
use crate::replay::Checkpoints;
use crate::stop::{Stop, Stopped};
use crate::sys::{returning_free_memory, set_mmap_threshold, ModelMalloc, MMAP_THRESHOLD};
use crate::trace::TraceReader;
use std::path::{Path, PathBuf};

/// What one bench run measures (the `kvreplay bench` flags).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchRun {
    /// The trace (niah-2k); not needed with --closed-loop, --essential or --model.
    #[arg(required_unless_present_any = ["closed_loop", "essential", "model"])]
    pub trace: Option<PathBuf>,
    /// A long trace (traces/gemma3/niah-32k-d50.safetensors): its causal prefix pass against
    /// the matmul peak, one replay each of SnapKV, the H2O prompt-end cut and the per-step
    /// oracle, the streaming cost per token and the memory of one replay.
    #[arg(long)]
    pub long: Option<PathBuf>,
    /// Budgets of the grid.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "64,128,256,512,1024,2048"
    )]
    pub budgets: Vec<usize>,
    /// Budgets of the one-shot grid (timed beside its essential work and the strong NumPy
    /// reference).
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
    pub oneshot_budgets: Vec<usize>,
    /// Python with NumPy (default: a venv in $KVREPLAY_HOME/bench-venv, made on first use).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Skip the NumPy reference.
    #[arg(long)]
    pub no_numpy: bool,
    /// Prompt tokens for the capture-speed and closed-loop cost measurements (0: skip).
    #[arg(long, default_value_t = 2000)]
    pub capture_tokens: usize,
    /// Measure only the closed loop, batched against unbatched, on these recipes (comma
    /// separated, e.g. traces/needle/niah-1k-d50.toml,traces/gemma3/niah-4k-d50.toml).
    #[arg(long, value_delimiter = ',')]
    pub closed_loop: Vec<PathBuf>,
    /// Measure only the essential work of a closed-loop experiment's live runs on this machine
    /// (its traces captured first where missing): per recipe, one prefill per distinct
    /// prompt-time cache and every run's decode steps, at a model-shaped product's peak measured
    /// now. Runs nothing live: the floor to hold `kvreplay sweep`'s time against.
    #[arg(long, value_name = "EXPERIMENT", conflicts_with = "closed_loop")]
    pub essential: Option<PathBuf>,
    /// Measure only a native model at this machine's limits, on --capture-tokens tokens of the
    /// essays: the capture's prefill against its essential work at the product peak, one decode
    /// step against reading its weights and cache once at a streaming read, and one step of
    /// many rows (a `kvreplay fetch --model` name or `gguf:PATH`).
    #[arg(long, value_name = "MODEL", conflicts_with_all = ["closed_loop", "essential"])]
    pub model: Option<String>,
    /// With --model: hold its weights as the GGUF stores them whatever its size (the path a
    /// model above 8 GB as f32 takes; Llama and Qwen2 families).
    #[arg(long, requires = "model")]
    pub held_quantized: bool,
}

/// Runs every measurement of `run`, telling `progress` which one starts; `stop` is asked
/// before each, after each layer of a replay and after each chunk and token of the model (one
/// that returns [`Stopped`] ends the bench there with [`BenchError::Stopped`]).
pub fn measure(
    run: &BenchRun,
    progress: &dyn Fn(&str),
    stop: Stop<'_>,
) -> Result<Table, BenchError> {
    let step = |what: &str| -> Result<(), BenchError> {
        progress(what);
        Ok(stop()?)
    };
    let after_layer = || -> Result<(), Stopped> {
        returning_free_memory()?;
        stop()
    };
    let checkpoints = Checkpoints {
        after_layer: &after_layer,
        stop,
    };
    if !run.closed_loop.is_empty() {
        return closed_loop_rows(&run.closed_loop, &step, stop);
    }
    if let Some(model) = &run.model {
        let model = (model.as_str(), run.held_quantized);
        return limits_rows(model, run.capture_tokens, &step, stop);
    }
    let trace_path = run
        .trace
        .as_deref()
        .expect("clap requires it without --closed-loop");
    let long = run.long.as_deref();
    let (budgets, oneshot_budgets) = (&run.budgets, &run.oneshot_budgets);
    let python = if run.no_numpy {
        None
    } else {
        Some(super::numpy_python(run.python.clone())?)
    };
    let trace = TraceReader::open(trace_path)?;
    let meta = trace.meta();
    let mut table = Table::new(["measure", "value"]);
    let threads = rayon::current_num_threads();
    table.push([
        "trace".into(),
        format!(
            "{} ({} layers, T = {}, prompt {})",
            trace_path.display(),
            meta.n_layers,
            trace.n_positions(),
            meta.prompt_len
        ),
    ]);
    table.push(["threads".into(), threads.to_string()]);
    step("matmul peak")?;
    let (peak, peak_product) = peak_without_mapping(meta.head_dim);
    table.push([
        "matmul peak (f32, one thread, best of matrixmultiply and kvreplay's product)".into(),
        format!("{peak:.1} GFLOP/s ({peak_product})"),
    ]);
    step("scoring kernel")?;
    let (scoring, scoring_seconds) =
        super::scoring_throughput(&trace, super::SCORING_REPEATS, checkpoints)?;
    table.push([
        "attention scoring q·Kᵀ + softmax over the prompt (one thread)".into(),
        format!(
            "{scoring:.1} GFLOP/s = {:.0}% of peak ({scoring_seconds:.2} s)",
            100.0 * scoring / peak
        ),
    ]);
    step("replay grid")?;
    let (grid, grid_resident) =
        super::resident_growth(|| super::replay_grid(&trace, budgets, checkpoints));
    let (reports, replay_seconds) = grid?;
    // Counted in a second, untimed run: counting costs the timed one its allocations' speed.
    let (counted, grid_heap) =
        super::heap::heap_growth(|| super::replay_grid(&trace, budgets, checkpoints));
    counted?;
    table.push([
        format!(
            "kvreplay grid ({} policies × {} budgets, streaming ones included)",
            super::GRID_POLICIES.len(),
            budgets.len()
        ),
        format!("{replay_seconds:.2} s"),
    ]);
    if let Some(python) = &python {
        step("NumPy reference grid")?;
        let numpy = unless_stopped(
            super::numpy_grid(python, trace_path, budgets, &reports),
            stop,
        )?;
        table.push([
            "NumPy reference grid (same trace, same metric; H2O and key-proxy streamed token by token)".into(),
            format!("{:.2} s", numpy.seconds),
        ]);
        table.push([
            "agreement: largest Δ retained mass over the grid (absolute)".into(),
            format!(
                "{:.1e} (tolerance {:.0e})",
                numpy.worst_difference,
                super::NUMPY_TOLERANCE
            ),
        ]);
        table.push([
            "speed-up kvreplay / NumPy".into(),
            format!("{:.1}×", numpy.seconds / replay_seconds),
        ]);
    }
    step("one-shot grid against its essential work")?;
    oneshot_rows(
        &mut table,
        (&trace, trace_path),
        oneshot_budgets,
        python.as_deref(),
        checkpoints,
    )?;
    for (label, path) in std::iter::once(("", trace_path)).chain(long.map(|l| (" (long)", l))) {
        let reader = TraceReader::open(path)?;
        step("streaming cost")?;
        let cost = super::streaming_cost(&reader, 256, checkpoints)?;
        table.push([
            format!(
                "key-proxy streaming at budget 256, T = {}{label}",
                reader.n_positions()
            ),
            format!("{cost:.2} µs per token per cache"),
        ]);
    }
    if let Some(long) = long {
        step("long trace")?;
        long_rows(&mut table, &TraceReader::open(long)?, checkpoints)?;
    }
    let megabytes = |bytes: usize| bytes as f64 / 1e6;
    let growth_cell = |(resident, heap): super::MemoryGrowth, layer: usize| {
        let resident = match resident {
            Some(growth) => format!(
                "{:.1} MB = {:.2}× one layer's q, k, v in f32 ({:.1} MB) + {:.1} MB of results",
                megabytes(growth.working()),
                growth.working() as f64 / layer as f64,
                megabytes(layer),
                megabytes(growth.retained),
            ),
            None => "n/a (the peak cannot be reset: /proc/self/clear_refs)".into(),
        };
        match heap {
            Some(heap) => format!(
                "{resident}; live heap {:.1} MB = {:.2}×",
                megabytes(heap.working()),
                heap.working() as f64 / layer as f64
            ),
            None => format!("{resident}; live heap n/a (build with --features heap-count)"),
        }
    };
    for (label, path) in std::iter::once(("", trace_path)).chain(long.map(|l| (" (long)", l))) {
        let reader = TraceReader::open(path)?;
        step("memory of one replay")?;
        let layer = super::layer_bytes(&reader);
        for (name, growth) in super::replay_memory(&reader, 128, checkpoints)? {
            table.push([
                format!(
                    "peak resident memory of one replay: {name} at budget 128, T = {}{label}",
                    reader.n_positions()
                ),
                growth_cell(growth, layer),
            ]);
        }
    }
    table.push([
        format!(
            "peak resident memory of the grid run ({} policies in one pass, {threads} threads)",
            reports.len()
        ),
        growth_cell((grid_resident, grid_heap), super::layer_bytes(&trace)),
    ]);
    if run.capture_tokens > 0 {
        // The model's rows run as `kvreplay capture` and `kvreplay live` run it.
        let _tuned = ModelMalloc::tune();
        step("capture and closed-loop speed")?;
        let (tokens, speed) = super::capture_speed(run.capture_tokens, stop)?;
        table.push([
            format!("capture prefill, {tokens} tokens, recording q/k/v"),
            format!("{speed:.0} tokens/s"),
        ]);
        let live = super::live_speed(run.capture_tokens, stop)?;
        let (_, plain_prefill, plain_decode) = live.runs[0].clone();
        for (label, prefill, decode) in &live.runs {
            table.push([
                format!(
                    "live: {label}, {} prompt tokens then {} decode steps (ms per token)",
                    live.tokens, live.steps
                ),
                format!(
                    "prefill {prefill:.2} ({:.2}× plain), decode {decode:.1} ({:.2}× plain)",
                    prefill / plain_prefill,
                    decode / plain_decode
                ),
            ]);
        }
    }
    Ok(table)
}

/// `result`, or the stop where it failed because Ctrl-C reached the NumPy reference's process
/// too (the terminal signals the whole process group).
fn unless_stopped<T>(result: Result<T, BenchError>, stop: Stop<'_>) -> Result<T, BenchError> {
    result.or_else(|err| {
        stop()?;
        Err(err)
    })
}

/// The one-shot grid's rows: its time beside its essential work, and beside the strong NumPy
/// reference when there is a Python.
fn oneshot_rows(
    table: &mut Table,
    (trace, trace_path): (&TraceReader, &Path),
    budgets: &[usize],
    python: Option<&Path>,
    checkpoints: Checkpoints<'_>,
) -> Result<(), BenchError> {
    let timing = super::timed_against_essential(trace, budgets, super::TIMED_RUNS, checkpoints)?;
    let (seconds, essential) = (timing.best_grid(), timing.best_essential());
    let policies = super::ONESHOT_POLICIES.len();
    table.push([
        format!(
            "one-shot grid ({policies} policies × {} budgets: {}), best of {}",
            budgets.len(),
            super::ONESHOT_POLICIES.join(", "),
            super::TIMED_RUNS
        ),
        format!(
            "{seconds:.2} s (runs {} s)",
            listed_seconds(timing.grid.iter().copied())
        ),
    ]);
    table.push([
        format!(
            "its essential work: read + one causal prefix pass + decode attention + selections, best of {}, run alternately with the grid",
            super::TIMED_RUNS
        ),
        format!(
            "{:.2} s = {:.2} + {:.2} + {:.2} + {:.2} s (runs {} s)",
            essential.total(),
            essential.read,
            essential.prefix,
            essential.decode,
            essential.selections,
            listed_seconds(timing.essential.iter().map(|e| e.total()))
        ),
    ]);
    table.push([
        "one-shot grid / its essential work (best over best)".into(),
        format!("{:.2}×", timing.ratio()),
    ]);
    if let Some(python) = python {
        let numpy = unless_stopped(
            super::oneshot_numpy(python, trace_path, budgets, &timing.reports),
            checkpoints.stop,
        )?;
        table.push([
            "strong NumPy reference, one-shot grid (scores shared across budgets, vectorised)"
                .into(),
            format!(
                "{:.2} s (largest Δ retained mass {:.1e})",
                numpy.seconds, numpy.worst_difference
            ),
        ]);
        table.push([
            "speed-up kvreplay (median grid run) / strong NumPy (one run), one-shot grid".into(),
            format!("{:.1}×", numpy.seconds / timing.median_grid()),
        ]);
    }
    Ok(())
}

/// Seconds as the bench lists runs: "3.25, 3.22, 3.13".
fn listed_seconds(seconds: impl Iterator<Item = f64>) -> String {
    let listed: Vec<String> = seconds.map(|t| format!("{t:.2}")).collect();
    listed.join(", ")
}

/// [`super::matmul_peak`] at `head_dim`. matrixmultiply allocates a packing buffer per
/// product: timed under this binary's 128 KiB mmap threshold, each would be mapped and faulted in
/// afresh, so the threshold is lifted while it runs.
fn peak_without_mapping(head_dim: usize) -> (f64, String) {
    set_mmap_threshold(16 << 20);
    let peak = super::matmul_peak(head_dim);
    set_mmap_threshold(MMAP_THRESHOLD);
    peak
}

/// The long trace's rows: the matmul peak at its head size, its prefix pass against that peak
/// (one timed run per global layer: at 32K a run takes tens of seconds, long enough to be steady)
/// and one replay each of SnapKV, the H2O prompt-end cut and the per-step oracle.
fn long_rows(
    table: &mut Table,
    trace: &TraceReader,
    checkpoints: Checkpoints<'_>,
) -> Result<(), BenchError> {
    let meta = trace.meta();
    let (peak, peak_product) = peak_without_mapping(meta.head_dim);
    table.push([
        format!("long: matmul peak at its head size, d = {}", meta.head_dim),
        format!("{peak:.1} GFLOP/s ({peak_product})"),
    ]);
    let (scoring, seconds) = super::scoring_throughput(trace, 1, checkpoints)?;
    table.push([
        format!(
            "long: causal prefix pass q·Kᵀ + softmax over the prompt, T = {}, {} global layers (one thread)",
            trace.n_positions(),
            meta.global_layers().len()
        ),
        format!(
            "{scoring:.1} GFLOP/s = {:.0}% of peak ({seconds:.1} s)",
            100.0 * scoring / peak
        ),
    ]);
    for (name, seconds) in super::long_replays(trace, 128, checkpoints)? {
        table.push([
            format!("long: one replay of {name} at budget 128"),
            format!("{seconds:.2} s"),
        ]);
    }
    Ok(())
}

/// The closed loop's rows: each recipe's live runs one at a time and batched, their decode steps
/// per row, and one step of many rows against one.
fn closed_loop_rows(
    recipes: &[PathBuf],
    step: &dyn Fn(&str) -> Result<(), BenchError>,
    stop: Stop<'_>,
) -> Result<Table, BenchError> {
    let _tuned = ModelMalloc::tune();
    let mut table = Table::new(["measure", "value"]);
    table.push(["threads".into(), rayon::current_num_threads().to_string()]);
    for recipe in recipes {
        step(&format!("closed loop on {}", recipe.display()))?;
        let speed = super::closed_loop::closed_loop_speed(recipe, stop)?;
        let what = format!(
            "closed loop, {} ({}, {} prompt tokens)",
            recipe.display(),
            speed.model,
            speed.prompt_tokens
        );
        let (alone, together) = speed.seconds;
        let per_minute = |seconds: f64| 60.0 * speed.runs as f64 / seconds;
        table.push([
            format!(
                "{what}: {} live runs ({} presets at B = 128), one at a time | batched",
                speed.runs,
                super::closed_loop::PRESETS.len()
            ),
            format!(
                "{alone:.1} s ({:.1} runs/min) | {together:.1} s ({:.1} runs/min), {:.2}× faster",
                per_minute(alone),
                per_minute(together),
                alone / together
            ),
        ]);
        if let Some(work) = speed.essential {
            let (prefills, decode) = work.seconds();
            table.push([
                format!(
                    "{what}: the batched runs | their essential work ({} prefills, {} rows × {} steps, at the {:.1} GFLOP/s product peak)",
                    work.prefills, speed.runs, speed.steps, work.peak
                ),
                format!(
                    "{together:.1} s | {:.1} s ({prefills:.1} s prefills, {decode:.1} s decode) = {:.1}× the essential work",
                    prefills + decode,
                    together / (prefills + decode)
                ),
            ]);
        }
        let (one, stepped, all) = speed.decode_ms;
        table.push([
            format!(
                "{what}: decode, ms per token per row (its prefill-timing runs, {} steps each), one at a time | batched, a pass per token | batched, teacher-forced in one pass and free runs resumed from it",
                speed.steps
            ),
            format!(
                "{one:.1} | {stepped:.1} | {all:.1}, {:.2}× faster",
                one / all
            ),
        ]);
        let (rows, one, all) = speed.step;
        let essential = speed.essential.map_or(String::new(), |work| {
            let ms = work.step_ms();
            format!("; its essential work {ms:.1} = {:.1}× one row", ms / one)
        });
        table.push([
            format!("{what}: one decode step, 1 row | {rows} rows (ms)"),
            format!("{one:.1} | {all:.1} = {:.1}× one row{essential}", all / one),
        ]);
    }
    Ok(table)
}

/// The essential work of `experiment` (read from `path`) on its `traces`: a row per trace, then
/// the whole, in seconds at the product peak measured now.
pub fn essential_rows(
    (path, experiment): (&Path, &crate::experiment::Experiment),
    traces: &[crate::experiment::TraceFile],
) -> Result<Table, BenchError> {
    let (work, peak) = super::closed_loop::experiment_work((path, experiment), traces)?;
    let seconds = |macs: f64| 2.0 * macs / (peak * 1e9);
    let mut table = Table::new(["measure", "value"]);
    table.push(["threads".into(), rayon::current_num_threads().to_string()]);
    table.push([
        "model-shaped product peak (512×1024·1024×2048, every thread)".into(),
        format!("{peak:.1} GFLOP/s"),
    ]);
    let (mut runs, mut prefills, mut total) = (0, 0, (0.0, 0.0));
    for recipe in &work {
        let what = format!(
            "{} ({}, {} prompt tokens): {} live runs, {} prefills, {} decode steps a run",
            recipe.trace.display(),
            recipe.model,
            recipe.prompt_tokens,
            recipe.runs,
            recipe.prefills,
            recipe.steps
        );
        let value = match recipe.multiply_adds {
            Some((prefill, decode)) => {
                let (prefill, decode) = (seconds(prefill), seconds(decode));
                total = (total.0 + prefill, total.1 + decode);
                format!(
                    "{:.1} s ({prefill:.1} s prefills, {decode:.1} s decode)",
                    prefill + decode
                )
            }
            None => "not counted: the model's family does not count its weights".into(),
        };
        (runs, prefills) = (runs + recipe.runs, prefills + recipe.prefills);
        table.push([what, value]);
    }
    let whole = total.0 + total.1;
    table.push([
        format!(
            "{}: {runs} live runs on {} recipes, {prefills} prefills",
            path.display(),
            work.len()
        ),
        format!(
            "{whole:.0} s = {:.1} min ({:.0} s prefills, {:.0} s decode)",
            whole / 60.0,
            total.0,
            total.1
        ),
    ]);
    Ok(table)
}

/// The rows of `kvreplay bench --model`: a model at this machine's limits
/// ([`model_limits`](super::limits::model_limits)).
fn limits_rows(
    (model, quantized): (&str, bool),
    tokens: usize,
    step: &dyn Fn(&str) -> Result<(), BenchError>,
    stop: Stop<'_>,
) -> Result<Table, BenchError> {
    let _tuned = ModelMalloc::tune();
    step(&format!("{model} at this machine's limits"))?;
    let limits = super::limits::model_limits((model, quantized), tokens, stop)?;
    let mut table = Table::new(["measure", "value"]);
    table.push(["threads".into(), rayon::current_num_threads().to_string()]);
    table.push(["model runs as".into(), limits.engine.clone()]);
    let (prefill, essential) = limits.prefill;
    table.push([
        format!("{model}: capture prefill, {} tokens, recording q/k/v", limits.tokens),
        format!(
            "{prefill:.2} s ({:.0} tokens/s); essential work {essential:.2} s at the product peak of {:.0} GFLOP/s: {:.2}×",
            limits.tokens as f64 / prefill,
            limits.peak,
            prefill / essential
        ),
    ]);
    let (step, floor) = limits.step;
    let (weights, cache) = limits.bytes;
    table.push([
        format!("{model}: one decode step, one row, after {} tokens", limits.tokens),
        format!(
            "{step:.1} ms; bandwidth floor {floor:.1} ms ({:.2} GB of weights as held and {:.2} GB of cache read once at a streaming read of {:.1} GB/s): {:.2}×",
            weights as f64 / 1e9,
            cache as f64 / 1e9,
            limits.bandwidth,
            step / floor
        ),
    ]);
    let rows = super::limits::BATCH_ROWS;
    table.push([
        format!("{model}: one decode step of {rows} rows, each its own copy of the cache"),
        format!(
            "{:.1} ms ({:.1} rows/s; {:.2}× one row's time for {rows}× its rows)",
            limits.batched_ms,
            1e3 * rows as f64 / limits.batched_ms,
            limits.batched_ms / step
        ),
    ]);
    Ok(table)
}
