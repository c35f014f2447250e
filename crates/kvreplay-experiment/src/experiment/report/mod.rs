//! The report of an experiment, from its stored runs: a markdown table of mean retained mass
//! with 95% confidence intervals per method and budget (real memory beside it), paired
//! comparisons (mean difference with its interval and a two-sided sign test), span survival,
//! the entropy profile when asked, rows in Parquet and CSV (polars), and plots.
//!
//! Intervals are over prompts ([`super::intervals`]): Student t over per-prompt means, the
//! questions asked of one shared context counting as one prompt. A report over one prompt gives
//! its means without an interval and says so: the (layer, query head, decode step) samples of one
//! trace are correlated (the same needle, neighbouring steps), so they measure that prompt, not
//! how a method generalises.

use super::calibration;
use super::figures::{heatmap, line_chart, slug, FigureFiles, Series};
use super::intervals::Interval;
use super::ranking;
use super::stats::sign_test;
use super::store::{find_run, stored_runs, write_atomically, StoredRun};
use super::traces::NeedleCell;
use super::SweepError;
use super::{Budget, Experiment, TraceFile};
use crate::export::{Format, Table};
use crate::replay::{entropy_profile, PolicyError, RETAINED_MASS};
use crate::trace::{layer_kind, TraceReader};
use polars::prelude::*;
use std::path::{Path, PathBuf};

mod entropy;
mod frames;
mod lost;
mod mass;
mod needle;
mod paired;
mod plots;
mod spans;

use entropy::entropy_section;
use frames::write_frames;
use lost::lost_section;
use mass::{mass_section, model_section};
use needle::needle_section;
use paired::paired_section;
use plots::figures_of_runs;
use spans::span_sections;

/// The retained-mass samples of a run (layer, query head, decode step).
fn samples(run: &StoredRun) -> Vec<f64> {
    run.report.samples[RETAINED_MASS]
        .iter()
        .flatten()
        .flatten()
        .copied()
        .collect()
}

/// Which prompt templates the traces' RULER recipes use, as a line of the report's header; empty
/// when none is a RULER recipe.
fn templates(traces: &[TraceFile]) -> String {
    let mut counts: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for trace in traces {
        let template = trace
            .recipe
            .as_ref()
            .and_then(|recipe| crate::recipe::Recipe::load(recipe).ok())
            .and_then(|(recipe, _)| recipe.template());
        if let Some(template) = template {
            *counts.entry(template).or_default() += 1;
        }
    }
    if counts.is_empty() {
        return String::new();
    }
    let each: Vec<String> = counts
        .iter()
        .map(|(template, n)| format!("`{template}` on {n}"))
        .collect();
    format!(
        "Prompt template of the RULER traces (a recipe's `template`: `chat` wraps the task in the model's chat turns, `base` is RULER's raw task text): {}.\n\n",
        each.join(", ")
    )
}

/// `0.9118 ± 0.0163`, or the mean alone where there is no interval (the header says when).
fn unsigned(interval: &Interval) -> String {
    match interval.half_width() {
        Some(half) => format!("{:.4} ± {half:.4}", interval.estimate),
        None => format!("{:.4}", interval.estimate),
    }
}

/// `+0.0123 ± 0.0045`, or the mean alone where there is no interval.
fn signed(interval: &Interval) -> String {
    match interval.half_width() {
        Some(half) => format!("{:+.4} ± {half:.4}", interval.estimate),
        None => format!("{:+.4}", interval.estimate),
    }
}

/// A run's KV entries per layer, from its trace's head counts.
pub fn kv_entries(run: &StoredRun, traces: &[TraceFile]) -> f64 {
    traces
        .iter()
        .find(|trace| trace.path.display().to_string() == run.trace)
        .and_then(|trace| trace.heads)
        .map_or(f64::NAN, |(n_heads, n_kv_heads)| {
            run.report.kv_entries(n_heads, n_kv_heads)
        })
}

/// The model of a trace, as its header says.
fn model_of(trace: &TraceFile) -> String {
    trace.model.clone().unwrap_or_else(|| "unknown".into())
}

/// The traces grouped by model, models in the order of their first trace.
fn by_model(traces: &[TraceFile]) -> Vec<(String, Vec<TraceFile>)> {
    let mut groups: Vec<(String, Vec<TraceFile>)> = Vec::new();
    for trace in traces {
        let model = model_of(trace);
        match groups.iter_mut().find(|(m, _)| *m == model) {
            Some((_, group)) => group.push(trace.clone()),
            None => groups.push((model, vec![trace.clone()])),
        }
    }
    groups
}

/// Builds the experiment's report from its stored runs, section by section, writes it (with its
/// Parquet/CSV rows and figures) under `results`, and returns the Markdown. `command` is the
/// command line to name in it. With traces of several models the report has a summary table
/// side by side and then one part per model, every section computed on that model's traces.
pub fn build(
    experiment: &Experiment,
    traces: &[TraceFile],
    results: &Path,
    command: &str,
) -> Result<String, SweepError> {
    std::fs::create_dir_all(results).map_err(|e| SweepError::Io {
        path: results.to_owned(),
        detail: format!("cannot create directory: {e}"),
    })?;
    let runs = stored_runs(experiment, traces, results)?;
    let trace_names: Vec<String> = traces
        .iter()
        .map(|t| t.path.display().to_string())
        .collect();
    let description = match experiment.description.trim() {
        "" => String::new(),
        text => format!("{text}\n\n"),
    };
    let mut out = format!(
        "# {}\n\n{description}Produced by `{command}` ({} runs on {}).\n\n",
        experiment.name,
        runs.len(),
        trace_names.join(", ")
    );
    out += &templates(traces);
    let frames = if runs.is_empty() {
        Vec::new()
    } else {
        write_frames(&runs, traces, results)?
    };
    let needle_grid = experiment.needle_cells(traces);
    let models = by_model(traces);
    if models.len() < 2 {
        let figures = FigureFiles::under(results);
        let part = part(experiment, &needle_grid, traces, &runs, &figures)?;
        out += &part.body;
        if !runs.is_empty() {
            out += &files_line(&frames, &part.figures);
        }
        out += &part.tail;
    } else {
        if !runs.is_empty() {
            out += &model_section(experiment, &experiment.policy_names(), &runs, &models);
        }
        let mut all_figures = Vec::new();
        for (model, model_traces) in &models {
            let paths: Vec<String> = model_traces
                .iter()
                .map(|t| t.path.display().to_string())
                .collect();
            let model_runs: Vec<StoredRun> = runs
                .iter()
                .filter(|r| paths.contains(&r.trace))
                .cloned()
                .collect();
            let figures = FigureFiles {
                dir: results,
                suffix: format!("_{}", slug(model)),
            };
            let part = part(
                experiment,
                &needle_grid,
                model_traces,
                &model_runs,
                &figures,
            )?;
            out += &format!("\n## `{model}`\n");
            let text = part.body + &part.tail;
            if !text.starts_with('\n') {
                out += "\n";
            }
            out += &text;
            all_figures.extend(part.figures);
        }
        if !runs.is_empty() {
            out += &files_line(&frames, &all_figures);
        }
    }
    write_atomically(&results.join("report.md"), out.as_bytes())?;
    let page = crate::view::report::report_page(&out, results);
    write_atomically(&results.join("report.html"), page.as_bytes())?;
    if let Some(root) = results.parent().filter(|root| !root.as_os_str().is_empty()) {
        let index = crate::view::report::index_page(root).map_err(|e| SweepError::Io {
            path: root.to_owned(),
            detail: format!("cannot list the experiments: {e}"),
        })?;
        write_atomically(&root.join("index.html"), index.as_bytes())?;
    }
    Ok(out)
}

/// The layers the policies compress on `traces`, in the model's numbering, when every trace
/// names them alike; `None` when no trace names them (every layer is compressed) or they differ.
fn compressed_layers(traces: &[TraceFile]) -> Option<Vec<usize>> {
    let first = traces.first()?.global_layers.clone()?;
    traces
        .iter()
        .all(|t| t.global_layers.as_ref() == Some(&first))
        .then_some(first)
}

/// The report's sections for one set of traces: the body (tables of the runs), the figures of
/// the runs, and the tail (needle grid and entropy profile, which list their own figures).
struct Part {
    body: String,
    figures: Vec<PathBuf>,
    tail: String,
}

fn part(
    experiment: &Experiment,
    needle_grid: &[NeedleCell],
    traces: &[TraceFile],
    runs: &[StoredRun],
    files: &FigureFiles<'_>,
) -> Result<Part, SweepError> {
    let trace_names: Vec<String> = traces
        .iter()
        .map(|t| t.path.display().to_string())
        .collect();
    let mut body = String::new();
    let mut figures = Vec::new();
    if !runs.is_empty() {
        let names = experiment.policy_names();
        let (mass, mass_series) = mass_section(experiment, &names, runs, &trace_names, traces);
        body += &mass;
        body += &paired_section(experiment, runs, &trace_names);
        body += &span_sections(experiment, &names, runs, &trace_names);
        body += &lost_section(experiment, &names, runs, &trace_names);
        body += &ranking::section(experiment, runs, &trace_names);
        figures = figures_of_runs(experiment, &names, runs, &trace_names, &mass_series, files)?;
        if runs.iter().all(|r| r.closed_loop.is_some()) {
            let (text, plots) = calibration::section(
                experiment,
                &names,
                runs,
                &trace_names,
                compressed_layers(traces).as_deref(),
                files,
            )?;
            body += &text;
            figures.extend(plots);
        }
    }
    let mut tail = String::new();
    let paths: Vec<&PathBuf> = traces.iter().map(|t| &t.path).collect();
    let needle_grid: Vec<NeedleCell> = needle_grid
        .iter()
        .filter(|cell| paths.contains(&&cell.trace))
        .cloned()
        .collect();
    if let (Some(budget), false) = (experiment.heatmap_budget, needle_grid.is_empty()) {
        tail += &needle_section(experiment, runs, &needle_grid, budget, files)?;
    }
    if let Some(window) = experiment.entropy_window {
        tail += &entropy_section(traces, window, files)?;
    }
    Ok(Part {
        body,
        figures,
        tail,
    })
}

/// `Files: ...` naming the rows and figures written.
fn files_line(frames: &[PathBuf], figures: &[PathBuf]) -> String {
    format!(
        "\nFiles: {}.\n",
        frames
            .iter()
            .chain(figures)
            .map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A table with a `policy` column and one column per budget.
fn budget_table(experiment: &Experiment) -> Table {
    let mut headers = vec!["policy".to_string()];
    headers.extend(experiment.budgets.iter().map(Budget::header));
    Table::with_headers(headers)
}
