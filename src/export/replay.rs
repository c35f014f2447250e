//! Tables of replay results: one summary row per policy, and a per-layer breakdown.

use super::Table;
use crate::replay::ReplayReport;

fn fixed(value: f64) -> String {
    format!("{value:.4}")
}

/// The columns every table shares: mean kept, retained mass, top-k recall, output error.
fn metric_cells(mean_kept: f64, retained: f64, recall: f64, error: Option<f64>) -> [String; 4] {
    [
        format!("{mean_kept:.1}"),
        fixed(retained),
        fixed(recall),
        error.map_or("n/a".into(), fixed),
    ]
}

/// One row per report: the overall figures, and the needle's survival when the trace has one.
pub fn summary_table(reports: &[ReplayReport]) -> Table {
    let span_names: Vec<String> = reports
        .first()
        .map(|r| r.spans.iter().map(|s| s.name.clone()).collect())
        .unwrap_or_default();
    let mut headers: Vec<String> = [
        "policy",
        "budget",
        "mean kept",
        "retained mass",
        "top-k recall",
        "output error",
    ]
    .iter()
    .map(|h| h.to_string())
    .collect();
    for name in &span_names {
        headers.push(format!("{name} kept"));
        headers.push(format!("{name} mass kept/full"));
    }
    let mut table = Table::with_headers(headers);
    for report in reports {
        let mut row = vec![report.policy.clone(), report.nominal_budget.to_string()];
        row.extend(metric_cells(
            report.mean_kept,
            report.retained_mass,
            report.topk_recall,
            report.output_error,
        ));
        for span in &report.spans {
            row.push(fixed(span.kept_fraction));
            row.push(format!("{:.4}/{:.4}", span.kept_mass, span.full_mass));
        }
        table.push(row);
    }
    table
}

/// One row per layer of one report.
pub fn layer_table(report: &ReplayReport) -> Table {
    let mut table = Table::new([
        "layer",
        "budget",
        "mean kept",
        "retained mass",
        "top-k recall",
        "output error",
    ]);
    for layer in &report.layers {
        let mut row = vec![layer.layer.to_string(), layer.budget.to_string()];
        row.extend(metric_cells(
            layer.mean_kept,
            layer.retained_mass,
            layer.topk_recall,
            layer.output_error,
        ));
        table.push(row);
    }
    table
}
