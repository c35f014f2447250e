//! The Gemma 3 forward pass (`general.architecture = gemma3`, e.g. Gemma 3 270M): scaled token
//! embeddings, RMSNorm before and after attention and the MLP, RMS-normed queries and keys,
//! half-split rotary with one base for sliding-window layers and another for global ones, a gated
//! tanh-GELU MLP, tied embeddings.
//!
//! Sources: Hugging Face transformers `models/gemma3/modeling_gemma3.py` (5.x) for the layer
//! order, and llama.cpp `src/llama-model.cpp` (`LLM_ARCH_GEMMA3`) for what the GGUF leaves out:
//! every sixth layer is global (`set_swa_pattern(6)`: layer `l` slides when `l % 6 < 5`), the
//! sliding layers' rotary base is 10,000 (`rope_freq_base_train_swa`), the global layers' comes
//! from `gemma3.rope.freq_base`, and the attention scale is `1/sqrt(key_length)` (the models
//! below 27B). llama.cpp's converter stores every RMSNorm weight as `1 + w`, so the norms here
//! multiply by the stored weight as it is. A sliding layer attends over its last
//! `gemma3.attention.sliding_window` positions, its own included (transformers'
//! `sliding_window_overlay`: `q - kv < window`). Checked against transformers' own loading of the
//! same GGUF (docs/assets.md).

use super::batch::{
    each_row_attends, elements, entered_at, entry_states, every_step_logits, last_logits,
    product_spans, record_inputs, record_residuals, spans, stacked_ids, take_below, Feed, Rotated,
};
use super::cached_attention::LayerAttention;
use super::causal_lm::{check_rows_entering, CausalLm, ModelSpec, Row, WeightProducts, F32_ENGINE};
use super::gated::{gated, Activation};
use super::gguf::GgufFile;
use super::llama::transposed;
use super::ops::{inverse_frequencies, rms_norm, rotary_tables, rotate, split_heads, RotaryTables};
use super::product::rows_product;
use super::prompt::TextTokenizer;
use super::weight::Weight;
use super::{ModelError, SpmTokenizer};
use crate::trace::{AttentionWeights, Projection, QkNorms};
use candle_core::Tensor;
use ndarray::Array1;
use std::path::Path;

/// Every `SLIDING_PATTERN`-th layer is global (llama.cpp `set_swa_pattern(6)`).
const SLIDING_PATTERN: usize = 6;
/// The rotary base of sliding-window layers (llama.cpp `rope_freq_base_train_swa`).
const SLIDING_ROPE_THETA: f32 = 10_000.0;

struct Block {
    attn_norm: Tensor,
    // Weights are stored transposed, [in, out], so a linear layer is one `matmul`.
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    q_norm: Tensor,
    k_norm: Tensor,
    post_attention_norm: Tensor,
    ffn_norm: Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    post_ffw_norm: Tensor,
}

impl Block {
    /// The weights of its linear layers.
    fn projections(&self) -> [&Weight; 7] {
        [
            &self.wq, &self.wk, &self.wv, &self.wo, &self.gate, &self.up, &self.down,
        ]
    }
}

/// A loaded Gemma 3 model: f32 weights, the tokenizer and the two rotary tables.
pub struct Gemma3 {
    spec: ModelSpec,
    rms_eps: f64,
    embedding: Tensor,
    embedding_scale: f64,
    output_norm: Tensor,
    blocks: Vec<Block>,
    tokenizer: SpmTokenizer,
    global_inv_freq: Vec<f32>,
    sliding_inv_freq: Vec<f32>,
}

impl Gemma3 {
    /// Loads a Gemma 3 GGUF, dequantising every weight to f32.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// [`load`](Self::load) from an opened GGUF.
    pub fn from_gguf(gguf: GgufFile) -> Result<Self, ModelError> {
        if gguf.architecture() != "gemma3" {
            return Err(gguf.metadata_error("general.architecture", "\"gemma3\""));
        }
        if gguf.asks_quantized() {
            return Err(ModelError::F32Only {
                path: gguf.path.clone(),
                family: "gemma3",
            });
        }
        gguf.check_fits(false, false)?;
        let key = |name: &str| format!("gemma3.{name}");
        let n_layers = gguf.usize_value(&key("block_count"))?;
        let n_heads = gguf.usize_value(&key("attention.head_count"))?;
        let n_kv_heads = gguf.usize_value(&key("attention.head_count_kv"))?;
        let head_dim = gguf.usize_value(&key("attention.key_length"))?;
        let hidden = gguf.usize_value(&key("embedding_length"))?;
        let window = gguf.usize_value(&key("attention.sliding_window"))?;
        let global_theta = gguf.f32_value(&key("rope.freq_base"))?;
        let rms_eps = gguf.f32_value(&key("attention.layer_norm_rms_epsilon"))? as f64;
        let tokenizer = SpmTokenizer::from_gguf(&gguf)?;
        let block = |layer: usize| -> Result<Block, ModelError> {
            let weight = |name: &str| gguf.tensor(&format!("blk.{layer}.{name}.weight"));
            Ok(Block {
                attn_norm: weight("attn_norm")?,
                wq: transposed(weight("attn_q")?)?,
                wk: transposed(weight("attn_k")?)?,
                wv: transposed(weight("attn_v")?)?,
                wo: transposed(weight("attn_output")?)?,
                q_norm: weight("attn_q_norm")?,
                k_norm: weight("attn_k_norm")?,
                post_attention_norm: weight("post_attention_norm")?,
                ffn_norm: weight("ffn_norm")?,
                gate: transposed(weight("ffn_gate")?)?,
                up: transposed(weight("ffn_up")?)?,
                down: transposed(weight("ffn_down")?)?,
                post_ffw_norm: weight("post_ffw_norm")?,
            })
        };
        let embedding = || gguf.tensor("token_embd.weight");
        let (embedding, blocks) = gguf.embedding_and_blocks(embedding, n_layers, block)?;
        let windows: Vec<usize> = (0..n_layers)
            .map(|layer| {
                if layer % SLIDING_PATTERN < SLIDING_PATTERN - 1 {
                    window
                } else {
                    0
                }
            })
            .collect();
        let spec = ModelSpec {
            family: "gemma3",
            name: gguf.name("gemma3"),
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            rope_theta: None,
            rope_thetas: windows
                .iter()
                .map(|&w| {
                    if w > 0 {
                        SLIDING_ROPE_THETA
                    } else {
                        global_theta
                    }
                })
                .collect(),
            windows,
            engine: F32_ENGINE.into(),
        };
        Ok(Self {
            embedding,
            embedding_scale: (hidden as f32).sqrt() as f64,
            output_norm: gguf.tensor("output_norm.weight")?,
            blocks,
            tokenizer,
            global_inv_freq: inverse_frequencies(global_theta, head_dim),
            sliding_inv_freq: inverse_frequencies(SLIDING_ROPE_THETA, head_dim),
            rms_eps,
            spec,
        })
    }
}

impl CausalLm for Gemma3 {
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
            output: self.embedding.elem_count(),
            bytes: 4
                * (elements(self.blocks.iter().flat_map(Block::projections))
                    + self.embedding.elem_count()),
        })
    }

    fn attends_over_prefixes(&self) -> bool {
        true
    }

    fn residual_layer(&self) -> Option<usize> {
        let first_global = self.spec.windows.iter().position(|&window| window == 0)?;
        (first_global > 0).then_some(first_global)
    }

    fn attention_weights(&self, layer: usize) -> Result<Option<AttentionWeights>, ModelError> {
        let block = &self.blocks[layer];
        let projection = |weight: &Weight| -> Result<Projection, ModelError> {
            Ok(Projection {
                weight: weight.linear()?,
                bias: None,
            })
        };
        let norm = |norm: &Tensor| -> Result<Array1<f32>, ModelError> {
            Ok(Array1::from(norm.to_vec1::<f32>()?))
        };
        Ok(Some(AttentionWeights {
            projections: [
                projection(&block.wq)?,
                projection(&block.wk)?,
                projection(&block.wv)?,
                projection(&block.wo)?,
            ],
            qk_norms: Some(QkNorms {
                q: norm(&block.q_norm)?,
                k: norm(&block.k_norm)?,
                eps: self.rms_eps as f32,
            }),
        }))
    }
}

/// What a row's attention needs through every layer of one pass: what its cache held before
/// the pass and its two rotary tables.
struct Sequence {
    past: usize,
    feed: Feed,
    global: RotaryTables,
    sliding: RotaryTables,
}

impl Gemma3 {
    /// Every row's tokens through every block, fed as `feed` says: the stacked hidden states
    /// before the output norm, and where each row's tokens sit among them.
    fn hidden(
        &self,
        rows: &mut [Row<'_, '_>],
        feed: Feed,
    ) -> Result<(Tensor, Vec<(usize, usize)>), ModelError> {
        check_rows_entering(rows)?;
        let eps = self.rms_eps;
        let spans = spans(rows);
        let sums = product_spans(&spans, feed);
        let entered = entered_at(rows)?;
        let mut x = match entered {
            Some(_) => entry_states(rows)?,
            None => (self.embedding.embedding(&stacked_ids(rows)?)? * self.embedding_scale)?,
        };
        let sequences = rows
            .iter()
            .map(|row| self.sequence(row, feed))
            .collect::<Result<Vec<_>, _>>()?;
        let residual_layer = self.residual_layer();
        for (layer, block) in self.blocks.iter().enumerate() {
            if Some(layer) == residual_layer {
                record_residuals(rows, &x, &spans)?;
            }
            if entered.is_some_and(|entered| layer < entered) {
                take_below(rows, layer)?;
                continue;
            }
            let h = rms_norm(&x, &block.attn_norm, eps)?;
            record_inputs(rows, layer, &h, &spans)?;
            let product = |w: &Weight| w.rows_product(&h, &sums);
            let (q, k, v) = (
                product(&block.wq)?,
                product(&block.wk)?,
                product(&block.wv)?,
            );
            let attended = each_row_attends(
                rows,
                (&sequences, &spans),
                (&q, &k, &v),
                |sequence, projected| self.rotated((layer, block), sequence, projected),
            )?;
            let out = block.wo.rows_product(&attended, &sums)?;
            x = (x + rms_norm(&out, &block.post_attention_norm, eps)?)?;
            let h = rms_norm(&x, &block.ffn_norm, eps)?;
            let product = |w: &Weight| w.rows_product(&h, &sums);
            let gated = gated(
                &product(&block.gate)?,
                &product(&block.up)?,
                Activation::GeluTanh,
            )?;
            let down = block.down.rows_product(&gated, &sums)?;
            x = (x + rms_norm(&down, &block.post_ffw_norm, eps)?)?;
        }
        for (row, &(_, n)) in rows.iter_mut().zip(&spans) {
            row.cache.next_position += n;
        }
        Ok((x, spans))
    }

    /// The logits of hidden states `states` stacking rows at `spans` (the tied embedding as the
    /// output layer).
    fn logits(&self, states: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor, ModelError> {
        let normed = rms_norm(states, &self.output_norm, self.rms_eps)?;
        rows_product(&normed, &self.embedding.t()?, spans)
    }

    /// What `row`'s attention needs through the pass, its tokens fed as `feed` says.
    fn sequence(&self, row: &Row<'_, '_>, feed: Feed) -> Result<Sequence, ModelError> {
        let (n, past, start) = (row.ids.len(), row.cache.len(), row.cache.next_position);
        Ok(Sequence {
            past,
            feed,
            global: rotary_tables(&self.global_inv_freq, start, n),
            sliding: rotary_tables(&self.sliding_inv_freq, start, n),
        })
    }

    /// One row's vectors at `layer` as its attention takes them, from its projections
    /// `[n, heads * d]`: QK-norm and rotary applied, within the layer's window.
    fn rotated(
        &self,
        (layer, block): (usize, &Block),
        sequence: &Sequence,
        (q, k, v): (Tensor, Tensor, Tensor),
    ) -> Result<Rotated, ModelError> {
        let (spec, eps) = (&self.spec, self.rms_eps);
        let window = spec.windows[layer];
        let tables = if window > 0 {
            &sequence.sliding
        } else {
            &sequence.global
        };
        let q = split_heads(&q, spec.n_heads)?;
        let q = rotate(&rms_norm(&q, &block.q_norm, eps)?, tables)?;
        let k = split_heads(&k, spec.n_kv_heads)?;
        let k = rotate(&rms_norm(&k, &block.k_norm, eps)?, tables)?;
        let v = split_heads(&v, spec.n_kv_heads)?;
        let geometry = LayerAttention {
            layer,
            n_heads: spec.n_heads,
            window,
            scale: spec.scale as f64,
            feed: sequence.feed,
        };
        Ok((geometry, sequence.past, (q, k, v)))
    }
}
