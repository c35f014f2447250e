//! The model-family axis: what capture and the closed-loop live mode need of a native model
//! ([`CausalLm`]), its geometry ([`ModelSpec`]), its KV cache and the recorder that keeps what
//! attention saw. Greedy generation is written once, here, for every family.

use super::mask::AttentionMask;
use super::prompt::TextTokenizer;
use super::recorder::Recorder;
use super::ModelError;
use candle_core::{Device, Tensor};

/// The attention geometry of a model, as a trace header records it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The family's registry name (`llama`, `gemma3`).
    pub family: &'static str,
    /// The model's name, from `general.name`.
    pub name: String,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Softmax scale of the attention logits.
    pub scale: f32,
    /// Base of the half-split rotary, when every layer uses the same one.
    pub rope_theta: Option<f32>,
    /// Per layer, the base of its rotary, when layers differ (empty otherwise).
    pub rope_thetas: Vec<f32>,
    /// Per layer, the attention window (the most recent positions a query attends over, its own
    /// included); 0 for global attention.
    pub windows: Vec<usize>,
}

/// A native causal language model: one forward pass over a KV cache that a policy may mask.
pub trait CausalLm: Sync {
    /// The geometry.
    fn spec(&self) -> &ModelSpec;

    /// The tokenizer built from the model file.
    fn tokenizer(&self) -> &dyn TextTokenizer;

    /// Runs `ids` (positions `cache.len()..`) through the model, appending to the cache and to
    /// the recorder, and returns the logits of the last position. In each layer every query
    /// attends over what `mask` decides when the layer's vectors are known (a KV-cache policy's
    /// evictions: the keys stay in the cache, the attention masks them, so each head can keep its
    /// own set); without a mask, causally (and within the layer's window). A mask that hides
    /// nothing gives the unmasked result bit for bit.
    fn forward_masked(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        recorder: Option<&mut Recorder>,
        mask: Option<&mut dyn AttentionMask>,
    ) -> Result<Vec<f32>, ModelError>;

    /// [`forward_masked`](Self::forward_masked) without a mask.
    fn forward(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        recorder: Option<&mut Recorder>,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_masked(ids, cache, recorder, None)
    }

    /// Greedy generation: feeds `prompt` in chunks of `chunk` tokens, then generates up to
    /// `max_new` tokens, stopping before the tokenizer's stop token. Every generated token is fed
    /// back, so the recorder sees positions `0..prompt.len() + generated.len()`. Returns the
    /// generated ids and calls `progress(done)` after each chunk or token.
    fn generate(
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
    /// stopping before the stop token, each fed back (attending as `mask` decides, when given).
    /// Calls `on_logits` with the logits after each fed token; returns the tokens.
    fn decode_greedy(
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
        let stop = self.tokenizer().stop_token();
        while generated.len() < max_new && next != stop {
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

/// The keys and values seen so far, per layer, `[n_kv_heads, positions, head_dim]`. Cloning is
/// cheap (tensors share their storage; a forward pass makes new ones).
#[derive(Default, Clone)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    /// The position of the next token (the entries cached, unless some were removed).
    pub(crate) next_position: usize,
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

    /// Appends a chunk's keys and values `[n_kv_heads, n, d]` to layer `layer` and returns the
    /// layer's whole cache.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (keys, values) = match self.layers.get(layer) {
            Some((past_k, past_v)) => (
                Tensor::cat(&[past_k, &k], 1)?,
                Tensor::cat(&[past_v, &v], 1)?,
            ),
            None => (k, v),
        };
        if self.layers.len() <= layer {
            self.layers.push((keys.clone(), values.clone()));
        } else {
            self.layers[layer] = (keys.clone(), values.clone());
        }
        Ok((keys, values))
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
