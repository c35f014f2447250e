//! One row's attention at one layer once its queries and keys are rotated: the policy's mask
//! (within the layer's window), the recorder, the cache appended to, and the weighted values. Every
//! family whose attention is plain scaled dot-product over a window calls it after its own
//! projections, norms and rotary.

use super::causal_lm::Row;
use super::mask::policy_mask;
use super::masked_softmax::ChunkMask;
use super::ops::attend;
use super::ModelError;
use candle_core::Tensor;

/// How a pass feeds each row's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Feed {
    /// As one chunk (a prefill): each row's products and attention over its tokens at once.
    Chunk,
    /// As if one token at a time ([`CausalLm::forward_steps`](super::CausalLm::forward_steps)):
    /// every product summed per token as a one-token pass sums it, and each query attending as
    /// its own step would.
    Steps,
}

/// The attention geometry of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerAttention {
    /// The layer's index.
    pub layer: usize,
    /// Query heads.
    pub n_heads: usize,
    /// The most recent positions a query attends over, its own included (0: global).
    pub window: usize,
    /// Softmax scale of the logits.
    pub scale: f64,
    /// Whether the row's tokens attend as one chunk or one step at a time.
    pub feed: Feed,
}

/// A row's queries at one layer once its cache holds their keys and values, ready to attend.
pub(crate) struct Prepared {
    pub geometry: LayerAttention,
    /// Positions the row's cache held before the pass.
    pub past: usize,
    /// The post-rotary queries `[n_heads, n, d]`.
    pub q: Tensor,
    /// The row's own cache after the append: keys transposed `[n_kv_heads, d, held]`, values
    /// `[n_kv_heads, held, d]`, for the positions from `start` on.
    pub held: (Tensor, Tensor, usize),
    /// The policy's mask `[n_heads, n, past + n]`, when it decides.
    pub policy_mask: Option<Vec<f32>>,
}

/// `row`'s attention at `geometry.layer` for its post-rotary q `[n_heads, n, d]`, k and v
/// `[n_kv_heads, n, d]` (the row's cache held `past` positions before them): `[n_heads, n, d]`.
/// A sliding-window layer needs a cache that holds every position (one whose entries were
/// removed, [`KvCache::retain`](super::KvCache::retain), is refused).
pub(crate) fn attend_cached(
    row: &mut Row<'_, '_>,
    geometry: &LayerAttention,
    past: usize,
    qkv: (Tensor, Tensor, Tensor),
) -> Result<Tensor, ModelError> {
    let prepared = prepare_cached(row, geometry, past, qkv)?;
    let attention = prepared.attend_alone()?;
    finish(row, prepared, &attention);
    Ok(attention)
}

/// What [`attend_cached`] does before its queries attend: the policy's mask, its rewrite of the
/// cache, the recorder, and the keys and values appended to the cache.
pub(crate) fn prepare_cached(
    row: &mut Row<'_, '_>,
    geometry: &LayerAttention,
    past: usize,
    (q, k, v): (Tensor, Tensor, Tensor),
) -> Result<Prepared, ModelError> {
    let LayerAttention { layer, window, .. } = *geometry;
    if window > 0 && past != row.cache.next_position {
        return Err(ModelError::Mask(
            "a sliding-window layer masks by position: its cache must hold every position".into(),
        ));
    }
    let policy_mask = policy_mask(row.mask.as_deref_mut(), layer, past, (&q, &k, &v))?;
    if let Some(rewrite) = row.mask.as_deref_mut().and_then(|mask| mask.rewrite(layer)) {
        row.cache.overwrite(layer, &rewrite)?;
    }
    if let Some(recorder) = row.recorder.as_deref_mut() {
        recorder.record(layer, &q, &k, &v)?;
    }
    let held = row.cache.append(layer, k, v)?;
    Ok(Prepared {
        geometry: *geometry,
        past,
        q,
        held,
        policy_mask,
    })
}

impl Prepared {
    /// The queries attending over the row's own cache alone.
    pub fn attend_alone(&self) -> Result<Tensor, ModelError> {
        let (keys_t, values, start) = &self.held;
        let held = (keys_t, values, *start);
        let mask = (self.policy_mask.as_deref(), self.past);
        match self.geometry.feed {
            Feed::Steps if self.q.dims()[1] > 1 => {
                attend_each_query(&self.q, held, mask, &self.geometry)
            }
            _ => attend_visible(&self.q, held, mask, &self.geometry),
        }
    }
}

/// What [`attend_cached`] does once the queries attended: the mask's buffer given back, and the
/// recorder.
pub(crate) fn finish(row: &mut Row<'_, '_>, prepared: Prepared, attention: &Tensor) {
    if let Some(mask) = prepared.policy_mask {
        super::mask_buffers::give_back(mask);
    }
    if let Some(recorder) = row.recorder.as_deref_mut() {
        recorder.record_attention(prepared.geometry.layer, attention);
    }
}

/// Queries `q` `[n_heads, n, d]` at positions `past..past + n` attending over the cache's
/// positions up to `past + n` (keys transposed, values, both from position `start` on) as
/// `policy_mask` `[n_heads, n, past + n]` decides (when it does), within the layer's window.
fn attend_visible(
    q: &Tensor,
    (keys_t, values, start): (&Tensor, &Tensor, usize),
    (policy_mask, past): (Option<&[f32]>, usize),
    geometry: &LayerAttention,
) -> Result<Tensor, ModelError> {
    let window = geometry.window;
    let n = q.dims()[1];
    let total = past + n;
    // Keys before the chunk's first query's window are never seen: leave them out.
    let first = match (&policy_mask, window) {
        (None, window) if window > 0 => (past + 1).saturating_sub(window),
        _ => 0,
    };
    if first < start {
        return Err(ModelError::Mask(format!(
            "layer {} attends from position {first}, and its cache holds positions from {start} \
             (a cache kept to its window serves unmasked sliding-window layers only)",
            geometry.layer
        )));
    }
    let mask = ChunkMask {
        policy: policy_mask,
        past,
        window,
        first,
    };
    let keys_t = keys_t.narrow(2, first - start, total - first)?;
    let values = values.narrow(1, first - start, total - first)?;
    attend(q, &keys_t, &values, &mask, geometry.scale)
}

/// [`attend_visible`] of each query of `q` `[n_heads, n, d]` alone, over the positions up to its
/// own, as its one-token step attends: the same sums, bit for bit.
fn attend_each_query(
    q: &Tensor,
    (keys_t, values, start): (&Tensor, &Tensor, usize),
    (policy_mask, past): (Option<&[f32]>, usize),
    geometry: &LayerAttention,
) -> Result<Tensor, ModelError> {
    let n = q.dims()[1];
    let each = (0..n)
        .map(|query| {
            let seen = past + query + 1 - start;
            let mask =
                policy_mask.map(|mask| query_lines(mask, (geometry.n_heads, n, past + n), query));
            let held = (
                &keys_t.narrow(2, 0, seen)?,
                &values.narrow(1, 0, seen)?,
                start,
            );
            attend_visible(
                &q.narrow(1, query, 1)?,
                held,
                (mask.as_deref(), past + query),
                geometry,
            )
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(Tensor::cat(&each, 1)?)
}

/// Query `query`'s lines of a chunk's mask `[heads, n, total]`, up to its own position:
/// `[heads, 1, total - n + query + 1]`, the mask its own one-token step would get.
pub(crate) fn query_lines(
    mask: &[f32],
    (heads, n, total): (usize, usize, usize),
    query: usize,
) -> Vec<f32> {
    let seen = total - n + query + 1;
    (0..heads)
        .flat_map(|head| &mask[(head * n + query) * total..][..seen])
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::KvCache;
    use candle_core::Device;

    fn vectors(heads: usize) -> Tensor {
        Tensor::ones((heads, 1, 2), candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_sliding_layer_refuses_a_cache_with_positions_removed() {
        let mut cache = KvCache::default();
        for _ in 0..2 {
            cache.append(0, vectors(1), vectors(1)).unwrap();
        }
        cache.next_position = 2;
        let mut pruned = cache.retain(&[1]).unwrap();
        let ids = [7];
        let geometry = |window| LayerAttention {
            layer: 0,
            n_heads: 1,
            window,
            scale: 1.0,
            feed: Feed::Chunk,
        };
        let mut row = Row::new(&ids, &mut pruned, None);
        let qkv = || (vectors(1), vectors(1), vectors(1));
        let refused = attend_cached(&mut row, &geometry(4), 1, qkv());
        assert!(matches!(refused, Err(ModelError::Mask(_))));
        // A global layer attends over what is left.
        let attended = attend_cached(&mut row, &geometry(0), 1, qkv()).unwrap();
        assert_eq!(attended.dims(), [1, 1, 2]);
    }

    /// `[heads, n, 4]` vectors that differ by head, position and channel.
    fn varied(heads: usize, positions: std::ops::Range<usize>, salt: f32) -> Tensor {
        let n = positions.len();
        let values: Vec<f32> = (0..heads)
            .flat_map(|h| {
                positions.clone().flat_map(move |p| {
                    (0..4).map(move |c| ((h * 7 + p * 3 + c) as f32 * 0.37 + salt).sin())
                })
            })
            .collect();
        Tensor::from_vec(values, (heads, n, 4), &Device::Cpu).unwrap()
    }

    #[test]
    fn a_cache_kept_to_its_window_attends_as_the_whole_cache() {
        // A sliding layer of window 4 over 10 cached positions: the next tokens' attention over a
        // copy holding the last 4 positions equals the whole cache's, bit for bit, fed as one chunk
        // or a query at a time; a policy mask, which spans every position, is refused there.
        let mut whole = KvCache::default();
        whole
            .append(0, varied(1, 0..10, 0.1), varied(1, 0..10, 0.2))
            .unwrap();
        whole.next_position = 10;
        let windowed = whole.with_room_holding(3, &[4]).unwrap();
        let ids = [1, 2, 3];
        for feed in [Feed::Chunk, Feed::Steps] {
            let geometry = LayerAttention {
                layer: 0,
                n_heads: 2,
                window: 4,
                scale: 0.5,
                feed,
            };
            let qkv = || {
                (
                    varied(2, 10..13, 0.3),
                    varied(1, 10..13, 0.4),
                    varied(1, 10..13, 0.5),
                )
            };
            let attend = |cache: &KvCache| {
                let mut cache = cache.with_room(0).unwrap();
                let mut row = Row::new(&ids, &mut cache, None);
                let out = attend_cached(&mut row, &geometry, 10, qkv()).unwrap();
                out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            assert_eq!(attend(&windowed), attend(&whole), "{feed:?}");
        }
        let mut masked = windowed.with_room(1).unwrap();
        let mut nothing: crate::model::Evicted = vec![vec![Vec::new(); 2]];
        let mut row = Row::new(&ids[..1], &mut masked, Some(&mut nothing));
        let geometry = LayerAttention {
            layer: 0,
            n_heads: 2,
            window: 4,
            scale: 0.5,
            feed: Feed::Chunk,
        };
        let qkv = (
            varied(2, 10..11, 0.3),
            varied(1, 10..11, 0.4),
            varied(1, 10..11, 0.5),
        );
        let refused = attend_cached(&mut row, &geometry, 10, qkv);
        assert!(matches!(refused, Err(ModelError::Mask(_))), "{refused:?}");
    }
}
