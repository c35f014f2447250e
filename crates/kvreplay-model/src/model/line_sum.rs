//! The sum of a line as candle-core 0.11 sums the last axis of a contiguous tensor
//! (`sum_keepdim`): on x86-64 with AVX2 its `vec_sum` (cpu/avx.rs) adds the line's whole 32-value
//! blocks into four 8-lane accumulators, folds them (`(a₀ + a₁) + (a₂ + a₃)`), adds the two halves
//! of the result lane by lane, sums the four values that leaves by two horizontal adds, and then
//! adds the rest of the line one value at a time. Fused passes (an RMSNorm, a softmax's
//! normalisation) sum their lines here, bit for bit what the tensor operation they replace gives.
//! Elsewhere the line goes through candle itself.

use candle_core::{Device, Tensor};

/// `values` summed as candle's `sum_keepdim` over a line sums them.
pub(crate) fn line_sum(values: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { line_sum_avx2(values) };
    }
    Tensor::from_slice(values, values.len(), &Device::Cpu)
        .and_then(|line| line.sum_all()?.to_scalar::<f32>())
        .expect("a vector in CPU memory sums")
}

/// [`line_sum`] as candle's AVX2 `vec_sum` runs it ([module doc](self)).
///
/// # Safety
/// The processor must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn line_sum_avx2(values: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let whole = values.len() & !31;
    let mut sums = [_mm256_setzero_ps(); 4];
    for block in values[..whole].chunks_exact(32) {
        for (j, sum) in sums.iter_mut().enumerate() {
            *sum = _mm256_add_ps(*sum, _mm256_loadu_ps(block[j * 8..].as_ptr()));
        }
    }
    let folded = _mm256_add_ps(
        _mm256_add_ps(sums[0], sums[1]),
        _mm256_add_ps(sums[2], sums[3]),
    );
    let halves = _mm_add_ps(
        _mm256_castps256_ps128(folded),
        _mm256_extractf128_ps(folded, 1),
    );
    let pairs = _mm_hadd_ps(halves, halves);
    let mut total = _mm_cvtss_f32(_mm_hadd_ps(pairs, pairs));
    for value in &values[whole..] {
        total += value;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    #[test]
    fn a_line_sums_as_candles_sum_keepdim_bit_for_bit() {
        // Lengths around the 32-value blocks, values of many magnitudes and both signs.
        for len in (0..100).chain([255, 256, 257, 1000, 4099]) {
            let values: Vec<f32> = (0..len as u32)
                .map(|i| {
                    let magnitude = ((i * 7919) % 23) as f32 - 11.0;
                    (i as f32 * 0.61).sin() * magnitude.exp2()
                })
                .collect();
            let line = Tensor::from_slice(&values, (1, len), &Device::Cpu).unwrap();
            let candle = line.sum_keepdim(D::Minus1).unwrap().flatten_all().unwrap();
            let candle = candle.to_vec1::<f32>().unwrap()[0];
            assert_eq!(
                line_sum(&values).to_bits(),
                candle.to_bits(),
                "{len} values"
            );
        }
    }
}
