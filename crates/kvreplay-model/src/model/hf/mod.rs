//! Any Hugging Face causal LM as a kvreplay model (`model = "hf:<hub id or directory>"` in a
//! recipe, or `hf:<directory>/<file>.gguf` for a GGUF that transformers loads): transformers runs
//! the embeddings, projections, norms, rotary, MLPs and head in a worker process, and kvreplay
//! runs every layer's attention itself, over its own [`KvCache`] with the policy's mask
//! ([`attend_cached`], the code of the native families). So capture, the full run, the kept
//! sets, the masked decoding and every closed-loop number go through the same engine as the
//! native models; only the weights are transformers'.
//!
//! The worker (`worker.py`) registers an attention function with transformers'
//! `AttentionInterface`: each layer's post-rotary q, k, v come to kvreplay and the attention
//! output goes back. The model runs without a cache of its own (`use_cache=False`, explicit
//! positions), so a kept set is exactly what kvreplay's cache and mask say. The tokenizer is the
//! model's own, asked over the same pipe, so recipes build with it as they do with a native one.
//!
//! Which Python: `KVREPLAY_HF_PYTHON`, else `$KVREPLAY_HOME/hf-venv/bin/python` if it exists, else
//! `python3`; it needs torch and transformers ≥ 5 (and `gguf` for GGUF files). Where the weights
//! run: `KVREPLAY_HF_DEVICE` (default `cpu`) and `KVREPLAY_HF_DTYPE` (`f32`, `bf16`, `f16`;
//! default `f32`). Refused, as the Python capture refuses them: chunked attention, ALiBi, learned
//! sinks, attention soft-capping and per-layer softmax scales.

mod worker;

use super::batch::Feed;
use super::cached_attention::{attend_cached, LayerAttention};
use super::causal_lm::{check_rows, CausalLm, ModelSpec, Row};
use super::chat_template::ChatTemplate;
use super::prompt::{Template, TextTokenizer};
use super::ModelError;
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use worker::Worker;

/// The prefix of a recipe's `model` that names a Hugging Face model.
pub const PREFIX: &str = "hf:";

/// A Hugging Face causal LM run by transformers, its attention by kvreplay.
pub struct HfModel {
    spec: ModelSpec,
    /// The softmax scale as the model has it (the spec's is f32).
    scale: f64,
    tokenizer: HfTokenizer,
}

/// The model's own tokenizer, asked through the worker.
struct HfTokenizer {
    worker: Mutex<Worker>,
    /// The tokenizer's chat template, rendered as a GGUF's is; a tokenizer without one (a base
    /// model) is prompted as plain text, as the native Gemma 3 270M is.
    chat: Option<ChatTemplate>,
    bos: Option<u32>,
    stop: u32,
}

impl HfModel {
    /// Loads `model` (`hf:` and a hub id, a directory, or a `.gguf` file in a directory; a leading
    /// `~/` is the home directory).
    pub fn load(model: &str) -> Result<Self, ModelError> {
        let (dir, gguf) = location(model);
        let (worker, ready) = Worker::start(&python(), model, (&dir, gguf.as_deref()))?;
        let malformed =
            |field: &str| worker.failure(&format!("the worker's `{field}` is malformed"));
        let count = |field: &str| {
            let value = ready[field].as_u64().map(|v| v as usize);
            value.ok_or_else(|| malformed(field))
        };
        let floats = |field: &str| -> Vec<f64> {
            let values = ready[field]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            values.iter().filter_map(Value::as_f64).collect()
        };
        let scale = ready["scale"].as_f64().ok_or_else(|| malformed("scale"))?;
        let spec = ModelSpec {
            family: "hf",
            name: model.to_owned(),
            n_layers: count("n_layers")?,
            n_heads: count("n_heads")?,
            n_kv_heads: count("n_kv_heads")?,
            head_dim: count("head_dim")?,
            scale: scale as f32,
            rope_theta: ready["rope_theta"].as_f64().map(|v| v as f32),
            rope_thetas: floats("rope_thetas").iter().map(|&v| v as f32).collect(),
            windows: floats("windows").iter().map(|&w| w as usize).collect(),
            engine: ready["engine"]
                .as_str()
                .ok_or_else(|| malformed("engine"))?
                .to_owned(),
        };
        let stop = ready["stop"].as_u64().ok_or_else(|| malformed("stop"))? as u32;
        let tokenizer = HfTokenizer {
            chat: match ready["chat_template"].as_str() {
                Some(source) => {
                    let token = |name: &str| ready[name].as_str().map(str::to_owned);
                    let template =
                        ChatTemplate::new(source, token("bos_token"), token("eos_token"));
                    Some(template.map_err(|err| worker.failure(&format!("chat_template: {err}")))?)
                }
                None => None,
            },
            bos: ready["bos"].as_u64().map(|id| id as u32),
            stop,
            worker: Mutex::new(worker),
        };
        Ok(Self {
            spec,
            scale,
            tokenizer,
        })
    }

    fn worker(&self) -> MutexGuard<'_, Worker> {
        self.tokenizer.worker.lock().expect("no holder panicked")
    }

    /// `row`'s attention at `layer` from the worker's q, k, v (f32 `[heads, n, d]` one after
    /// the other; the row's cache held `past` positions before them): the output
    /// `[n_heads, n, d]` as bytes.
    fn attend(
        &self,
        row: &mut Row<'_, '_>,
        (layer, past): (usize, usize),
        payload: &[u8],
    ) -> Result<Vec<u8>, ModelError> {
        let spec = &self.spec;
        let (n, heads, kv, d) = (row.ids.len(), spec.n_heads, spec.n_kv_heads, spec.head_dim);
        let values = floats(payload);
        let (q_len, kv_len) = (heads * n * d, kv * n * d);
        if values.len() != q_len + 2 * kv_len || layer >= spec.n_layers {
            return Err(ModelError::Input(format!(
                "the worker sent {} values for layer {layer}, not {}",
                values.len(),
                q_len + 2 * kv_len
            )));
        }
        let tensor = |range: std::ops::Range<usize>, heads: usize| {
            Tensor::from_slice(&values[range], (heads, n, d), &Device::Cpu)
        };
        let q = tensor(0..q_len, heads)?;
        let k = tensor(q_len..q_len + kv_len, kv)?;
        let v = tensor(q_len + kv_len..values.len(), kv)?;
        let geometry = LayerAttention {
            layer,
            n_heads: heads,
            window: spec.windows.get(layer).copied().unwrap_or(0),
            scale: self.scale,
            feed: Feed::Chunk,
        };
        let output = attend_cached(row, &geometry, past, (q, k, v))?;
        let output = output.flatten_all()?.to_vec1::<f32>()?;
        Ok(output
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect())
    }

    /// One row's forward pass: the worker runs the model, kvreplay each layer's attention.
    fn forward_one(&self, row: &mut Row<'_, '_>) -> Result<Vec<f32>, ModelError> {
        let past = row.cache.len();
        let request = json!({"op": "forward", "ids": row.ids, "position": row.cache.next_position});
        let mut worker = self.worker();
        worker.send(request, &[])?;
        loop {
            let (header, payload) = worker.receive()?;
            match header["op"].as_str() {
                Some("attend") => {
                    let layer = header["layer"].as_u64().unwrap_or(u64::MAX) as usize;
                    match self.attend(row, (layer, past), &payload) {
                        Ok(bytes) => worker.send(json!({"op": "attended"}), &bytes)?,
                        Err(err) => {
                            worker.send(json!({"op": "abort"}), &[])?;
                            worker.expect("aborted")?;
                            return Err(err);
                        }
                    }
                }
                Some("logits") => {
                    row.cache.next_position += row.ids.len();
                    return Ok(floats(&payload));
                }
                _ => return Err(worker.failure(&format!("unexpected frame {header}"))),
            }
        }
    }
}

impl CausalLm for HfModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn tokenizer(&self) -> &dyn TextTokenizer {
        &self.tokenizer
    }

    /// Each row runs its own forward pass of the worker's model: transformers' products are not
    /// batch-invariant (a row stacked with others is summed in another order), and a row's
    /// logits must not depend on what it is batched with.
    fn forward_rows(&self, rows: &mut [Row<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        check_rows(rows)?;
        rows.iter_mut().map(|row| self.forward_one(row)).collect()
    }
}

impl HfTokenizer {
    /// Asks the worker; a worker that fails gives `None` (the next forward pass names why).
    fn ask(&self, request: Value, op: &str) -> Option<Value> {
        let mut worker = self.worker.lock().expect("no holder panicked");
        worker.send(request, &[]).ok()?;
        worker.expect(op).ok().map(|(header, _)| header)
    }
}

impl TextTokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.ask(json!({"op": "encode", "text": text}), "encoded")
            .and_then(|reply| serde_json::from_value(reply["ids"].clone()).ok())
            .unwrap_or_default()
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.ask(json!({"op": "decode", "ids": ids}), "decoded")
            .and_then(|reply| reply["text"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }

    fn stop_token(&self) -> u32 {
        self.stop
    }

    fn bos(&self) -> Option<u32> {
        self.bos
    }

    fn template(&self) -> Template<'_> {
        match &self.chat {
            Some(chat) => Template::Chat(chat),
            None => Template::Plain,
        }
    }
}

/// Where transformers finds `model`: its directory or hub id, and the GGUF file in it if it names
/// one; `hf:` dropped and a leading `~/` made the home directory.
fn location(model: &str) -> (String, Option<String>) {
    let id = model.strip_prefix(PREFIX).unwrap_or(model);
    let id = match id.strip_prefix("~/") {
        Some(rest) => format!("{}/{rest}", std::env::var("HOME").unwrap_or_default()),
        None => id.to_owned(),
    };
    match id.strip_suffix(".gguf").and(id.rsplit_once('/')) {
        Some((dir, file)) => (dir.to_owned(), Some(file.to_owned())),
        None => (id, None),
    }
}

/// Little-endian f32 bytes as values.
fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The Python that runs the worker.
fn python() -> PathBuf {
    if let Some(python) = std::env::var_os("KVREPLAY_HF_PYTHON") {
        return PathBuf::from(python);
    }
    let venv = crate::assets::Assets::from_env()
        .home()
        .join("hf-venv/bin/python");
    match venv.is_file() {
        true => venv,
        false => PathBuf::from("python3"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_names_its_directory_and_gguf() {
        let gguf = |dir: &str, file: &str| (dir.to_owned(), Some(file.to_owned()));
        assert_eq!(
            location("hf:Qwen/Qwen2.5-7B-Instruct"),
            ("Qwen/Qwen2.5-7B-Instruct".to_owned(), None)
        );
        assert_eq!(
            location("hf:/models/smollm2/m.gguf"),
            gguf("/models/smollm2", "m.gguf")
        );
        let home = std::env::var("HOME").unwrap_or_default();
        assert_eq!(
            location("hf:~/m/x.gguf"),
            gguf(&format!("{home}/m"), "x.gguf")
        );
    }
}
