//! A linear layer's weight `[in, out]`: the tensor candle multiplies a chunk by, and a copy of its
//! columns in strips that the batched decode's chain products read in order.
//!
//! A batch of one-token rows sums each output over the whole depth in registers, a strip of
//! columns at a time ([`rows_product`](super::product::rows_product)). Read where they lie, a
//! strip's weights are a few columns of rows kilobytes apart: each depth a new page, which
//! neither the processor's prefetcher nor its TLB follows far, and a copy per strip and step
//! (a tenth of a decode's time at ~1K on SmolLM2, and the output layer's product at half the
//! speed of the blocks'). The copy is made once, the first time a batch needs it, so a model that
//! only prefills (a capture) never holds it: it costs the weights' size again (0.54 GB on
//! SmolLM2-135M, 0.40 GB on Gemma 3 270M, whose output layer is read as dot products instead).
//! The strips change where the weights are read from, not the sums: each output is the same
//! chain of multiply-adds.
//!
//! A model too large to hold as f32 ([`F32_LIMIT`]) holds its quantized weights as the GGUF
//! stores them, in their blocks ([`Weight::quantized`]), multiplied by
//! [`quantized::product`](super::quantized::product), whose rows do not depend on each other
//! either.

use super::product::{product_of_rows, strip_columns, with_rows};
use super::strips::Strips;
use super::ModelError;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::sync::{Arc, OnceLock};

/// Bytes of f32 weights above which a model holds its weights quantized: the models the
/// committed results come from (SmolLM2-135M, Gemma 3 270M, Qwen2.5-Coder 0.5B and 1.5B: 0.5 to
/// 6.2 GB as f32) stay on the bit-exact f32 path; a 7B model (~30 GB as f32) is held as its file.
pub(crate) const F32_LIMIT: usize = 8_000_000_000;

/// A weight `[k, n]`: as f32 (and, once a batch of one-token rows has needed them, its strips),
/// or quantized `[n, k]` as the file holds it.
pub(crate) enum Weight {
    F32 {
        tensor: Tensor,
        strips: OnceLock<Option<Strips>>,
    },
    Quantized(Arc<QTensor>),
}

impl Weight {
    pub(crate) fn new(tensor: Tensor) -> Self {
        Self::F32 {
            tensor,
            strips: OnceLock::new(),
        }
    }

    /// A quantized weight `[n, k]` held as it is; a float one (F32, F16, BF16, as small tensors
    /// of quantized files are) dequantized and transposed to the f32 path.
    pub(crate) fn quantized(weight: Arc<QTensor>) -> Result<Self, ModelError> {
        match weight.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => Ok(Self::new(
                weight.dequantize(&Device::Cpu)?.t()?.contiguous()?,
            )),
            _ => Ok(Self::Quantized(weight)),
        }
    }

    /// The weight as PyTorch's `nn.Linear` holds it, `[out, in]` f32 (dequantized where it is
    /// held quantized).
    pub(crate) fn linear(&self) -> Result<ndarray::Array2<f32>, ModelError> {
        let tensor = match self {
            Self::F32 { tensor, .. } => tensor.t()?.contiguous()?,
            Self::Quantized(weight) => weight.dequantize(&Device::Cpu)?,
        };
        let (rows, columns) = tensor.dims2()?;
        let flat = tensor.flatten_all()?.to_vec1::<f32>()?;
        Ok(ndarray::Array2::from_shape_vec((rows, columns), flat).expect("candle shape matches"))
    }

    /// Its number of weights.
    pub(crate) fn elem_count(&self) -> usize {
        match self {
            Self::F32 { tensor, .. } => tensor.elem_count(),
            Self::Quantized(weight) => weight.shape().elem_count(),
        }
    }

    /// Bytes it takes as held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::F32 { tensor, .. } => 4 * tensor.elem_count(),
            Self::Quantized(weight) => weight.storage_size_in_bytes(),
        }
    }

    /// `x · w` for `x` stacking rows of tokens at `spans`, each row's result as it gets it alone
    /// ([`rows_product`](super::product::rows_product)), the strips read where it sums one-token
    /// rows in them; quantized, candle's product, whose rows are independent too.
    pub(crate) fn rows_product(
        &self,
        x: &Tensor,
        spans: &[(usize, usize)],
    ) -> Result<Tensor, ModelError> {
        match self {
            Self::F32 { tensor, .. } => product_of_rows(x, tensor, spans, || self.strips()),
            Self::Quantized(weight) => super::quantized::product(weight, x),
        }
    }

    /// The strips, made on first use; `None` where the products do not sum in strips here (no
    /// fused multiply-add) or the tensor's columns are not adjacent (a transposed view).
    fn strips(&self) -> Result<Option<&Strips>, ModelError> {
        let Self::F32 { tensor, strips } = self else {
            return Ok(None);
        };
        if let Some(strips) = strips.get() {
            return Ok(strips.as_ref());
        }
        let made = match strip_columns() {
            Some(width) => with_rows(tensor, |rows, stride| {
                let (k, n) = (tensor.dims()[0], tensor.dims()[1]);
                Strips::of(rows, stride, (k, n), width)
            })?,
            None => None,
        };
        Ok(strips.get_or_init(|| made).as_ref())
    }
}

/// A token embedding `[vocab, hidden]`: f32, or quantized as the file holds it (rows dequantized
/// as they are looked up).
pub(crate) enum Embedding {
    F32(Tensor),
    Quantized(Arc<QTensor>),
}

impl Embedding {
    /// The rows of `ids`.
    pub(crate) fn rows(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        Ok(match self {
            Self::F32(table) => table.embedding(ids)?,
            Self::Quantized(table) => table.embedding(ids)?,
        })
    }

    /// The output layer that ties its weights to this embedding.
    pub(crate) fn tied_output(&self) -> Result<Weight, ModelError> {
        match self {
            Self::F32(table) => Ok(Weight::new(table.t()?.contiguous()?)),
            Self::Quantized(table) => Weight::quantized(table.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::product::tests::wave;
    use candle_core::Device;

    #[test]
    fn rows_summed_from_strips_are_each_row_alone() {
        // Deeper than a gemm block; 200 columns: whole strips and columns left over past them.
        // Two rows (a pass of the few) and nineteen (whole passes and the rest).
        let (k, n) = (1536, 200);
        let w = Tensor::from_vec(wave(k * n, 1.5), (k, n), &Device::Cpu).unwrap();
        let weight = Weight::new(w.clone());
        for m in [2, 19] {
            let x = Tensor::from_vec(wave(m * k, 0.5), (m, k), &Device::Cpu).unwrap();
            let spans: Vec<(usize, usize)> = (0..m).map(|row| (row, 1)).collect();
            let got: Vec<Vec<f32>> = weight.rows_product(&x, &spans).unwrap().to_vec2().unwrap();
            for (row, got) in got.iter().enumerate() {
                let alone: Vec<Vec<f32>> = x
                    .narrow(0, row, 1)
                    .unwrap()
                    .matmul(&w)
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                assert_eq!(got, &alone[0], "{m} rows: row {row}");
            }
        }
        // The strips were made where the products sum in them, and only there.
        let Weight::F32 { strips, .. } = &weight else {
            unreachable!("an f32 weight")
        };
        let made = strips.get().expect("asked for").is_some();
        assert_eq!(made, strip_columns().is_some());
    }

    #[test]
    fn quantized_rows_are_each_row_alone_and_near_the_dequantized_product() {
        use candle_core::quantized::GgmlDType;
        // 264 columns: whole tiles of every kernel and columns past them.
        let (k, n) = (512, 264);
        let w = Tensor::from_vec(wave(n * k, 1.5), (n, k), &Device::Cpu).unwrap();
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
            GgmlDType::Q4_1,
        ] {
            let stored = Arc::new(QTensor::quantize(&w, dtype).unwrap());
            let dequantized = stored.dequantize(&Device::Cpu).unwrap().t().unwrap();
            let weight = Weight::quantized(stored).unwrap();
            assert!(matches!(weight, Weight::Quantized(_)));
            assert_eq!(weight.elem_count(), k * n);
            let m = 9;
            let x = Tensor::from_vec(wave(m * k, 0.5), (m, k), &Device::Cpu).unwrap();
            let spans: Vec<(usize, usize)> = (0..m).map(|row| (row, 1)).collect();
            let got: Vec<Vec<f32>> = weight.rows_product(&x, &spans).unwrap().to_vec2().unwrap();
            let exact: Vec<Vec<f32>> = x.matmul(&dequantized).unwrap().to_vec2().unwrap();
            for (row, got) in got.iter().enumerate() {
                let one = x.narrow(0, row, 1).unwrap();
                let alone: Vec<Vec<f32>> = weight
                    .rows_product(&one, &[(0, 1)])
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                assert_eq!(got, &alone[0], "{dtype:?}: row {row}");
                // The activations are quantized to 8 bits per block: near, not equal.
                let scale = exact[row].iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in got.iter().zip(&exact[row]) {
                    assert!((a - b).abs() <= 0.02 * scale, "{dtype:?}: {a} vs {b}");
                }
            }
        }
        // A float tensor of a quantized file joins the f32 path.
        let float = Arc::new(QTensor::quantize(&w, GgmlDType::F32).unwrap());
        assert!(matches!(
            Weight::quantized(float).unwrap(),
            Weight::F32 { .. }
        ));
    }
}
