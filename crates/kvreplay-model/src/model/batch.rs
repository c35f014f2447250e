//! Several sequences in one forward pass. Every weight product runs once over the rows of all of
//! them stacked (a decode step of many policies reads each weight matrix once instead of once per
//! policy), while each sequence keeps its own cache, positions, recorder and mask, and its
//! attention is the one it gets in a pass of its own (alone, on worker threads, or together with
//! the rows that continue the same prefix, `prefix_attention.rs`). A stacked product
//! sums each row as the product of that row alone does (`product.rs`), so a sequence's logits do
//! not depend on what it was batched with (`tests/integration/live.rs` checks it bit for bit).

pub(crate) use super::cached_attention::Feed;
use super::cached_attention::{finish, prepare_cached, LayerAttention};
use super::causal_lm::Row;
use super::ops::merge_heads;
use super::prefix_attention::attend_prepared;
use super::product::with_rows;
use super::weight::Weight;
use super::ModelError;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Where each row's tokens sit among the stacked rows: `(first, n)`.
pub(crate) fn spans(rows: &[Row<'_, '_>]) -> Vec<(usize, usize)> {
    let mut first = 0;
    rows.iter()
        .map(|row| {
            let span = (first, row.ids.len());
            first += row.ids.len();
            span
        })
        .collect()
}

/// The spans of the rows' last tokens, stacked one per row.
fn last_spans(spans: &[(usize, usize)]) -> Vec<(usize, usize)> {
    (0..spans.len()).map(|row| (row, 1)).collect()
}

/// Every row's token ids, stacked.
pub(crate) fn stacked_ids(rows: &[Row<'_, '_>]) -> Result<Tensor, ModelError> {
    let ids: Vec<u32> = rows
        .iter()
        .flat_map(|row| row.ids.iter().copied())
        .collect();
    let n = ids.len();
    Ok(Tensor::from_vec(ids, n, &Device::Cpu)?)
}

/// `parts` stacked along the first axis (one part stays as it is).
pub(crate) fn stack(mut parts: Vec<Tensor>) -> Result<Tensor, ModelError> {
    if parts.len() == 1 {
        return Ok(parts.pop().expect("one part"));
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// A row's vectors at one layer as its attention takes them: the layer's geometry, the
/// positions its cache held before the pass, and its post-rotary q `[n_heads, n, d]`, k and v
/// `[n_kv_heads, n, d]`.
pub(crate) type Rotated = (LayerAttention, usize, (Tensor, Tensor, Tensor));

/// Each row's attention at one layer: `rotated(its state, its q, k, v projections)` for the row's
/// span of the stacked projections; each row's cache takes its keys and values (on worker
/// threads), its queries attend ([`attend_prepared`]: the rows that continue one prefix over it
/// together), and the outputs `[n, heads * d]` are stacked.
pub(crate) fn each_row_attends<S: Sync>(
    rows: &mut [Row<'_, '_>],
    (states, spans): (&[S], &[(usize, usize)]),
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    rotated: impl Fn(&S, (Tensor, Tensor, Tensor)) -> Result<Rotated, ModelError> + Sync,
) -> Result<Tensor, ModelError> {
    let prepared = rows
        .par_iter_mut()
        .zip(states)
        .zip(spans)
        .map(|((row, state), &(first, n))| {
            let narrow = |t: &Tensor| t.narrow(0, first, n);
            let (geometry, past, qkv) = rotated(state, (narrow(q)?, narrow(k)?, narrow(v)?))?;
            prepare_cached(row, &geometry, past, qkv)
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let attended = attend_prepared(rows, &prepared)?;
    let outputs = rows
        .par_iter_mut()
        .zip(prepared)
        .zip(attended)
        .map(|((row, prepared), attention)| {
            finish(row, prepared, &attention);
            merge_heads(&attention)
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    stack(outputs)
}

/// The layer where every row's pass [enters](Row::entry) the model, when they have entries:
/// all of them, at one layer.
pub(crate) fn entered_at(rows: &[Row<'_, '_>]) -> Result<Option<usize>, ModelError> {
    let layers: Vec<Option<usize>> = rows
        .iter()
        .map(|row| row.entry.as_ref().map(|entry| entry.layer))
        .collect();
    match layers.iter().all(|layer| *layer == layers[0]) {
        true => Ok(layers[0]),
        false => Err(ModelError::Input(
            "the rows of a pass enter the model at one layer, all of them or none".into(),
        )),
    }
}

/// The rows' entering hidden states, stacked `[tokens, hidden]`.
pub(crate) fn entry_states(rows: &[Row<'_, '_>]) -> Result<Tensor, ModelError> {
    let states = rows
        .iter()
        .map(|row| {
            let entry = row.entry.as_ref().expect("every row enters");
            match entry.hidden.dims2()?.0 == row.ids.len() {
                true => Ok(entry.hidden.clone()),
                false => Err(ModelError::Input(format!(
                    "a row of {} tokens enters with the hidden states of {}",
                    row.ids.len(),
                    entry.hidden.dims2()?.0
                ))),
            }
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    stack(states)
}

/// Each row's keys and values of layer `layer`, below where its pass enters, appended to its
/// cache from its entry's [`below`](super::causal_lm::Entry::below) cache.
pub(crate) fn take_below(rows: &mut [Row<'_, '_>], layer: usize) -> Result<(), ModelError> {
    for row in rows {
        let entry = row.entry.as_ref().expect("every row enters");
        let positions = (row.cache.next_position, row.ids.len());
        let (k, v) = entry.below.layer_positions(layer, positions)?;
        row.cache.append(layer, k, v)?;
    }
    Ok(())
}

/// Each recorded row's attention input `h` of layer `layer` (stacked at `spans`), kept by the
/// recorders that keep inputs.
pub(crate) fn record_inputs(
    rows: &mut [Row<'_, '_>],
    layer: usize,
    h: &Tensor,
    spans: &[(usize, usize)],
) -> Result<(), ModelError> {
    for (row, &(first, n)) in rows.iter_mut().zip(spans) {
        if let Some(recorder) = row.recorder.as_deref_mut() {
            if recorder.keeps_inputs() {
                recorder.record_input(layer, &h.narrow(0, first, n)?);
            }
        }
    }
    Ok(())
}

/// Each recorded row's hidden states in `x` (stacked at `spans`), kept by its recorder as those
/// entering the model's residual layer.
pub(crate) fn record_residuals(
    rows: &mut [Row<'_, '_>],
    x: &Tensor,
    spans: &[(usize, usize)],
) -> Result<(), ModelError> {
    for (row, &(first, n)) in rows.iter_mut().zip(spans) {
        if let Some(recorder) = row.recorder.as_deref_mut() {
            recorder.record_residual(x.narrow(0, first, n)?);
        }
    }
    Ok(())
}

/// The hidden states of each row's last token, stacked `[rows, hidden]`.
fn last_states(x: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor, ModelError> {
    stack(
        spans
            .iter()
            .map(|&(first, n)| x.narrow(0, first + n - 1, 1))
            .collect::<Result<Vec<_>, _>>()?,
    )
}

/// Per row, its logits, from the stacked `[rows, vocab]`, copied on worker threads (a Gemma 3
/// row is 1 MiB).
fn row_logits(logits: &Tensor) -> Result<Vec<Vec<f32>>, ModelError> {
    let logits = logits.to_dtype(candle_core::DType::F32)?;
    let (rows, vocab) = logits.dims2()?;
    let copied = with_rows(&logits, |data, stride| {
        (0..rows)
            .into_par_iter()
            .map(|row| data[row * stride..][..vocab].to_vec())
            .collect()
    })?;
    match copied {
        Some(copied) => Ok(copied),
        None => Ok(logits.to_vec2::<f32>()?),
    }
}

/// `on_row(row, logits)` for each row of the stacked `[rows, vocab]` on worker threads, read
/// where they lie when they are f32 in memory, else copied first.
fn each_row_logits(
    logits: &Tensor,
    on_row: &(dyn Fn(usize, &[f32]) + Sync),
) -> Result<(), ModelError> {
    let logits = logits.to_dtype(candle_core::DType::F32)?;
    let (rows, vocab) = logits.dims2()?;
    let read = with_rows(&logits, |data, stride| {
        (0..rows)
            .into_par_iter()
            .for_each(|row| on_row(row, &data[row * stride..][..vocab]))
    })?;
    if read.is_none() {
        let copied = logits.to_vec2::<f32>()?;
        copied
            .par_iter()
            .enumerate()
            .for_each(|(row, values)| on_row(row, values));
    }
    Ok(())
}

/// The multiply-adds one token costs through `weights`: their elements, together.
pub(crate) fn elements<'a>(weights: impl Iterator<Item = &'a Weight>) -> usize {
    weights.map(Weight::elem_count).sum()
}

/// The bytes `weights` take as held.
pub(crate) fn bytes<'a>(weights: impl Iterator<Item = &'a Weight>) -> usize {
    weights.map(Weight::bytes).sum()
}

/// The spans the weight products sum by: the rows' own, or one per token when fed step by step.
pub(crate) fn product_spans(spans: &[(usize, usize)], feed: Feed) -> Vec<(usize, usize)> {
    match feed {
        Feed::Chunk => spans.to_vec(),
        Feed::Steps => {
            let tokens: usize = spans.iter().map(|&(_, n)| n).sum();
            (0..tokens).map(|token| (token, 1)).collect()
        }
    }
}

/// Per row, the logits at its last token: `logits(states, spans)` of the stacked hidden states
/// `x` of the rows at `spans`, read at each row's last token.
pub(crate) fn last_logits(
    x: &Tensor,
    spans: &[(usize, usize)],
    logits: impl Fn(&Tensor, &[(usize, usize)]) -> Result<Tensor, ModelError>,
) -> Result<Vec<Vec<f32>>, ModelError> {
    row_logits(&logits(&last_states(x, spans)?, &last_spans(spans))?)
}

/// Hidden states per output product when every token's logits are wanted: bounds the logits held
/// at once (a Gemma 3 row of 262,144 is 1 MiB) while the output weight is still read once for
/// many tokens.
const STATES_PER_PRODUCT: usize = 128;

/// Every token's logits, `on_logits(row, step, logits)` (on worker threads), each summed as a
/// one-token pass sums it: `logits(states, one span per token)` of the stacked hidden states `x`
/// of the rows at `spans`.
pub(crate) fn every_step_logits(
    x: &Tensor,
    spans: &[(usize, usize)],
    logits: impl Fn(&Tensor, &[(usize, usize)]) -> Result<Tensor, ModelError>,
    on_logits: &(dyn Fn(usize, usize, &[f32]) + Sync),
) -> Result<(), ModelError> {
    let owners: Vec<(usize, usize)> = spans
        .iter()
        .enumerate()
        .flat_map(|(row, &(_, n))| (0..n).map(move |step| (row, step)))
        .collect();
    for (group, owners) in owners.chunks(STATES_PER_PRODUCT).enumerate() {
        let states = x.narrow(0, group * STATES_PER_PRODUCT, owners.len())?;
        let one_each: Vec<(usize, usize)> = (0..owners.len()).map(|t| (t, 1)).collect();
        each_row_logits(&logits(&states, &one_each)?, &|index, values| {
            let (row, step) = owners[index];
            on_logits(row, step, values)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::causal_lm::{Entry, KvCache};

    /// A one-layer cache of positions 0..4, two KV heads of dimension 3: key `(h, p, c)` is
    /// `100h + 10p + c`, its value that negated.
    fn cache() -> KvCache {
        let keys: Vec<f32> = (0..2)
            .flat_map(|h| {
                (0..4).flat_map(move |p| (0..3).map(move |c| (100 * h + 10 * p + c) as f32))
            })
            .collect();
        let keys = Tensor::from_vec(keys, (2, 4, 3), &Device::Cpu).unwrap();
        let values = keys.neg().unwrap();
        let mut cache = KvCache::default();
        cache.append(0, keys, values).unwrap();
        cache.next_position = 4;
        cache
    }

    #[test]
    fn rows_enter_at_one_layer_with_their_tokens_states_and_the_keys_below() {
        let below = cache();
        let ids = [7u32, 8];
        let hidden = Tensor::zeros((2, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
        let entry = |layer| Entry {
            layer,
            hidden: hidden.clone(),
            below: &below,
        };
        let (mut own, mut other) = (below.truncated(1), KvCache::default());
        let mut rows = [
            Row {
                entry: Some(entry(3)),
                ..Row::new(&ids, &mut own, None)
            },
            Row::new(&ids, &mut other, None),
        ];
        assert!(
            entered_at(&rows).is_err(),
            "one row enters, the other does not"
        );
        rows[1].entry = Some(entry(2));
        assert!(entered_at(&rows).is_err(), "two layers");
        let mut rows = [Row {
            entry: Some(entry(3)),
            ..Row::new(&ids, &mut own, None)
        }];
        assert_eq!(entered_at(&rows).unwrap(), Some(3));
        assert_eq!(entry_states(&rows).unwrap().dims(), &[2, 5]);
        // The row holds position 0: it takes positions 1 and 2 of layer 0 from below.
        take_below(&mut rows, 0).unwrap();
        assert_eq!(own.len(), 3);
        let taken = own.keys(0).unwrap();
        let held = below.keys(0).unwrap();
        assert_eq!(taken, held.slice(ndarray::s![.., ..3, ..]));
        let short = [Row {
            entry: Some(entry(3)),
            ..Row::new(&ids[..1], &mut other, None)
        }];
        assert!(entry_states(&short).is_err(), "one token, two states");
    }
}
