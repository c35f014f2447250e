//! Chat templates rendered by kvreplay (minijinja) against transformers' `apply_chat_template`
//! (jinja2), on the shipped models' own templates and on templates written for these tests in the
//! layouts of other families (`tests/fixtures/chat_templates/`), and GGUF tokenizers with another
//! family's template (Llama 3's pre-tokenizer, BOS and template; Gemma's SentencePiece with an
//! instruction template) against the ones transformers converts from the same files.
//! The reference side is `tests/reference/causal_lm_hf.py` in the torch environment.

use crate::common;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use kvreplay_model::model::{family, ChatMessage, ChatTemplate, Template, TextTokenizer};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

/// Conversations that reach each branch of the templates: with and without a system message,
/// two user turns in a row, an answer with reasoning, contents with spaces and newlines at their
/// ends.
fn conversations() -> Vec<Vec<ChatMessage>> {
    vec![
        vec![message("user", "What is the capital of France?")],
        vec![
            message("system", " Answer briefly. "),
            message("user", "Where?\n"),
        ],
        vec![
            message("system", "S"),
            message("user", "context"),
            message("user", "question"),
        ],
        vec![
            message("user", "2 + 2?"),
            message("assistant", "Add them.</think> 4"),
            message("user", "and 3 + 3?"),
        ],
    ]
}

fn as_json(messages: &[ChatMessage]) -> Value {
    json!(messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect::<Vec<_>>())
}

fn fixture(name: &str) -> String {
    let dir = common::repository().join("tests/fixtures/chat_templates");
    std::fs::read_to_string(dir.join(name)).unwrap()
}

/// transformers' rendering and token ids of every conversation, under the GGUF's template or
/// `source`.
fn theirs(gguf: &Path, source: Option<&str>) -> Vec<(String, Vec<u32>)> {
    let requests: Vec<Value> = conversations()
        .iter()
        .map(|c| json!({"chat": as_json(c), "template": source}))
        .collect();
    let reply = common::transformers_reference(gguf, Value::Array(requests));
    let answers = reply["answers"].as_array().unwrap();
    answers
        .iter()
        .map(|a| {
            let ids = serde_json::from_value(a["ids"].clone()).unwrap();
            (a["text"].as_str().unwrap().to_owned(), ids)
        })
        .collect()
}

fn assert_renders_as_transformers(
    template: &ChatTemplate,
    tokenizer: &dyn TextTokenizer,
    theirs: &[(String, Vec<u32>)],
) {
    for (conversation, (text, ids)) in conversations().iter().zip(theirs) {
        let ours = template.render(conversation, true).unwrap();
        assert_eq!(&ours, text, "{conversation:?}");
        assert_eq!(&tokenizer.encode(&ours), ids, "{conversation:?}");
    }
}

fn chat_template(tokenizer: &dyn TextTokenizer) -> &ChatTemplate {
    match tokenizer.template() {
        Template::Chat(template) => template,
        Template::Plain => panic!("the GGUF has a chat template"),
    }
}

#[test]
fn the_models_own_templates_render_as_transformers_renders_them() {
    let smollm2 = common::real_assets().model_path();
    let qwen = common::model_gguf("qwen2.5-coder-0.5b");
    for gguf in [smollm2, qwen] {
        let tokenizer = family::tokenizer(&gguf).unwrap();
        let template = chat_template(tokenizer.as_ref());
        assert_renders_as_transformers(template, tokenizer.as_ref(), &theirs(&gguf, None));
    }
}

#[test]
fn templates_of_other_layouts_render_as_transformers_renders_them() {
    let qwen = common::model_gguf("qwen2.5-coder-0.5b");
    let tokenizer = family::tokenizer(&qwen).unwrap();
    // Qwen2.5's BOS and EOS as the templates' `bos_token` and `eos_token`, as transformers
    // hands them over.
    let (bos, eos) = (
        Some("<|endoftext|>".to_owned()),
        Some("<|im_end|>".to_owned()),
    );
    for name in [
        "llama3-layout.jinja",
        "reasoning-layout.jinja",
        "loops.jinja",
    ] {
        let source = fixture(name);
        let template = ChatTemplate::new(&source, bos.clone(), eos.clone()).unwrap();
        let expected = theirs(&qwen, Some(&source));
        assert_renders_as_transformers(&template, tokenizer.as_ref(), &expected);
    }
}

/// A copy of `gguf`'s metadata (its vocabulary and tokenizer settings) with `changes`, the chat
/// template `template`, and one tiny tensor: what a tokenizer reads of another model's GGUF.
fn tokenizer_gguf(
    gguf: &Path,
    (dir, name): (&Path, &str),
    changes: Vec<(&str, gguf_file::Value)>,
    template: &str,
) -> PathBuf {
    let mut file = std::fs::File::open(gguf).unwrap();
    let mut metadata = gguf_file::Content::read(&mut file).unwrap().metadata;
    for (key, value) in changes {
        metadata.insert(key.into(), value);
    }
    let template = gguf_file::Value::String(fixture(template));
    metadata.insert("tokenizer.chat_template".into(), template);
    let metadata: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let device = candle_core::Device::Cpu;
    let zeros = candle_core::Tensor::zeros((8, 4), candle_core::DType::F32, &device).unwrap();
    let tensor = QTensor::quantize(&zeros, GgmlDType::F32).unwrap();
    let path = dir.join(name);
    let mut out = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut out, &metadata, &[("token_embd.weight", &tensor)]).unwrap();
    path
}

/// Qwen2.5's vocabulary and merges with Llama 3's pre-tokenizer, a BOS token added to plain
/// prompts, and the Llama-3-layout template.
fn llama3_tokenizer_gguf(dir: &Path) -> PathBuf {
    let qwen = common::model_gguf("qwen2.5-coder-0.5b");
    let changes = vec![
        (
            "tokenizer.ggml.pre",
            gguf_file::Value::String("llama-bpe".into()),
        ),
        ("tokenizer.ggml.add_bos_token", gguf_file::Value::Bool(true)),
    ];
    let target = (dir, "llama3-tokenizer.gguf");
    tokenizer_gguf(&qwen, target, changes, "llama3-layout.jinja")
}

#[test]
fn a_llama3_tokenizer_encodes_and_renders_as_transformers_converts_it() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = llama3_tokenizer_gguf(dir.path());
    let tokenizer = family::tokenizer(&gguf).unwrap();
    // Apostrophes, digits, spaces, newlines. (Qwen2.5's vocabulary has no token of two digits, so
    // Llama 3's split of digits in threes shows in the pre-tokenizer's unit test, not here.)
    let texts = [
        "In 2024, 12345 apples cost $1,000,000.",
        "It's 3.14159; WE'LL see\n\n  x  \t007\r\n",
    ];
    let mut requests: Vec<Value> = texts.iter().map(|t| json!({"text": t})).collect();
    let conversation = &conversations()[1];
    requests.push(json!({"chat": as_json(conversation), "template": null}));
    let reply = common::transformers_reference(&gguf, Value::Array(requests));
    let answers = reply["answers"].as_array().unwrap();
    assert_eq!(tokenizer.bos(), Some(151_643), "add_bos_token: BOS");
    for (text, answer) in texts.iter().zip(answers) {
        let theirs: Vec<u32> = serde_json::from_value(answer["ids"].clone()).unwrap();
        let ours: Vec<u32> = tokenizer
            .bos()
            .into_iter()
            .chain(tokenizer.encode(text))
            .collect();
        assert_eq!(ours, theirs, "{text:?}");
    }
    let template = chat_template(tokenizer.as_ref());
    let text = template.render(conversation, true).unwrap();
    assert_eq!(text, answers[2]["text"].as_str().unwrap());
    assert!(
        text.starts_with("<|endoftext|><|start_header_id|>system"),
        "{text}"
    );
    let theirs: Vec<u32> = serde_json::from_value(answers[2]["ids"].clone()).unwrap();
    assert_eq!(tokenizer.encode(&text), theirs);
    // `<|eot_id|>` is no token of this vocabulary: generation stops at the file's EOS.
    assert_eq!(tokenizer.stop_token(), 151_645);
}

/// Gemma 3's SentencePiece vocabulary with a template in Gemma's instruction layout: the
/// tokenizer prompts through it, as transformers does, and stops at `<end_of_turn>`; the base
/// 270M's own GGUF has no template and is prompted as plain text.
#[test]
fn a_gemma_tokenizer_with_a_template_renders_as_transformers_converts_it() {
    let gemma = common::gemma_path();
    assert!(matches!(
        family::tokenizer(&gemma).unwrap().template(),
        Template::Plain
    ));
    let dir = tempfile::tempdir().unwrap();
    let target = (dir.path(), "gemma-it-tokenizer.gguf");
    let gguf = tokenizer_gguf(&gemma, target, Vec::new(), "gemma-layout.jinja");
    let tokenizer = family::tokenizer(&gguf).unwrap();
    let template = chat_template(tokenizer.as_ref());
    assert_renders_as_transformers(template, tokenizer.as_ref(), &theirs(&gguf, None));
    let text = template.render(&conversations()[1], true).unwrap();
    assert!(
        text.starts_with("<bos><start_of_turn>user\n Answer briefly. \n\nWhere?<end_of_turn>"),
        "{text}"
    );
    let end_of_turn = tokenizer.encode("<end_of_turn>");
    assert_eq!(end_of_turn.len(), 1);
    assert_eq!(tokenizer.stop_token(), end_of_turn[0]);
}
