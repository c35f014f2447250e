//! RULER's variable tracking (`scripts/data/synthetic/variable_tracking.py`, task `vt`): chains
//! `VAR A = 12345`, `VAR B = VAR A`, … hidden one statement per line among noise lines, and a
//! question for every variable that ends up holding the first chain's value (a multi-hop trace).
//! As in RULER, a worked example (3-letter variables, its own noise, its answer) comes first; it
//! fills `example_tokens` tokens (RULER's is made at 500), and 0 leaves it out. RULER's essay
//! haystack for this task is not offered: its configuration uses noise.

use super::niah::NOISE;
use super::{after_last, before, fit, nth_span, Assembly, Draw, Sources, Task, Writer};
use crate::model::TextTokenizer;
use crate::recipe::{BuiltPrompt, RecipeError};
use serde::Deserialize;

/// RULER's variable-tracking settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariableTracking {
    /// The model that runs it (a name of `kvreplay fetch --model`, default `smollm2-135m`;
    /// or `gguf:PATH`, a GGUF on disk; or `hf:` and a Hugging Face hub id or directory).
    #[serde(default)]
    pub model: Option<String>,
    /// Prompt length in tokens, template, example and answer prefix included.
    pub prompt_tokens: usize,
    /// Greedy tokens to generate (RULER's `tokens_to_generate`, 30).
    #[serde(default = "generate")]
    pub generate: usize,
    /// The seed of every random draw (RULER's default, 42).
    #[serde(default = "super::rulers_seed")]
    pub seed: u64,
    /// The prompt's template: `chat` (the model's own, the default) or `base` (RULER's `base`:
    /// the raw task text after BOS, then the answer prefix).
    #[serde(default)]
    pub template: super::PromptTemplate,
    /// Chains of assignments (the first is asked; the others are distractors).
    #[serde(default = "one")]
    pub num_chains: usize,
    /// Assignments after each chain's value.
    #[serde(default = "hops")]
    pub num_hops: usize,
    /// Tokens of the worked example before the task (0: none).
    #[serde(default = "example_tokens")]
    pub example_tokens: usize,
}

fn generate() -> usize {
    30
}
fn one() -> usize {
    1
}
fn hops() -> usize {
    4
}
fn example_tokens() -> usize {
    500
}

const HEAD: &str =
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n";

/// The chains of one prompt: each chain's variables and value.
#[derive(Clone)]
struct Chains {
    variables: Vec<Vec<String>>,
    values: Vec<u64>,
}

impl Chains {
    /// `chains` chains of `hops` hops over distinct `letters`-letter names, each with a value in
    /// RULER's range (`np.random.randint(10000, 99999)`).
    fn draw(draw: &mut Draw, chains: usize, hops: usize, letters: usize) -> Self {
        let mut names: Vec<String> = Vec::new();
        while names.len() < chains * (hops + 1) {
            let name = draw.letters(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", letters);
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Self {
            variables: names.chunks(hops + 1).map(<[String]>::to_vec).collect(),
            values: (0..chains).map(|_| draw.between(10_000, 99_998)).collect(),
        }
    }

    /// Statement `hop` of chain `chain`, as RULER writes it (trailing space included).
    fn statement(&self, chain: usize, hop: usize) -> String {
        let names = &self.variables[chain];
        match hop {
            0 => format!("VAR {} = {}", names[0], self.values[chain]),
            _ => format!("VAR {} = VAR {} ", names[hop], names[hop - 1]),
        }
    }

    /// `lines` noise lines with every chain's statements inserted in order at random lines, as
    /// RULER inserts them: (chain, hop) for a statement, `None` for noise.
    fn haystack(&self, draw: &mut Draw, lines: usize) -> Vec<Option<(usize, usize)>> {
        let mut haystack = vec![None; lines];
        for (chain, names) in self.variables.iter().enumerate() {
            let mut at = draw.sample(haystack.len(), names.len());
            at.sort_unstable();
            for (hop, position) in at.into_iter().enumerate() {
                haystack.insert(position + hop, Some((chain, hop)));
            }
        }
        haystack
    }

    /// The task's text from its head to its question, each statement of the first chain a span.
    fn write(&self, haystack: &[Option<(usize, usize)>], out: &mut dyn Writer) {
        out.text(HEAD);
        for line in haystack {
            match *line {
                None => out.text(&format!("\n{NOISE}")),
                Some((0, hop)) => out.span(
                    nth_span("chain", hop),
                    &format!("\n{}", self.statement(0, hop)),
                ),
                Some((chain, hop)) => out.text(&format!("\n{}", self.statement(chain, hop))),
            }
        }
        out.span(
            "question".into(),
            &format!(
                "\nQuestion: Find all variables that are assigned the value {} in the text above.",
                self.values[0]
            ),
        );
    }

    /// RULER's answer prefix.
    fn answer_prefix(&self) -> String {
        format!(
            " Answer: According to the chain(s) of variable assignment in the text above, {} variables are assigned the value {}, they are: ",
            self.variables[0].len(),
            self.values[0]
        )
    }
}

impl VariableTracking {
    /// RULER's worked example: 3-letter names, its own noise, its answer after its prefix.
    fn example(&self, tokenizer: &dyn TextTokenizer) -> Result<Vec<u32>, RecipeError> {
        if self.example_tokens == 0 {
            return Ok(Vec::new());
        }
        let mut draw = Draw::new(!self.seed);
        let chains = Chains::draw(&mut draw, self.num_chains, self.num_hops.min(10), 3);
        let built = fit(
            KIND,
            self.example_tokens,
            chains.variables[0].len(),
            |lines| {
                let haystack = chains.haystack(&mut draw.clone(), lines);
                let mut example = String::new();
                chains.write(&haystack, &mut example);
                example.push_str(&chains.answer_prefix());
                example.push(' ');
                example.push_str(&chains.variables[0].join(" "));
                example.push('\n');
                Ok(BuiltPrompt {
                    ids: tokenizer.encode(&example),
                    spans: Vec::new(),
                    generate: 0,
                    answers: Vec::new(),
                })
            },
        )?;
        Ok(built.ids)
    }
}

/// The recipe kind.
const KIND: &str = "ruler-vt";

impl Task for VariableTracking {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        if self.num_chains == 0 {
            return Err(("num_chains", "must be at least 1".into()));
        }
        if self.num_hops == 0 {
            return Err(("num_hops", "must be at least 1".into()));
        }
        if self.example_tokens >= self.prompt_tokens {
            return Err((
                "example_tokens",
                format!("must be below prompt_tokens ({})", self.prompt_tokens),
            ));
        }
        Ok(())
    }

    fn prompts(&self, sources: &Sources<'_>) -> Result<Vec<BuiltPrompt>, RecipeError> {
        let tokenizer = sources.tokenizer;
        let example = self.example(tokenizer)?;
        let mut draw = Draw::new(self.seed);
        let chains = Chains::draw(&mut draw, self.num_chains, self.num_hops, 5);
        let least = self.num_chains * (self.num_hops + 1);
        fit(KIND, self.prompt_tokens, least, |lines| {
            let haystack = chains.haystack(&mut draw.clone(), lines);
            let mut prompt = Assembly::open(tokenizer, self.template);
            prompt.tokens(&example);
            chains.write(&haystack, &mut prompt);
            Ok(prompt.close(
                &chains.answer_prefix(),
                self.generate,
                chains.variables[0].clone(),
            ))
        })
        .map(|prompt| vec![prompt])
    }

    fn solve(&self, text: &str) -> Vec<String> {
        let task = after_last(text, HEAD.trim_end());
        let body = before(task, "\nQuestion:");
        let Some(asked) = after_last(task, "assigned the value ")
            .split([' ', ','])
            .next()
            .and_then(|value| value.parse::<u64>().ok())
        else {
            return Vec::new();
        };
        let mut values = std::collections::BTreeMap::<&str, u64>::new();
        let mut aliases = Vec::new();
        for statement in body
            .lines()
            .filter_map(|line| line.trim().strip_prefix("VAR "))
        {
            let Some((name, source)) = statement.split_once(" = ") else {
                continue;
            };
            match source.trim().strip_prefix("VAR ") {
                Some(other) => aliases.push((name, other)),
                None => {
                    if let Ok(value) = source.trim().parse() {
                        values.insert(name, value);
                    }
                }
            }
        }
        while let Some(at) = aliases
            .iter()
            .position(|(_, from)| values.contains_key(from))
        {
            let (name, from) = aliases.swap_remove(at);
            values.insert(name, values[from]);
        }
        values
            .into_iter()
            .filter(|&(_, value)| value == asked)
            .map(|(name, _)| name.to_owned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::super::testing::{essays, Bytes};
    use super::*;

    fn built(toml: &str) -> BuiltPrompt {
        let task: VariableTracking = toml::from_str(&format!(
            "prompt_tokens = 2000
{toml}"
        ))
        .unwrap();
        build(&task, &Bytes, &essays(1).1).unwrap()
    }

    #[test]
    fn a_chain_is_hidden_in_noise_after_a_worked_example() {
        let prompt = built("example_tokens = 1000");
        assert!(
            prompt.ids.len() <= 2000 && prompt.ids.len() > 1900,
            "{}",
            prompt.ids.len()
        );
        assert_eq!(prompt.answers.len(), 5);
        let text = Bytes.decode(&prompt.ids);
        assert_eq!(
            text.matches(HEAD.trim_end()).count(),
            2,
            "the example, then the task"
        );
        assert!(
            text.contains("5 variables are assigned the value"),
            "{text}"
        );
        assert!(text.ends_with(", they are: "), "{text}");
        let spans: Vec<&str> = prompt.spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            spans,
            ["chain", "chain-2", "chain-3", "chain-4", "chain-5", "question"]
        );
        let first = &prompt.spans[0];
        let statement = Bytes.decode(&prompt.ids[first.start..first.end]);
        assert!(
            statement.starts_with(&format!("\nVAR {} = ", prompt.answers[0])),
            "{statement}"
        );
    }

    #[test]
    fn distractor_chains_and_no_example() {
        let prompt = built(
            "num_chains = 2
num_hops = 2
example_tokens = 0",
        );
        assert_eq!(prompt.answers.len(), 3);
        let text = Bytes.decode(&prompt.ids);
        assert_eq!(text.matches("VAR ").count(), 2 * 3 + 2 * 2);
        assert_eq!(text.matches(HEAD.trim_end()).count(), 1);
    }

    #[test]
    fn the_solver_follows_the_assignments() {
        let task: VariableTracking = toml::from_str("prompt_tokens = 2000").unwrap();
        let text = format!(
            "{HEAD}\nVAR AB = 12345\nnoise\nVAR CD = VAR AB \nVAR EF = 54321\nVAR GH = VAR CD \nQuestion: Find all variables that are assigned the value 12345 in the text above. Answer: …"
        );
        assert_eq!(task.solve(&text), ["AB", "CD", "GH"]);
    }
}
