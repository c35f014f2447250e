//! The native Gemma 3 forward and tokenizer against an implementation we did not write:
//! Hugging Face transformers (5.x) loading the same GGUF (`tests/reference/causal_lm_hf.py`).
//! Token ids must be equal; the last-position logits agree within 2e-3 relative to their range
//! (two f32 implementations of 18 layers; observed below); greedy tokens are equal; the layer
//! kinds are the config's; attention recomputed from the recorded vectors equals the forward's.
//! And the model does the task: it copies the needle of a plain-text needle prompt longer than
//! its 512-token window, also live under a policy that keeps everything (exactly the full run),
//! while a policy that compresses the global layers changes what it does.

use crate::common;

use kvreplay::live::{Batching, LiveSession};
use kvreplay::model::{CausalLm, Gemma3, KvCache, Recorder};
use kvreplay::recipe::Recipe;
use kvreplay::replay::{Layers, PolicyParams, Timing};
use std::path::PathBuf;

fn gemma() -> (Gemma3, PathBuf) {
    let path = common::gemma_path();
    (Gemma3::load(&path).expect("the Gemma 3 GGUF loads"), path)
}

#[test]
fn gemma3_matches_transformers() {
    let (model, path) = gemma();
    let essays = common::real_assets().require_essays().unwrap();
    let essay = std::fs::read_to_string(&essays[0]).unwrap();
    let texts = [
        "The capital of France is".to_string(),
        "Hello  world\n\nI  <table> x\u{e9}\u{4e2d} \u{1F600}\ttab\t\tand  spaces   end ".into(),
        essay[..6000].to_string(),
    ];
    let prompt = model.tokenizer().encode(&texts[0]);
    let mut ids = model.tokenizer().bos().into_iter().collect::<Vec<_>>();
    ids.extend(&prompt);
    let mut requests: Vec<serde_json::Value> = texts
        .iter()
        .map(|t| serde_json::json!({ "text": t }))
        .collect();
    requests.push(serde_json::json!({ "ids": ids, "generate": 12 }));
    let reply = common::transformers_reference(&path, serde_json::Value::Array(requests));
    let answers = reply["answers"].as_array().unwrap();
    for (text, answer) in texts.iter().zip(answers) {
        let ours: Vec<u32> = model
            .tokenizer()
            .bos()
            .into_iter()
            .chain(model.tokenizer().encode(text))
            .collect();
        let theirs: Vec<u32> = serde_json::from_value(answer["ids"].clone()).unwrap();
        assert_eq!(
            ours,
            theirs,
            "token ids of {:?}",
            &text[..text.len().min(60)]
        );
    }
    let expected_windows: Vec<usize> = reply["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|kind| match kind.as_str().unwrap() {
            "sliding_attention" => reply["sliding_window"].as_u64().unwrap() as usize,
            _ => 0,
        })
        .collect();
    assert_eq!(model.spec().windows, expected_windows);
    let theirs: Vec<f32> = serde_json::from_value(answers[3]["logits"].clone()).unwrap();
    let mut cache = KvCache::default();
    let ours = model.forward(&ids, &mut cache, None).unwrap();
    common::assert_logits_near(&ours, &theirs, 2e-3);
    let generated = model
        .generate(&ids, 12, 512, None, &mut |_| Ok(()))
        .unwrap();
    let expected: Vec<u32> = serde_json::from_value(answers[3]["generated"].clone()).unwrap();
    eprintln!("greedy: {:?}", model.tokenizer().decode(&generated));
    assert_eq!(generated, expected);
}

#[test]
fn attention_recomputed_from_the_recorded_vectors_is_the_forward_pass() {
    let (model, _) = gemma();
    let spec = model.spec().clone();
    let essays = common::real_assets().require_essays().unwrap();
    let text = std::fs::read_to_string(&essays[1]).unwrap();
    let ids: Vec<u32> = model.tokenizer().encode(&text)[..700].to_vec();
    let mut recorder = Recorder::with_attention_output();
    let mut cache = KvCache::default();
    for chunk in ids.chunks(256) {
        model
            .forward(chunk, &mut cache, Some(&mut recorder))
            .unwrap();
    }
    for layer in [0, 5] {
        let (q, k, v) = recorder.layer(layer).unwrap();
        let output = recorder.attention_output(layer).unwrap().unwrap();
        let window = spec.windows[layer];
        let mut worst = 0.0f32;
        for head in 0..spec.n_heads {
            for position in [0usize, 300, 511, 512, 513, 699] {
                let first = if window > 0 {
                    (position + 1).saturating_sub(window)
                } else {
                    0
                };
                let kv = head / (spec.n_heads / spec.n_kv_heads);
                let logits: Vec<f32> = (first..=position)
                    .map(|j| {
                        (0..spec.head_dim)
                            .map(|d| q[[head, position, d]] * k[[kv, j, d]])
                            .sum::<f32>()
                            * spec.scale
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f32::MIN, f32::max);
                let weights: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f32 = weights.iter().sum();
                for d in 0..spec.head_dim {
                    let expected: f32 = weights
                        .iter()
                        .zip(first..=position)
                        .map(|(w, j)| w / total * v[[kv, j, d]])
                        .sum();
                    worst = worst.max((expected - output[[head, position, d]]).abs());
                }
            }
        }
        eprintln!("layer {layer} (window {window}): max |Δ| = {worst:e}");
        assert!(worst < 1e-4, "layer {layer}: attention differs by {worst}");
    }
}

#[test]
fn gemma3_finds_the_needle_live_and_keeping_everything_is_the_full_run() {
    let (model, _) = gemma();
    let essays = common::real_assets().require_essays().unwrap();
    let recipe = Recipe::parse(
        "kind = \"niah\"\nmodel = \"gemma3-270m\"\nprompt_tokens = 800\ndepth_percent = 25.0\nneedle = \"The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\"\nquestion = \"What is the best thing to do in San Francisco?\"\nanswer_prefix = \"The best thing to do in San Francisco is\"\nanswer = \"sandwich\"\ngenerate = 8\n",
        std::path::Path::new("gemma-needle.toml"),
    )
    .unwrap();
    let prompt = recipe
        .build(model.tokenizer(), &essays, std::path::Path::new("."))
        .unwrap();
    assert_eq!(prompt.ids.len(), 800);
    assert_eq!(prompt.ids[0], model.tokenizer().bos().unwrap());
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(&model, &prompt, 512, scratch.path()).unwrap();
    let everything = PolicyParams {
        budget: 4096,
        ..PolicyParams::default()
    };
    let compressed = PolicyParams {
        scorer: "tova".into(),
        timing: Timing::PrefillThenStream,
        budget: 32,
        ..PolicyParams::default()
    };
    // Every layer compressed: streaming with room for everything (its sliding layers' caches
    // still drop what leaves their window), and TOVA at 32 tokens in every layer.
    let everything_streamed = PolicyParams {
        scorer: "recency".into(),
        timing: Timing::Streaming,
        layers: Layers::All,
        ..everything.clone()
    };
    let compressed_all = PolicyParams {
        layers: Layers::All,
        ..compressed.clone()
    };
    let reports = session
        .run_many(&[
            everything.check().unwrap(),
            compressed.clone().check().unwrap(),
            everything_streamed.check().unwrap(),
            compressed_all.clone().check().unwrap(),
        ])
        .unwrap();
    let (all, tova) = (&reports[0], &reports[1]);
    eprintln!(
        "full: {:?}; tova@32: {:?} (KL {})",
        all.full_text, tova.text, tova.kl
    );
    assert!(
        all.full_answer_ok,
        "the full run copies the needle: {:?}",
        all.full_text
    );
    assert!(all.steps.iter().all(|s| s.kl == 0.0 && s.top1));
    assert_eq!(all.text, all.full_text);
    // Only the global layers are compressed, and what the model does changes.
    let layers: Vec<usize> = tova.open_loop.layers.iter().map(|l| l.layer).collect();
    assert_eq!(layers, vec![5, 11, 17]);
    assert_eq!(tova.live_layers.len(), 3);
    assert!(tova.kl > 0.0 && tova.open_loop.metric("retained_mass").unwrap() < 1.0);
    // Under `layers = all` a stream with room for everything is the full run (the masked
    // attention sums in another order: KL below 1e-6), and TOVA compresses all 18 layers; layer
    // 0's live vectors cannot drift, so its live mass is the open-loop replay's (the same kept
    // sets from the same windowed streams; 1e-5 for the recording's arithmetic).
    let (streamed, tova_all) = (&reports[2], &reports[3]);
    assert_eq!(streamed.text, streamed.full_text);
    assert!(
        streamed.steps.iter().all(|s| s.kl < 1e-6 && s.top1),
        "{:?}",
        streamed.steps
    );
    let layers: Vec<usize> = tova_all.open_loop.layers.iter().map(|l| l.layer).collect();
    assert_eq!(layers, (0..18).collect::<Vec<_>>());
    assert_eq!(tova_all.live_layers.len(), 18);
    let open_first = tova_all.open_loop.layers[0].metrics["retained_mass"];
    assert!(
        (tova_all.live_layers[0] - open_first).abs() < 1e-5,
        "{} vs {open_first}",
        tova_all.live_layers[0]
    );
    assert!(
        open_first < 1.0 - 1e-3,
        "a sliding layer at 32 tokens loses mass: {open_first}"
    );
    assert!(tova_all.open_loop.kv_entries < tova.open_loop.kv_entries);
    // Decoded together, the prefill shared where nothing is evicted while the prompt runs, a
    // one-shot cut's teacher-forced tokens in one pass (on the global layers, and on every layer,
    // its sliding ones masked within their window), and each row's cache copy holding only the
    // 512-position window of the sliding layers it does not compress (the 800-token prompt's
    // first 288 positions gone there), and StreamingLLM's own prefill taken over from the full
    // run's cache where it first evicts (at 100; at 600 from the second chunk's start, 512,
    // since a chunk from 600 would read the sliding layers' keys from 89 on, not from 1),
    // entering the model at the first global layer (5) with the full run's hidden states there:
    // each report is the one its policy gets alone with its own prefill through every layer,
    // whole caches, one pass per token, bit for bit.
    let snapkv = PolicyParams {
        budget: 32,
        ..PolicyParams::default()
    };
    let snapkv_all = PolicyParams {
        layers: Layers::All,
        ..snapkv.clone()
    };
    let streaming = |budget| PolicyParams {
        scorer: "recency".into(),
        timing: Timing::Streaming,
        sinks: 4,
        budget,
        ..PolicyParams::default()
    };
    let policies = [
        compressed,
        compressed_all,
        snapkv,
        snapkv_all,
        streaming(100),
        streaming(600),
    ]
    .map(|p| p.check().unwrap());
    let alone = session
        .run_batched(&policies, Batching::ONE_AT_A_TIME)
        .unwrap();
    assert_eq!((&alone[0], &alone[1]), (&reports[1], &reports[3]));
    assert!(alone[2..].iter().all(|report| report.kl > 0.0));
    assert_eq!(session.run_many(&policies).unwrap(), alone);
}

/// Gemma 3 holds its weights as f32 only: asked to hold them as the file stores them (`kvreplay
/// bench --model … --held-quantized`), it refuses, naming the families that can; SmolLM2 (Llama)
/// loads so and says so in its engine.
#[test]
fn only_llama_and_qwen2_hold_their_weights_quantized() {
    let refused = kvreplay::model::family::load_quantized(&common::gemma_path()).err();
    let message = refused.map(|err| err.to_string()).unwrap_or_default();
    assert!(
        message.contains("family `gemma3` holds its weights as f32 only"),
        "{message}"
    );
    let smollm2 = common::real_assets().model_path();
    let held = kvreplay::model::family::load_quantized(&smollm2).unwrap();
    assert_eq!(held.spec().engine, kvreplay::model::QUANTIZED_ENGINE);
    let f32 = kvreplay::model::family::load(&smollm2).unwrap();
    assert_eq!(f32.spec().engine, kvreplay::model::F32_ENGINE);
    // The command line: the bench's rows say how the model runs; Gemma 3 exits 2 with the rule.
    let bench = |model: &str| {
        let mut command = assert_cmd::Command::cargo_bin("kvreplay").unwrap();
        let tokens = ["--capture-tokens", "32"];
        command
            .args(["bench", "--model", model, "--held-quantized"])
            .args(tokens);
        command.assert()
    };
    let gguf = |path: PathBuf| format!("gguf:{}", path.display());
    let rows = bench(&gguf(smollm2)).success().get_output().stdout.clone();
    let rows = String::from_utf8(rows).unwrap();
    assert!(rows.contains(kvreplay::model::QUANTIZED_ENGINE), "{rows}");
    bench(&gguf(common::gemma_path()))
        .code(2)
        .stderr(predicates::str::contains("holds its weights as f32 only"));
}
