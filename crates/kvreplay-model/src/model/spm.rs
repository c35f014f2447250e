//! The SentencePiece-style tokenizer of GGUF models whose `tokenizer.ggml.model` is `llama`
//! (Gemma 3): llama.cpp's `llm_tokenizer_spm` (llama-vocab.cpp), rebuilt from the GGUF's tokens,
//! scores and token types.
//!
//! Rule: control (type 3) and user-defined (type 4) tokens written in the text are matched first,
//! longest leftmost (user-defined ones are runs of newlines, spaces and tabs and some HTML tags);
//! in the rest, spaces become `▁` (no space prefix when `add_space_prefix` is false, as for Gemma
//! 3), the text is split into characters, and adjacent symbols are merged while the merged text is
//! a token, the highest-scoring merge first (leftmost on ties); a final symbol that is not a token
//! is split back along its merges, and characters not in the vocabulary become their UTF-8 bytes
//! (`<0xNN>` tokens). Checked id for id against transformers' tokenizer of the same GGUF.
//!
//! A GGUF with a chat template (an instruction-tuned Gemma) is prompted through it
//! ([`ChatTemplate`]), generation stopping at the control token it writes after an answer
//! (`<end_of_turn>`); one without (Gemma 3 270M, a base model) as plain text after BOS.

use super::chat_template::{self, ChatTemplate};
use super::gguf::{GgufFile, BOS_KEY, EOS_KEY};
use super::prompt::{Template, TextTokenizer};
use super::ModelError;
use candle_core::quantized::gguf_file::Value;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// A SentencePiece-style tokenizer with byte fallback.
pub struct SpmTokenizer {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    ids: HashMap<String, u32>,
    /// Control and user-defined tokens by their first byte, longest first.
    specials: Vec<Vec<(String, u32)>>,
    bytes: [u32; 256],
    bos: Option<u32>,
    stop: u32,
    /// The GGUF's chat template: an instruction-tuned Gemma's; a base model (Gemma 3 270M) has
    /// none and is prompted as plain text.
    chat: Option<ChatTemplate>,
}

/// A merge candidate: two adjacent symbols whose joined text is a token.
#[derive(PartialEq)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A symbol of the text being merged: a byte range, linked to its neighbours.
#[derive(Clone)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SpmTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let fail = |detail: String| ModelError::Tokenizer {
            path: gguf.path.clone(),
            detail,
        };
        let tokens = gguf.strings("tokenizer.ggml.tokens")?;
        let numbers = |key: &str| -> Vec<f64> {
            gguf.value(key)
                .and_then(|v| v.to_vec().ok())
                .map(|values| values.iter().map(number).collect())
                .unwrap_or_default()
        };
        let scores: Vec<f32> = numbers("tokenizer.ggml.scores")
            .into_iter()
            .map(|s| s as f32)
            .collect();
        let types: Vec<i32> = numbers("tokenizer.ggml.token_type")
            .into_iter()
            .map(|t| t as i32)
            .collect();
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(fail(format!(
                "{} tokens but {} scores and {} token types",
                tokens.len(),
                scores.len(),
                types.len()
            )));
        }
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, token)| (token.clone(), id as u32))
            .collect();
        let mut specials: Vec<Vec<(String, u32)>> = vec![Vec::new(); 256];
        for (id, token) in tokens.iter().enumerate() {
            if let (CONTROL | USER_DEFINED, Some(&first)) = (types[id], token.as_bytes().first()) {
                specials[first as usize].push((token.clone(), id as u32));
            }
        }
        for list in specials.iter_mut() {
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        let mut bytes = [0u32; 256];
        for (byte, slot) in bytes.iter_mut().enumerate() {
            let name = format!("<0x{byte:02X}>");
            *slot = *ids
                .get(&name)
                .ok_or_else(|| fail(format!("no byte token {name}")))?;
        }
        let token_id = |key: &str| gguf.usize_value(key).ok().map(|id| id as u32);
        let add_bos = gguf
            .value("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(true);
        let chat = chat_template::of_gguf(gguf, &tokens)?;
        let mut tokenizer = Self {
            bos: token_id(BOS_KEY).filter(|_| add_bos),
            stop: token_id(EOS_KEY).ok_or_else(|| fail(format!("no {EOS_KEY}")))?,
            chat: None,
            tokens,
            scores,
            types,
            ids,
            specials,
            bytes,
        };
        let encode = |text: &str| tokenizer.encode(text);
        let is_control = |id: u32| tokenizer.types.get(id as usize) == Some(&CONTROL);
        let stop =
            chat_template::stop_token(chat.as_ref(), encode, is_control, Some(tokenizer.stop));
        tokenizer.stop = stop.unwrap_or(tokenizer.stop);
        tokenizer.chat = chat;
        Ok(tokenizer)
    }

    /// The special token written at `text[at..]`, longest first.
    fn special_at(&self, text: &str, at: usize) -> Option<(usize, u32)> {
        self.specials[text.as_bytes()[at] as usize]
            .iter()
            .find(|(token, _)| text[at..].starts_with(token.as_str()))
            .map(|(token, id)| (token.len(), *id))
    }

    /// Ids of a piece of text with no special token in it.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let text = text.replace(' ', "\u{2581}");
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: None,
                next: None,
            })
            .collect();
        let n = symbols.len();
        for (index, symbol) in symbols.iter_mut().enumerate() {
            symbol.prev = index.checked_sub(1);
            symbol.next = (index + 1 < n).then_some(index + 1);
        }
        let mut queue = BinaryHeap::new();
        let mut merges: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
        for left in 1..n {
            self.push_bigram(&text, &symbols, left - 1, left, &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (left, right) = (bigram.left, bigram.right);
            if symbols[left].len == 0
                || symbols[right].len == 0
                || symbols[left].len + symbols[right].len != bigram.len
            {
                continue;
            }
            let (start, left_len, right_len) =
                (symbols[left].start, symbols[left].len, symbols[right].len);
            merges.insert((start, left_len + right_len), (left_len, right_len));
            symbols[left].len += right_len;
            symbols[right].len = 0;
            symbols[left].next = symbols[right].next;
            if let Some(next) = symbols[right].next {
                symbols[next].prev = Some(left);
            }
            if let Some(prev) = symbols[left].prev {
                self.push_bigram(&text, &symbols, prev, left, &mut queue);
            }
            if let Some(next) = symbols[left].next {
                self.push_bigram(&text, &symbols, left, next, &mut queue);
            }
        }
        let mut index = Some(0);
        while let Some(at) = index {
            let symbol = &symbols[at];
            self.resegment(&text, symbol.start, symbol.len, &merges, out);
            index = symbol.next;
        }
    }

    fn push_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let start = symbols[left].start;
        let len = symbols[left].len + symbols[right].len;
        if let Some(&id) = self.ids.get(&text[start..start + len]) {
            queue.push(Bigram {
                left,
                right,
                score: self.scores[id as usize],
                len,
            });
        }
    }

    fn resegment(
        &self,
        text: &str,
        start: usize,
        len: usize,
        merges: &HashMap<(usize, usize), (usize, usize)>,
        out: &mut Vec<u32>,
    ) {
        let piece = &text[start..start + len];
        if let Some(&id) = self.ids.get(piece) {
            out.push(id);
        } else if let Some(&(left, right)) = merges.get(&(start, len)) {
            self.resegment(text, start, left, merges, out);
            self.resegment(text, start + left, right, merges, out);
        } else {
            out.extend(piece.bytes().map(|byte| self.bytes[byte as usize]));
        }
    }
}

impl TextTokenizer for SpmTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut plain_start = 0;
        let mut at = 0;
        while at < text.len() {
            match self.special_at(text, at) {
                Some((len, id)) => {
                    self.encode_plain(&text[plain_start..at], &mut ids);
                    ids.push(id);
                    at += len;
                    plain_start = at;
                }
                None => at += text[at..].chars().next().map_or(1, char::len_utf8),
            }
        }
        self.encode_plain(&text[plain_start..], &mut ids);
        ids
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(token) = self.tokens.get(id as usize) else {
                continue;
            };
            if self.types[id as usize] == BYTE {
                bytes.extend(u8::from_str_radix(&token[3..5], 16).ok());
            } else {
                bytes.extend_from_slice(token.replace('\u{2581}', " ").as_bytes());
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn stop_token(&self) -> u32 {
        self.stop
    }

    fn bos(&self) -> Option<u32> {
        self.bos
    }

    fn template(&self) -> Template<'_> {
        match &self.chat {
            Some(chat) => Template::Chat(chat),
            None => Template::Plain,
        }
    }
}

/// A GGUF number as `f64` (0 for any other value), read off its variant: candle's accessors build
/// an error message for every value of another type, a second's work for a 262K vocabulary.
fn number(value: &Value) -> f64 {
    match value {
        Value::F32(x) => f64::from(*x),
        Value::I32(x) => f64::from(*x),
        _ => 0.0,
    }
}
