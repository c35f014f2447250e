//! Prompts as samples: a RULER recipe with `samples = N` stands for N prompts of its task, each
//! drawn with a seed of its own, so that keys, values, needle depths, words and chains differ
//! between them (RULER draws `num_samples` prompts per task, 500 by default,
//! `scripts/data/synthetic/niah.py`). Sample `k`'s seed is a hash of the recipe's `seed`, its
//! file name and `k` ([`sample_seed`]): recipes of one name share their samples across lengths
//! and models (so two models answer the same prompts), recipes of different tasks do not, and a
//! sample does not depend on how many there are.
//!
//! A `ruler-jsonl` recipe's samples are the lines of its file instead: sample `k` reads line
//! `k + 1`, and `samples` may not exceed the file's lines.
//!
//! Each sample is written out as a recipe of its own, `<stem>.samples/s<k>.toml` beside the
//! recipe (its text less `samples`, with its seed), so that capture, live mode and sweeps run it
//! as any recipe and it can be run or inspected alone.

use super::RecipeError;
use crate::splitmix;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The most samples a recipe may ask for (RULER's scripts draw up to this many per task).
pub const MAX_SAMPLES: usize = 10_000;

/// The recipe kinds that draw their prompt at random, so that samples differ.
pub(super) const DRAWING_KINDS: [&str; 4] = ["ruler-niah", "ruler-vt", "ruler-cwe", "ruler-fwe"];

/// The `samples` of recipe text (1 when absent), checked: a whole number from 1 to
/// [`MAX_SAMPLES`], on a kind that draws at random.
pub(super) fn samples_of(table: &toml::Table, path: &Path) -> Result<usize, RecipeError> {
    let invalid = |rule: String| RecipeError::Invalid {
        path: path.to_owned(),
        field: "samples",
        rule,
    };
    let Some(value) = table.get("samples") else {
        return Ok(1);
    };
    let samples = value
        .as_integer()
        .filter(|n| (1..=MAX_SAMPLES as i64).contains(n))
        .ok_or_else(|| invalid(format!("must be a whole number from 1 to {MAX_SAMPLES}")))?;
    let kind = table
        .get("kind")
        .and_then(toml::Value::as_str)
        .unwrap_or("");
    if samples > 1 && kind == "ruler-jsonl" {
        let file = table
            .get("file")
            .and_then(toml::Value::as_str)
            .unwrap_or("");
        let data = path.parent().unwrap_or(Path::new("")).join(file);
        let lines = super::ruler::file::count_samples(&data)?;
        if samples as usize > lines {
            return Err(invalid(format!(
                "{} holds {lines} samples, fewer than {samples}",
                data.display()
            )));
        }
        return Ok(samples as usize);
    }
    if samples > 1 && !DRAWING_KINDS.contains(&kind) {
        return Err(invalid(format!(
            "kind `{kind}` draws nothing at random, so its samples would be one prompt: samples need a kind of {} (or ruler-jsonl, whose samples are its file's lines)",
            DRAWING_KINDS.join(", ")
        )));
    }
    Ok(samples as usize)
}

/// The seed of sample `sample` of the recipe named `stem` whose `seed` is `seed`: SplitMix64
/// over the seed, the first eight bytes of the name's SHA-256 and the sample's index, less its
/// lowest bit (63 bits, so that TOML, whose integers are signed, holds it).
pub fn sample_seed(seed: u64, stem: &str, sample: usize) -> u64 {
    let digest = Sha256::digest(stem.as_bytes());
    let name = u64::from_le_bytes(digest[..8].try_into().expect("eight bytes"));
    splitmix::hash(splitmix::hash(seed ^ name) ^ sample as u64) >> 1
}

/// The recipe file of sample `sample` of recipe file `recipe`.
pub fn sample_recipe(recipe: &Path, sample: usize) -> PathBuf {
    let stem = recipe.file_stem().unwrap_or_default().to_string_lossy();
    recipe
        .with_file_name(format!("{stem}.samples"))
        .join(format!("s{sample:03}.toml"))
}

/// The recipe files recipe file `recipe` stands for: itself, or with `samples = N` (N > 1) its N
/// sample recipes, written beside it where they are missing or differ.
pub fn sample_recipes(recipe: &Path) -> Result<Vec<PathBuf>, RecipeError> {
    let text = std::fs::read_to_string(recipe).map_err(|source| RecipeError::Io {
        path: recipe.to_owned(),
        source,
    })?;
    // Checked as written first, so that an error names the file the user edits.
    super::Recipe::parse(&text, recipe)?;
    let table = super::table_of(&text, recipe)?;
    let samples = samples_of(&table, recipe)?;
    if samples == 1 {
        return Ok(vec![recipe.to_owned()]);
    }
    (0..samples)
        .map(|sample| write_sample(recipe, &table, sample))
        .collect()
}

/// Writes sample `sample` of `recipe` (parsed as `table`) unless it is there as is.
fn write_sample(recipe: &Path, table: &toml::Table, sample: usize) -> Result<PathBuf, RecipeError> {
    let stem = recipe.file_stem().unwrap_or_default().to_string_lossy();
    let seed = table
        .get("seed")
        .and_then(toml::Value::as_integer)
        .map_or(super::ruler::rulers_seed(), |seed| seed as u64);
    let mut own = table.clone();
    own.remove("samples");
    let how = match own.get("file").and_then(toml::Value::as_str) {
        // A file's sample is its line; the sample recipe sits a folder down.
        Some(file) => {
            let file = Path::new("..").join(file).display().to_string();
            own.insert("file".into(), toml::Value::String(file));
            own.insert("line".into(), toml::Value::Integer(sample as i64 + 1));
            format!("line {} of its file", sample + 1)
        }
        None => {
            let drawn = sample_seed(seed, &stem, sample);
            own.insert("seed".into(), toml::Value::Integer(drawn as i64));
            format!("seed {drawn} (the hash of its seed {seed}, its name `{stem}` and the sample's index)")
        }
    };
    let path = sample_recipe(recipe, sample);
    let content = format!(
        "# Sample {sample} of {}, written by kvreplay from that recipe:\n# {how}. Edit that recipe, not this file.\n{}",
        recipe.display(),
        toml::to_string(&own).expect("a TOML table serializes")
    );
    let io = |source| RecipeError::Io {
        path: path.clone(),
        source,
    };
    super::Recipe::parse(&content, &path)?;
    if std::fs::read_to_string(&path).ok().as_deref() != Some(content.as_str()) {
        std::fs::create_dir_all(path.parent().expect("a sample recipe has a folder"))
            .map_err(io)?;
        crate::atomic::write(&path, content.as_bytes()).map_err(io)?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn samples_are_recipes_of_their_own_with_seeds_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let text = "kind = \"ruler-niah\"\nprompt_tokens = 1000\ntype_haystack = \"noise\"\ngenerate = 16\nsamples = 3\n";
        let path = recipe(dir.path(), "niah_single_1.toml", text);
        let samples = sample_recipes(&path).unwrap();
        assert_eq!(
            samples,
            (0..3)
                .map(|k| dir
                    .path()
                    .join(format!("niah_single_1.samples/s00{k}.toml")))
                .collect::<Vec<_>>()
        );
        let seeds: Vec<u64> = samples
            .iter()
            .map(
                |sample| match super::super::Recipe::load(sample).unwrap().0 {
                    super::super::Recipe::RulerNiah(task) => task.seed,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert_eq!(
            seeds,
            (0..3)
                .map(|k| sample_seed(42, "niah_single_1", k))
                .collect::<Vec<_>>()
        );
        assert!(seeds[0] != seeds[1] && seeds[1] != seeds[2] && seeds[0] != seeds[2]);
        // Another task of the same seed draws other samples; the same name elsewhere the same.
        assert_ne!(sample_seed(42, "niah_multikey_1", 0), seeds[0]);
        let other = tempfile::tempdir().unwrap();
        let again = recipe(other.path(), "niah_single_1.toml", text);
        let theirs = sample_recipes(&again).unwrap();
        let body = |p: &Path| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .skip(2)
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(body(&theirs[1]), body(&samples[1]));
        // Written once: a second expansion leaves the files as they are.
        let written = std::fs::metadata(&samples[0]).unwrap().modified().unwrap();
        sample_recipes(&path).unwrap();
        assert_eq!(
            std::fs::metadata(&samples[0]).unwrap().modified().unwrap(),
            written
        );
    }

    #[test]
    fn a_files_samples_are_its_lines() {
        let dir = tempfile::tempdir().unwrap();
        let line = |value: u32| {
            format!("{{\"input\": \"Numbers.\\nThe number for a-b is: {value}.\\nWhat is the number for a-b?\", \"answer_prefix\": \" It is\", \"outputs\": [\"{value}\"]}}\n")
        };
        std::fs::write(
            dir.path().join("validation.jsonl"),
            line(1111) + &line(2222) + &line(3333),
        )
        .unwrap();
        let text = "kind = \"ruler-jsonl\"\nfile = \"validation.jsonl\"\ntask = \"niah_single_1\"\nsamples = 2\n";
        let path = recipe(dir.path(), "mine.toml", text);
        let samples = sample_recipes(&path).unwrap();
        assert_eq!(samples.len(), 2);
        let answers: Vec<Vec<String>> = samples
            .iter()
            .map(|sample| {
                let (recipe, base) = super::super::Recipe::load(sample).unwrap();
                let tokenizer = super::super::ruler::testing::Bytes;
                recipe.build(&tokenizer, &[], &base).unwrap().answers
            })
            .collect();
        assert_eq!(answers, [["1111"], ["2222"]]);
        let four = recipe(
            dir.path(),
            "four.toml",
            &text.replace("samples = 2", "samples = 4"),
        );
        let err = sample_recipes(&four).unwrap_err().to_string();
        assert!(
            err.contains("field `samples`: ")
                && err.contains("validation.jsonl holds 3 samples, fewer than 4"),
            "{err}"
        );
    }

    #[test]
    fn a_recipe_without_samples_is_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = recipe(
            dir.path(),
            "a.toml",
            "kind = \"ruler-vt\"\nprompt_tokens = 1000\ngenerate = 30\nsamples = 1\n",
        );
        assert_eq!(sample_recipes(&path).unwrap(), vec![path.clone()]);
        assert!(!dir.path().join("a.samples").exists());
    }

    #[test]
    fn samples_out_of_range_or_on_a_kind_that_draws_nothing_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (text, rule) in [
            (
                "kind = \"ruler-vt\"\nprompt_tokens = 1000\ngenerate = 30\nsamples = 0\n",
                "must be a whole number from 1 to 10000",
            ),
            (
                "kind = \"ruler-vt\"\nprompt_tokens = 1000\ngenerate = 30\nsamples = 10001\n",
                "must be a whole number from 1 to 10000",
            ),
            (
                "kind = \"ruler-vt\"\nprompt_tokens = 1000\ngenerate = 30\nsamples = \"ten\"\n",
                "must be a whole number",
            ),
            (
                "kind = \"chat\"\nmessage = \"hi\"\ngenerate = 4\nsamples = 2\n",
                "kind `chat` draws nothing at random",
            ),
        ] {
            let path = recipe(dir.path(), "bad.toml", text);
            let err = sample_recipes(&path).unwrap_err().to_string();
            assert!(
                err.contains("bad.toml: field `samples`: ") && err.contains(rule),
                "{err}"
            );
            assert!(super::super::Recipe::load(&path)
                .unwrap_err()
                .to_string()
                .contains(rule));
        }
    }
}
