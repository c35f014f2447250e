//! The Llama forward pass (RMSNorm, half-split rotary, grouped-query attention, SwiGLU, tied
//! embeddings), run chunk by chunk over a KV cache, with a [`Recorder`] hook that keeps what
//! attention saw.

use super::gguf::{unpermute_rows, GgufFile};
use super::mask::{causal_mask, to_array, AttentionMask, ChunkVectors};
use super::{ChatTokenizer, LlamaConfig, ModelError};
use candle_core::{DType, Device, Tensor, D};
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
    embedding: Tensor,
    output: Tensor,
    output_norm: Tensor,
    blocks: Vec<Block>,
    tokenizer: ChatTokenizer,
    inv_freq: Vec<f32>,
}

/// The keys and values seen so far, per layer, `[n_kv_heads, positions, head_dim]`. Cloning is
/// cheap (tensors share their storage; a forward pass makes new ones).
#[derive(Default, Clone)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    /// The position of the next token (the entries cached, unless some were removed).
    next_position: usize,
}

impl KvCache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dims()[1])
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cached keys of `layer`, `[n_kv_heads, positions, head_dim]`.
    pub fn keys(&self, layer: usize) -> Result<ndarray::Array3<f32>, ModelError> {
        super::mask::to_array(&self.layers[layer].0)
    }

    /// The same cache holding only the entries `positions` (ascending) in every layer and head:
    /// the keys keep the rotation of their original positions, as an evicting cache's survivors
    /// do, and the next token still gets the next position.
    pub fn retain(&self, positions: &[usize]) -> Result<KvCache, ModelError> {
        let index: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let index = Tensor::from_vec(index, positions.len(), &Device::Cpu)?;
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| Ok((k.index_select(&index, 1)?, v.index_select(&index, 1)?)))
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(KvCache {
            layers,
            next_position: self.next_position,
        })
    }
}

/// Collects, per layer, the post-rotary q and k and the v of every position run, chunk by chunk;
/// optionally also the attention output (before `attn_output`), to check a trace against the
/// forward pass that produced it.
#[derive(Default)]
pub struct Recorder {
    q: Vec<Vec<Tensor>>,
    k: Vec<Vec<Tensor>>,
    v: Vec<Vec<Tensor>>,
    attention: Vec<Vec<Tensor>>,
    keep_attention: bool,
}

impl Recorder {
    /// A recorder that also keeps each layer's attention output `[n_heads, T, head_dim]`.
    pub fn with_attention_output() -> Self {
        Self {
            keep_attention: true,
            ..Self::default()
        }
    }

    fn push(slot: &mut Vec<Vec<Tensor>>, layer: usize, value: &Tensor) {
        if slot.len() <= layer {
            slot.resize_with(layer + 1, Vec::new);
        }
        slot[layer].push(value.clone());
    }

    fn joined(slot: &[Vec<Tensor>], layer: usize) -> Result<ndarray::Array3<f32>, ModelError> {
        let tensor = Tensor::cat(&slot[layer], 1)?;
        let (heads, positions, dim) = tensor.dims3()?;
        let flat = tensor.flatten_all()?.to_vec1::<f32>()?;
        Ok(
            ndarray::Array3::from_shape_vec((heads, positions, dim), flat)
                .expect("candle shape matches"),
        )
    }

    /// Layer `layer`'s q `[n_heads, T, d]`, k and v `[n_kv_heads, T, d]`.
    #[allow(clippy::type_complexity)]
    pub fn layer(
        &self,
        layer: usize,
    ) -> Result<
        (
            ndarray::Array3<f32>,
            ndarray::Array3<f32>,
            ndarray::Array3<f32>,
        ),
        ModelError,
    > {
        Ok((
            Self::joined(&self.q, layer)?,
            Self::joined(&self.k, layer)?,
            Self::joined(&self.v, layer)?,
        ))
    }

    /// Layer `layer`'s attention output `[n_heads, T, d]`, if it was kept.
    pub fn attention_output(
        &self,
        layer: usize,
    ) -> Result<Option<ndarray::Array3<f32>>, ModelError> {
        if !self.keep_attention || self.attention.len() <= layer {
            return Ok(None);
        }
        Ok(Some(Self::joined(&self.attention, layer)?))
    }
}

fn transposed(weight: Tensor) -> Result<Tensor, ModelError> {
    Ok(weight.t()?.contiguous()?)
}

impl Llama {
    /// Loads a Llama-architecture GGUF, dequantising every weight to f32.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let mut gguf = GgufFile::open(path)?;
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
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / config.rope_theta.powf(2.0 * i as f32 / head_dim as f32))
            .collect();
        Ok(Self {
            output: transposed(output)?,
            output_norm: gguf.tensor("output_norm.weight")?,
            embedding,
            blocks,
            tokenizer,
            config,
            inv_freq,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The tokenizer built from the GGUF.
    pub fn tokenizer(&self) -> &ChatTokenizer {
        &self.tokenizer
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor, ModelError> {
        let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
        let inv_rms = (mean_square + self.config.rms_eps)?.sqrt()?.recip()?;
        Ok(x.broadcast_mul(&inv_rms)?.broadcast_mul(weight)?)
    }

    /// cos and sin tables `[n, head_dim/2]` for positions `start..start+n`.
    fn rotary_tables(&self, start: usize, n: usize) -> Result<(Tensor, Tensor), ModelError> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for position in start..start + n {
            for freq in &self.inv_freq {
                let angle = position as f32 * freq;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, half), &Device::Cpu)?,
            Tensor::from_vec(sin, (n, half), &Device::Cpu)?,
        ))
    }

    /// Half-split rotary on `[heads, n, head_dim]`.
    fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, ModelError> {
        let half = x.dims()[2] / 2;
        let first = x.narrow(2, 0, half)?;
        let second = x.narrow(2, half, half)?;
        let rotated_first = (first.broadcast_mul(cos)? - second.broadcast_mul(sin)?)?;
        let rotated_second = (second.broadcast_mul(cos)? + first.broadcast_mul(sin)?)?;
        Ok(Tensor::cat(&[rotated_first, rotated_second], 2)?)
    }

    /// `[heads, n, d]` from a `[n, heads*d]` projection.
    fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor, ModelError> {
        let (n, width) = x.dims2()?;
        Ok(x.reshape((n, heads, width / heads))?
            .transpose(0, 1)?
            .contiguous()?)
    }

    /// Repeats each KV head `group` times: `[kv, P, d]` -> `[kv*group, P, d]` (`repeat_kv`).
    fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor, ModelError> {
        if group == 1 {
            return Ok(x.clone());
        }
        let (kv, positions, dim) = x.dims3()?;
        Ok(x.unsqueeze(1)?
            .expand((kv, group, positions, dim))?
            .reshape((kv * group, positions, dim))?)
    }

    /// Runs `ids` (positions `cache.len()..`) through the model, appending to the cache and to
    /// the recorder, and returns the logits of the last position.
    pub fn forward(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        recorder: Option<&mut Recorder>,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_masked(ids, cache, recorder, None)
    }

    /// [`forward`](Self::forward) where, in each layer, every query attends over what `mask`
    /// decides when the layer's vectors are known (a KV-cache policy's evictions: the keys stay
    /// in the cache, the attention masks them, so each head can keep its own set). A mask that
    /// hides nothing gives the result of `forward`, bit for bit.
    pub fn forward_masked(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        mut recorder: Option<&mut Recorder>,
        mut mask: Option<&mut dyn AttentionMask>,
    ) -> Result<Vec<f32>, ModelError> {
        let config = &self.config;
        let n = ids.len();
        let past = cache.len();
        let start = cache.next_position;
        let (n_heads, n_kv, head_dim) = (config.n_heads, config.n_kv_heads, config.head_dim());
        let ids_tensor = Tensor::from_vec(ids.to_vec(), n, &Device::Cpu)?;
        let mut x = self.embedding.embedding(&ids_tensor)?;
        let (cos, sin) = self.rotary_tables(start, n)?;
        let total = past + n;
        let causal = Tensor::from_vec(causal_mask(1, past, n), (n, total), &Device::Cpu)?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = self.rms_norm(&x, &block.attn_norm)?;
            let q = Self::rotate(
                &Self::split_heads(&h.matmul(&block.wq)?, n_heads)?,
                &cos,
                &sin,
            )?;
            let k = Self::rotate(&Self::split_heads(&h.matmul(&block.wk)?, n_kv)?, &cos, &sin)?;
            let v = Self::split_heads(&h.matmul(&block.wv)?, n_kv)?;
            let layer_mask = match mask.as_deref_mut() {
                Some(policy) => {
                    let (q, k, v) = (to_array(&q)?, to_array(&k)?, to_array(&v)?);
                    let chunk = ChunkVectors {
                        past,
                        q: q.view(),
                        k: k.view(),
                        v: v.view(),
                    };
                    policy.layer_mask(layer, &chunk)?
                }
                None => None,
            };
            let layer_mask = match layer_mask {
                Some(values) => Tensor::from_vec(values, (n_heads, n, total), &Device::Cpu)?,
                None => causal.clone(),
            };
            if let Some(recorder) = recorder.as_deref_mut() {
                Recorder::push(&mut recorder.q, layer, &q);
                Recorder::push(&mut recorder.k, layer, &k);
                Recorder::push(&mut recorder.v, layer, &v);
            }
            let (keys, values) = match cache.layers.get(layer) {
                Some((past_k, past_v)) => (
                    Tensor::cat(&[past_k, &k], 1)?,
                    Tensor::cat(&[past_v, &v], 1)?,
                ),
                None => (k, v),
            };
            let group = n_heads / n_kv;
            let keys_rep = Self::repeat_kv(&keys, group)?;
            let values_rep = Self::repeat_kv(&values, group)?;
            let logits = (q.matmul(&keys_rep.transpose(1, 2)?.contiguous()?)? * scale)?
                .broadcast_add(&layer_mask)?;
            let max = logits.max_keepdim(D::Minus1)?;
            let weights = logits.broadcast_sub(&max)?.exp()?;
            let weights = weights.broadcast_div(&weights.sum_keepdim(D::Minus1)?)?;
            let attention = weights.matmul(&values_rep)?;
            if let Some(recorder) = recorder.as_deref_mut() {
                if recorder.keep_attention {
                    Recorder::push(&mut recorder.attention, layer, &attention);
                }
            }
            if cache.layers.len() <= layer {
                cache.layers.push((keys, values));
            } else {
                cache.layers[layer] = (keys, values);
            }
            let merged = attention
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, n_heads * head_dim))?;
            x = (x + merged.matmul(&block.wo)?)?;
            let h = self.rms_norm(&x, &block.ffn_norm)?;
            let gated = (h.matmul(&block.gate)?.silu()? * h.matmul(&block.up)?)?;
            x = (x + gated.matmul(&block.down)?)?;
        }
        cache.next_position = start + n;
        let last = x.narrow(0, n - 1, 1)?;
        let last = self.rms_norm(&last, &self.output_norm)?;
        let logits = last.matmul(&self.output)?.squeeze(0)?;
        Ok(logits.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    /// Greedy generation: feeds `prompt` in chunks of `chunk` tokens, then generates up to
    /// `max_new` tokens, stopping before `<|im_end|>`. Every generated token is fed back, so the
    /// recorder sees positions `0..prompt.len() + generated.len()`. Returns the generated ids and
    /// calls `progress(done)` after each chunk or token.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        chunk: usize,
        mut recorder: Option<&mut Recorder>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<u32>, ModelError> {
        let mut cache = KvCache::default();
        let mut logits = Vec::new();
        for piece in prompt.chunks(chunk.max(1)) {
            logits = self.forward(piece, &mut cache, recorder.as_deref_mut())?;
            progress(cache.len());
        }
        let mut done = cache.len();
        self.decode_greedy(&mut cache, &logits, max_new, recorder, None, &mut |_| {
            done += 1;
            progress(done)
        })
    }

    /// Greedy decoding from `cache`, whose last logits are `logits`: up to `max_new` tokens,
    /// stopping before `<|im_end|>`, each fed back (attending as `mask` decides, when given).
    /// Calls `on_logits` with the logits after each fed token; returns the tokens.
    pub fn decode_greedy(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        max_new: usize,
        mut recorder: Option<&mut Recorder>,
        mut mask: Option<&mut dyn AttentionMask>,
        on_logits: &mut dyn FnMut(&[f32]),
    ) -> Result<Vec<u32>, ModelError> {
        let mut generated = Vec::new();
        let mut next = argmax(logits);
        while generated.len() < max_new && next != self.tokenizer.end_of_turn() {
            generated.push(next);
            let mask = mask.as_mut().map(|m| &mut **m as &mut dyn AttentionMask);
            let step = self.forward_masked(&[next], cache, recorder.as_deref_mut(), mask)?;
            on_logits(&step);
            next = argmax(&step);
        }
        Ok(generated)
    }
}

/// Index of the largest value; the lowest index wins ties.
pub(crate) fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (index, value) in values.iter().enumerate() {
        if *value > values[best] {
            best = index;
        }
    }
    best as u32
}
