//! Tensor operations both model families share: RMSNorm, the half-split rotary, head splitting,
//! grouped-query repetition and masked softmax attention.

use super::ModelError;
use candle_core::{Device, Tensor, D};

/// `x / rms(x) * weight` over the last axis.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor, ModelError> {
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_rms = (mean_square + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv_rms)?.broadcast_mul(weight)?)
}

/// Inverse frequencies `theta^(-2i/d)` of the half-split rotary.
pub(crate) fn inverse_frequencies(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32))
        .collect()
}

/// cos and sin tables `[n, head_dim/2]` for positions `start..start+n`.
pub(crate) fn rotary_tables(
    inv_freq: &[f32],
    start: usize,
    n: usize,
) -> Result<(Tensor, Tensor), ModelError> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for position in start..start + n {
        for freq in inv_freq {
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
pub(crate) fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, ModelError> {
    let half = x.dims()[2] / 2;
    let first = x.narrow(2, 0, half)?;
    let second = x.narrow(2, half, half)?;
    let rotated_first = (first.broadcast_mul(cos)? - second.broadcast_mul(sin)?)?;
    let rotated_second = (second.broadcast_mul(cos)? + first.broadcast_mul(sin)?)?;
    Ok(Tensor::cat(&[rotated_first, rotated_second], 2)?)
}

/// `[heads, n, d]` from a `[n, heads*d]` projection.
pub(crate) fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor, ModelError> {
    let (n, width) = x.dims2()?;
    Ok(x.reshape((n, heads, width / heads))?
        .transpose(0, 1)?
        .contiguous()?)
}

/// `[n, heads*d]` from `[heads, n, d]`.
pub(crate) fn merge_heads(x: &Tensor) -> Result<Tensor, ModelError> {
    let (heads, n, dim) = x.dims3()?;
    Ok(x.transpose(0, 1)?.contiguous()?.reshape((n, heads * dim))?)
}

/// Repeats each KV head `group` times: `[kv, P, d]` -> `[kv*group, P, d]` (`repeat_kv`).
pub(crate) fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor, ModelError> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (kv, positions, dim) = x.dims3()?;
    Ok(x.unsqueeze(1)?
        .expand((kv, group, positions, dim))?
        .reshape((kv * group, positions, dim))?)
}

/// `softmax(scale * q kᵀ + mask) v` for queries `[heads, n, d]` over keys and values
/// `[kv_heads, P, d]` (repeated for grouped-query attention) with an additive mask broadcast to
/// `[heads, n, P]`.
pub(crate) fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> Result<Tensor, ModelError> {
    let group = q.dims()[0] / keys.dims()[0];
    let keys = repeat_kv(keys, group)?;
    let values = repeat_kv(values, group)?;
    let logits = (q.matmul(&keys.transpose(1, 2)?.contiguous()?)? * scale)?.broadcast_add(mask)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let weights = logits.broadcast_sub(&max)?.exp()?;
    let weights = weights.broadcast_div(&weights.sum_keepdim(D::Minus1)?)?;
    Ok(weights.matmul(&values)?)
}
