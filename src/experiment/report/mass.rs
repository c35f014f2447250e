//! Retained mass per policy and budget with intervals and real memory, overall and per model.

use super::*;

/// The retained-mass table (mean ± CI, KV entries per layer) and its series for the figure.
pub(super) fn mass_section(
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
            points.push((budget.position(), mean));
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
    let mut out = "Models side by side (the trace header's `model`, with its number of traces): mean retained mass over each model's traces, ± 95% CI (Student t over per-trace means) where it has several. On a model with sliding-window layers only its global layers are compressed and measured; the others keep their window. Each model's part below has the full tables.\n\n".to_string();
    let mut headers = vec!["policy".to_string(), "model".to_string()];
    headers.extend(experiment.budgets.iter().map(Budget::header));
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
