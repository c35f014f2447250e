//! CSV: the summary rows; with the per-layer breakdown, one row per (policy, layer) instead.

use super::{layer_table, summary_table, Exporter, Format, Table};
use crate::replay::ReplayReport;

/// RFC 4180 CSV.
pub struct Csv;

impl Exporter for Csv {
    fn export(&self, reports: &[ReplayReport], per_layer: bool) -> String {
        if !per_layer {
            return summary_table(reports).render(Format::Csv);
        }
        let mut combined: Option<Table> = None;
        for report in reports {
            let layers = layer_table(report).prefixed("policy", &report.policy);
            match combined.as_mut() {
                None => combined = Some(layers),
                Some(table) => table.append(layers),
            }
        }
        combined.map(|t| t.render(Format::Csv)).unwrap_or_default()
    }
}
