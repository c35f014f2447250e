//! Several questions of one context (SCBench's shared-context setting) on the real model: the
//! context is captured once (every question's trace holds the same context vectors, bit for bit),
//! a live run compresses it once and asks every question of that cache (the same reports as
//! compressing it for each question), and a closed-loop sweep stores each question's runs.

use crate::common;

use common::real_model as model;
use kvreplay::capture::{build_questions, capture, capture_recipe, CaptureOptions};
use kvreplay::live::LiveQuestions;
use kvreplay::model::Recorder;
use kvreplay::recipe::BuiltQuestions;
use kvreplay::replay::{PolicyParams, Protocol, ValidPolicy};
use kvreplay::trace::{StorageDtype, TraceReader};
use std::path::{Path, PathBuf};

/// Two questions about ~400 tokens of essays with four keys hidden in them, each asking one key.
const RECIPE: &str =
    "kind = \"ruler-niah\"\nprompt_tokens = 400\nnum_needle_k = 4\nquestions = 2\ngenerate = 8\n";

/// The recipe, written into `dir`.
fn recipe(dir: &Path) -> PathBuf {
    common::real_assets().require_essays().unwrap();
    let path = dir.join("two.toml");
    std::fs::write(&path, RECIPE).unwrap();
    path
}

fn policy(scorer: &str, protocol: Protocol) -> ValidPolicy {
    PolicyParams {
        budget: 48,
        window: 4,
        scorer: scorer.into(),
        protocol,
        ..PolicyParams::default()
    }
    .check()
    .unwrap()
}

#[test]
fn the_questions_share_one_captured_context() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = recipe(dir.path());
    let out = dir.path().join("two.safetensors");
    let summaries = capture_recipe(
        &recipe,
        &out,
        (StorageDtype::F32, 128, false),
        &mut Default::default(),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let paths: Vec<&PathBuf> = summaries.iter().map(|s| &s.path).collect();
    assert_eq!(
        paths,
        [
            dir.path().join("two.q1.safetensors"),
            dir.path().join("two.q2.safetensors")
        ]
        .iter()
        .collect::<Vec<_>>()
    );
    assert!(!out.exists());
    let traces: Vec<TraceReader> = paths
        .iter()
        .map(|p| TraceReader::open(p).unwrap())
        .collect();
    let shared: usize = traces[0].meta().extra["shared_context"].parse().unwrap();
    for (index, trace) in traces.iter().enumerate() {
        let extra = &trace.meta().extra;
        assert_eq!(extra["question"], (index + 1).to_string());
        assert_eq!(extra["questions"], "2");
        let question = trace
            .meta()
            .spans
            .iter()
            .find(|s| s.name == "question")
            .unwrap();
        assert_eq!(question.start, shared);
    }
    // The context's tokens and every layer's q, k and v are the same bits in both traces; the
    // questions differ.
    let tokens: Vec<Vec<i64>> = traces
        .iter()
        .map(|t| t.tokens().unwrap().to_vec())
        .collect();
    assert_eq!(tokens[0][..shared], tokens[1][..shared]);
    assert_ne!(tokens[0][shared..], tokens[1][shared..]);
    let context = ndarray::s![.., ..shared, ..];
    for layer in [0, 14, 29] {
        let (a, b) = (
            traces[0].layer(layer).unwrap(),
            traces[1].layer(layer).unwrap(),
        );
        assert_eq!(a.q.slice(context), b.q.slice(context));
        assert_eq!(a.k.slice(context), b.k.slice(context));
        assert_eq!(
            a.v.as_ref().unwrap().slice(context),
            b.v.as_ref().unwrap().slice(context)
        );
    }
}

#[test]
fn a_recipe_of_one_question_captures_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = Path::new("traces/capital.toml");
    let out = dir.path().join("capital.safetensors");
    capture_recipe(
        recipe,
        &out,
        (StorageDtype::F32, 16, false),
        &mut Default::default(),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let prompt = build_questions(recipe, model()).unwrap().prompts.remove(0);
    let options = CaptureOptions {
        storage: StorageDtype::F32,
        chunk: 16,
        recipe_name: "capital.toml".into(),
        model_id: "m".into(),
    };
    let alone = capture(
        model(),
        &prompt,
        &options,
        Recorder::default(),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let path = dir.path().join("alone.safetensors");
    alone.write(&path).unwrap();
    let (a, b) = (
        TraceReader::open(&out).unwrap(),
        TraceReader::open(&path).unwrap(),
    );
    assert_eq!(a.tokens().unwrap(), b.tokens().unwrap());
    for layer in 0..a.meta().n_layers {
        let (a, b) = (a.layer(layer).unwrap(), b.layer(layer).unwrap());
        assert_eq!((&a.q, &a.k, &a.v), (&b.q, &b.k, &b.v), "layer {layer}");
    }
}

#[test]
fn one_compression_serves_every_question_as_compressing_for_each_would() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = recipe(dir.path());
    let questions = build_questions(&recipe, model()).unwrap();
    let policies = [
        policy("snapkv", Protocol::QuestionAgnostic),
        policy("knorm", Protocol::QuestionAgnostic),
        policy("snapkv", Protocol::QuestionInPrompt),
    ];
    assert!(LiveQuestions::compresses_context_once(&policies[0]));
    assert!(!LiveQuestions::compresses_context_once(&policies[2]));
    let together = LiveQuestions::start(model(), &questions, 128, dir.path()).unwrap();
    let reports = together.run_many(&policies).unwrap();
    assert_eq!(reports.len(), 2);
    for (index, prompt) in questions.prompts.iter().enumerate() {
        // The question asked alone, its context prefilled the same way and compressed for it.
        let alone = BuiltQuestions {
            shared: questions.shared,
            prompts: vec![prompt.clone()],
            reconstruction: None,
        };
        let alone = LiveQuestions::start(model(), &alone, 128, dir.path()).unwrap();
        let expected = alone.sessions()[0].run_many(&policies).unwrap();
        assert_eq!(reports[index], expected, "question {}", index + 1);
    }
    // The questions ask different keys of the one context: the full runs answer each.
    for question in &reports {
        assert_eq!(
            question[0].full_answer_score, 1.0,
            "{}",
            question[0].full_text
        );
    }
    assert_ne!(reports[0][0].full_text, reports[1][0].full_text);
    // The question-agnostic policies kept the same context for both questions; their open-loop
    // metrics are each question's own.
    assert_ne!(
        reports[0][0].open_loop.metric("retained_mass"),
        reports[1][0].open_loop.metric("retained_mass")
    );
}

#[test]
fn a_closed_loop_sweep_stores_each_questions_runs() {
    let dir = tempfile::tempdir().unwrap();
    recipe(dir.path());
    std::fs::write(
        dir.path().join("q.toml"),
        "description = \"two questions\"\ntraces = [\"two.toml\"]\nbudgets = [48]\nclosed_loop = true\n\
         [[policy]]\nname = \"snapkv\"\nscorer = \"snapkv\"\nwindow = 4\nprotocol = \"question-agnostic\"\n",
    )
    .unwrap();
    assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args(["sweep", "q.toml"])
        .assert()
        .success();
    for question in ["two.q1.safetensors", "two.q2.safetensors"] {
        assert!(dir.path().join(question).is_file());
    }
    let csv = std::fs::read_to_string(dir.path().join("results/q/runs.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    assert!(
        csv.contains("two.q1.safetensors") && csv.contains("two.q2.safetensors"),
        "{csv}"
    );
    // `kvreplay live` prints a row per question and their mean.
    let live = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args([
            "live", "--recipe", "two.toml", "--scorer", "snapkv", "--budget", "48",
        ])
        .args(["--window", "4", "--protocol", "question-agnostic"])
        .assert()
        .success();
    let table = String::from_utf8(live.get_output().stdout.clone()).unwrap();
    assert!(table.contains("2 questions of one context"), "{table}");
    for row in ["| 1 ", "| 2 ", "| mean "] {
        assert!(table.lines().any(|l| l.starts_with(row)), "{table}");
    }
    // Its numbers are the sweep's, question by question.
    let kl_of = |row: &str| -> String {
        let line = table.lines().find(|l| l.starts_with(row)).unwrap();
        line.split('|').nth(4).unwrap().trim().to_owned()
    };
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let kl = header.iter().position(|c| *c == "kl").unwrap();
    for (question, row) in [
        ("two.q1.safetensors", "| 1 "),
        ("two.q2.safetensors", "| 2 "),
    ] {
        let line = csv.lines().find(|l| l.contains(question)).unwrap();
        let stored: f64 = line.split(',').nth(kl).unwrap().parse().unwrap();
        assert_eq!(format!("{stored:.4}"), kl_of(row), "{question}");
    }
    // The sweep wrote the traces from its live sessions' full runs: the bytes a capture writes,
    // and a sweep over traces captured first stores the same runs.
    let first = dir.path().join("captured first");
    std::fs::create_dir(&first).unwrap();
    for file in ["two.toml", "q.toml"] {
        std::fs::copy(dir.path().join(file), first.join(file)).unwrap();
    }
    assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(&first)
        .args(["capture", "--recipe", "two.toml"])
        .assert()
        .success();
    let modified = |path: PathBuf| std::fs::metadata(path).unwrap().modified().unwrap();
    let mut written = Vec::new();
    for question in ["two.q1.safetensors", "two.q2.safetensors"] {
        let bytes = |dir: &Path| std::fs::read(dir.join(question)).unwrap();
        assert!(bytes(dir.path()) == bytes(&first), "{question}");
        written.push(modified(dir.path().join(question)));
    }
    assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(&first)
        .args(["sweep", "q.toml"])
        .assert()
        .success();
    let runs_of = |dir: &Path| std::fs::read_to_string(dir.join("results/q/runs.csv")).unwrap();
    assert_eq!(runs_of(&first), csv);
    // Run again: everything is stored, nothing is captured or run again.
    let again = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args(["sweep", "q.toml"])
        .assert()
        .success();
    let out = String::from_utf8(again.get_output().stderr.clone()).unwrap();
    assert!(out.contains("0 runs done, 2 already there"), "{out}");
    for (question, written) in ["two.q1.safetensors", "two.q2.safetensors"]
        .iter()
        .zip(written)
    {
        assert_eq!(modified(dir.path().join(question)), written, "{question}");
    }
}

/// `kvreplay capture --attention-inputs` prints the sizes first and records every question's
/// attention inputs, the shared context's the same bits in both (the questions' recorders
/// continue the context's); q, k and v are the bytes a capture without them writes.
#[test]
fn a_capture_with_attention_inputs_records_them_for_every_question() {
    let dir = tempfile::tempdir().unwrap();
    recipe(dir.path());
    let plain = dir.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let run = |args: &[&str], cwd: &Path| {
        let output = assert_cmd::Command::cargo_bin("kvreplay")
            .unwrap()
            .current_dir(cwd)
            .args(["capture", "--recipe"])
            .args(args)
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stderr).unwrap()
    };
    let stderr = run(&["two.toml", "--attention-inputs"], dir.path());
    assert!(
        stderr.contains("in 2 trace(s): q, k, v")
            && stderr.contains("attention inputs")
            && stderr.contains("projections 212.3 MB"),
        "{stderr}"
    );
    run(&["../two.toml", "--out", "two.safetensors"], &plain);
    let traces: Vec<TraceReader> = ["two.q1.safetensors", "two.q2.safetensors"]
        .iter()
        .map(|name| TraceReader::open(dir.path().join(name)).unwrap())
        .collect();
    let shared: usize = traces[0].meta().extra["shared_context"].parse().unwrap();
    for layer in [0, 29] {
        let inputs: Vec<_> = traces
            .iter()
            .map(|trace| trace.layer_inputs(layer).unwrap().unwrap())
            .collect();
        assert_eq!(inputs[0].hidden.nrows(), traces[0].n_positions());
        let context = ndarray::s![..shared, ..];
        assert_eq!(
            inputs[0].hidden.slice(context),
            inputs[1].hidden.slice(context)
        );
        let rows = inputs[0].hidden.nrows().min(inputs[1].hidden.nrows());
        assert!((shared..rows).any(|r| inputs[0].hidden.row(r) != inputs[1].hidden.row(r)));
        assert_eq!(inputs[0].weights, inputs[1].weights);
        assert_eq!(inputs[0].projection("q_proj").weight.dim(), (576, 576));
    }
    let inspect = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .arg("inspect")
        .arg(dir.path().join("two.q1.safetensors"))
        .output()
        .unwrap();
    let shown = String::from_utf8(inspect.stdout).unwrap();
    assert!(
        shown.contains("| attention inputs") && shown.contains("hidden states (d_model 576)"),
        "{shown}"
    );
    let without = TraceReader::open(plain.join("two.q1.safetensors")).unwrap();
    assert!(!without.has_inputs());
    for layer in [0, 29] {
        let (a, b) = (
            traces[0].layer(layer).unwrap(),
            without.layer(layer).unwrap(),
        );
        assert_eq!((a.q, a.k, a.v), (b.q, b.k, b.v));
    }
}

/// KVzip's reconstruction pass (`reconstruction = "kvzip"`): a capture records it in every
/// question's trace, run once where the questions start (the context, in chunks of 128 after the
/// template's opening, each chunk's rows laid out as kvpress lays them out); the `kvzip` scorer
/// replays it at that cut and refuses another; a live run records the same pass with its full
/// run, so the policy runs live and its open-loop replay is the captured trace's, bit for bit.
#[test]
fn a_kvzip_pass_is_captured_once_for_the_questions_and_run_live() {
    use kvreplay::model::CausalLm;
    use kvreplay::recipe::reconstruction::plan;
    let dir = tempfile::tempdir().unwrap();
    let recipe = recipe(dir.path());
    let text = format!("{RECIPE}reconstruction = \"kvzip\"\nreconstruction_chunk = 128\n");
    std::fs::write(&recipe, text).unwrap();
    let out = dir.path().join("two.safetensors");
    capture_recipe(
        &recipe,
        &out,
        (StorageDtype::F32, 128, false),
        &mut Default::default(),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let traces: Vec<TraceReader> = ["two.q1.safetensors", "two.q2.safetensors"]
        .iter()
        .map(|name| TraceReader::open(dir.path().join(name)).unwrap())
        .collect();
    let questions = build_questions(&recipe, model()).unwrap();
    assert_eq!(questions.reconstruction, Some(128));
    let prompt = &questions.prompts[0];
    let planned = plan(&prompt.ids, questions.shared, model().tokenizer(), 128).unwrap();
    assert!(planned.pass.chunks.len() >= 3, "{:?}", planned.pass);
    assert_eq!(planned.pass.cut(), questions.shared);
    for trace in &traces {
        assert_eq!(trace.reconstruction(), Some(&planned.pass));
        let ids = trace.reconstruction_tokens().unwrap().unwrap();
        assert_eq!(ids.to_vec(), planned.token_ids());
        let rows = trace.layer(29).unwrap().reconstruction.unwrap();
        assert_eq!(rows, traces[0].layer(29).unwrap().reconstruction.unwrap());
    }
    let inspect = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .arg("inspect")
        .arg(dir.path().join("two.q1.safetensors"))
        .output()
        .unwrap();
    let shown = String::from_utf8(inspect.stdout).unwrap();
    let pass = &planned.pass;
    let line = format!(
        "KVzip's, positions {}..{} in {} chunk(s), {} rows",
        pass.start(),
        pass.cut(),
        pass.chunks.len(),
        pass.rows()
    );
    assert!(shown.contains(&line), "{shown}");
    // The last rows of chunk 0 are its context's own tokens, repeated.
    let first = &planned.rows[0];
    let tail = &prompt.ids[planned.pass.chunks[0].context.clone()];
    assert_eq!(&first[first.len() - tail.len()..], tail);
    let kvzip = policy("kvzip", Protocol::QuestionAgnostic);
    let replayed = kvreplay::replay::replay(&traces[0], &kvzip).unwrap();
    let elsewhere =
        kvreplay::replay::replay(&traces[0], &policy("kvzip", Protocol::QuestionInPrompt));
    assert!(elsewhere
        .unwrap_err()
        .to_string()
        .contains("reconstruction pass repeats the context up to position"),);
    let live = LiveQuestions::start(model(), &questions, 128, dir.path()).unwrap();
    let reports = live.run_many(&[kvzip]).unwrap();
    let open_loop = &reports[0][0].open_loop;
    let layers = |report: &kvreplay::replay::ReplayReport| -> Vec<_> {
        let layers = report.layers.iter();
        layers
            .map(|l| (l.metrics.clone(), l.kept_by_unit.clone()))
            .collect()
    };
    assert_eq!(open_loop.metrics, replayed.metrics);
    assert_eq!(layers(open_loop), layers(&replayed));
    assert_eq!(open_loop.spans, replayed.spans);
    assert!(reports[0][0].kl.is_finite());
}

/// Ctrl-C during `kvreplay capture` stops it after the prefill chunk or token in progress: exit
/// 130, no trace written, nothing half-written left beside it. The prompt is long and prefilled in
/// small chunks, and the signal goes as soon as the capture has started (its planned size is
/// printed), so the test does not race its end.
#[test]
fn ctrl_c_stops_a_capture_and_writes_nothing() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    common::real_assets().require_essays().unwrap();
    let recipe = "kind = \"niah\"\nprompt_tokens = 3000\ndepth_percent = 50.0\nneedle = \"The code is 1234.\"\nquestion = \"What is the code?\"\ngenerate = 8\n";
    std::fs::write(dir.path().join("long.toml"), recipe).unwrap();
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("kvreplay"))
        .current_dir(dir.path())
        .args(["capture", "--recipe", "long.toml", "--chunk", "16"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    while !said.contains("positions in") {
        assert!(stderr.read_line(&mut said).unwrap() > 0, "{said}");
    }
    // SAFETY: sends SIGINT to the child this test spawned.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    std::io::Read::read_to_string(&mut stderr, &mut said).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{said}");
    assert!(
        said.contains("interrupted: stopped where the work stood"),
        "{said}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name != "long.toml")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
