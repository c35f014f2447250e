//! Turning scores into kept sets. Ties: a selection of the best keeps the lower position
//! (torch.topk leaves the order of equal values unspecified; this is the rule a stable sort
//! gives); a streaming eviction evicts the first minimum, the lower position, as `np.argmin` and
//! `torch.argmin` do in the seed library and in H2O's code.

use super::{Protection, Unit};

/// What one cache keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitKept {
    /// Prefill timing: these prompt positions (sorted); every generated token is kept as well.
    Fixed(Vec<usize>),
    /// One kept set (sorted) per decode step, generated tokens included.
    PerStep(Vec<Vec<usize>>),
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
            UnitKept::PerStep(steps) => steps[step].clone(),
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
    let keep_first = keep_first(positions, scores, is_protected);
    let mut order = first_indices(positions, n, &keep_first);
    order.sort_unstable_by(&keep_first);
    order.into_iter().map(|index| positions[index]).collect()
}

/// The ranking's order on indices into `positions`: protected first, then the higher score, then
/// the lower position.
fn keep_first<'a>(
    positions: &'a [usize],
    scores: &'a [f32],
    is_protected: impl Fn(usize) -> bool + 'a,
) -> impl Fn(&usize, &usize) -> std::cmp::Ordering + 'a {
    move |&a: &usize, &b: &usize| {
        let (pa, pb) = (positions[a], positions[b]);
        is_protected(pb)
            .cmp(&is_protected(pa))
            .then_with(|| scores[b].total_cmp(&scores[a]))
            .then_with(|| pa.cmp(&pb))
    }
}

/// The indices of the first `n` of `positions` under `keep_first`, unordered.
fn first_indices(
    positions: &[usize],
    n: usize,
    keep_first: impl FnMut(&usize, &usize) -> std::cmp::Ordering,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..positions.len()).collect();
    let n = n.min(order.len());
    if n < order.len() {
        order.select_nth_unstable_by(n, keep_first);
        order.truncate(n);
    }
    order
}

/// The `budget` positions to keep (sorted): protected ones, then the best scores.
pub(crate) fn select_top(
    positions: &[usize],
    scores: &[f32],
    budget: usize,
    is_protected: impl Fn(usize) -> bool,
) -> Vec<usize> {
    // The partial selection alone: its head need not be ranked, only sorted by position.
    let keep_first = keep_first(positions, scores, is_protected);
    let mut kept: Vec<usize> = first_indices(positions, budget, &keep_first)
        .into_iter()
        .map(|index| positions[index])
        .collect();
    kept.sort_unstable();
    kept
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
