//! Tables of replay results: one summary row per policy, and a per-layer breakdown. The metric
//! columns come from the metrics registry, in its order.

use super::Table;
use crate::replay::metrics::REGISTRY;
use crate::replay::ReplayReport;
use std::collections::BTreeMap;

fn fixed(value: f64) -> String {
    format!("{value:.4}")
}

/// The headers every table shares after its first columns: mean kept per cache, KV entries per
/// layer that a decode step reads and that the cache holds (one unit for every layout; they
/// differ for dynamic sparse attention, which reads part of a cache it keeps whole), the bytes a
/// layer's caches hold (at the trace's width, or as a quantizer stores them), then each metric.
fn metric_headers(first: &[&str]) -> Vec<String> {
    let mut headers: Vec<String> = first.iter().map(|h| h.to_string()).collect();
    headers.push("mean kept".into());
    headers.push("KV read/layer".into());
    headers.push("KV held/layer".into());
    headers.push("KiB/layer".into());
    headers.extend(REGISTRY.iter().map(|metric| metric.title().to_string()));
    headers
}

/// The cells of those columns: `n/a` for a metric not measured.
fn metric_cells(
    mean_kept: f64,
    (read, held, bytes): (f64, f64, f64),
    metrics: &BTreeMap<String, f64>,
) -> Vec<String> {
    let mut cells = vec![
        format!("{mean_kept:.1}"),
        format!("{read:.1}"),
        format!("{held:.1}"),
        format!("{:.1}", bytes / 1024.0),
    ];
    cells.extend(
        REGISTRY
            .iter()
            .map(|metric| metrics.get(metric.id()).map_or("n/a".into(), |v| fixed(*v))),
    );
    cells
}

/// One row per report: the overall figures, and the needle's survival when the trace has one.
pub fn summary_table(reports: &[ReplayReport]) -> Table {
    let span_names: Vec<String> = reports
        .first()
        .map(|r| r.spans.iter().map(|s| s.name.clone()).collect())
        .unwrap_or_default();
    let mut headers = metric_headers(&["policy", "budget"]);
    for name in &span_names {
        headers.push(format!("{name} kept"));
        headers.push(format!("{name} mass kept/full"));
    }
    let mut table = Table::with_headers(headers);
    for report in reports {
        let mut row = vec![report.policy.clone(), report.nominal_budget.to_string()];
        row.extend(metric_cells(
            report.mean_kept,
            (report.kv_entries, report.held_entries, report.kv_bytes),
            &report.metrics,
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
    let mut table = Table::with_headers(metric_headers(&["layer", "budget"]));
    for layer in &report.layers {
        let mut row = vec![layer.layer.to_string(), layer.budget.to_string()];
        row.extend(metric_cells(
            layer.mean_kept,
            (layer.kv_entries, layer.held_entries, layer.kv_bytes),
            &layer.metrics,
        ));
        table.push(row);
    }
    table
}

/// Where each report's lost mass went: the share of the full attention not kept, split by region
/// of the context and by when it left the cache (`replay::metrics::lost`), means over layers,
/// query heads and decode steps.
pub fn lost_table(reports: &[ReplayReport]) -> Table {
    let mut headers = vec!["policy".to_string(), "lost".to_string()];
    if let Some(first) = reports.first() {
        headers.extend(first.lost_by_region.iter().map(|s| s.name.clone()));
        headers.extend(first.lost_by_when.iter().map(|s| s.name.clone()));
    }
    let mut table = Table::with_headers(headers);
    for report in reports {
        let lost: f64 = report.lost_by_region.iter().map(|s| s.mass).sum();
        let mut row = vec![report.policy.clone(), fixed(lost)];
        row.extend(
            report
                .lost_by_region
                .iter()
                .chain(&report.lost_by_when)
                .map(|s| fixed(s.mass)),
        );
        table.push(row);
    }
    table
}
