//! Merging at the compressions made while decoding (CaM): the rule ([`DecodeMerge`]), what one
//! compression evicted as the rule needs it ([`Eviction`]), and the values and running attention
//! of one cache step by step ([`DecodeMergedValues`]).

use crate::splitmix::hash;
use ndarray::{Array2, ArrayView1, ArrayView2};

/// CaM's merge (kvpress 0.5.5 `CAMPress.compress`, `kvpress/presses/cam_press.py` lines 161-218):
/// each merge candidate `m` spreads its value over the `merge_budget` kept positions after it,
/// `n` of them (fewer at the cache's end), `v_t += v_m / n` in f32 (in candidate order, as
/// `scatter_add_` adds), when a uniform draw falls below `clamp(A_m / (Σ A_t / max(n, 1)), 0,
/// 1)` (0/0 is 0, x/0 is 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeMerge {
    /// Kept positions after a candidate that receive its value.
    pub merge_budget: usize,
    /// Seed of the draws.
    pub seed: u64,
}

/// One compression made while decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    /// The position whose arrival triggered it.
    pub position: usize,
    /// The first decode step whose query reads the compressed cache (the step itself evicting
    /// first, the next one attending first).
    pub effective_step: usize,
    /// The evicted positions, highest score first, ties the later position first (kvpress's
    /// flipped stable sort).
    pub ranked: Vec<usize>,
    /// Tokens arrived since the previous compression (kvpress's `layer_step_counts`): how many of
    /// the best-scored evicted entries are merge candidates.
    pub merges: usize,
}

impl Eviction {
    /// The merge candidates, in position order.
    pub fn candidates(&self) -> Vec<usize> {
        let mut candidates = self.ranked[..self.merges.min(self.ranked.len())].to_vec();
        candidates.sort_unstable();
        candidates
    }
}

impl DecodeMerge {
    /// The draw, uniform in [0, 1), for candidate `candidate` of cache `cache` of layer `layer`
    /// at the compression triggered by position `position`: SplitMix64 hashes of them all, so
    /// every draw is the same whatever the order or thread that makes it.
    pub fn draw(&self, layer: usize, cache: usize, position: usize, candidate: usize) -> f64 {
        let stream =
            hash(hash(hash(self.seed ^ ((layer as u64) << 32)) ^ cache as u64) ^ position as u64);
        (hash(stream ^ candidate as u64) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The kept positions after `candidate` that receive its value, given the compressed cache's
    /// `kept` positions (ascending).
    pub fn targets<'k>(&self, kept: &'k [usize], candidate: usize) -> &'k [usize] {
        let start = kept.partition_point(|&j| j <= candidate);
        &kept[start..(start + self.merge_budget).min(kept.len())]
    }

    /// The probability that `candidate` merges into `targets`, from the running attention sums
    /// `attention` (by position).
    pub fn probability(&self, attention: &[f64], candidate: usize, targets: &[usize]) -> f64 {
        let mean = targets.iter().map(|&t| attention[t]).sum::<f64>() / targets.len().max(1) as f64;
        let p = attention[candidate] / mean;
        match p {
            p if p.is_nan() => 0.0,
            p if p.is_infinite() => 1.0,
            p => p.clamp(0.0, 1.0),
        }
    }
}

/// One cache's values and running attention under a [`DecodeMerge`], step by step: replayed
/// over a trace's values, or fed the running model's as they arrive.
#[derive(Debug, Clone)]
pub struct DecodeMergedValues {
    rule: DecodeMerge,
    values: Array2<f32>,
    attention: Vec<f64>,
    evictions: Vec<Eviction>,
    next: usize,
    /// The layer and cache the draws are made for.
    cache: (usize, usize),
}

impl DecodeMergedValues {
    /// The values `values` (`[T, d]`, as captured) of cache `cache` of layer `layer`, whose
    /// compressions while decoding were `evictions` (in order).
    pub fn new(
        rule: DecodeMerge,
        values: ArrayView2<'_, f32>,
        evictions: Vec<Eviction>,
        (layer, cache): (usize, usize),
    ) -> Self {
        Self {
            rule,
            values: values.to_owned(),
            attention: vec![0.0; values.nrows()],
            evictions,
            next: 0,
            cache: (layer, cache),
        }
    }

    /// Sets position `position`'s value as the model wrote it.
    pub fn write(&mut self, position: usize, value: ArrayView1<'_, f32>) {
        self.values.row_mut(position).assign(&value);
    }

    /// Notes compressions made since the last ones, in order.
    pub fn note(&mut self, evictions: impl IntoIterator<Item = Eviction>) {
        self.evictions.extend(evictions);
    }

    /// Folds the compressions that take effect at decode step `step`, whose query reads `held`
    /// (ascending: the compressed cache, and any token that arrived since); returns the positions
    /// whose values changed (ascending).
    pub fn at_step(&mut self, step: usize, held: &[usize]) -> Vec<usize> {
        let mut changed = Vec::new();
        while let Some(eviction) = self.evictions.get(self.next) {
            if eviction.effective_step > step {
                break;
            }
            self.next += 1;
            if eviction.effective_step == step {
                let kept: Vec<usize> = held
                    .iter()
                    .copied()
                    .take_while(|&j| j <= eviction.position)
                    .collect();
                let eviction = eviction.clone();
                changed.extend(self.fold(&eviction, &kept));
            }
        }
        changed.sort_unstable();
        changed.dedup();
        changed
    }

    /// One compression's merges into the kept positions `kept`; the positions that received one.
    fn fold(&mut self, eviction: &Eviction, kept: &[usize]) -> Vec<usize> {
        let (layer, cache) = self.cache;
        let mut changed = Vec::new();
        for candidate in eviction.candidates() {
            let targets = self.rule.targets(kept, candidate);
            let p = self.rule.probability(&self.attention, candidate, targets);
            let draw = self.rule.draw(layer, cache, eviction.position, candidate);
            if targets.is_empty() || draw >= p {
                continue;
            }
            let scale = 1.0f32 / targets.len() as f32;
            let source = self.values.row(candidate).to_owned();
            for &target in targets {
                for (value, &x) in self.values.row_mut(target).iter_mut().zip(&source) {
                    *value += x * scale;
                }
            }
            changed.extend_from_slice(targets);
        }
        changed
    }

    /// Adds one decode step's attention over `held` (`weights`, one per held position, in
    /// order, summing to 1) to the running sums.
    pub fn attend(&mut self, held: &[usize], weights: impl IntoIterator<Item = f64>) {
        for (&j, weight) in held.iter().zip(weights) {
            self.attention[j] += weight;
        }
    }

    /// The values as held, `[T, d]`.
    pub fn values(&self) -> ArrayView2<'_, f32> {
        self.values.view()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand: kept 2, 5, 6, 9 after a compression at position 9 that evicted 1, 3, 4 (ranked
    /// 4, 1, 3), two tokens after the last one, budget 2: candidates 1 and 4. Candidate 1's
    /// targets are 2 and 5 (mean attention (0.2 + 0.4) / 2 = 0.3, its own 0.6: p = 1); candidate
    /// 4's are 5 and 6 (mean 0.3, its own 0.15: p = 0.5). With p = 1 the draw always merges:
    /// v_2 and v_5 each gain v_1 / 2.
    #[test]
    fn a_cam_merge_by_hand() {
        let rule = DecodeMerge {
            merge_budget: 2,
            seed: 7,
        };
        let kept = [2, 5, 6, 9];
        let eviction = Eviction {
            position: 9,
            effective_step: 1,
            ranked: vec![4, 1, 3],
            merges: 2,
        };
        assert_eq!(eviction.candidates(), [1, 4]);
        assert_eq!(rule.targets(&kept, 1), [2, 5]);
        assert_eq!(rule.targets(&kept, 4), [5, 6]);
        assert_eq!(rule.targets(&kept, 9), [] as [usize; 0]);
        let mut attention = vec![0.0; 10];
        for (j, a) in [(1, 0.6), (2, 0.2), (4, 0.15), (5, 0.4), (6, 0.2)] {
            attention[j] = a;
        }
        assert_eq!(rule.probability(&attention, 1, &[2, 5]), 1.0);
        assert!((rule.probability(&attention, 4, &[5, 6]) - 0.5).abs() < 1e-12);
        assert_eq!(rule.probability(&attention, 3, &[]), 0.0, "0/0");
        attention[3] = 0.1;
        assert_eq!(rule.probability(&attention, 3, &[8]), 1.0, "x/0");
        let values = Array2::from_shape_fn((10, 2), |(j, i)| (j * 10 + i) as f32);
        let mut held = DecodeMergedValues::new(rule, values.view(), vec![eviction.clone()], (0, 0));
        held.attend(&[1, 2, 4, 5, 6], [1, 2, 4, 5, 6].map(|j| attention[j]));
        assert!(held.at_step(0, &[1, 2, 3, 4, 5, 6, 9]).is_empty());
        assert_eq!(held.values(), values.view(), "not yet in effect");
        let merged_4 = rule.draw(0, 0, 9, 4) < 0.5;
        let changed = held.at_step(1, &[2, 5, 6, 9, 10]);
        assert_eq!(changed, if merged_4 { vec![2, 5, 6] } else { vec![2, 5] });
        let v = held.values();
        assert_eq!(v.row(2).to_vec(), [20.0 + 5.0, 21.0 + 5.5]);
        let from_4 = if merged_4 { [20.0, 20.5] } else { [0.0, 0.0] };
        assert_eq!(
            v.row(5).to_vec(),
            [50.0 + 5.0 + from_4[0], 51.0 + 5.5 + from_4[1]]
        );
        assert_eq!(v.row(6).to_vec(), [60.0 + from_4[0], 61.0 + from_4[1]]);
        assert_eq!(v.row(9), values.row(9));
        // Draws are uniform: about half of many fall below 1/2.
        let below = (0..10_000).filter(|&c| rule.draw(1, 2, 3, c) < 0.5).count();
        assert!((4_800..5_200).contains(&below), "{below}");
    }
}
