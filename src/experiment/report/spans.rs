//! Span survival: the share of each span's tokens and attention each policy keeps.

use super::*;

/// One table per named span of the traces: tokens kept / mass kept.
pub(super) fn span_sections(
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
