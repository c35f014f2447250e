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
    // Per head, 16 lanes at a time held in four registers while the kept rows stream past: each
    // lane still adds its terms in kept order, and nothing is stored until the rows are done.
    let blocks = d / 16 * 16;
    for (head, head_sums) in weights.iter().zip(sums.chunks_exact_mut(d)) {
        let mut lane = 0;
        while lane < blocks {
            // SAFETY: lane + 16 <= blocks <= d, the length of `head_sums` and of every row.
            unsafe {
                let target = head_sums.as_mut_ptr().add(lane);
                let mut acc = [0usize, 4, 8, 12].map(|k| _mm256_loadu_pd(target.add(k)));
                for &j in kept {
                    let splat = _mm256_set1_pd(head[j] as f64);
                    let source = all.as_ptr().add(j * d + lane);
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let v = _mm256_cvtps_pd(_mm_loadu_ps(source.add(4 * k)));
                        *acc = _mm256_add_pd(*acc, _mm256_mul_pd(splat, v));
                    }
                }
                for (k, acc) in acc.iter().enumerate() {
                    _mm256_storeu_pd(target.add(4 * k), *acc);
                }
            }
            lane += 16;
        }
        for (i, sum) in head_sums.iter_mut().enumerate().skip(blocks) {
            for &j in kept {
                *sum += head[j] as f64 * all[j * d + i] as f64;
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

    #[test]
    fn the_vector_path_matches_the_portable_sums_bit_for_bit() {
        // 40 lanes: two blocks of 16 and a remainder of 8; 3 heads; kept out of position order.
        let (t, d) = (50, 40);
        let unit = |i: usize| ((i * 2654435761) % 1000) as f32 / 997.0 - 0.5;
        let values = Array2::from_shape_fn((t, d), |(r, c)| unit(r * d + c) * 3.0);
        let heads: Vec<Vec<f32>> = (0..3)
            .map(|h| (0..t).map(|j| unit(7 * j + h).abs() / 10.0).collect())
            .collect();
        let weights: Vec<&[f32]> = heads.iter().map(Vec::as_slice).collect();
        let kept: Vec<usize> = (0..t).rev().step_by(3).chain([1, 4]).collect();
        let mut portable = vec![0.0f64; 3 * d];
        add_rows(
            &kept,
            &weights,
            values.as_slice().unwrap(),
            d,
            &mut portable,
        );
        assert_eq!(kept_outputs(&kept, &weights, values.view()), portable);
    }
}
