//! Markdown: the summary table, then one per-layer table per report.

use super::{layer_table, summary_table, Exporter, Format};
use crate::replay::ReplayReport;

/// GitHub-flavoured markdown tables.
pub struct Markdown;

impl Exporter for Markdown {
    fn export(&self, reports: &[ReplayReport], per_layer: bool) -> String {
        let mut out = summary_table(reports).render(Format::Markdown);
        if per_layer {
            for report in reports {
                out += &format!("\nPer layer, {}:\n\n", report.policy);
                out += &layer_table(report).render(Format::Markdown);
            }
        }
        out
    }
}
