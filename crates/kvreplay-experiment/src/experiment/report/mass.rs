//! Retained mass per policy and budget with intervals and real memory, overall and per model.

use super::*;
use crate::capture::shared_context;
use crate::experiment::intervals::{mean_interval, Prompts};
use crate::experiment::store::prompts_of;

/// The retained-mass table (mean ± CI, KV entries per layer) and its series for the figure.
pub(super) fn mass_section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
    traces: &[TraceFile],
) -> (String, Vec<Series>) {
    let prompts = Prompts::of(trace_names.iter().map(|t| shared_context(t)));
    let mut out = match prompts.count() {
        1 => "Mean retained mass of the one prompt (no interval: an interval over prompts needs two or more), KV entries stored per layer in brackets (mean over layers and decode steps; one unit for every cache layout, so equal numbers are equal memory):\n\n".to_string(),
        _ => format!(
            "Mean retained mass ± 95% CI half-width (Student t over the per-prompt means of {} prompts; the questions asked of one context are one prompt), KV entries stored per layer in brackets (mean over layers and decode steps; one unit for every cache layout, so equal numbers are equal memory):\n\n",
            prompts.count()
        ),
    };
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
            let mass: Vec<f64> = per_trace
                .iter()
                .map(|r| r.report.metric(RETAINED_MASS).unwrap_or(f64::NAN))
                .collect();
            let interval = mean_interval(&mass, &prompts_of(per_trace.iter().copied()));
            let entries = per_trace.iter().map(|r| kv_entries(r, traces)).sum::<f64>()
                / per_trace.len() as f64;
            row.push(format!("{} ({entries:.0})", unsigned(&interval)));
            points.push((budget.position(), interval.estimate));
        }
        table.push(row);
        mass_series.push((name.clone(), points));
    }
    out += &table.render(Format::Markdown);
    (out, mass_series)
}

/// The models side by side: per policy, one row per model with its mean retained mass over its
/// traces at each budget (± 95% CI with more than one trace).
pub(super) fn model_section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    models: &[(String, Vec<TraceFile>)],
) -> String {
    let mut out = "Models side by side (the trace header's `model`, with its number of traces): mean retained mass over each model's traces, ± 95% CI (Student t over per-prompt means; the questions asked of one context are one prompt) where it has two prompts or more. On a model with sliding-window layers only its global layers are compressed and measured; the others keep their window. Each model's part below has the full tables.\n\n".to_string();
    let mut headers = vec!["policy".to_string(), "model".to_string()];
    headers.extend(experiment.budgets.iter().map(Budget::header));
    let mut table = Table::with_headers(headers);
    for name in names {
        for (model, traces) in models {
            let mut row = vec![name.clone(), format!("{model} ({})", traces.len())];
            for &budget in &experiment.budgets {
                let of: Vec<(&StoredRun, f64)> = traces
                    .iter()
                    .filter_map(|t| find_run(runs, name, budget, &t.path.display().to_string()))
                    .filter_map(|r| Some((r, r.report.metric(RETAINED_MASS)?)))
                    .collect();
                let values: Vec<f64> = of.iter().map(|&(_, value)| value).collect();
                row.push(match values.len() {
                    0 => "—".into(),
                    _ => unsigned(&mean_interval(
                        &values,
                        &prompts_of(of.iter().map(|&(r, _)| r)),
                    )),
                });
            }
            table.push(row);
        }
    }
    out += &table.render(Format::Markdown);
    out
}
