//! Turning results into text: one [`Exporter`] trait with an implementation per format
//! (markdown, CSV, JSON), in the manner of hyperfine's exporters, over one [`Table`] type.
//! Numbers are formatted here and nowhere else.

mod csv;
mod json;
mod live;
mod markdown;
mod methods;
mod replay;
mod table;

pub use csv::Csv;
pub use json::Json;
pub use live::{live_questions_table, live_table};
pub use markdown::Markdown;
pub use methods::methods_markdown;
pub use replay::{layer_table, lost_table, summary_table};
pub use table::{Format, Table};

use crate::replay::ReplayReport;

/// Renders replay reports.
pub trait Exporter {
    /// The text of `reports`; `per_layer` adds each report's layer breakdown.
    fn export(&self, reports: &[ReplayReport], per_layer: bool) -> String;
}

/// The exporter for a format.
pub fn exporter(format: Format) -> Box<dyn Exporter> {
    match format {
        Format::Markdown => Box::new(Markdown),
        Format::Csv => Box::new(Csv),
        Format::Json => Box::new(Json),
    }
}
use crate::replay::entropy_profile;
use crate::trace::layer_kind;
use crate::trace::{TraceError, TraceReader};

/// The report of `kvreplay inspect`: header, spans, sizes, and the per-layer entropy table.
pub fn inspect_markdown(trace: &TraceReader, window: usize) -> Result<String, TraceError> {
    let meta = trace.meta();
    let n_positions = trace.n_positions();
    let mut out = format!("# {}\n\n", trace.path().display());
    let mut header = Table::new(["field", "value"]);
    header.push(["model".into(), meta.model.clone()]);
    header.push([
        "layers × heads (kv heads) × head_dim".into(),
        format!(
            "{} × {} ({}) × {}",
            meta.n_layers, meta.n_heads, meta.n_kv_heads, meta.head_dim
        ),
    ]);
    header.push(["attention".into(), crate::trace::layer_kinds(meta)]);
    header.push(["positions T".into(), n_positions.to_string()]);
    header.push(["prompt_len".into(), meta.prompt_len.to_string()]);
    header.push([
        "generated".into(),
        (n_positions - meta.prompt_len).to_string(),
    ]);
    header.push(["scale".into(), format!("{:.6}", meta.scale)]);
    header.push([
        "softcap".into(),
        meta.softcap.map_or("none".into(), |cap| cap.to_string()),
    ]);
    header.push(["storage".into(), trace.storage_dtype()]);
    header.push(["values stored".into(), trace.has_values().to_string()]);
    if let Some(d_model) = trace.d_model() {
        let what = match trace.qk_norm_eps() {
            Some(eps) => format!(
                "hidden states (d_model {d_model}), q/k/v/o projections and per-head q/k norms (ε {eps:e})"
            ),
            None => format!("hidden states (d_model {d_model}) and q/k/v/o projections"),
        };
        header.push(["attention inputs".into(), what]);
    }
    if let Some(pass) = trace.reconstruction() {
        let what = format!(
            "KVzip's, positions {}..{} in {} chunk(s), {} rows",
            pass.start(),
            pass.cut(),
            pass.chunks.len(),
            pass.rows()
        );
        header.push(["reconstruction pass".into(), what]);
    }
    header.push([
        "file size".into(),
        format!("{:.1} MB", trace.file_len() as f64 / 1e6),
    ]);
    for (key, value) in &meta.extra {
        if key == "generated_text" || key == "source" {
            header.push([key.clone(), format!("{value:?}")]);
        }
    }
    out += &header.render(Format::Markdown);
    if !meta.spans.is_empty() {
        let mut spans = Table::new(["span", "start", "end", "tokens"]);
        for span in &meta.spans {
            spans.push([
                span.name.clone(),
                span.start.to_string(),
                span.end.to_string(),
                (span.end - span.start).to_string(),
            ]);
        }
        out += "\n";
        out += &spans.render(Format::Markdown);
    }
    let window = window.min(meta.prompt_len);
    out += &format!(
        "\nAttention entropy of the last {window} prompt queries over the prompt (nats; normalized = / ln(keys)), mean over query heads:\n\n"
    );
    let profile = entropy_profile(trace, window)?;
    let hybrid = profile.iter().any(|row| row.window > 0);
    let mut headers: Vec<String> = ["layer", "entropy", "normalized"]
        .map(String::from)
        .to_vec();
    if hybrid {
        headers.push("attends over".into());
    }
    let mut entropy = Table::with_headers(headers);
    for row in profile {
        let mut cells = vec![
            row.layer.to_string(),
            format!("{:.3}", row.entropy),
            format!("{:.3}", row.normalized),
        ];
        if hybrid {
            cells.push(layer_kind(row.window));
        }
        entropy.push(cells);
    }
    out += &entropy.render(Format::Markdown);
    Ok(out)
}
