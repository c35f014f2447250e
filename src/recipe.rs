//! Trace recipes: small TOML files in `traces/` that say which prompt to capture. Three kinds:
//! a needle-in-a-haystack prompt (the test of Kamradt's `needlehaystack` package, built in token
//! space so the needle's span is exact), a chat message, and a plain text file.

use crate::model::{ChatMessage, ChatTokenizer, Template, TextTokenizer};
use crate::trace::Span;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Errors reading or building a recipe.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecipeError {
    /// The recipe file cannot be read.
    #[error("{path}: cannot read recipe: {source}")]
    Io {
        /// The recipe.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key or kind, or a value of the wrong type.
    #[error("{path}: invalid recipe: {detail} (valid kinds: niah, chat, text)")]
    Parse {
        /// The recipe.
        path: PathBuf,
        /// The parser's message.
        detail: String,
    },
    /// A value is out of range.
    #[error("{path}: field `{field}`: {rule}")]
    Invalid {
        /// The recipe.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// The rule broken.
        rule: String,
    },
    /// The haystack is too short for the requested prompt length.
    #[error("the essays hold {available} tokens, the recipe needs {needed} of context")]
    HaystackTooShort {
        /// Tokens available.
        available: usize,
        /// Tokens needed.
        needed: usize,
    },
}

/// What to capture.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Recipe {
    /// Needle in a haystack: essays up to `prompt_tokens`, a needle at `depth_percent`, a question.
    Niah(NiahRecipe),
    /// One chat message, ChatML template.
    Chat(ChatRecipe),
    /// A text file, fed raw (no chat template).
    Text(TextRecipe),
}

/// The needle-in-a-haystack recipe.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NiahRecipe {
    /// The model that runs it (a name of `kvreplay fetch --model`; default `smollm2-135m`).
    #[serde(default)]
    pub model: Option<String>,
    /// Target prompt length in tokens, template included.
    pub prompt_tokens: usize,
    /// Where the needle goes, in percent of the context (at the sentence break before it).
    pub depth_percent: f64,
    /// The needle sentence.
    pub needle: String,
    /// The retrieval question.
    pub question: String,
    /// The needle's key phrase: a generation that contains it answered the question (closed-loop
    /// task success).
    #[serde(default)]
    pub answer: Option<String>,
    /// Text the answer starts with, appended after the prompt (a base model needs one, e.g. "The
    /// best thing to do in San Francisco is").
    #[serde(default)]
    pub answer_prefix: Option<String>,
    /// Greedy tokens to generate.
    pub generate: usize,
}

/// The chat recipe.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRecipe {
    /// The model that runs it (a name of `kvreplay fetch --model`; default `smollm2-135m`).
    #[serde(default)]
    pub model: Option<String>,
    /// The user's message.
    pub message: String,
    /// A system message (default: the template's own).
    pub system: Option<String>,
    /// Greedy tokens to generate.
    pub generate: usize,
    /// What a correct generation contains (closed-loop task success), if the chat has an answer.
    #[serde(default)]
    pub answer: Option<String>,
}

/// The text-file recipe.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextRecipe {
    /// The model that runs it (a name of `kvreplay fetch --model`; default `smollm2-135m`).
    #[serde(default)]
    pub model: Option<String>,
    /// The file, relative to the recipe.
    pub file: PathBuf,
    /// Keep at most this many tokens of it.
    pub max_tokens: Option<usize>,
    /// Greedy tokens to generate.
    pub generate: usize,
    /// What a correct generation contains (closed-loop task success), if the text asks a
    /// question.
    #[serde(default)]
    pub answer: Option<String>,
}

/// A prompt ready to run: token ids, named spans, and its text.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltPrompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Named spans (`needle`, `question`).
    pub spans: Vec<Span>,
    /// Tokens to generate.
    pub generate: usize,
    /// What a correct generation contains, when the recipe says.
    pub answer: Option<String>,
}

/// The needlehaystack system message.
pub const NIAH_SYSTEM: &str =
    "You are a helpful AI bot that answers questions for a user. Keep your response short and direct";
/// Appended to the question by needlehaystack.
pub const NIAH_QUESTION_SUFFIX: &str =
    " Don't give information outside the document or repeat your findings";

impl Recipe {
    /// Reads and checks a recipe file.
    pub fn load(path: &Path) -> Result<(Self, PathBuf), RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Io {
            path: path.to_owned(),
            source,
        })?;
        let recipe = Self::parse(&text, path)?;
        let base = path.parent().map(Path::to_owned).unwrap_or_default();
        Ok((recipe, base))
    }

    /// Parses and checks recipe text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, RecipeError> {
        let recipe: Recipe = toml::from_str(text).map_err(|err| RecipeError::Parse {
            path: path.to_owned(),
            detail: err.message().to_owned(),
        })?;
        recipe.check(path)?;
        Ok(recipe)
    }

    /// The name of the model that runs the recipe.
    pub fn model(&self) -> &str {
        let model = match self {
            Recipe::Niah(niah) => &niah.model,
            Recipe::Chat(chat) => &chat.model,
            Recipe::Text(text) => &text.model,
        };
        model.as_deref().unwrap_or(crate::assets::MODELS[0].name)
    }

    fn check(&self, path: &Path) -> Result<(), RecipeError> {
        let invalid = |field: &'static str, rule: &str| RecipeError::Invalid {
            path: path.to_owned(),
            field,
            rule: rule.to_owned(),
        };
        if crate::assets::model_asset(self.model()).is_none() {
            let names: Vec<&str> = crate::assets::MODELS.iter().map(|m| m.name).collect();
            return Err(invalid(
                "model",
                &format!(
                    "unknown model `{}` (known: {})",
                    self.model(),
                    names.join(", ")
                ),
            ));
        }
        if let Recipe::Niah(niah) = self {
            if !(0.0..=100.0).contains(&niah.depth_percent) {
                return Err(invalid("depth_percent", "must be in [0, 100]"));
            }
            if niah.prompt_tokens < 200 {
                return Err(invalid("prompt_tokens", "must be at least 200"));
            }
            if niah.needle.trim().is_empty() || niah.question.trim().is_empty() {
                return Err(invalid("needle", "needle and question must not be empty"));
            }
        }
        Ok(())
    }

    /// Builds the prompt. `essays` (sorted) are needed by `niah` only; `base` resolves `text`'s file.
    pub fn build(
        &self,
        tokenizer: &dyn TextTokenizer,
        essays: &[PathBuf],
        base: &Path,
    ) -> Result<BuiltPrompt, RecipeError> {
        match self {
            Recipe::Niah(niah) => build_niah(niah, tokenizer, essays),
            Recipe::Chat(chat) if tokenizer.template() == Template::Plain => {
                let text = match &chat.system {
                    Some(system) => format!("{system}\n\n{}", chat.message),
                    None => chat.message.clone(),
                };
                Ok(BuiltPrompt {
                    ids: with_bos(tokenizer, tokenizer.encode(&text)),
                    spans: Vec::new(),
                    generate: chat.generate,
                    answer: chat.answer.clone(),
                })
            }
            Recipe::Chat(chat) => {
                let mut messages = Vec::new();
                if let Some(system) = &chat.system {
                    messages.push(ChatMessage {
                        role: "system".into(),
                        content: system.clone(),
                    });
                }
                messages.push(ChatMessage {
                    role: "user".into(),
                    content: chat.message.clone(),
                });
                Ok(BuiltPrompt {
                    ids: tokenizer.encode(&ChatTokenizer::chat_prompt(&messages)),
                    spans: Vec::new(),
                    generate: chat.generate,
                    answer: chat.answer.clone(),
                })
            }
            Recipe::Text(text) => {
                let path = base.join(&text.file);
                let content = std::fs::read_to_string(&path)
                    .map_err(|source| RecipeError::Io { path, source })?;
                let mut ids = with_bos(tokenizer, tokenizer.encode(&content));
                if let Some(max) = text.max_tokens {
                    ids.truncate(max);
                }
                Ok(BuiltPrompt {
                    ids,
                    spans: Vec::new(),
                    generate: text.generate,
                    answer: text.answer.clone(),
                })
            }
        }
    }
}

/// `ids` after the tokenizer's BOS token, if it has one.
fn with_bos(tokenizer: &dyn TextTokenizer, ids: Vec<u32>) -> Vec<u32> {
    tokenizer.bos().into_iter().chain(ids).collect()
}

/// The needlehaystack prompt (system, context with the needle, question) in token space: the
/// context is truncated to fit `prompt_tokens`, and the needle is inserted after the last token
/// ending in '.' before `depth_percent` of the context (needlehaystack backs up to a '.' token;
/// we accept any token whose text ends with '.', a deliberate widening for BPE merges like "etc.").
fn build_niah(
    niah: &NiahRecipe,
    tokenizer: &dyn TextTokenizer,
    essays: &[PathBuf],
) -> Result<BuiltPrompt, RecipeError> {
    let answer_prefix = niah.answer_prefix.as_deref().unwrap_or_default();
    let (prefix, between, closing) = match tokenizer.template() {
        Template::ChatMl => (
            tokenizer.encode(&format!(
                "{}<|im_start|>user\n",
                ChatTokenizer::chat_turn("system", NIAH_SYSTEM)
            )),
            tokenizer.encode("<|im_end|>\n<|im_start|>user\n"),
            tokenizer.encode(&format!(
                "{NIAH_QUESTION_SUFFIX}<|im_end|>\n<|im_start|>assistant\n{answer_prefix}"
            )),
        ),
        Template::Plain => (
            with_bos(tokenizer, Vec::new()),
            tokenizer.encode("\n\nQuestion: "),
            tokenizer.encode(format!("\nAnswer: {answer_prefix}").trim_end()),
        ),
    };
    let question = tokenizer.encode(&niah.question);
    let needle = tokenizer.encode(&format!("\n{}\n", niah.needle.trim()));
    let overhead = prefix.len() + between.len() + question.len() + closing.len() + needle.len();
    let needed = niah.prompt_tokens.saturating_sub(overhead);
    let mut text = String::new();
    let mut context = Vec::new();
    for essay in essays {
        let essay_text = std::fs::read_to_string(essay).map_err(|source| RecipeError::Io {
            path: essay.clone(),
            source,
        })?;
        text.push_str(&essay_text);
        context = tokenizer.encode(&text);
        if context.len() >= needed {
            break;
        }
    }
    if context.len() < needed {
        return Err(RecipeError::HaystackTooShort {
            available: context.len(),
            needed,
        });
    }
    context.truncate(needed);
    let mut insertion = if niah.depth_percent >= 100.0 {
        context.len()
    } else {
        (context.len() as f64 * niah.depth_percent / 100.0) as usize
    };
    if niah.depth_percent < 100.0 {
        while insertion > 0 && !tokenizer.token_text(context[insertion - 1]).ends_with('.') {
            insertion -= 1;
        }
    }
    let mut ids = prefix;
    ids.extend_from_slice(&context[..insertion]);
    let needle_span = Span {
        name: "needle".into(),
        start: ids.len(),
        end: ids.len() + needle.len(),
    };
    ids.extend_from_slice(&needle);
    ids.extend_from_slice(&context[insertion..]);
    ids.extend_from_slice(&between);
    let question_span = Span {
        name: "question".into(),
        start: ids.len(),
        end: ids.len() + question.len(),
    };
    ids.extend_from_slice(&question);
    ids.extend_from_slice(&closing);
    Ok(BuiltPrompt {
        ids,
        spans: vec![needle_span, question_span],
        generate: niah.generate,
        answer: niah.answer.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Recipe {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("recipe.toml");
        std::fs::write(&path, text).unwrap();
        Recipe::load(&path).unwrap().0
    }

    #[test]
    fn text_and_chat_recipes_take_an_answer() {
        let text = load("kind = \"text\"\nfile = \"p.txt\"\ngenerate = 4\nanswer = \"Paris\"\n");
        let Recipe::Text(text) = text else {
            panic!("a text recipe: {text:?}")
        };
        assert_eq!(text.answer.as_deref(), Some("Paris"));
        let chat = load("kind = \"chat\"\nmessage = \"Capital of France?\"\ngenerate = 4\n");
        let Recipe::Chat(chat) = chat else {
            panic!("a chat recipe: {chat:?}")
        };
        assert_eq!(chat.answer, None);
    }
}
