//! Closed loop on a Hugging Face model (`hf:`, transformers in a worker process, attention by
//! kvreplay) against the native live mode, on the same GGUF and recipe for both families: the
//! same prompt, the same kept sets on the two recordings, and closed-loop numbers within the
//! stated tolerances (KL per step within 1e-3, the same greedy texts and top-1 agreement, live
//! mass within 1e-3) for six presets, streaming ones included. The Python environment is the one
//! `crates/kvreplay-model/tests/integration/hf_capture.rs` uses.

use crate::common;

use kvreplay::capture::{capture, CaptureOptions};
use kvreplay::live::{LiveReport, LiveSession};
use kvreplay::model::{CausalLm, Gemma3, HfModel, Recorder};
use kvreplay::recipe::{BuiltPrompt, Recipe};
use kvreplay::replay::{kept_masks, presets, ValidPolicy};
use kvreplay::trace::{StorageDtype, TraceReader};
use std::path::Path;

/// Six presets: one-shot at the prompt's end (SnapKV, PyramidKV, AdaKV), evicting while decoding
/// (H2O, TOVA) and while the prompt runs (StreamingLLM).
const PRESETS: [&str; 6] = [
    "snapkv",
    "pyramidkv",
    "adakv",
    "h2o",
    "tova",
    "streamingllm",
];
const BUDGET: usize = 64;
/// KL per step, log-probability lost, live and open-loop retained mass: two f32 implementations
/// of the same model (q, k, v differ by ~3e-5).
const TOLERANCE: f64 = 1e-3;

/// The GGUF at `gguf` through transformers, in the test's Python environment (the library
/// finds it as `$KVREPLAY_HF_PYTHON` or `$KVREPLAY_HOME/hf-venv`).
fn through_transformers(gguf: &Path) -> HfModel {
    common::torch_python();
    HfModel::load(&format!("hf:{}", gguf.display())).expect("transformers loads the GGUF")
}

fn prompt(model: &dyn CausalLm, recipe: &str) -> BuiltPrompt {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("recipe.toml");
    std::fs::write(&path, recipe).unwrap();
    let (parsed, base) = Recipe::load(&path).unwrap();
    let essays = common::real_assets().require_essays().unwrap();
    parsed.build(model.tokenizer(), &essays, &base).unwrap()
}

fn recording(model: &dyn CausalLm, prompt: &BuiltPrompt, out: &Path) -> TraceReader {
    let options = CaptureOptions {
        storage: StorageDtype::F32,
        chunk: 512,
        recipe_name: "test".into(),
        model_id: "test".into(),
    };
    let recorder = Recorder::default();
    let captured = capture(model, prompt, &options, recorder, &mut |_, _| Ok(())).unwrap();
    captured.write(out).unwrap();
    TraceReader::open(out).unwrap()
}

fn policies() -> Vec<ValidPolicy> {
    PRESETS
        .iter()
        .map(|name| presets::preset(name, BUDGET).unwrap().check().unwrap())
        .collect()
}

fn assert_close(what: &str, native: f64, hf: f64) {
    assert!(
        (native - hf).abs() < TOLERANCE,
        "{what}: native {native}, transformers {hf}"
    );
}

fn assert_same_run(native: &LiveReport, hf: &LiveReport) {
    let name = &native.policy;
    assert_eq!(native.full_text, hf.full_text, "{name}: full text");
    assert_eq!(native.text, hf.text, "{name}: free-running text");
    assert_eq!(native.steps.len(), hf.steps.len(), "{name}: steps");
    for (step, (a, b)) in native.steps.iter().zip(&hf.steps).enumerate() {
        assert_close(&format!("{name} step {step} KL"), a.kl, b.kl);
        assert_close(
            &format!("{name} step {step} lost"),
            a.logprob_lost,
            b.logprob_lost,
        );
        assert_eq!(a.top1, b.top1, "{name} step {step}: top-1");
    }
    assert_close(
        &format!("{name} live mass"),
        native.live_retained_mass,
        hf.live_retained_mass,
    );
    let mass = |r: &LiveReport| r.open_loop.metric("retained_mass").unwrap();
    assert_close(&format!("{name} open-loop mass"), mass(native), mass(hf));
    assert_eq!(native.answer_score, hf.answer_score, "{name}: answer");
}

/// Both models build `recipe` alike, keep the same sets on their recordings, and run the presets
/// live alike.
fn check_family(native: &dyn CausalLm, gguf: &Path, recipe: &str) {
    let hf = through_transformers(gguf);
    let built = prompt(native, recipe);
    let hf_built = prompt(&hf, recipe);
    assert_eq!(built.ids, hf_built.ids, "the prompt's tokens");
    assert_eq!(built.spans, hf_built.spans, "the prompt's spans");
    let dir = tempfile::tempdir().unwrap();
    let ours = recording(native, &built, &dir.path().join("native.safetensors"));
    let theirs = recording(&hf, &built, &dir.path().join("hf.safetensors"));
    assert_eq!(ours.tokens().unwrap(), theirs.tokens().unwrap());
    // Each trace names what computed it.
    let source = |trace: &TraceReader| trace.meta().extra["source"].clone();
    assert!(
        source(&ours).contains(kvreplay::model::F32_ENGINE),
        "{}",
        source(&ours)
    );
    assert!(
        source(&theirs).contains(" transformers ") && source(&theirs).contains("f32 on cpu"),
        "{}",
        source(&theirs)
    );
    let policies = policies();
    for policy in &policies {
        let kept = |trace: &TraceReader| {
            kept_masks(trace, policy, false, kvreplay::replay::Checkpoints::NONE)
                .unwrap()
                .mask
        };
        assert_eq!(kept(&ours), kept(&theirs), "{}: kept sets", policy.label());
    }
    let native_runs = LiveSession::start(native, &built, 512, dir.path())
        .unwrap()
        .run_many(&policies)
        .unwrap();
    let hf_runs = LiveSession::start(&hf, &built, 512, dir.path())
        .unwrap()
        .run_many(&policies)
        .unwrap();
    for (a, b) in native_runs.iter().zip(&hf_runs) {
        eprintln!(
            "{}: KL {:.6} vs {:.6}, text {:?}",
            a.policy, a.kl, b.kl, b.text
        );
        assert_same_run(a, b);
    }
    // A lossy budget: the comparison is not of two untouched runs.
    assert!(native_runs.iter().all(|r| r.kl > 0.0));
}

const NIAH: &str = "kind = \"niah\"\nprompt_tokens = 400\ndepth_percent = 40.0\nneedle = \"The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\"\nquestion = \"What is the best thing to do in San Francisco?\"\ngenerate = 10\n";

#[test]
fn smollm2_through_transformers_runs_live_as_the_native_model() {
    let gguf = common::real_assets().model_path();
    check_family(common::real_model(), &gguf, NIAH);
}

/// Gemma 3: sliding-window layers, a base model's plain template, a prompt longer than the
/// 512-token window.
#[test]
fn gemma3_through_transformers_runs_live_as_the_native_model() {
    let gguf = common::gemma_path();
    let model = Gemma3::load(&gguf).unwrap();
    let recipe = NIAH
        .replace("prompt_tokens = 400", "prompt_tokens = 700")
        .replace(
            "generate = 10",
            "generate = 8\nanswer_prefix = \"The best thing to do in San Francisco is\"",
        );
    check_family(&model, &gguf, &format!("model = \"gemma3-270m\"\n{recipe}"));
}

/// A recipe of SmolLM2 through transformers.
fn hf_recipe(dir: &Path) -> std::path::PathBuf {
    let gguf = common::real_assets().model_path();
    common::torch_python();
    let path = dir.join("niah-hf.toml");
    std::fs::write(&path, format!("model = \"hf:{}\"\n{NIAH}", gguf.display())).unwrap();
    path
}

fn kvreplay(dir: &Path) -> assert_cmd::Command {
    let mut command = assert_cmd::Command::cargo_bin("kvreplay").unwrap();
    command.current_dir(dir);
    command
}

#[test]
fn kvreplay_live_and_a_closed_loop_sweep_run_on_a_transformers_model() {
    let dir = tempfile::tempdir().unwrap();
    hf_recipe(dir.path());
    let live = kvreplay(dir.path())
        .args(["live", "--recipe", "niah-hf.toml", "--budget", "64"])
        .args(["--format", "csv"])
        .assert()
        .success();
    let table = String::from_utf8(live.get_output().stdout.clone()).unwrap();
    assert!(table.contains("flat+snapkv@prefill,64,"), "{table}");
    std::fs::write(
        dir.path().join("e.toml"),
        "description = \"hf\"\ntraces = [\"niah-hf.toml\"]\nbudgets = [64]\nclosed_loop = true\n\
         [[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\n\
         [[policy]]\nname = \"h2o\"\npreset = \"h2o\"\n",
    )
    .unwrap();
    kvreplay(dir.path())
        .args(["sweep", "e.toml"])
        .assert()
        .success();
    let csv = std::fs::read_to_string(dir.path().join("results/e/runs.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    // The trace beside the recipe was captured through transformers.
    let trace = TraceReader::open(dir.path().join("niah-hf.safetensors")).unwrap();
    assert!(
        trace.meta().model.starts_with("hf:"),
        "{}",
        trace.meta().model
    );
    // A trace whose prompt the recipe's model does not build is refused, naming the position.
    std::fs::write(
        dir.path().join("chat-hf.toml"),
        std::fs::read_to_string(dir.path().join("niah-hf.toml"))
            .unwrap()
            .replace("prompt_tokens = 400", "prompt_tokens = 300"),
    )
    .unwrap();
    std::fs::copy(
        dir.path().join("niah-hf.safetensors"),
        dir.path().join("chat-hf.safetensors"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("f.toml"),
        "description = \"hf\"\ntraces = [\"chat-hf.toml\"]\nbudgets = [64]\nclosed_loop = true\n\
         [[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\n",
    )
    .unwrap();
    let refused = kvreplay(dir.path())
        .args(["sweep", "f.toml"])
        .assert()
        .code(2);
    let message = String::from_utf8(refused.get_output().stderr.clone()).unwrap();
    assert!(
        message.contains("builds a prompt that differs from the captured trace"),
        "{message}"
    );
    // The worker does not hand kvreplay its weights: attention inputs are refused before the run.
    let refused = kvreplay(dir.path())
        .args(["capture", "--recipe", "niah-hf.toml", "--attention-inputs"])
        .args(["--out", "inputs.safetensors"])
        .assert()
        .code(2);
    let message = String::from_utf8(refused.get_output().stderr.clone()).unwrap();
    assert!(
        message.contains("model family `hf` does not give kvreplay its attention weights"),
        "{message}"
    );
    assert!(!dir.path().join("inputs.safetensors").exists());
}

/// `kvreplay live` on the needle recipe run by `model` in `dir`: it exits 2; its stderr.
fn refused_live(dir: &Path, model: &str) -> String {
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, format!("model = \"{model}\"\n{NIAH}")).unwrap();
    let refused = kvreplay(dir)
        .args(["live", "--recipe", "r.toml"])
        .assert()
        .code(2);
    String::from_utf8(refused.get_output().stderr.clone()).unwrap()
}

#[test]
fn a_model_transformers_cannot_load_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    common::torch_python();
    let model = format!("hf:{}/no-such-model", dir.path().display());
    let message = refused_live(dir.path(), &model);
    assert!(
        message.contains("no-such-model`: transformers cannot load it"),
        "{message}"
    );
}

#[test]
fn the_shipped_large_model_recipe_names_a_transformers_model() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/hf/qwen2.5-7b-niah-8k.toml");
    let (recipe, _) = Recipe::load(&path).unwrap();
    assert_eq!(recipe.model(), "hf:Qwen/Qwen2.5-7B-Instruct");
}

/// A tiny random Gemma 2 (attention soft-capping) with SmolLM2's tokenizer, saved in `dir`.
fn soft_capped_model(dir: &Path) {
    let gguf = common::real_assets().model_path();
    let script = format!(
        "from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM\n\
         tok = AutoTokenizer.from_pretrained({:?}, gguf_file={:?})\n\
         config = Gemma2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, \
         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, \
         attn_logit_softcapping=50.0)\n\
         Gemma2ForCausalLM(config).save_pretrained({:?})\n\
         tok.save_pretrained({:?})\n",
        gguf.parent().unwrap(),
        gguf.file_name().unwrap(),
        dir,
        dir
    );
    let status = std::process::Command::new(common::torch_python())
        .args(["-c", &script])
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn a_model_kvreplay_cannot_run_faithfully_is_refused_naming_why() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gemma2-tiny");
    soft_capped_model(&model);
    let message = refused_live(dir.path(), &format!("hf:{}", model.display()));
    assert!(
        message.contains("gemma2-tiny`: this model uses attention logit soft-capping"),
        "{message}"
    );
}

/// Batched live runs through transformers are the runs one at a time, each with its own
/// prefill, bit for bit (each row runs its own forward pass in the worker).
#[test]
fn batched_hf_runs_are_the_runs_one_at_a_time() {
    let hf = through_transformers(&common::real_assets().model_path());
    let built = prompt(&hf, NIAH);
    let dir = tempfile::tempdir().unwrap();
    let session = LiveSession::start(&hf, &built, 512, dir.path()).unwrap();
    let policies = policies();
    let batched = session.run_many(&policies).unwrap();
    let alone = session
        .run_batched(&policies, kvreplay::live::Batching::ONE_AT_A_TIME)
        .unwrap();
    for (a, b) in batched.iter().zip(&alone) {
        assert_eq!(a.text, b.text, "{}", a.policy);
        for (step, (x, y)) in a.steps.iter().zip(&b.steps).enumerate() {
            assert_eq!(x, y, "{} step {step}", a.policy);
        }
        assert_eq!(a.live_layers, b.live_layers, "{}", a.policy);
        assert_eq!(a, b, "{}", a.policy);
    }
}
