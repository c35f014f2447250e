//! A gated MLP's activation of its gate projection times its up projection, in one parallel pass
//! over the two instead of candle's two (the activation, then the product), each a pass of its own
//! through its thread pool. Both activations are written as candle-core 0.11 writes them (op.rs,
//! `Silu` and `Gelu`), operation for operation, so every element is candle's bit for bit; their
//! exponentials and tanh go eight lanes at a time where the platform's functions give the lanes'
//! bits ([`expf`](super::expf), [`tanhf`](super::tanhf)).

use super::expf::exp_shifted;
use super::product::with_rows;
use super::tanhf::tanh_in_place;
use super::ModelError;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `v / (1 + exp(−v))` (Llama).
    Silu,
    /// `0.5·v·(1 + tanh(√(2/π)·v·(1 + 0.044715·v²)))` (Gemma 3).
    GeluTanh,
}

/// `√(2/π)` as candle's `SQRT_TWO_OVER_PI_F32` rounds it.
const SQRT_TWO_OVER_PI: u32 = 0x3f4c_422a;

/// Elements one task activates.
const TASK_ELEMENTS: usize = 4096;

/// `activation(gate) · up`, element by element, for two projections of one shape `[n, width]`.
pub(crate) fn gated(
    gate: &Tensor,
    up: &Tensor,
    activation: Activation,
) -> Result<Tensor, ModelError> {
    let shape = gate.dims2()?;
    if up.dims2()? != shape {
        return Err(ModelError::Input(format!(
            "a gate of shape {shape:?} and an up projection of shape {:?}",
            up.dims()
        )));
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    let both = with_rows(&gate, |gate, _| {
        with_rows(&up, |up, _| activated_times(gate, up, activation))
    });
    match both?.transpose()?.flatten() {
        Some(out) => Ok(Tensor::from_vec(out, shape, &Device::Cpu)?),
        None => Err(ModelError::Input(
            "gate or up projection outside CPU memory".into(),
        )),
    }
}

/// `activation(gate[i]) · up[i]` for every `i`, in parallel tasks.
fn activated_times(gate: &[f32], up: &[f32], activation: Activation) -> Vec<f32> {
    let mut out = vec![0.0f32; gate.len()];
    out.par_chunks_mut(TASK_ELEMENTS)
        .zip(gate.par_chunks(TASK_ELEMENTS))
        .zip(up.par_chunks(TASK_ELEMENTS))
        .for_each(|((out, gate), up)| match activation {
            Activation::Silu => silu_times(gate, up, out),
            Activation::GeluTanh => gelu_tanh_times(gate, up, out),
        });
    out
}

/// `out = silu(gate) · up`: candle's `v / (1.0 + (-v).exp())`, then the product.
fn silu_times(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for (out, &v) in out.iter_mut().zip(gate) {
        *out = -v;
    }
    exp_shifted(out, 0.0);
    for ((out, &v), &u) in out.iter_mut().zip(gate).zip(up) {
        *out = v / (1.0 + *out) * u;
    }
}

/// `out = gelu(gate) · up`: candle's
/// `0.5 * v * (1.0 + f32::tanh(SQRT_TWO_OVER_PI_F32 * v * (1.0 + 0.044715 * v * v)))`, then
/// the product.
fn gelu_tanh_times(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let scale = f32::from_bits(SQRT_TWO_OVER_PI);
    for (out, &v) in out.iter_mut().zip(gate) {
        *out = scale * v * (1.0 + 0.044715 * v * v);
    }
    tanh_in_place(out);
    for ((out, &v), &u) in out.iter_mut().zip(gate).zip(up) {
        *out = 0.5 * v * (1.0 + *out) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[n, width]` values of every magnitude (scattered bit patterns, their NaNs and infinities
    /// among them) and an activation's working range evenly, with zeros.
    fn varied(n: usize, width: usize, salt: u32) -> Tensor {
        let values: Vec<f32> = (0..(n * width) as u32)
            .map(|i| match i % 3 {
                0 => f32::from_bits((i ^ salt).wrapping_mul(0x9e37_79b9)),
                1 => (i % 4001) as f32 * 0.01 - 20.0,
                _ => ((i ^ salt) % 2001) as f32 * 0.001 - 1.0,
            })
            .collect();
        Tensor::from_vec(values, (n, width), &Device::Cpu).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        values.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn each_activation_times_up_is_candles_bit_for_bit() {
        // Several tasks' worth, and a width that leaves lanes over.
        let (gate, up) = (varied(7, 3001, 0), varied(7, 3001, 0x5bd1_e995));
        let candle = [
            (Activation::Silu, (gate.silu().unwrap() * &up).unwrap()),
            (Activation::GeluTanh, (gate.gelu().unwrap() * &up).unwrap()),
        ];
        for (activation, expected) in candle {
            let ours = gated(&gate, &up, activation).unwrap();
            assert_eq!(bits(&ours), bits(&expected), "{activation:?}");
        }
        // A gate given as a strided view.
        let wide = varied(3001, 7, 1).t().unwrap();
        let up = varied(7, 3001, 2);
        let expected = (wide.gelu().unwrap() * &up).unwrap();
        // Where both factors are NaN, the product's payload follows candle's operand order.
        let nan_as_one = |t: &Tensor| -> Vec<u32> {
            let nan = f32::NAN.to_bits();
            bits(t)
                .into_iter()
                .map(|b| if f32::from_bits(b).is_nan() { nan } else { b })
                .collect()
        };
        let ours = gated(&wide, &up, Activation::GeluTanh).unwrap();
        assert_eq!(nan_as_one(&ours), nan_as_one(&expected));
    }

    #[test]
    fn projections_of_two_shapes_are_refused() {
        let refused = gated(&varied(2, 4, 0), &varied(4, 2, 0), Activation::Silu);
        assert!(matches!(refused, Err(ModelError::Input(_))), "{refused:?}");
    }
}
