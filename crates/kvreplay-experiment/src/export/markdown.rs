//! Markdown: the summary table, where the lost mass went, then one per-layer table per report.

use super::{layer_table, lost_table, summary_table, Exporter, Format};
use crate::replay::ReplayReport;

/// GitHub-flavoured markdown tables.
pub struct Markdown;

impl Exporter for Markdown {
    fn export(&self, reports: &[ReplayReport], per_layer: bool) -> String {
        let mut out = summary_table(reports).render(Format::Markdown);
        out += "\nWhere the lost mass went (share of the full attention not kept, by region: the first 4 positions, each span, the 32 positions up to the query, the rest; and by when it left: cut at the prompt's end, evicted while the prompt streamed in, evicted while decoding, or held but not read by a re-selecting policy):\n\n";
        out += &lost_table(reports).render(Format::Markdown);
        if per_layer {
            for report in reports {
                out += &format!("\nPer layer, {}:\n\n", report.policy);
                out += &layer_table(report).render(Format::Markdown);
            }
        }
        out
    }
}
