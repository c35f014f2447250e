//! The softmax every scorer and metric runs over each row of logits: the prefill scorers run it
//! over every prompt row, so after the q·Kᵀ product it is the attention-scoring kernel's other
//! half. Its arithmetic is fixed to the operation (a Cephes `expf` polynomial in fused
//! multiply-adds, a sum in eight f64 lanes folded in one order), so the AVX2/FMA code and the
//! portable code give bit-identical results on every machine. The AVX2 code exists because the
//! compiler vectorised the portable loops poorly (NaN-aware max, a shuffled f64 sum, a separate
//! pass per step): it makes three passes (max; exp, store and sum; scale) where the portable
//! code makes four, and `softmax_into` saves the copy a scorer would otherwise make. On
//! niah-2k's prompt rows this took the softmax from ~0.75 s to ~0.45 s of the bench's 30-layer
//! scoring kernel (perf; the product takes ~0.93 s); what is left is exp's arithmetic.

/// A stable softmax in f64 (no fixed kernel): for what is measured in f64, a cache's own
/// attention over the keys it holds, or a head's score.
pub fn softmax_f64(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exp: Vec<f64> = logits.iter().map(|&l| (l - max).exp()).collect();
    let total: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / total).collect()
}

/// In-place softmax; an empty slice stays empty. Inputs must be finite (traces are checked on
/// load); an entry more than 87 below the largest gets ~1.6e-38 / sum, not 0.
pub fn softmax_in_place(values: &mut [f32]) {
    let data = values.as_mut_ptr();
    // SAFETY: `data` is valid for reads and writes of `values.len()` floats; source and
    // destination may be the same.
    unsafe { softmax_raw(data, data, values.len()) }
}

/// `out` = the softmax of `logits` (its previous contents are dropped, its capacity reused):
/// one pass fewer than copying the logits and running [`softmax_in_place`], same result.
pub fn softmax_into(logits: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.reserve(logits.len());
    // SAFETY: `out` has capacity for `logits.len()` floats and does not overlap `logits`; the
    // kernel writes every one of them before `set_len` exposes them.
    unsafe {
        softmax_raw(logits.as_ptr(), out.as_mut_ptr(), logits.len());
        out.set_len(logits.len());
    }
}

/// The softmax of `logits`, as a new vector.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let mut weights = Vec::with_capacity(logits.len());
    softmax_into(logits, &mut weights);
    weights
}

/// Writes the softmax of `len` floats at `source` to `destination`.
///
/// # Safety
/// `source` must be valid for reads and `destination` for writes of `len` floats; they are
/// either the same pointer or non-overlapping.
unsafe fn softmax_raw(source: *const f32, destination: *mut f32, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected just above; pointers as promised by the caller.
        return unsafe { avx2::softmax(source, destination, len) };
    }
    // SAFETY: as promised by the caller.
    unsafe { softmax_portable(source, destination, len) }
}

/// `e^x` for `x <= 88` (the softmax only asks for `x <= 0`: it shifts by the row's largest
/// value), within 2 ulp (Cephes' `expf` polynomial, Horner's rule in fused
/// multiply-adds: `mul_add` rounds once, like the FMA instruction, so both code paths agree to
/// the bit; where the processor has no FMA, the portable path calls libm's correctly rounded
/// `fmaf`), written without branches. Inputs below -87 return ~1.6e-38 instead of underflowing,
/// which no softmax sum can notice. [`avx2::exp`] is the same arithmetic, eight lanes at a time.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.max(EXP_LOW);
    let shifted = x.mul_add(std::f32::consts::LOG2_E, MAGIC);
    let n = shifted - MAGIC;
    let exponent = shifted.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = EXP_POLYNOMIAL[0];
    for coefficient in &EXP_POLYNOMIAL[1..] {
        p = p.mul_add(r, *coefficient);
    }
    let e = (p * r).mul_add(r, r) + 1.0;
    e * f32::from_bits(((exponent + 127) as u32) << 23)
}

const EXP_LOW: f32 = -87.0;
/// 1.5 · 2²³: adding it rounds to an integer.
const MAGIC: f32 = 12_582_912.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
// Cephes' coefficients as published, digits beyond f32 included.
#[allow(clippy::excessive_precision)]
const EXP_POLYNOMIAL: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5.000_000_1e-1,
];

/// Folds the eight f64 lanes and the tail in the one order both code paths use.
#[inline(always)]
fn fold_lanes(lanes: [f64; 8], tail: f64) -> f64 {
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
        + tail
}

/// The largest of `values` (`-inf` when empty); no NaN handling (inputs are finite).
#[inline(always)]
fn largest(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(
        f32::NEG_INFINITY,
        |max, value| if value > max { value } else { max },
    )
}

/// Divides the exponentials in `values` by their sum: the eight lanes of the whole groups of
/// eight, then the remaining values in order, folded in the one order both code paths use.
#[inline(always)]
fn normalise(values: &mut [f32], lanes: [f64; 8]) {
    let tail: f64 = values[values.len() / 8 * 8..]
        .iter()
        .map(|value| *value as f64)
        .sum();
    let inv = (1.0 / fold_lanes(lanes, tail)) as f32;
    for value in values.iter_mut() {
        *value *= inv;
    }
}

/// # Safety
/// As [`softmax_raw`].
unsafe fn softmax_portable(source: *const f32, destination: *mut f32, len: usize) {
    // SAFETY (whole body): indices stay below `len`; each element is read before it is written.
    let max = largest((0..len).map(|i| unsafe { *source.add(i) }));
    for i in 0..len {
        unsafe { *destination.add(i) = exp(*source.add(i) - max) };
    }
    let values = unsafe { std::slice::from_raw_parts_mut(destination, len) };
    // Eight independent f64 lanes (an addition chain per lane, not one for the whole row).
    let mut lanes = [0.0f64; 8];
    for chunk in values.chunks_exact(8) {
        for lane in 0..8 {
            lanes[lane] += chunk[lane] as f64;
        }
    }
    normalise(values, lanes);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::softmax_portable`] in AVX2: the same operations in the same order per lane.
    ///
    /// # Safety
    /// The processor has AVX2 and FMA; pointers as [`super::softmax_raw`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(source: *const f32, destination: *mut f32, len: usize) {
        let whole = len / 8 * 8;
        // SAFETY (whole body): every access is below `len`; each group of eight is loaded
        // before it is stored, so `source == destination` is fine.
        let max = unsafe { max(source, len) };
        let shift = _mm256_set1_ps(max);
        let mut low = _mm256_setzero_pd();
        let mut high = _mm256_setzero_pd();
        for start in (0..whole).step_by(8) {
            let e = exp(_mm256_sub_ps(
                unsafe { _mm256_loadu_ps(source.add(start)) },
                shift,
            ));
            unsafe { _mm256_storeu_ps(destination.add(start), e) };
            low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
        }
        for i in whole..len {
            unsafe { *destination.add(i) = super::exp(*source.add(i) - max) };
        }
        let values = unsafe { std::slice::from_raw_parts_mut(destination, len) };
        let mut lanes = [0.0f64; 8];
        unsafe {
            _mm256_storeu_pd(lanes.as_mut_ptr(), low);
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4), high);
        }
        normalise(values, lanes);
    }

    /// The largest of `len` floats (`-inf` when empty), four vectors of eight per step.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max(source: *const f32, len: usize) -> f32 {
        let whole = len / 32 * 32;
        let mut lanes = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        for start in (0..whole).step_by(32) {
            for (index, lane) in lanes.iter_mut().enumerate() {
                // SAFETY: `start + 8 * index + 8 <= whole <= len`.
                let values = unsafe { _mm256_loadu_ps(source.add(start + 8 * index)) };
                *lane = _mm256_max_ps(*lane, values);
            }
        }
        let folded = _mm256_max_ps(
            _mm256_max_ps(lanes[0], lanes[1]),
            _mm256_max_ps(lanes[2], lanes[3]),
        );
        let mut eight = [0.0f32; 8];
        // SAFETY: `eight` holds eight floats.
        unsafe { _mm256_storeu_ps(eight.as_mut_ptr(), folded) };
        // SAFETY: `i < len`.
        largest((whole..len).map(|i| unsafe { *source.add(i) }).chain(eight))
    }

    /// [`super::exp`] on eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOW));
        let magic = _mm256_set1_ps(MAGIC);
        let shifted = _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), magic);
        let n = _mm256_sub_ps(shifted, magic);
        let exponent = _mm256_sub_epi32(
            _mm256_castps_si256(shifted),
            _mm256_set1_epi32(MAGIC.to_bits() as i32),
        );
        let r = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(LN2_LO),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x),
        );
        let mut p = _mm256_set1_ps(EXP_POLYNOMIAL[0]);
        for coefficient in &EXP_POLYNOMIAL[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*coefficient));
        }
        let e = _mm256_add_ps(
            _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
            _mm256_set1_ps(1.0),
        );
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(exponent, _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn exp_is_within_two_ulp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (fast, exact) = (exp(x), x.exp());
            assert!(
                (fast - exact).abs() <= 2.5 * f32::EPSILON * exact,
                "exp({x}): {fast} vs {exact}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn softmax_matches_hand_computation() {
        // e^(x-2) / (e^-1 + e^-2 + 1) for logits 1, 0, 2.
        let weights = softmax(&[1.0, 0.0, 2.0]);
        assert_abs_diff_eq!(weights[0], 0.244_728, epsilon = 1e-6);
        assert_abs_diff_eq!(weights[1], 0.090_031, epsilon = 1e-6);
        assert_abs_diff_eq!(weights[2], 0.665_241, epsilon = 1e-6);
        assert!(softmax(&[]).is_empty());
    }

    /// Rows of every length around the lane groups (8 for the sum, 32 for the max), with the
    /// largest logit anywhere and some far below it.
    fn rows() -> Vec<Vec<f32>> {
        (0..200)
            .chain([1_000, 2_047, 8_021])
            .map(|len| {
                (0..len)
                    .map(|i| {
                        let wave = ((i * 7919 + len * 31) % 1000) as f32 / 1000.0;
                        if i % 97 == 13 {
                            -120.0 * wave
                        } else {
                            12.0 * wave - 3.0
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_path_gives_the_same_bits() {
        for row in rows() {
            let mut in_place = row.clone();
            softmax_in_place(&mut in_place);
            let mut reused = vec![5.0; 3];
            softmax_into(&row, &mut reused);
            let mut portable = vec![0.0; row.len()];
            // SAFETY: both buffers hold `row.len()` floats and do not overlap.
            unsafe { softmax_portable(row.as_ptr(), portable.as_mut_ptr(), row.len()) };
            let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&in_place), bits(&portable), "length {}", row.len());
            assert_eq!(bits(&reused), bits(&portable), "length {}", row.len());
        }
    }

    #[test]
    fn matches_an_f64_softmax() {
        for row in rows().into_iter().filter(|row| !row.is_empty()) {
            // The shift `v - max` is rounded to f32 as in the kernel (that rounding is the
            // input's, not the kernel's error); everything after it in f64.
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f64> = row.iter().map(|v| ((v - max) as f64).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for (fast, exact) in softmax(&row).iter().zip(&exps) {
                let exact = exact / sum;
                // exp within 2 ulp, the normalisation one rounding more.
                assert!(
                    (*fast as f64 - exact).abs() <= 4.0 * f32::EPSILON as f64 * exact + 1e-37,
                    "length {}: {fast} vs {exact}",
                    row.len()
                );
            }
        }
    }
}
