//! A matrix-vector product, each entry summed as ndarray's `keys.dot(&query)` sums it, several
//! rows at a time.
//!
//! ndarray 0.16.1 without BLAS multiplies a matrix by a vector one row at a time
//! (`general_mat_vec_mul_impl`, `linalg/impl_linalg.rs`), each row's `dot` summed by
//! `numeric_util::unrolled_dot`: eight partial sums `p0..p7`, `p_l` taking the terms `l, l + 8,
//! …` as `p_l + x * y` (a product, then a sum, never fused), then `0 + (p0 + p4)`, `+ (p1 + p5)`,
//! `+ (p2 + p6)`, `+ (p3 + p7)`, then the last `len % 8` terms one by one. One row's eight sums
//! form a single chain of vector additions, so a row at a time waits on each addition's latency.
//! [`row_dots`] runs eight rows' chains side by side: every entry the same operations in the
//! same order, so the same bits, at a fraction of the time.

use ndarray::{ArrayView1, ArrayView2};

/// `keys · query`, each entry ndarray's `keys.dot(&query)` entry bit for bit.
pub fn row_dots(keys: ArrayView2<f32>, query: ArrayView1<f32>) -> Vec<f32> {
    let (rows, depth) = keys.dim();
    let [stride, column_stride] = [keys.strides()[0], keys.strides()[1]];
    // Rows of adjacent columns, one after another in memory; any other view goes to ndarray.
    let laid_out = (column_stride == 1 || depth <= 1) && rows > 0 && stride >= depth as isize;
    let (Some(query), true) = (query.as_slice(), laid_out) else {
        return keys.dot(&query).to_vec();
    };
    let stride = stride as usize;
    // SAFETY: the rows are `stride` apart from the view's first element, each `depth` long, and
    // the view holds every one of them.
    let row = |index: usize| unsafe {
        std::slice::from_raw_parts(keys.as_ptr().add(index * stride), depth)
    };
    let mut out = vec![0.0; rows];
    let mut first = 0;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") {
        while first + ROWS <= rows {
            let block = std::array::from_fn(|offset| row(first + offset));
            // SAFETY: `is_x86_feature_detected` found AVX.
            let sums = unsafe { dots_avx(block, query) };
            out[first..first + ROWS].copy_from_slice(&sums);
            first += ROWS;
        }
    }
    for (index, value) in out.iter_mut().enumerate().skip(first) {
        *value = unrolled_dot(row(index), query);
    }
    out
}

/// Rows summed side by side.
const ROWS: usize = 8;

/// ndarray's `unrolled_dot` for `f32`, as written there.
fn unrolled_dot(xs: &[f32], ys: &[f32]) -> f32 {
    let mut p = [0.0f32; 8];
    let whole = xs.len() / 8 * 8;
    for (x, y) in xs[..whole].chunks_exact(8).zip(ys[..whole].chunks_exact(8)) {
        for ((sum, x), y) in p.iter_mut().zip(x).zip(y) {
            *sum += x * y;
        }
    }
    finish(p, &xs[whole..], &ys[whole..])
}

/// The eight partial sums added as `unrolled_dot` adds them, then the terms left over.
fn finish(p: [f32; 8], xs: &[f32], ys: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    sum += p[0] + p[4];
    sum += p[1] + p[5];
    sum += p[2] + p[6];
    sum += p[3] + p[7];
    tail(sum, xs, ys)
}

/// `sum` with the terms left over past the eight lanes added one by one.
#[inline]
fn tail(mut sum: f32, xs: &[f32], ys: &[f32]) -> f32 {
    for (&x, &y) in xs.iter().zip(ys) {
        sum += x * y;
    }
    sum
}

/// [`ROWS`] rows' `unrolled_dot` with `query`, each row's eight partial sums the lanes of one
/// vector (multiplied, then added: no fused multiply-add), the eight rows' partial sums then
/// added together in one transposed pass ([`finish_eight`]).
///
/// # Safety
/// The processor has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn dots_avx(rows: [&[f32]; ROWS], query: &[f32]) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let depth = query.len();
    assert!(rows.iter().all(|row| row.len() == depth));
    let whole = depth / 8 * 8;
    let mut sums = [_mm256_setzero_ps(); ROWS];
    let mut at = 0;
    while at < whole {
        let y = _mm256_loadu_ps(query.as_ptr().add(at));
        for (sum, row) in sums.iter_mut().zip(&rows) {
            let x = _mm256_loadu_ps(row.as_ptr().add(at));
            *sum = _mm256_add_ps(*sum, _mm256_mul_ps(x, y));
        }
        at += 8;
    }
    let heads = finish_eight(sums);
    std::array::from_fn(|index| tail(heads[index], &rows[index][whole..], &query[whole..]))
}

/// Eight vectors' partial sums added as [`finish`] adds them, before the terms left over: lane
/// `i` of `sums[i]`'s `0 + (p0 + p4) + (p1 + p5) + (p2 + p6) + (p3 + p7)`, the eight at once
/// after a transpose that puts every vector's partial sum `p_l` in one vector.
///
/// # Safety
/// The processor has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn finish_eight(sums: [std::arch::x86_64::__m256; 8]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let [a, b, c, d, e, f, g, h] = sums;
    // Pairs of vectors interleaved, then quadruples: `low[l]` holds `p_l` and `p_{l+4}` of the
    // first four vectors, `high[l]` of the last four.
    let quads = |a, b, c, d| {
        let (ab_low, ab_high) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        let (cd_low, cd_high) = (_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
        [
            _mm256_shuffle_ps::<0x44>(ab_low, cd_low),
            _mm256_shuffle_ps::<0xee>(ab_low, cd_low),
            _mm256_shuffle_ps::<0x44>(ab_high, cd_high),
            _mm256_shuffle_ps::<0xee>(ab_high, cd_high),
        ]
    };
    let (low, high) = (quads(a, b, c, d), quads(e, f, g, h));
    let p = |l: usize| _mm256_permute2f128_ps::<0x20>(low[l], high[l]);
    let p_plus_four = |l: usize| _mm256_permute2f128_ps::<0x31>(low[l], high[l]);
    let mut sum = _mm256_setzero_ps();
    for l in 0..4 {
        sum = _mm256_add_ps(sum, _mm256_add_ps(p(l), p_plus_four(l)));
    }
    let mut out = [0.0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), sum);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{s, Array1, Array2};

    /// Values in (-3, 3), seeded.
    fn varied(rows: usize, depth: usize, seed: u64) -> Array2<f32> {
        let mut state = seed;
        Array2::from_shape_fn((rows, depth), |_| {
            let unit = (crate::splitmix::next(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
            (unit * 2.0 - 1.0) * 3.0
        })
    }

    #[test]
    fn every_entry_is_ndarrays_dot_bit_for_bit() {
        // Depths with and without a remainder past the eight lanes, row counts around the
        // eight rows summed side by side, a view of every other row, and rows that sum to
        // values of very different sizes.
        for (rows, depth) in [
            (0, 8),
            (1, 64),
            (7, 64),
            (8, 64),
            (19, 64),
            (17, 5),
            (33, 256),
            (9, 70),
        ] {
            let keys = varied(rows, depth, rows as u64 * 31 + depth as u64);
            let query = Array1::from_iter(varied(1, depth, 7).iter().map(|v| v * 1e-3));
            let want = keys.dot(&query).to_vec();
            let got = row_dots(keys.view(), query.view());
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{rows} x {depth}"
            );
            let every_other = keys.slice(s![..;2, ..]);
            let want = every_other.dot(&query).to_vec();
            let got = row_dots(every_other, query.view());
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "every other of {rows}"
            );
        }
    }

    #[test]
    fn a_view_whose_columns_are_not_adjacent_is_multiplied_by_ndarray() {
        let keys = varied(12, 16, 3);
        let query = Array1::from_iter((0..12).map(|v| v as f32 - 5.5));
        let transposed = keys.t();
        let want = transposed.dot(&query).to_vec();
        assert_eq!(row_dots(transposed, query.view()), want);
    }
}
