//! An order-independent sum of f32 attention weights: the same bits whatever order the weights
//! arrive in, so that a kept set's mass summed over the set (the general path) and read off a
//! running sum along a score order (the nested path, [`super::nested`]) agree exactly.
//!
//! Each weight goes to the bucket of its f32 exponent, an f64 sum. Every f32 of exponent field
//! `e` is a multiple of `2^(e - 150)` (of `2^-149` for `e` 0 and 1) below `2^(e - 126)`, so a
//! bucket's sum is a multiple of that step below `2^29` times `2^(e - 126)`: it needs at most 53
//! significant bits, and f64 holds it exactly for up to `2^29` weights. The bucket sums are
//! therefore exact (the same whatever the order), and the total adds them in one fixed order,
//! smallest exponent first. It differs from the exact sum by the rounding of that last addition
//! of at most a few dozen bucket sums: closer to it than a plain f64 sum of the weights.

/// One bucket per f32 exponent field.
const BUCKETS: usize = 256;

/// A running order-independent sum of f32 weights.
#[derive(Debug, Clone)]
pub struct MassSum {
    buckets: [f64; BUCKETS],
    /// The lowest and highest bucket holding a term (`low > high` when empty), so that the total
    /// and a reset walk only that range.
    low: usize,
    high: usize,
}

impl Default for MassSum {
    fn default() -> Self {
        Self {
            buckets: [0.0; BUCKETS],
            low: BUCKETS,
            high: 0,
        }
    }
}

impl MassSum {
    /// Adds one weight.
    #[inline]
    pub fn add(&mut self, weight: f32) {
        let bucket = ((weight.to_bits() >> 23) & 0xff) as usize;
        self.buckets[bucket] += weight as f64;
        self.low = self.low.min(bucket);
        self.high = self.high.max(bucket);
    }

    /// The sum: the bucket sums added smallest exponent first (0 when empty; an empty bucket in
    /// between adds 0, which leaves the total's bits as they are).
    pub fn total(&self) -> f64 {
        let used = self.buckets.get(self.low..=self.high).unwrap_or(&[]);
        used.iter().fold(0.0, |total, &bucket| total + bucket)
    }

    /// Empties the sum.
    pub fn clear(&mut self) {
        if let Some(used) = self.buckets.get_mut(self.low..=self.high) {
            used.fill(0.0);
        }
        (self.low, self.high) = (BUCKETS, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The sum of `weights[j]` over `positions`, in their order.
    fn mass_of(weights: &[f32], positions: impl IntoIterator<Item = usize>) -> f64 {
        let mut sum = MassSum::default();
        for j in positions {
            sum.add(weights[j]);
        }
        sum.total()
    }

    /// The exact sum of weights in `[2^-92, 1)`, in fixed point: each is an integer multiple of
    /// `2^-115` below `2^115`, and 400 of them stay below `2^128`.
    fn exact(weights: &[f32]) -> f64 {
        let scaled: u128 = weights
            .iter()
            .map(|&w| {
                let bits = w.to_bits();
                let exponent = ((bits >> 23) & 0xff) as i32;
                let mantissa = (bits & 0x7f_ffff) as u128 | 1 << 23;
                // w = mantissa * 2^(exponent - 150) = (mantissa << (exponent - 35)) * 2^-115.
                mantissa << (exponent - 35)
            })
            .sum();
        // u128 to f64 rounds to nearest; the power of two is exact.
        scaled as f64 * 2f64.powi(-115)
    }

    /// A weight in `[2^-92, 1)`, log-uniform, from a seed.
    fn weight(seed: u64) -> f32 {
        let unit = (seed >> 11) as f64 / (1u64 << 53) as f64;
        (2f64.powf(-92.0 * unit) as f32).min(1.0 - f32::EPSILON / 2.0)
    }

    proptest! {
        #[test]
        fn any_order_gives_the_same_bits(
            seeds in proptest::collection::vec(any::<u64>(), 0..400),
            rotation in 0usize..400,
        ) {
            let weights: Vec<f32> = seeds.iter().map(|&s| weight(s)).collect();
            let forward = mass_of(&weights, 0..weights.len());
            let backward = mass_of(&weights, (0..weights.len()).rev());
            let n = weights.len().max(1);
            let rotated = mass_of(&weights, (0..weights.len()).map(|j| (j + rotation) % n));
            prop_assert_eq!(forward.to_bits(), backward.to_bits());
            prop_assert_eq!(forward.to_bits(), rotated.to_bits());
        }

        #[test]
        fn the_sum_is_within_a_rounding_per_bucket_of_the_exact_sum(
            seeds in proptest::collection::vec(any::<u64>(), 1..400),
        ) {
            let weights: Vec<f32> = seeds.iter().map(|&s| weight(s)).collect();
            let (sum, exact) = (mass_of(&weights, 0..weights.len()), exact(&weights));
            // At most one rounding of the running total per bucket added (93 exponents).
            let bound = 93.0 * f64::EPSILON / 2.0 * exact;
            prop_assert!((sum - exact).abs() <= bound, "{} against {}", sum, exact);
        }
    }

    #[test]
    fn a_cleared_sum_starts_again_and_small_cases_are_hand_computed() {
        let mut sum = MassSum::default();
        for w in [0.5f32, 0.25, 0.125, 1.0, f32::from_bits(1)] {
            sum.add(w);
        }
        // The subnormal weight is added first and lost in rounding, as in the exact sum's f64.
        assert_eq!(sum.total(), 1.875);
        sum.clear();
        assert_eq!(sum.total(), 0.0);
        sum.add(0.1);
        assert_eq!(sum.total(), 0.1f32 as f64);
        // Sixteen equal weights and their f64 sum: a power of two times the weight, exact.
        let mut many = MassSum::default();
        (0..16).for_each(|_| many.add(0.3));
        assert_eq!(many.total(), 16.0 * 0.3f32 as f64);
    }
}
