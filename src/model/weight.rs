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

/// The columns of a weight `[k, n]` in strips `width` wide: strip `s`'s `k` rows of `width`
/// consecutive columns from `s · width` on, one after another; the columns past the last whole
/// strip are not copied.
pub(crate) struct Strips {
    data: Vec<f32>,
    k: usize,
    width: usize,
}

impl Strips {
    /// The strips of `w`'s rows (`stride` apart, `k` of them, `n` columns).
    fn of(w: &[f32], stride: usize, (k, n): (usize, usize), width: usize) -> Self {
        let strips = n / width;
        let mut data = Vec::with_capacity(strips * k * width);
        for strip in 0..strips {
            for depth in 0..k {
                data.extend_from_slice(&w[depth * stride + strip * width..][..width]);
            }
        }
        Self { data, k, width }
    }

    /// The strip starting at `column` (a multiple of the width), its rows `width` apart; `None`
    /// past the last whole strip.
    pub(crate) fn strip(&self, column: usize) -> Option<(&[f32], usize)> {
        assert_eq!(column % self.width, 0, "a strip starts at column {column}");
        let at = column / self.width * self.k * self.width;
        (at < self.data.len()).then(|| (&self.data[at..][..self.k * self.width], self.width))
    }

    /// The strips' width.
    pub(crate) fn width(&self) -> usize {
        self.width
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn wave(len: usize, seed: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 + seed) * 0.7123).sin())
            .collect()
    }

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

    #[test]
    fn a_strip_holds_its_columns_row_after_row() {
        // 3 rows of 7 columns, 9 apart: two strips of 3 columns, the seventh column left out.
        let w: Vec<f32> = (0..27).map(|i| i as f32).collect();
        let strips = Strips::of(&w, 9, (3, 7), 3);
        assert_eq!(strips.width(), 3);
        let (first, stride) = strips.strip(0).unwrap();
        assert_eq!(stride, 3);
        assert_eq!(first, [0., 1., 2., 9., 10., 11., 18., 19., 20.]);
        let (second, _) = strips.strip(3).unwrap();
        assert_eq!(second, [3., 4., 5., 12., 13., 14., 21., 22., 23.]);
        assert!(strips.strip(6).is_none());
    }
}
