//! `exp(x − max)` over a softmax line, eight lanes at a time, each lane bit for bit what
//! `f32::exp` gives on glibc x86-64, whose `expf` the model's softmax called one value at a time.
//!
//! glibc 2.28 and later compute `expf` by ARM's optimized-routines algorithm
//! (sysdeps/ieee754/flt-32/e_expf.c, data in e_exp2f_data.c) and, on a processor with FMA, run
//! the build of it whose multiply-adds are fused (`__expf_fma`): in double precision,
//! `kd = fma(N/ln 2, x, 1.5·2⁵²)`, `ki = bits(kd)`, `kd −= 1.5·2⁵²`, `r = fma(N/ln 2, x, −kd)`,
//! `s = double(T[ki mod N] + (ki << 47))`, `z = fma(C₀, r, C₁)`, `y = fma(C₂, r, 1)`,
//! `y = fma(z, r², y)`, and `(float)(y · s)`, with N = 32 and the table and coefficients below.
//! Inputs of magnitude 88 or more, infinities and NaNs take its special cases: those lanes call
//! `f32::exp` itself (−∞ gives 0, as there). The lanes run on x86-64 glibc with AVX2 and FMA
//! when, on first use, `f32::exp` gives their bits on a probe of 196,608 values (an older glibc's
//! `expf` is another algorithm); everywhere else every value goes through `f32::exp`. A test
//! checks every `f32` against `f32::exp`.

use std::sync::OnceLock;

/// `T[i] = bits(2^(i/32)) − (i << 47)`, `2^(i/32)` correctly rounded (e_exp2f_data.c `tab`).
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// `invln2_scaled`: `0x1.71547652b82fep+0 · 32`.
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// `shift`: `0x1.8p+52`.
const SHIFT: u64 = 0x4338000000000000;
/// `poly_scaled`: `0x1.c6af84b912394p-5 / 32³`, `0x1.ebfce50fac4f3p-3 / 32²`,
/// `0x1.62e42ff0c52d6p-1 / 32`.
const POLY: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];
/// The exponent field (`bits >> 20 & 0x7ff`) from which `expf` takes its special cases: that of
/// 88.0.
const SPECIAL_TOP: u32 = 0x42b;

/// `values[i] = (values[i] − max).exp()` for every value, as `f32::exp` computes each.
pub(crate) fn exp_shifted(values: &mut [f32], max: f32) {
    #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
    if *vectorized() {
        // SAFETY: `vectorized` found AVX2 and FMA.
        unsafe { exp_shifted_avx2(values, max) };
        return;
    }
    exp_shifted_scalar(values, max);
}

/// [`exp_shifted`] one value at a time.
fn exp_shifted_scalar(values: &mut [f32], max: f32) {
    for value in values {
        *value = (*value - max).exp();
    }
}

/// Whether the lanes run here: AVX2 and FMA, and the probe finds the platform's `expf` equal to
/// them on every value.
fn vectorized() -> &'static bool {
    static VECTORIZED: OnceLock<bool> = OnceLock::new();
    VECTORIZED.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // Scattered bit patterns of every magnitude, and a softmax's range evenly.
            let probe: Vec<f32> = (0..1u32 << 16)
                .map(|i| -f32::from_bits(i.wrapping_mul(0x9e37_79b9) >> 1))
                .chain((0..1u32 << 17).map(|i| i as f32 * (-88.0 / (1u32 << 17) as f32)))
                .collect();
            let mut lanes = probe.clone();
            // SAFETY: AVX2 and FMA were just detected.
            unsafe { exp_shifted_avx2(&mut lanes, 0.0) };
            return probe
                .iter()
                .zip(&lanes)
                .all(|(x, lane)| x.exp().to_bits() == lane.to_bits());
        }
        false
    })
}

/// [`exp_shifted`] eight lanes at a time ([module doc](self)).
///
/// # Safety
/// The processor must support AVX2 and FMA.
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(values: &mut [f32], max: f32) {
    use std::arch::x86_64::*;
    let shift = _mm256_set1_ps(max);
    let special_above = _mm256_set1_epi32(SPECIAL_TOP as i32 - 1);
    let exponent = _mm256_set1_epi32(0x7ff);
    let mut chunks = values.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let x = _mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift);
        let top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), exponent);
        let special = _mm256_castsi256_ps(_mm256_cmpgt_epi32(top, special_above));
        // −∞ (a masked logit) gives 0 in the lanes; the other special cases call `f32::exp`.
        let zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(x, _mm256_set1_ps(f32::NEG_INFINITY));
        let special = _mm256_movemask_ps(_mm256_andnot_ps(zero, special));
        let low = exp_lanes(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let high = exp_lanes(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
        let y = _mm256_set_m128(_mm256_cvtpd_ps(high), _mm256_cvtpd_ps(low));
        let y = _mm256_andnot_ps(zero, y);
        let mut shifted = [0.0f32; 8];
        if special != 0 {
            _mm256_storeu_ps(shifted.as_mut_ptr(), x);
        }
        _mm256_storeu_ps(chunk.as_mut_ptr(), y);
        for lane in (0..8).filter(|lane| special >> lane & 1 == 1) {
            chunk[lane] = shifted[lane].exp();
        }
    }
    exp_shifted_scalar(chunks.into_remainder(), max);
}

/// `expf`'s main path on four lanes of `x` widened to double ([module doc](self)).
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_lanes(x: std::arch::x86_64::__m256d) -> std::arch::x86_64::__m256d {
    use std::arch::x86_64::*;
    let constant = |bits: u64| _mm256_set1_pd(f64::from_bits(bits));
    let (inv_ln2_n, shift) = (constant(INV_LN2_N), constant(SHIFT));
    let kd = _mm256_fmadd_pd(inv_ln2_n, x, shift);
    let ki = _mm256_castpd_si256(kd);
    let kd = _mm256_sub_pd(kd, shift);
    let r = _mm256_fmsub_pd(inv_ln2_n, x, kd);
    let index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr().cast(), index);
    let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
    let z = _mm256_fmadd_pd(constant(POLY[0]), r, constant(POLY[1]));
    let r2 = _mm256_mul_pd(r, r);
    let y = _mm256_fmadd_pd(constant(POLY[2]), r, _mm256_set1_pd(1.0));
    let y = _mm256_fmadd_pd(z, r2, y);
    _mm256_mul_pd(y, s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// Every `step`-th `f32` bit pattern through [`exp_shifted`] by `max` against `f32::exp`:
    /// how many differ.
    fn differing((step, max): (usize, f32)) -> usize {
        let blocks: Vec<u32> = (0..1u32 << 16).collect();
        blocks
            .par_iter()
            .map(|&block| {
                let values: Vec<f32> = (0..1u32 << 16)
                    .step_by(step)
                    .map(|low| f32::from_bits(block << 16 | low))
                    .collect();
                let mut lanes = values.clone();
                exp_shifted(&mut lanes, max);
                values
                    .iter()
                    .zip(&lanes)
                    .filter(|(x, lane)| (**x - max).exp().to_bits() != lane.to_bits())
                    .count()
            })
            .sum()
    }

    #[test]
    fn every_float_exponentiates_as_the_platform_does() {
        // Every bit pattern (NaNs, infinities, subnormals, the special cases' edges) unshifted,
        // every 61st shifted.
        assert_eq!(differing((1, 0.0)), 0);
        assert_eq!(differing((61, -1.5)), 0);
    }

    #[test]
    fn glibc_on_a_processor_with_fma_takes_the_lanes() {
        // The CI and development machines: a failure here means the check above compared
        // `f32::exp` with itself.
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            assert!(*vectorized());
        }
    }
}
