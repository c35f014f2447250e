//! The native Qwen2 family (Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M) against an implementation
//! we did not write: Hugging Face transformers (5.x) loading the same GGUF
//! (`tests/reference/causal_lm_hf.py`). Token ids must be equal (the `qwen2` pre-tokenizer on
//! digits, contractions, newlines, Unicode and added tokens); the last-position logits agree
//! within 2e-3 relative to their range (two f32 implementations of 24 layers; observed below);
//! greedy tokens are equal. The q/k/v of a capture are checked against transformers' in
//! `crates/kvreplay-model/tests/integration/hf_capture.rs`.

use crate::common;

use kvreplay_model::model::{CausalLm, KvCache, Llama, Qwen2};
use std::path::PathBuf;
use std::sync::OnceLock;

const MODEL: &str = "qwen2.5-coder-0.5b";

fn qwen() -> &'static (Llama, PathBuf) {
    static LOADED: OnceLock<(Llama, PathBuf)> = OnceLock::new();
    LOADED.get_or_init(|| {
        let path = common::model_gguf(MODEL);
        (Qwen2::load(&path).expect("the Qwen2 GGUF loads"), path)
    })
}

#[test]
fn qwen2_matches_transformers() {
    let (model, path) = qwen();
    let essays = common::real_assets().require_essays().unwrap();
    let essay = std::fs::read_to_string(&essays[2]).unwrap();
    let texts = [
        "The capital of France is".to_string(),
        "Hello  world\n\nI  <table> x\u{e9}\u{4e2d} 12345 don't WE'LL \u{1F600}\ttab\r\n\r\n  end "
            .into(),
        "<tool_call>{\"name\": \"f\"}</tool_call><|im_start|>user\nhi<|im_end|>".into(),
        essay[..6000].to_string(),
    ];
    let question = common::chat_text(
        model.tokenizer(),
        "What is the capital of France? Answer in one sentence.",
    );
    let ids = model.tokenizer().encode(&question);
    let mut requests: Vec<serde_json::Value> = texts
        .iter()
        .map(|t| serde_json::json!({ "text": t }))
        .collect();
    requests.push(serde_json::json!({ "ids": ids, "generate": 12 }));
    let reply = common::transformers_reference(path, serde_json::Value::Array(requests));
    let answers = reply["answers"].as_array().unwrap();
    assert_eq!(model.tokenizer().bos(), None);
    for (text, answer) in texts.iter().zip(answers) {
        let theirs: Vec<u32> = serde_json::from_value(answer["ids"].clone()).unwrap();
        let ours = model.tokenizer().encode(text);
        assert_eq!(
            ours,
            theirs,
            "token ids of {:?}",
            &text[..text.len().min(60)]
        );
        assert_eq!(model.tokenizer().decode(&ours), *text, "round trip");
    }
    let theirs: Vec<f32> = serde_json::from_value(answers[4]["logits"].clone()).unwrap();
    let ours = model.forward(&ids, &mut KvCache::default(), None).unwrap();
    common::assert_logits_near(&ours, &theirs, 2e-3);
    let generated = model
        .generate(&ids, 12, 512, None, &mut |_| Ok(()))
        .unwrap();
    let theirs: Vec<u32> = serde_json::from_value(answers[4]["generated"].clone()).unwrap();
    // Ours stops before `<|im_end|>`; transformers' generate writes it, then stops.
    let stop = model.tokenizer().stop_token();
    let expected: Vec<u32> = theirs.into_iter().take_while(|&id| id != stop).collect();
    eprintln!("greedy: {:?}", model.tokenizer().decode(&generated));
    assert_eq!(generated, expected);
}

#[test]
fn the_chat_template_and_geometry_are_the_ggufs() {
    let (model, _) = qwen();
    let system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
    let text = common::chat_text(model.tokenizer(), "hi");
    assert_eq!(
        text,
        format!("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    );
    let spec = model.spec();
    assert_eq!(spec.family, "qwen2");
    assert_eq!(
        (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim),
        (24, 14, 2, 64)
    );
    assert_eq!(spec.rope_theta, Some(1_000_000.0));
    assert_eq!(model.tokenizer().stop_token(), 151_645, "<|im_end|>");
}
