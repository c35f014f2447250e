//! The statistics the reports use: means with Student-t intervals and the sign test (statrs),
//! average ranks, Pearson, Spearman and Kendall's τ-b; the intervals over prompts (the bootstrap
//! among them) live in [`super::intervals`]. Every function is deterministic: a report computed twice from
//! the same runs is byte-identical.

use statrs::distribution::{Binomial, ContinuousCDF, DiscreteCDF, StudentsT};

/// Mean and 95% half-width of a sample (Student t; 0 half-width for fewer than two values).
pub fn mean_ci(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let t = StudentsT::new(0.0, 1.0, n - 1.0)
        .expect("n > 1")
        .inverse_cdf(0.975);
    (mean, t * (variance / n).sqrt())
}

/// Two-sided sign test of paired differences (zeros dropped): p-value under Binomial(n, 1/2).
pub fn sign_test(differences: &[f64]) -> f64 {
    let positive = differences.iter().filter(|d| **d > 0.0).count() as u64;
    let negative = differences.iter().filter(|d| **d < 0.0).count() as u64;
    let n = positive + negative;
    if n == 0 {
        return 1.0;
    }
    let tail = Binomial::new(0.5, n)
        .expect("valid")
        .cdf(positive.min(negative));
    (2.0 * tail).min(1.0)
}

/// The index of the largest of `values`, the first of equal ones; `None` when there are none.
pub fn best_index(values: &[f64]) -> Option<usize> {
    (0..values.len()).max_by(|&a, &b| values[a].total_cmp(&values[b]).then(b.cmp(&a)))
}

/// Average ranks (1-based; ties share the mean of their ranks).
pub fn ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    // Equal values in index order, as a stable sort leaves them: the same order, unstably sorted.
    order.sort_unstable_by(|&a, &b| values[a].total_cmp(&values[b]).then(a.cmp(&b)));
    let mut ranks = vec![0.0; values.len()];
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && values[order[end]] == values[order[start]] {
            end += 1;
        }
        let rank = (start + end + 1) as f64 / 2.0;
        for &index in &order[start..end] {
            ranks[index] = rank;
        }
        start = end;
    }
    ranks
}

fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    if sxx == 0.0 || syy == 0.0 {
        return f64::NAN;
    }
    sxy / (sxx * syy).sqrt()
}

/// Spearman's rank correlation (NaN when either side is constant).
pub fn spearman(x: &[f64], y: &[f64]) -> f64 {
    pearson(&ranks(x), &ranks(y))
}

/// Kendall's τ-b: `(concordant - discordant) / sqrt((n0 - ties_x) (n0 - ties_y))` over all pairs
/// (NaN when either side is constant). Pairs are counted by Knight's sort (Knight 1966, "A
/// computer method for calculating Kendall's tau with ungrouped data", JASA 61(314)), in
/// `O(n log n)`; the counts are the pairwise ones exactly, so the value is too. Values that are
/// not finite are compared pair by pair ([`kendall_pairwise`]).
pub fn kendall(x: &[f64], y: &[f64]) -> f64 {
    if !x.iter().chain(y).all(|v| v.is_finite()) {
        return kendall_pairwise(x, y);
    }
    let n = x.len() as i64;
    let pairs = n * (n - 1) / 2;
    let mut points: Vec<(f64, f64)> = x.iter().copied().zip(y.iter().copied()).collect();
    points.sort_unstable_by(|a, b| finite_cmp(a.0, b.0).then(finite_cmp(a.1, b.1)));
    let ties_x = tied_pairs(&points, |a, b| a.0 == b.0);
    let ties_xy = tied_pairs(&points, |a, b| a.0 == b.0 && a.1 == b.1);
    // In x's order (ties by y), a pair whose y falls is discordant: x rises strictly there.
    let mut ys: Vec<f64> = points.iter().map(|point| point.1).collect();
    let discordant = inversions(&mut ys);
    let ties_y = tied_pairs(&ys, |a, b| a == b);
    let concordant = pairs - ties_x - ties_y + ties_xy - discordant;
    tau_b((concordant, discordant), (pairs, ties_x, ties_y))
}

/// [`kendall`] by comparing every pair: `dx = x_i - x_j` and `dy` alike, a tie where one is 0,
/// concordant where both have one sign.
fn kendall_pairwise(x: &[f64], y: &[f64]) -> f64 {
    let (mut concordant, mut discordant, mut ties_x, mut ties_y, mut pairs) =
        (0i64, 0i64, 0i64, 0i64, 0i64);
    for i in 0..x.len() {
        for j in i + 1..x.len() {
            pairs += 1;
            let (dx, dy) = (x[i] - x[j], y[i] - y[j]);
            if dx == 0.0 {
                ties_x += 1;
            }
            if dy == 0.0 {
                ties_y += 1;
            }
            if dx == 0.0 || dy == 0.0 {
                continue;
            }
            if (dx > 0.0) == (dy > 0.0) {
                concordant += 1;
            } else {
                discordant += 1;
            }
        }
    }
    tau_b((concordant, discordant), (pairs, ties_x, ties_y))
}

fn tau_b((concordant, discordant): (i64, i64), (pairs, ties_x, ties_y): (i64, i64, i64)) -> f64 {
    let denominator = (((pairs - ties_x) * (pairs - ties_y)) as f64).sqrt();
    if denominator == 0.0 {
        return f64::NAN;
    }
    (concordant - discordant) as f64 / denominator
}

/// Finite values' order (-0 equal to 0, as their difference is).
fn finite_cmp(a: f64, b: f64) -> std::cmp::Ordering {
    a.partial_cmp(&b).expect("finite values compare")
}

/// Pairs within the runs of neighbours that `equal` says are equal (`items` sorted so that equal
/// ones are neighbours).
fn tied_pairs<T: Copy>(items: &[T], equal: impl Fn(T, T) -> bool) -> i64 {
    let (mut ties, mut run) = (0i64, 1i64);
    for window in items.windows(2) {
        match equal(window[0], window[1]) {
            true => run += 1,
            false => {
                ties += run * (run - 1) / 2;
                run = 1;
            }
        }
    }
    ties + run * (run - 1) / 2
}

/// Pairs `i < j` with `values[i] > values[j]`, counted by a merge sort that leaves `values`
/// sorted: runs of [`INSERTION_RUN`] sorted by insertion (each step past a larger value one
/// inversion), then merged bottom-up through one scratch buffer.
fn inversions(values: &mut [f64]) -> i64 {
    let mut count = 0i64;
    for run in values.chunks_mut(INSERTION_RUN) {
        for end in 1..run.len() {
            let mut at = end;
            while at > 0 && run[at] < run[at - 1] {
                run.swap(at, at - 1);
                count += 1;
                at -= 1;
            }
        }
    }
    let mut scratch = vec![0.0; values.len()];
    let mut width = INSERTION_RUN;
    while width < values.len() {
        for (pair, out) in values
            .chunks_mut(2 * width)
            .zip(scratch.chunks_mut(2 * width))
        {
            if pair.len() > width {
                count += merge(pair.split_at(width), out);
                pair.copy_from_slice(out);
            }
        }
        width *= 2;
    }
    count
}

/// Values per run that [`inversions`] sorts by insertion before merging.
const INSERTION_RUN: usize = 16;

/// `left` and `right` (each sorted) merged into `out`, ties from `left` first: the pairs with a
/// value of `right` below one of `left`.
fn merge((left, right): (&[f64], &[f64]), out: &mut [f64]) -> i64 {
    let (mut i, mut j, mut count) = (0, 0, 0i64);
    for slot in out.iter_mut() {
        if j < right.len() && (i == left.len() || right[j] < left[i]) {
            // Every value left in `left` is larger than this one.
            count += (left.len() - i) as i64;
            *slot = right[j];
            j += 1;
        } else {
            *slot = left[i];
            i += 1;
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;
    use proptest::prelude::*;

    #[test]
    fn the_best_index_is_the_first_largest() {
        assert_eq!(best_index(&[0.2, 0.7, 0.7, 0.1]), Some(1));
        assert_eq!(best_index(&[]), None);
    }

    #[test]
    fn interval_by_hand() {
        // [1, 2, 3, 4]: mean 2.5, sd 1.290994, t(0.975, 3) = 3.182446 (scipy.stats.t.ppf),
        // half-width = 3.182446 * 1.290994 / 2 = 2.054260.
        let (mean, half) = mean_ci(&[1.0, 2.0, 3.0, 4.0]);
        assert_abs_diff_eq!(mean, 2.5, epsilon = 1e-12);
        assert_abs_diff_eq!(half, 2.054_260, epsilon = 1e-5);
    }

    #[test]
    fn sign_test_by_hand() {
        // 9 positive, 1 negative: p = 2 * P(X <= 1 | n = 10) = 2 * 11/1024 = 0.021484375.
        let mut diffs = vec![1.0; 9];
        diffs.push(-1.0);
        diffs.push(0.0);
        assert_abs_diff_eq!(sign_test(&diffs), 0.021_484_375, epsilon = 1e-12);
        assert_eq!(sign_test(&[0.0, 0.0]), 1.0);
    }

    #[test]
    fn rank_correlations_by_hand() {
        // x = [1, 2, 3], y = [1, 3, 2]: Spearman 1 - 6 * 2 / (3 * 8) = 0.5; Kendall: pairs
        // (1,2) and (1,3) concordant, (2,3) discordant: 1/3.
        assert_abs_diff_eq!(
            spearman(&[1.0, 2.0, 3.0], &[1.0, 3.0, 2.0]),
            0.5,
            epsilon = 1e-12
        );
        assert_abs_diff_eq!(
            kendall(&[1.0, 2.0, 3.0], &[1.0, 3.0, 2.0]),
            1.0 / 3.0,
            epsilon = 1e-12
        );
        // With a tie in x = [1, 2, 2, 3], y = [1, 2, 3, 4]: average ranks [1, 2.5, 2.5, 4];
        // ρ = 4.5 / sqrt(4.5 * 5) = 0.948683; τ-b = 5 / sqrt(5 * 6) = 0.912871.
        let (x, y) = ([1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(ranks(&x), vec![1.0, 2.5, 2.5, 4.0]);
        assert_abs_diff_eq!(spearman(&x, &y), 0.948_683, epsilon = 1e-6);
        assert_abs_diff_eq!(kendall(&x, &y), 0.912_871, epsilon = 1e-6);
        assert!(spearman(&[1.0, 1.0], &[1.0, 2.0]).is_nan());
    }

    proptest! {
        /// Knight's counts are the pairwise ones: the same τ-b to the bit, ties (few distinct
        /// values, -0 beside 0) included, and values that are not finite left to the pairs.
        #[test]
        fn kendall_by_sorting_is_kendall_by_pairs(
            points in proptest::collection::vec((0u8..6, 0u8..6, any::<bool>()), 0..60)
        ) {
            let value = |v: u8, negative: bool| match (v, negative) {
                (0, true) => -0.0,
                (5, true) => f64::NAN,
                (5, false) => f64::INFINITY,
                (v, _) => f64::from(v) * 0.25,
            };
            let x: Vec<f64> = points.iter().map(|&(a, _, s)| value(a, s)).collect();
            let y: Vec<f64> = points.iter().map(|&(_, b, s)| value(b, !s)).collect();
            let finite: Vec<(f64, f64)> = x.iter().zip(&y).map(|(a, b)| (*a, *b))
                .filter(|(a, b)| a.is_finite() && b.is_finite()).collect();
            let (fx, fy): (Vec<f64>, Vec<f64>) = finite.into_iter().unzip();
            for (x, y) in [(&x, &y), (&fx, &fy)] {
                let (sorted, pairwise) = (kendall(x, y), kendall_pairwise(x, y));
                let both_nan = sorted.is_nan() && pairwise.is_nan();
                prop_assert!(
                    sorted.to_bits() == pairwise.to_bits() || both_nan,
                    "{sorted} against {pairwise}"
                );
            }
        }

        /// The merge sort counts every pair out of order, ties not counted, and leaves the values
        /// sorted: lengths within one insertion run and across several levels of merges.
        #[test]
        fn inversions_are_the_pairs_out_of_order(
            values in proptest::collection::vec(0u8..20, 0..200)
        ) {
            let mut values: Vec<f64> = values.into_iter().map(f64::from).collect();
            let by_pairs = (0..values.len())
                .flat_map(|i| (i + 1..values.len()).map(move |j| (i, j)))
                .filter(|&(i, j)| values[i] > values[j])
                .count() as i64;
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            prop_assert_eq!(inversions(&mut values), by_pairs);
            prop_assert_eq!(values, sorted);
        }
    }
}
