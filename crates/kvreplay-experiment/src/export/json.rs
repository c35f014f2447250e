//! JSON: the reports as they are (one object for one report, an array for several), per-layer
//! arrays included; `retained_mass`, `topk_recall`, `output_error`, `mean_kept`, `kv_entries` and `kv_bytes` at the top.

use super::Exporter;
use crate::replay::ReplayReport;

/// Pretty-printed JSON.
pub struct Json;

impl Exporter for Json {
    fn export(&self, reports: &[ReplayReport], _per_layer: bool) -> String {
        let text = match reports {
            [single] => serde_json::to_string_pretty(single),
            many => serde_json::to_string_pretty(many),
        };
        text.expect("reports serialise") + "\n"
    }
}
