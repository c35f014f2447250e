//! RULER's synthetic tasks (Hsieh et al., "RULER: What's the Real Context Size of Your
//! Long-Context Language Models?", COLM 2024; NVIDIA/RULER at c3f5e3b,
//! `scripts/data/synthetic/`), generated natively from the essays kvreplay already fetches: the
//! needle tasks ([`niah`]), variable tracking ([`variable_tracking`]), common-words
//! ([`common_words`]) and frequent-words ([`frequent_words`]) extraction. Each task keeps RULER's
//! templates, answer prefixes and default sizes, and its scorer, `string_match_all` (the share of
//! the expected strings the output contains, [`BuiltPrompt::answer_score`]).
//!
//! What differs from RULER, on purpose:
//! - prompts are built in token space, piece by piece, so every needle's span is exact (as
//!   [`crate::recipe::niah`] does): a needle goes after the token ending in '.' nearest before
//!   its depth, where RULER splits sentences with NLTK;
//! - the haystack grows until the prompt holds `prompt_tokens` tokens (template and answer prefix
//!   included), where RULER's limit also counts the generated tokens;
//! - words (needle keys of type `words`, the common-words list) come from the essays' own
//!   vocabulary unless `words = "wonderwords"` takes RULER's lists ([`WordSource`]); a `words`
//!   key is two of them joined by '-', like RULER's adjective-noun pairs;
//! - random draws come from one seeded SplitMix64 stream, so the same recipe gives the same
//!   prompt on any machine, but not RULER's Python samples;
//! - on a chat model the task is the user's message and the answer prefix opens the assistant's
//!   turn (RULER's chat templates do the same); few-shot examples sit inside that message;
//!   `template = "base"` writes RULER's `base` template instead, the raw task text.
//!
//! Every built prompt is checked by its task's own solver, which reads the answers back from the
//! prompt's decoded text with no knowledge of how it was generated: a prompt whose tokens do not
//! state its answer is refused.

pub mod common_words;
pub mod file;
pub mod frequent_words;
pub mod niah;
pub mod variable_tracking;

use super::{essay_tokens, with_bos, BuiltPrompt, RecipeError};
use crate::model::{Template, TextTokenizer};
use crate::splitmix;
use crate::trace::Span;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// One of RULER's tasks, as a recipe kind.
pub trait Task {
    /// The recipe kind.
    fn kind(&self) -> &'static str;
    /// The prompt's length in tokens.
    fn prompt_tokens(&self) -> usize;
    /// Checks the settings on their own: the field and the rule broken.
    fn check(&self) -> Result<(), (&'static str, String)>;
    /// Builds the prompt of each question asked of the one context (one, but for `ruler-niah`'s
    /// `questions`), with its expected answers.
    fn prompts(&self, sources: &Sources<'_>) -> Result<Vec<BuiltPrompt>, RecipeError>;
    /// The answers, read back from the prompt's decoded text by the task's own rule (independent
    /// of how the prompt was generated).
    fn solve(&self, text: &str) -> Vec<String>;
}

/// What a task draws its text from.
pub struct Sources<'a> {
    /// The model's tokenizer.
    pub tokenizer: &'a dyn TextTokenizer,
    /// The essays, sorted.
    pub essays: &'a [PathBuf],
}

impl Sources<'_> {
    /// The first `needed` tokens of the essays, whitespace collapsed to single spaces as RULER's
    /// haystack is.
    pub fn essay_tokens(&self, needed: usize) -> Result<Vec<u32>, RecipeError> {
        essay_tokens(self.tokenizer, self.essays, needed, collapse_whitespace)
    }

    /// The two word lists a `words` key joins one of each of: the essays' vocabulary twice, or
    /// RULER's adjectives and nouns (each sorted, duplicates removed).
    pub fn key_words(&self, source: WordSource) -> Result<(Vec<String>, Vec<String>), RecipeError> {
        match source {
            WordSource::Essays => {
                let words = self.words()?;
                Ok((words.clone(), words))
            }
            WordSource::Wonderwords => {
                let lists = word_lists()?;
                Ok((sorted(lists.adjectives), sorted(lists.nouns)))
            }
        }
    }

    /// The words a list task draws from: the essays' vocabulary, or RULER's nouns, adjectives and
    /// verbs together (sorted, duplicates removed).
    pub fn list_words(&self, source: WordSource) -> Result<Vec<String>, RecipeError> {
        match source {
            WordSource::Essays => self.words(),
            WordSource::Wonderwords => {
                let lists = word_lists()?;
                Ok(sorted(
                    [lists.nouns, lists.adjectives, lists.verbs].concat(),
                ))
            }
        }
    }

    /// The essays' vocabulary: every distinct lower-case ASCII word of 4 to 12 letters, sorted.
    pub fn words(&self) -> Result<Vec<String>, RecipeError> {
        let mut words = BTreeSet::new();
        for essay in self.essays {
            let text = std::fs::read_to_string(essay).map_err(|source| RecipeError::Io {
                path: essay.clone(),
                source,
            })?;
            words.extend(
                text.split(|c: char| !c.is_ascii_alphabetic())
                    .filter(|w| (4..=12).contains(&w.len()))
                    .filter(|w| w.bytes().all(|b| b.is_ascii_lowercase()))
                    .map(str::to_owned),
            );
        }
        Ok(words.into_iter().collect())
    }
}

/// Where a task's words come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WordSource {
    /// The essays' own vocabulary (what the shipped recipes use): a key's words may also occur in
    /// the haystack.
    #[default]
    Essays,
    /// RULER's, from the `wonderwords` package (fetched and checksum-pinned): a needle key is an
    /// adjective and a noun (`scripts/data/synthetic/niah.py`), the common words are its nouns,
    /// adjectives and verbs (`common_words_extraction.py`).
    Wonderwords,
}

/// RULER's default seed, 42.
pub(super) fn rulers_seed() -> u64 {
    42
}

/// RULER's word lists, fetched when missing.
fn word_lists() -> Result<crate::assets::WordLists, RecipeError> {
    crate::assets::Assets::from_env()
        .word_lists()
        .map_err(|err| RecipeError::Task {
            task: "wonderwords",
            rule: err.to_string(),
        })
}

/// `words` sorted, duplicates removed (Python's `sorted(set(words))`).
fn sorted(words: Vec<String>) -> Vec<String> {
    words
        .into_iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Checks `task`'s settings: the field and the rule broken.
pub(super) fn check(task: &dyn Task) -> Result<(), (&'static str, String)> {
    if task.prompt_tokens() < 200 {
        return Err(("prompt_tokens", "must be at least 200".into()));
    }
    task.check()
}

/// Builds `task`'s prompt (of its first question) and checks that its decoded text states its
/// answers.
#[cfg(test)]
pub(super) fn build(
    task: &dyn Task,
    tokenizer: &dyn TextTokenizer,
    essays: &[PathBuf],
) -> Result<BuiltPrompt, RecipeError> {
    Ok(build_questions(task, tokenizer, essays)?.swap_remove(0))
}

/// Builds `task`'s prompt of each question and checks that each one's decoded text states its
/// answers.
pub(super) fn build_questions(
    task: &dyn Task,
    tokenizer: &dyn TextTokenizer,
    essays: &[PathBuf],
) -> Result<Vec<BuiltPrompt>, RecipeError> {
    let prompts = task.prompts(&Sources { tokenizer, essays })?;
    for prompt in &prompts {
        let mut found = task.solve(&tokenizer.decode(&prompt.ids));
        let mut expected = prompt.answers.clone();
        found.sort();
        expected.sort();
        if found != expected {
            return Err(RecipeError::Task {
                task: task.kind(),
                rule: format!(
                    "the prompt's text must state its answers: it states {found:?}, the task expects {expected:?}"
                ),
            });
        }
    }
    Ok(prompts)
}

/// What [`fit`] sizes: a prompt, or the prompts of several questions (as long as the longest).
pub(crate) trait Fitted {
    /// Its length in tokens.
    fn tokens(&self) -> usize;
}

impl Fitted for BuiltPrompt {
    fn tokens(&self) -> usize {
        self.ids.len()
    }
}

impl Fitted for Vec<BuiltPrompt> {
    fn tokens(&self) -> usize {
        self.iter()
            .map(|prompt| prompt.ids.len())
            .max()
            .unwrap_or(0)
    }
}

/// The prompt of the largest size `n ≥ least` (needles' haystack lines, words, essay tokens) that
/// `build(n)` fits in `prompt_tokens`; sizes are tried by doubling, then bisection.
pub(crate) fn fit<P: Fitted>(
    kind: &'static str,
    prompt_tokens: usize,
    least: usize,
    build: impl Fn(usize) -> Result<P, RecipeError>,
) -> Result<P, RecipeError> {
    let first = build(least)?;
    if first.tokens() > prompt_tokens {
        return Err(RecipeError::Task {
            task: kind,
            rule: format!(
                "prompt_tokens = {prompt_tokens} cannot hold the task: its smallest prompt has {} tokens",
                first.tokens()
            ),
        });
    }
    // Every task adds about a token or more per unit of size: no more units are tried.
    let cap = prompt_tokens + 1;
    let (mut fits, mut best, mut over) = (least, first, cap);
    let mut next = (least.max(1) * 2).min(cap);
    while next < cap {
        let prompt = build(next)?;
        if prompt.tokens() > prompt_tokens {
            over = next;
            break;
        }
        (fits, best) = (next, prompt);
        next = (next * 2).min(cap);
    }
    while over - fits > 1 {
        let middle = fits + (over - fits) / 2;
        let prompt = build(middle)?;
        if prompt.tokens() > prompt_tokens {
            over = middle;
        } else {
            (fits, best) = (middle, prompt);
        }
    }
    Ok(best)
}

/// Which template a task's prompt is written in (RULER's `--model_template_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptTemplate {
    /// The model's own: on a chat model the task is the user's message and the answer prefix
    /// opens the assistant's turn (RULER's chat templates); on a base model, as `base`.
    #[default]
    Chat,
    /// RULER's `base` template, `{task_template}`: the raw task text after BOS, then the answer
    /// prefix, whatever the model.
    Base,
}

impl PromptTemplate {
    /// Its name in a recipe.
    pub fn name(self) -> &'static str {
        match self {
            PromptTemplate::Chat => "chat",
            PromptTemplate::Base => "base",
        }
    }
}

/// A prompt assembled in token space: each piece is tokenized on its own, so spans are exact.
pub(crate) struct Assembly<'t> {
    tokenizer: &'t dyn TextTokenizer,
    /// The template the prompt is written in: the model's, or plain text for `base`.
    template: Template<'t>,
    ids: Vec<u32>,
    spans: Vec<Span>,
}

impl<'t> Assembly<'t> {
    /// The opening of a user's message: the chat template's (its default system turn where it
    /// inserts one, and the user's header), or BOS alone for a base model or the `base` template.
    pub fn open(tokenizer: &'t dyn TextTokenizer, template: PromptTemplate) -> Self {
        let template = match template {
            PromptTemplate::Chat => tokenizer.template(),
            PromptTemplate::Base => Template::Plain,
        };
        let ids = match template {
            Template::Chat(chat) => tokenizer.encode(chat.user_turn().0),
            Template::Plain => with_bos(tokenizer, Vec::new()),
        };
        Self {
            tokenizer,
            template,
            ids,
            spans: Vec::new(),
        }
    }

    /// Appends tokens.
    pub fn tokens(&mut self, ids: &[u32]) {
        self.ids.extend_from_slice(ids);
    }

    /// Closes the user's message (on a chat model), opens the answer with `answer_prefix`, and
    /// names what the answer must contain.
    pub fn close(
        mut self,
        answer_prefix: &str,
        generate: usize,
        answers: Vec<String>,
    ) -> BuiltPrompt {
        match self.template {
            Template::Chat(chat) => self.text(&format!("{}{answer_prefix}", chat.user_turn().1)),
            Template::Plain => self.text(answer_prefix),
        }
        BuiltPrompt {
            ids: self.ids,
            spans: self.spans,
            generate,
            answers,
        }
    }
}

/// Where a task writes its text: a prompt (its spans recorded) or a plain text (an example).
pub(crate) trait Writer {
    /// Appends a piece of text.
    fn text(&mut self, text: &str);
    /// Appends a piece of text as the span `name`.
    fn span(&mut self, name: String, text: &str);
}

impl Writer for Assembly<'_> {
    fn text(&mut self, text: &str) {
        self.ids.extend(self.tokenizer.encode(text));
    }

    fn span(&mut self, name: String, text: &str) {
        let start = self.ids.len();
        self.text(text);
        self.spans.push(Span {
            name,
            start,
            end: self.ids.len(),
        });
    }
}

impl Writer for String {
    fn text(&mut self, text: &str) {
        self.push_str(text);
    }

    fn span(&mut self, _name: String, text: &str) {
        self.push_str(text);
    }
}

/// The name of the `index`-th (from 0) span of a kind: `needle`, `needle-2`, `needle-3`…
pub(crate) fn nth_span(kind: &str, index: usize) -> String {
    match index {
        0 => kind.to_owned(),
        _ => format!("{kind}-{}", index + 1),
    }
}

/// `text` with every run of whitespace made one space.
fn collapse_whitespace(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// RULER's needle depths: `np.round(np.linspace(0, 100, num=40))`, in percent (no value falls on
/// a half, so rounding mode does not matter).
pub(crate) fn depths() -> Vec<usize> {
    (0..40)
        .map(|i| (100.0 * i as f64 / 39.0).round() as usize)
        .collect()
}

/// The seeded random draws of one prompt.
#[derive(Clone)]
pub(crate) struct Draw(u64);

impl Draw {
    /// The stream of seed `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A number in `[0, n)` (`n > 0`), by Lemire's multiply-shift.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(splitmix::next(&mut self.0)) * n as u128) >> 64) as usize
    }

    /// A number in `[low, high]`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.below((high - low + 1) as usize) as u64
    }

    /// `k` distinct numbers of `[0, n)` in the order drawn (Python's `random.sample`), `k ≤ n`.
    pub fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut pool: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i);
            pool.swap(i, j);
        }
        pool.truncate(k);
        pool
    }

    /// Shuffles `items` (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }

    /// `length` random letters of `alphabet`.
    pub fn letters(&mut self, alphabet: &[u8], length: usize) -> String {
        (0..length)
            .map(|_| char::from(alphabet[self.below(alphabet.len())]))
            .collect()
    }

    /// A version-4 UUID (Python's `uuid.UUID(int=random.getrandbits(128), version=4)`).
    pub fn uuid(&mut self) -> String {
        let high = splitmix::next(&mut self.0);
        let low = splitmix::next(&mut self.0);
        let high = (high & !0xF000) | 0x4000;
        let low = (low & !(0xC000 << 48)) | (0x8000 << 48);
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            high >> 32,
            (high >> 16) & 0xFFFF,
            high & 0xFFFF,
            low >> 48,
            low & 0xFFFF_FFFF_FFFF
        )
    }
}

/// The text after the last occurrence of `marker` (the whole text if none): a task's own part
/// of a prompt that may hold few-shot examples before it.
pub(crate) fn after_last<'a>(text: &'a str, marker: &str) -> &'a str {
    text.rfind(marker)
        .map_or(text, |at| &text[at + marker.len()..])
}

/// The text before the first occurrence of `marker` (the whole text if none).
pub(crate) fn before<'a>(text: &'a str, marker: &str) -> &'a str {
    text.find(marker).map_or(text, |at| &text[..at])
}

/// The `count` most frequent of `words` (ignoring `skip`), if they outnumber every other word:
/// the extraction tasks' solver.
pub(crate) fn most_frequent<'a>(
    words: impl Iterator<Item = &'a str>,
    skip: &str,
    count: usize,
) -> Vec<String> {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for word in words.filter(|w| *w != skip) {
        *counts.entry(word).or_default() += 1;
    }
    let mut ranked: Vec<(&str, usize)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let clear = ranked.len() >= count
        && ranked
            .get(count)
            .is_none_or(|next| ranked[count - 1].1 > next.1);
    if !clear {
        return Vec::new();
    }
    ranked[..count]
        .iter()
        .map(|(w, _)| (*w).to_owned())
        .collect()
}

#[cfg(test)]
pub(crate) mod testing {
    //! A byte-level tokenizer (one token per byte) and a small essay, so tasks build without
    //! the real assets.

    use crate::model::{ChatTemplate, Template, TextTokenizer};
    use std::path::PathBuf;

    /// One token per byte; a base-model layout.
    pub struct Bytes;

    impl TextTokenizer for Bytes {
        fn encode(&self, text: &str) -> Vec<u32> {
            text.bytes().map(u32::from).collect()
        }
        fn decode(&self, ids: &[u32]) -> String {
            String::from_utf8_lossy(&ids.iter().map(|&id| id as u8).collect::<Vec<_>>())
                .into_owned()
        }
        fn stop_token(&self) -> u32 {
            0
        }
        fn bos(&self) -> Option<u32> {
            None
        }
        fn template(&self) -> Template<'_> {
            Template::Plain
        }
    }

    /// [`Bytes`] with a chat model's layout (ChatML) and a default system message.
    pub struct ChatBytes;

    /// A ChatML template that inserts `You are a test.` where a conversation has no system
    /// message.
    fn chat_bytes_template() -> &'static ChatTemplate {
        static TEMPLATE: std::sync::OnceLock<ChatTemplate> = std::sync::OnceLock::new();
        TEMPLATE.get_or_init(|| {
            let source = "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a test.<|im_end|>\n' }}{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
            ChatTemplate::new(source, None, None).unwrap()
        })
    }

    impl TextTokenizer for ChatBytes {
        fn encode(&self, text: &str) -> Vec<u32> {
            Bytes.encode(text)
        }
        fn decode(&self, ids: &[u32]) -> String {
            Bytes.decode(ids)
        }
        fn stop_token(&self) -> u32 {
            0
        }
        fn bos(&self) -> Option<u32> {
            None
        }
        fn template(&self) -> Template<'_> {
            Template::Chat(chat_bytes_template())
        }
    }

    /// A folder with one essay of `sentences` sentences over a vocabulary of about twice as
    /// many made-up words.
    pub fn essays(sentences: usize) -> (tempfile::TempDir, Vec<PathBuf>) {
        let dir = tempfile::tempdir().unwrap();
        let word = |i: usize| -> String {
            let mut n = i * 7919 + 12345;
            (0..5)
                .map(|_| {
                    let letter = char::from(b'a' + (n % 26) as u8);
                    n /= 26;
                    letter
                })
                .collect()
        };
        let text: String = (0..sentences)
            .map(|i| {
                format!(
                    "The {} of {}  shapes\n more. ",
                    word(2 * i),
                    word(2 * i + 1)
                )
            })
            .collect();
        let path = dir.path().join("essay.txt");
        std::fs::write(&path, text).unwrap();
        (dir, vec![path])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_are_rulers() {
        let depths = depths();
        assert_eq!(depths.len(), 40);
        // np.round(np.linspace(0, 100, 40)).astype(int)[:6] and [-3:]
        assert_eq!(depths[..6], [0, 3, 5, 8, 10, 13]);
        assert_eq!(depths[37..], [95, 97, 100]);
    }

    #[test]
    fn samples_are_distinct_and_seeded() {
        let mut draw = Draw::new(42);
        let sample = draw.sample(40, 40);
        assert_eq!(sample.iter().collect::<BTreeSet<_>>().len(), 40);
        assert_eq!(Draw::new(42).sample(40, 5), sample[..5]);
        assert_ne!(Draw::new(43).sample(40, 5), sample[..5]);
    }

    /// On a chat model, `chat` wraps the task in the chat turns and `base` writes RULER's raw task
    /// text; the task's own text, spans and answers are the same under both.
    #[test]
    fn the_base_template_is_the_raw_task_text() {
        let (_dir, essays) = testing::essays(200);
        let under = |template: &str| {
            let task: niah::NiahTask = toml::from_str(&format!(
                "prompt_tokens = 1500\ntype_haystack = \"noise\"\ntemplate = \"{template}\""
            ))
            .unwrap();
            build(&task, &testing::ChatBytes, &essays).unwrap()
        };
        let (chat, base) = (under("chat"), under("base"));
        let (chat_text, base_text) = (
            testing::Bytes.decode(&chat.ids),
            testing::Bytes.decode(&base.ids),
        );
        assert!(chat_text.starts_with("<|im_start|>system\n"), "{chat_text}");
        assert!(
            chat_text.contains("<|im_end|>\n<|im_start|>assistant\n"),
            "{chat_text}"
        );
        assert!(
            base_text.starts_with("A special magic number is hidden"),
            "{base_text}"
        );
        assert!(!base_text.contains("<|im_"), "{base_text}");
        assert_eq!(chat.answers, base.answers);
        let question = |prompt: &BuiltPrompt, text: &str| {
            let span = prompt.spans.iter().find(|s| s.name == "question").unwrap();
            text[span.start..span.end].to_owned()
        };
        assert_eq!(question(&chat, &chat_text), question(&base, &base_text));
        let err = toml::from_str::<niah::NiahTask>("prompt_tokens = 1500\ntemplate = \"raw\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown variant `raw`, expected `chat` or `base`"),
            "{err}"
        );
    }

    #[test]
    fn uuids_are_version_four() {
        let uuid = Draw::new(7).uuid();
        assert_eq!(uuid.len(), 36);
        assert_eq!(&uuid[14..15], "4");
        assert!("89ab".contains(&uuid[19..20]), "{uuid}");
    }

    #[test]
    fn fit_finds_the_largest_size_that_fits() {
        let build = |n: usize| -> Result<BuiltPrompt, RecipeError> {
            Ok(BuiltPrompt {
                ids: vec![0; 10 + 3 * n],
                spans: Vec::new(),
                generate: 1,
                answers: Vec::new(),
            })
        };
        // 10 + 3n ≤ 200 → n = 63.
        assert_eq!(fit("t", 200, 1, build).unwrap().ids.len(), 199);
        assert_eq!(fit("t", 13, 1, build).unwrap().ids.len(), 13);
        let err = fit("t", 12, 1, build).unwrap_err().to_string();
        assert!(err.contains("its smallest prompt has 13 tokens"), "{err}");
    }

    #[test]
    fn most_frequent_needs_a_clear_margin() {
        let words = "a b a c a b d".split(' ');
        assert_eq!(most_frequent(words.clone(), "", 2), ["a", "b"]);
        assert!(
            most_frequent(words.clone(), "", 3).is_empty(),
            "c and d tie"
        );
        assert_eq!(most_frequent(words, "a", 1), ["b"]);
    }

    #[test]
    fn scores_are_the_share_of_answers_found_ignoring_case() {
        let prompt = BuiltPrompt {
            ids: Vec::new(),
            spans: Vec::new(),
            generate: 1,
            answers: vec!["Paris".into(), "LYON".into(), "Nice".into()],
        };
        assert_eq!(prompt.answer_score("paris and lyon"), Some(2.0 / 3.0));
        assert_eq!(
            BuiltPrompt {
                answers: Vec::new(),
                ..prompt
            }
            .answer_score("x"),
            None
        );
    }
}
