//! The nested path: where one cache's one-shot kept sets under several policies are nested (a
//! top-B of one score order at every budget B, as the budgets and allocators of one scorer
//! select), one walk of the largest set in that order measures them all. Its retained mass, top-k
//! recall and span survival come from running sums along the order, read off at each smaller
//! set's size, instead of a sum over every set.
//!
//! Both paths sum masses with [`MassSum`], whose bits do not depend on the order of the terms, so
//! a running sum read off at a set's size is bit for bit the general path's sum over that set;
//! the counts are exact either way. Nestedness is checked on the sets themselves, so a policy
//! whose sets are not nested (or a cache where they are not) is measured on the general path.

use super::mass_sum::MassSum;
use super::DecodeReference;
use crate::replay::{LayerContext, Unit};
use crate::trace::Span;

/// What the kept-set metrics need of one sample: the kept mass, how many of the top-k positions
/// are kept, and per span the kept tokens and their mass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeptShare {
    /// The full-attention mass on the kept positions ([`MassSum`]).
    pub mass: f64,
    /// How many of the largest `top_k` weights' positions are kept.
    pub top_kept: usize,
    /// Per span of the trace: its kept tokens and their full-attention mass.
    pub spans: Vec<(usize, f64)>,
}

/// One member's [`KeptShare`] for every sample of one cache, in (step, head) order.
pub type CacheShares = Vec<KeptShare>;

/// Nested prompt sets, ordered by size: each position's level (the first set that holds it).
struct Nest {
    /// Per position, its level, or `usize::MAX` where no set holds it.
    level: Vec<usize>,
    /// The largest set's positions by level (in position order within a level, as the sets are
    /// sorted).
    order: Vec<usize>,
    /// Per level, the end of its positions in `order`.
    ends: Vec<usize>,
    /// The member (index into the sets given) at each level.
    members: Vec<usize>,
}

impl Nest {
    /// The nest of `sets` (each sorted) over `n_positions` positions, or `None` unless every set
    /// holds every smaller one.
    fn new(sets: &[&[usize]], n_positions: usize) -> Option<Self> {
        let mut members: Vec<usize> = (0..sets.len()).collect();
        members.sort_by_key(|&member| sets[member].len());
        let mut level = vec![usize::MAX; n_positions];
        let (mut order, mut ends) = (Vec::new(), Vec::with_capacity(sets.len()));
        for (rank, &member) in members.iter().enumerate() {
            for &j in sets[member] {
                if level[j] == usize::MAX {
                    level[j] = rank;
                    order.push(j);
                }
            }
            // The union so far is as large as this set only if the set holds it.
            if order.len() != sets[member].len() {
                return None;
            }
            ends.push(order.len());
        }
        Some(Self {
            level,
            order,
            ends,
            members,
        })
    }

    /// Each level's positions in `order`.
    fn levels(&self) -> impl Iterator<Item = &[usize]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .map(|(start, &end)| &self.order[start..end])
    }
}

/// The [`KeptShare`] of every sample of `unit` under each of `sets` (one-shot prompt sets, each
/// sorted, generated positions kept by all), in the order given, or `None` unless the sets are
/// nested. `top_k` is the k of every member's top-k recall.
pub fn nested_shares(
    layer: &LayerContext<'_>,
    unit: &Unit,
    sets: &[&[usize]],
    reference: &DecodeReference,
    spans: &[Span],
    top_k: usize,
) -> Option<Vec<CacheShares>> {
    let nest = Nest::new(sets, layer.n_positions())?;
    let prompt_len = layer.prompt_len;
    let n_steps = layer.n_positions() - prompt_len;
    let mut shares = vec![Vec::with_capacity(n_steps * unit.query_heads.len()); sets.len()];
    let mut sum = MassSum::default();
    let mut by_level = vec![KeptShare::default(); sets.len()];
    let mut top_at = vec![0usize; sets.len()];
    for step in 0..n_steps {
        let position = prompt_len + step;
        let first = layer.first_visible(position);
        let generated = prompt_len.max(first)..=position;
        for head in unit.query_heads.clone() {
            let weights = reference.weights(head, step, position);
            let local = head - reference.heads.start;
            let top = &reference.top[local * n_steps + step];
            // Mass: the generated positions every set keeps, then level by level.
            sum.clear();
            generated.clone().for_each(|j| sum.add(weights[j]));
            for (share, positions) in by_level.iter_mut().zip(nest.levels()) {
                positions
                    .iter()
                    .filter(|&&j| j >= first)
                    .for_each(|&j| sum.add(weights[j]));
                share.mass = sum.total();
            }
            // Top-k: each kept position counts from its level on.
            top_at.fill(0);
            let mut running = 0;
            for &j in top[..top_k.min(top.len())].iter().filter(|&&j| j >= first) {
                if j >= prompt_len {
                    running += 1;
                } else if nest.level[j] != usize::MAX {
                    top_at[nest.level[j]] += 1;
                }
            }
            for (share, &count) in by_level.iter_mut().zip(&top_at) {
                running += count;
                share.top_kept = running;
            }
            span_shares(
                &nest,
                weights,
                spans,
                first..position + 1,
                prompt_len,
                &mut sum,
                &mut by_level,
            );
            for (share, &member) in by_level.iter().zip(&nest.members) {
                shares[member].push(share.clone());
            }
        }
    }
    Some(shares)
}

/// Each level's kept tokens and mass in each span, for a query that sees `visible` (generated
/// positions from `prompt_len` on are kept at every level).
fn span_shares(
    nest: &Nest,
    weights: &[f32],
    spans: &[Span],
    visible: std::ops::Range<usize>,
    prompt_len: usize,
    sum: &mut MassSum,
    by_level: &mut [KeptShare],
) {
    for share in by_level.iter_mut() {
        share.spans.clear();
    }
    for span in spans {
        let seen = span.start.max(visible.start)..span.end.min(visible.end);
        sum.clear();
        let generated = seen.start.max(prompt_len)..seen.end;
        let mut count = generated.len();
        generated.for_each(|j| sum.add(weights[j]));
        for (share, positions) in by_level.iter_mut().zip(nest.levels()) {
            for &j in positions.iter().filter(|j| seen.contains(j)) {
                count += 1;
                sum.add(weights[j]);
            }
            share.spans.push((count, sum.total()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::lost::Dating;
    use super::super::{measure_unit, MeasureSettings, UnitMeasure};
    use super::*;
    use crate::replay::scorer::testing::{global_layer, group_unit, hashed_group};
    use crate::replay::{Timing, UnitKept};
    use proptest::prelude::*;

    /// Every number a measure holds, as bits.
    fn bits(measure: &UnitMeasure) -> Vec<u64> {
        let metrics = measure.metrics.iter().flatten().copied();
        let spans = measure.spans.iter().flat_map(|&(a, b, c)| [a, b, c]);
        let lost = measure.lost.iter().copied();
        let all = metrics.chain(spans).chain(lost).map(f64::to_bits);
        all.chain([measure.kept_total as u64]).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

        /// Top-B sets of one score order at several budgets, on a global or a sliding-window
        /// layer, with spans across the prompt's end and after a query: the nested path gives every number of the
        /// general path's measure, bit for bit.
        #[test]
        fn the_nested_path_measures_as_the_general_path_bit_for_bit(
            heads in 1usize..4,
            prompt_len in 30usize..70,
            steps in 1usize..10,
            window in prop_oneof![Just(0usize), 20usize..40],
            budgets in proptest::collection::vec(1usize..40, 1..5),
            seed in 0usize..1000,
            top_k in 1usize..12,
        ) {
            let (t, d) = (prompt_len + steps, 24);
            let (q, k, v) = hashed_group(heads, t, d);
            let layer = LayerContext { window, ..global_layer(&q, &k, Some(&v), prompt_len) };
            let unit = group_unit(heads);
            let spans = [
                Span { name: "needle".into(), start: prompt_len / 3, end: prompt_len / 2 },
                Span { name: "tail".into(), start: prompt_len - 5, end: t - steps / 2 },
                // After the first queries: they see none of it.
                Span { name: "answer".into(), start: prompt_len + steps / 2, end: t },
            ];
            let prompt: Vec<usize> = layer.prompt_cache().collect();
            let mut order = prompt.clone();
            order.sort_by_key(|&j| (j * 7919 + seed) % 101);
            let sets: Vec<Vec<usize>> = budgets
                .iter()
                .map(|&b| {
                    let mut set = order[..b.min(order.len())].to_vec();
                    set.sort_unstable();
                    set
                })
                .collect();
            let refs: Vec<&[usize]> = sets.iter().map(Vec::as_slice).collect();
            let reference = DecodeReference::new(&layer, 0, 12, &spans, false);
            let settings = MeasureSettings {
                spans: &spans,
                top_k,
                dating: Dating::of(Timing::Prefill),
                storage: crate::replay::Storage::Captured,
                reselects: false,
                width: 2,
            };
            let shares = nested_shares(&layer, &unit, &refs, &reference, &spans, top_k)
                .expect("top-B sets of one order nest");
            for (set, shares) in sets.iter().zip(&shares) {
                let kept = UnitKept::Fixed(set.clone());
                let general = measure_unit(&layer, &unit, &kept, 1, &reference, settings, None);
                let nested =
                    measure_unit(&layer, &unit, &kept, 1, &reference, settings, Some(shares));
                prop_assert_eq!(bits(&general), bits(&nested));
            }
        }
    }

    #[test]
    fn sets_that_are_not_nested_are_refused_and_nested_ones_are_levelled() {
        assert!(Nest::new(&[&[1, 2], &[2, 3, 4]], 6).is_none());
        assert!(Nest::new(&[&[0, 1, 2, 3], &[1, 5]], 6).is_none());
        let nest = Nest::new(&[&[0, 2, 3, 5], &[2], &[2, 5]], 6).unwrap();
        assert_eq!(nest.members, vec![1, 2, 0]);
        assert_eq!(nest.level, vec![2, usize::MAX, 0, 2, usize::MAX, 1]);
        let levels: Vec<&[usize]> = nest.levels().collect();
        assert_eq!(levels, vec![&[2][..], &[5], &[0, 3]]);
        // Equal sets are nested: the second adds nothing.
        let equal = Nest::new(&[&[1, 4], &[1, 4]], 6).unwrap();
        assert_eq!(equal.ends, vec![2, 2]);
    }
}
