//! Experiment files: parsing rules, a sweep on a fixture trace, resuming, and the report.

use crate::common;

use assert_cmd::Command;
use common::{write_fixture, Shape};
use kvreplay::experiment::Experiment;
use predicates::str::contains;
use std::path::{Path, PathBuf};

const EXPERIMENT: &str = r#"
description = "fixture sweep"
traces = ["fixture.safetensors"]
budgets = [6, 10]

[[policy]]
name = "snapkv"
preset = "snapkv"
window = 2

[[policy]]
name = "tq"
scorer = "true-query"
timing = ["prefill", "streaming"]
window = 2

[[compare]]
a = "tq timing=prefill"
b = "snapkv"
"#;

fn setup(experiment: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_fixture(&dir.path().join("fixture.safetensors"), Shape::default(), 5);
    std::fs::write(dir.path().join("e.toml"), experiment).unwrap();
    dir
}

fn kvreplay(dir: &tempfile::TempDir) -> Command {
    let mut cmd = Command::cargo_bin("kvreplay").unwrap();
    cmd.current_dir(dir.path());
    cmd
}

#[test]
fn sweep_writes_report_rows_and_plots_then_resumes() {
    let dir = setup(EXPERIMENT);
    let first = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    let report = String::from_utf8(first.get_output().stdout.clone()).unwrap();
    let said = String::from_utf8_lossy(&first.get_output().stderr);
    assert!(
        said.contains("e: 6 runs done, 0 already there, in ") && said.trim_end().ends_with(" s"),
        "{said}"
    );
    let results = dir.path().join("results/e");
    for file in [
        "report.md",
        "runs.csv",
        "runs.parquet",
        "retained_mass_vs_budget.png",
        "retained_mass_vs_budget.svg",
        "schedules.png",
        "report.html",
    ] {
        assert!(results.join(file).is_file(), "{file} missing");
    }
    assert!(dir.path().join("results/index.html").is_file());
    // The chart's data beside its pictures, for the page's interactive chart.
    let chart = std::fs::read_to_string(results.join("retained_mass_vs_budget.json")).unwrap();
    let chart: serde_json::Value = serde_json::from_str(&chart).unwrap();
    assert_eq!(chart["mark"], "lines");
    assert!(!chart["series"].as_array().unwrap().is_empty());
    assert_eq!(std::fs::read_dir(results.join("runs")).unwrap().count(), 6);
    let csv = std::fs::read_to_string(results.join("runs.csv")).unwrap();
    assert_eq!(csv.lines().count(), 7);
    assert!(csv.starts_with(
        "id,trace,policy,budget,mean_kept,kv_entries,retained_mass,topk_recall,output_error"
    ));
    insta::assert_snapshot!(report);
    // A rerun skips everything and prints the same report.
    let second = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    assert!(String::from_utf8_lossy(&second.get_output().stderr)
        .contains("e: 0 runs done, 6 already there"));
    assert_eq!(
        String::from_utf8(second.get_output().stdout.clone()).unwrap(),
        report
    );
    // A lost run (killed before its rename) is redone alone; a stray partial file is ignored.
    let runs: Vec<_> = std::fs::read_dir(results.join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    std::fs::remove_file(&runs[0]).unwrap();
    std::fs::write(results.join("runs/stray.partial.123"), b"{half").unwrap();
    let third = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    assert!(String::from_utf8_lossy(&third.get_output().stderr)
        .contains("e: 1 runs done, 5 already there"));
    assert_eq!(
        String::from_utf8(third.get_output().stdout.clone()).unwrap(),
        report
    );
}

#[test]
fn report_agrees_with_replay() {
    let dir = setup(EXPERIMENT);
    kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    let replay = kvreplay(&dir)
        .args([
            "replay",
            "fixture.safetensors",
            "--budget",
            "6",
            "--window",
            "2",
            "--gqa",
            "query-head",
            "--pool",
            "max",
            "--format",
            "json",
        ])
        .assert()
        .success();
    let json: serde_json::Value = serde_json::from_slice(&replay.get_output().stdout).unwrap();
    let mass = json["retained_mass"].as_f64().unwrap();
    let csv = std::fs::read_to_string(dir.path().join("results/e/runs.csv")).unwrap();
    let row = csv
        .lines()
        .find(|l| l.contains(",snapkv,6,"))
        .expect("snapkv at 6");
    let cells: Vec<&str> = row.split(',').collect();
    let stored: f64 = cells[6].parse().unwrap();
    assert!((stored - mass).abs() < 1e-12, "{stored} vs {mass}");
    // Memory in one unit: the report's KV entries per layer are the replay's.
    let entries: f64 = cells[5].parse().unwrap();
    let replayed = json["kv_entries"].as_f64().unwrap();
    assert!((entries - replayed).abs() < 1e-9, "{entries} vs {replayed}");
}

#[test]
fn unknown_keys_and_names_are_listed() {
    let dir = setup(&EXPERIMENT.replace("window = 2\n\n[[policy]]", "windw = 2\n\n[[policy]]"));
    kvreplay(&dir)
        .args(["sweep", "e.toml"])
        .assert()
        .code(2)
        .stderr(
            contains("policy `snapkv`: unknown key `windw`; valid: name, preset,")
                .and(contains("window")),
        );
    let dir = setup(&EXPERIMENT.replace("preset = \"snapkv\"", "preset = \"snapkvv\""));
    kvreplay(&dir)
        .args(["sweep", "e.toml"])
        .assert()
        .code(2)
        .stderr(contains("unknown preset `snapkvv`"));
    let dir = setup(&EXPERIMENT.replace("b = \"snapkv\"", "b = \"flat\""));
    kvreplay(&dir)
        .args(["sweep", "e.toml"])
        .assert()
        .code(2)
        .stderr(contains(
            "[[compare]] names `flat`, which is no policy here",
        ));
    let dir = setup(&EXPERIMENT.replace("budgets = [6, 10]", "budgets = [6, 10]\nbudget = 3"));
    kvreplay(&dir)
        .args(["sweep", "e.toml"])
        .assert()
        .code(2)
        .stderr(contains("unknown field `budget`"));
    let dir = setup(&EXPERIMENT.replace("scorer = \"true-query\"", "scorer = \"h3o\""));
    kvreplay(&dir)
        .args(["sweep", "e.toml"])
        .assert()
        .code(2)
        .stderr(contains("unknown scorer `h3o`"));
    let dir = setup(&EXPERIMENT.replace("window = 2\n\n[[policy]]", "bytes = 0.5\n\n[[policy]]"));
    kvreplay(&dir)
        .args(["sweep", "e.toml"])
        .assert()
        .code(2)
        .stderr(contains(
            "policy `snapkv`: `bytes` in a [[policy]]: an experiment's budgets in bytes are its top-level `bytes` list",
        ));
    for (bytes, error) in [
        ("bytes = [0.5]\n", "`budgets` and `bytes` are both given"),
        (
            "bytes = [\"half\"]\n",
            "`bytes` lists \"half\": each is a fraction",
        ),
    ] {
        let dir = setup(&EXPERIMENT.replace(
            "budgets = [6, 10]\n",
            &format!("budgets = [6, 10]\n{bytes}"),
        ));
        kvreplay(&dir)
            .args(["sweep", "e.toml"])
            .assert()
            .code(2)
            .stderr(contains(error));
    }
}

/// Budgets in bytes: each run resolves its fraction on its trace to the tokens `kvreplay replay
/// --bytes` resolves it to, and the report's columns are the fractions.
#[test]
fn an_experiment_at_equal_bytes_runs_each_fraction_as_replay_resolves_it() {
    let experiment = r#"
description = "equal bytes"
traces = ["fixture.safetensors"]
bytes = ["1/2", 0.25]

[[policy]]
name = "plain"
scorer = "snapkv"
window = 2

[[policy]]
name = "kivi"
scorer = "snapkv"
window = 2
quantizer = "kivi"
bits = 4
group_size = 4
residual = 4
"#;
    let dir = setup(experiment);
    let out = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    assert!(
        report.contains("1/2 of the bytes") && report.contains("1/4 of the bytes"),
        "{report}"
    );
    let csv = std::fs::read_to_string(dir.path().join("results/e/runs.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let column = |name: &str| header.iter().position(|c| *c == name).unwrap();
    let mut checked = 0;
    for (name, quantizer) in [
        ("plain", &[][..]),
        (
            "kivi",
            &[
                "--quantizer",
                "kivi",
                "--bits",
                "4",
                "--group-size",
                "4",
                "--residual",
                "4",
            ][..],
        ),
    ] {
        for fraction in ["1/2", "0.25"] {
            let mut args = vec![
                "replay",
                "fixture.safetensors",
                "--scorer",
                "snapkv",
                "--window",
                "2",
                "--bytes",
                fraction,
                "--format",
                "json",
            ];
            args.extend_from_slice(quantizer);
            let replayed = kvreplay(&dir).args(&args).assert().success();
            let json: serde_json::Value =
                serde_json::from_slice(&replayed.get_output().stdout).unwrap();
            let resolved = json["nominal_budget"].as_u64().unwrap().to_string();
            let bytes = json["kv_bytes"].as_f64().unwrap();
            let row = csv
                .lines()
                .skip(1)
                .map(|l| l.split(',').collect::<Vec<_>>())
                .find(|row| row[column("policy")] == name && row[column("budget")] == resolved)
                .unwrap_or_else(|| panic!("{name} at {fraction} ({resolved} tokens): {csv}"));
            assert_eq!(row[column("kv_bytes")].parse::<f64>().unwrap(), bytes);
            checked += 1;
        }
    }
    assert_eq!(checked, 4);
}

use predicates::prelude::*;

#[test]
fn unwritable_results_directory_exits_2() {
    let dir = setup(EXPERIMENT);
    std::fs::write(
        dir.path().join("blocked"),
        b"a file where the results directory should be",
    )
    .unwrap();
    kvreplay(&dir)
        .args(["sweep", "e.toml", "--results", "blocked"])
        .assert()
        .code(2)
        .stderr(contains("blocked/e"));
}

mod parser_never_panics {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngSeed};

    proptest! {
        #![proptest_config(Config { cases: 200, failure_persistence: None, rng_seed: RngSeed::Fixed(4), ..Config::default() })]

        /// Random edits of a valid experiment file: a clean error or a valid experiment, never a panic.
        #[test]
        fn mangled_experiment_files(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<char>()), 1..6)) {
            let mut text: Vec<char> = super::EXPERIMENT.chars().collect();
            for (index, c) in edits {
                let at = index.index(text.len());
                text[at] = c;
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.toml");
            std::fs::write(&path, text.into_iter().collect::<String>()).unwrap();
            let _ = kvreplay::experiment::Experiment::load(&path);
        }
    }
}

#[test]
fn experiments_that_would_lose_or_measure_nothing_are_refused() {
    for (edit, rule) in [
        // Two policies with one name: the report would show one row.
        (
            EXPERIMENT.replace("name = \"tq\"", "name = \"snapkv\""),
            "two [[policy]] tables are named `snapkv`",
        ),
        (
            EXPERIMENT.replace("budgets = [6, 10]", "budgets = [6, 10, 6]"),
            "budget 6 is listed twice",
        ),
        (
            EXPERIMENT.replace("budgets = [6, 10]", "budgets = []"),
            "`budgets` is empty",
        ),
        (
            "description = \"x\"\ntraces = [\"fixture.safetensors\"]\nbudgets = [6]\n".to_string(),
            "no [[policy]] and no `entropy_window`",
        ),
        (
            EXPERIMENT.replace(
                "timing = [\"prefill\", \"streaming\"]",
                "timing = [\"prefill\", \"prefill\"]",
            ),
            "`timing` lists prefill twice",
        ),
        (
            EXPERIMENT.replace(
                "budgets = [6, 10]",
                "budgets = [6, 10]\nranking = [\"mass\"]",
            ),
            "ranking names `mass`, which is no metric; metrics: retained_mass,",
        ),
        (
            EXPERIMENT.replace(
                "budgets = [6, 10]",
                "budgets = [6, 10]\nranking = [\"retained_mass\"]\nceiling = \"oracle\"",
            ),
            "ceiling = `oracle` is no policy here",
        ),
        (
            EXPERIMENT.replace(
                "budgets = [6, 10]",
                "budgets = [6, 10]\nceiling = \"snapkv\"",
            ),
            "ceiling is set but `ranking` names no metric",
        ),
    ] {
        let dir = setup(&edit);
        kvreplay(&dir)
            .args(["sweep", "e.toml"])
            .assert()
            .code(2)
            .stderr(contains("e.toml").and(contains(rule)));
        assert!(
            !dir.path().join("results").exists(),
            "nothing written for {rule}"
        );
    }
}

#[test]
fn runs_are_bound_to_the_trace_content() {
    let dir = setup(EXPERIMENT);
    kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    // Re-capture the trace with other content under the same name and size.
    write_fixture(&dir.path().join("fixture.safetensors"), Shape::default(), 6);
    kvreplay(&dir)
        .args(["report", "e.toml"])
        .assert()
        .code(2)
        .stderr(contains(
            "fixture.safetensors: the trace changed since 6 stored runs were computed on it",
        ));
    // A sweep computes the runs for the new content, and the report is whole again.
    let swept = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    assert!(String::from_utf8_lossy(&swept.get_output().stderr)
        .contains("e: 6 runs done, 0 already there"));
    kvreplay(&dir).args(["report", "e.toml"]).assert().success();
}

/// Traces of two models, one hybrid: the report puts the models side by side (each model's
/// mean over its traces, checked against a replay of each trace), then has one part per model
/// with its own tables and figures (the hybrid model's entropy table naming each layer's kind),
/// and the hybrid trace's memory column is the replay's own figure, sliding-window layers
/// included.
#[test]
fn two_models_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        n_layers: 3,
        ..Shape::default()
    };
    for (file, model, windows, seed) in [
        ("a1.safetensors", "model-a", vec![], 3),
        ("a2.safetensors", "model-a", vec![], 4),
        ("b1.safetensors", "model-b", vec![8, 0, 8], 5),
    ] {
        let mut meta = common::meta(shape);
        meta.model = model.into();
        meta.windows = windows;
        let t = shape.prompt_len + shape.generated;
        let mut writer = kvreplay::trace::TraceWriter::new(
            meta,
            kvreplay::trace::StorageDtype::F32,
            (0..t as i64).collect(),
        );
        for (q, k, v) in common::tensors(shape, seed) {
            writer.push_layer(q, k, Some(v));
        }
        writer.write(&dir.path().join(file)).unwrap();
    }
    std::fs::write(
        dir.path().join("m.toml"),
        "description = \"two models\"\ntraces = [\"a1.safetensors\", \"a2.safetensors\", \"b1.safetensors\"]\nbudgets = [6]\nentropy_window = 2\n\n[[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\nwindow = 2\n",
    )
    .unwrap();
    let out = kvreplay(&dir).args(["sweep", "m.toml"]).assert().success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    assert!(report.contains("Models side by side"), "{report}");
    let policy = kvreplay::replay::PolicyParams {
        window: 2,
        ..kvreplay::replay::presets::preset("snapkv", 6).unwrap()
    }
    .check()
    .unwrap();
    let replayed = |file: &str| {
        kvreplay::replay::replay(
            &kvreplay::trace::TraceReader::open(dir.path().join(file)).unwrap(),
            &policy,
        )
        .unwrap()
    };
    let (a1, a2, b1) = (
        replayed("a1.safetensors"),
        replayed("a2.safetensors"),
        replayed("b1.safetensors"),
    );
    let mass = |r: &kvreplay::replay::ReplayReport| r.metric("retained_mass").unwrap();
    let a_mean = (mass(&a1) + mass(&a2)) / 2.0;
    assert!(
        report.contains(&format!("| snapkv | model-a (2) | {a_mean:.4} ±")),
        "{report}"
    );
    assert!(
        report.contains(&format!("| snapkv | model-b (1) | {:.4} ", mass(&b1))),
        "{report}"
    );
    let part = |model: &str| -> String {
        let start = report.find(&format!("## `{model}`")).unwrap();
        let end = report[start + 1..]
            .find("## `")
            .map_or(report.len(), |e| start + 1 + e);
        report[start..end].to_string()
    };
    let (part_a, part_b) = (part("model-a"), part("model-b"));
    assert!(
        part_a.contains("Student t over the per-prompt means of 2 prompts;"),
        "{part_a}"
    );
    assert!(!part_a.contains("attends over"), "{part_a}");
    assert!(
        part_b.contains(&format!("| snapkv | {:.4} (", mass(&b1)))
            && part_b.contains("Mean retained mass of the one prompt (no interval"),
        "{part_b}"
    );
    assert!(part_b.contains("| 0     | window 8"), "{part_b}");
    assert!(part_b.contains("| 1     | global"), "{part_b}");
    for model in ["model_a", "model_b"] {
        for figure in ["retained_mass_vs_budget", "schedules", "entropy"] {
            let file = dir.path().join(format!("results/m/{figure}_{model}.png"));
            assert!(file.is_file(), "{file:?}");
        }
    }
    let csv = std::fs::read_to_string(dir.path().join("results/m/runs.csv")).unwrap();
    let b_row = csv.lines().find(|l| l.contains("b1.safetensors")).unwrap();
    let entries: f64 = b_row.split(',').nth(5).unwrap().parse().unwrap();
    assert!(
        (entries - b1.kv_entries).abs() < 1e-9,
        "{entries} vs {}",
        b1.kv_entries
    );
}

#[test]
fn ranking_orders_policies_by_their_mean_over_budgets_against_the_ceiling() {
    let experiment = EXPERIMENT.replace(
        "budgets = [6, 10]",
        "budgets = [6, 10]\nranking = [\"retained_mass\", \"topk_recall\"]\nceiling = \"snapkv\"",
    );
    let dir = setup(&experiment);
    let out = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    // Each policy's mean over budgets, from the stored rows (one trace: the run's own figure).
    let csv = std::fs::read_to_string(dir.path().join("results/e/runs.csv")).unwrap();
    let mass = |policy: &str, budget: usize| -> f64 {
        let row = csv
            .lines()
            .find(|l| l.contains(&format!(",{policy},{budget},")))
            .unwrap_or_else(|| panic!("{policy} at {budget}"));
        row.split(',').nth(6).unwrap().parse().unwrap()
    };
    let section = report
        .split("Ranking by retained mass")
        .nth(1)
        .expect("a ranking by retained mass")
        .split("Ranking by top-")
        .next()
        .unwrap();
    let rows = ranking_rows(section);
    assert_eq!(rows[0][0], "ceiling");
    assert_eq!(rows[0][1], "snapkv");
    let ranked: Vec<(&str, f64)> = rows[1..]
        .iter()
        .map(|row| (row[1], row[4].parse::<f64>().unwrap()))
        .collect();
    assert_eq!(ranked.len(), 2);
    for (name, mean) in &ranked {
        let expected = (mass(name, 6) + mass(name, 10)) / 2.0;
        assert!(
            (mean - expected).abs() < 6e-5,
            "{name}: {mean} vs {expected}"
        );
        // The share of the ceiling at budget 6, to the percent shown.
        let share = 100.0 * mass(name, 6) / mass("snapkv", 6);
        let shown = rows
            .iter()
            .find(|row| row[1] == *name)
            .map(|row| row[2].to_string())
            .unwrap();
        assert!(
            shown.ends_with(&format!("({share:.0}%)")),
            "{shown} vs {share}"
        );
    }
    assert!(ranked[0].1 >= ranked[1].1, "ranked best first: {ranked:?}");
    assert!(report.contains("Kendall's τ-b"), "{report}");
}

/// Every experiment shipped in `experiments/` parses and checks, and names recipes that exist.
#[test]
fn every_shipped_experiment_loads() {
    let mut shipped = 0;
    for entry in std::fs::read_dir("experiments").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let experiment = Experiment::load(&path).unwrap_or_else(|e| panic!("{e}"));
        for trace in &experiment.traces {
            assert!(
                trace.is_file(),
                "{}: {} is missing",
                path.display(),
                trace.display()
            );
        }
        shipped += 1;
    }
    assert!(shipped >= 10, "{shipped} experiments");
}

/// A method given as a table (its name and its settings) or a setting qualified by its axis
/// reaches that method alone; a bare key two chosen methods declare is refused, naming both.
#[test]
fn a_method_table_gives_settings_to_its_method_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("apart.toml");
    let write = |policy: &str| {
        let file = format!("traces = [\"t.safetensors\"]\nbudgets = [16]\n\n[[policy]]\n{policy}");
        std::fs::write(&path, file).unwrap();
    };
    write(
        "name = \"apart\"\nscorer = { name = \"rkv\", threshold = [0.5, 0.7] }\nheads.name = \"threshold\"\nheads.threshold = -1.0\n",
    );
    let experiment = Experiment::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let labels: Vec<&str> = experiment
        .policies
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        labels,
        ["apart scorer.threshold=0.5", "apart scorer.threshold=0.7"]
    );
    let settings = experiment
        .check(&experiment.policies[1].1)
        .unwrap()
        .settings();
    assert_eq!(settings["scorer.threshold"], "0.7");
    assert_eq!(settings["heads.threshold"], "-1.0");
    write("name = \"bare\"\nscorer = \"rkv\"\nheads = \"threshold\"\nthreshold = 0.7\n");
    let err = Experiment::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("write `scorer.threshold` or `heads.threshold`"),
        "{err}"
    );
    write("name = \"odd\"\nwindow = { size = 4 }\n");
    let err = Experiment::load(&path).unwrap_err().to_string();
    assert!(err.contains("`window` is a table"), "{err}");
}

/// The timing's own settings given as its table, qualified or bare are one policy, with one run
/// id; a bare one a chosen method declares too would need its axis, as a method's does.
#[test]
fn a_timing_table_gives_the_timing_its_settings() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timed.toml");
    let ids = |policy: &str| -> Vec<String> {
        let file = format!(
            "traces = [\"t.safetensors\"]\nbudgets = [16]\n\n[[policy]]\nname = \"p\"\nscorer = \"knorm\"\n{policy}"
        );
        std::fs::write(&path, file).unwrap();
        let experiment = Experiment::load(&path).unwrap_or_else(|e| panic!("{e}"));
        experiment
            .plan(&[stand_in()])
            .into_iter()
            .map(|run| run.id)
            .collect()
    };
    let flat =
        ids("timing = \"decoding\"\norder = \"attend-first\"\ninterval = 4\ntrigger = \"steps\"\n");
    let table = ids("timing = { name = \"decoding\", order = \"attend-first\", interval = 4, trigger = \"steps\" }\n");
    let dotted = ids("timing.name = \"decoding\"\ntiming.order = \"attend-first\"\ntiming.interval = 4\ntiming.trigger = \"steps\"\n");
    let qualified = ids("timing = \"decoding\"\n\"timing.order\" = \"attend-first\"\n\"timing.interval\" = 4\n\"timing.trigger\" = \"steps\"\n");
    assert_eq!(flat.len(), 1);
    assert_eq!(table, flat);
    assert_eq!(dotted, flat);
    assert_eq!(qualified, flat);
    assert_ne!(ids("timing = \"decoding\"\ninterval = 2\n"), flat);
}

/// An experiment that extends another inherits every key it does not set and replaces the ones
/// it does (its `[[policy]]` tables replace the base's whole list).
#[test]
fn an_extending_experiment_inherits_what_it_does_not_set() {
    let dir = setup(EXPERIMENT);
    std::fs::create_dir(dir.path().join("slices")).unwrap();
    let slice = dir.path().join("slices/wider.toml");
    std::fs::write(&slice, "extends = \"../e.toml\"\nbudgets = [6, 8, 10]\n").unwrap();
    let base = Experiment::load(&dir.path().join("e.toml")).unwrap();
    let wider = Experiment::load(&slice).unwrap();
    assert_eq!(wider.name, "wider");
    assert_eq!(wider.description, base.description);
    assert_eq!(wider.traces, base.traces);
    assert_eq!(wider.compare, base.compare);
    assert_eq!(
        wider.budgets,
        [6, 8, 10].map(kvreplay::experiment::Budget::Tokens)
    );
    assert_eq!(wider.policies.len(), 3 * 3);
    let at = |experiment: &Experiment, budget: usize| -> Vec<String> {
        let policies = experiment.policies.iter();
        let at_budget = policies.filter(|(_, p)| p.budget == budget);
        at_budget.map(|(name, _)| name.clone()).collect()
    };
    assert_eq!(at(&wider, 6), at(&base, 6));
    let own_policy =
        "extends = \"../e.toml\"\n[[policy]]\nname = \"knorm\"\nscorer = \"knorm\"\nwindow = 2\n";
    std::fs::write(&slice, own_policy).unwrap();
    let err = Experiment::load(&slice).unwrap_err().to_string();
    // The base's comparisons name policies the slice replaced: checked as the slice's own.
    assert!(
        err.contains("wider.toml") && err.contains("[[compare]] names"),
        "{err}"
    );
}

#[test]
fn a_broken_extends_is_refused_naming_the_file() {
    let dir = setup(EXPERIMENT);
    std::fs::write(dir.path().join("mid.toml"), "extends = \"e.toml\"\n").unwrap();
    for (slice, rule) in [
        (
            "extends = \"none.toml\"\n",
            "extends = `none.toml`: no such file",
        ),
        ("extends = 3\n", "`extends` must be a string"),
        (
            "extends = \"mid.toml\"\n",
            "itself extends another experiment: one level only",
        ),
        (
            "extends = \"e.toml\"\nbudget = [6]\n",
            "unknown field `budget`",
        ),
    ] {
        std::fs::write(dir.path().join("slice.toml"), slice).unwrap();
        kvreplay(&dir)
            .args(["sweep", "slice.toml"])
            .assert()
            .code(2)
            .stderr(contains("slice.toml").and(contains(rule)));
        assert!(
            !dir.path().join("results").exists(),
            "nothing written for {rule}"
        );
    }
}

/// The full calibration runs every needle depth of its lengths; its slices (the half-hour ~1K one,
/// ~4K and ~8K) run its policies and budgets on some of its recipes, so their stored runs (ids
/// from settings and recipe) are interchangeable.
#[test]
fn the_calibration_runs_every_depth_and_its_slices_share_its_runs() {
    let full = Experiment::load(Path::new("experiments/calibration.toml")).unwrap();
    let recipes = |dir: &str, lengths: &[&str]| -> Vec<PathBuf> {
        let depths = [0, 25, 50, 75, 100];
        lengths
            .iter()
            .flat_map(|length| {
                depths.iter().map(move |depth| {
                    PathBuf::from(format!("traces/{dir}/niah-{length}-d{depth}.toml"))
                })
            })
            .collect()
    };
    // The full calibration: every needle depth, SmolLM2 at ~1K, ~2K and ~4K, Gemma 3 at ~1K to ~8K.
    let mut every = recipes("needle", &["1k", "2k", "4k"]);
    every.extend(recipes("gemma3", &["1k", "2k", "4k", "8k"]));
    assert_eq!(full.traces, every);
    for (file, traces) in [
        ("experiments/calibration-1k.toml", {
            let mut traces = recipes("needle", &["1k"]);
            traces.extend(recipes("gemma3", &["1k"]));
            traces
        }),
        (
            "experiments/calibration-4k.toml",
            recipes("needle", &["4k"]),
        ),
        (
            "experiments/calibration-8k.toml",
            recipes("gemma3", &["8k"]),
        ),
    ] {
        let slice = Experiment::load(Path::new(file)).unwrap();
        assert_eq!(slice.policies, full.policies, "{file}");
        assert_eq!(slice.budgets, full.budgets, "{file}");
        assert_eq!(slice.closed_loop, full.closed_loop, "{file}");
        assert_eq!(slice.traces, traces, "{file}");
    }
}

#[test]
fn description_is_optional() {
    let without = EXPERIMENT.replace("description = \"fixture sweep\"\n", "");
    let dir = setup(&without);
    let experiment = Experiment::load(&dir.path().join("e.toml")).unwrap();
    assert_eq!(experiment.description, "");
    let out = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    assert!(
        report.starts_with("# e\n\nProduced by `kvreplay sweep e.toml`"),
        "{report}"
    );
}

/// The README's experiment example is the shipped file, word for word.
#[test]
fn the_readme_shows_the_quickstart_experiment_as_shipped() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let quickstart = std::fs::read_to_string(root.join("experiments/quickstart.toml")).unwrap();
    assert!(
        readme.contains(&format!("```toml\n{quickstart}```")),
        "README.md's experiment example differs from experiments/quickstart.toml"
    );
}

/// An error ranks lowest first.
#[test]
fn ranking_by_an_error_puts_the_lowest_first() {
    let experiment = EXPERIMENT.replace(
        "budgets = [6, 10]",
        "budgets = [6, 10]\nranking = [\"output_error\"]",
    );
    let dir = setup(&experiment);
    let out = kvreplay(&dir).args(["sweep", "e.toml"]).assert().success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let section = report
        .split("Ranking by output error")
        .nth(1)
        .expect("a ranking by output error");
    assert!(
        section.starts_with(
            " (mean over the traces at each budget; ranked by the mean over budgets, lowest first)"
        ),
        "{section}"
    );
    let means: Vec<f64> = ranking_rows(section)
        .iter()
        .map(|row| row.last().unwrap().parse().unwrap())
        .collect();
    assert_eq!(means.len(), 3);
    assert!(means.windows(2).all(|pair| pair[0] <= pair[1]), "{means:?}");
    assert!(means[0] < means[2], "{means:?}");
}

/// The rows of a ranking table (every cell trimmed), its header left out.
fn ranking_rows(section: &str) -> Vec<Vec<&str>> {
    section
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| rank"))
        .map(|l| {
            l.split('|')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect()
        })
        .collect()
}

/// Ctrl-C during a closed-loop sweep's full run (the model prefilling the recipe's prompt, which
/// also writes its trace) stops it after the chunk in progress: exit 130, no trace written (the
/// capture lock's file aside), no run stored. Before, the full run went on to its end, wrote the
/// trace and ran the first batch of policies. The signal goes once the capture has taken its lock.
#[test]
fn ctrl_c_stops_a_closed_loop_sweep_in_its_full_run() {
    let dir = tempfile::tempdir().unwrap();
    common::real_assets().require_essays().unwrap();
    let recipe = "kind = \"niah\"\nprompt_tokens = 1500\ndepth_percent = 50.0\nneedle = \"The code is 1234.\"\nquestion = \"What is the code?\"\ngenerate = 8\n";
    std::fs::write(dir.path().join("long.toml"), recipe).unwrap();
    let experiment = "traces = [\"long.toml\"]\nbudgets = [64]\nclosed_loop = true\n\n[[policy]]\nname = \"s\"\npreset = \"snapkv\"\n";
    std::fs::write(dir.path().join("live.toml"), experiment).unwrap();
    let child = common::spawn_kvreplay(dir.path(), &["sweep", "live.toml"]);
    common::interrupt_when(child, || dir.path().join("long.safetensors.lock").exists());
    let traces: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".safetensors"))
        .collect();
    assert!(traces.is_empty(), "{traces:?}");
    assert!(!dir.path().join("results/live/runs").exists());
}

/// Ctrl-C during a sweep stops it within the layer in progress: exit 130 and a message, every run
/// stored before it intact and none recorded as failed; running it again resumes.
#[test]
fn ctrl_c_stops_a_sweep_and_running_it_again_resumes() {
    stop_a_sweep_and_resume(libc::SIGINT);
}

/// SIGTERM (`kill`, Slurm's `scancel` and time limit) stops a sweep as Ctrl-C does, exiting 143.
#[test]
fn sigterm_stops_a_sweep_as_ctrl_c_does() {
    stop_a_sweep_and_resume(libc::SIGTERM);
}

/// A sweep sent `signal` stops, keeps what it stored and resumes. The sweep is long (hundreds of
/// replays of a trace of 4,096 positions) and the signal is sent as soon as its first run is
/// stored, so the test does not race its end.
fn stop_a_sweep_and_resume(signal: libc::c_int) {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        prompt_len: 4096,
        generated: 128,
    };
    write_fixture(&dir.path().join("fixture.safetensors"), shape, 9);
    let budgets: Vec<String> = (1..=150).map(|b| (b * 16).to_string()).collect();
    let experiment = format!(
        "traces = [\"fixture.safetensors\"]\nbudgets = [{}]\n\n[[policy]]\nname = \"tq\"\nscorer = \"true-query\"\n\n[[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\n",
        budgets.join(", ")
    );
    std::fs::write(dir.path().join("long.toml"), experiment).unwrap();
    let total = 2 * budgets.len();
    let runs = dir.path().join("results/long/runs");
    let stored = || match std::fs::read_dir(&runs) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .count(),
        Err(_) => 0,
    };
    let child = common::spawn_kvreplay(dir.path(), &["sweep", "long.toml"]);
    common::signal_when(child, signal, || stored() > 0);
    let kept = stored();
    assert!(kept >= 1 && kept < total, "{kept} of {total} stored");
    assert!(!dir.path().join("results/long/failed").exists());
    let again = kvreplay(&dir)
        .args(["sweep", "long.toml"])
        .assert()
        .success();
    let said = String::from_utf8_lossy(&again.get_output().stderr).into_owned();
    let resumed = format!("long: {} runs done, {kept} already there", total - kept);
    assert!(said.contains(&resumed), "{said}");
}

/// A trace as run ids see it, for planning without a file: a name, a content hash, a recipe's.
fn stand_in() -> kvreplay::experiment::TraceFile {
    kvreplay::experiment::TraceFile {
        path: "trace.safetensors".into(),
        sha256: "0".repeat(64),
        recipe: None,
        question: None,
        recipe_sha256: Some("1".repeat(64)),
        heads: None,
        prompt_len: None,
        model: None,
        global_layers: None,
    }
}

/// The run id of every policy of every shipped experiment, for one stand-in trace, is the one
/// `tests/fixtures/run_ids.tsv` records. That file was written by the code before policies' method
/// settings were routed per axis (typed settings); an id hashes the trace only through its file
/// name, content hash and recipe hash, beside the policy's canonical form, so equal ids on the
/// stand-in mean equal ids on every trace: the committed results' stored runs keep their ids.
/// Experiments added since have no rows there.
#[test]
fn every_shipped_runs_id_is_unchanged() {
    let stand_in = stand_in();
    let recorded = std::fs::read_to_string("tests/fixtures/run_ids.tsv").unwrap();
    let mut experiments: Vec<&str> = recorded
        .lines()
        .map(|line| line.split('\t').next().unwrap())
        .collect();
    experiments.dedup();
    assert!(experiments.len() >= 29, "{experiments:?}");
    for name in experiments {
        let experiment = Experiment::load(&Path::new("experiments").join(format!("{name}.toml")))
            .unwrap_or_else(|e| panic!("{e}"));
        let now: Vec<String> = experiment
            .plan(std::slice::from_ref(&stand_in))
            .into_iter()
            .map(|run| format!("{name}\t{}\t{}\t{}", run.name, run.params.budget, run.id))
            .collect();
        let was: Vec<&str> = recorded
            .lines()
            .filter(|line| line.split('\t').next() == Some(name))
            .collect();
        assert_eq!(now, was, "{name}: run ids changed");
    }
}

/// A sweep identifies a trace held in memory (a live run's recording) as it identifies the file of
/// the same bytes: one content hash, one head count.
#[test]
fn a_trace_in_memory_is_identified_as_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fixture.safetensors");
    write_fixture(&path, Shape::default(), 3);
    let bytes = std::fs::read(&path).unwrap();
    let identified = kvreplay::experiment::TraceFile::of_bytes(Path::new("a recording"), &bytes);
    let file = kvreplay::experiment::TraceFile::identify(&path).unwrap();
    assert_eq!(identified.sha256, file.sha256);
    assert_eq!(identified.heads, file.heads);
    assert!(identified.heads.is_some());
}
