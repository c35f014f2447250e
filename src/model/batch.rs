//! Several sequences in one forward pass. Every weight product runs once over the rows of all of
//! them stacked (a decode step of many policies reads each weight matrix once instead of once per
//! policy), while each sequence keeps its own cache, positions, recorder and mask, and its
//! attention runs alone (on worker threads), exactly as in a pass of its own. A stacked product
//! sums each row as the product of that row alone does (`product.rs`), so a sequence's logits do
//! not depend on what it was batched with (`tests/live.rs` checks it bit for bit).

use super::causal_lm::Row;
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
pub(crate) fn last_spans(spans: &[(usize, usize)]) -> Vec<(usize, usize)> {
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

/// Each row's attention at one layer, on worker threads: `attention(row, its state, its q, k, v
/// projections)` for the row's span of the stacked projections; the outputs stacked.
pub(crate) fn each_row_attends<S: Sync>(
    rows: &mut [Row<'_, '_>],
    (states, spans): (&[S], &[(usize, usize)]),
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    attention: impl Fn(&mut Row<'_, '_>, &S, (Tensor, Tensor, Tensor)) -> Result<Tensor, ModelError>
        + Sync,
) -> Result<Tensor, ModelError> {
    let outputs = rows
        .par_iter_mut()
        .zip(states)
        .zip(spans)
        .map(|((row, state), &(first, n))| {
            let narrow = |t: &Tensor| t.narrow(0, first, n);
            attention(row, state, (narrow(q)?, narrow(k)?, narrow(v)?))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    stack(outputs)
}

/// The hidden states of each row's last token, stacked `[rows, hidden]`.
pub(crate) fn last_states(x: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor, ModelError> {
    stack(
        spans
            .iter()
            .map(|&(first, n)| x.narrow(0, first + n - 1, 1))
            .collect::<Result<Vec<_>, _>>()?,
    )
}

/// Per row, its logits, from the stacked `[rows, vocab]`.
pub(crate) fn row_logits(logits: &Tensor) -> Result<Vec<Vec<f32>>, ModelError> {
    Ok(logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?)
}

/// Checks that a batch has rows and that none of them is empty.
pub(crate) fn check_rows(rows: &[Row<'_, '_>]) -> Result<(), ModelError> {
    if rows.is_empty() || rows.iter().any(|row| row.ids.is_empty()) {
        return Err(ModelError::Input(
            "a forward pass needs at least one row, each with at least one token".into(),
        ));
    }
    Ok(())
}
