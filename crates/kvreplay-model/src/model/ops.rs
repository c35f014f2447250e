//! Tensor operations both model families share: RMSNorm, the half-split rotary, head splitting,
//! and masked softmax attention (grouped-query).

use super::line_sum::line_sum;
use super::masked_softmax::{masked_softmax, one_query_softmax, ChunkMask};
use super::product::{rows_product, with_rows};
use super::ModelError;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Elements of the lines one task normalises, at least one line.
const TASK_ELEMENTS: usize = 16384;

/// `x / rms(x) * weight` over the last axis, in one parallel pass over the lines, each element
/// what candle's chain (`sqr`, `mean_keepdim`, `+ eps`, `sqrt`, `recip`, two broadcast products)
/// gives, bit for bit: the mean is the line's sum ([`line_sum`]) times `1/width` rounded to f32,
/// plus 0, and `eps` is added after a product by 1, as candle's affine maps compute them.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor, ModelError> {
    let shape = x.shape().clone();
    let width = x.dims().last().copied().unwrap_or(0);
    let weight: Vec<f32> = weight.to_vec1()?;
    if weight.len() != width || width == 0 {
        return Err(ModelError::Input(format!(
            "an RMSNorm of {} weights over lines of {width}",
            weight.len()
        )));
    }
    let lines = x
        .contiguous()?
        .reshape((shape.elem_count() / width, width))?;
    match with_rows(&lines, |data, _| normalized_lines(data, &weight, eps))? {
        Some(normed) => Ok(Tensor::from_vec(normed, shape, &Device::Cpu)?),
        None => Err(ModelError::Input("RMSNorm input outside CPU memory".into())),
    }
}

/// [`rms_norm`] of the lines of `data`, each `weight.len()` wide.
fn normalized_lines(data: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let width = weight.len();
    let (scale, eps) = ((1.0 / width as f64) as f32, eps as f32);
    let task = width * (TASK_ELEMENTS / width).max(1);
    let mut out = vec![0.0f32; data.len()];
    out.par_chunks_mut(task)
        .zip(data.par_chunks(task))
        .for_each(|(out, data)| {
            for (out, x) in out.chunks_exact_mut(width).zip(data.chunks_exact(width)) {
                for (square, &v) in out.iter_mut().zip(x) {
                    *square = v * v;
                }
                let mean_square = line_sum(out) * scale + 0.0;
                let inv_rms = (mean_square * 1.0 + eps).sqrt().recip();
                for ((out, &v), &w) in out.iter_mut().zip(x).zip(weight) {
                    *out = v * inv_rms * w;
                }
            }
        });
    out
}

/// Inverse frequencies `theta^(-2i/d)` of the half-split rotary.
pub(crate) fn inverse_frequencies(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32))
        .collect()
}

/// The half-split rotary's cos and sin tables for a run of positions, `[n, head_dim/2]` each,
/// row-major.
pub(crate) struct RotaryTables {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

/// The rotary tables for positions `start..start+n`.
pub(crate) fn rotary_tables(inv_freq: &[f32], start: usize, n: usize) -> RotaryTables {
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
    RotaryTables { cos, sin, half }
}

/// Half-split rotary on `[heads, n, head_dim]` with `tables` for its `n` positions: each pair
/// `(a, b)` of a position's halves becomes `(a·cos − b·sin, b·cos + a·sin)`, every product
/// rounded before its sum as candle's chain of broadcast products, difference and sum rounds
/// them, so the same bits, in one pass instead of eight operations and their allocations (a
/// decode step rotates every row's queries and keys at every layer).
pub(crate) fn rotate(x: &Tensor, tables: &RotaryTables) -> Result<Tensor, ModelError> {
    let (heads, n, dim) = x.dims3()?;
    let half = dim / 2;
    let RotaryTables { cos, sin, .. } = tables;
    if tables.half != half || cos.len() != n * half {
        return Err(ModelError::Input(format!(
            "rotary tables of {} positions by {} for {n} positions of {dim} channels",
            cos.len() / tables.half.max(1),
            tables.half
        )));
    }
    let x = x.contiguous()?.reshape((heads * n, dim))?;
    let rotated = with_rows(&x, |rows, stride| {
        let mut out = vec![0.0f32; heads * n * dim];
        for (line, out) in out.chunks_exact_mut(dim).enumerate() {
            let position = line % n;
            let (cos, sin) = (&cos[position * half..], &sin[position * half..]);
            let (first, second) = rows[line * stride..][..dim].split_at(half);
            let (out_first, out_second) = out.split_at_mut(half);
            for i in 0..half {
                let (a, b, c, s) = (first[i], second[i], cos[i], sin[i]);
                out_first[i] = a * c - b * s;
                out_second[i] = b * c + a * s;
            }
        }
        out
    })?;
    match rotated {
        Some(out) => Ok(Tensor::from_vec(out, (heads, n, dim), &Device::Cpu)?),
        None => Err(ModelError::Input("rotary input outside CPU memory".into())),
    }
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

/// `softmax(scale * q kᵀ + mask) v` for queries `[heads, n, d]` over keys given transposed,
/// `[kv_heads, d, P]`, and values `[kv_heads, P, d]` (grouped-query attention: query head `h`
/// reads KV head `h / group`), under the chunk's mask. Each query head is one product against
/// its KV head's keys as the cache holds them: the same products, term for term, as repeating
/// the keys and values to every query head (`repeat_kv`) and multiplying in one batch, without
/// copying the cache once per query head.
pub(crate) fn attend(
    q: &Tensor,
    keys_t: &Tensor,
    values: &Tensor,
    mask: &ChunkMask<'_>,
    scale: f64,
) -> Result<Tensor, ModelError> {
    let (heads, n, _) = q.dims3()?;
    if n == 1 {
        return attend_one_query(q, keys_t, values, mask, scale);
    }
    let kv_heads = keys_t.dims()[0];
    let group = heads / kv_heads;
    let mut outputs = Vec::with_capacity(heads);
    for kv in 0..kv_heads {
        let keys_t = keys_t.narrow(0, kv, 1)?;
        let values = values.narrow(0, kv, 1)?;
        for head in kv * group..(kv + 1) * group {
            let logits = q.narrow(0, head, 1)?.matmul(&keys_t)?;
            outputs.push(masked_softmax(&logits, scale, mask, head)?.matmul(&values)?);
        }
    }
    Ok(Tensor::cat(&outputs, 0)?)
}

/// [`attend`] for one query per head (a decode step): each KV head's group of query heads in one
/// product against its keys, one fused softmax over their lines ([`one_query_softmax`]) and one
/// weighted sum of its values, the products summed as the products of one head at a time sum
/// them ([`rows_product`]), so the result is [`attend`]'s head by head, bit for bit, with a
/// fraction of the operations.
fn attend_one_query(
    q: &Tensor,
    keys_t: &Tensor,
    values: &Tensor,
    mask: &ChunkMask<'_>,
    scale: f64,
) -> Result<Tensor, ModelError> {
    let heads = q.dims()[0];
    let kv_heads = keys_t.dims()[0];
    let group = heads / kv_heads;
    let one_row_each: Vec<(usize, usize)> = (0..group).map(|row| (row, 1)).collect();
    let mut outputs = Vec::with_capacity(kv_heads);
    for kv in 0..kv_heads {
        let keys_t = keys_t.narrow(0, kv, 1)?.squeeze(0)?;
        let values = values.narrow(0, kv, 1)?.squeeze(0)?;
        let queries = q.narrow(0, kv * group, group)?.squeeze(1)?;
        let product = |x: &Tensor, w: &Tensor| rows_product(x, w, &one_row_each);
        let logits = product(&queries, &keys_t)?;
        let weights = one_query_softmax(&logits, scale, mask, kv * group..(kv + 1) * group)?;
        let mixed = product(&weights, &values)?;
        outputs.push(mixed.unsqueeze(1)?);
    }
    Ok(Tensor::cat(&outputs, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    /// `softmax(scale · q·k + mask) · v` head by head in f64, query head `h` reading KV head
    /// `h / group`: the definition, with nothing shared.
    fn by_definition(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: &[f32],
        (heads, kv_heads, n, positions, dim): (usize, usize, usize, usize, usize),
        scale: f64,
    ) -> Vec<f64> {
        let group = heads / kv_heads;
        let mut out = Vec::new();
        for head in 0..heads {
            let kv = head / group;
            for row in 0..n {
                let query = &q[(head * n + row) * dim..][..dim];
                let logits: Vec<f64> = (0..positions)
                    .map(|p| {
                        let key = &k[(kv * positions + p) * dim..][..dim];
                        let dot: f64 = query
                            .iter()
                            .zip(key)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum();
                        dot * scale + mask[(head * n + row) * positions + p] as f64
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..dim {
                    let sum: f64 = (0..positions)
                        .map(|p| weights[p] * v[(kv * positions + p) * dim + d] as f64)
                        .sum();
                    out.push(sum / total);
                }
            }
        }
        out
    }

    #[test]
    fn grouped_attention_matches_its_definition() {
        let (heads, kv_heads, n, positions, dim) = (6, 2, 3, 5, 4);
        let wave = |len: usize, seed: f32| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as f32 + seed) * 0.731).sin())
                .collect()
        };
        let q = wave(heads * n * dim, 0.3);
        let k = wave(kv_heads * positions * dim, 1.7);
        let v = wave(kv_heads * positions * dim, 2.9);
        // Causal over a cache of 2 earlier positions, and one head with two of its keys masked.
        let causal = crate::model::causal_mask(1, positions - n, n);
        let mut per_head: Vec<f32> = (0..heads).flat_map(|_| causal.clone()).collect();
        per_head[(4 * n + 2) * positions] = f32::NEG_INFINITY;
        per_head[(4 * n + 2) * positions + 3] = f32::NEG_INFINITY;
        let tensor = |data: &[f32], shape: (usize, usize, usize)| {
            Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()
        };
        let (qt, kt, vt) = (
            tensor(&q, (heads, n, dim)),
            tensor(&k, (kv_heads, positions, dim))
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap(),
            tensor(&v, (kv_heads, positions, dim)),
        );
        let shape = (heads, kv_heads, n, positions, dim);
        let causal_only = ChunkMask {
            policy: None,
            past: positions - n,
            window: 0,
            first: 0,
        };
        let masks = [
            (
                causal_only,
                (0..heads)
                    .flat_map(|_| causal.clone())
                    .collect::<Vec<f32>>(),
            ),
            (
                ChunkMask {
                    policy: Some(&per_head),
                    ..causal_only
                },
                per_head.clone(),
            ),
        ];
        for (mask, flat) in masks {
            let got: Vec<f32> = attend(&qt, &kt, &vt, &mask, 0.5)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let want = by_definition(&q, &k, &v, &flat, shape, 0.5);
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
            }
        }
    }

    /// The head-by-head products [`attend`] makes for several queries, for one query.
    fn head_by_head(q: &Tensor, keys_t: &Tensor, values: &Tensor, mask: &Tensor) -> Vec<f32> {
        let (heads, kv_heads) = (q.dims()[0], keys_t.dims()[0]);
        let group = heads / kv_heads;
        let mut out = Vec::new();
        for head in 0..heads {
            let kv = head / group;
            let mask = match mask.rank() {
                3 => mask.narrow(0, head, 1).unwrap(),
                _ => mask.clone(),
            };
            let logits = (q
                .narrow(0, head, 1)
                .unwrap()
                .matmul(&keys_t.narrow(0, kv, 1).unwrap())
                .unwrap()
                * 0.125)
                .unwrap()
                .broadcast_add(&mask)
                .unwrap();
            let max = logits.max_keepdim(D::Minus1).unwrap();
            let weights = logits.broadcast_sub(&max).unwrap().exp().unwrap();
            let weights = weights
                .broadcast_div(&weights.sum_keepdim(D::Minus1).unwrap())
                .unwrap();
            let mixed = weights.matmul(&values.narrow(0, kv, 1).unwrap()).unwrap();
            out.extend(mixed.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        out
    }

    /// The chain of tensor operations [`rotate`] stands for.
    fn rotated_by_candle(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = x.dims()[2] / 2;
        let first = x.narrow(2, 0, half).unwrap();
        let second = x.narrow(2, half, half).unwrap();
        let product = |a: &Tensor, b: &Tensor| a.broadcast_mul(b).unwrap();
        let rotated_first = (product(&first, cos) - product(&second, sin)).unwrap();
        let rotated_second = (product(&second, cos) + product(&first, sin)).unwrap();
        Tensor::cat(&[rotated_first, rotated_second], 2).unwrap()
    }

    #[test]
    fn the_one_pass_rms_norm_is_candles_chain_bit_for_bit() {
        // Lines shorter and longer than the sum's 32-value blocks, several tasks' worth, values
        // of many magnitudes; a QK-norm's `[heads, n, d]`, and a strided view.
        let wave = |len: usize, salt: f32| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    let magnitude = ((i * 7919) % 17) as f32 - 8.0;
                    ((i as f32 + salt) * 0.37).sin() * magnitude.exp2()
                })
                .collect()
        };
        let chain = |x: &Tensor, weight: &Tensor, eps: f64| -> Tensor {
            let mean_square = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let inv_rms = (mean_square + eps)
                .unwrap()
                .sqrt()
                .unwrap()
                .recip()
                .unwrap();
            x.broadcast_mul(&inv_rms)
                .unwrap()
                .broadcast_mul(weight)
                .unwrap()
        };
        let bits = |t: &Tensor| -> Vec<u32> {
            let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            values.iter().map(|v| v.to_bits()).collect()
        };
        let cpu = &Device::Cpu;
        for (dims, eps) in [
            (vec![3, 7], 1e-6),
            (vec![5, 64], 1e-5),
            (vec![40, 640], 1e-6),
            (vec![2, 2049], 1e-6),
            (vec![4, 9, 256], 1e-6),
        ] {
            let width = *dims.last().unwrap();
            let count = dims.iter().product();
            let x = Tensor::from_vec(wave(count, 0.5), dims.as_slice(), cpu).unwrap();
            let weight = Tensor::from_vec(wave(width, 2.0), width, cpu).unwrap();
            let ours = rms_norm(&x, &weight, eps).unwrap();
            assert_eq!(bits(&ours), bits(&chain(&x, &weight, eps)), "{dims:?}");
        }
        let x = Tensor::from_vec(wave(64 * 5, 1.0), (64, 5), cpu)
            .unwrap()
            .t()
            .unwrap();
        let weight = Tensor::from_vec(wave(64, 3.0), 64, cpu).unwrap();
        let ours = rms_norm(&x, &weight, 1e-6).unwrap();
        assert_eq!(bits(&ours), bits(&chain(&x, &weight, 1e-6)));
        let refused = rms_norm(
            &x,
            &Tensor::ones(63, candle_core::DType::F32, cpu).unwrap(),
            1e-6,
        );
        assert!(matches!(refused, Err(ModelError::Input(_))), "{refused:?}");
    }

    #[test]
    fn the_one_pass_rotary_is_candles_chain_bit_for_bit() {
        let bits = |t: &Tensor| -> Vec<u32> {
            let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            values.into_iter().map(f32::to_bits).collect()
        };
        // Large and small values, so that rounding each product before the sum shows.
        for (heads, n, dim, start) in [(3, 5, 8, 0), (2, 1, 64, 997), (9, 37, 64, 40)] {
            let values = (0..heads * n * dim)
                .map(|i| ((i * 7919 % 1013) as f32 * 0.37).sin() * 10f32.powi((i % 7) as i32 - 3));
            let x = Tensor::from_vec(values.collect(), (heads, n, dim), &Device::Cpu).unwrap();
            let tables = rotary_tables(&inverse_frequencies(10000.0, dim), start, n);
            let table = |t: &[f32]| Tensor::from_slice(t, (n, dim / 2), &Device::Cpu).unwrap();
            let (cos, sin) = (table(&tables.cos), table(&tables.sin));
            let strided = Tensor::from_vec(
                (0..n * heads * dim)
                    .map(|i| (i as f32 * 0.61).cos())
                    .collect(),
                (n, heads, dim),
                &Device::Cpu,
            )
            .unwrap()
            .transpose(0, 1)
            .unwrap();
            for x in [x, strided] {
                let fused = rotate(&x, &tables).unwrap();
                assert_eq!(fused.dims(), x.dims());
                assert_eq!(bits(&fused), bits(&rotated_by_candle(&x, &cos, &sin)));
            }
        }
        // Tables of another head size, or of other positions, are refused.
        let x = Tensor::zeros((2, 3, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        for (dim, n) in [(4, 3), (8, 2), (8, 4)] {
            let tables = rotary_tables(&inverse_frequencies(10000.0, dim), 0, n);
            let refused = rotate(&x, &tables);
            assert!(matches!(refused, Err(ModelError::Input(_))), "{refused:?}");
        }
    }

    #[test]
    fn one_query_per_head_is_the_head_by_head_result_bit_for_bit() {
        let (heads, kv_heads, dim) = (6, 2, 64);
        let wave = |len: usize, seed: f32| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as f32 + seed) * 0.391).sin())
                .collect()
        };
        // Depths within, between and beyond gemm's blocks (512 deep for small products, 1,024
        // for larger ones), in a cache buffer with room to spare.
        for positions in [40, 600, 1500] {
            let capacity = positions + 7;
            let buffer = |seed| {
                Tensor::from_vec(
                    wave(kv_heads * capacity * dim, seed),
                    (kv_heads, capacity, dim),
                    &Device::Cpu,
                )
                .unwrap()
            };
            let values = buffer(1.3).narrow(1, 0, positions).unwrap();
            let keys_t = buffer(2.1)
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
                .narrow(2, 0, positions)
                .unwrap();
            let q =
                Tensor::from_vec(wave(heads * dim, 0.7), (heads, 1, dim), &Device::Cpu).unwrap();
            // A key masked in one head; in another, all but the last eight keys (so the first two
            // of a ten-key sliding window too).
            let mut per_head = vec![0.0f32; heads * positions];
            per_head[3 * positions + 5] = f32::NEG_INFINITY;
            per_head[5 * positions..][..positions - 8].fill(f32::NEG_INFINITY);
            // Every key of one head masked: NaNs, as candle's chain makes them.
            let mut one_head_blind = per_head.clone();
            one_head_blind[positions..][..positions].fill(f32::NEG_INFINITY);
            let unmasked = ChunkMask {
                policy: None,
                past: positions - 1,
                window: 0,
                first: 0,
            };
            let sliding = ChunkMask {
                window: 10,
                ..unmasked
            };
            let masks = [
                unmasked,
                ChunkMask {
                    policy: Some(&per_head),
                    ..unmasked
                },
                sliding,
                ChunkMask {
                    policy: Some(&per_head),
                    ..sliding
                },
                ChunkMask {
                    policy: Some(&one_head_blind),
                    ..unmasked
                },
            ];
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            for mask in masks {
                let got: Vec<f32> = attend(&q, &keys_t, &values, &mask, 0.125)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let want = head_by_head(&q, &keys_t, &values, &mask.tensor(heads, 1).unwrap());
                assert_eq!(bits(got), bits(want), "{positions} positions, {mask:?}");
            }
        }
    }
}
