//! The weight products of a batched decode step, each row's result the one it gets alone.
//!
//! candle multiplies by the `gemm` crate (0.19), whose sums depend on the number of rows. One row
//! goes through its matrix-vector paths (`gemm-common` `gemv.rs`): against a row-major weight,
//! every output starts from the product of the first terms and adds the others in order with
//! fused multiply-adds (`mixed_gemv_colmajor`); against a transposed one (Gemma 3's tied
//! embedding as its output layer), every output is a dot product summed in eight SIMD
//! accumulators, added pairwise, then lane by lane (`mixed_gemv_rowmajor`). Several rows go
//! through its blocked kernel, which sums the depth in blocks of up to 1,024 and then adds the
//! blocks: the same sums as the first path up to that depth, not beyond it (a Llama MLP's down
//! projection, 1,536 deep in SmolLM2; 2,048 in Gemma 3 270M), and never the second path's.
//! [`rows_product`] sums a batch of single-token rows as those paths sum one row, so each row
//! gets its unbatched logits bit for bit.

use super::ModelError;
use candle_core::{Device, Storage, Tensor};
use rayon::prelude::*;

/// The depth up to which `gemm`'s blocked kernel sums as its one-row path does.
const GEMM_DEPTH_BLOCK: usize = 1024;

/// Columns of the output one task computes: the rows' partial sums for them stay in L1.
const COLUMNS: usize = 64;

/// `x · w` for `x` `[m, k]` stacking `rows` rows of `x.dims()[0] / rows` tokens each and `w`
/// `[k, n]`, each row's result as it gets it alone: one stacked product where that changes no
/// sum (one row, or a depth within a `gemm` block), the one-row summation where every row is one
/// token, else a product per row.
pub(crate) fn rows_product(
    x: &Tensor,
    w: &Tensor,
    spans: &[(usize, usize)],
) -> Result<Tensor, ModelError> {
    let (m, k) = x.dims2()?;
    let single_tokens = spans.len() > 1 && spans.iter().all(|&(_, n)| n == 1);
    let transposed = !w.is_contiguous() && w.t()?.is_contiguous();
    if single_tokens && transposed {
        let n = w.dims2()?.1;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let rows_of_w = w.t()?;
        let (storage, layout) = rows_of_w.storage_and_layout();
        let out = match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(weights), Some((start, end))) => {
                dot_rows(&xs, &weights.as_slice::<f32>()?[start..end], (m, k, n))
            }
            _ => unreachable!("a contiguous CPU tensor"),
        };
        return Ok(Tensor::from_vec(out, (m, n), &Device::Cpu)?);
    }
    if spans.len() == 1 || (k <= GEMM_DEPTH_BLOCK && !transposed) {
        return Ok(x.matmul(w)?);
    }
    if single_tokens {
        let n = w.dims2()?.1;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let (storage, layout) = w.storage_and_layout();
        let out = match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(weights), Some((start, end))) => {
                one_token_rows(&xs, &weights.as_slice::<f32>()?[start..end], (m, k, n))
            }
            _ => {
                let ws = w.flatten_all()?.to_vec1::<f32>()?;
                one_token_rows(&xs, &ws, (m, k, n))
            }
        };
        return Ok(Tensor::from_vec(out, (m, n), &Device::Cpu)?);
    }
    let parts = spans
        .iter()
        .map(|&(first, n)| x.narrow(0, first, n)?.matmul(w))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// `x [m, k] · w [k, n]`, row-major, each output `x[r, 0]·w[0, j]` and then the later terms
/// added in order by multiply-adds, fused where the processor fuses them (as `gemm` does).
fn one_token_rows(x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let fused = fuses_multiply_add();
    let blocks: Vec<(usize, Vec<f32>)> = (0..n)
        .step_by(COLUMNS)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|first| {
            let width = COLUMNS.min(n - first);
            let block = pulp::Arch::new().dispatch(ColumnBlock {
                x,
                w,
                shape: (m, k, n),
                columns: (first, width),
                fused,
            });
            (first, block)
        })
        .collect();
    let mut out = vec![0.0; m * n];
    for (first, block) in blocks {
        let width = block.len() / m.max(1);
        for (row, values) in block.chunks_exact(width).enumerate() {
            out[row * n + first..][..width].copy_from_slice(values);
        }
    }
    out
}

/// `x [m, k] · wᵀ` for `w` `[n, k]` row-major: each output the dot product of a row of `x` and
/// one of `w`, summed as `gemm`'s one-row path against a transposed weight sums it (its SIMD
/// width: 8 lanes where it runs AVX2 with FMA, else 1).
fn dot_rows(x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let fused = fuses_multiply_add();
    let outputs: Vec<Vec<f32>> = w
        .par_chunks(COLUMNS * k)
        .map(|block| {
            pulp::Arch::new().dispatch(DotBlock {
                x,
                w: block,
                shape: (m, k),
                fused,
            })
        })
        .collect();
    let mut out = vec![0.0; m * n];
    for (index, block) in outputs.iter().enumerate() {
        let width = block.len() / m.max(1);
        for (row, values) in block.chunks_exact(width).enumerate() {
            out[row * n + index * COLUMNS..][..width].copy_from_slice(values);
        }
    }
    out
}

/// The dot products of every row of `x` with the rows of `w` (a block of a weight's rows),
/// `[m, rows of w]`.
struct DotBlock<'a> {
    x: &'a [f32],
    w: &'a [f32],
    shape: (usize, usize),
    fused: bool,
}

impl pulp::WithSimd for DotBlock<'_> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> Vec<f32> {
        let (m, k) = self.shape;
        let columns = self.w.len() / k;
        let mut out = vec![0.0f32; m * columns];
        for (column, weights) in self.w.chunks_exact(k).enumerate() {
            for row in 0..m {
                let x = &self.x[row * k..][..k];
                out[row * columns + column] = match self.fused {
                    true => gemv_dot::<8, true>(x, weights),
                    false => gemv_dot::<1, false>(x, weights),
                };
            }
        }
        out
    }
}

/// `a · b` summed as `gemm`'s `mixed_gemv_rowmajor` sums it with `LANES`-wide vectors: eight
/// accumulators over blocks of `8 × LANES`, added pairwise; then whole vectors into the first;
/// then its lanes in order; then the remaining terms one by one.
#[inline(always)]
fn gemv_dot<const LANES: usize, const FUSED: bool>(a: &[f32], b: &[f32]) -> f32 {
    let multiply_add = |x: f32, y: f32, acc: f32| match FUSED {
        true => x.mul_add(y, acc),
        false => x * y + acc,
    };
    let k = a.len();
    let (block, whole) = (8 * LANES, k / LANES * LANES);
    let mut acc = [[0.0f32; LANES]; 8];
    let mut depth = 0;
    while depth + block <= k {
        for (index, lanes) in acc.iter_mut().enumerate() {
            let at = depth + index * LANES;
            for (lane, value) in lanes.iter_mut().enumerate() {
                *value = multiply_add(a[at + lane], b[at + lane], *value);
            }
        }
        depth += block;
    }
    let add = |x: [f32; LANES], y: [f32; LANES]| -> [f32; LANES] {
        std::array::from_fn(|lane| x[lane] + y[lane])
    };
    let low = add(add(acc[0], acc[1]), add(acc[2], acc[3]));
    let high = add(add(acc[4], acc[5]), add(acc[6], acc[7]));
    let mut sum = add(low, high);
    while depth < whole {
        for (lane, value) in sum.iter_mut().enumerate() {
            *value = multiply_add(a[depth + lane], b[depth + lane], *value);
        }
        depth += LANES;
    }
    let mut total = sum[0];
    for value in &sum[1..] {
        total += value;
    }
    for index in depth..k {
        total = multiply_add(a[index], b[index], total);
    }
    total
}

/// Whether `gemm` fuses its multiply-adds here: its AVX2 kernels need FMA, and without them it
/// multiplies and adds.
fn fuses_multiply_add() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    true
}

/// The outputs of columns `first..first + width` of every row, `[m, width]`.
struct ColumnBlock<'a> {
    x: &'a [f32],
    w: &'a [f32],
    shape: (usize, usize, usize),
    columns: (usize, usize),
    fused: bool,
}

impl pulp::WithSimd for ColumnBlock<'_> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> Vec<f32> {
        let (m, k, n) = self.shape;
        let (first, width) = self.columns;
        let mut block = vec![0.0f32; m * width];
        for depth in 0..k {
            let weights = &self.w[depth * n + first..][..width];
            for (row, out) in block.chunks_exact_mut(width).enumerate() {
                let a = self.x[row * k + depth];
                match (depth, self.fused) {
                    (0, _) => out.iter_mut().zip(weights).for_each(|(o, &b)| *o = a * b),
                    (_, true) => out
                        .iter_mut()
                        .zip(weights)
                        .for_each(|(o, &b)| *o = a.mul_add(b, *o)),
                    (_, false) => out
                        .iter_mut()
                        .zip(weights)
                        .for_each(|(o, &b)| *o = a * b + *o),
                }
            }
        }
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wave(len: usize, seed: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 + seed) * 0.7123).sin())
            .collect()
    }

    #[test]
    fn one_token_rows_sum_as_a_row_alone() {
        // Deeper than a gemm block, with a column block left over (n = 200).
        let (m, k, n) = (5, 1536, 200);
        let x = Tensor::from_vec(wave(m * k, 0.5), (m, k), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(wave(k * n, 1.5), (k, n), &Device::Cpu).unwrap();
        let spans: Vec<(usize, usize)> = (0..m).map(|r| (r, 1)).collect();
        let batched: Vec<Vec<f32>> = rows_product(&x, &w, &spans).unwrap().to_vec2().unwrap();
        for (row, got) in batched.iter().enumerate() {
            let alone: Vec<Vec<f32>> = x
                .narrow(0, row, 1)
                .unwrap()
                .matmul(&w)
                .unwrap()
                .to_vec2()
                .unwrap();
            assert_eq!(got, &alone[0], "row {row}");
        }
        // gemm's own stacked product differs in the last bits at this depth: the case above is
        // not one that any summation would pass.
        let stacked: Vec<Vec<f32>> = x.matmul(&w).unwrap().to_vec2().unwrap();
        assert_ne!(stacked, batched);
    }

    #[test]
    fn one_token_rows_against_a_transposed_weight_sum_as_a_row_alone() {
        // Depths with and without a remainder past the 64-term blocks and past whole vectors;
        // more outputs than gemm's small-product kernel takes (16 × 16).
        for k in [640, 650, 13] {
            let (m, n) = (4, 300);
            let x = Tensor::from_vec(wave(m * k, 0.25), (m, k), &Device::Cpu).unwrap();
            let rows = Tensor::from_vec(wave(n * k, 4.5), (n, k), &Device::Cpu).unwrap();
            let w = rows.t().unwrap();
            let spans: Vec<(usize, usize)> = (0..m).map(|r| (r, 1)).collect();
            let batched: Vec<Vec<f32>> = rows_product(&x, &w, &spans).unwrap().to_vec2().unwrap();
            for (row, got) in batched.iter().enumerate() {
                let alone: Vec<Vec<f32>> = x
                    .narrow(0, row, 1)
                    .unwrap()
                    .matmul(&w)
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                assert_eq!(got, &alone[0], "k = {k}, row {row}");
            }
        }
    }

    #[test]
    fn rows_of_several_tokens_get_their_own_products() {
        let (k, n) = (1100, 64);
        let x = Tensor::from_vec(wave(5 * k, 2.5), (5, k), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(wave(k * n, 3.5), (k, n), &Device::Cpu).unwrap();
        let spans = [(0, 2), (2, 3)];
        let got: Vec<Vec<f32>> = rows_product(&x, &w, &spans).unwrap().to_vec2().unwrap();
        for &(first, rows) in &spans {
            let alone: Vec<Vec<f32>> = x
                .narrow(0, first, rows)
                .unwrap()
                .matmul(&w)
                .unwrap()
                .to_vec2()
                .unwrap();
            assert_eq!(got[first..first + rows], alone[..]);
        }
    }
}
