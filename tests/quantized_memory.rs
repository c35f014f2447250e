//! A model too large to hold as f32 is held as its GGUF stores it: a synthetic GGUF with
//! Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 query and 8 KV heads, FFN 14336, a 128,256-token
//! vocabulary, an untied output layer), every matrix Q4_K with random blocks, written here, loads
//! and runs a short prompt with its peak resident memory under 1.3× the file's size (plus the KV
//! cache, a few MB here), where its weights as f32 would take 32 GB. One test in its own binary,
//! so the peak (`VmHWM`) is this model's.

mod common;

use half::f16;
use kvreplay::model::{family, KvCache};
use std::io::{BufWriter, Write};

const LAYERS: usize = 32;
const HIDDEN: usize = 4096;
const KV: usize = 1024;
const FFN: usize = 14336;
const VOCAB: usize = 128_256;
// GGUF's value type codes, then its tensor type codes.
const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const GGML_F32: u32 = 0;
const GGML_Q4_K: u32 = 12;

fn string(out: &mut impl Write, text: &str) {
    out.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    out.write_all(text.as_bytes()).unwrap();
}

/// GPT-2's byte-level alphabet: the character each byte is written as in the vocabulary.
fn byte_characters() -> Vec<String> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut shifted = 256;
    (0..256u32)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                shifted += 1;
                shifted - 1
            };
            char::from_u32(code).unwrap().to_string()
        })
        .collect()
}

/// The vocabulary: the 256 byte characters, `Ġt`, the two ChatML control tokens, then padding.
fn vocabulary() -> (Vec<String>, Vec<i32>) {
    let mut tokens = byte_characters();
    tokens.push("Ġt".into());
    tokens.extend(["<|im_start|>".into(), "<|im_end|>".into()]);
    let mut types = vec![1; tokens.len()];
    types[257] = 3;
    types[258] = 3;
    while tokens.len() < VOCAB {
        tokens.push(format!("[PAD{}]", tokens.len()));
        types.push(1);
    }
    (tokens, types)
}

/// GGUF metadata: its key-value pairs, written out, and how many.
#[derive(Default)]
struct Metadata {
    bytes: Vec<u8>,
    count: u64,
}

impl Metadata {
    fn key(&mut self, name: &str, kind: u32) -> &mut Vec<u8> {
        string(&mut self.bytes, name);
        self.bytes.extend(kind.to_le_bytes());
        self.count += 1;
        &mut self.bytes
    }

    fn text(&mut self, name: &str, value: &str) {
        string(self.key(name, STRING), value);
    }

    fn number(&mut self, name: &str, value: usize) {
        self.key(name, U32).extend((value as u32).to_le_bytes());
    }

    fn float(&mut self, name: &str, value: f32) {
        self.key(name, F32).extend(value.to_le_bytes());
    }

    fn array(&mut self, name: &str, kind: u32, len: usize) -> &mut Vec<u8> {
        let bytes = self.key(name, ARRAY);
        bytes.extend(kind.to_le_bytes());
        bytes.extend((len as u64).to_le_bytes());
        bytes
    }
}

fn metadata() -> Metadata {
    let mut meta = Metadata::default();
    meta.text("general.architecture", "llama");
    meta.number("llama.block_count", LAYERS);
    meta.number("llama.attention.head_count", 32);
    meta.number("llama.attention.head_count_kv", 8);
    meta.number("llama.embedding_length", HIDDEN);
    meta.float("llama.rope.freq_base", 500_000.0);
    meta.float("llama.attention.layer_norm_rms_epsilon", 1e-5);
    meta.text("tokenizer.ggml.model", "gpt2");
    meta.text("tokenizer.ggml.pre", "smollm");
    let (tokens, types) = vocabulary();
    let array = meta.array("tokenizer.ggml.tokens", STRING, tokens.len());
    tokens.iter().for_each(|token| string(array, token));
    let array = meta.array("tokenizer.ggml.token_type", I32, types.len());
    types
        .iter()
        .for_each(|kind| array.extend(kind.to_le_bytes()));
    string(meta.array("tokenizer.ggml.merges", STRING, 1), "Ġ t");
    // `<|im_end|>`, as a real file states its EOS: generation stops there (no chat template).
    meta.number("tokenizer.ggml.eos_token_id", 258);
    meta
}

/// Every tensor: name, GGUF dimensions (innermost first) and type.
fn tensors() -> Vec<(String, Vec<usize>, u32)> {
    let mut all = vec![
        (
            "token_embd.weight".to_string(),
            vec![HIDDEN, VOCAB],
            GGML_Q4_K,
        ),
        ("output.weight".into(), vec![HIDDEN, VOCAB], GGML_Q4_K),
        ("output_norm.weight".into(), vec![HIDDEN], GGML_F32),
    ];
    for layer in 0..LAYERS {
        let name = |n: &str| format!("blk.{layer}.{n}.weight");
        all.extend([
            (name("attn_norm"), vec![HIDDEN], GGML_F32),
            (name("ffn_norm"), vec![HIDDEN], GGML_F32),
            (name("attn_q"), vec![HIDDEN, HIDDEN], GGML_Q4_K),
            (name("attn_k"), vec![HIDDEN, KV], GGML_Q4_K),
            (name("attn_v"), vec![HIDDEN, KV], GGML_Q4_K),
            (name("attn_output"), vec![HIDDEN, HIDDEN], GGML_Q4_K),
            (name("ffn_gate"), vec![HIDDEN, FFN], GGML_Q4_K),
            (name("ffn_up"), vec![HIDDEN, FFN], GGML_Q4_K),
            (name("ffn_down"), vec![FFN, HIDDEN], GGML_Q4_K),
        ]);
    }
    all
}

fn bytes_of(dims: &[usize], kind: u32) -> usize {
    let elements: usize = dims.iter().product();
    match kind {
        GGML_F32 => elements * 4,
        _ => elements / 256 * 144,
    }
}

/// Writes the GGUF, streaming its blocks: Q4_K blocks with scales `d` = 0.001 and `dmin` =
/// 0.0075 (so the weights d·sc·q − dmin·m centre near zero) and random 6-bit scales and 4-bit
/// quants; norms of ones. Returns the file's size.
fn write_gguf(path: &std::path::Path) -> u64 {
    let mut out = BufWriter::with_capacity(1 << 22, std::fs::File::create(path).unwrap());
    let meta = metadata();
    let tensors = tensors();
    out.write_all(&0x4655_4747u32.to_le_bytes()).unwrap();
    out.write_all(&3u32.to_le_bytes()).unwrap();
    out.write_all(&(tensors.len() as u64).to_le_bytes())
        .unwrap();
    out.write_all(&meta.count.to_le_bytes()).unwrap();
    out.write_all(&meta.bytes).unwrap();
    let mut offset = 0u64;
    let mut written = 24 + meta.bytes.len() as u64;
    for (name, dims, kind) in &tensors {
        let mut info = Vec::new();
        string(&mut info, name);
        info.extend((dims.len() as u32).to_le_bytes());
        dims.iter()
            .for_each(|d| info.extend((*d as u64).to_le_bytes()));
        info.extend(kind.to_le_bytes());
        info.extend(offset.to_le_bytes());
        out.write_all(&info).unwrap();
        written += info.len() as u64;
        offset += (bytes_of(dims, *kind) as u64).next_multiple_of(32);
    }
    let padding = written.next_multiple_of(32) - written;
    out.write_all(&vec![0u8; padding as usize]).unwrap();
    let mut rng = common::Rng(0x5EED);
    let mut block = [0u8; 144];
    block[..2].copy_from_slice(&f16::from_f32(0.001).to_bits().to_le_bytes());
    block[2..4].copy_from_slice(&f16::from_f32(0.0075).to_bits().to_le_bytes());
    for (_, dims, kind) in &tensors {
        let size = bytes_of(dims, *kind);
        if *kind == GGML_F32 {
            let ones: Vec<u8> = (0..size / 4).flat_map(|_| 1f32.to_le_bytes()).collect();
            out.write_all(&ones).unwrap();
        } else {
            for _ in 0..size / 144 {
                for chunk in block[4..].chunks_mut(8) {
                    let bits = rng.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&bits[..chunk.len()]);
                }
                out.write_all(&block).unwrap();
            }
        }
        let padding = size.next_multiple_of(32) - size;
        out.write_all(&vec![0u8; padding]).unwrap();
    }
    out.flush().unwrap();
    std::fs::metadata(path).unwrap().len()
}

/// This process's peak resident memory (`VmHWM`), in bytes.
fn peak_resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

#[test]
fn an_8b_shaped_q4_k_model_runs_within_its_file_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama-3.1-8b-shaped-q4_k.gguf");
    let size = write_gguf(&path);
    let model = family::load(&path).expect("the synthetic GGUF loads");
    let spec = model.spec();
    assert_eq!(
        (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim),
        (32, 32, 8, 128)
    );
    // Every matrix loaded: Llama-3.1-8B's 7.50e9 weights of the products.
    let weights = model.weight_products_per_token().unwrap();
    let per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * FFN;
    assert_eq!(weights.blocks, LAYERS * per_layer);
    assert_eq!(weights.output, HIDDEN * VOCAB);
    let prompt = model
        .tokenizer()
        .encode("<|im_start|>user\nthe the tot to<|im_end|>\n");
    assert_eq!(prompt[0], 257, "control tokens are special");
    let mut cache = KvCache::default();
    let logits = model.forward(&prompt, &mut cache, None).unwrap();
    assert_eq!(logits.len(), VOCAB);
    assert!(logits.iter().all(|l| l.is_finite()), "finite logits");
    let generated = model
        .generate(&prompt, 2, 64, None, &mut |_| Ok(()))
        .unwrap();
    assert!(generated.len() <= 2);
    let cache_bytes = (LAYERS * 2 * KV * (prompt.len() + 2) * 4) as u64;
    let peak = peak_resident();
    eprintln!(
        "file {:.2} GB, peak resident {:.2} GB ({:.3}× the file), KV cache {:.1} MB",
        size as f64 / 1e9,
        peak as f64 / 1e9,
        peak as f64 / size as f64,
        cache_bytes as f64 / 1e6
    );
    assert!(
        (peak as f64) < 1.3 * size as f64 + cache_bytes as f64,
        "peak {peak} for a file of {size}"
    );
}
