//! The report of an experiment, from its stored runs: a markdown table of mean retained mass
//! with 95% confidence intervals per method and budget (real memory beside it), paired
//! comparisons (mean difference with its interval and a two-sided sign test), span survival,
//! the entropy profile when asked, rows in Parquet and CSV (polars), and plots.
//!
//! Intervals: with one trace, Student-t over the (layer, query head, decode step) samples of
//! retained mass. Those samples are correlated (the same needle, neighbouring steps), so the
//! interval says how precisely this trace was measured, not how the method generalises; with
//! several traces the interval is over per-trace means instead, and the report says which.

use super::calibration;
use super::figures::{heatmap, line_chart, slug, FigureFiles, Series};
use super::ranking;
use super::stats::{mean_ci, sign_test};
use super::store::{find_run, stored_runs, write_atomically, ClosedLoop, StoredRun};
use super::traces::NeedleCell;
use super::SweepError;
use super::{Experiment, TraceFile};
use crate::export::{Format, Table};
use crate::replay::{entropy_profile, metrics, PolicyError, RETAINED_MASS};
use crate::trace::{layer_kind, TraceReader};
use polars::prelude::*;
use std::path::{Path, PathBuf};

/// The retained-mass samples of a run (layer, query head, decode step).
fn samples(run: &StoredRun) -> Vec<f64> {
    run.report.samples[RETAINED_MASS]
        .iter()
        .flatten()
        .flatten()
        .copied()
        .collect()
}

/// A run's KV entries per layer, from its trace's head counts.
fn kv_entries(run: &StoredRun, traces: &[TraceFile]) -> f64 {
    traces
        .iter()
        .find(|trace| trace.path.display().to_string() == run.trace)
        .and_then(|trace| trace.heads)
        .map_or(f64::NAN, |(n_heads, n_kv_heads)| {
            run.report.kv_entries(n_heads, n_kv_heads)
        })
}

fn write_frames(
    runs: &[StoredRun],
    traces: &[TraceFile],
    results: &Path,
) -> Result<Vec<PathBuf>, SweepError> {
    let column = |name: &str, values: Vec<f64>| Column::new(name.into(), values);
    let mut columns = vec![
        Column::new(
            "id".into(),
            runs.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "trace".into(),
            runs.iter().map(|r| r.trace.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "policy".into(),
            runs.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "budget".into(),
            runs.iter()
                .map(|r| r.report.nominal_budget as u64)
                .collect::<Vec<_>>(),
        ),
        column(
            "mean_kept",
            runs.iter().map(|r| r.report.mean_kept).collect(),
        ),
        column(
            "kv_entries",
            runs.iter().map(|r| kv_entries(r, traces)).collect(),
        ),
    ];
    columns.extend(metrics::REGISTRY.iter().map(|metric| {
        let values = runs
            .iter()
            .map(|r| r.report.metric(metric.id()).unwrap_or(f64::NAN))
            .collect();
        column(metric.id(), values)
    }));
    if runs.iter().all(|r| r.closed_loop.is_some()) {
        let closed: Vec<&ClosedLoop> = runs.iter().filter_map(|r| r.closed_loop.as_ref()).collect();
        columns.extend([
            column("kl", closed.iter().map(|c| c.kl).collect()),
            column("top1", closed.iter().map(|c| c.top1).collect()),
            column(
                "live_retained_mass",
                closed
                    .iter()
                    .map(|c| c.live_retained_mass.unwrap_or(f64::NAN))
                    .collect(),
            ),
            column(
                "logprob_lost",
                closed.iter().map(|c| c.logprob_lost).collect(),
            ),
            Column::new(
                "answer_ok".into(),
                closed.iter().map(|c| c.answer_ok).collect::<Vec<_>>(),
            ),
            Column::new(
                "full_answer_ok".into(),
                closed.iter().map(|c| c.full_answer_ok).collect::<Vec<_>>(),
            ),
            Column::new(
                "text".into(),
                closed.iter().map(|c| c.text.clone()).collect::<Vec<_>>(),
            ),
        ]);
    }
    let mut frame = DataFrame::new_infer_height(columns).map_err(|e| SweepError::Io {
        path: results.to_owned(),
        detail: e.to_string(),
    })?;
    let mut written = Vec::new();
    for (extension, parquet) in [("parquet", true), ("csv", false)] {
        let path = results.join(format!("runs.{extension}"));
        let mut bytes: Vec<u8> = Vec::new();
        let outcome = if parquet {
            ParquetWriter::new(&mut bytes)
                .finish(&mut frame)
                .map(|_| ())
        } else {
            CsvWriter::new(&mut bytes).finish(&mut frame)
        };
        outcome.map_err(|e| SweepError::Io {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        write_atomically(&path, &bytes)?;
        written.push(path);
    }
    Ok(written)
}

/// Per policy, the share of the needle's full-attention mass that survives at `budget`, as a
/// depth × length table and heatmap (the PyramidKV paper's figure 5 layout).
fn needle_section(
    experiment: &Experiment,
    runs: &[StoredRun],
    grid: &[NeedleCell],
    budget: usize,
    files: &FigureFiles<'_>,
) -> Result<String, SweepError> {
    let mut lengths: Vec<usize> = grid.iter().map(|c| c.length).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut depths: Vec<f64> = grid.iter().map(|c| c.depth).collect();
    depths.sort_by(f64::total_cmp);
    depths.dedup();
    let mut out = format!(
        "\nNeedle survival at budget {budget}: share of the needle's full-attention mass the kept set holds (mean over layers, heads and decode steps), by context length and needle depth:\n"
    );
    let mut figures = Vec::new();
    for name in experiment.policy_names() {
        let mut values = vec![vec![f64::NAN; lengths.len()]; depths.len()];
        for cell in grid {
            let trace = cell.trace.display().to_string();
            if let Some(run) = find_run(runs, &name, budget, &trace) {
                if let Some((_, _, kept, full)) = run.report.spans.iter().find(|s| s.0 == "needle")
                {
                    let row = depths
                        .iter()
                        .position(|d| *d == cell.depth)
                        .expect("listed");
                    let column = lengths
                        .iter()
                        .position(|l| *l == cell.length)
                        .expect("listed");
                    values[row][column] = if *full > 0.0 { kept / full } else { 0.0 };
                }
            }
        }
        let mut headers = vec![format!("{name}: depth \\ length")];
        headers.extend(lengths.iter().map(|l| l.to_string()));
        let mut table = Table::with_headers(headers);
        for (row, depth) in depths.iter().enumerate().rev() {
            let mut cells = vec![format!("{depth}%")];
            cells.extend(values[row].iter().map(|v| {
                if v.is_nan() {
                    "—".to_string()
                } else {
                    format!("{v:.3}")
                }
            }));
            table.push(cells);
        }
        out += "\n";
        out += &table.render(Format::Markdown);
        figures.extend(heatmap(
            &files.stem(&format!("needle_{}", slug(&name))),
            &format!("{name}: needle mass kept at budget {budget}"),
            &lengths.iter().map(|l| l.to_string()).collect::<Vec<_>>(),
            &depths.iter().map(|d| format!("{d}%")).collect::<Vec<_>>(),
            &values,
            "context length (prompt tokens)",
            "needle depth",
        )?);
    }
    out += &format!(
        "\nFigures: {}.\n",
        figures
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "png"))
            .map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(out)
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

/// The retained-mass table (mean ± CI, KV entries per layer) and its series for the figure.
fn mass_section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
    traces: &[TraceFile],
) -> (String, Vec<Series>) {
    let several = trace_names.len() > 1;
    let mut out = format!(
        "Mean retained mass ± 95% CI half-width ({}), KV entries stored per layer in brackets (mean over layers and decode steps; one unit for every cache layout, so equal numbers are equal memory):\n\n",
        if several {
            "Student t over per-trace means"
        } else {
            "Student t over the layer × query head × decode step samples of one trace; they are correlated, so this is the precision of this measurement, not a generalisation claim"
        }
    );
    let mut table = budget_table(experiment);
    let mut mass_series: Vec<Series> = Vec::new();
    for name in names {
        let mut row = vec![name.clone()];
        let mut points = Vec::new();
        for &budget in &experiment.budgets {
            let per_trace: Vec<&StoredRun> = trace_names
                .iter()
                .filter_map(|t| find_run(runs, name, budget, t))
                .collect();
            if per_trace.is_empty() {
                row.push("—".into());
                continue;
            }
            let (mean, half) = if several {
                mean_ci(
                    &per_trace
                        .iter()
                        .map(|r| r.report.metric(RETAINED_MASS).unwrap_or(f64::NAN))
                        .collect::<Vec<_>>(),
                )
            } else {
                mean_ci(&samples(per_trace[0]))
            };
            let entries = per_trace.iter().map(|r| kv_entries(r, traces)).sum::<f64>()
                / per_trace.len() as f64;
            row.push(format!("{mean:.4} ± {half:.4} ({entries:.0})"));
            points.push((budget as f64, mean));
        }
        table.push(row);
        mass_series.push((name.clone(), points));
    }
    out += &table.render(Format::Markdown);
    (out, mass_series)
}

/// The models side by side: per policy, one row per model with its mean retained mass over its
/// traces at each budget (± 95% CI with more than one trace).
fn model_section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    models: &[(String, Vec<TraceFile>)],
) -> String {
    let mut out = "Models side by side (the trace header's `model`, with its number of traces): mean retained mass over each model's traces, ± 95% CI (Student t over per-trace means) where it has several. On a model with sliding-window layers only its global layers are compressed and measured; the others keep their window. Each model's part below has the full tables.\n\n".to_string();
    let mut headers = vec!["policy".to_string(), "model".to_string()];
    headers.extend(experiment.budgets.iter().map(|b| format!("B = {b}")));
    let mut table = Table::with_headers(headers);
    for name in names {
        for (model, traces) in models {
            let mut row = vec![name.clone(), format!("{model} ({})", traces.len())];
            for &budget in &experiment.budgets {
                let values: Vec<f64> = traces
                    .iter()
                    .filter_map(|t| find_run(runs, name, budget, &t.path.display().to_string()))
                    .filter_map(|r| r.report.metric(RETAINED_MASS))
                    .collect();
                row.push(match values.len() {
                    0 => "—".into(),
                    1 => format!("{:.4}", values[0]),
                    _ => {
                        let (mean, half) = mean_ci(&values);
                        format!("{mean:.4} ± {half:.4}")
                    }
                });
            }
            table.push(row);
        }
    }
    out += &table.render(Format::Markdown);
    out
}

/// A table with a `policy` column and one column per budget.
fn budget_table(experiment: &Experiment) -> Table {
    let mut headers = vec!["policy".to_string()];
    headers.extend(experiment.budgets.iter().map(|b| format!("B = {b}")));
    Table::with_headers(headers)
}

/// The paired comparisons (`[[compare]]`), or nothing.
fn paired_section(experiment: &Experiment, runs: &[StoredRun], trace_names: &[String]) -> String {
    if experiment.compare.is_empty() {
        return String::new();
    }
    let mut out = "\nPaired comparisons on the same (trace, layer, head, step) positions: mean of a − b with its 95% CI, the share of positions where a keeps more, and a two-sided sign test:\n\n".to_string();
    let mut paired = Table::new(["a", "b", "budget", "mean a − b", "a > b", "sign test p"]);
    for pair in &experiment.compare {
        for &budget in &experiment.budgets {
            let mut differences = Vec::new();
            for trace in trace_names {
                if let (Some(a), Some(b)) = (
                    find_run(runs, &pair.a, budget, trace),
                    find_run(runs, &pair.b, budget, trace),
                ) {
                    differences.extend(samples(a).iter().zip(samples(b)).map(|(x, y)| x - y));
                }
            }
            if differences.is_empty() {
                continue;
            }
            let (mean, half) = mean_ci(&differences);
            let wins =
                differences.iter().filter(|d| **d > 0.0).count() as f64 / differences.len() as f64;
            paired.push([
                pair.a.clone(),
                pair.b.clone(),
                budget.to_string(),
                format!("{mean:+.4} ± {half:.4}"),
                format!("{:.1}%", 100.0 * wins),
                match sign_test(&differences) {
                    0.0 => "< 1e-300".into(),
                    p => format!("{p:.2e}"),
                },
            ]);
        }
    }
    out += &paired.render(Format::Markdown);
    out
}

/// One table per named span of the traces: tokens kept / mass kept.
fn span_sections(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    let mut out = String::new();
    let span_names: Vec<String> = runs[0].report.spans.iter().map(|s| s.0.clone()).collect();
    for (index, span) in span_names.iter().enumerate() {
        out += &format!("\nSpan `{span}`: share of its tokens kept / share of its full-attention mass kept (mean over traces, layers, heads, steps):\n\n");
        let mut table = budget_table(experiment);
        for name in names {
            let mut row = vec![name.clone()];
            for &budget in &experiment.budgets {
                let values: Vec<(f64, f64)> = trace_names
                    .iter()
                    .filter_map(|t| find_run(runs, name, budget, t))
                    .map(|r| {
                        let (_, fraction, kept, full) = &r.report.spans[index];
                        (*fraction, if *full > 0.0 { kept / full } else { 0.0 })
                    })
                    .collect();
                if values.is_empty() {
                    row.push("—".into());
                } else {
                    let n = values.len() as f64;
                    row.push(format!(
                        "{:.3} / {:.3}",
                        values.iter().map(|v| v.0).sum::<f64>() / n,
                        values.iter().map(|v| v.1).sum::<f64>() / n
                    ));
                }
            }
            table.push(row);
        }
        out += &table.render(Format::Markdown);
    }
    out
}

/// Where the lost mass went at the heatmap budget (else the middle budget): per policy, the mean
/// over traces of each region's and each time's share of the attention not kept. Empty when a run
/// was stored before it was measured.
fn lost_section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    let budget = experiment
        .heatmap_budget
        .unwrap_or(experiment.budgets[experiment.budgets.len() / 2]);
    let of = |name: &String| -> Vec<&StoredRun> {
        trace_names
            .iter()
            .filter_map(|t| find_run(runs, name, budget, t))
            .collect()
    };
    let Some(first) = names.iter().flat_map(of).next() else {
        return String::new();
    };
    if runs.iter().any(|r| r.report.lost.is_empty()) {
        return String::new();
    }
    let mut headers = vec!["policy".to_string(), "lost".to_string()];
    headers.extend(first.report.lost.iter().map(|(name, _)| name.clone()));
    let mut table = Table::with_headers(headers);
    let regions = first.report.lost.len() - crate::replay::metrics::lost::WHEN.len();
    for name in names {
        let runs = of(name);
        if runs.is_empty() {
            continue;
        }
        let n = runs.len() as f64;
        let means: Vec<f64> = (0..first.report.lost.len())
            .map(|index| runs.iter().map(|r| r.report.lost[index].1).sum::<f64>() / n)
            .collect();
        let mut row = vec![
            name.clone(),
            format!("{:.4}", means[..regions].iter().sum::<f64>()),
        ];
        row.extend(means.iter().map(|m| format!("{m:.4}")));
        table.push(row);
    }
    format!(
        "\nWhere the lost mass went at budget {budget} (mean over traces, layers, heads and steps of the share of the full attention not kept), by region — the first 4 positions, each span, the 32 positions up to the query, the rest — and by when it left the cache:\n\n{}",
        table.render(Format::Markdown)
    )
}

/// The retained-mass-vs-budget and per-layer schedule figures; returns their files.
fn figures_of_runs(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
    mass_series: &[Series],
    files: &FigureFiles<'_>,
) -> Result<Vec<PathBuf>, SweepError> {
    let mut figures = line_chart(
        &files.stem("retained_mass_vs_budget"),
        &format!("{}: retained attention mass", experiment.name),
        "budget (tokens per cache)",
        "mean retained mass",
        mass_series,
        true,
    )?;
    let middle = experiment.budgets[experiment.budgets.len() / 2];
    let schedules: Vec<Series> = names
        .iter()
        .filter_map(|name| find_run(runs, name, middle, &trace_names[0]).map(|r| (name, r)))
        .map(|(name, run)| {
            let points = run
                .report
                .layer_kept
                .iter()
                .enumerate()
                .map(|(l, k)| (l as f64, *k))
                .collect();
            (name.clone(), points)
        })
        .collect();
    figures.extend(line_chart(
        &files.stem("schedules"),
        &format!("mean kept tokens per layer at budget {middle}"),
        "layer",
        "mean kept tokens per cache",
        &schedules,
        false,
    )?);
    Ok(figures)
}

/// The per-layer attention entropy of each trace's last `window` prompt queries, and its figure.
fn entropy_section(
    traces: &[TraceFile],
    window: usize,
    files: &FigureFiles<'_>,
) -> Result<String, SweepError> {
    let entropy = traces
        .iter()
        .map(|trace| {
            let reader = TraceReader::open(&trace.path).map_err(PolicyError::from)?;
            let profile = entropy_profile(&reader, window).map_err(PolicyError::from)?;
            Ok((trace.path.clone(), profile))
        })
        .collect::<Result<Vec<_>, SweepError>>()?;
    let mut out = "\nAttention entropy of the last prompt queries over the prompt, per layer (nats; normalised = / ln(keys attended)):\n\n".to_string();
    let stem = |trace: &Path| {
        trace
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned()
    };
    let hybrid = entropy[0].1.iter().any(|row| row.window > 0);
    let mut headers = vec!["layer".to_string()];
    if hybrid {
        headers.push("attends over".into());
    }
    for (trace, _) in &entropy {
        headers.push(format!("{} entropy", stem(trace)));
        headers.push(format!("{} normalised", stem(trace)));
    }
    let mut table = Table::with_headers(headers);
    for (row_index, first) in entropy[0].1.iter().enumerate() {
        let mut row = vec![first.layer.to_string()];
        if hybrid {
            row.push(layer_kind(first.window));
        }
        for (_, profile) in &entropy {
            row.push(format!("{:.3}", profile[row_index].entropy));
            row.push(format!("{:.3}", profile[row_index].normalized));
        }
        table.push(row);
    }
    out += &table.render(Format::Markdown);
    let series: Vec<Series> = entropy
        .iter()
        .map(|(trace, profile)| {
            (
                stem(trace),
                profile
                    .iter()
                    .map(|l| (l.layer as f64, l.entropy))
                    .collect(),
            )
        })
        .collect();
    let figures = line_chart(
        &files.stem("entropy"),
        "attention entropy per layer",
        "layer",
        "entropy (nats)",
        &series,
        false,
    )?;
    out += &format!(
        "\nFigure: {}.\n",
        figures
            .iter()
            .map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(out)
}
