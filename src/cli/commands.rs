//! What each command does between parsing and printing: it calls the library, shows progress
//! on a terminal (indicatif; nothing when piped) and prints what the library returns.

use super::OutputArgs;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvreplay::assets::Assets;
use kvreplay::capture::{self, ModelSlot};
use kvreplay::experiment::shard::Shard;
use kvreplay::experiment::{
    claim_results, report, run_sweep, Capture, Experiment, TraceEntry, TraceFile,
};
use kvreplay::export::{exporter, Format};
use kvreplay::live::LiveReport;
use kvreplay::replay::{
    presets, replay_many, Checkpoints, PolicyParams, ReplayReport, ValidPolicy,
};
use kvreplay::stop::Stop;
use kvreplay::sys;
use kvreplay::trace::{StorageDtype, TraceReader};
use kvreplay::view;
use std::path::Path;

pub fn replay_all(
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
    crate::stop::catch_interrupt();
    let reports = pool
        .install(|| {
            let after_layer = || {
                sys::return_free_memory();
                bar.inc(1);
                crate::stop::check()
            };
            replay_many(trace, policies, stopping_after(&after_layer))
        })
        .context("replaying")?;
    bar.finish_and_clear();
    Ok(reports)
}

/// A spinner showing `what` is under way, on a terminal only.
fn spinner(what: &str) -> ProgressBar {
    let spinner = ProgressBar::new_spinner();
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    spinner.set_message(what.to_owned());
    spinner
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

pub fn fetch() -> Result<()> {
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

pub fn capture_recipe(
    recipe: &Path,
    out: &Path,
    storing: (StorageDtype, usize, bool),
    models: &mut ModelSlot,
) -> Result<(), capture::CaptureError> {
    let _tuned = sys::ModelMalloc::tune();
    crate::stop::catch_interrupt();
    let size = capture::planned_size(recipe, models, storing)?;
    eprintln!("{}: {size}", recipe.display());
    let bar = progress_bar(0, "capture");
    let started = std::time::Instant::now();
    let summaries = capture::capture_recipe(recipe, out, storing, models, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        crate::stop::check()
    })?;
    bar.finish_and_clear();
    for summary in &summaries {
        println!(
            "{}: {} prompt + {} generated tokens\ngenerated: {:?}",
            summary.path.display(),
            summary.prompt_tokens,
            summary.generated_tokens,
            summary.generated_text
        );
    }
    println!("captured in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The table of presets `names` on `reader` (every preset that runs on it when `None`, those left
/// out named on stderr).
pub fn compare(
    reader: &TraceReader,
    (budget, settings): (usize, &serde_json::Map<String, serde_json::Value>),
    names: Option<Vec<String>>,
    output: &OutputArgs,
) -> Result<String> {
    let labelled = match names {
        Some(names) => presets::labelled(&names, budget, settings)?,
        None => {
            let (runnable, left_out) = presets::runnable_on(reader, budget, settings)?;
            for (name, why) in left_out {
                eprintln!("left out `{name}`: {why}");
            }
            runnable
        }
    };
    let (labels, policies): (Vec<String>, Vec<_>) = labelled.into_iter().unzip();
    let reports = replay_all(reader, &policies, output.threads)?;
    let labelled: Vec<ReplayReport> = reports
        .into_iter()
        .zip(labels)
        .map(|(report, policy)| ReplayReport { policy, ..report })
        .collect();
    Ok(exporter(output.format).export(&labelled, !output.no_layers))
}

/// A live run of `recipe` under `policy`, as text.
pub fn live(recipe: &Path, policy: &ValidPolicy, format: Format, chunk: usize) -> Result<String> {
    let _tuned = sys::ModelMalloc::tune();
    let spinner = spinner("live: the full cache, then the policy");
    let scratch = std::env::temp_dir();
    crate::stop::catch_interrupt();
    let stop = crate::stop::check;
    let questions = kvreplay::live::run_recipe(
        recipe,
        std::slice::from_ref(policy),
        (chunk, &scratch),
        &stop,
    )?;
    spinner.finish_and_clear();
    let mut reports: Vec<LiveReport> = questions.into_iter().flatten().collect();
    Ok(match (format, reports.len()) {
        (Format::Json, 1) => serde_json::to_string_pretty(&reports[0])? + "\n",
        (Format::Json, _) => serde_json::to_string_pretty(&reports)? + "\n",
        (_, 1) => kvreplay::export::live_table(&reports.remove(0), format),
        _ => kvreplay::export::live_questions_table(&reports, format),
    })
}

/// The newcomer's first run: fetch, capture niah-2k (once), inspect it, compare the classic methods.
pub fn demo(budget: usize) -> Result<()> {
    fetch()?;
    let recipe = Path::new("traces/niah-2k.toml");
    let trace = recipe.with_extension("safetensors");
    if trace.is_file() {
        println!("{}: already captured", trace.display());
    } else {
        capture_recipe(
            recipe,
            &trace,
            (StorageDtype::F16, 512, false),
            &mut ModelSlot::default(),
        )?;
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
    let settings = serde_json::Map::new();
    print!("{}", compare(&reader, (budget, &settings), None, &output)?);
    Ok(())
}

/// The experiment's traces, capturing missing recipes when `may_capture` is set, each once
/// ([`capture::capture_once`]; with their attention inputs where a policy reads them), with
/// their models from `models`.
fn experiment_traces(
    experiment: &Experiment,
    may_capture: bool,
    models: &mut ModelSlot,
) -> Result<Vec<TraceFile>> {
    let inputs = experiment.reads_inputs;
    let mut capture_once = |recipe: &Path, trace: &Path| {
        capture::capture_once(recipe, trace, &mut |recipe, trace| {
            capture_recipe(recipe, trace, (StorageDtype::F16, 512, inputs), models)
        })
    };
    Ok(experiment.trace_files(may_capture.then_some(&mut capture_once as Capture<'_>))?)
}

/// Which runs a sweep command runs before its report.
pub enum SweepRuns {
    /// Every missing run, then the report.
    All,
    /// The missing runs of one shard, no report.
    Shard(Shard),
    /// None: the report from the stored runs.
    None,
}

/// Runs what `runs` asks for, then prints the report unless it ran one shard.
pub fn sweep(path: &Path, results_root: &Path, runs: SweepRuns) -> Result<()> {
    let experiment = Experiment::load(path)?;
    let _tuned = experiment.closed_loop.then(sys::ModelMalloc::tune);
    let results = results_root.join(&experiment.name);
    let shard = match runs {
        SweepRuns::Shard(shard) => Some(shard),
        _ => None,
    };
    let run_missing = !matches!(runs, SweepRuns::None);
    if run_missing {
        claim_results(&results, path)?;
    }
    let mut models = ModelSlot::default();
    let traces = match run_missing {
        true => run_missing_runs(&experiment, &results, shard, &mut models)?,
        false => experiment_traces(&experiment, false, &mut models)?,
    };
    if shard.is_none() {
        let command = format!("kvreplay sweep {}", path.display());
        print!(
            "{}",
            report::build(&experiment, &traces, &results, &command)?
        );
    }
    Ok(())
}

/// Runs the experiment's runs not stored under `results` (of `shard` only, when given), its
/// recipes captured where missing: a closed loop's by the live sessions that run them (no
/// capture bar), the others' first. Returns the experiment's traces.
fn run_missing_runs(
    experiment: &Experiment,
    results: &Path,
    shard: Option<Shard>,
    models: &mut ModelSlot,
) -> Result<Vec<TraceFile>> {
    let entries = match experiment.closed_loop && shard.is_none() {
        true => experiment.trace_entries()?,
        false => vec![TraceEntry::Captured(experiment_traces(
            experiment, true, models,
        )?)],
    };
    let label = match shard {
        Some(shard) => format!("{} shard {shard}", experiment.name),
        None => experiment.name.clone(),
    };
    let bar = progress_bar(0, &label);
    let started = std::time::Instant::now();
    let after_layer = sys::after_sweep_layer(experiment.closed_loop);
    crate::stop::catch_interrupt();
    let swept = run_sweep(
        experiment,
        &entries,
        results,
        shard,
        (
            &|done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64)
            },
            stopping_after(&|| {
                after_layer()?;
                crate::stop::check()
            }),
        ),
        models,
    )?;
    bar.finish_and_clear();
    let took = clock(started.elapsed().as_secs_f64());
    let (ran, skipped) = (swept.ran, swept.skipped);
    eprintln!("{label}: {ran} runs done, {skipped} already there, in {took}");
    Ok(swept.traces)
}

/// `seconds` as a reader times a run: "12.3 s", "4 min 05 s", "2 h 51 min 03 s".
fn clock(seconds: f64) -> String {
    let whole = seconds.round() as u64;
    let (hours, minutes, rest) = (whole / 3600, whole / 60 % 60, whole % 60);
    match (hours, minutes) {
        (0, 0) => format!("{seconds:.1} s"),
        (0, _) => format!("{minutes} min {rest:02} s"),
        _ => format!("{hours} h {minutes:02} min {rest:02} s"),
    }
}

/// The bench's table, with the measurement under way shown on a terminal.
pub fn bench(run: &kvreplay::bench::BenchRun) -> Result<String> {
    if let Some(path) = &run.essential {
        let experiment = Experiment::load(path)?;
        let traces = experiment_traces(&experiment, true, &mut ModelSlot::default())?;
        let spinner = spinner("essential work");
        let table = kvreplay::bench::essential_rows((path, &experiment), &traces)?;
        spinner.finish_and_clear();
        return Ok(table.render(Format::Markdown));
    }
    crate::stop::catch_interrupt();
    let spinner = spinner("bench");
    let progress = |step: &str| spinner.set_message(step.to_owned());
    let table = kvreplay::bench::measure(run, &progress, &crate::stop::check)?;
    spinner.finish_and_clear();
    Ok(table.render(Format::Markdown))
}

/// Writes the view page of the policy `params` (and preset `compare` at its budget) on `trace`
/// to `out`, atomically; returns its size in bytes.
pub fn view(
    trace: &TraceReader,
    params: &PolicyParams,
    compare: Option<&str>,
    out: &Path,
) -> Result<usize> {
    let main = params.clone().check()?;
    let mut policies = vec![(main.label(), main)];
    if let Some(name) = compare {
        let other = presets::preset(name, params.budget)?.check()?;
        policies.push((name.to_owned(), other));
    }
    let spinner = spinner("view: layer passes done");
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {msg}: {pos}").expect("static template"),
    );
    crate::stop::catch_interrupt();
    let page = view::page_of(
        trace,
        &policies,
        &Assets::from_env(),
        stopping_after(&|| {
            spinner.inc(1);
            crate::stop::check()
        }),
    );
    spinner.finish_and_clear();
    let page = page?;
    kvreplay::atomic::write(out, page.as_bytes()).with_context(|| format!("{}", out.display()))?;
    Ok(page.len())
}

/// Checkpoints that call `after_layer` after each layer and ask Ctrl-C's stop within layers.
fn stopping_after(after_layer: Stop<'_>) -> Checkpoints<'_> {
    Checkpoints {
        after_layer,
        stop: &crate::stop::check,
    }
}

#[cfg(test)]
mod tests {
    use super::clock;

    #[test]
    fn a_clock_reads_as_a_reader_times_a_run() {
        assert_eq!(clock(12.34), "12.3 s");
        assert_eq!(clock(59.7), "1 min 00 s");
        assert_eq!(clock(245.0), "4 min 05 s");
        assert_eq!(clock(2.0 * 3600.0 + 51.0 * 60.0 + 3.4), "2 h 51 min 03 s");
    }
}
