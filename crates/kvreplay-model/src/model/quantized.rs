//! Products with a weight held quantized, in its GGUF blocks: candle's compact kernel
//! (`k_quants::matmul`), which quantizes each row of activations to the block type's dot-product
//! partner (Q8_K for the K-quants, Q8_0 or Q8_1 for the others) and dots it with each column's
//! blocks, dequantizing as it goes. Each row's result depends on that row alone.
//!
//! Not candle's `QMatMul`: on x86 it repacks Q4_K (and, for several rows, Q6_K and Q8_0)
//! weights into tiles kept beside the blocks, a second copy of the weights that doubled the peak
//! memory of an 8B-shaped model (10.4 GB for a 4.5 GB file), and it takes other paths for one row
//! than for several.

use super::product::with_rows;
use super::ModelError;
use candle_core::quantized::k_quants::{self, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// `x [m, k] · wᵀ` for a quantized `w [n, k]`: `[m, n]`.
pub(crate) fn product(weight: &QTensor, x: &Tensor) -> Result<Tensor, ModelError> {
    let (n, k) = weight.shape().dims2()?;
    let x = x.contiguous()?;
    let m = x.dims2()?.0;
    let blocks = weight.data()?;
    let mut out = vec![0f32; m * n];
    let multiplied = with_rows(&x, |rows, _| -> Result<(), ModelError> {
        let rows = &rows[..m * k];
        let dims = (m, k, n);
        match weight.dtype() {
            GgmlDType::Q4_0 => multiply::<k_quants::BlockQ4_0>(dims, rows, &blocks, &mut out),
            GgmlDType::Q4_1 => multiply::<k_quants::BlockQ4_1>(dims, rows, &blocks, &mut out),
            GgmlDType::Q5_0 => multiply::<k_quants::BlockQ5_0>(dims, rows, &blocks, &mut out),
            GgmlDType::Q5_1 => multiply::<k_quants::BlockQ5_1>(dims, rows, &blocks, &mut out),
            GgmlDType::Q8_0 => multiply::<k_quants::BlockQ8_0>(dims, rows, &blocks, &mut out),
            GgmlDType::Q2K => multiply::<k_quants::BlockQ2K>(dims, rows, &blocks, &mut out),
            GgmlDType::Q3K => multiply::<k_quants::BlockQ3K>(dims, rows, &blocks, &mut out),
            GgmlDType::Q4K => multiply::<k_quants::BlockQ4K>(dims, rows, &blocks, &mut out),
            GgmlDType::Q5K => multiply::<k_quants::BlockQ5K>(dims, rows, &blocks, &mut out),
            GgmlDType::Q6K => multiply::<k_quants::BlockQ6K>(dims, rows, &blocks, &mut out),
            other => Err(ModelError::Input(format!(
                "no product with weights of type {other:?} held quantized"
            ))),
        }
    })?;
    multiplied.ok_or_else(|| ModelError::Input("activations not in host memory".into()))??;
    Ok(Tensor::from_vec(out, (m, n), &Device::Cpu)?)
}

/// The product over `bytes`, the blocks of type `T` a CPU `QTensor` holds (a `Vec<T>`'s memory,
/// so aligned for `T`).
fn multiply<T: GgmlType>(
    dims: (usize, usize, usize),
    rows: &[f32],
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), ModelError> {
    let size = std::mem::size_of::<T>();
    assert!(
        bytes.len().is_multiple_of(size)
            && bytes.as_ptr().align_offset(std::mem::align_of::<T>()) == 0,
        "a QTensor's blocks are a Vec of its block type"
    );
    // SAFETY: the bytes are the memory of a `Vec<T>` (checked above: whole blocks, aligned), and
    // every bit pattern is a valid block (plain integers and f16 scales).
    let blocks =
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) };
    Ok(k_quants::matmul(dims, rows, blocks, out)?)
}
