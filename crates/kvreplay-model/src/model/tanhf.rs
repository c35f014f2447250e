//! `tanh` eight lanes at a time, each lane bit for bit what `f32::tanh` gives on the glibc
//! x86-64 this project runs on (Debian 12's 2.36), whose `tanhf` Gemma 3's tanh-GELU called one
//! value at a time.
//!
//! That glibc computes `tanhf` by Sun's fdlibm algorithm in single precision, every operation
//! rounded on its own (sysdeps/ieee754/flt-32/s_tanhf.c and s_expm1f.c, glibc commit 30891f35):
//! for `|x| ≥ 22` it gives `±1`; for `1 ≤ |x| < 22`, `t = expm1f(2|x|)` and `1 − 2/(t + 2)`;
//! for smaller `|x|`, `t = expm1f(−2|x|)` and `−t/(t + 2)`; the sign is `x`'s. `expm1f(a)`
//! reduces `a = k·ln2 + r` (`k = ±1` for `0.5 ln2 < |a| < 1.5 ln2`, else `k` = `1/ln2 · a ± 0.5`
//! truncated, `0` for `|a| ≤ 0.5 ln2`), with `ln2` split in `hi + lo` and the reduction's
//! rounding error `c`, evaluates a rational approximation of `expm1(r)` (coefficients `Q1..Q5`
//! below), and scales by `2^k` through the exponent bits, one formula per range of `k`. The
//! lanes compute every range's formula and keep each lane's own; infinities, NaNs and
//! `|x| < 2⁻⁵⁵` (where it returns `x` or `x·(1 + x)`) call `f32::tanh` itself. They run where
//! the processor has AVX2 and, on first use, `f32::tanh` gives their bits on a probe of 262,144
//! values; elsewhere (another libm, such as later glibc's correctly rounded `tanhf`, or another
//! processor) every value goes through `f32::tanh`. A test checks every `f32` against
//! `f32::tanh`.

use std::sync::OnceLock;

/// `ln2_hi`, `ln2_lo`, `invln2` of s_expm1f.c (bits).
const LN2_HI: u32 = 0x3f317180;
const LN2_LO: u32 = 0x3717f7d1;
const INV_LN2: u32 = 0x3fb8aa3b;
/// `Q1..Q5` of s_expm1f.c (bits).
const Q: [u32; 5] = [0xbd088889, 0x3ad00d01, 0xb8a670cd, 0x36867e54, 0xb457edbb];

/// `values[i] = values[i].tanh()` for every value, as `f32::tanh` computes each.
pub(crate) fn tanh_in_place(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if *vectorized() {
        // SAFETY: `vectorized` found AVX2.
        unsafe { tanh_avx2(values) };
        return;
    }
    tanh_scalar(values);
}

/// [`tanh_in_place`] one value at a time.
fn tanh_scalar(values: &mut [f32]) {
    for value in values {
        *value = value.tanh();
    }
}

/// Whether the lanes run here: AVX2, and the probe finds the platform's `tanhf` equal to them on
/// every value.
fn vectorized() -> &'static bool {
    static VECTORIZED: OnceLock<bool> = OnceLock::new();
    VECTORIZED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // Scattered bit patterns of every magnitude, and a GELU's range evenly.
            let probe: Vec<f32> = (0..1u32 << 17)
                .map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9)))
                .chain((0..1u32 << 17).map(|i| (i as f32 - 65536.0) * (24.0 / 65536.0)))
                .collect();
            let mut lanes = probe.clone();
            // SAFETY: AVX2 was just detected.
            unsafe { tanh_avx2(&mut lanes) };
            return probe
                .iter()
                .zip(&lanes)
                .all(|(x, lane)| x.tanh().to_bits() == lane.to_bits());
        }
        false
    })
}

/// [`tanh_in_place`] eight lanes at a time ([module doc](self)).
///
/// # Safety
/// The processor must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tanh_avx2(values: &mut [f32]) {
    use std::arch::x86_64::*;
    let int = _mm256_set1_epi32;
    let float = _mm256_set1_ps;
    let mut chunks = values.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let input: [f32; 8] = (&*chunk).try_into().expect("eight lanes");
        let x = _mm256_loadu_ps(input.as_ptr());
        let bits = _mm256_castps_si256(x);
        let magnitude = _mm256_and_si256(bits, int(0x7fff_ffff));
        let special = _mm256_or_si256(
            _mm256_cmpgt_epi32(magnitude, int(0x7f7f_ffff)),
            _mm256_cmpgt_epi32(int(0x2400_0000), magnitude),
        );
        let special = _mm256_movemask_ps(_mm256_castsi256_ps(special));
        let at_least_one = _mm256_castsi256_ps(_mm256_cmpgt_epi32(magnitude, int(0x3f7f_ffff)));
        let saturated = _mm256_castsi256_ps(_mm256_cmpgt_epi32(magnitude, int(0x41af_ffff)));
        let twice = _mm256_mul_ps(float(2.0), _mm256_castsi256_ps(magnitude));
        let negated = _mm256_xor_ps(twice, float(-0.0));
        let t = expm1_lanes(_mm256_blendv_ps(negated, twice, at_least_one));
        let plus_two = _mm256_add_ps(t, float(2.0));
        let above = _mm256_sub_ps(float(1.0), _mm256_div_ps(float(2.0), plus_two));
        let below = _mm256_div_ps(_mm256_xor_ps(t, float(-0.0)), plus_two);
        let z = _mm256_blendv_ps(below, above, at_least_one);
        let z = _mm256_blendv_ps(z, float(1.0), saturated);
        let sign = _mm256_and_si256(bits, int(i32::MIN));
        let y = _mm256_xor_ps(z, _mm256_castsi256_ps(sign));
        _mm256_storeu_ps(chunk.as_mut_ptr(), y);
        if special != 0 {
            for lane in (0..8).filter(|lane| special >> lane & 1 == 1) {
                chunk[lane] = input[lane].tanh();
            }
        }
    }
    tanh_scalar(chunks.into_remainder());
}

/// `expm1f` of s_expm1f.c on eight lanes of `a`, for `|a|` below `27 ln2` or positive below
/// `88.7` (its overflow and `−1` cases are not taken), `|a| < 2⁻²⁵` giving `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn expm1_lanes(a: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let int = _mm256_set1_epi32;
    let float = _mm256_set1_ps;
    let constant = |bits: u32| float(f32::from_bits(bits));
    let bits = _mm256_castps_si256(a);
    let magnitude = _mm256_and_si256(bits, int(0x7fff_ffff));
    let negative = _mm256_cmpgt_epi32(int(0), bits);
    // k: 0 up to 0.5 ln2, ±1 up to 1.5 ln2, else `invln2 · a ± 0.5` truncated.
    let half = _mm256_xor_ps(float(0.5), _mm256_and_ps(a, float(-0.0)));
    let far = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(constant(INV_LN2), a), half));
    let one = _mm256_or_si256(int(1), negative);
    let near = _mm256_cmpgt_epi32(int(0x3f85_1592), magnitude);
    let k = _mm256_blendv_epi8(far, one, near);
    let reduced = _mm256_cmpgt_epi32(magnitude, int(0x3eb1_7218));
    let k = _mm256_and_si256(k, reduced);
    let t = _mm256_cvtepi32_ps(k);
    let hi = _mm256_sub_ps(a, _mm256_mul_ps(t, constant(LN2_HI)));
    let lo = _mm256_mul_ps(t, constant(LN2_LO));
    let x = _mm256_sub_ps(hi, lo);
    let c = _mm256_sub_ps(_mm256_sub_ps(hi, x), lo);
    // x in the primary range.
    let hfx = _mm256_mul_ps(float(0.5), x);
    let hxs = _mm256_mul_ps(x, hfx);
    let mut r1 = constant(Q[4]);
    for q in Q[..4].iter().rev() {
        r1 = _mm256_add_ps(constant(*q), _mm256_mul_ps(hxs, r1));
    }
    let r1 = _mm256_add_ps(float(1.0), _mm256_mul_ps(hxs, r1));
    let tt = _mm256_sub_ps(float(3.0), _mm256_mul_ps(r1, hfx));
    let e = _mm256_mul_ps(
        hxs,
        _mm256_div_ps(
            _mm256_sub_ps(r1, tt),
            _mm256_sub_ps(float(6.0), _mm256_mul_ps(x, tt)),
        ),
    );
    let k_zero = _mm256_sub_ps(x, _mm256_sub_ps(_mm256_mul_ps(x, e), hxs));
    let e = _mm256_sub_ps(_mm256_mul_ps(x, _mm256_sub_ps(e, c)), c);
    let e = _mm256_sub_ps(e, hxs);
    let e_less_x = _mm256_sub_ps(e, x);
    let k_minus_one = _mm256_sub_ps(_mm256_mul_ps(float(0.5), _mm256_sub_ps(x, e)), float(0.5));
    let k_one = _mm256_blendv_ps(
        _mm256_add_ps(float(1.0), _mm256_mul_ps(float(2.0), _mm256_sub_ps(x, e))),
        _mm256_mul_ps(float(-2.0), _mm256_sub_ps(e, _mm256_add_ps(x, float(0.5)))),
        _mm256_cmp_ps::<_CMP_LT_OQ>(x, float(-0.25)),
    );
    let scaled = |y: __m256| {
        _mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_castps_si256(y),
            _mm256_slli_epi32::<23>(k),
        ))
    };
    let k_far = _mm256_sub_ps(scaled(_mm256_sub_ps(float(1.0), e_less_x)), float(1.0));
    let below_23 = _mm256_castsi256_ps(_mm256_sub_epi32(
        int(0x3f80_0000),
        _mm256_srlv_epi32(int(0x0100_0000), k),
    ));
    let k_below_23 = scaled(_mm256_sub_ps(below_23, e_less_x));
    let from_23 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(int(0x7f), k)));
    let k_from_23 = scaled(_mm256_add_ps(
        _mm256_sub_ps(x, _mm256_add_ps(e, from_23)),
        float(1.0),
    ));
    let is = |value: i32| _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, int(value)));
    let above = |value: i32| _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, int(value)));
    // From the widest range in: k ≤ −2 or k > 56, then 23..=56, 2..=22, 1, −1, 0.
    let y = k_far;
    let y = _mm256_blendv_ps(y, k_from_23, _mm256_andnot_ps(above(56), above(22)));
    let y = _mm256_blendv_ps(y, k_below_23, _mm256_andnot_ps(above(22), above(1)));
    let y = _mm256_blendv_ps(y, k_one, is(1));
    let y = _mm256_blendv_ps(y, k_minus_one, is(-1));
    let y = _mm256_blendv_ps(y, k_zero, is(0));
    let tiny = _mm256_castsi256_ps(_mm256_cmpgt_epi32(int(0x3300_0000), magnitude));
    _mm256_blendv_ps(y, a, tiny)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// Every `f32` bit pattern through [`tanh_in_place`] against `f32::tanh`: how many differ.
    fn differing() -> usize {
        let blocks: Vec<u32> = (0..1u32 << 16).collect();
        blocks
            .par_iter()
            .map(|&block| {
                let values: Vec<f32> = (0..1u32 << 16)
                    .map(|low| f32::from_bits(block << 16 | low))
                    .collect();
                let mut lanes = values.clone();
                tanh_in_place(&mut lanes);
                values
                    .iter()
                    .zip(&lanes)
                    .filter(|(x, lane)| x.tanh().to_bits() != lane.to_bits())
                    .count()
            })
            .sum()
    }

    #[test]
    fn every_float_goes_through_tanh_as_the_platform_does() {
        // Every bit pattern: NaNs, infinities, subnormals, each range of expm1f's k and its edges.
        assert_eq!(differing(), 0);
    }

    #[test]
    fn glibc_with_suns_tanhf_takes_the_lanes() {
        // The CI and development machines (Debian 12, glibc 2.36; later releases replaced
        // `tanhf` by a correctly rounded one): a failure here means the check above compared
        // `f32::tanh` with itself.
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        if std::is_x86_feature_detected!("avx2") && glibc_minor() <= 36 {
            assert!(*vectorized());
        }
    }

    /// glibc's minor version, as it reports itself.
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    fn glibc_minor() -> u32 {
        extern "C" {
            fn gnu_get_libc_version() -> *const std::ffi::c_char;
        }
        // SAFETY: glibc returns a static NUL-terminated string.
        let version = unsafe { std::ffi::CStr::from_ptr(gnu_get_libc_version()) };
        let version = version.to_str().expect("an ASCII version");
        version
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .expect("major.minor")
    }
}
