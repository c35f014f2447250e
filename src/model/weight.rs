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

use super::product::{product_of_rows, strip_columns, with_rows};
use super::strips::Strips;
use super::ModelError;
use candle_core::Tensor;
use std::sync::OnceLock;

/// A weight `[k, n]` and, once a batch of one-token rows has needed them, its strips.
pub(crate) struct Weight {
    tensor: Tensor,
    strips: OnceLock<Option<Strips>>,
}

impl Weight {
    pub(crate) fn new(tensor: Tensor) -> Self {
        Self {
            tensor,
            strips: OnceLock::new(),
        }
    }

    pub(crate) fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// `x · w` for `x` stacking rows of tokens at `spans`, each row's result as it gets it alone
    /// ([`rows_product`](super::product::rows_product)), the strips read where it sums one-token
    /// rows in them.
    pub(crate) fn rows_product(
        &self,
        x: &Tensor,
        spans: &[(usize, usize)],
    ) -> Result<Tensor, ModelError> {
        product_of_rows(x, &self.tensor, spans, || self.strips())
    }

    /// The strips, made on first use; `None` where the products do not sum in strips here (no
    /// fused multiply-add) or the tensor's columns are not adjacent (a transposed view).
    fn strips(&self) -> Result<Option<&Strips>, ModelError> {
        if let Some(strips) = self.strips.get() {
            return Ok(strips.as_ref());
        }
        let made = match strip_columns() {
            Some(width) => with_rows(&self.tensor, |rows, stride| {
                let (k, n) = (self.tensor.dims()[0], self.tensor.dims()[1]);
                Strips::of(rows, stride, (k, n), width)
            })?,
            None => None,
        };
        Ok(self.strips.get_or_init(|| made).as_ref())
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
        let made = weight.strips.get().expect("asked for").is_some();
        assert_eq!(made, strip_columns().is_some());
    }
}
