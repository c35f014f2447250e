//! RULER's tasks on the real tokenizers: every shipped RULER recipe builds at about its length
//! (1,000, 2,000 and 4,000 tokens) on its model, its prompt states its answers (each build checks this with the task's own
//! solver) and marks its question, and settings that cannot fit their length are refused.

use crate::common;

use kvreplay_model::model::{CausalLm, Gemma3, TextTokenizer};
use kvreplay_model::recipe::Recipe;
use std::path::Path;

/// RULER's thirteen synthetic tasks less its two QA tasks (which need SQuAD and HotpotQA).
const TASKS: [&str; 11] = [
    "cwe",
    "fwe",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multiquery",
    "niah_multivalue",
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "vt",
];

/// Builds every task of `folder`, recipes of `length` prompt tokens, and checks what each states.
fn check_folder(folder: &str, tokenizer: &dyn TextTokenizer, length: usize) {
    let essays = common::real_assets().require_essays().unwrap();
    for task in TASKS {
        let path = common::repository()
            .join(folder)
            .join(format!("{task}.toml"));
        let (recipe, base) = Recipe::load(&path).unwrap();
        let prompt = recipe
            .build(tokenizer, &essays, &base)
            .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        assert!(
            (length * 9 / 10..=length).contains(&prompt.ids.len()),
            "{}: {} tokens",
            path.display(),
            prompt.ids.len()
        );
        let text = tokenizer.decode(&prompt.ids);
        assert!(!prompt.answers.is_empty());
        for answer in &prompt.answers {
            assert!(
                text.contains(answer.as_str()),
                "{}: {answer}",
                path.display()
            );
        }
        let question = prompt.spans.iter().find(|s| s.name == "question").unwrap();
        assert!(question.end < prompt.ids.len(), "{}", path.display());
        if task.starts_with("niah") {
            let needle = prompt.spans.iter().find(|s| s.name == "needle").unwrap();
            let needle_text = tokenizer.decode(&prompt.ids[needle.start..needle.end]);
            assert!(
                needle_text.contains("One of the special magic"),
                "{needle_text}"
            );
        }
    }
}

/// The task folders of each model and their recipes' length.
const FOLDERS: [(&str, usize); 3] = [("ruler", 1000), ("ruler-2k", 2000), ("ruler-4k", 4000)];

#[test]
fn every_ruler_task_builds_on_smollm2() {
    let model = common::real_model();
    for (folder, length) in FOLDERS {
        check_folder(&format!("traces/{folder}"), model.tokenizer(), length);
    }
}

#[test]
fn every_ruler_task_builds_on_gemma3() {
    let gemma = Gemma3::load(&common::gemma_path()).unwrap();
    for (folder, length) in FOLDERS {
        check_folder(
            &format!("traces/gemma3/{folder}"),
            gemma.tokenizer(),
            length,
        );
    }
}

#[test]
fn a_task_that_cannot_fit_its_length_is_refused() {
    let essays = common::real_assets().require_essays().unwrap();
    let recipe = Recipe::parse(
        "kind = \"ruler-niah\"\nprompt_tokens = 400\nnum_needle_k = 16\ntype_needle_k = \"uuids\"\ntype_needle_v = \"uuids\"\n",
        Path::new("crowded.toml"),
    )
    .unwrap();
    let err = recipe
        .build(common::real_model().tokenizer(), &essays, Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("ruler-niah: prompt_tokens = 400 cannot hold the task"),
        "{err}"
    );
}

/// RULER's own files (`tests/fixtures/ruler-1k-base`, written by RULER's code with SmolLM2's
/// tokenizer): each line builds as a `ruler-jsonl` recipe into the prompt RULER counted (its
/// `length` is the prompt's tokens plus the tokens to generate), with RULER's expected strings,
/// its question marked and, on the needle tasks, each needle's value.
#[test]
fn rulers_own_files_build_to_rulers_lengths() {
    let model = common::real_model();
    let tokenizer = model.tokenizer();
    let fixtures = common::repository().join("tests/fixtures/ruler-1k-base");
    for task in [
        "niah_single_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "vt",
        "fwe",
    ] {
        let folder = fixtures.join(task);
        let lines = std::fs::read_to_string(folder.join("validation.jsonl")).unwrap();
        for (index, line) in lines.lines().enumerate() {
            let json: serde_json::Value = serde_json::from_str(line).unwrap();
            let text = format!(
                "kind = \"ruler-jsonl\"\nfile = \"validation.jsonl\"\ntask = \"{task}\"\nline = {}\n",
                index + 1
            );
            let recipe = Recipe::parse(&text, &folder.join("r.toml")).unwrap();
            let prompt = recipe.build(tokenizer, &[], &folder).unwrap();
            let bos = usize::from(tokenizer.bos().is_some());
            assert_eq!(
                prompt.ids.len() - bos + prompt.generate,
                json["length"].as_u64().unwrap() as usize,
                "{task} line {}",
                index + 1
            );
            let outputs: Vec<String> = serde_json::from_value(json["outputs"].clone()).unwrap();
            assert_eq!(prompt.answers, outputs);
            let question = prompt.spans.iter().find(|s| s.name == "question").unwrap();
            assert!(question.end < prompt.ids.len(), "{task}");
            if task.starts_with("niah") {
                let needle = prompt.spans.iter().find(|s| s.name == "needle").unwrap();
                let value = tokenizer.decode(&prompt.ids[needle.start..needle.end]);
                assert!(
                    outputs.contains(&value.trim().to_string()),
                    "{task}: {value}"
                );
            }
        }
    }
}

/// `words = "wonderwords"` draws as RULER does: a needle key is one of RULER's adjectives and one
/// of its nouns (from the pinned `wonderwords` wheel), and the common words come from its lists.
#[test]
fn rulers_word_lists_give_the_keys_and_the_common_words() {
    let model = common::real_model();
    let lists = common::real_assets().word_lists().unwrap();
    assert_eq!(
        (lists.adjectives.len(), lists.nouns.len(), lists.verbs.len()),
        (912, 6782, 1042)
    );
    let essays = common::real_assets().require_essays().unwrap();
    let build = |text: &str| {
        let recipe = Recipe::parse(text, Path::new("w.toml")).unwrap();
        recipe
            .build(model.tokenizer(), &essays, Path::new("."))
            .unwrap()
    };
    let niah = build("kind = \"ruler-niah\"\nprompt_tokens = 600\ntype_haystack = \"noise\"\nwords = \"wonderwords\"\n");
    let text = model.tokenizer().decode(&niah.ids);
    let key = text
        .split("special magic numbers for ")
        .nth(1)
        .and_then(|rest| rest.split(" is: ").next())
        .unwrap();
    let (adjective, noun) = key.split_once('-').unwrap();
    assert!(lists.adjectives.iter().any(|a| a == adjective), "{key}");
    assert!(lists.nouns.iter().any(|n| n == noun), "{key}");
    let cwe = build("kind = \"ruler-cwe\"\nprompt_tokens = 1000\nwords = \"wonderwords\"\n");
    let vocabulary: std::collections::BTreeSet<&String> = lists
        .nouns
        .iter()
        .chain(&lists.adjectives)
        .chain(&lists.verbs)
        .collect();
    assert_eq!(cwe.answers.len(), 10);
    assert!(
        cwe.answers.iter().all(|w| vocabulary.contains(w)),
        "{:?}",
        cwe.answers
    );
}
