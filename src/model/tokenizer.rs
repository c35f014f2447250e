//! The tokenizer, rebuilt from the GGUF's own vocabulary and merges, and the ChatML template.
//!
//! The rule is llama.cpp's `smollm` pre-tokenizer: individual digits, then GPT-2 byte-level
//! splitting without a prefix space; control tokens (token_type 3) are special; no BOS token.
//! (candle's GGUF tokenizer helper adds a prefix space and gets this model wrong.)

use super::gguf::GgufFile;
use super::prompt::{Template, TextTokenizer};
use super::ModelError;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, Tokenizer};

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// SmolLM2-Instruct's default system message, inserted by its chat template when none is given.
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// A tokenizer plus the ChatML chat template.
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    end_of_turn: u32,
}

impl ChatTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let fail = |detail: String| ModelError::Tokenizer {
            path: gguf.path.clone(),
            detail,
        };
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
        tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]))));
        tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
        let specials: Vec<AddedToken> = token_types
            .iter()
            .enumerate()
            .filter(|(_, kind)| **kind == 3)
            .map(|(id, _)| AddedToken::from(tokens[id].clone(), true))
            .collect();
        tokenizer
            .add_special_tokens(specials)
            .map_err(|err| fail(err.to_string()))?;
        let end_of_turn = tokenizer
            .token_to_id("<|im_end|>")
            .ok_or_else(|| fail("no <|im_end|> token: not a ChatML model".into()))?;
        Ok(Self {
            tokenizer,
            end_of_turn,
        })
    }

    /// ChatML text of one message: `<|im_start|>role\ncontent<|im_end|>\n`.
    pub fn chat_turn(role: &str, content: &str) -> String {
        format!("<|im_start|>{role}\n{content}<|im_end|>\n")
    }

    /// The ChatML prompt for a conversation, ending with the assistant's turn opened. Without a
    /// system message the template's default one is inserted, as SmolLM2's template does.
    pub fn chat_prompt(messages: &[ChatMessage]) -> String {
        let mut text = String::new();
        if messages.first().map(|m| m.role.as_str()) != Some("system") {
            text += &Self::chat_turn("system", DEFAULT_SYSTEM);
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
}
