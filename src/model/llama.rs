//! The Llama forward pass (RMSNorm, half-split rotary, grouped-query attention, SwiGLU, tied
//! embeddings), run chunk by chunk over a KV cache, with a [`Recorder`] hook that keeps what
//! attention saw.

use super::causal_lm::{CausalLm, KvCache, ModelSpec};
use super::gguf::{unpermute_rows, GgufFile};
use super::mask::{causal_mask, policy_mask, AttentionMask};
use super::ops::{
    attend, inverse_frequencies, merge_heads, rms_norm, rotary_tables, rotate, split_heads,
};
use super::prompt::TextTokenizer;
use super::recorder::Recorder;
use super::{ChatTokenizer, LlamaConfig, ModelError};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

struct Block {
    attn_norm: Tensor,
    // Weights are stored transposed, [in, out], so a linear layer is one `matmul`.
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

/// A loaded model: f32 weights, the tokenizer and the rotary tables.
pub struct Llama {
    config: LlamaConfig,
    spec: ModelSpec,
    embedding: Tensor,
    output: Tensor,
    output_norm: Tensor,
    blocks: Vec<Block>,
    tokenizer: ChatTokenizer,
    inv_freq: Vec<f32>,
}

pub(crate) fn transposed(weight: Tensor) -> Result<Tensor, ModelError> {
    Ok(weight.t()?.contiguous()?)
}

impl Llama {
    /// Loads a Llama-architecture GGUF, dequantising every weight to f32.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// [`load`](Self::load) from an opened GGUF.
    pub fn from_gguf(mut gguf: GgufFile) -> Result<Self, ModelError> {
        let config = gguf.llama_config()?;
        let tokenizer = ChatTokenizer::from_gguf(&gguf)?;
        let embedding = gguf.tensor("token_embd.weight")?;
        let output = match gguf.content.tensor_infos.contains_key("output.weight") {
            true => gguf.tensor("output.weight")?,
            false => embedding.clone(),
        };
        let mut blocks = Vec::with_capacity(config.n_layers);
        for layer in 0..config.n_layers {
            let mut weight = |name: &str| gguf.tensor(&format!("blk.{layer}.{name}.weight"));
            blocks.push(Block {
                attn_norm: weight("attn_norm")?,
                wq: transposed(unpermute_rows(&weight("attn_q")?, config.n_heads)?)?,
                wk: transposed(unpermute_rows(&weight("attn_k")?, config.n_kv_heads)?)?,
                wv: transposed(weight("attn_v")?)?,
                wo: transposed(weight("attn_output")?)?,
                ffn_norm: weight("ffn_norm")?,
                gate: transposed(weight("ffn_gate")?)?,
                up: transposed(weight("ffn_up")?)?,
                down: transposed(weight("ffn_down")?)?,
            });
        }
        let head_dim = config.head_dim();
        let spec = ModelSpec {
            family: "llama",
            name: config.name.clone(),
            n_layers: config.n_layers,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            rope_theta: Some(config.rope_theta),
            rope_thetas: Vec::new(),
            windows: vec![0; config.n_layers],
        };
        Ok(Self {
            output: transposed(output)?,
            output_norm: gguf.tensor("output_norm.weight")?,
            embedding,
            blocks,
            tokenizer,
            inv_freq: inverse_frequencies(config.rope_theta, head_dim),
            config,
            spec,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

impl CausalLm for Llama {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn tokenizer(&self) -> &dyn TextTokenizer {
        &self.tokenizer
    }

    fn forward_masked(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        mut recorder: Option<&mut Recorder>,
        mut mask: Option<&mut dyn AttentionMask>,
    ) -> Result<Vec<f32>, ModelError> {
        let config = &self.config;
        let eps = config.rms_eps;
        let n = ids.len();
        let past = cache.len();
        let start = cache.next_position;
        let (n_heads, n_kv) = (config.n_heads, config.n_kv_heads);
        let ids_tensor = Tensor::from_vec(ids.to_vec(), n, &Device::Cpu)?;
        let mut x = self.embedding.embedding(&ids_tensor)?;
        let (cos, sin) = rotary_tables(&self.inv_freq, start, n)?;
        let total = past + n;
        let causal = Tensor::from_vec(causal_mask(1, past, n), (n, total), &Device::Cpu)?;
        let scale = 1.0 / (config.head_dim() as f64).sqrt();
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, eps)?;
            let q = rotate(&split_heads(&h.matmul(&block.wq)?, n_heads)?, &cos, &sin)?;
            let k = rotate(&split_heads(&h.matmul(&block.wk)?, n_kv)?, &cos, &sin)?;
            let v = split_heads(&h.matmul(&block.wv)?, n_kv)?;
            let layer_mask = policy_mask(mask.as_deref_mut(), layer, past, (&q, &k, &v))?;
            let layer_mask = match layer_mask {
                Some(values) => Tensor::from_vec(values, (n_heads, n, total), &Device::Cpu)?,
                None => causal.clone(),
            };
            if let Some(recorder) = recorder.as_deref_mut() {
                recorder.record(layer, &q, &k, &v)?;
            }
            let (keys_t, values) = cache.append(layer, k, v)?;
            let attention = attend(&q, &keys_t, &values, &layer_mask, scale)?;
            if let Some(recorder) = recorder.as_deref_mut() {
                recorder.record_attention(layer, &attention);
            }
            x = (x + merge_heads(&attention)?.matmul(&block.wo)?)?;
            let h = rms_norm(&x, &block.ffn_norm, eps)?;
            let gated = (h.matmul(&block.gate)?.silu()? * h.matmul(&block.up)?)?;
            x = (x + gated.matmul(&block.down)?)?;
        }
        cache.next_position = start + n;
        let last = x.narrow(0, n - 1, 1)?;
        let last = rms_norm(&last, &self.output_norm, eps)?;
        let logits = last.matmul(&self.output)?.squeeze(0)?;
        Ok(logits.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }
}
