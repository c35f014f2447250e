//! The Python capture (`traces/capture_hf.py`, transformers with an attention hook) against the
//! native capture, on the same GGUF and the same recipes: same token ids and spans, q/k/v within
//! 1e-3 (observed ~3e-5: two f32 implementations), and kvreplay's metrics within 1e-3. With
//! `--attention-inputs` on both sides, the same attention inputs: hidden states within 1e-3 of
//! their range and projections within 1e-6 (both dequantize the same GGUF blocks).
//! The Python environment (torch, transformers, gguf; ~3 GB) is made once in
//! `$KVREPLAY_HF_PYTHON`'s venv or `$KVREPLAY_HOME/hf-venv`; `.ci/run` keeps it in its cache.

use crate::common;

use kvreplay_model::assets::Assets;

use kvreplay_model::capture::{capture, CaptureOptions};
use kvreplay_model::model::{CausalLm, Gemma3, Llama, Qwen2, Recorder};
use kvreplay_model::recipe::Recipe;
use kvreplay_model::replay::{presets, replay};
use kvreplay_model::trace::{StorageDtype, TraceReader};
use std::path::{Path, PathBuf};
use std::process::Command;

fn native(model: &dyn CausalLm, recipe: &Path, essays: &[PathBuf], (out, inputs): (&Path, bool)) {
    let (parsed, base) = Recipe::load(recipe).unwrap();
    let prompt = parsed.build(model.tokenizer(), essays, &base).unwrap();
    let options = CaptureOptions {
        storage: StorageDtype::F32,
        chunk: 512,
        recipe_name: "test".into(),
        model_id: "native".into(),
    };
    let captured = capture(
        model,
        &prompt,
        &options,
        Recorder::default().keeping_inputs(inputs),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    captured.write(out).unwrap();
}

/// Runs `traces/capture_hf.py` on the GGUF `gguf` (transformers loads it from its directory) and
/// `recipe`, writing `out`, with `extra` options.
fn python_capture(gguf: &Path, recipe: &Path, out: &Path, extra: &[&str]) {
    let status = Command::new(common::torch_python())
        .arg(common::repository().join("traces/capture_hf.py"))
        .arg("--model")
        .arg(gguf.parent().unwrap())
        .arg("--gguf-file")
        .arg(gguf.file_name().unwrap())
        .arg("--recipe")
        .arg(recipe)
        .arg("--out")
        .arg(out)
        .args(extra)
        .arg("--essays")
        .arg(Assets::from_env().essays_dir())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "capture_hf.py failed on {}",
        recipe.display()
    );
}

/// The largest difference between the two traces' q, k and v, over every layer: absolute, or
/// relative to the largest magnitude of the tensor it is in.
fn worst_difference(ours: &TraceReader, theirs: &TraceReader, relative: bool) -> f32 {
    let mut worst = 0.0f32;
    for layer in 0..ours.meta().n_layers {
        let (a, b) = (ours.layer(layer).unwrap(), theirs.layer(layer).unwrap());
        for (x, y) in [
            (&a.q, &b.q),
            (&a.k, &b.k),
            (a.v.as_ref().unwrap(), b.v.as_ref().unwrap()),
        ] {
            let scale = if relative {
                y.iter().fold(0.0f32, |m, v| m.max(v.abs()))
            } else {
                1.0
            };
            let diff = x
                .iter()
                .zip(y.iter())
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            worst = worst.max(diff / scale);
        }
    }
    worst
}

/// The largest differences between the two traces' attention inputs over every layer: of the
/// hidden states relative to their largest magnitude, and of the projections' weights and
/// biases, absolute.
fn worst_input_difference(ours: &TraceReader, theirs: &TraceReader) -> (f32, f32) {
    let largest = |values: ndarray::ArrayViewD<'_, f32>| -> f32 {
        values.iter().fold(0.0f32, |m, v| m.max(v.abs()))
    };
    let (mut hidden, mut weights) = (0.0f32, 0.0f32);
    for layer in 0..ours.meta().n_layers {
        let a = ours.layer_inputs(layer).unwrap().expect("native inputs");
        let b = theirs.layer_inputs(layer).unwrap().expect("Python inputs");
        let scale = largest(b.hidden.view().into_dyn());
        hidden = hidden.max(largest((&a.hidden - &b.hidden).view().into_dyn()) / scale);
        let (x, y) = (&a.weights.qk_norms, &b.weights.qk_norms);
        assert_eq!(x.is_some(), y.is_some(), "layer {layer}: q/k norms");
        if let (Some(x), Some(y)) = (x, y) {
            assert_eq!(x.eps, y.eps, "layer {layer}: the q/k norms' ε");
            for (p, q) in [(&x.q, &y.q), (&x.k, &y.k)] {
                weights = weights.max(largest((p - q).view().into_dyn()));
            }
        }
        for (x, y) in a.weights.projections.iter().zip(&b.weights.projections) {
            weights = weights.max(largest((&x.weight - &y.weight).view().into_dyn()));
            assert_eq!(x.bias.is_some(), y.bias.is_some(), "layer {layer}: biases");
            if let (Some(p), Some(q)) = (&x.bias, &y.bias) {
                weights = weights.max(largest((p - q).view().into_dyn()));
            }
        }
    }
    (hidden, weights)
}

/// What the trace-format contract promises of attention inputs: in each of `layers`, the
/// hidden states through `q_proj` (`k_proj`), each head through the trace's q (k) norm where it
/// has one, then turned by the layer's half-split rotary, give the trace's queries (keys), within
/// 1e-3 of their largest magnitude.
fn assert_queries_from_inputs(trace: &TraceReader, layers: &[usize]) {
    let (meta, d) = (trace.meta(), trace.meta().head_dim);
    for &layer in layers {
        let tensors = trace.layer(layer).unwrap();
        let inputs = tensors.inputs.as_ref().expect("attention inputs");
        let theta = f64::from(meta.rope_theta_of(layer).expect("a rotary base"));
        let norms = inputs.weights.qk_norms.as_ref();
        let kinds = [
            ("q_proj", &tensors.q, norms.map(|n| &n.q)),
            ("k_proj", &tensors.k, norms.map(|n| &n.k)),
        ];
        for (name, stored, norm) in kinds {
            let projection = inputs.projection(name);
            let mut before = inputs.hidden.dot(&projection.weight.t());
            if let Some(bias) = &projection.bias {
                before += bias;
            }
            let (mut worst, mut largest) = (0.0f64, 0.0f64);
            for ((head, position, i), &value) in stored.indexed_iter() {
                let x = before.slice(ndarray::s![position, head * d..(head + 1) * d]);
                let x: Vec<f64> = match norm {
                    Some(weight) => {
                        let eps = f64::from(norms.unwrap().eps);
                        let square = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>();
                        let rms = (square / d as f64 + eps).sqrt();
                        x.iter()
                            .zip(weight)
                            .map(|(v, w)| f64::from(*v) / rms * f64::from(*w))
                            .collect()
                    }
                    None => x.iter().map(|v| f64::from(*v)).collect(),
                };
                let half = d / 2;
                let angle = position as f64 / theta.powf(2.0 * (i % half) as f64 / d as f64);
                let (sin, cos) = angle.sin_cos();
                let turned = match i < half {
                    true => x[i] * cos - x[i + half] * sin,
                    false => x[i] * cos + x[i - half] * sin,
                };
                worst = worst.max((turned - f64::from(value)).abs());
                largest = largest.max(f64::from(value).abs());
            }
            assert!(
                worst / largest < 1e-3,
                "layer {layer} {name}: {worst:e} of {largest}"
            );
        }
    }
}

/// Presets `names` at `budget` measure the same `metrics` on both traces, within 1e-3.
fn assert_same_metrics(
    ours: &TraceReader,
    theirs: &TraceReader,
    names: &[&str],
    budget: usize,
    metrics: &[&str],
) {
    for name in names {
        let policy = presets::preset(name, budget).unwrap().check().unwrap();
        let (a, b) = (
            replay(ours, &policy).unwrap(),
            replay(theirs, &policy).unwrap(),
        );
        for metric in metrics {
            let (x, y) = (a.metric(metric).unwrap(), b.metric(metric).unwrap());
            assert!((x - y).abs() < 1e-3, "{name} {metric}: {x} vs {y}");
        }
    }
}

#[test]
fn python_capture_matches_native_capture() {
    let assets = Assets::from_env();
    assets.fetch().expect("assets");
    let model_path = assets.model_path();
    let model = Llama::load(&model_path).unwrap();
    let essays = assets.require_essays().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let niah = dir.path().join("niah-small.toml");
    std::fs::write(
        &niah,
        "kind = \"niah\"\nprompt_tokens = 400\ndepth_percent = 40.0\nneedle = \"The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\"\nquestion = \"What is the best thing to do in San Francisco?\"\ngenerate = 8\n",
    )
    .unwrap();
    let chat = common::repository().join("traces/capital.toml");
    for recipe in [chat.as_path(), niah.as_path()] {
        let native_path = dir.path().join("native.safetensors");
        let hf_path = dir.path().join("hf.safetensors");
        native(&model, recipe, &essays, (&native_path, true));
        let options = ["--dtype", "f32", "--attention-inputs"];
        python_capture(&model_path, recipe, &hf_path, &options);
        let (ours, theirs) = (
            TraceReader::open(&native_path).unwrap(),
            TraceReader::open(&hf_path).unwrap(),
        );
        assert_eq!(
            ours.tokens().unwrap(),
            theirs.tokens().unwrap(),
            "{}",
            recipe.display()
        );
        assert_eq!(ours.meta().prompt_len, theirs.meta().prompt_len);
        assert_eq!(ours.meta().spans, theirs.meta().spans);
        assert_eq!(theirs.meta().rope_theta, Some(100_000.0));
        assert_eq!(ours.meta().rope_theta, theirs.meta().rope_theta);
        assert!((ours.meta().scale - theirs.meta().scale).abs() < 1e-7);
        let worst = worst_difference(&ours, &theirs, false);
        eprintln!(
            "{}: max |Δ| over q, k, v of 30 layers = {worst:e}",
            recipe.display()
        );
        assert!(
            worst < 1e-3,
            "{}: q/k/v differ by {worst}",
            recipe.display()
        );
        let (hidden, weights) = worst_input_difference(&ours, &theirs);
        eprintln!("attention inputs: hidden {hidden:e} of their range, projections {weights:e}");
        assert!(hidden < 1e-3 && weights < 1e-6, "{hidden}, {weights}");
        assert_same_metrics(
            &ours,
            &theirs,
            &["snapkv", "h2o", "streamingllm", "h2o-adapted", "oracle"],
            16,
            &["retained_mass", "topk_recall"],
        );
    }
}

/// A needle recipe for `model` of `tokens` prompt tokens, the needle at `depth` percent, the
/// answer opened for it, `generate` tokens.
fn needle_recipe(model: &str, (tokens, depth): (usize, f64), generate: usize) -> String {
    format!(
        "kind = \"niah\"\nmodel = \"{model}\"\nprompt_tokens = {tokens}\ndepth_percent = {depth:.1}\nneedle = \"The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\"\nquestion = \"What is the best thing to do in San Francisco?\"\nanswer_prefix = \"The best thing to do in San Francisco is\"\ngenerate = {generate}\n"
    )
}

/// The native capture of `recipe` (a recipe's text) by `model` and the Python capture of it from
/// the GGUF `gguf`, in f32 with `extra` options (both with attention inputs if `extra` asks for
/// them); the folder holding both traces, then ours and theirs.
fn both_captures(
    model: &dyn CausalLm,
    gguf: &Path,
    recipe: &str,
    extra: &[&str],
) -> (tempfile::TempDir, TraceReader, TraceReader) {
    let inputs = extra.contains(&"--attention-inputs");
    let essays = common::real_assets().require_essays().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("needle.toml");
    std::fs::write(&path, recipe).unwrap();
    let (native_path, hf_path) = (
        dir.path().join("native.safetensors"),
        dir.path().join("hf.safetensors"),
    );
    native(model, &path, &essays, (&native_path, inputs));
    let options: Vec<&str> = ["--dtype", "f32"].iter().chain(extra).copied().collect();
    python_capture(gguf, &path, &hf_path, &options);
    let ours = TraceReader::open(&native_path).unwrap();
    let theirs = TraceReader::open(&hf_path).unwrap();
    (dir, ours, theirs)
}

/// Gemma 3 (hybrid attention, a base model): the Python capture writes the same tokens, spans,
/// layer windows and vectors as the native one, on a prompt longer than the 512-token window,
/// and the same attention inputs, the per-head q/k norms (transformers' `1 + weight`, the
/// GGUF's stored weight) included.
#[test]
fn python_capture_of_gemma3_matches_native_capture() {
    let gguf = common::gemma_path();
    let model = Gemma3::load(&gguf).unwrap();
    let recipe = needle_recipe("gemma3-270m", (700, 30.0), 6);
    let options = ["--chunk", "256", "--attention-inputs"];
    let (_dir, ours, theirs) = both_captures(&model, &gguf, &recipe, &options);
    let (hidden, weights) = worst_input_difference(&ours, &theirs);
    eprintln!("Gemma 3 attention inputs: hidden {hidden:e} of their range, weights {weights:e}");
    assert!(hidden < 1e-3 && weights < 1e-6, "{hidden}, {weights}");
    let inputs = ours.layer_inputs(0).unwrap().unwrap();
    assert_eq!(inputs.weights.qk_norms.map(|norms| norms.eps), Some(1e-6));
    assert_queries_from_inputs(&ours, &[0, 5]);
    assert_eq!(ours.tokens().unwrap(), theirs.tokens().unwrap());
    assert_eq!(ours.meta().spans, theirs.meta().spans);
    assert_eq!(ours.meta().windows, theirs.meta().windows);
    assert_eq!(ours.meta().rope_thetas, theirs.meta().rope_thetas);
    assert_eq!(ours.meta().rope_theta_of(5), Some(1_000_000.0));
    assert_eq!(ours.meta().rope_theta_of(0), Some(10_000.0));
    assert_eq!(ours.meta().global_layers(), vec![5, 11, 17]);
    assert!((ours.meta().scale - theirs.meta().scale).abs() < 1e-7);
    let worst = worst_difference(&ours, &theirs, true);
    eprintln!("Gemma 3: max |Δ| / max |x| over q, k, v of 18 layers = {worst:e}");
    assert!(worst < 1e-3, "q/k/v differ by {worst} of their range");
    assert_same_metrics(
        &ours,
        &theirs,
        &["snapkv", "h2o", "streamingllm", "oracle"],
        64,
        &["retained_mass"],
    );
}

/// Qwen2 (q/k/v biases, unpermuted rows, its own pre-tokenizer and system message): the Python
/// capture of the same GGUF writes the same tokens (prompt and greedy answer), spans, vectors
/// and attention inputs (the q, k, v biases included).
#[test]
fn python_capture_of_qwen2_matches_native_capture() {
    let gguf = common::model_gguf("qwen2.5-coder-0.5b");
    let model = Qwen2::load(&gguf).unwrap();
    let recipe = needle_recipe("qwen2.5-coder-0.5b", (600, 35.0), 8);
    let (_dir, ours, theirs) = both_captures(&model, &gguf, &recipe, &["--attention-inputs"]);
    assert_eq!(ours.tokens().unwrap(), theirs.tokens().unwrap());
    assert_eq!(ours.meta().prompt_len, theirs.meta().prompt_len);
    let (hidden, weights) = worst_input_difference(&ours, &theirs);
    eprintln!("Qwen2 attention inputs: hidden {hidden:e} of their range, projections {weights:e}");
    assert!(hidden < 1e-3 && weights < 1e-6, "{hidden}, {weights}");
    let q = ours.layer_inputs(0).unwrap().unwrap();
    assert!(q.projection("k_proj").bias.is_some() && q.projection("o_proj").bias.is_none());
    assert!(q.weights.qk_norms.is_none());
    assert_queries_from_inputs(&ours, &[0, 23]);
    assert_eq!(ours.meta().spans, theirs.meta().spans);
    assert_eq!(theirs.meta().rope_theta, Some(1_000_000.0));
    assert_eq!(ours.meta().rope_theta, theirs.meta().rope_theta);
    assert!((ours.meta().scale - theirs.meta().scale).abs() < 1e-7);
    let worst = worst_difference(&ours, &theirs, true);
    eprintln!("Qwen2: max |Δ| / max |x| over q, k, v of 24 layers = {worst:e}");
    assert!(worst < 1e-3, "q/k/v differ by {worst} of their range");
    assert_same_metrics(
        &ours,
        &theirs,
        &["snapkv", "h2o", "streamingllm", "oracle"],
        64,
        &["retained_mass"],
    );
}

/// The Python capture refuses, naming the feature, models whose attention a trace cannot describe
/// (checked on the refusal hooks themselves: chunked attention and ALiBi from the config, learned
/// sinks from what the attention call gets).
#[test]
fn python_capture_refuses_attention_it_cannot_replay() {
    let traces = common::repository().join("traces");
    let cases = [
        (
            "from types import SimpleNamespace as N; capture_hf.check_config(N(attention_chunk_size=8192, model_type='llama4_text'))",
            "chunked attention",
        ),
        (
            "from types import SimpleNamespace as N; capture_hf.check_config(N(model_type='bloom'))",
            "ALiBi",
        ),
        (
            "import torch; from types import SimpleNamespace as N; x = torch.zeros(1, 1, 2, 4); capture_hf.kvtrace_attention(N(layer_idx=0, sinks=torch.zeros(1), scaling=0.5), x, x, x, None)",
            "learned attention sinks",
        ),
    ];
    for (code, feature) in cases {
        let output = Command::new(common::torch_python())
            .current_dir(&traces)
            .args(["-c", &format!("import capture_hf; {code}")])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{feature}: accepted");
        assert!(
            stderr.contains(feature) && stderr.contains("refusing"),
            "{feature}: {stderr}"
        );
    }
}
