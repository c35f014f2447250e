//! The needle-in-a-haystack recipe: the test of Kamradt's `needlehaystack` package, built in
//! token space so the needle's span is exact.

use super::{essay_tokens, sentence_break_before, with_bos, BuiltPrompt, RecipeError};
use crate::model::{Template, TextTokenizer};
use crate::trace::Span;
use serde::Deserialize;
use std::path::PathBuf;

/// The needle-in-a-haystack recipe.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NiahRecipe {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `hf:` and a Hugging Face hub id or directory).
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

/// The needlehaystack system message.
pub const NIAH_SYSTEM: &str =
    "You are a helpful AI bot that answers questions for a user. Keep your response short and direct";
/// Appended to the question by needlehaystack.
pub const NIAH_QUESTION_SUFFIX: &str =
    " Don't give information outside the document or repeat your findings";

/// The needlehaystack prompt (system, context with the needle, question) in token space: the
/// context is truncated to fit `prompt_tokens`, and the needle is inserted after the last token
/// ending in '.' before `depth_percent` of the context (needlehaystack backs up to a '.' token;
/// we accept any token whose text ends with '.', a deliberate widening for BPE merges like "etc.").
pub(super) fn build(
    niah: &NiahRecipe,
    tokenizer: &dyn TextTokenizer,
    essays: &[PathBuf],
) -> Result<BuiltPrompt, RecipeError> {
    let answer_prefix = niah.answer_prefix.as_deref().unwrap_or_default();
    let (prefix, between, closing) = match tokenizer.template() {
        Template::Chat(chat) => {
            // The system message, then the context and the question as two user messages.
            let pieces = chat
                .around(Some(NIAH_SYSTEM), 2)
                .map_err(RecipeError::Template)?;
            (
                tokenizer.encode(&pieces[0]),
                tokenizer.encode(&pieces[1]),
                tokenizer.encode(&format!(
                    "{NIAH_QUESTION_SUFFIX}{}{answer_prefix}",
                    pieces[2]
                )),
            )
        }
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
    let context = essay_tokens(tokenizer, essays, needed, str::to_owned)?;
    let insertion = if niah.depth_percent >= 100.0 {
        context.len()
    } else {
        sentence_break_before(
            tokenizer,
            &context,
            (context.len() as f64 * niah.depth_percent / 100.0) as usize,
        )
    };
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
        answers: niah.answer.iter().cloned().collect(),
    })
}
