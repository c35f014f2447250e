//! The Llama forward pass (RMSNorm, half-split rotary, grouped-query attention, SwiGLU, tied
//! embeddings), run chunk by chunk over a KV cache, with a [`Recorder`] hook that keeps what
//! attention saw. Families with Llama's block and small differences ([`Variant`]: Qwen2's q/k/v
//! biases and unpermuted rows) run on it too.

use super::batch::{
    bytes, each_row_attends, elements, every_step_logits, last_logits, product_spans,
    record_inputs, spans, stacked_ids, Feed, Rotated,
};
use super::cached_attention::LayerAttention;
use super::causal_lm::{check_rows, CausalLm, ModelSpec, Row, WeightProducts};
use super::causal_lm::{F32_ENGINE, QUANTIZED_ENGINE};
use super::gated::{gated, Activation};
use super::gguf::{unpermute_quantized_rows, unpermute_rows, GgufFile};
use super::ops::{inverse_frequencies, rms_norm, rotary_tables, rotate, split_heads, RotaryTables};
use super::prompt::TextTokenizer;
use super::weight::{Embedding, Weight};
use super::{ChatTokenizer, LlamaConfig, ModelError};
use crate::trace::{AttentionWeights, Projection};
use candle_core::Tensor;
use ndarray::Array1;
use std::path::Path;

/// What sets a family with Llama's block apart from Llama.
pub(crate) struct Variant {
    /// `general.architecture`, and the family the spec names.
    pub(crate) architecture: &'static str,
    /// Whether llama.cpp's converter permuted the q/k rows for its interleaved rotary (it does
    /// for `llama`, not for `qwen2`); undone at load.
    pub(crate) permuted_qk: bool,
}

const LLAMA: Variant = Variant {
    architecture: "llama",
    permuted_qk: true,
};

struct Block {
    attn_norm: Tensor,
    // Weights are stored transposed, [in, out], so a linear layer is one `matmul`.
    wq: Weight,
    wk: Weight,
    wv: Weight,
    /// The q, k and v biases, where the file has them (Qwen2).
    biases: Option<[Tensor; 3]>,
    wo: Weight,
    ffn_norm: Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
}

impl Block {
    /// q, k and v of the normed hidden states `h` (rows summed at `sums`), biases added.
    fn projected(
        &self,
        h: &Tensor,
        sums: &[(usize, usize)],
    ) -> Result<(Tensor, Tensor, Tensor), ModelError> {
        let project = |w: &Weight, bias: Option<&Tensor>| -> Result<Tensor, ModelError> {
            let product = w.rows_product(h, sums)?;
            Ok(match bias {
                Some(bias) => product.broadcast_add(bias)?,
                None => product,
            })
        };
        let bias = |i: usize| self.biases.as_ref().map(|biases| &biases[i]);
        Ok((
            project(&self.wq, bias(0))?,
            project(&self.wk, bias(1))?,
            project(&self.wv, bias(2))?,
        ))
    }

    /// The weights of its linear layers.
    fn projections(&self) -> [&Weight; 7] {
        [
            &self.wq, &self.wk, &self.wv, &self.wo, &self.gate, &self.up, &self.down,
        ]
    }
}

/// A loaded model: its weights (f32, or quantized as stored), the tokenizer and the rotary tables.
pub struct Llama {
    config: LlamaConfig,
    spec: ModelSpec,
    embedding: Embedding,
    output: Weight,
    output_norm: Tensor,
    blocks: Vec<Block>,
    tokenizer: ChatTokenizer,
    inv_freq: Vec<f32>,
}

/// A weight as a linear layer multiplies by it, `[in, out]` (GGUF stores `[out, in]`).
pub(crate) fn transposed(weight: Tensor) -> Result<Weight, ModelError> {
    Ok(Weight::new(weight.t()?.contiguous()?))
}

impl Llama {
    /// Loads a Llama-architecture GGUF: its weights as f32, or, above
    /// [`F32_LIMIT`](super::weight::F32_LIMIT) as f32, as the file stores them.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// [`load`](Self::load) from an opened GGUF.
    pub fn from_gguf(gguf: GgufFile) -> Result<Self, ModelError> {
        Self::from_variant(gguf, &LLAMA)
    }

    /// Loads a Llama-architecture GGUF holding its weights as the file stores them, whatever its
    /// size: the path a model above [`F32_LIMIT`](super::weight::F32_LIMIT) as f32 takes.
    pub fn load_quantized(path: &Path) -> Result<Self, ModelError> {
        Self::with_weights(GgufFile::open(path)?, &LLAMA, true)
    }

    /// A GGUF of a family with Llama's block, loaded as `variant` says: its weights dequantised to
    /// f32, or, above [`F32_LIMIT`](super::weight::F32_LIMIT) as f32, held as the file stores them.
    pub(crate) fn from_variant(gguf: GgufFile, variant: &Variant) -> Result<Self, ModelError> {
        let quantized = gguf.holds_quantized();
        Self::with_weights(gguf, variant, quantized)
    }

    /// [`from_variant`](Self::from_variant), the weights `quantized` or f32.
    fn with_weights(
        gguf: GgufFile,
        variant: &Variant,
        quantized: bool,
    ) -> Result<Self, ModelError> {
        gguf.check_fits(quantized, true)?;
        let tokenizer = ChatTokenizer::from_gguf(&gguf)?;
        let config = gguf.llama_config(variant.architecture)?;
        let linear = |name: &str, heads: Option<usize>| -> Result<Weight, ModelError> {
            let heads = heads.filter(|_| variant.permuted_qk);
            match (quantized, heads) {
                (true, None) => Weight::quantized(gguf.qtensor(name)?),
                (true, Some(heads)) => {
                    Weight::quantized(unpermute_quantized_rows(&*gguf.qtensor(name)?, heads)?)
                }
                (false, None) => transposed(gguf.tensor(name)?),
                (false, Some(heads)) => transposed(unpermute_rows(&gguf.tensor(name)?, heads)?),
            }
        };
        let block = |layer: usize| -> Result<Block, ModelError> {
            let name = |name: &str| format!("blk.{layer}.{name}.weight");
            let weight = |short: &str| linear(&name(short), None);
            let bias = |name: &str| gguf.tensor(&format!("blk.{layer}.{name}.bias"));
            let biases = match gguf.has_tensor(&format!("blk.{layer}.attn_q.bias")) {
                true => Some([bias("attn_q")?, bias("attn_k")?, bias("attn_v")?]),
                false => None,
            };
            Ok(Block {
                attn_norm: gguf.tensor(&name("attn_norm"))?,
                wq: linear(&name("attn_q"), Some(config.n_heads))?,
                wk: linear(&name("attn_k"), Some(config.n_kv_heads))?,
                wv: weight("attn_v")?,
                biases,
                wo: weight("attn_output")?,
                ffn_norm: gguf.tensor(&name("ffn_norm"))?,
                gate: weight("ffn_gate")?,
                up: weight("ffn_up")?,
                down: weight("ffn_down")?,
            })
        };
        let embedding = || -> Result<Embedding, ModelError> {
            Ok(match quantized {
                true => Embedding::Quantized(gguf.qtensor("token_embd.weight")?),
                false => Embedding::F32(gguf.tensor("token_embd.weight")?),
            })
        };
        let (embedding, blocks) = gguf.embedding_and_blocks(embedding, config.n_layers, block)?;
        let output = match gguf.has_tensor("output.weight") {
            true => linear("output.weight", None)?,
            false => embedding.tied_output()?,
        };
        let head_dim = config.head_dim();
        let (inv_freq, rope_theta) = rotary(&gguf, &config, head_dim)?;
        let spec = ModelSpec {
            family: variant.architecture,
            name: config.name.clone(),
            n_layers: config.n_layers,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            rope_theta,
            rope_thetas: Vec::new(),
            windows: vec![0; config.n_layers],
            engine: match quantized {
                true => QUANTIZED_ENGINE,
                false => F32_ENGINE,
            }
            .into(),
        };
        Ok(Self {
            output,
            output_norm: gguf.tensor("output_norm.weight")?,
            embedding,
            blocks,
            tokenizer,
            inv_freq,
            config,
            spec,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

/// The rotary's inverse frequencies, and the one base a trace may state for them. Where the file
/// has `rope_freqs.weight` (Llama 3.1's and 3.2's long-context scaling, as llama.cpp's converter
/// writes it and its `ggml_rope_ext` reads it), each pair's frequency is divided by its factor;
/// such a rotary has no single base, so none is stated (as a transformers capture of a model with
/// `rope_scaling` states none) and the methods that turn keys back refuse its traces. Any other
/// scaling (`rope.scaling.type`) is refused.
fn rotary(
    gguf: &GgufFile,
    config: &LlamaConfig,
    head_dim: usize,
) -> Result<(Vec<f32>, Option<f32>), ModelError> {
    let scaling = format!("{}.rope.scaling.type", config.architecture);
    if gguf.str_value(&scaling).is_some_and(|kind| kind != "none") {
        return Err(gguf.metadata_error(
            &scaling,
            "`none` (kvreplay's rotary scales only by Llama 3's `rope_freqs`)",
        ));
    }
    let inv_freq = inverse_frequencies(config.rope_theta, head_dim);
    if !gguf.has_tensor(ROPE_FREQS) {
        return Ok((inv_freq, Some(config.rope_theta)));
    }
    let factors: Vec<f32> = gguf.tensor(ROPE_FREQS)?.to_vec1()?;
    let scaled = scaled_frequencies(&inv_freq, &factors)
        .map_err(|_| gguf.metadata_error(ROPE_FREQS, "one factor per rotary pair"))?;
    Ok((scaled, None))
}

/// The tensor of Llama 3's per-pair rotary factors.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// `inv_freq` divided pair by pair by `factors`; an error unless there is one factor a pair.
fn scaled_frequencies(inv_freq: &[f32], factors: &[f32]) -> Result<Vec<f32>, ()> {
    if factors.len() != inv_freq.len() {
        return Err(());
    }
    Ok(inv_freq.iter().zip(factors).map(|(f, k)| f / k).collect())
}

impl CausalLm for Llama {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn tokenizer(&self) -> &dyn TextTokenizer {
        &self.tokenizer
    }

    fn forward_rows(&self, rows: &mut [Row<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let (x, spans) = self.hidden(rows, Feed::Chunk)?;
        last_logits(&x, &spans, |states, spans| self.logits(states, spans))
    }

    fn forward_steps(
        &self,
        rows: &mut [Row<'_, '_>],
        on_logits: &(dyn Fn(usize, usize, &[f32]) + Sync),
    ) -> Result<(), ModelError> {
        let (x, spans) = self.hidden(rows, Feed::Steps)?;
        every_step_logits(&x, &spans, |s, spans| self.logits(s, spans), on_logits)
    }

    fn weight_products_per_token(&self) -> Option<WeightProducts> {
        Some(WeightProducts {
            blocks: elements(self.blocks.iter().flat_map(Block::projections)),
            output: self.output.elem_count(),
            bytes: bytes(
                self.blocks
                    .iter()
                    .flat_map(Block::projections)
                    .chain([&self.output]),
            ),
        })
    }

    fn attends_over_prefixes(&self) -> bool {
        true
    }

    fn attention_weights(&self, layer: usize) -> Result<Option<AttentionWeights>, ModelError> {
        let block = &self.blocks[layer];
        let bias = |index: usize| -> Result<Option<Array1<f32>>, ModelError> {
            match &block.biases {
                Some(biases) => Ok(Some(Array1::from(biases[index].to_vec1::<f32>()?))),
                None => Ok(None),
            }
        };
        let projection = |weight: &Weight, bias: Option<Array1<f32>>| -> Result<_, ModelError> {
            Ok(Projection {
                weight: weight.linear()?,
                bias,
            })
        };
        Ok(Some(AttentionWeights {
            projections: [
                projection(&block.wq, bias(0)?)?,
                projection(&block.wk, bias(1)?)?,
                projection(&block.wv, bias(2)?)?,
                projection(&block.wo, None)?,
            ],
            qk_norms: None,
        }))
    }
}

/// What a row's attention needs through every layer of one pass: what its cache held before the
/// pass and its rotary tables.
struct Sequence {
    past: usize,
    feed: Feed,
    rotary: RotaryTables,
}

impl Llama {
    /// Every row's tokens through every block, fed as `feed` says: the stacked hidden states
    /// before the output norm, and where each row's tokens sit among them.
    fn hidden(
        &self,
        rows: &mut [Row<'_, '_>],
        feed: Feed,
    ) -> Result<(Tensor, Vec<(usize, usize)>), ModelError> {
        check_rows(rows)?;
        let eps = self.config.rms_eps;
        let spans = spans(rows);
        let sums = product_spans(&spans, feed);
        let mut x = self.embedding.rows(&stacked_ids(rows)?)?;
        let sequences = rows
            .iter()
            .map(|row| self.sequence(row, feed))
            .collect::<Result<Vec<_>, _>>()?;
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, eps)?;
            record_inputs(rows, layer, &h, &spans)?;
            let (q, k, v) = block.projected(&h, &sums)?;
            let attended = each_row_attends(
                rows,
                (&sequences, &spans),
                (&q, &k, &v),
                |sequence, projected| self.rotated(layer, sequence, projected),
            )?;
            x = (x + block.wo.rows_product(&attended, &sums)?)?;
            let h = rms_norm(&x, &block.ffn_norm, eps)?;
            let product = |w: &Weight| w.rows_product(&h, &sums);
            let gated = gated(
                &product(&block.gate)?,
                &product(&block.up)?,
                Activation::Silu,
            )?;
            x = (x + block.down.rows_product(&gated, &sums)?)?;
        }
        for (row, &(_, n)) in rows.iter_mut().zip(&spans) {
            row.cache.next_position += n;
        }
        Ok((x, spans))
    }

    /// The logits of hidden states `states` stacking rows at `spans`.
    fn logits(&self, states: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor, ModelError> {
        let normed = rms_norm(states, &self.output_norm, self.config.rms_eps)?;
        self.output.rows_product(&normed, spans)
    }

    /// What `row`'s attention needs through the pass, its tokens fed as `feed` says.
    fn sequence(&self, row: &Row<'_, '_>, feed: Feed) -> Result<Sequence, ModelError> {
        let (n, past) = (row.ids.len(), row.cache.len());
        let rotary = rotary_tables(&self.inv_freq, row.cache.next_position, n);
        Ok(Sequence { past, feed, rotary })
    }

    /// One row's vectors at `layer` as its attention takes them, from its projections
    /// `[n, heads * d]`: rotary applied.
    fn rotated(
        &self,
        layer: usize,
        sequence: &Sequence,
        (q, k, v): (Tensor, Tensor, Tensor),
    ) -> Result<Rotated, ModelError> {
        let config = &self.config;
        let (n_heads, n_kv) = (config.n_heads, config.n_kv_heads);
        let q = rotate(&split_heads(&q, n_heads)?, &sequence.rotary)?;
        let k = rotate(&split_heads(&k, n_kv)?, &sequence.rotary)?;
        let v = split_heads(&v, n_kv)?;
        let geometry = LayerAttention {
            layer,
            n_heads,
            window: 0,
            scale: 1.0 / (config.head_dim() as f64).sqrt(),
            feed: sequence.feed,
        };
        Ok((geometry, sequence.past, (q, k, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::scaled_frequencies;

    #[test]
    fn rope_freqs_divide_each_pairs_frequency() {
        // Base 10,000, head size 4: pairs at 1 and 10,000^(-1/2) = 0.01; factors 1 and 8.
        let inv_freq = super::inverse_frequencies(10_000.0, 4);
        assert_eq!(inv_freq, [1.0, 0.01]);
        assert_eq!(
            scaled_frequencies(&inv_freq, &[1.0, 8.0]).unwrap(),
            [1.0, 0.00125]
        );
        assert!(scaled_frequencies(&inv_freq, &[1.0]).is_err());
    }
}
