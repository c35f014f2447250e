//! The byte-level BPE tokenizer, rebuilt from the GGUF's own vocabulary and merges, with the
//! GGUF's own chat template.
//!
//! The pre-tokenizer is the one `tokenizer.ggml.pre` names, as llama.cpp's `llama-vocab.cpp` and
//! transformers' GGUF converter (`integrations/gguf/gguf_tokenizer_mapping.py`,
//! `GGUF_PRE_TOKENIZER_SPLITS`) build it: `smollm` splits individual digits, then GPT-2
//! byte-level splitting without a prefix space; `qwen2` (and `deepseek-r1-qwen`) split with
//! Qwen2's regular expression (letters with one leading non-letter, single digits, punctuation
//! runs, newlines), `llama-bpe` (and `llama3`, `llama-v3`) with Llama 3's (the same, but digits
//! in runs of up to three), then map bytes without a further split. Control tokens (token_type 3)
//! are special, user-defined ones (4) are added tokens. A BOS token starts a prompt without a
//! chat template where `tokenizer.ggml.add_bos_token` says so; a chat template writes its own.
//! (candle's GGUF tokenizer helper adds a prefix space and gets these models wrong.)
//!
//! The chat template is `tokenizer.chat_template`, rendered as transformers renders it
//! ([`ChatTemplate`]); a GGUF without one is prompted as a base model (plain text). Generation
//! stops at the control token the template writes right after an assistant's answer
//! (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3), or else at `tokenizer.ggml.eos_token_id`.

use super::chat_template::{self, ChatTemplate};
use super::gguf::{GgufFile, BOS_KEY, EOS_KEY};
use super::prompt::{Template, TextTokenizer};
use super::ModelError;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

/// The pre-tokenizers kvreplay builds, by their `tokenizer.ggml.pre` name.
const PRE_TOKENIZERS: &[&str] = &[
    "smollm",
    "qwen2",
    "deepseek-r1-qwen",
    "llama-bpe",
    "llama3",
    "llama-v3",
];

/// Qwen2's split (transformers' GGUF converter, `Qwen2Converter`; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split (transformers' GGUF converter, `_LLAMA3_SPLIT`; llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_LLAMA3`): Qwen2's, with digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE tokenizer plus the model's chat template.
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    stop: u32,
    bos: Option<u32>,
    chat: Option<ChatTemplate>,
}

/// The pre-tokenizer called `name`, if kvreplay builds it.
fn pre_tokenizer(name: &str) -> Option<PreTokenizerWrapper> {
    let parts = match name {
        "smollm" => vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ],
        "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT),
        "llama-bpe" | "llama3" | "llama-v3" => split_then_bytes(LLAMA3_SPLIT),
        _ => return None,
    };
    Some(PreTokenizerWrapper::Sequence(Sequence::new(parts)))
}

/// A split by `expression`, its matches kept apart, then bytes mapped without a further split.
fn split_then_bytes(expression: &str) -> Vec<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(expression.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("a valid expression");
    vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
    ]
}

impl ChatTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let fail = |detail: String| ModelError::Tokenizer {
            path: gguf.path.clone(),
            detail,
        };
        let model = gguf.str_value("tokenizer.ggml.model").unwrap_or_default();
        if model != "gpt2" {
            return Err(fail(format!(
                "tokenizer.ggml.model `{model}` is not byte-level BPE (`gpt2`), the tokenizer this family builds"
            )));
        }
        let pre = gguf.str_value("tokenizer.ggml.pre").unwrap_or_default();
        let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
            fail(format!(
                "tokenizer.ggml.pre `{pre}` is not a pre-tokenizer kvreplay builds (known: {})",
                PRE_TOKENIZERS.join(", ")
            ))
        })?;
        let tokens = gguf.strings("tokenizer.ggml.tokens")?;
        let merges = gguf
            .strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|merge| {
                merge
                    .split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| fail(format!("merge {merge:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let token_types: Vec<i32> = gguf
            .value("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
            .map(|values| values.iter().map(|v| v.to_i32().unwrap_or(1)).collect())
            .unwrap_or_default();
        let vocab: ahash::AHashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, token)| (token.clone(), id as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|err| fail(err.to_string()))?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
        tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
        let added = |kind: i32, special: bool| -> Vec<AddedToken> {
            let of_kind = token_types.iter().enumerate().filter(|(_, k)| **k == kind);
            of_kind
                .map(|(id, _)| AddedToken::from(tokens[id].clone(), special))
                .collect()
        };
        tokenizer
            .add_special_tokens(added(3, true))
            .and_then(|_| tokenizer.add_tokens(added(4, false)))
            .map_err(|err| fail(err.to_string()))?;
        let chat = chat_template::of_gguf(gguf, &tokens)?;
        let is_control = |id: u32| token_types.get(id as usize) == Some(&3);
        let id_of = |key: &str| gguf.value(key).and_then(|v| v.to_u32().ok());
        let encode = |text: &str| {
            let encoding = tokenizer.encode(text, false);
            encoding.map(|e| e.get_ids().to_vec()).unwrap_or_default()
        };
        let stop = chat_template::stop_token(chat.as_ref(), encode, is_control, id_of(EOS_KEY))
            .ok_or_else(|| {
                fail(format!(
                    "no token ends a generation: the chat template writes no control token after an answer, and {EOS_KEY} is missing"
                ))
            })?;
        let adds_bos = gguf
            .value("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok());
        let bos = if adds_bos == Some(true) {
            Some(id_of(BOS_KEY).ok_or_else(|| {
                fail(format!(
                    "tokenizer.ggml.add_bos_token is set but {BOS_KEY} is missing"
                ))
            })?)
        } else {
            None
        };
        Ok(Self {
            tokenizer,
            stop,
            bos,
            chat,
        })
    }
}

impl TextTokenizer for ChatTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.tokenizer
            .encode(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::pre_tokenizer;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn pieces(name: &str, text: &str) -> Vec<String> {
        let mut split = PreTokenizedString::from(text);
        pre_tokenizer(name)
            .unwrap()
            .pre_tokenize(&mut split)
            .unwrap();
        split
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_owned())
            .collect()
    }

    #[test]
    fn llama3_splits_digits_in_threes_where_qwen2_splits_each() {
        // Byte-level spelling: a space is `Ġ`. Hand-split by each expression's alternatives.
        assert_eq!(
            pieces("llama-bpe", "In 2024, 12345 apples"),
            ["In", "Ġ", "202", "4", ",", "Ġ", "123", "45", "Ġapples"]
        );
        assert_eq!(
            pieces("qwen2", "In 2024, 12345"),
            ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "1", "2", "3", "4", "5"]
        );
        assert_eq!(pieces("llama3", "it's"), pieces("llama-bpe", "it's"));
        assert_eq!(pieces("deepseek-r1-qwen", "a 12"), pieces("qwen2", "a 12"));
    }
}
