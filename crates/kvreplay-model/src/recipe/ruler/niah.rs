//! RULER's needle tasks (`scripts/data/synthetic/niah.py`): needles "One of the special magic
//! {numbers} for {key} is: {value}." hidden in a haystack of essays, of one repeated noise
//! paragraph, or of other needles, and a question for the values of one or more keys. RULER's
//! eight needle tasks are settings of this one kind: `niah_single_1..3` (one key, number or UUID
//! values, noise or essay haystack), `niah_multikey_1..3` (distractor keys: 4 keys in essays, or
//! a haystack of needles), `niah_multivalue` (4 values for the key), `niah_multiquery` (4 keys
//! asked at once).
//!
//! Beyond RULER, `questions = N` asks N questions of one context, as SCBench's shared-context
//! setting does: each question asks `num_needle_q` keys of its own (drawn at once, so the first
//! question asks what `questions = 1` asks), and every question's prompt is the same haystack and
//! needles followed by its own question; the needles one question asks are the others'
//! distractors.

use super::{after_last, depths, fit, nth_span, Assembly, Draw, Sources, Task, Writer};
use crate::model::TextTokenizer;
use crate::recipe::sentence_break_before;
use crate::recipe::{BuiltPrompt, RecipeError};
use serde::Deserialize;

/// RULER's needle-task settings (its own field names).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NiahTask {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
    #[serde(default)]
    pub model: Option<String>,
    /// Prompt length in tokens, template and answer prefix included: the haystack grows to it.
    pub prompt_tokens: usize,
    /// Greedy tokens to generate (RULER's `tokens_to_generate`, 128).
    #[serde(default = "generate")]
    pub generate: usize,
    /// The seed of every random draw (RULER's default, 42).
    #[serde(default = "super::rulers_seed")]
    pub seed: u64,
    /// The prompt's template: `chat` (the model's own, the default) or `base` (RULER's `base`:
    /// the raw task text after BOS, then the answer prefix).
    #[serde(default)]
    pub template: super::PromptTemplate,
    /// What the needles hide in.
    #[serde(default)]
    pub type_haystack: Haystack,
    /// Where `words` keys and values come from: `essays` (the default) or `wonderwords`
    /// (RULER's adjective and noun lists).
    #[serde(default)]
    pub words: super::WordSource,
    /// What a key is (default `words`).
    #[serde(default = "words")]
    pub type_needle_k: Kind,
    /// What a value is (default `numbers`).
    #[serde(default)]
    pub type_needle_v: Kind,
    /// Keys with needles (at least `num_needle_q`; the keys not asked are distractors).
    #[serde(default = "one")]
    pub num_needle_k: usize,
    /// Values (needles) per key.
    #[serde(default = "one")]
    pub num_needle_v: usize,
    /// Keys asked at once.
    #[serde(default = "one")]
    pub num_needle_q: usize,
    /// Questions asked of the one context, each of `num_needle_q` keys of its own.
    #[serde(default = "one")]
    pub questions: usize,
}

/// What the needles hide in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Haystack {
    /// The essays, whitespace collapsed.
    #[default]
    Essay,
    /// RULER's noise paragraph, one per line.
    Noise,
    /// Other needles, with keys and values of the same kinds, one per line.
    Needle,
}

/// What a key or value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A 7-digit number.
    #[default]
    Numbers,
    /// Two words joined by '-': an adjective and a noun of RULER's lists (`words =
    /// "wonderwords"`), or two words of the essays.
    Words,
    /// A version-4 UUID.
    Uuids,
}

fn generate() -> usize {
    128
}
fn one() -> usize {
    1
}
fn words() -> Kind {
    Kind::Words
}

/// The words a `words` key joins: its first and its second.
type KeyWords = (Vec<String>, Vec<String>);

/// RULER's noise paragraph.
pub(crate) const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Numbers => "numbers",
            Kind::Words => "words",
            Kind::Uuids => "uuids",
        }
    }

    fn draw(self, draw: &mut Draw, words: &KeyWords) -> String {
        let (first, second) = words;
        match self {
            Kind::Numbers => draw.between(1_000_000, 9_999_999).to_string(),
            Kind::Words => format!(
                "{}-{}",
                first[draw.below(first.len())],
                second[draw.below(second.len())]
            ),
            Kind::Uuids => draw.uuid(),
        }
    }
}

/// The needles of one context, before the haystack, and the questions asked of it.
#[derive(Clone)]
struct Plan {
    /// Each needle's text and the index of its key.
    needles: Vec<(String, usize)>,
    /// Each question's keys.
    asked: Vec<Vec<usize>>,
    /// Each question's keys, as it names them.
    queries: Vec<String>,
    /// Each question's answers: the values of its keys.
    answers: Vec<Vec<String>>,
    /// Every key with needles (distractor haystack needles avoid them).
    keys: Vec<String>,
    /// The stream after the needles were drawn; the haystack continues it.
    draw: Draw,
}

/// One line of a line haystack.
enum Line {
    Haystack(String),
    Needle(usize),
}

impl NiahTask {
    fn needle(&self, key: &str, value: &str) -> String {
        format!(
            "One of the special magic {} for {key} is: {value}.",
            self.type_needle_v.name()
        )
    }

    /// Keys with needles: at least the keys asked.
    fn num_keys(&self) -> usize {
        self.num_needle_k.max(self.num_needle_q * self.questions)
    }

    /// RULER's draws: keys, their values, the needles shuffled, the keys asked (every question's
    /// at once, then split).
    fn plan(&self, words: &KeyWords) -> Plan {
        let mut draw = Draw::new(self.seed);
        let num_keys = self.num_keys();
        let (mut keys, mut values, mut needles) = (Vec::new(), Vec::new(), Vec::new());
        while keys.len() < num_keys {
            let key = self.type_needle_k.draw(&mut draw, words);
            if keys.contains(&key) {
                continue;
            }
            let key_values: Vec<String> = (0..self.num_needle_v)
                .map(|_| self.type_needle_v.draw(&mut draw, words))
                .collect();
            needles.extend(
                key_values
                    .iter()
                    .map(|v| (self.needle(&key, v), keys.len())),
            );
            keys.push(key);
            values.push(key_values);
        }
        draw.shuffle(&mut needles);
        let asked: Vec<Vec<usize>> = draw
            .sample(num_keys, self.num_needle_q * self.questions)
            .chunks(self.num_needle_q)
            .map(<[usize]>::to_vec)
            .collect();
        let query = |asked: &[usize]| {
            let names: Vec<&str> = asked.iter().map(|&i| keys[i].as_str()).collect();
            match names.split_last() {
                Some((last, rest)) if !rest.is_empty() => {
                    format!("{}, and {last}", rest.join(", "))
                }
                _ => names[0].to_owned(),
            }
        };
        Plan {
            queries: asked.iter().map(|keys| query(keys)).collect(),
            answers: asked
                .iter()
                .map(|keys| keys.iter().flat_map(|&i| values[i].clone()).collect())
                .collect(),
            needles,
            asked,
            keys,
            draw,
        }
    }

    /// The template's parts (head, question, answer prefix), made singular when one value is
    /// asked as RULER rewrites its template (before the query is put in).
    fn template(&self, query: &str) -> [String; 3] {
        let parts = [
            "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you about the {kind} afterwards.",
            "What are all the special magic {kind} for {query} mentioned in the provided text?",
            " The special magic {kind} for {query} mentioned in the provided text are",
        ];
        let kind = self.type_needle_v.name();
        let single = self.num_needle_q * self.num_needle_v == 1;
        parts.map(|part| {
            let (part, kind) = match single {
                true => (
                    part.replace("Some", "A")
                        .replace("are all", "is")
                        .replace("are", "is")
                        .replace("answers", "answer"),
                    &kind[..kind.len() - 1],
                ),
                false => (part.to_owned(), kind),
            };
            part.replace("{kind}", kind).replace("{query}", query)
        })
    }

    /// Each needle's span name in `question`'s prompt: the ones it asks `needle`, `needle-2`…,
    /// the others `distractor`…
    fn span_names(plan: &Plan, question: usize) -> Vec<String> {
        let (mut asked, mut other) = (0, 0);
        plan.needles
            .iter()
            .map(|(_, key)| {
                let (kind, count) = match plan.asked[question].contains(key) {
                    true => ("needle", &mut asked),
                    false => ("distractor", &mut other),
                };
                *count += 1;
                nth_span(kind, *count - 1)
            })
            .collect()
    }

    /// Each question's prompt with `essay` (essay tokens) as haystack, needles at RULER's depths.
    fn on_essay(
        &self,
        tokenizer: &dyn TextTokenizer,
        plan: &Plan,
        essay: &[u32],
    ) -> Vec<BuiltPrompt> {
        (0..self.questions)
            .map(|question| self.question_on_essay(tokenizer, plan, essay, question))
            .collect()
    }

    /// [`on_essay`](Self::on_essay)'s prompt of `question`.
    fn question_on_essay(
        &self,
        tokenizer: &dyn TextTokenizer,
        plan: &Plan,
        essay: &[u32],
        question: usize,
    ) -> BuiltPrompt {
        let mut draw = plan.draw.clone();
        let depths = depths();
        let mut at: Vec<usize> = draw
            .sample(depths.len(), plan.needles.len())
            .into_iter()
            .map(|i| sentence_break_before(tokenizer, essay, essay.len() * depths[i] / 100))
            .collect();
        at.sort_unstable();
        let [head, asked, prefix] = self.template(&plan.queries[question]);
        let names = Self::span_names(plan, question);
        let mut prompt = Assembly::open(tokenizer, self.template);
        prompt.text(&format!("{head}\n"));
        let mut from = 0;
        for ((position, (needle, _)), name) in at.into_iter().zip(&plan.needles).zip(names) {
            prompt.tokens(&essay[from..position]);
            prompt.span(name, &format!(" {needle}"));
            from = position;
        }
        prompt.tokens(&essay[from..]);
        prompt.span("question".into(), &format!("\n{asked}"));
        prompt.close(&prefix, self.generate, plan.answers[question].clone())
    }

    /// Each question's prompt with `lines` lines of noise or distractor needles as haystack.
    fn on_lines(
        &self,
        tokenizer: &dyn TextTokenizer,
        plan: &Plan,
        lines: usize,
        words: &KeyWords,
    ) -> Vec<BuiltPrompt> {
        let mut draw = plan.draw.clone();
        let mut haystack: Vec<Line> = (0..lines)
            .map(|_| match self.type_haystack {
                Haystack::Needle => loop {
                    let key = self.type_needle_k.draw(&mut draw, words);
                    let value = self.type_needle_v.draw(&mut draw, words);
                    if !plan.keys.contains(&key) {
                        break Line::Haystack(self.needle(&key, &value));
                    }
                },
                _ => Line::Haystack(NOISE.to_owned()),
            })
            .collect();
        let mut at = draw.sample(lines, plan.needles.len());
        at.sort_unstable_by(|a, b| b.cmp(a));
        for (needle, position) in at.into_iter().enumerate() {
            haystack.insert(position, Line::Needle(needle));
        }
        (0..self.questions)
            .map(|question| {
                let [head, asked, prefix] = self.template(&plan.queries[question]);
                let mut names = Self::span_names(plan, question);
                let mut prompt = Assembly::open(tokenizer, self.template);
                prompt.text(&head);
                for line in &haystack {
                    match *line {
                        Line::Haystack(ref text) => prompt.text(&format!("\n{text}")),
                        Line::Needle(i) => prompt.span(
                            std::mem::take(&mut names[i]),
                            &format!("\n{}", plan.needles[i].0),
                        ),
                    }
                }
                prompt.span("question".into(), &format!("\n{asked}"));
                prompt.close(&prefix, self.generate, plan.answers[question].clone())
            })
            .collect()
    }
}

/// The recipe kind.
const KIND: &str = "ruler-niah";

impl Task for NiahTask {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        for (field, value) in [
            ("num_needle_k", self.num_needle_k),
            ("num_needle_v", self.num_needle_v),
            ("num_needle_q", self.num_needle_q),
            ("questions", self.questions),
        ] {
            if value == 0 {
                return Err((field, "must be at least 1".into()));
            }
        }
        if self.num_keys() * self.num_needle_v > 40 && self.type_haystack == Haystack::Essay {
            return Err((
                "num_needle_k",
                "at most 40 needles (the larger of num_needle_k and num_needle_q × questions, \
                 times num_needle_v) fit RULER's 40 depths"
                    .into(),
            ));
        }
        Ok(())
    }

    fn prompts(&self, sources: &Sources<'_>) -> Result<Vec<BuiltPrompt>, RecipeError> {
        let uses_words = [self.type_needle_k, self.type_needle_v].contains(&Kind::Words);
        let words = if uses_words {
            sources.key_words(self.words)?
        } else {
            (Vec::new(), Vec::new())
        };
        if uses_words && (words.0.len() < 2 || words.1.len() < 2) {
            return Err(RecipeError::Task {
                task: KIND,
                rule: "`words` keys or values need words of 4 to 12 letters in the essays".into(),
            });
        }
        let plan = self.plan(&words);
        let tokenizer = sources.tokenizer;
        match self.type_haystack {
            Haystack::Essay => {
                let essay = sources.essay_tokens(self.prompt_tokens)?;
                fit(KIND, self.prompt_tokens, 0, |n| {
                    Ok(self.on_essay(tokenizer, &plan, &essay[..n]))
                })
            }
            Haystack::Noise | Haystack::Needle => {
                fit(KIND, self.prompt_tokens, plan.needles.len(), |n| {
                    Ok(self.on_lines(tokenizer, &plan, n, &words))
                })
            }
        }
    }

    fn solve(&self, text: &str) -> Vec<String> {
        let question = after_last(text, "\nWhat ");
        let Some(query) = question
            .split_once(" for ")
            .and_then(|(_, rest)| rest.split_once(" mentioned in the provided text?"))
            .map(|(query, _)| query)
        else {
            return Vec::new();
        };
        let asked: Vec<&str> = query
            .split(", and ")
            .flat_map(|part| part.split(", "))
            .collect();
        text.split("One of the special magic ")
            .skip(1)
            .filter_map(|needle| {
                let (_, rest) = needle.split_once(" for ")?;
                let (key, rest) = rest.split_once(" is: ")?;
                let (value, _) = rest.split_once('.')?;
                asked.contains(&key).then(|| value.to_owned())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::super::testing::{essays, Bytes};
    use super::*;

    fn task(toml: &str) -> NiahTask {
        toml::from_str(&format!("prompt_tokens = 3000\n{toml}")).unwrap()
    }

    fn built(task: &NiahTask) -> BuiltPrompt {
        let (_dir, essays) = essays(400);
        build(task, &Bytes, &essays).unwrap()
    }

    #[test]
    fn a_single_needle_in_essays_fills_the_length_and_states_its_value() {
        let prompt = built(&task(""));
        assert!(
            prompt.ids.len() <= 3000 && prompt.ids.len() > 2950,
            "{}",
            prompt.ids.len()
        );
        assert_eq!(prompt.answers.len(), 1);
        assert_eq!(prompt.answers[0].len(), 7);
        let text = Bytes.decode(&prompt.ids);
        assert!(
            text.starts_with("A special magic number is hidden"),
            "{text}"
        );
        assert!(
            text.ends_with("mentioned in the provided text is"),
            "{text}"
        );
        let needle = &prompt.spans[0];
        assert_eq!(needle.name, "needle");
        let needle_text = Bytes.decode(&prompt.ids[needle.start..needle.end]);
        assert!(
            needle_text.ends_with(&format!("is: {}.", prompt.answers[0])),
            "{needle_text}"
        );
        assert_eq!(prompt.spans[1].name, "question");
        assert_eq!(prompt.generate, 128);
    }

    #[test]
    fn multi_key_multi_value_and_multi_query_ask_what_rulers_settings_say() {
        let multikey = built(&task("num_needle_k = 4"));
        assert_eq!(multikey.answers.len(), 1);
        let names: Vec<&str> = multikey.spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names.iter().filter(|n| n.starts_with("distractor")).count(),
            3
        );
        let multivalue = built(&task("num_needle_v = 4"));
        assert_eq!(multivalue.answers.len(), 4);
        assert!(Bytes
            .decode(&multivalue.ids)
            .contains("What are all the special magic numbers"));
        let multiquery = built(&task("num_needle_q = 4\ntype_haystack = \"noise\""));
        assert_eq!(multiquery.answers.len(), 4);
        assert!(Bytes.decode(&multiquery.ids).contains(", and "));
        let needles = built(&task(
            "type_haystack = \"needle\"\ntype_needle_k = \"uuids\"\ntype_needle_v = \"uuids\"",
        ));
        let text = Bytes.decode(&needles.ids);
        assert!(
            text.matches("One of the special magic uuids").count() > 20,
            "{text}"
        );
        assert_eq!(needles.answers[0].len(), 36);
    }

    #[test]
    fn the_same_seed_gives_the_same_prompt_and_another_seed_another() {
        let first = built(&task("type_haystack = \"noise\""));
        assert_eq!(built(&task("type_haystack = \"noise\"")), first);
        assert_ne!(
            built(&task("type_haystack = \"noise\"\nseed = 7")).answers,
            first.answers
        );
    }

    #[test]
    fn the_solver_reads_only_the_keys_asked() {
        let task = task("num_needle_k = 2");
        let text = "x One of the special magic numbers for a-b is: 1234567. One of the special \
                    magic numbers for c-d is: 7654321.\nWhat is the special magic number for c-d \
                    mentioned in the provided text?";
        assert_eq!(task.solve(text), ["7654321"]);
    }

    #[test]
    fn several_questions_share_the_context_and_ask_keys_of_their_own() {
        let (_dir, essays) = essays(400);
        let one = built(&task("num_needle_k = 4"));
        let recipe = crate::recipe::Recipe::RulerNiah(task("num_needle_k = 4\nquestions = 3"));
        let questions = recipe
            .build_questions(&Bytes, &essays, std::path::Path::new("."))
            .unwrap();
        let prompts = &questions.prompts;
        assert_eq!(prompts.len(), 3);
        // The first question asks what one question asks; the others ask other keys.
        assert_eq!(prompts[0].answers, one.answers);
        let mut answers: Vec<&String> = prompts.iter().flat_map(|p| &p.answers).collect();
        answers.dedup();
        assert_eq!(answers.len(), 3, "{answers:?}");
        for prompt in prompts {
            assert!(prompt.ids.len() <= 3000);
            assert_eq!(
                prompt.ids[..questions.shared],
                prompts[0].ids[..questions.shared]
            );
            let question = prompt.spans.iter().find(|s| s.name == "question").unwrap();
            assert_eq!(question.start, questions.shared);
            // Its needle is the one span named so; the other three keys' are distractors.
            let names: Vec<&str> = prompt.spans.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names.iter().filter(|n| **n == "needle").count(), 1);
            assert_eq!(
                names.iter().filter(|n| n.starts_with("distractor")).count(),
                3
            );
            let needle = prompt.spans.iter().find(|s| s.name == "needle").unwrap();
            let text = Bytes.decode(&prompt.ids[needle.start..needle.end]);
            assert!(
                text.ends_with(&format!("is: {}.", prompt.answers[0])),
                "{text}"
            );
        }
        // A recipe of one question is all context.
        let single = crate::recipe::Recipe::RulerNiah(task("num_needle_k = 4"))
            .build_questions(&Bytes, &essays, std::path::Path::new("."))
            .unwrap();
        assert_eq!(single.shared, single.prompts[0].ids.len());
        assert_eq!(single.prompts, [one]);
    }

    #[test]
    fn more_questions_than_the_depths_hold_are_refused() {
        let err = task("questions = 41").check().unwrap_err();
        assert_eq!(err.0, "num_needle_k");
        assert!(err.1.contains("num_needle_q × questions"), "{}", err.1);
        assert_eq!(task("questions = 0").check().unwrap_err().0, "questions");
        let (_dir, essays) = essays(400);
        let err = crate::recipe::Recipe::RulerNiah(task("questions = 2"))
            .build(&Bytes, &essays, std::path::Path::new("."))
            .unwrap_err()
            .to_string();
        assert!(err.contains("asks 2 questions of one context"), "{err}");
    }

    #[test]
    fn too_many_needles_for_the_length_are_refused() {
        let (_dir, essays) = essays(400);
        let task: NiahTask =
            toml::from_str("prompt_tokens = 300\nnum_needle_k = 8\ntype_haystack = \"noise\"")
                .unwrap();
        let err = build(&task, &Bytes, &essays).unwrap_err().to_string();
        assert!(
            err.starts_with("ruler-niah: prompt_tokens = 300 cannot hold the task"),
            "{err}"
        );
    }
}
