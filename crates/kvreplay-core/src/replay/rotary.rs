//! The half-split rotary embedding of Hugging Face transformers (`rotate_half`), in f64: what the
//! scorers and head splits that turn a trace's post-rotary vectors back (or forward to other
//! positions) use.

use ndarray::{Array1, ArrayView1};
use std::ops::Range;

/// The half-split rotary of Hugging Face transformers (`rotate_half`): pair `i` and `i + d/2`
/// turn by `position / theta^(2i/d)`.
pub(crate) struct Rotary {
    inverse_frequencies: Vec<f64>,
}

impl Rotary {
    pub(crate) fn new(theta: f32, head_dim: usize) -> Self {
        let half = head_dim / 2;
        Self {
            inverse_frequencies: (0..half)
                .map(|i| 1.0 / f64::from(theta).powf(2.0 * i as f64 / head_dim as f64))
                .collect(),
        }
    }

    /// The angles' cosines and sines at `position`, one per pair.
    pub(crate) fn at(&self, position: usize) -> (Vec<f64>, Vec<f64>) {
        self.inverse_frequencies
            .iter()
            .map(|f| (position as f64 * f).sin_cos())
            .map(|(sin, cos)| (cos, sin))
            .unzip()
    }

    /// The mean cosines and sines over `positions`: the averaged rotary matrix R̄.
    pub(crate) fn mean_over(&self, positions: Range<usize>) -> (Vec<f64>, Vec<f64>) {
        let n = positions.len() as f64;
        let half = self.inverse_frequencies.len();
        let (mut cos, mut sin) = (vec![0.0; half], vec![0.0; half]);
        for position in positions {
            let (c, s) = self.at(position);
            for i in 0..half {
                cos[i] += c[i] / n;
                sin[i] += s[i] / n;
            }
        }
        (cos, sin)
    }
}

/// `x cos + rotate_half(x) sin` with per-pair `cos`, `sin`: R x (rotate back with `-sin`).
pub(crate) fn rotate(x: ArrayView1<f64>, cos: &[f64], sin: &[f64]) -> Array1<f64> {
    let half = cos.len();
    Array1::from_shape_fn(2 * half, |i| {
        if i < half {
            x[i] * cos[i] - x[i + half] * sin[i]
        } else {
            x[i] * cos[i - half] + x[i - half] * sin[i - half]
        }
    })
}
