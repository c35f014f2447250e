//! Trace recipes: small TOML files in `traces/` that say which prompt to capture: a
//! needle-in-a-haystack prompt ([`niah`]), a chat message, a plain text file, and RULER's
//! synthetic tasks ([`ruler`]). Each builds a prompt in token space, with the spans a trace
//! records and the strings a correct answer contains.

pub mod niah;
pub mod reconstruction;
pub mod ruler;
pub mod samples;

pub use niah::{NiahRecipe, NIAH_QUESTION_SUFFIX, NIAH_SYSTEM};

use crate::model::{ChatMessage, Template, TextTokenizer};
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
    #[error("{path}: invalid recipe: {detail} (valid kinds: niah, chat, text, ruler-niah, ruler-vt, ruler-cwe, ruler-fwe, ruler-jsonl)")]
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
    /// A line of a data file (a RULER `validation.jsonl`) lacks a field or breaks its rule.
    #[error("{path}: line {line}: field `{field}`: {rule}")]
    Line {
        /// The data file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The field.
        field: &'static str,
        /// The rule broken.
        rule: String,
    },
    /// The model's chat template cannot lay out the recipe's conversation.
    #[error("the model's chat template cannot lay out this recipe: {0}")]
    Template(String),
    /// A task's parameters cannot fit its length, or its prompt does not hold its answer.
    #[error("{task}: {rule}")]
    Task {
        /// The task kind.
        task: &'static str,
        /// The rule broken.
        rule: String,
    },
}

/// What to capture.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Recipe {
    /// Needle in a haystack: essays up to `prompt_tokens`, a needle at `depth_percent`, a question.
    Niah(NiahRecipe),
    /// One chat message, in the model's chat template.
    Chat(ChatRecipe),
    /// A text file, fed raw (no chat template).
    Text(TextRecipe),
    /// RULER's needle tasks: single, multi-key, multi-value and multi-query needles.
    #[serde(rename = "ruler-niah")]
    RulerNiah(ruler::niah::NiahTask),
    /// RULER's variable tracking: chains of `VAR X = VAR Y` assignments.
    #[serde(rename = "ruler-vt")]
    RulerVt(ruler::variable_tracking::VariableTracking),
    /// RULER's common-words extraction from a numbered word list.
    #[serde(rename = "ruler-cwe")]
    RulerCwe(ruler::common_words::CommonWords),
    /// RULER's frequent-words extraction from Zipf-distributed coded words.
    #[serde(rename = "ruler-fwe")]
    RulerFwe(ruler::frequent_words::FrequentWords),
    /// A sample of a RULER `validation.jsonl`, as RULER wrote it.
    #[serde(rename = "ruler-jsonl")]
    RulerJsonl(ruler::file::RulerFile),
}

/// The chat recipe.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRecipe {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
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

impl ChatRecipe {
    /// The message in the model's chat template (its system message where the recipe has none,
    /// the assistant's turn opened), or as plain text after BOS for a base model.
    fn build(&self, tokenizer: &dyn TextTokenizer) -> Result<BuiltPrompt, RecipeError> {
        let ids = match tokenizer.template() {
            Template::Plain => {
                let text = match &self.system {
                    Some(system) => format!("{system}\n\n{}", self.message),
                    None => self.message.clone(),
                };
                with_bos(tokenizer, tokenizer.encode(&text))
            }
            Template::Chat(template) => {
                let system = self.system.iter().map(|system| ChatMessage {
                    role: "system".into(),
                    content: system.clone(),
                });
                let user = ChatMessage {
                    role: "user".into(),
                    content: self.message.clone(),
                };
                let messages: Vec<ChatMessage> = system.chain([user]).collect();
                let text = template
                    .render(&messages, true)
                    .map_err(RecipeError::Template)?;
                tokenizer.encode(&text)
            }
        };
        Ok(BuiltPrompt {
            ids,
            spans: Vec::new(),
            generate: self.generate,
            answers: self.answer.iter().cloned().collect(),
        })
    }
}

/// The text-file recipe.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextRecipe {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
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
    /// What a correct generation contains (every string), empty when the recipe says nothing.
    pub answers: Vec<String>,
}

/// The prompts of the questions asked of one context: each starts with the same `shared` tokens
/// (the context, which a capture or a live run computes once), then its own question.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltQuestions {
    /// Leading tokens every question's prompt shares: where the questions start, or the whole
    /// prompt when there is one question.
    pub shared: usize,
    /// Each question's prompt.
    pub prompts: Vec<BuiltPrompt>,
    /// The chunk size of KVzip's reconstruction pass, when the recipe asks for one
    /// ([`reconstruction`]): captures and live runs record it with each question's run.
    pub reconstruction: Option<usize>,
}

impl BuiltQuestions {
    /// One prompt, all of it shared.
    pub fn one(prompt: BuiltPrompt) -> Self {
        Self {
            shared: prompt.ids.len(),
            prompts: vec![prompt],
            reconstruction: None,
        }
    }

    /// Several questions' prompts, checked to share their context: every `question` span starts
    /// at the same token, and every prompt has the first one's tokens before it.
    fn shared_context(task: &'static str, prompts: Vec<BuiltPrompt>) -> Result<Self, RecipeError> {
        let question_start = |prompt: &BuiltPrompt| {
            prompt
                .spans
                .iter()
                .find(|span| span.name == "question")
                .map(|span| span.start)
        };
        let Some(shared) = question_start(&prompts[0]) else {
            return Err(RecipeError::Task {
                task,
                rule: "several questions need a `question` span, where the shared context ends"
                    .into(),
            });
        };
        for (index, prompt) in prompts.iter().enumerate().skip(1) {
            let differs = (0..shared).find(|&at| prompt.ids.get(at) != prompts[0].ids.get(at));
            if let Some(at) = differs.or((question_start(prompt) != Some(shared)).then_some(shared))
            {
                return Err(RecipeError::Task {
                    task,
                    rule: format!(
                        "question {}'s context differs from question 1's at token {at}: every question must follow the same context",
                        index + 1
                    ),
                });
            }
        }
        Ok(Self {
            shared,
            prompts,
            reconstruction: None,
        })
    }
}

impl BuiltPrompt {
    /// RULER's `string_match_all`: the share of the expected strings that `text` contains,
    /// ignoring case (`scripts/eval/synthetic/constants.py`); `None` without expected strings.
    pub fn answer_score(&self, text: &str) -> Option<f64> {
        if self.answers.is_empty() {
            return None;
        }
        let text = text.to_lowercase();
        let found = self
            .answers
            .iter()
            .filter(|answer| text.contains(&answer.to_lowercase()))
            .count();
        Some(found as f64 / self.answers.len() as f64)
    }
}

/// A RULER recipe's `max_seq_length`, taken out of `table` and standing in for `prompt_tokens`
/// until [`Recipe::fit_sequence`] sets it; `None` when the recipe gives `prompt_tokens`.
fn max_seq_length(table: &mut toml::Table, path: &Path) -> Result<Option<usize>, RecipeError> {
    let invalid = |rule: &str| RecipeError::Invalid {
        path: path.to_owned(),
        field: "max_seq_length",
        rule: rule.to_owned(),
    };
    let Some(value) = table.remove("max_seq_length") else {
        return Ok(None);
    };
    let kind = table
        .get("kind")
        .and_then(toml::Value::as_str)
        .unwrap_or("");
    if !samples::DRAWING_KINDS.contains(&kind) {
        return Err(invalid(&format!(
            "kind `{kind}` does not take it: only {}",
            samples::DRAWING_KINDS.join(", ")
        )));
    }
    if table.contains_key("prompt_tokens") {
        return Err(invalid(
            "give prompt_tokens or max_seq_length, not both (max_seq_length counts the tokens to generate too)",
        ));
    }
    let length = value
        .as_integer()
        .filter(|n| *n > 0)
        .ok_or_else(|| invalid("must be a positive whole number"))?;
    table.insert("prompt_tokens".into(), toml::Value::Integer(length));
    Ok(Some(length as usize))
}

/// Recipe text as a TOML table; `path` names it in errors.
fn table_of(text: &str, path: &Path) -> Result<toml::Table, RecipeError> {
    toml::from_str(text).map_err(|err: toml::de::Error| RecipeError::Parse {
        path: path.to_owned(),
        detail: err.message().to_owned(),
    })
}

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

    /// Parses and checks recipe text; `path` names it in errors. Its `samples` (see
    /// [`samples`]) is checked here and expanded by [`samples::sample_recipes`]: the recipe itself
    /// is its draw at its own `seed`.
    pub fn parse(text: &str, path: &Path) -> Result<Self, RecipeError> {
        let mut table = table_of(text, path)?;
        samples::samples_of(&table, path)?;
        table.remove("samples");
        reconstruction::take_options(&mut table, path)?;
        let max_seq_length = max_seq_length(&mut table, path)?;
        let mut recipe = Recipe::deserialize(table).map_err(|err| RecipeError::Parse {
            path: path.to_owned(),
            detail: err.message().to_owned(),
        })?;
        if let Some(length) = max_seq_length {
            recipe.fit_sequence(length, path)?;
        }
        recipe.check(path)?;
        Ok(recipe)
    }

    /// Sets a RULER kind's `prompt_tokens` to `max_seq_length` less its tokens to generate, as
    /// RULER's `max_seq_length` counts both.
    fn fit_sequence(&mut self, max_seq_length: usize, path: &Path) -> Result<(), RecipeError> {
        let (prompt_tokens, generate) = match self {
            Recipe::RulerNiah(task) => (&mut task.prompt_tokens, task.generate),
            Recipe::RulerVt(task) => (&mut task.prompt_tokens, task.generate),
            Recipe::RulerCwe(task) => (&mut task.prompt_tokens, task.generate),
            Recipe::RulerFwe(task) => (&mut task.prompt_tokens, task.generate),
            _ => unreachable!(
                "max_seq_length is refused on other kinds: {}",
                path.display()
            ),
        };
        *prompt_tokens = max_seq_length.saturating_sub(generate);
        Ok(())
    }

    /// The name of the model that runs the recipe.
    pub fn model(&self) -> &str {
        let model = match self {
            Recipe::Niah(niah) => &niah.model,
            Recipe::Chat(chat) => &chat.model,
            Recipe::Text(text) => &text.model,
            Recipe::RulerNiah(task) => &task.model,
            Recipe::RulerVt(task) => &task.model,
            Recipe::RulerCwe(task) => &task.model,
            Recipe::RulerFwe(task) => &task.model,
            Recipe::RulerJsonl(file) => &file.model,
        };
        model.as_deref().unwrap_or(crate::assets::MODELS[0].name)
    }

    /// The RULER task the recipe is, if it is one.
    fn ruler_task(&self) -> Option<&dyn ruler::Task> {
        match self {
            Recipe::RulerNiah(task) => Some(task),
            Recipe::RulerVt(task) => Some(task),
            Recipe::RulerCwe(task) => Some(task),
            Recipe::RulerFwe(task) => Some(task),
            Recipe::Niah(_) | Recipe::Chat(_) | Recipe::Text(_) | Recipe::RulerJsonl(_) => None,
        }
    }

    /// The prompt template of a RULER recipe (`chat` or `base`; a RULER file's is in its text),
    /// `None` for the other kinds.
    pub fn template(&self) -> Option<&'static str> {
        match self {
            Recipe::RulerNiah(task) => Some(task.template.name()),
            Recipe::RulerVt(task) => Some(task.template.name()),
            Recipe::RulerCwe(task) => Some(task.template.name()),
            Recipe::RulerFwe(task) => Some(task.template.name()),
            Recipe::RulerJsonl(_) => Some("RULER's file"),
            Recipe::Niah(_) | Recipe::Chat(_) | Recipe::Text(_) => None,
        }
    }

    /// How many questions the recipe asks of its one context (each a trace of its own).
    pub fn questions(&self) -> usize {
        match self {
            Recipe::RulerNiah(task) => task.questions,
            _ => 1,
        }
    }

    /// Whether building the prompt reads the essays (as haystack or vocabulary).
    pub fn reads_essays(&self) -> bool {
        matches!(
            self,
            Recipe::Niah(_) | Recipe::RulerNiah(_) | Recipe::RulerCwe(_)
        )
    }

    fn check(&self, path: &Path) -> Result<(), RecipeError> {
        let invalid = |field: &'static str, rule: &str| RecipeError::Invalid {
            path: path.to_owned(),
            field,
            rule: rule.to_owned(),
        };
        let hf = self.model().starts_with(crate::model::hf::PREFIX);
        let on_disk = crate::model::family::gguf_path(self.model());
        if let Some(gguf) = on_disk.as_ref().filter(|gguf| !gguf.is_file()) {
            let rule = format!("`{}`: no GGUF file at {}", self.model(), gguf.display());
            return Err(invalid("model", &rule));
        }
        if !hf && on_disk.is_none() && crate::assets::model_asset(self.model()).is_none() {
            let names: Vec<&str> = crate::assets::MODELS.iter().map(|m| m.name).collect();
            return Err(invalid(
                "model",
                &format!(
                    "unknown model `{}` (known: {}; or `gguf:` and a GGUF file's path; or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory)",
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
        if let Some(task) = self.ruler_task() {
            ruler::check(task).map_err(|(field, rule)| invalid(field, &rule))?;
        }
        if let Recipe::RulerJsonl(file) = self {
            file.check()
                .map_err(|(field, rule)| invalid(field, &rule))?;
        }
        Ok(())
    }

    /// Builds the prompt of each question asked of the context ([`questions`](Self::questions)).
    /// `essays` (sorted) are needed by the kinds that [read them](Self::reads_essays); `base`
    /// resolves `text`'s file.
    pub fn build_questions(
        &self,
        tokenizer: &dyn TextTokenizer,
        essays: &[PathBuf],
        base: &Path,
    ) -> Result<BuiltQuestions, RecipeError> {
        let Some(task) = self.ruler_task() else {
            return Ok(BuiltQuestions::one(self.build(tokenizer, essays, base)?));
        };
        let mut prompts = ruler::build_questions(task, tokenizer, essays)?;
        match prompts.len() {
            1 => Ok(BuiltQuestions::one(prompts.remove(0))),
            _ => BuiltQuestions::shared_context(task.kind(), prompts),
        }
    }

    /// Builds the prompt of a recipe that asks one question (see
    /// [`build_questions`](Self::build_questions)).
    pub fn build(
        &self,
        tokenizer: &dyn TextTokenizer,
        essays: &[PathBuf],
        base: &Path,
    ) -> Result<BuiltPrompt, RecipeError> {
        match self {
            Recipe::Niah(niah) => niah::build(niah, tokenizer, essays),
            Recipe::RulerNiah(_)
            | Recipe::RulerVt(_)
            | Recipe::RulerCwe(_)
            | Recipe::RulerFwe(_) => {
                let task = self.ruler_task().expect("a RULER kind");
                let mut questions = ruler::build_questions(task, tokenizer, essays)?;
                if questions.len() > 1 {
                    return Err(RecipeError::Task {
                        task: task.kind(),
                        rule: format!(
                            "asks {} questions of one context: build them with `build_questions`",
                            questions.len()
                        ),
                    });
                }
                Ok(questions.remove(0))
            }
            Recipe::Chat(chat) => chat.build(tokenizer),
            Recipe::RulerJsonl(file) => file.build(tokenizer, base),
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
                    answers: text.answer.iter().cloned().collect(),
                })
            }
        }
    }
}

/// `ids` after the tokenizer's BOS token, if it has one.
fn with_bos(tokenizer: &dyn TextTokenizer, ids: Vec<u32>) -> Vec<u32> {
    tokenizer.bos().into_iter().chain(ids).collect()
}

/// The first `needed` tokens of the essays (in the given order), read one essay at a time and
/// tokenized as one text after `normalise`.
fn essay_tokens(
    tokenizer: &dyn TextTokenizer,
    essays: &[PathBuf],
    needed: usize,
    normalise: fn(&str) -> String,
) -> Result<Vec<u32>, RecipeError> {
    let mut text = String::new();
    let mut context = Vec::new();
    for essay in essays {
        let essay_text = std::fs::read_to_string(essay).map_err(|source| RecipeError::Io {
            path: essay.clone(),
            source,
        })?;
        text.push_str(&essay_text);
        context = tokenizer.encode(&normalise(&text));
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
    Ok(context)
}

/// The last position at or before `position` that follows a token ending in '.' (0 if none): a
/// sentence break in token space.
fn sentence_break_before(tokenizer: &dyn TextTokenizer, context: &[u32], position: usize) -> usize {
    let mut insertion = position.min(context.len());
    while insertion > 0 && !tokenizer.token_text(context[insertion - 1]).ends_with('.') {
        insertion -= 1;
    }
    insertion
}

#[cfg(test)]
mod tests {
    /// `max_seq_length` counts the tokens to generate, as RULER's does: the prompt gets the rest.
    #[test]
    fn max_seq_length_leaves_room_for_the_generated_tokens() {
        let path = std::path::Path::new("m.toml");
        let parse = |text: &str| super::Recipe::parse(text, path);
        let Ok(super::Recipe::RulerVt(vt)) = parse("kind = \"ruler-vt\"\nmax_seq_length = 1024\n")
        else {
            panic!("a ruler-vt recipe");
        };
        assert_eq!((vt.prompt_tokens, vt.generate), (994, 30));
        let Ok(super::Recipe::RulerCwe(cwe)) =
            parse("kind = \"ruler-cwe\"\nmax_seq_length = 4096\ngenerate = 120\n")
        else {
            panic!("a ruler-cwe recipe");
        };
        assert_eq!(cwe.prompt_tokens, 3976);
        for (text, rule) in [
            (
                "kind = \"ruler-vt\"\nmax_seq_length = 1024\nprompt_tokens = 900\n",
                "not both",
            ),
            (
                "kind = \"chat\"\nmessage = \"hi\"\ngenerate = 2\nmax_seq_length = 64\n",
                "kind `chat` does not take it",
            ),
            (
                "kind = \"ruler-vt\"\nmax_seq_length = 0\n",
                "must be a positive whole number",
            ),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(
                err.starts_with("m.toml: field `max_seq_length`: ") && err.contains(rule),
                "{err}"
            );
        }
    }

    use super::*;

    fn load(text: &str) -> Recipe {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("recipe.toml");
        std::fs::write(&path, text).unwrap();
        Recipe::load(&path).unwrap().0
    }

    fn prompt(ids: &[u32], question: usize) -> BuiltPrompt {
        BuiltPrompt {
            ids: ids.to_vec(),
            spans: vec![Span {
                name: "question".into(),
                start: question,
                end: ids.len(),
            }],
            generate: 4,
            answers: Vec::new(),
        }
    }

    #[test]
    fn questions_must_follow_the_same_context() {
        let shared = BuiltQuestions::shared_context(
            "t",
            vec![prompt(&[1, 2, 3, 9], 3), prompt(&[1, 2, 3, 8, 8], 3)],
        )
        .unwrap();
        assert_eq!(shared.shared, 3);
        let differs = |second: BuiltPrompt| {
            BuiltQuestions::shared_context("t", vec![prompt(&[1, 2, 3, 9], 3), second])
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            differs(prompt(&[1, 5, 3, 9], 3)),
            "t: question 2's context differs from question 1's at token 1: every question must follow the same context"
        );
        // The same tokens, the question starting elsewhere.
        assert!(differs(prompt(&[1, 2, 3, 9], 2)).contains("at token 3"));
        let none = BuiltQuestions::shared_context(
            "t",
            vec![BuiltPrompt {
                spans: Vec::new(),
                ..prompt(&[1], 0)
            }],
        );
        assert!(none
            .unwrap_err()
            .to_string()
            .contains("need a `question` span"));
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
