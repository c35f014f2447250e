//! The kept set's share of attention outputs: for every row (a query head at a decode step),
//! `Σ_j p_j v_j` over the kept positions, in f64, each lane summed in kept order. Rows that read
//! the same kept set (a cache's heads, and under prefill timing every decode step's copy of the
//! kept prompt) are summed together, so each value row is read and widened once for all of them,
//! and several rows' independent sums keep the vector units busy. A product of two f32 numbers is
//! exact in f64, so a fused multiply-add rounds once as the separate multiply and add do: every
//! path (AVX-512, AVX2, portable) gives the same bits, and the same bits as adding one row's
//! terms one after another.

use ndarray::ArrayView2;

/// Adds `Σ_{j ∈ kept} rows[r][j] · values[j]` to `sums[r·d..(r+1)·d]` for each row `r` (`sums`
/// row-major, `rows.len() × d`), continuing each lane's sum in kept order.
pub(super) fn add_kept_outputs(
    kept: &[usize],
    rows: &[&[f32]],
    values: ArrayView2<f32>,
    sums: &mut [f64],
) {
    let d = values.ncols();
    assert_eq!(sums.len(), rows.len() * d, "one sum per row and lane");
    match values.as_slice() {
        Some(all) => add_rows(kept, rows, all, d, sums),
        None => {
            // Not contiguous (a strided view): the contiguous rows it reads, in kept order.
            let packed: Vec<f32> = kept.iter().flat_map(|&j| values.row(j).to_vec()).collect();
            let rows_packed: Vec<Vec<f32>> = rows
                .iter()
                .map(|row| kept.iter().map(|&j| row[j]).collect())
                .collect();
            let rows_packed: Vec<&[f32]> = rows_packed.iter().map(Vec::as_slice).collect();
            let order: Vec<usize> = (0..kept.len()).collect();
            add_rows(&order, &rows_packed, &packed, d, sums);
        }
    }
}

/// The fastest path this machine runs.
fn add_rows(kept: &[usize], rows: &[&[f32]], all: &[f32], d: usize, sums: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected just above.
            unsafe { x86::add_rows_avx512(kept, rows, all, d, sums) };
            return;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected just above.
            unsafe { x86::add_rows_avx2(kept, rows, all, d, sums) };
            return;
        }
    }
    add_rows_portable(kept, rows, all, d, 0, sums);
}

/// Lanes `from..d` of every row, one multiply and one add per term.
fn add_rows_portable(
    kept: &[usize],
    rows: &[&[f32]],
    all: &[f32],
    d: usize,
    from: usize,
    sums: &mut [f64],
) {
    if from == d {
        return;
    }
    for (row, row_sums) in rows.iter().zip(sums.chunks_exact_mut(d)) {
        for &j in kept {
            let weight = row[j] as f64;
            let values = &all[j * d + from..(j + 1) * d];
            for (sum, &v) in row_sums[from..].iter_mut().zip(values) {
                *sum += weight * v as f64;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::add_rows_portable;
    use std::arch::x86_64::*;

    /// One vector path: `$rows_fn` sums four registers of lanes (`$lanes` lanes) of up to
    /// `$rows` rows at a time while the kept rows stream past, each lane in kept order, and leaves
    /// the remainder lanes to the portable code; `$block` is one such block, for `R` rows.
    macro_rules! vector_path {
        (
            $rows_fn:ident, $block:ident, $feature:literal, lanes $lanes:literal,
            rows [$($r:literal),+], $zero:ident, $load:ident, $store:ident, $widen:ident,
            $load_ps:ident, $splat:ident, $fmadd:ident
        ) => {
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $rows_fn(
                kept: &[usize],
                rows: &[&[f32]],
                all: &[f32],
                d: usize,
                sums: &mut [f64],
            ) {
                const MAX_ROWS: usize = [$($r),+].len();
                let blocks = d / $lanes * $lanes;
                for (chunk, chunk_sums) in rows.chunks(MAX_ROWS).zip(sums.chunks_mut(MAX_ROWS * d)) {
                    for lane in (0..blocks).step_by($lanes) {
                        // SAFETY: lane + $lanes <= d for every row; the caller checked the
                        // features.
                        unsafe {
                            match chunk.len() {
                                $($r => $block::<$r>(kept, chunk, all, d, lane, chunk_sums),)+
                                _ => unreachable!("chunks of at most MAX_ROWS rows"),
                            }
                        }
                    }
                }
                add_rows_portable(kept, rows, all, d, blocks, sums);
            }

            #[target_feature(enable = $feature)]
            unsafe fn $block<const R: usize>(
                kept: &[usize],
                rows: &[&[f32]],
                all: &[f32],
                d: usize,
                lane: usize,
                sums: &mut [f64],
            ) {
                const STEP: usize = $lanes / 4;
                // SAFETY: every row has `lane + $lanes <= d` lanes in `sums`, and `all` holds d
                // values for every kept position (the caller's contract).
                unsafe {
                    let base = sums.as_mut_ptr();
                    let target = |r: usize, k: usize| base.add(r * d + lane + STEP * k);
                    let mut acc = [[$zero(); 4]; R];
                    for (r, acc) in acc.iter_mut().enumerate() {
                        for (k, acc) in acc.iter_mut().enumerate() {
                            *acc = $load(target(r, k));
                        }
                    }
                    for &j in kept {
                        let source = all.as_ptr().add(j * d + lane);
                        let v = [0, 1, 2, 3].map(|k| $widen($load_ps(source.add(STEP * k))));
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let weight = $splat(*rows[r].get_unchecked(j) as f64);
                            for (acc, v) in acc.iter_mut().zip(v) {
                                *acc = $fmadd(weight, v, *acc);
                            }
                        }
                    }
                    for (r, acc) in acc.iter().enumerate() {
                        for (k, acc) in acc.iter().enumerate() {
                            $store(target(r, k), *acc);
                        }
                    }
                }
            }
        };
    }

    // Four rows of 32 lanes: 16 accumulators, the widened values and the weights fit the 32
    // AVX-512 registers.
    vector_path!(
        add_rows_avx512, block_512, "avx512f", lanes 32, rows [1, 2, 3, 4],
        _mm512_setzero_pd, _mm512_loadu_pd, _mm512_storeu_pd, _mm512_cvtps_pd,
        _mm256_loadu_ps, _mm512_set1_pd, _mm512_fmadd_pd
    );
    // Two rows of 16 lanes in the 16 AVX2 registers.
    vector_path!(
        add_rows_avx2, block_256, "avx2,fma", lanes 16, rows [1, 2],
        _mm256_setzero_pd, _mm256_loadu_pd, _mm256_storeu_pd, _mm256_cvtps_pd,
        _mm_loadu_ps, _mm256_set1_pd, _mm256_fmadd_pd
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    /// The sums over `kept`, started from zero.
    fn kept_outputs(kept: &[usize], rows: &[&[f32]], values: ArrayView2<f32>) -> Vec<f64> {
        kept_outputs_from(&vec![0.0; rows.len() * values.ncols()], kept, rows, values)
    }

    /// The sums over `kept`, continued from `start`.
    fn kept_outputs_from(
        start: &[f64],
        kept: &[usize],
        rows: &[&[f32]],
        values: ArrayView2<f32>,
    ) -> Vec<f64> {
        let mut sums = start.to_vec();
        add_kept_outputs(kept, rows, values, &mut sums);
        sums
    }

    #[test]
    fn each_row_sums_its_own_weighted_values_in_kept_order() {
        // Values rows (1, 2), (3, -1), (0.5, 4); kept 2 then 0; row 0 weights (0.1, _, 0.3),
        // row 1 (0.5, _, 0.25): row 0 = 0.3 (0.5, 4) + 0.1 (1, 2) = (0.25, 1.4); row 1 =
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
        // A view that is not contiguous (every other column) takes the same arithmetic.
        let wide = Array2::from_shape_fn(
            (3, 4),
            |(t, c)| if c % 2 == 0 { values[[t, c / 2]] } else { 9.0 },
        );
        let strided = wide.slice(ndarray::s![.., ..;2]);
        assert_eq!(kept_outputs(&[2, 0], &[&h0, &h1], strided), expected);
        // Continuing a sum over the rest of a kept set is the sum over the whole set.
        let head = kept_outputs(&[2], &[&h0, &h1], values.view());
        assert_eq!(
            kept_outputs_from(&head, &[0], &[&h0, &h1], values.view()),
            expected
        );
    }

    /// Values, rows of weights and a kept set out of position order, for `n_rows` rows of `d`
    /// lanes.
    fn case(n_rows: usize, d: usize) -> (Array2<f32>, Vec<Vec<f32>>, Vec<usize>) {
        let t = 50;
        let unit = |i: usize| ((i * 2654435761) % 1000) as f32 / 997.0 - 0.5;
        let values = Array2::from_shape_fn((t, d), |(r, c)| unit(r * d + c) * 3.0);
        let rows = (0..n_rows)
            .map(|h| (0..t).map(|j| unit(7 * j + h).abs() / 10.0).collect())
            .collect();
        let kept = (0..t).rev().step_by(3).chain([1, 4]).collect();
        (values, rows, kept)
    }

    #[test]
    fn every_vector_path_matches_the_portable_sums_bit_for_bit() {
        // 1 to 7 rows (full and partial row blocks), lanes with and without remainders.
        for (n_rows, d) in [(1, 64), (3, 40), (7, 72), (4, 256), (2, 8), (5, 100)] {
            let (values, rows, kept) = case(n_rows, d);
            let rows: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let all = values.as_slice().unwrap();
            let mut portable = vec![0.25f64; n_rows * d];
            let start = portable.clone();
            add_rows_portable(&kept, &rows, all, d, 0, &mut portable);
            assert_eq!(
                kept_outputs_from(&start, &kept, &rows, values.view()),
                portable
            );
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f") {
                    let mut sums = start.clone();
                    // SAFETY: detected just above.
                    unsafe { x86::add_rows_avx512(&kept, &rows, all, d, &mut sums) };
                    assert_eq!(sums, portable, "avx512, {n_rows} rows, d = {d}");
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    let mut sums = start.clone();
                    // SAFETY: detected just above.
                    unsafe { x86::add_rows_avx2(&kept, &rows, all, d, &mut sums) };
                    assert_eq!(sums, portable, "avx2, {n_rows} rows, d = {d}");
                }
            }
        }
    }
}
