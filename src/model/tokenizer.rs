//! The byte-level BPE tokenizer, rebuilt from the GGUF's own vocabulary and merges, and the
//! ChatML template.
//!
//! The pre-tokenizer is the one `tokenizer.ggml.pre` names, as llama.cpp's `llama-vocab.cpp` and
//! transformers' GGUF converter build it: `smollm` splits individual digits, then GPT-2
//! byte-level splitting without a prefix space; `qwen2` splits with Qwen2's regular expression
//! (letters with one leading non-letter, single digits, punctuation runs, newlines), then maps
//! bytes without a further split. Control tokens (token_type 3) are special, user-defined ones (4)
//! are added tokens; no BOS token. (candle's GGUF tokenizer helper adds a prefix space and gets
//! these models wrong.)
//!
//! The ChatML template's default system message, which the model's template inserts when a
//! conversation has none, is read from the GGUF's `tokenizer.chat_template` ([`default_system`]).

use super::gguf::GgufFile;
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

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// The pre-tokenizers kvreplay builds, by their `tokenizer.ggml.pre` name.
const PRE_TOKENIZERS: &[&str] = &["smollm", "qwen2"];

/// Qwen2's split (transformers' GGUF converter, `Qwen2Converter`; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer plus the ChatML chat template.
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    end_of_turn: u32,
    default_system: Option<String>,
}

/// The pre-tokenizer called `name`, if kvreplay builds it.
fn pre_tokenizer(name: &str) -> Option<PreTokenizerWrapper> {
    let parts = match name {
        "smollm" => vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ],
        "qwen2" => vec![
            PreTokenizerWrapper::Split(
                Split::new(
                    SplitPattern::Regex(QWEN2_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .expect("a valid expression"),
            ),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ],
        _ => return None,
    };
    Some(PreTokenizerWrapper::Sequence(Sequence::new(parts)))
}

/// The default system message of a ChatML chat template: the text of the first literal
/// `<|im_start|>system` turn written out whole in it (`'<|im_start|>system\nYou are…<|im_end|>'`),
/// as SmolLM2's and Qwen2.5's templates insert it when the conversation has no system message.
/// `None` where the template inserts none (a turn built from a message's content is skipped).
pub fn default_system(template: &str) -> Option<String> {
    let turn = regex::Regex::new(r"<\|im_start\|>system(?:\n|\\n)([^'\x22<{}]+)<\|im_end\|>")
        .expect("a valid expression");
    let system = turn.captures(template)?.get(1)?.as_str();
    Some(system.replace("\\n", "\n"))
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
        let end_of_turn = tokenizer
            .token_to_id("<|im_end|>")
            .ok_or_else(|| fail("no <|im_end|> token: not a ChatML model".into()))?;
        let template = gguf.str_value("tokenizer.chat_template");
        Ok(Self {
            tokenizer,
            end_of_turn,
            default_system: template.and_then(default_system),
        })
    }

    /// ChatML text of one message: `<|im_start|>role\ncontent<|im_end|>\n`.
    pub fn chat_turn(role: &str, content: &str) -> String {
        format!("<|im_start|>{role}\n{content}<|im_end|>\n")
    }

    /// The ChatML prompt for a conversation, ending with the assistant's turn opened. Without a
    /// system message the template's default one (`default_system`), if any, is inserted, as
    /// SmolLM2's and Qwen2.5's templates do.
    pub fn chat_prompt(messages: &[ChatMessage], default_system: Option<&str>) -> String {
        let mut text = String::new();
        if messages.first().map(|m| m.role.as_str()) != Some("system") {
            if let Some(system) = default_system {
                text += &Self::chat_turn("system", system);
            }
        }
        for message in messages {
            text += &Self::chat_turn(&message.role, &message.content);
        }
        text + "<|im_start|>assistant\n"
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

    /// `<|im_end|>`: the assistant's turn is over.
    fn stop_token(&self) -> u32 {
        self.end_of_turn
    }

    fn bos(&self) -> Option<u32> {
        None
    }

    fn template(&self) -> Template {
        Template::ChatMl
    }

    fn default_system(&self) -> Option<&str> {
        self.default_system.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::default_system;

    #[test]
    fn the_default_system_message_is_the_whole_literal_system_turn() {
        // SmolLM2-135M-Instruct's template (a newline in the literal) and the system branch of
        // Qwen2.5's (an escaped one; the turn built from the message's content is skipped).
        let smollm = "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}";
        assert_eq!(
            default_system(smollm).as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        let qwen = r"{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }} {%- else %} {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}";
        assert_eq!(
            default_system(qwen).as_deref(),
            Some("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
        );
        // A template that inserts no system turn of its own.
        let none = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}";
        assert_eq!(default_system(none), None);
    }
}
