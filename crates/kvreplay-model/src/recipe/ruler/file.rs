//! RULER's own prompts: a recipe of kind `ruler-jsonl` reads one sample of a `validation.jsonl`
//! as RULER's `scripts/data/prepare.py` writes it (NVIDIA/RULER, one JSON object a line with
//! `input`, `answer_prefix` and `outputs`), so a user runs kvreplay on the RULER data they
//! already have. The prompt is `input + answer_prefix` as RULER's `scripts/pred/call_api.py` sends
//! it: the file's text already holds its model template (`chat` or `base`), so kvreplay adds only
//! the tokenizer's BOS. `samples = N` takes lines 1 to N (see [`crate::recipe::samples`]).
//!
//! Scoring is RULER's for the synthetic tasks, `string_match_all` (the share of `outputs` the text
//! holds, [`crate::recipe::BuiltPrompt::answer_score`]); its QA tasks score by
//! `string_match_part` and are refused. Spans: `question`, the line that asks (the last line of
//! `input` opening with `What ` or `Question:`), and on the needle tasks a `needle` span (then
//! `needle-2`, …) on the first occurrence of each expected value in the context before it, each
//! the tokens that hold its characters.

use super::super::{with_bos, BuiltPrompt, RecipeError};
use super::nth_span;
use crate::model::TextTokenizer;
use crate::trace::Span;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// RULER's synthetic tasks and the tokens each generates (`scripts/synthetic.yaml` and
/// `scripts/data/synthetic/constants.py`: `tokens_to_generate`).
pub const TASKS: [(&str, usize); 11] = [
    ("niah_single_1", 128),
    ("niah_single_2", 128),
    ("niah_single_3", 128),
    ("niah_multikey_1", 128),
    ("niah_multikey_2", 128),
    ("niah_multikey_3", 128),
    ("niah_multivalue", 128),
    ("niah_multiquery", 128),
    ("vt", 30),
    ("cwe", 120),
    ("fwe", 50),
];

/// A sample of a RULER `validation.jsonl`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulerFile {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
    #[serde(default)]
    pub model: Option<String>,
    /// The `validation.jsonl`, relative to the recipe.
    pub file: PathBuf,
    /// RULER's task name (`niah_single_1`, `vt`, `cwe`, …): its scorer and tokens to generate.
    pub task: String,
    /// The sample: its line of the file, from 1.
    #[serde(default = "first")]
    pub line: usize,
    /// Greedy tokens to generate (default: RULER's for the task).
    #[serde(default)]
    pub generate: Option<usize>,
}

fn first() -> usize {
    1
}

/// One line of a `validation.jsonl`: the fields kvreplay reads.
struct Sample {
    input: String,
    answer_prefix: String,
    outputs: Vec<String>,
}

impl RulerFile {
    /// Checks the settings on their own: the field and the rule broken.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.task.starts_with("qa_") {
            return Err((
                "task",
                format!("`{}` scores by RULER's string_match_part, which kvreplay does not run; its synthetic tasks score by string_match_all", self.task),
            ));
        }
        if !TASKS.iter().any(|(name, _)| *name == self.task) {
            let names: Vec<&str> = TASKS.iter().map(|(name, _)| *name).collect();
            return Err((
                "task",
                format!("unknown task `{}` (known: {})", self.task, names.join(", ")),
            ));
        }
        if self.line == 0 {
            return Err(("line", "counts from 1".into()));
        }
        Ok(())
    }

    /// The tokens to generate: the recipe's, or RULER's default for the task.
    fn generate(&self) -> usize {
        let default = TASKS.iter().find(|(name, _)| *name == self.task);
        self.generate
            .unwrap_or_else(|| default.map_or(128, |&(_, tokens)| tokens))
    }

    /// Builds the prompt of line [`line`](Self::line) of the file (resolved against `base`).
    pub fn build(
        &self,
        tokenizer: &dyn TextTokenizer,
        base: &Path,
    ) -> Result<BuiltPrompt, RecipeError> {
        let path = base.join(&self.file);
        let sample = read_sample(&path, self.line)?;
        let question = question_start(&sample.input);
        let needles = match self.task.starts_with("niah") {
            true => needle_ranges(
                &sample.input[..question.unwrap_or(sample.input.len())],
                &sample.outputs,
            ),
            false => Vec::new(),
        };
        let question_at = question.unwrap_or(sample.input.len());
        let question_end = sample.input[question_at..]
            .find('\n')
            .map_or(sample.input.len(), |n| question_at + n);
        let mut marked: Vec<(String, (usize, usize))> = needles
            .iter()
            .enumerate()
            .map(|(index, &range)| (nth_span("needle", index), range))
            .collect();
        if question.is_some() {
            marked.push(("question".into(), (question_at, question_end)));
        }
        // One piece, as RULER tokenizes it; the spans are found by their characters.
        let text = sample.input.clone() + &sample.answer_prefix;
        let body = tokenizer.encode(&text);
        let ids = with_bos(tokenizer, body.clone());
        let bos = ids.len() - body.len();
        let spans = marked
            .into_iter()
            .map(|(name, (start, end))| Span {
                name,
                start: bos + token_of(tokenizer, &body, start),
                end: bos + tokens_through(tokenizer, &body, end),
            })
            .collect();
        Ok(BuiltPrompt {
            ids,
            spans,
            generate: self.generate(),
            answers: sample.outputs,
        })
    }
}

/// The index of the token holding character `offset` of the decoded `ids`: the most tokens whose
/// text ends at or before it.
fn token_of(tokenizer: &dyn TextTokenizer, ids: &[u32], offset: usize) -> usize {
    let (mut low, mut high) = (0, ids.len());
    while low < high {
        let middle = (low + high).div_ceil(2);
        match tokenizer.decode(&ids[..middle]).len() <= offset {
            true => low = middle,
            false => high = middle - 1,
        }
    }
    low
}

/// The fewest tokens whose decoded text reaches character `offset`.
fn tokens_through(tokenizer: &dyn TextTokenizer, ids: &[u32], offset: usize) -> usize {
    let (mut low, mut high) = (0, ids.len());
    while low < high {
        let middle = (low + high) / 2;
        match tokenizer.decode(&ids[..middle]).len() >= offset {
            true => high = middle,
            false => low = middle + 1,
        }
    }
    low
}

/// The number of samples (non-empty lines) of a `validation.jsonl`.
pub fn count_samples(path: &Path) -> Result<usize, RecipeError> {
    Ok(sample_lines(&read(path)?).len())
}

/// The samples of a `validation.jsonl`'s text: its non-empty lines.
fn sample_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .collect()
}

fn read(path: &Path) -> Result<String, RecipeError> {
    std::fs::read_to_string(path).map_err(|source| RecipeError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Line `line` (from 1, empty lines not counted) of `path`, its fields checked.
fn read_sample(path: &Path, line: usize) -> Result<Sample, RecipeError> {
    let text = read(path)?;
    let rule = |field: &'static str, rule: String| RecipeError::Line {
        path: path.to_owned(),
        line,
        field,
        rule,
    };
    let samples = sample_lines(&text);
    let raw = samples
        .get(line - 1)
        .ok_or_else(|| rule("line", format!("the file has {} samples", samples.len())))?;
    let json: serde_json::Value =
        serde_json::from_str(raw).map_err(|err| rule("line", format!("not JSON: {err}")))?;
    let string = |field: &'static str| -> Result<String, RecipeError> {
        match &json[field] {
            serde_json::Value::String(text) => Ok(text.clone()),
            serde_json::Value::Null => Err(rule(field, "missing".into())),
            _ => Err(rule(field, "must be a string".into())),
        }
    };
    let (input, answer_prefix) = (string("input")?, string("answer_prefix")?);
    let outputs: Vec<String> = match &json["outputs"] {
        serde_json::Value::Null => return Err(rule("outputs", "missing".into())),
        serde_json::Value::Array(items) => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| rule("outputs", "must be a list of strings".into()))?,
        _ => return Err(rule("outputs", "must be a list of strings".into())),
    };
    if outputs.is_empty() || outputs.iter().any(|o| o.trim().is_empty()) {
        return Err(rule(
            "outputs",
            "must hold at least one expected string, none empty".into(),
        ));
    }
    Ok(Sample {
        input,
        answer_prefix,
        outputs,
    })
}

/// Where the question starts: the last line of `input` that opens with `What ` or `Question:`
/// (RULER's templates ask on such a line after the context).
fn question_start(input: &str) -> Option<usize> {
    ["\nWhat ", "\nQuestion:"]
        .iter()
        .filter_map(|opening| input.rfind(opening).map(|at| at + 1))
        .max()
}

/// The first occurrence of each expected value in `context`, in order of position (a value not
/// found, or overlapping one found before, is left unmarked).
fn needle_ranges(context: &str, outputs: &[String]) -> Vec<(usize, usize)> {
    let mut ranges: Vec<(usize, usize)> = outputs
        .iter()
        .filter_map(|output| {
            context
                .find(output.as_str())
                .map(|at| (at, at + output.len()))
        })
        .collect();
    ranges.sort_unstable();
    ranges.dedup_by(|later, earlier| later.0 < earlier.1);
    ranges
}

#[cfg(test)]
mod tests {
    use super::super::testing::Bytes;
    use super::*;

    const LINE: &str = r#"{"index": 0, "input": "Some special magic numbers are hidden.\nOne of the special magic numbers for tall-river is: 1234567.\nNoise.\nWhat are all the special magic numbers for tall-river mentioned in the provided text?", "outputs": ["1234567"], "length": 80, "length_w_model_temp": 80, "answer_prefix": " The special magic numbers for tall-river mentioned in the provided text are"}"#;

    fn file(lines: &[&str]) -> (tempfile::TempDir, RulerFile) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("validation.jsonl"), lines.join("\n") + "\n").unwrap();
        let recipe = RulerFile {
            model: None,
            file: "validation.jsonl".into(),
            task: "niah_multikey_1".into(),
            line: 1,
            generate: None,
        };
        (dir, recipe)
    }

    #[test]
    fn a_line_is_its_input_then_its_answer_prefix_with_the_needle_and_question_marked() {
        let (dir, recipe) = file(&[LINE]);
        let prompt = recipe.build(&Bytes, dir.path()).unwrap();
        let text = Bytes.decode(&prompt.ids);
        assert!(
            text.starts_with("Some special magic numbers are hidden.\nOne of"),
            "{text}"
        );
        assert!(text.ends_with("text?\n The special magic numbers for tall-river mentioned in the provided text are") || text.ends_with("text? The special magic numbers for tall-river mentioned in the provided text are"), "{text}");
        let span = |name: &str| {
            let span = prompt.spans.iter().find(|s| s.name == name).unwrap();
            Bytes.decode(&prompt.ids[span.start..span.end])
        };
        assert_eq!(span("needle"), "1234567");
        assert_eq!(
            span("question"),
            "What are all the special magic numbers for tall-river mentioned in the provided text?"
        );
        assert_eq!(prompt.answers, ["1234567"]);
        assert_eq!(prompt.generate, 128);
        assert_eq!(prompt.answer_score("The numbers are 1234567."), Some(1.0));
    }

    #[test]
    fn bad_lines_name_the_file_line_and_field() {
        let missing = r#"{"input": "x", "outputs": ["1"]}"#;
        let empty = r#"{"input": "x", "answer_prefix": " A:", "outputs": []}"#;
        let (dir, recipe) = file(&[LINE, missing, empty]);
        let at = |line: usize| {
            RulerFile {
                line,
                ..recipe.clone()
            }
            .build(&Bytes, dir.path())
            .unwrap_err()
            .to_string()
        };
        assert!(
            at(2).ends_with("validation.jsonl: line 2: field `answer_prefix`: missing"),
            "{}",
            at(2)
        );
        assert!(
            at(3).contains("line 3: field `outputs`: must hold at least one"),
            "{}",
            at(3)
        );
        assert!(
            at(4).contains("line 4: field `line`: the file has 3 samples"),
            "{}",
            at(4)
        );
        assert_eq!(
            count_samples(&dir.path().join("validation.jsonl")).unwrap(),
            3
        );
    }

    #[test]
    fn tasks_are_rulers_synthetic_ones() {
        let (_dir, recipe) = file(&[LINE]);
        let with = |task: &str| {
            RulerFile {
                task: task.into(),
                ..recipe.clone()
            }
            .check()
        };
        assert!(with("vt").is_ok());
        assert!(with("qa_1").unwrap_err().1.contains("string_match_part"));
        assert!(with("niah")
            .unwrap_err()
            .1
            .contains("unknown task `niah` (known: niah_single_1"));
        assert_eq!(
            RulerFile {
                task: "vt".into(),
                ..recipe.clone()
            }
            .generate(),
            30
        );
        assert_eq!(
            RulerFile {
                generate: Some(7),
                ..recipe
            }
            .generate(),
            7
        );
    }
}
