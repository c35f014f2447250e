//! Turning scores into kept sets. Ties: a selection of the best keeps the lower position
//! (torch.topk leaves the order of equal values unspecified; this is the rule a stable sort
//! gives); a streaming eviction evicts the first minimum, the lower position, as `np.argmin` and
//! `torch.argmin` do in the seed library and in H2O's code.

use super::merge::Eviction;
use super::{Protection, Unit};

/// What one cache keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitKept {
    /// Prefill timing: these prompt positions (sorted); every generated token is kept as well.
    Fixed(Vec<usize>),
    /// One kept set (sorted) per decode step, generated tokens included.
    PerStep(Vec<Vec<usize>>),
    /// As `PerStep`, with the compressions made while decoding, in order: a merge that folds what
    /// they evict needs them.
    Compressing(Vec<Vec<usize>>, Vec<Eviction>),
}

impl UnitKept {
    /// Whether `position` is kept when decode step `step` (position `prompt_len + step`) attends.
    pub fn kept_positions(&self, step: usize, prompt_len: usize) -> Vec<usize> {
        match self {
            UnitKept::Fixed(prompt) => prompt
                .iter()
                .copied()
                .chain(prompt_len..=prompt_len + step)
                .collect(),
            UnitKept::PerStep(steps) | UnitKept::Compressing(steps, _) => steps[step].clone(),
        }
    }

    /// The kept set of every decode step, unless the set is fixed.
    pub fn steps(&self) -> Option<&[Vec<usize>]> {
        match self {
            UnitKept::Fixed(_) => None,
            UnitKept::PerStep(steps) | UnitKept::Compressing(steps, _) => Some(steps),
        }
    }
}

/// Every cache of one layer: its unit, budget and kept sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The allocator's budget for the layer.
    pub layer_budget: usize,
    /// The caches.
    pub units: Vec<Unit>,
    /// The budget each cache had.
    pub budgets: Vec<usize>,
    /// What each kept.
    pub kept: Vec<UnitKept>,
}

/// Orders `positions` for keeping: protected ones first (in position order), then by score,
/// highest first, ties to the lower position.
pub(crate) fn ranking(
    positions: &[usize],
    scores: &[f32],
    is_protected: impl Fn(usize) -> bool,
) -> Vec<usize> {
    ranked_head(positions, scores, positions.len(), is_protected)
}

/// The first `n` of [`ranking`], in its order: a partial selection (linear time) puts them
/// first, and only they are sorted. The order is total (ties go to the lower position), so the
/// result is the ranking's own head.
pub(crate) fn ranked_head(
    positions: &[usize],
    scores: &[f32],
    n: usize,
    is_protected: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let mut keys = first_keys(positions, scores, n, is_protected);
    keys.sort_unstable();
    positions_of(&keys)
}

/// The `budget` positions to keep (sorted): protected ones, then the best scores.
pub(crate) fn select_top(
    positions: &[usize],
    scores: &[f32],
    budget: usize,
    is_protected: impl Fn(usize) -> bool,
) -> Vec<usize> {
    // The partial selection alone: its head need not be ranked, only sorted by position.
    let mut kept = positions_of(&first_keys(positions, scores, budget, is_protected));
    kept.sort_unstable();
    kept
}

/// The [`rank_key`]s of the first `n` of `positions` in the ranking's order, unordered.
fn first_keys(
    positions: &[usize],
    scores: &[f32],
    n: usize,
    is_protected: impl Fn(usize) -> bool,
) -> Vec<u64> {
    let mut keys: Vec<u64> = positions
        .iter()
        .zip(scores)
        .map(|(&position, &score)| rank_key(is_protected(position), score, position))
        .collect();
    let n = n.min(keys.len());
    if n < keys.len() {
        keys.select_nth_unstable(n);
        keys.truncate(n);
    }
    keys
}

/// Bits of a position in a [`rank_key`].
const POSITION_BITS: u32 = 31;

/// A key whose ascending order is the ranking's: protected first, then the higher score (in
/// `f32::total_cmp`'s order), then the lower position. One integer comparison instead of three.
fn rank_key(protected: bool, score: f32, position: usize) -> u64 {
    assert!(
        position < 1 << POSITION_BITS,
        "position {position} beyond a rank key"
    );
    let bits = score.to_bits();
    // Unsigned order = total_cmp order: negatives reversed below the positives.
    let ordered = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    (u64::from(!protected) << 63) | (u64::from(!ordered) << POSITION_BITS) | position as u64
}

/// The positions `keys` carry, in a vector of their length: kept sets are held for a whole layer,
/// so they must not keep the capacity of every candidate (as collecting in place from the keys
/// would).
fn positions_of(keys: &[u64]) -> Vec<usize> {
    let mut positions = Vec::with_capacity(keys.len());
    positions.extend(keys.iter().map(|&key| position_of(key)));
    positions
}

/// The position a [`rank_key`] carries.
fn position_of(key: u64) -> usize {
    (key & ((1 << POSITION_BITS) - 1)) as usize
}

/// The cache entry to evict: the lowest score outside the entries `protect` covers (positions
/// `0..sinks`, the last `window` entries); on ties the first (lowest position) goes, as `argmin`
/// does. `None` when everything is protected. The sinks are positions, not the oldest entries:
/// on a sliding-window layer they slide out like any token.
pub(crate) fn victim(cache: &[usize], scores: &[f32], protect: Protection) -> Option<usize> {
    let end = cache.len().saturating_sub(protect.window);
    let sinks = cache.partition_point(|&position| position < protect.sinks);
    (sinks.min(end)..end).min_by(|&a, &b| {
        scores[a]
            .total_cmp(&scores[b])
            .then_with(|| cache[a].cmp(&cache[b]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn protected_first_then_scores_then_lower_position() {
        let positions = [0, 1, 2, 3, 4];
        let scores = [0.0, 5.0, 1.0, 5.0, 9.0];
        assert_eq!(
            ranking(&positions, &scores, |p| p == 0),
            vec![0, 4, 1, 3, 2]
        );
        assert_eq!(
            select_top(&positions, &scores, 3, |p| p == 0),
            vec![0, 1, 4]
        );
        for n in 0..=6 {
            assert_eq!(
                ranked_head(&positions, &scores, n, |p| p == 0),
                vec![0, 4, 1, 3, 2][..n.min(5)]
            );
        }
    }

    /// A few scores of every kind `total_cmp` orders: signed zeros, infinities, NaNs, ties.
    fn score() -> impl Strategy<Value = f32> {
        prop_oneof![
            any::<f32>(),
            prop::sample::select(vec![
                0.0,
                -0.0,
                1.0,
                -1.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -f32::NAN,
                f32::MIN_POSITIVE,
            ]),
        ]
    }

    proptest! {
        #[test]
        fn rank_keys_order_entries_as_the_ranking_rule_does(
            a in (any::<bool>(), score(), 0usize..1 << 31),
            b in (any::<bool>(), score(), 0usize..1 << 31),
        ) {
            // The rule spelled out: protected first, then the higher score, then the lower position.
            let rule = b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2));
            prop_assert_eq!(rank_key(a.0, a.1, a.2).cmp(&rank_key(b.0, b.1, b.2)), rule);
            prop_assert_eq!(position_of(rank_key(a.0, a.1, a.2)), a.2);
        }
    }

    #[test]
    fn victim_skips_sinks_and_window() {
        let cache = [0, 1, 2, 3, 4];
        let scores = [0.0, 3.0, 2.0, 2.0, 0.0];
        // sinks 1 protects entry 0, window 1 protects entry 4; 2 and 3 tie: the first goes.
        assert_eq!(
            victim(
                &cache,
                &scores,
                Protection {
                    sinks: 1,
                    window: 1
                }
            ),
            Some(2)
        );
        assert_eq!(
            victim(
                &cache,
                &scores,
                Protection {
                    sinks: 3,
                    window: 2
                }
            ),
            None
        );
    }
}
