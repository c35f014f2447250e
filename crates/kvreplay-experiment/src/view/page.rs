//! A [`View`] as one self-contained HTML page: the data as JSON in a `<script>` element, the
//! drawing code and styles inlined (`page.js`, `page.css`, written for kvreplay: no library, no
//! server, no network). The page draws a layer x position map of what each policy kept, the full
//! cache's attention mass beside it, the spans, a step slider where a policy chooses again while
//! decoding, a difference map for two policies, and per-layer tables.
//!
//! Opened with `#readback`, the page also writes the kept cells it decoded from its own data into
//! `<pre id="readback">`, so a test in a headless browser can check them against the library's.

use super::View;
use base64::Engine;
use serde::Serializer;

const TEMPLATE: &str = include_str!("page.html");
const SCRIPT: &str = include_str!("page.js");
const STYLE: &str = include_str!("page.css");

/// The largest page [`html`] writes for a model of up to 64 layers, whatever the trace's length:
/// the kept cells are at most 3 MiB as bits (4 MiB in base64) or 1 MiB binned, the full cache's
/// mass at most 64 layers x 2,048 bins of a short number, the texts 2,048 of 80 characters.
pub const MAX_PAGE_BYTES: usize = 8 << 20;

/// The page of `view`, titled `title`.
pub fn html(view: &View, title: &str) -> String {
    let data = serde_json::to_string(view).expect("a view serialises");
    TEMPLATE
        .replace("{{title}}", &escape(title))
        .replace("{{style}}", STYLE)
        .replace("{{script}}", SCRIPT)
        .replace("{{data}}", &data.replace("</", "<\\/"))
}

/// Bytes as base64 (the kept cells, one byte each).
pub fn base64<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// `text` safe inside HTML.
pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
