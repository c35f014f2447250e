//! The model-family axis: what capture and the closed-loop live mode need of a native model
//! ([`CausalLm`]), its geometry ([`ModelSpec`]), its KV cache and the recorder that keeps what
//! attention saw. Greedy generation is written once, here, for every family.

use super::mask::{AttentionMask, Rewrite};
use super::product::with_rows;
use super::prompt::TextTokenizer;
use super::recorder::Recorder;
use super::ModelError;
use crate::stop::Stopped;
use candle_core::{Device, Tensor};
use std::sync::Arc;

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
    /// What computes it, as a trace's `source` names it: [`F32_ENGINE`], [`QUANTIZED_ENGINE`], or
    /// transformers with its versions, dtype and device.
    pub engine: String,
}

/// The native model with every weight dequantised to f32 at load.
pub const F32_ENGINE: &str = "native capture (candle f32, weights dequantised at load)";

/// The native model holding its quantized weights as the GGUF stores them.
pub const QUANTIZED_ENGINE: &str = "native capture (candle f32 activations, weights held quantized as the GGUF stores them, each product on activations quantized to 8 bits)";

/// The multiply-adds of a model's weight products for one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightProducts {
    /// Every block's projections.
    pub blocks: usize,
    /// The output layer (the logits).
    pub output: usize,
    /// Bytes of all those weights as the model holds them (f32, or quantized blocks).
    pub bytes: usize,
}

/// One sequence of a batched forward pass: its next tokens (positions `cache.len()..`), its
/// cache, what records it, and the policy that masks its attention.
pub struct Row<'a, 'm> {
    /// The tokens to run.
    pub ids: &'a [u32],
    /// The sequence's cache, appended to.
    pub cache: &'a mut KvCache,
    /// Records what attention saw, when given.
    pub recorder: Option<&'a mut Recorder>,
    /// Decides what each query attends over; causal when absent.
    pub mask: Option<&'a mut (dyn AttentionMask + 'm)>,
    /// The cache whose first positions `cache` continues on its global layers, when its own
    /// holds only what came after them ([`KvCache::with_room_holding`]): read, not written, and
    /// read once for all the rows of a pass that continue it (a prompt's cache under many
    /// policies). A family that cannot read it says so ([`CausalLm::attends_over_prefixes`]).
    pub prefix: Option<&'a KvCache>,
    /// Where the row's pass enters the model when not at its embedding, in a family that
    /// records hidden states ([`CausalLm::residual_layer`]).
    pub entry: Option<Entry<'a>>,
}

/// A pass that enters the model at layer `layer`: its tokens' hidden states entering that layer,
/// `hidden` `[n, hidden size]`, and, for each layer below it, the keys and values of the row's
/// positions in `below` (a run that computed those layers for these positions as this pass
/// would: an own prefill over a full run's cache, where the layers below the first one its
/// policy compresses run as the full run's).
pub struct Entry<'a> {
    /// The first layer the pass runs.
    pub layer: usize,
    /// The hidden states of the row's tokens entering it.
    pub hidden: Tensor,
    /// The cache the layers below take their keys and values from.
    pub below: &'a KvCache,
}

impl<'a, 'm> Row<'a, 'm> {
    /// A row of `ids` over `cache`, unrecorded, masked by `mask` when given.
    pub fn new(
        ids: &'a [u32],
        cache: &'a mut KvCache,
        mask: Option<&'a mut (dyn AttentionMask + 'm)>,
    ) -> Self {
        Self {
            ids,
            cache,
            recorder: None,
            mask,
            prefix: None,
            entry: None,
        }
    }

    /// The row continuing `prefix`'s positions on the layers where its own cache holds none of
    /// them.
    pub fn over_prefix(self, prefix: Option<&'a KvCache>) -> Self {
        Self { prefix, ..self }
    }
}

/// A native causal language model: one forward pass over a KV cache that a policy may mask.
pub trait CausalLm: Sync {
    /// The geometry.
    fn spec(&self) -> &ModelSpec;

    /// The tokenizer built from the model file.
    fn tokenizer(&self) -> &dyn TextTokenizer;

    /// Runs every row's tokens through the model in one pass, each over its own cache (appended
    /// to), recorder and mask, and returns each row's logits at its last position. In each layer
    /// every query attends over what its row's mask decides when the layer's vectors are known
    /// (a KV-cache policy's evictions: the keys stay in the cache, the attention masks them, so
    /// each head can keep its own set); without a mask, causally (and within the layer's window).
    /// A mask that hides nothing gives the unmasked result bit for bit, and a row's logits are
    /// the same bit for bit whatever it is batched with.
    fn forward_rows(&self, rows: &mut [Row<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError>;

    /// The multiply-adds of the weight products one token costs, where the family knows them:
    /// every block's projections, and the output layer (which a prefill runs for its last token
    /// only). The model's part of a closed loop's essential work.
    fn weight_products_per_token(&self) -> Option<WeightProducts> {
        None
    }

    /// Whether a row's global layers may read their first positions from its
    /// [`prefix`](Row::prefix) (its own cache holding only what came after them).
    fn attends_over_prefixes(&self) -> bool {
        false
    }

    /// Layer `layer`'s attention weights as a trace stores them (`q_proj`, `k_proj`, `v_proj`,
    /// `o_proj`, each `[out, in]` with its bias, the q and k rows in the half-split rotary's
    /// order, and the per-head q/k norms where the family has them): what gives the pre-rotary
    /// queries and keys from the attention inputs; `None` for a family that does not give them.
    fn attention_weights(
        &self,
        _layer: usize,
    ) -> Result<Option<crate::trace::AttentionWeights>, ModelError> {
        Ok(None)
    }

    /// The layer whose entering hidden states a recorded pass keeps
    /// ([`Recorder::residual`]) and where a row's pass may [enter](Row::entry): the first
    /// global layer of a family with sliding-window layers below it; `None` for the others.
    fn residual_layer(&self) -> Option<usize> {
        None
    }

    /// Runs every row's tokens as if each token were fed alone, after the one before it (a
    /// teacher-forced decode, whose tokens are known): each row's cache, and the logits after
    /// each of its tokens, passed to `on_logits(row, step, logits)` (in any order, from any
    /// thread), are those of that many one-token [`forward_rows`](Self::forward_rows) calls, bit
    /// for bit. A row's mask sees its
    /// tokens as one chunk, so it must decide each query's attention from the positions up to
    /// its own alone (a fixed eviction does; a policy that evicts as tokens arrive does not).
    /// This implementation makes the one-token passes; a native family runs one pass.
    fn forward_steps(
        &self,
        rows: &mut [Row<'_, '_>],
        on_logits: &(dyn Fn(usize, usize, &[f32]) + Sync),
    ) -> Result<(), ModelError> {
        check_rows(rows)?;
        let longest = rows.iter().map(|row| row.ids.len()).max().unwrap_or(0);
        for step in 0..longest {
            let mut running = Vec::with_capacity(rows.len());
            let mut indices = Vec::with_capacity(rows.len());
            for (index, row) in rows.iter_mut().enumerate() {
                if let Some(token) = row.ids.get(step..=step) {
                    indices.push(index);
                    running.push(Row {
                        ids: token,
                        cache: &mut *row.cache,
                        recorder: row.recorder.as_deref_mut(),
                        mask: row.mask.as_deref_mut(),
                        prefix: row.prefix,
                        entry: None,
                    });
                }
            }
            for (index, logits) in indices.into_iter().zip(self.forward_rows(&mut running)?) {
                on_logits(index, step, &logits);
            }
        }
        Ok(())
    }

    /// [`forward_rows`](Self::forward_rows) of one row: `ids` at positions `cache.len()..`.
    fn forward_masked(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        recorder: Option<&mut Recorder>,
        mask: Option<&mut dyn AttentionMask>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut rows = [Row {
            ids,
            cache,
            recorder,
            mask,
            prefix: None,
            entry: None,
        }];
        Ok(self
            .forward_rows(&mut rows)?
            .pop()
            .expect("one row, one result"))
    }

    /// [`forward_masked`](Self::forward_masked) without a recorder, entering the model as
    /// `entry` says.
    fn forward_entering(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        mask: Option<&mut dyn AttentionMask>,
        entry: Entry<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut rows = [Row {
            entry: Some(entry),
            ..Row::new(ids, cache, mask)
        }];
        Ok(self
            .forward_rows(&mut rows)?
            .pop()
            .expect("one row, one result"))
    }

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
    /// generated ids and calls `progress(done)` after each chunk or token; a progress that
    /// returns [`Stopped`] ends the generation there ([`ModelError::Stopped`]).
    fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        chunk: usize,
        mut recorder: Option<&mut Recorder>,
        progress: &mut dyn FnMut(usize) -> Result<(), Stopped>,
    ) -> Result<Vec<u32>, ModelError> {
        let mut cache = KvCache::default();
        let mut logits = Vec::new();
        for piece in prompt.chunks(chunk.max(1)) {
            logits = self.forward(piece, &mut cache, recorder.as_deref_mut())?;
            progress(cache.len())?;
        }
        let mut done = cache.len();
        self.decode_greedy(&mut cache, &logits, max_new, recorder, None, &mut |_| {
            done += 1;
            progress(done)
        })
    }

    /// Greedy decoding from `cache`, whose last logits are `logits`: up to `max_new` tokens,
    /// stopping before the stop token, each fed back (attending as `mask` decides, when given).
    /// Calls `on_logits` with the logits after each fed token (one that returns [`Stopped`] ends
    /// the decoding there); returns the tokens.
    fn decode_greedy(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        max_new: usize,
        mut recorder: Option<&mut Recorder>,
        mut mask: Option<&mut dyn AttentionMask>,
        on_logits: &mut dyn FnMut(&[f32]) -> Result<(), Stopped>,
    ) -> Result<Vec<u32>, ModelError> {
        let mut generated = Vec::new();
        let mut next = argmax(logits);
        let stop = self.tokenizer().stop_token();
        while generated.len() < max_new && next != stop {
            generated.push(next);
            let mask = mask.as_mut().map(|m| &mut **m as &mut dyn AttentionMask);
            let step = self.forward_masked(&[next], cache, recorder.as_deref_mut(), mask)?;
            on_logits(&step)?;
            next = argmax(&step);
        }
        Ok(generated)
    }
}

/// Checks that a batch has rows, that none of them is empty, and that each enters the model at
/// its embedding (a family that can [enter](Row::entry) elsewhere checks the first two alone,
/// [`check_rows_entering`]).
pub(crate) fn check_rows(rows: &[Row<'_, '_>]) -> Result<(), ModelError> {
    check_rows_entering(rows)?;
    match rows.iter().any(|row| row.entry.is_some()) {
        true => Err(ModelError::Input(
            "this model's passes enter at the embedding: it records no hidden states".into(),
        )),
        false => Ok(()),
    }
}

/// Checks that a batch has rows and that none of them is empty.
pub(crate) fn check_rows_entering(rows: &[Row<'_, '_>]) -> Result<(), ModelError> {
    if rows.is_empty() || rows.iter().any(|row| row.ids.is_empty()) {
        return Err(ModelError::Input(
            "a forward pass needs at least one row, each with at least one token".into(),
        ));
    }
    Ok(())
}

/// Index of the largest value; the lowest index wins ties.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (index, value) in values.iter().enumerate() {
        if *value > values[best] {
            best = index;
        }
    }
    best as u32
}

/// The keys and values seen so far, per layer: the keys transposed, `[n_kv_heads, head_dim,
/// capacity]` (the layout the logit product reads), the values `[n_kv_heads, capacity,
/// head_dim]`, the positions `start..len` in use (`start` is 0 unless a copy
/// [kept only a layer's last positions](Self::with_room_holding)). The buffers grow by
/// doubling, so a decode step writes its own column and row instead of copying the cache. A clone
/// copies what is in use: a buffer is written in place only beyond every other holder's
/// positions.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// The position of the next token (the entries cached, unless some were removed).
    pub(crate) next_position: usize,
}

struct LayerCache {
    keys_t: Tensor,
    values: Tensor,
    /// The first position held (buffer index 0).
    start: usize,
    /// One past the last position held.
    len: usize,
}

impl LayerCache {
    /// Positions held.
    fn held(&self) -> usize {
        self.len - self.start
    }

    /// The buffer index of position `position`, when it is held.
    fn index(&self, position: usize) -> Result<usize, ModelError> {
        match (self.start..self.len).contains(&position) {
            true => Ok(position - self.start),
            false => Err(ModelError::Mask(format!(
                "position {position} is not in a cache holding positions {}..{}",
                self.start, self.len
            ))),
        }
    }
}

/// Axis of the positions in the transposed keys and in the values.
const KEY_POSITIONS: usize = 2;
const VALUE_POSITIONS: usize = 1;

impl Clone for KvCache {
    fn clone(&self) -> Self {
        self.first_positions(usize::MAX, self.next_position)
    }
}

impl KvCache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |layer| layer.len)
    }

    /// Layers cached so far.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cached keys of `layer`, `[n_kv_heads, positions, head_dim]` (the positions it holds:
    /// all of them, unless a copy kept a sliding-window layer's window only).
    pub fn keys(&self, layer: usize) -> Result<ndarray::Array3<f32>, ModelError> {
        let layer = &self.layers[layer];
        let keys = layer.keys_t.narrow(KEY_POSITIONS, 0, layer.held())?;
        super::mask::to_array(&keys.transpose(1, 2)?.contiguous()?)
    }

    /// The cached keys of `layer` per KV head, each `[positions, head_dim]` row after row in one
    /// shared allocation: [`keys`](Self::keys) head by head, transposed straight from the cache.
    pub(crate) fn head_keys(&self, layer: usize) -> Result<Vec<Arc<[f32]>>, ModelError> {
        let layer = &self.layers[layer];
        let (heads, dim, room) = layer.keys_t.dims3()?;
        let held = layer.held();
        let lines = layer.keys_t.reshape((heads * dim, room))?;
        let transposed = with_rows(&lines, |data, stride| {
            (0..heads)
                .map(|head| {
                    let mut rows = vec![0.0f32; held * dim];
                    for channel in 0..dim {
                        let line = &data[(head * dim + channel) * stride..][..held];
                        for (position, &key) in line.iter().enumerate() {
                            rows[position * dim + channel] = key;
                        }
                    }
                    Arc::from(rows)
                })
                .collect()
        })?;
        transposed.ok_or_else(|| ModelError::Input("cached keys outside CPU memory".into()))
    }

    /// The cached values of `layer`, `[n_kv_heads, positions, head_dim]` (the positions it
    /// holds, as [`keys`](Self::keys)).
    pub fn values(&self, layer: usize) -> Result<ndarray::Array3<f32>, ModelError> {
        let layer = &self.layers[layer];
        let values = layer.values.narrow(VALUE_POSITIONS, 0, layer.held())?;
        super::mask::to_array(&values.contiguous()?)
    }

    /// Writes `rewrite`'s keys and values over their positions of layer `layer`, in place, a run
    /// of consecutive positions at a time. The cache must hold its own buffers (a
    /// [`with_room`](Self::with_room) copy, or one grown by its own appends): a clone or a
    /// truncation may share them with the cache it came from, which would change too.
    pub fn overwrite(&mut self, layer: usize, rewrite: &Rewrite) -> Result<(), ModelError> {
        let cache = &self.layers[layer];
        // Each run's first position is checked as it is written; the last one bounds them all.
        if let Some(&last) = rewrite.positions.last() {
            cache.index(last)?;
        }
        let mut start = 0;
        while start < rewrite.positions.len() {
            let first = rewrite.positions[start];
            let run = rewrite.positions[start..]
                .iter()
                .enumerate()
                .take_while(|&(i, &position)| position == first + i)
                .count();
            let rows = ndarray::s![.., start..start + run, ..];
            let tensor = |rows: ndarray::ArrayView3<f32>| -> Result<Tensor, ModelError> {
                let dims = rows.dim();
                let flat: Vec<f32> = rows.iter().copied().collect();
                Ok(Tensor::from_vec(flat, dims, &Device::Cpu)?)
            };
            let keys_t = tensor(rewrite.keys.slice(rows))?
                .transpose(1, 2)?
                .contiguous()?;
            let offset = cache.index(first)?;
            cache.keys_t.slice_set(&keys_t, KEY_POSITIONS, offset)?;
            cache.values.slice_set(
                &tensor(rewrite.values.slice(rows))?,
                VALUE_POSITIONS,
                offset,
            )?;
            start += run;
        }
        Ok(())
    }

    /// Appends a chunk's keys and values `[n_kv_heads, n, d]` to layer `layer` and returns the
    /// layer's whole cache: keys transposed `[n_kv_heads, d, positions]`, values
    /// `[n_kv_heads, positions, d]`, for the positions `start..` it holds, and `start`.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor, usize), ModelError> {
        let k_t = k.transpose(1, 2)?.contiguous()?;
        let (keys_t, values, start, len) = match self.layers.get(layer) {
            Some(cache) => (
                Some(&cache.keys_t),
                Some(&cache.values),
                cache.start,
                cache.len,
            ),
            None => (None, None, 0, 0),
        };
        let held = len - start;
        let keys_t = grown(keys_t, held, &k_t, KEY_POSITIONS)?;
        let values = grown(values, held, &v, VALUE_POSITIONS)?;
        keys_t.slice_set(&k_t, KEY_POSITIONS, held)?;
        values.slice_set(&v.contiguous()?, VALUE_POSITIONS, held)?;
        let cache = LayerCache {
            keys_t,
            values,
            start,
            len: len + k.dims()[1],
        };
        if self.layers.len() <= layer {
            self.layers.push(cache);
        } else {
            self.layers[layer] = cache;
        }
        let cache = &self.layers[layer];
        Ok((
            cache.keys_t.narrow(KEY_POSITIONS, 0, cache.held())?,
            cache.values.narrow(VALUE_POSITIONS, 0, cache.held())?,
            cache.start,
        ))
    }

    /// A copy with room for `extra` more positions in every layer, so that as many appends grow
    /// no buffer (a clone has no room: its first append doubles it).
    pub fn with_room(&self, extra: usize) -> Result<KvCache, ModelError> {
        self.with_room_holding(extra, &[])
    }

    /// [`with_room`](Self::with_room), holding the last `last[layer]` positions of each layer
    /// (every position it holds where `last` is larger or has no entry). A sliding-window layer
    /// whose queries attend over their window alone needs no more than its window, and the
    /// attention it computes is the same, bit for bit (its sums already leave the keys before the
    /// window out); a layer whose queries a policy masks must keep every position (its masked
    /// sums run over them all). A copy that holds none of a global layer's positions continues
    /// this cache there: a row reads them from this one as its [`prefix`](Row::prefix).
    pub fn with_room_holding(&self, extra: usize, last: &[usize]) -> Result<KvCache, ModelError> {
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(index, layer)| {
                let start = match last.get(index) {
                    Some(&last) => layer.start.max(layer.len.saturating_sub(last)),
                    None => layer.start,
                };
                let (from, held) = (start - layer.start, layer.len - start);
                let copy = |buffer: &Tensor, axis: usize| -> Result<Tensor, ModelError> {
                    let used = buffer.narrow(axis, from, held)?;
                    let mut dims = used.dims().to_vec();
                    dims[axis] += extra;
                    let room = Tensor::zeros(dims, used.dtype(), used.device())?;
                    room.slice_set(&used.contiguous()?, axis, 0)?;
                    Ok(room)
                };
                Ok(LayerCache {
                    keys_t: copy(&layer.keys_t, KEY_POSITIONS)?,
                    values: copy(&layer.values, VALUE_POSITIONS)?,
                    start,
                    len: layer.len,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(KvCache {
            layers,
            next_position: self.next_position,
        })
    }

    /// Layer `layer`'s first `len` positions, as a row continuing this cache reads them: keys
    /// transposed `[n_kv_heads, d, len]`, values `[n_kv_heads, len, d]`.
    pub(crate) fn layer_prefix(
        &self,
        layer: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor), ModelError> {
        match self.layers.get(layer) {
            Some(cache) if cache.start == 0 && len <= cache.len => Ok((
                cache.keys_t.narrow(KEY_POSITIONS, 0, len)?,
                cache.values.narrow(VALUE_POSITIONS, 0, len)?,
            )),
            _ => Err(ModelError::Mask(format!(
                "a row continues positions 0..{len} of layer {layer} of a cache that does not \
                 hold them"
            ))),
        }
    }

    /// Layer `layer`'s keys and values `[n_kv_heads, n, d]` of positions `first..first + n`.
    pub(crate) fn layer_positions(
        &self,
        layer: usize,
        (first, n): (usize, usize),
    ) -> Result<(Tensor, Tensor), ModelError> {
        let cache = self.layers.get(layer).ok_or_else(|| {
            ModelError::Mask(format!(
                "a cache of {} layers has no layer {layer}",
                self.layers.len()
            ))
        })?;
        let from = cache.index(first)?;
        cache.index(first + n - 1)?;
        Ok((
            cache
                .keys_t
                .narrow(KEY_POSITIONS, from, n)?
                .transpose(1, 2)?,
            cache.values.narrow(VALUE_POSITIONS, from, n)?,
        ))
    }

    /// Forgets the last `steps` positions appended to every layer, as if they had not run: the
    /// next appends write over them (the buffers keep their room), so no clone taken since they
    /// were appended may still be read (a clone of a full buffer shares it).
    pub(crate) fn rewind(&mut self, steps: usize) {
        for layer in &mut self.layers {
            assert!(
                layer.held() >= steps,
                "a cache rewinds only positions it holds"
            );
            layer.len -= steps;
        }
        self.next_position -= steps;
    }

    /// The cache of the first `len` positions alone, as if only they had run (`len` at most
    /// [`len`](Self::len)).
    pub fn truncated(&self, len: usize) -> KvCache {
        self.first_positions(len, len)
    }

    /// A copy of the first `len` positions (at most those in use) of every layer, the next token
    /// at `next_position`.
    fn first_positions(&self, len: usize, next_position: usize) -> KvCache {
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|layer| {
                    let len = len.clamp(layer.start, layer.len);
                    let first = |buffer: &Tensor, axis: usize| {
                        buffer
                            .narrow(axis, 0, len - layer.start)
                            .and_then(|t| t.contiguous())
                            .expect("a cache's positions in use are within its buffer")
                    };
                    LayerCache {
                        keys_t: first(&layer.keys_t, KEY_POSITIONS),
                        values: first(&layer.values, VALUE_POSITIONS),
                        start: layer.start,
                        len,
                    }
                })
                .collect(),
            next_position,
        }
    }

    /// The same cache holding only the entries `positions` (ascending) in every layer and head:
    /// the keys keep the rotation of their original positions, as an evicting cache's survivors
    /// do, and the next token still gets the next position.
    pub fn retain(&self, positions: &[usize]) -> Result<KvCache, ModelError> {
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let index = positions
                    .iter()
                    .map(|&p| layer.index(p).map(|i| i as u32))
                    .collect::<Result<Vec<u32>, ModelError>>()?;
                let index = Tensor::from_vec(index, positions.len(), &Device::Cpu)?;
                let kept = |buffer: &Tensor, axis: usize| {
                    buffer
                        .narrow(axis, 0, layer.held())?
                        .contiguous()?
                        .index_select(&index, axis)
                };
                Ok(LayerCache {
                    keys_t: kept(&layer.keys_t, KEY_POSITIONS)?,
                    values: kept(&layer.values, VALUE_POSITIONS)?,
                    start: 0,
                    len: positions.len(),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(KvCache {
            layers,
            next_position: self.next_position,
        })
    }
}

/// `buffer` (its first `len` positions along `axis` in use) with room for `new` after them: the
/// same buffer when it has room, else one of twice its size (at least `len` plus `new`'s
/// positions) holding a copy of the positions in use.
fn grown(
    buffer: Option<&Tensor>,
    len: usize,
    new: &Tensor,
    axis: usize,
) -> Result<Tensor, ModelError> {
    let needed = len + new.dims()[axis];
    let capacity = buffer.map_or(0, |b| b.dims()[axis]);
    match buffer {
        Some(buffer) if capacity >= needed => Ok(buffer.clone()),
        _ => {
            let mut dims = new.dims().to_vec();
            dims[axis] = (2 * capacity).max(needed);
            let bigger = Tensor::zeros(dims, new.dtype(), new.device())?;
            if let (Some(buffer), true) = (buffer, len > 0) {
                bigger.slice_set(&buffer.narrow(axis, 0, len)?.contiguous()?, axis, 0)?;
            }
            Ok(bigger)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk `[kv_heads = 2, n, d = 3]` whose entries name their head and position.
    fn chunk(start: usize, n: usize, salt: f32) -> (Tensor, Tensor) {
        let values: Vec<f32> = (0..2)
            .flat_map(|head| {
                (start..start + n)
                    .flat_map(move |p| (0..3).map(move |c| salt + (100 * head + 10 * p + c) as f32))
            })
            .collect();
        let t = Tensor::from_vec(values, (2, n, 3), &Device::Cpu).unwrap();
        (t.clone(), (t * 2.0).unwrap())
    }

    /// The keys of layer 0, head after head, row after row; taken head by head they are the same.
    fn rows(cache: &KvCache) -> Vec<f32> {
        let rows: Vec<f32> = cache.keys(0).unwrap().iter().copied().collect();
        let heads = cache.head_keys(0).unwrap();
        assert_eq!(heads.concat(), rows);
        rows
    }

    #[test]
    fn the_cache_grows_in_place_and_a_clone_appends_on_its_own() {
        let mut cache = KvCache::default();
        // Chunks of 1, 2, 3 and 1 positions: the buffer grows 1 -> 3 -> 6 -> 12 positions.
        let mut start = 0;
        for n in [1, 2, 3, 1] {
            let (k, v) = chunk(start, n, 0.0);
            let (keys_t, values, first) = cache.append(0, k, v).unwrap();
            start += n;
            assert_eq!(first, 0);
            assert_eq!(keys_t.dims(), [2, 3, start]);
            assert_eq!(values.dims(), [2, start, 3]);
        }
        let (whole, _) = chunk(0, start, 0.0);
        let whole: Vec<f32> = whole.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(rows(&cache), whole);
        // The original and its clone each append a different position 7: neither sees the other's.
        let mut clone = cache.clone();
        let (k, v) = chunk(start, 1, 0.5);
        clone.append(0, k, v).unwrap();
        let (k, v) = chunk(start, 1, 0.25);
        cache.append(0, k, v).unwrap();
        let newest = |cache: &KvCache| cache.keys(0).unwrap()[[1, start, 2]];
        assert_eq!(newest(&clone), 0.5 + 172.0);
        assert_eq!(newest(&cache), 0.25 + 172.0);
        assert_eq!(rows(&clone)[..whole.len() / 2], whole[..whole.len() / 2]);
        // A copy with room holds the same positions and takes appends without growing.
        let roomy = cache.with_room(3).unwrap();
        assert_eq!(rows(&roomy), rows(&cache));
        assert_eq!(roomy.layers[0].keys_t.dims()[2], start + 1 + 3);
        let mut grown = roomy;
        for n in [1, 2] {
            let (k, v) = chunk(start + 1, n, 0.0);
            grown.append(0, k, v).unwrap();
        }
        assert_eq!(grown.layers[0].keys_t.dims()[2], start + 4);
        // Keeping positions 0 and 6 keeps their keys.
        let kept = cache.retain(&[0, 6]).unwrap();
        assert_eq!(kept.len(), 2);
        assert_eq!(kept.keys(0).unwrap()[[1, 1, 0]], 160.0);
    }

    #[test]
    fn a_windowed_copy_holds_the_last_positions_and_appends_after_them() {
        let mut cache = KvCache::default();
        let (k, v) = chunk(0, 7, 0.0);
        cache.append(0, k, v).unwrap();
        // Layer 0 kept to its last 3 positions (4, 5, 6), with room for 2 more.
        let mut windowed = cache.with_room_holding(2, &[3]).unwrap();
        assert_eq!((windowed.layers[0].start, windowed.len()), (4, 7));
        let (last, _) = chunk(4, 3, 0.0);
        let last: Vec<f32> = last.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(rows(&windowed), last);
        let (k, v) = chunk(7, 1, 0.0);
        let (keys_t, values, start) = windowed.append(0, k, v).unwrap();
        assert_eq!(keys_t.dims(), [2, 3, 4]);
        assert_eq!((values.dims(), start), (&[2usize, 4, 3][..], 4));
        assert_eq!(
            windowed.layers[0].keys_t.dims()[2],
            5,
            "appended into its room"
        );
        assert_eq!(windowed.keys(0).unwrap()[[1, 3, 0]], 170.0);
        // Positions before the window are gone: naming them is an error.
        assert!(windowed.retain(&[3, 5]).is_err());
        let keys = ndarray::Array3::zeros((2, 1, 3));
        let rewrite = |position| Rewrite {
            positions: vec![position],
            keys: keys.clone(),
            values: keys.clone(),
        };
        assert!(windowed.overwrite(0, &rewrite(3)).is_err());
        windowed.overwrite(0, &rewrite(5)).unwrap();
        assert_eq!(windowed.keys(0).unwrap()[[0, 1, 0]], 0.0);
        // A count wider than the layer, or none given, keeps every position; 0 keeps none.
        for last in [&[9][..], &[]] {
            let whole = cache.with_room_holding(0, last).unwrap();
            assert_eq!(rows(&whole), rows(&cache));
        }
        let none = cache.with_room_holding(1, &[0]).unwrap();
        assert_eq!((none.layers[0].start, none.len()), (7, 7));
    }
}
