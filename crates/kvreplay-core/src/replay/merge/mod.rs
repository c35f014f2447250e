//! Merging: what becomes of the values a cache evicts. One method per file, the file name is the
//! registry key. Merging is apart from eviction: it folds evicted entries into kept ones
//! (changing what the kept values hold), never which entries are kept, so any allocator, head
//! split and scorer combines with it; it runs at the one cut of the `prefill` timing
//! ([`ValueMerge`]) or at every compression while decoding ([`DecodeMerge`]). Keys stay as
//! captured, so a merged entry attracts the attention its key attracts: retained mass is the
//! kept mass, as without merging, and output error (the cache's own output over the merged
//! values) shows what merging buys. How a cache holds its merged values is [`MergedValues`] and
//! [`DecodeMergedValues`].

mod cache;
mod decoding;

pub use cache::MergedValues;
pub use decoding::{DecodeMerge, DecodeMergedValues, Eviction};

use super::settings::Broken;
use ndarray::{ArrayView1, ArrayView2};

mod cam;
mod none;
mod similarity;

crate::registry! {
    Merge:
    none::NoMerge,
    similarity::Similarity,
    cam::Cam,
}

/// A rule for folding evicted entries into kept ones.
pub trait Merge: Send + Sync {
    /// Rules its settings must follow beyond their types.
    fn check(&self) -> Result<(), Broken> {
        Ok(())
    }
    /// How it merges at the prompt's cut; `None` when evicted entries are dropped there.
    fn merging(&self) -> Option<ValueMerge>;
    /// How it merges at the compressions made while decoding; `None` (the default) when it
    /// does not.
    fn decode_merging(&self) -> Option<DecodeMerge> {
        None
    }
}

/// kvpress's merge-on-evict: each evicted value is folded into the kept entry whose key is most
/// cosine-similar to its own, weighted by that similarity and by the two values' norms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValueMerge {
    /// Least cosine similarity for a merge.
    pub similarity_threshold: f64,
    /// Share of the evicted entries, most similar first, that merge.
    pub merge_fraction: f64,
}

/// kvpress's numerical floor for norms (`_EPS`).
const EPS: f64 = 1e-6;

impl ValueMerge {
    /// The values `values` (`[T, d]`) of the `kept` positions after the `evicted` ones
    /// are folded in, in kept order, as kvpress 0.5.5's `MergingPress.merge` computes them
    /// (`kvpress/presses/merging_press.py` lines 101-175) in f64: keys normalised by
    /// `max(|k|, 1e-6)`; each evicted entry's target the kept key of highest cosine similarity
    /// (the first among equals, as `max` returns); it merges when that similarity is at least the
    /// threshold and, below a fraction of 1, at least the `1 − merge_fraction` quantile of the
    /// merging similarities (linear interpolation, as `torch.quantile`); weight `max(s, 0) ·
    /// |v_e| / (|v_e| + |v_t| + 1e-6)`; a target that received weight `W` and sum `Σ w v_e`
    /// becomes `(v_t + Σ w v_e) / (1 + W)`, the others stay as they were.
    pub fn merged(
        &self,
        keys: ArrayView2<f32>,
        values: ArrayView2<f32>,
        (kept, evicted): (&[usize], &[usize]),
    ) -> Vec<Vec<f32>> {
        let norm =
            |row: ArrayView1<f32>| row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let unit = |row: ArrayView1<f32>| -> Vec<f64> {
            let norm = norm(row).max(EPS);
            row.iter().map(|&x| x as f64 / norm).collect()
        };
        let kept_keys: Vec<Vec<f64>> = kept.iter().map(|&j| unit(keys.row(j))).collect();
        let best: Vec<(f64, usize)> = evicted
            .iter()
            .map(|&e| {
                let key = unit(keys.row(e));
                let mut best = (f64::NEG_INFINITY, 0);
                for (t, kept_key) in kept_keys.iter().enumerate() {
                    let s: f64 = key.iter().zip(kept_key).map(|(a, b)| a * b).sum();
                    if s > best.0 {
                        best = (s, t);
                    }
                }
                best
            })
            .collect();
        let merges = self.gate(&best);
        let d = values.ncols();
        let mut sums = vec![vec![0.0f64; d]; kept.len()];
        let mut weights = vec![0.0f64; kept.len()];
        for ((&e, &(s, t)), merges) in evicted.iter().zip(&best).zip(merges) {
            if !merges || kept.is_empty() {
                continue;
            }
            let (evicted_norm, target_norm) = (norm(values.row(e)), norm(values.row(kept[t])));
            let w = s.max(0.0) * evicted_norm / (evicted_norm + target_norm + EPS);
            for (sum, &x) in sums[t].iter_mut().zip(values.row(e)) {
                *sum += w * x as f64;
            }
            weights[t] += w;
        }
        kept.iter()
            .zip(sums.iter().zip(&weights))
            .map(|(&j, (sum, &w))| match w > 0.0 {
                true => values
                    .row(j)
                    .iter()
                    .zip(sum)
                    .map(|(&v, &s)| ((v as f64 + s) / (1.0 + w)) as f32)
                    .collect(),
                false => values.row(j).to_vec(),
            })
            .collect()
    }

    /// Folds the visible prompt positions `visible` that `kept` (ascending, prompt positions)
    /// leaves out into the kept ones of `values` (`[T, d]`), in place ([`merged`](Self::merged)
    /// over `keys`).
    pub fn merge_into(
        &self,
        keys: ArrayView2<f32>,
        values: &mut ndarray::Array2<f32>,
        (kept, visible): (&[usize], std::ops::Range<usize>),
    ) {
        let evicted: Vec<usize> = visible.filter(|j| kept.binary_search(j).is_err()).collect();
        let merged = self.merged(keys, values.view(), (kept, &evicted));
        for (&j, value) in kept.iter().zip(merged) {
            values.row_mut(j).assign(&ndarray::ArrayView1::from(&value));
        }
    }

    /// Which evicted entries merge, given each one's best similarity: the threshold gate, then,
    /// below a fraction of 1, the quantile gate.
    fn gate(&self, best: &[(f64, usize)]) -> Vec<bool> {
        let mut merges: Vec<bool> = best
            .iter()
            .map(|&(s, _)| s >= self.similarity_threshold)
            .collect();
        if self.merge_fraction < 1.0 && merges.iter().any(|&m| m) {
            let candidates: Vec<f64> = best
                .iter()
                .zip(&merges)
                .map(|(&(s, _), &m)| if m { s } else { f64::NEG_INFINITY })
                .collect();
            let cut = quantile(&candidates, 1.0 - self.merge_fraction);
            for (m, &(s, _)) in merges.iter_mut().zip(best) {
                *m = *m && s >= cut;
            }
        }
        merges
    }
}

/// `torch.quantile(x, q)` with linear interpolation: sorted `x` at `q · (n − 1)`, between its two
/// neighbours by `torch.lerp` (`a + w (b − a)` below a weight of 1/2, `b − (b − a)(1 − w)` from
/// it), so an interval reaching down to −∞ gives NaN or −∞ as there.
fn quantile(x: &[f64], q: f64) -> f64 {
    let mut sorted = x.to_vec();
    sorted.sort_by(f64::total_cmp);
    let position = q * (sorted.len() - 1) as f64;
    let (low, high) = (position.floor() as usize, position.ceil() as usize);
    let (a, b, w) = (sorted[low], sorted[high], position - low as f64);
    match w < 0.5 {
        true => a + w * (b - a),
        false => b - (b - a) * (1.0 - w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_by_hand() {
        // d = 2. Kept 0 (key [1, 0], value [2, 0]) and 1 (key [0, 1], value [0, 4]); evicted 2
        // (key [3, 1]: cosine 3/√10 ≈ 0.949 with key 0, 1/√10 with key 1; value [0, 2]) and 3
        // (key [-1, 0]: cosine −1 and 0, so key 1 at 0; its weight is then 0).
        // Entry 2 into 0: w = 0.9487 · |[0, 2]| / (2 + 2 + 1e-6) = 0.9487 · 2 / 4 ≈ 0.4743;
        // v_0 = ([2, 0] + w [0, 2]) / (1 + w) = [2 / 1.4743, 0.9487 / 1.4743].
        let keys = ndarray::array![[1.0f32, 0.0], [0.0, 1.0], [3.0, 1.0], [-1.0, 0.0]];
        let values = ndarray::array![[2.0f32, 0.0], [0.0, 4.0], [0.0, 2.0], [5.0, 5.0]];
        let (keys, values) = (keys.view(), values.view());
        let merge = ValueMerge {
            similarity_threshold: 0.0,
            merge_fraction: 1.0,
        };
        let merged = merge.merged(keys, values, (&[0, 1], &[2, 3]));
        let s = 3.0 / 10f64.sqrt();
        let w = s * 2.0 / (4.0 + EPS);
        let expected = [(2.0 / (1.0 + w)) as f32, (2.0 * w / (1.0 + w)) as f32];
        assert!((merged[0][0] - expected[0]).abs() < 1e-6, "{merged:?}");
        assert!((merged[0][1] - expected[1]).abs() < 1e-6, "{merged:?}");
        // Entry 3 merges into 1 with weight 0: unchanged.
        assert_eq!(merged[1], [0.0, 4.0]);
        // A threshold above entry 2's similarity merges nothing.
        let strict = ValueMerge {
            similarity_threshold: 0.95,
            ..merge
        };
        assert_eq!(
            strict.merged(keys, values, (&[0, 1], &[2, 3])),
            [vec![2.0, 0.0], vec![0.0, 4.0]]
        );
    }

    #[test]
    fn quantiles_interpolate_as_torch() {
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.5);
        assert_eq!(quantile(&[4.0, 1.0, 3.0], 0.25), 2.0);
        assert!(quantile(&[f64::NEG_INFINITY, 1.0], 0.25).is_nan());
        assert_eq!(quantile(&[f64::NEG_INFINITY, 1.0], 0.75), f64::NEG_INFINITY);
    }
}
