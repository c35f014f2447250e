//! RULER's frequent-words extraction (`scripts/data/synthetic/freq_words_extraction.py`, task
//! `fwe`): coded words (random letters) drawn with Zipf frequencies, the most frequent one
//! written as dots, and a question for the three most frequent real ones. The vocabulary holds
//! `vocab_size` words (RULER's default: a fiftieth of the length); word of rank k appears
//! ⌊n·k^−α / ζ(α)⌋ times, n grown until the prompt is full.

use super::{after_last, before, fit, most_frequent, Assembly, Draw, Sources, Task, Writer};
use crate::recipe::{BuiltPrompt, RecipeError};
use serde::Deserialize;

/// RULER's frequent-words settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrequentWords {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
    #[serde(default)]
    pub model: Option<String>,
    /// Prompt length in tokens, template and answer prefix included.
    pub prompt_tokens: usize,
    /// Greedy tokens to generate (RULER's `tokens_to_generate`, 50).
    #[serde(default = "generate")]
    pub generate: usize,
    /// The seed of every random draw (RULER's default, 42).
    #[serde(default = "super::rulers_seed")]
    pub seed: u64,
    /// The prompt's template: `chat` (the model's own, the default) or `base` (RULER's `base`:
    /// the raw task text after BOS, then the answer prefix).
    #[serde(default)]
    pub template: super::PromptTemplate,
    /// The Zipf exponent (RULER's default, 2).
    #[serde(default = "alpha")]
    pub alpha: f64,
    /// Letters per coded word (RULER's default, 6).
    #[serde(default = "coded_wordlen")]
    pub coded_wordlen: usize,
    /// Coded words in the vocabulary (default: `prompt_tokens / 50`).
    #[serde(default)]
    pub vocab_size: Option<usize>,
}

fn generate() -> usize {
    50
}
fn alpha() -> f64 {
    2.0
}
fn coded_wordlen() -> usize {
    6
}

const HEAD: &str = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. ";
const QUESTION: &str = "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?";
const ANSWER_PREFIX: &str =
    " Answer: According to the coded text above, the three most frequently appeared words are:";
/// The most frequent word's spelling: noise.
const DOTS: &str = "...";

impl FrequentWords {
    fn vocab_size(&self) -> usize {
        self.vocab_size.unwrap_or(self.prompt_tokens / 50)
    }

    /// RULER's vocabulary: distinct coded words, sorted then shuffled, the first made dots.
    fn vocabulary(&self, draw: &mut Draw) -> Vec<String> {
        let mut vocabulary = std::collections::BTreeSet::new();
        while vocabulary.len() < self.vocab_size() {
            vocabulary.insert(draw.letters(b"abcdefghijklmnopqrstuvwxyz", self.coded_wordlen));
        }
        let mut vocabulary: Vec<String> = vocabulary.into_iter().collect();
        draw.shuffle(&mut vocabulary);
        vocabulary[0] = DOTS.to_owned();
        vocabulary
    }

    /// RULER's `gen_text`: each word ⌊n·k^−α/ζ(α)⌋ times, shuffled.
    fn text(&self, draw: &mut Draw, vocabulary: &[String], n: usize) -> String {
        let zeta = zeta(self.alpha);
        let mut words: Vec<&str> = Vec::new();
        for (rank, word) in vocabulary.iter().enumerate() {
            let count = (n as f64 * ((rank + 1) as f64).powf(-self.alpha) / zeta) as usize;
            words.extend(std::iter::repeat_n(word.as_str(), count));
        }
        draw.shuffle(&mut words);
        words.join(" ")
    }
}

/// The Riemann zeta function at `s > 1`: the first 1,000 terms, then the Euler–Maclaurin tail
/// (error below 1e-15 for s ≥ 1.1).
fn zeta(s: f64) -> f64 {
    const N: f64 = 1000.0;
    let head: f64 = (1..1000).map(|k| (k as f64).powf(-s)).sum();
    head + N.powf(1.0 - s) / (s - 1.0) + N.powf(-s) / 2.0 + s * N.powf(-s - 1.0) / 12.0
}

/// The recipe kind.
const KIND: &str = "ruler-fwe";

impl Task for FrequentWords {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        if self.alpha.is_nan() || self.alpha < 1.1 {
            return Err(("alpha", "must be at least 1.1 (ζ(α) diverges at 1)".into()));
        }
        if !(2..=12).contains(&self.coded_wordlen) {
            return Err(("coded_wordlen", "must be in [2, 12]".into()));
        }
        let size = self.vocab_size();
        if size < 5 || size as f64 > 26f64.powi(self.coded_wordlen as i32) / 2.0 {
            return Err((
                "vocab_size",
                format!("{size} coded words: must be at least 5 and at most half of 26^coded_wordlen (prompt_tokens ≥ 250 by default)"),
            ));
        }
        Ok(())
    }

    fn prompts(&self, sources: &Sources<'_>) -> Result<Vec<BuiltPrompt>, RecipeError> {
        let mut draw = Draw::new(self.seed);
        let vocabulary = self.vocabulary(&mut draw);
        let answers = vocabulary[1..4].to_vec();
        fit(KIND, self.prompt_tokens, 1, |n| {
            let mut prompt = Assembly::open(sources.tokenizer, self.template);
            prompt.text(&format!(
                "{HEAD}{}",
                self.text(&mut draw.clone(), &vocabulary, n)
            ));
            prompt.span("question".into(), QUESTION);
            Ok(prompt.close(ANSWER_PREFIX, self.generate, answers.clone()))
        })
        .map(|prompt| vec![prompt])
    }

    fn solve(&self, text: &str) -> Vec<String> {
        let body = before(after_last(text, HEAD.trim_end()), "\nQuestion:");
        most_frequent(body.split_whitespace(), DOTS, 3)
    }
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::super::testing::{essays, Bytes};
    use super::*;
    use crate::model::TextTokenizer;

    #[test]
    fn zeta_is_right() {
        assert!((zeta(2.0) - std::f64::consts::PI.powi(2) / 6.0).abs() < 1e-13);
        assert!((zeta(3.0) - 1.202_056_903_159_594_2).abs() < 1e-13);
    }

    #[test]
    fn counts_follow_zipf_and_the_top_three_are_asked() {
        let task: FrequentWords = toml::from_str("prompt_tokens = 3000").unwrap();
        let prompt = build(&task, &Bytes, &essays(1).1).unwrap();
        assert!(
            prompt.ids.len() <= 3000 && prompt.ids.len() > 2980,
            "{}",
            prompt.ids.len()
        );
        let text = Bytes.decode(&prompt.ids);
        let body = before(after_last(&text, HEAD.trim_end()), "\nQuestion:");
        let count = |word: &str| body.split_whitespace().filter(|w| *w == word).count();
        let (dots, second) = (count(DOTS), count(&prompt.answers[0]));
        // Ranks 1 and 2 appear ⌊n/ζ(2)⌋ and ⌊n/(4ζ(2))⌋ times: a ratio of 4 up to rounding.
        assert!(
            (dots as f64 / second as f64 - 4.0).abs() < 0.1,
            "{dots} / {second}"
        );
        assert_eq!(
            prompt.answers.iter().map(|a| a.len()).collect::<Vec<_>>(),
            [6, 6, 6]
        );
    }

    #[test]
    fn a_prompt_too_short_to_rank_three_words_is_refused() {
        let task: FrequentWords =
            toml::from_str("prompt_tokens = 420\ncoded_wordlen = 12").unwrap();
        let err = build(&task, &Bytes, &essays(1).1).unwrap_err().to_string();
        assert!(
            err.starts_with("ruler-fwe: the prompt's text must state its answers"),
            "{err}"
        );
    }
}
