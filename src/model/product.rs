//! The weight products of a batched decode step, each row's result the one it gets alone.
//!
//! candle multiplies by the `gemm` crate (0.19), whose sums depend on the number of rows: one row
//! goes through its matrix-vector path, which for every output starts from the product of the
//! first terms and adds the others in order with fused multiply-adds (`gemm-common`
//! `gemv::mixed_gemv_colmajor`); several rows go through its blocked kernel, which sums the
//! depth in blocks of up to 1,024 and then adds the blocks. Below that depth both sum alike; above
//! it (a Llama MLP's down projection, 1,536 deep in SmolLM2; 2,048 in Gemma 3 270M) they differ in
//! the last bits. [`rows_product`] sums every row as the one-row path does, so that a batch of
//! single-token rows gives each row its unbatched logits bit for bit.

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
    if spans.len() == 1 || k <= GEMM_DEPTH_BLOCK {
        return Ok(x.matmul(w)?);
    }
    if spans.iter().all(|&(_, n)| n == 1) {
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
