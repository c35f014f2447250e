//! Where the cut falls: the question-agnostic protocol (kvpress's pipeline: the context is
//! compressed before the question, which is appended uncompressed) against the default
//! question-in-prompt protocol, on fixture traces with a `question` span.

use crate::common;

use common::{Shape, ROPE_THETA};
use kvreplay::replay::{replay, PolicyError, PolicyParams, Protocol, Timing};
use kvreplay::trace::{Span, StorageDtype, TraceReader, TraceWriter};
use std::path::Path;

/// The fixture's question: positions 14..17 of a 20-token prompt, 4 generated tokens.
const QUESTION: Span = Span {
    name: String::new(),
    start: 14,
    end: 17,
};

/// `layers` written with their prompt ending at `prompt_len` and a `question` span.
fn write(
    path: &Path,
    shape: Shape,
    layers: &[(
        ndarray::Array3<f32>,
        ndarray::Array3<f32>,
        ndarray::Array3<f32>,
    )],
    prompt_len: usize,
) -> TraceReader {
    let mut meta = common::meta(shape);
    meta.prompt_len = prompt_len;
    meta.rope_theta = Some(ROPE_THETA);
    meta.spans.push(Span {
        name: "question".into(),
        ..QUESTION
    });
    let t = shape.prompt_len + shape.generated;
    let mut writer = TraceWriter::new(meta, StorageDtype::F32, (0..t as i64).collect());
    for (q, k, v) in layers {
        writer.push_layer(q.clone(), k.clone(), Some(v.clone()));
    }
    // The reconstruction pass a capture runs where the question starts, in both traces.
    common::with_extras(writer, shape, 0, QUESTION.start)
        .write(path)
        .unwrap();
    TraceReader::open(path).unwrap()
}

fn policy(scorer: &str, timing: Timing, protocol: Protocol) -> PolicyParams {
    PolicyParams {
        protocol,
        ..common::fixture_policy(scorer, timing, 8, 0)
    }
}

/// Compressing before the question is compressing a prompt that ends where the question starts,
/// the question's queries then counting as decode queries: bit for bit, for every scorer and
/// every timing with a prompt-end cut.
#[test]
fn question_agnostic_is_a_prompt_that_ends_at_the_question() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let layers = common::tensors(shape, 23);
    let full = write(&dir.path().join("full.safetensors"), shape, &layers, 20);
    let cut = write(
        &dir.path().join("cut.safetensors"),
        shape,
        &layers,
        QUESTION.start,
    );
    let mut compared = 0;
    for method in kvreplay::replay::scorer::REGISTRY {
        for timing in [
            Timing::Prefill,
            Timing::PrefillThenStream,
            Timing::PerStepPrompt,
        ] {
            let agnostic = policy(method.name, timing, Protocol::QuestionAgnostic);
            let Ok(agnostic) = agnostic.check() else {
                continue;
            };
            let in_prompt = policy(method.name, timing, Protocol::QuestionInPrompt)
                .check()
                .unwrap();
            let (ours, reference) = (
                replay(&full, &agnostic).unwrap(),
                replay(&cut, &in_prompt).unwrap(),
            );
            let label = format!("{} {timing:?}", method.name);
            assert_eq!(ours.metrics, reference.metrics, "{label}");
            assert_eq!(ours.layers, reference.layers, "{label}");
            assert_eq!(ours.mean_kept, reference.mean_kept, "{label}");
            assert!(
                ours.policy.ends_with("question-agnostic"),
                "{}",
                ours.policy
            );
            compared += 1;
        }
    }
    assert!(
        compared >= kvreplay::replay::scorer::REGISTRY.len(),
        "{compared}"
    );
    // The question is after the cut: none of its attention is lost, whatever the budget.
    let snapkv = replay(
        &full,
        &policy("snapkv", Timing::Prefill, Protocol::QuestionAgnostic)
            .check()
            .unwrap(),
    )
    .unwrap();
    let question = snapkv.spans.iter().find(|s| s.name == "question").unwrap();
    assert!(
        (question.kept_mass - question.full_mass).abs() < 1e-12 && question.full_mass > 0.0,
        "{question:?}"
    );
}

/// A budget that keeps the whole context keeps everything: the full run.
#[test]
fn keeping_the_whole_context_is_the_full_cache() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let layers = common::tensors(shape, 5);
    let full = write(&dir.path().join("full.safetensors"), shape, &layers, 20);
    let everything = PolicyParams {
        budget: QUESTION.start,
        ..policy("tova", Timing::Prefill, Protocol::QuestionAgnostic)
    };
    let report = replay(&full, &everything.check().unwrap()).unwrap();
    let mass = report.metric("retained_mass").unwrap();
    assert!((mass - 1.0).abs() < 1e-6, "{mass}");
}

/// A trace without a question span, and a timing without a prompt-end cut, are refused naming
/// the rule.
#[test]
fn what_the_protocol_needs_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fixture.safetensors");
    common::write_fixture(&path, Shape::default(), 1);
    let trace = TraceReader::open(&path).unwrap();
    let agnostic = policy("snapkv", Timing::Prefill, Protocol::QuestionAgnostic)
        .check()
        .unwrap();
    let err = replay(&trace, &agnostic).unwrap_err();
    assert!(
        matches!(err, PolicyError::TraceMismatch { .. })
            && err.to_string().contains("no `question` span"),
        "{err}"
    );
    let streaming = policy("recency", Timing::Streaming, Protocol::QuestionAgnostic).check();
    let err = streaming.unwrap_err().to_string();
    assert!(err.contains("protocol `question-agnostic`"), "{err}");
}

/// An experiment runs both protocols side by side, each a policy of its own in the report.
#[test]
fn a_sweep_compares_the_two_protocols() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    write(
        &dir.path().join("q.safetensors"),
        shape,
        &common::tensors(shape, 9),
        20,
    );
    std::fs::write(
        dir.path().join("p.toml"),
        "traces = [\"q.safetensors\"]\nbudgets = [8]\n\n[[policy]]\nname = \"snapkv\"\nscorer = \"snapkv\"\nwindow = 2\nprotocol = [\"question-in-prompt\", \"question-agnostic\"]\n",
    )
    .unwrap();
    let out = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args(["sweep", "p.toml"])
        .assert()
        .success();
    let report = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    for row in [
        "snapkv protocol=question-in-prompt",
        "snapkv protocol=question-agnostic",
    ] {
        assert!(report.contains(row), "{row}: {report}");
    }
}
