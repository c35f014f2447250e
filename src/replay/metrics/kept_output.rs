//! The kept set's share of an attention output: for every query head of one cache at one decode
//! step, `Σ_j p_j v_j` over the kept positions, in f64, summed in kept order. The heads of a cache
//! read the same value rows, so each row is read once and added to every head's sum; each head's
//! sums are the same bits as adding its own terms one after another (separate multiply and add,
//! no fused multiply-add, in the vector code too).

use ndarray::ArrayView2;

/// `[heads × d]`, head-major: `Σ_{j ∈ kept} weights[h][j] · values[j]` for each head `h`.
pub(super) fn kept_outputs(
    kept: &[usize],
    weights: &[&[f32]],
    values: ArrayView2<f32>,
) -> Vec<f64> {
    let d = values.ncols();
    let mut sums = vec![0.0f64; weights.len() * d];
    match values.as_slice() {
        Some(all) => {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx") {
                // SAFETY: the feature was detected just above.
                unsafe { add_rows_avx(kept, weights, all, d, &mut sums) };
                return sums;
            }
            add_rows(kept, weights, all, d, &mut sums);
        }
        None => {
            for &j in kept {
                let row: Vec<f32> = values.row(j).to_vec();
                add_row(j, &row, weights, d, &mut sums);
            }
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn add_rows_avx(
    kept: &[usize],
    weights: &[&[f32]],
    all: &[f32],
    d: usize,
    sums: &mut [f64],
) {
    use std::arch::x86_64::*;
    let lanes = d / 4 * 4;
    // Each row is widened to f64 once, then added to every head's sums.
    let mut wide = vec![0.0f64; d];
    for &j in kept {
        let row = &all[j * d..(j + 1) * d];
        let mut i = 0;
        while i < lanes {
            // SAFETY: i + 4 <= lanes <= d, the length of `row` and of `wide`.
            unsafe {
                let v = _mm256_cvtps_pd(_mm_loadu_ps(row.as_ptr().add(i)));
                _mm256_storeu_pd(wide.as_mut_ptr().add(i), v);
            }
            i += 4;
        }
        for i in lanes..d {
            wide[i] = row[i] as f64;
        }
        for (head, head_sums) in weights.iter().zip(sums.chunks_exact_mut(d)) {
            let weight = head[j] as f64;
            let splat = _mm256_set1_pd(weight);
            let (source, target) = (wide.as_ptr(), head_sums.as_mut_ptr());
            let mut i = 0;
            while i < lanes {
                // SAFETY: i + 4 <= lanes <= d, the length of `wide` and of `head_sums`.
                unsafe {
                    let v = _mm256_loadu_pd(source.add(i));
                    let sum = _mm256_loadu_pd(target.add(i));
                    _mm256_storeu_pd(target.add(i), _mm256_add_pd(sum, _mm256_mul_pd(splat, v)));
                }
                i += 4;
            }
            for i in lanes..d {
                head_sums[i] += weight * wide[i];
            }
        }
    }
}

#[inline(always)]
fn add_rows(kept: &[usize], weights: &[&[f32]], all: &[f32], d: usize, sums: &mut [f64]) {
    for &j in kept {
        add_row(j, &all[j * d..(j + 1) * d], weights, d, sums);
    }
}

#[inline(always)]
fn add_row(j: usize, row: &[f32], weights: &[&[f32]], d: usize, sums: &mut [f64]) {
    for (head, head_sums) in weights.iter().zip(sums.chunks_exact_mut(d)) {
        let weight = head[j] as f64;
        for (sum, &v) in head_sums.iter_mut().zip(row) {
            *sum += weight * v as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    #[test]
    fn each_head_sums_its_own_weighted_rows_in_kept_order() {
        // Values rows (1, 2), (3, -1), (0.5, 4); kept 2 then 0; head 0 weights (0.1, _, 0.3),
        // head 1 (0.5, _, 0.25): head 0 = 0.3 (0.5, 4) + 0.1 (1, 2) = (0.25, 1.4); head 1 =
        // 0.25 (0.5, 4) + 0.5 (1, 2) = (0.625, 2).
        let values = Array2::from_shape_vec((3, 2), vec![1.0, 2.0, 3.0, -1.0, 0.5, 4.0]).unwrap();
        let (h0, h1) = ([0.1f32, 0.9, 0.3], [0.5f32, 0.0, 0.25]);
        let sums = kept_outputs(&[2, 0], &[&h0, &h1], values.view());
        let expected = [
            0.3f32 as f64 * 0.5 + 0.1f32 as f64,
            0.3f32 as f64 * 4.0 + 0.1f32 as f64 * 2.0,
            0.625,
            2.0,
        ];
        assert_eq!(sums, expected);
        // A view that is not contiguous (every other column) takes the same path's arithmetic.
        let wide = Array2::from_shape_fn(
            (3, 4),
            |(t, c)| if c % 2 == 0 { values[[t, c / 2]] } else { 9.0 },
        );
        let strided = wide.slice(ndarray::s![.., ..;2]);
        assert_eq!(kept_outputs(&[2, 0], &[&h0, &h1], strided), expected);
    }
}
