//! RULER's common-words extraction (`scripts/data/synthetic/common_words_extraction.py`, task
//! `cwe`): a numbered list of words in which `num_cw` words appear `freq_cw` times and the others
//! `freq_ucw` times, and a question for the common ones (aggregation over the whole context,
//! where top-k attention is known to fail). As in RULER, prompts under 4,096 tokens (the
//! generated ones counted) use 6 and 1 repetitions and a 20-word example, longer ones
//! `freq_cw`/`freq_ucw` and a 40-word example of 10 and 3. Words are the essays' vocabulary.

use super::{after_last, before, fit, most_frequent, Assembly, Draw, Sources, Task, Writer};
use crate::recipe::{BuiltPrompt, RecipeError};
use serde::Deserialize;

/// RULER's common-words settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommonWords {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
    #[serde(default)]
    pub model: Option<String>,
    /// Prompt length in tokens, template, examples and answer prefix included.
    pub prompt_tokens: usize,
    /// Greedy tokens to generate (RULER's `tokens_to_generate`, 120).
    #[serde(default = "generate")]
    pub generate: usize,
    /// The seed of every random draw (RULER's default, 42).
    #[serde(default = "super::rulers_seed")]
    pub seed: u64,
    /// Where the words come from: `essays` (the default) or `wonderwords` (RULER's nouns,
    /// adjectives and verbs, its list when its own `english_words.json` is too short).
    #[serde(default)]
    pub words: super::WordSource,
    /// The prompt's template: `chat` (the model's own, the default) or `base` (RULER's `base`:
    /// the raw task text after BOS, then the answer prefix).
    #[serde(default)]
    pub template: super::PromptTemplate,
    /// Repetitions of each common word (prompts of 4,096 tokens or more).
    #[serde(default = "freq_cw")]
    pub freq_cw: usize,
    /// Repetitions of each other word (prompts of 4,096 tokens or more).
    #[serde(default = "freq_ucw")]
    pub freq_ucw: usize,
    /// Common words, asked for.
    #[serde(default = "num_cw")]
    pub num_cw: usize,
    /// Worked examples before the task.
    #[serde(default = "one")]
    pub num_fewshot: usize,
}

fn generate() -> usize {
    120
}
fn freq_cw() -> usize {
    30
}
fn freq_ucw() -> usize {
    3
}
fn num_cw() -> usize {
    10
}
fn one() -> usize {
    1
}

const HEAD: &str = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n";

/// One list: its text and its common words.
struct List {
    text: String,
    common: Vec<String>,
}

impl CommonWords {
    /// RULER's `get_example`: `count` words of `words`, the first `num_cw` repeated `common`
    /// times and the rest `other` times, shuffled and numbered.
    fn list(
        &self,
        draw: &mut Draw,
        words: &[String],
        count: usize,
        common: usize,
        other: usize,
    ) -> List {
        let chosen: Vec<&String> = draw
            .sample(words.len(), count)
            .into_iter()
            .map(|i| &words[i])
            .collect();
        let (frequent, rare) = chosen.split_at(self.num_cw);
        let mut list: Vec<&String> = Vec::new();
        for _ in 0..common {
            list.extend(frequent);
        }
        for _ in 0..other {
            list.extend(rare);
        }
        draw.shuffle(&mut list);
        List {
            text: numbered(list.into_iter()),
            common: frequent.iter().map(|w| (*w).clone()).collect(),
        }
    }

    fn question(&self) -> String {
        format!(
            "\nQuestion: What are the {} most common words in the above list?",
            self.num_cw
        )
    }

    fn answer_prefix(&self) -> String {
        format!(
            " Answer: The top {} words that appear most often in the list are:",
            self.num_cw
        )
    }

    /// RULER's switch on length: (example words, example repetitions, task repetitions).
    fn sizes(&self) -> (usize, (usize, usize), (usize, usize)) {
        if self.prompt_tokens + self.generate < 4096 {
            (20, (3, 1), (6, 1))
        } else {
            (40, (10, 3), (self.freq_cw, self.freq_ucw))
        }
    }
}

/// "1. word 2. word …"
fn numbered<'a>(words: impl Iterator<Item = &'a String>) -> String {
    words
        .enumerate()
        .map(|(i, word)| format!("{}. {word}", i + 1))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The recipe kind.
const KIND: &str = "ruler-cwe";

impl Task for CommonWords {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        if self.num_cw == 0 || self.num_cw >= 20 {
            return Err((
                "num_cw",
                "must be in [1, 20) (the short example lists 20 words)".into(),
            ));
        }
        if self.freq_ucw == 0 || self.freq_cw <= self.freq_ucw {
            return Err((
                "freq_cw",
                "must exceed freq_ucw, which must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn prompts(&self, sources: &Sources<'_>) -> Result<Vec<BuiltPrompt>, RecipeError> {
        let mut words = sources.list_words(self.words)?;
        let mut draw = Draw::new(self.seed);
        draw.shuffle(&mut words);
        let (example_words, (example_common, example_other), (common, other)) = self.sizes();
        if words.len() < example_words {
            return Err(RecipeError::Task {
                task: KIND,
                rule: format!(
                    "the essays hold {} words, the examples need {example_words}",
                    words.len()
                ),
            });
        }
        let examples: Vec<String> = (0..self.num_fewshot)
            .map(|_| {
                let list = self.list(
                    &mut draw,
                    &words,
                    example_words,
                    example_common,
                    example_other,
                );
                format!(
                    "{HEAD}{}{}{} {}",
                    list.text,
                    self.question(),
                    self.answer_prefix(),
                    numbered(list.common.iter())
                )
            })
            .collect();
        fit(KIND, self.prompt_tokens, self.num_cw + 1, |count| {
            if count > words.len() {
                return Err(RecipeError::Task {
                    task: KIND,
                    rule: format!(
                        "the essays hold {} distinct words, the list needs {count}",
                        words.len()
                    ),
                });
            }
            let list = self.list(&mut draw.clone(), &words, count, common, other);
            let mut prompt = Assembly::open(sources.tokenizer, self.template);
            for example in &examples {
                prompt.text(&format!("{example}\n"));
            }
            prompt.text(&format!("{HEAD}{}", list.text));
            prompt.span("question".into(), &self.question());
            Ok(prompt.close(&self.answer_prefix(), self.generate, list.common))
        })
        .map(|prompt| vec![prompt])
    }

    fn solve(&self, text: &str) -> Vec<String> {
        let body = before(after_last(text, HEAD), "\nQuestion:");
        let words = body.split_whitespace().filter(|item| {
            !item
                .trim_end_matches('.')
                .chars()
                .all(|c| c.is_ascii_digit())
        });
        most_frequent(words, "", self.num_cw)
    }
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::super::testing::{essays, Bytes};
    use super::*;
    use crate::model::TextTokenizer;

    #[test]
    fn short_prompts_repeat_common_words_six_times_after_an_example() {
        let task: CommonWords = toml::from_str("prompt_tokens = 1500\nnum_cw = 3").unwrap();
        let prompt = build(&task, &Bytes, &essays(200).1).unwrap();
        assert!(
            prompt.ids.len() <= 1500 && prompt.ids.len() > 1450,
            "{}",
            prompt.ids.len()
        );
        assert_eq!(prompt.answers.len(), 3);
        let text = Bytes.decode(&prompt.ids);
        let task_part = after_last(&text, HEAD);
        for word in &prompt.answers {
            assert_eq!(
                task_part.matches(&format!(". {word} ")).count(),
                6,
                "{word}: {text}"
            );
        }
        assert_eq!(text.matches(HEAD).count(), 2, "one example, then the task");
        assert!(text.ends_with("The top 3 words that appear most often in the list are:"));
    }

    #[test]
    fn long_prompts_use_the_settings() {
        let task: CommonWords =
            toml::from_str("prompt_tokens = 4096\nfreq_cw = 5\nfreq_ucw = 2\nnum_fewshot = 0")
                .unwrap();
        let (_dir, essays) = essays(30);
        let err = build(&task, &Bytes, &essays).unwrap_err().to_string();
        assert!(err.contains("the essays hold 62 distinct words"), "{err}");
    }

    #[test]
    fn the_solver_needs_a_clear_margin() {
        let task: CommonWords = toml::from_str("prompt_tokens = 2000\nnum_cw = 1").unwrap();
        assert_eq!(
            task.solve(&format!("{HEAD}1. alpha 2. beta 3. alpha\nQuestion:")),
            ["alpha"]
        );
        assert!(task
            .solve(&format!("{HEAD}1. alpha 2. beta\nQuestion:"))
            .is_empty());
    }
}
