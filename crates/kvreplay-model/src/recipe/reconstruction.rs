//! KVzip's reconstruction pass, as a recipe asks for it (`reconstruction = "kvzip"`, with
//! `reconstruction_chunk`, default 2048): the rows a capture runs after the cut and records
//! (`docs/trace-format.md`, "Reconstruction pass"), laid out as kvpress 0.5.5's `KVzipPress`
//! lays them out (`kvpress/presses/kvzip_press.py`, `__call__` lines 95-114 and `prepare` lines
//! 185-226):
//!
//! - the context is `[prefix, cut)`: `prefix` is the length of the chat template's opening (its
//!   default system turn and the user header, as the template gives it for a dummy message; 0 for
//!   a model without one), the cut where the `question` span starts (the question-agnostic cut),
//!   or the prompt's end when the prompt has no question;
//! - it is split into chunks of `reconstruction_chunk` tokens; chunk 0's rows are
//!   `"\n\nRepeat the previous context exactly."`, chunk i's are `"\n\nRepeat the part of the
//!   previous context exactly, starting with"` and the last 8 tokens of chunk i − 1; then the
//!   template's closing of the user turn (ChatML's `<|im_end|>\n<|im_start|>assistant\n`, or
//!   `"\n"` without a template), then the chunk's own tokens.

use super::RecipeError;
use crate::model::{Template, TextTokenizer};
use crate::trace::{Chunk, Reconstruction};
use std::path::Path;

/// The recipe keys.
const KEY: &str = "reconstruction";
const CHUNK_KEY: &str = "reconstruction_chunk";

/// kvpress's `chunk_size` default.
pub const DEFAULT_CHUNK: usize = 2048;

/// Tokens of the chunk before that a later chunk's instruction repeats (`prev_postfix_size`).
const POSTFIX: usize = 8;

/// A reconstruction pass ready to run: its chunks, and each chunk's row ids.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedPass {
    /// The chunks, as the trace records them.
    pub pass: Reconstruction,
    /// Each chunk's rows.
    pub rows: Vec<Vec<u32>>,
}

impl PlannedPass {
    /// Every chunk's row ids, one chunk after another.
    pub fn token_ids(&self) -> Vec<i64> {
        self.rows.iter().flatten().map(|&id| id as i64).collect()
    }
}

/// The chunk size of the pass recipe `table` asks for (`None`: no pass), its keys taken out of
/// the table; an error names the key and its rule.
pub(super) fn take_options(
    table: &mut toml::Table,
    path: &Path,
) -> Result<Option<usize>, RecipeError> {
    let invalid = |field: &'static str, rule: &str| RecipeError::Invalid {
        path: path.to_owned(),
        field,
        rule: rule.to_owned(),
    };
    let method = table.remove(KEY);
    let chunk = table.remove(CHUNK_KEY);
    match method {
        None if chunk.is_some() => Err(invalid(CHUNK_KEY, "needs `reconstruction = \"kvzip\"`")),
        None => Ok(None),
        Some(toml::Value::String(name)) if name == "kvzip" => match chunk {
            None => Ok(Some(DEFAULT_CHUNK)),
            Some(value) => value
                .as_integer()
                .filter(|n| *n > 0)
                .map(|n| Some(n as usize))
                .ok_or_else(|| invalid(CHUNK_KEY, "must be a positive whole number")),
        },
        Some(_) => Err(invalid(KEY, "the one pass recorded is \"kvzip\"")),
    }
}

/// The chunk size of the reconstruction pass recipe file `path` asks for, if any.
pub fn pass_chunk(path: &Path) -> Result<Option<usize>, RecipeError> {
    let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Io {
        path: path.to_owned(),
        source,
    })?;
    take_options(&mut super::table_of(&text, path)?, path)
}

/// Where the pass of a prompt of `ids` with spans `spans` cuts: where its `question` starts, or
/// its end.
pub fn cut_of(ids: &[u32], spans: &[crate::trace::Span]) -> usize {
    spans
        .iter()
        .find(|span| span.name == "question")
        .map_or(ids.len(), |span| span.start)
}

/// The pass over `ids[prefix..cut]` in chunks of `chunk` tokens, `prefix` the tokenizer's
/// template opening; an error when the context is empty.
pub fn plan(
    ids: &[u32],
    cut: usize,
    tokenizer: &dyn TextTokenizer,
    chunk: usize,
) -> Result<PlannedPass, String> {
    let (prefix, closing) = match tokenizer.template() {
        Template::Chat(chat) => {
            let (opening, closing) = chat.user_turn();
            (tokenizer.encode(opening).len(), tokenizer.encode(closing))
        }
        Template::Plain => (0, tokenizer.encode("\n")),
    };
    if cut <= prefix || cut > ids.len() {
        return Err(format!(
            "the reconstruction pass repeats positions [{prefix}, {cut}) of a {}-token prompt: nothing to repeat",
            ids.len()
        ));
    }
    let context = &ids[prefix..cut];
    let pieces: Vec<&[u32]> = context.chunks(chunk.max(1)).collect();
    let (mut chunks, mut rows) = (Vec::new(), Vec::new());
    let mut start = prefix;
    for (index, piece) in pieces.iter().enumerate() {
        let mut row = match index {
            0 => tokenizer.encode("\n\nRepeat the previous context exactly."),
            _ => {
                let before = pieces[index - 1];
                let mut row = tokenizer
                    .encode("\n\nRepeat the part of the previous context exactly, starting with");
                row.extend_from_slice(&before[before.len().saturating_sub(POSTFIX)..]);
                row
            }
        };
        row.extend_from_slice(&closing);
        row.extend_from_slice(piece);
        chunks.push(Chunk {
            context: start..start + piece.len(),
            rows: row.len(),
        });
        rows.push(row);
        start += piece.len();
    }
    Ok(PlannedPass {
        pass: Reconstruction { chunks },
        rows,
    })
}
