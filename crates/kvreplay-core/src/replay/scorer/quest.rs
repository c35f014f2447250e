//! `quest`: Quest's query-aware page selection (Tang et al., ICML 2024, arXiv:2406.10774;
//! github.com/mit-han-lab/Quest, commit 01c1623, `evaluation/quest_attention.py` lines 140-215).
//! The cache is cut into pages of `page_size` positions from position 0; a page's score for the
//! current query is the upper bound of its keys' logits, `Σ_i max(q_i · max_i, q_i · min_i)` over
//! the channel-wise maximum and minimum of its keys (the code's `sign`-flipped `amax`), and every
//! token of a page scores its page's bound. Nothing is evicted: run it under the `per-step` timing
//! (the `quest` preset), where each decode query reads the best pages of the whole cache — dynamic
//! sparse attention, not eviction. The code selects per query head (`gqa = "query-head"`); a cache
//! of several heads aggregates their bounds with `agg`.
//!
//! Deviations: Quest reads `min(max(3, budget // page_size), pages)` whole pages, a shorter last
//! page included, and leaves layers 0 and 1 dense; kvreplay reads exactly the budget in every
//! layer, so after the best whole pages it reads the first positions of the next (equal scores go
//! to the lower position). With a budget that is a multiple of `page_size`, at least three pages,
//! and the shorter last page not among the best, the two read the same tokens.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{Aggregation, LayerContext, Protection, Unit};
use std::ops::Range;

crate::settings! {
    /// Quest: pages of keys ranked by the upper bound of the current query's logits (Tang et al.,
    /// 2024, arXiv:2406.10774); dynamic sparse attention under the `per-step` timing.
    pub struct Quest = "quest" {
        /// Positions per page (`chunk_size`, 16 in Quest).
        page_size: usize = 16,
        /// How a cache of several query heads combines their page bounds: `mean`, `max` or `sum`.
        agg: Aggregation = Aggregation::Mean,
    }
}

#[derive(Clone)]
struct State {
    heads: Range<usize>,
    kv_head: usize,
    page_size: usize,
    agg: Aggregation,
    /// Each page's cached positions and their keys' channel-wise `(minimum, maximum)` at the
    /// last step, in page order: a page whose entries are unchanged keeps them (a cached
    /// position's key never changes).
    extremes: Vec<PageExtremes>,
}

/// A page's cached positions and its keys' channel-wise `(minimum, maximum)`.
type PageExtremes = (Vec<usize>, Vec<(f32, f32)>);

impl Scorer for Quest {
    fn check(&self) -> Result<(), Broken> {
        if self.page_size == 0 {
            return Err(Broken {
                key: "page_size",
                rule: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            heads: unit.query_heads.clone(),
            kv_head: unit.kv_head,
            page_size: self.page_size,
            agg: self.agg,
            extremes: Vec::new(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        let keys = layer.keys(self.kv_head);
        let d = keys.ncols();
        // The cached entries of each page (consecutive in the cache, whose positions ascend).
        let mut pages: Vec<Range<usize>> = Vec::new();
        for (index, &position) in cache.iter().enumerate() {
            match pages.last_mut() {
                Some(page) if cache[page.start] / self.page_size == position / self.page_size => {
                    page.end = index + 1
                }
                _ => pages.push(index..index + 1),
            }
        }
        // Each page's channel-wise minimum and maximum, once for all heads: `[page][channel]`,
        // each channel folded over the page's keys in order, a key's row at a time; the last
        // step's where the page holds the same entries.
        let mut last = std::mem::take(&mut self.extremes).into_iter();
        for page in &pages {
            let positions = &cache[page.clone()];
            let extremes = match last.next() {
                Some(kept) if kept.0 == positions => kept,
                _ => {
                    let mut extremes = vec![(f32::INFINITY, f32::NEG_INFINITY); d];
                    for &position in positions {
                        for (extreme, &k) in extremes.iter_mut().zip(keys.row(position)) {
                            *extreme = (extreme.0.min(k), extreme.1.max(k));
                        }
                    }
                    (positions.to_vec(), extremes)
                }
            };
            self.extremes.push(extremes);
        }
        let mut bounds = vec![0.0f32; pages.len()];
        for (count, head) in self.heads.clone().enumerate() {
            let query = layer.query(head, newest);
            for (acc, (_, page)) in bounds.iter_mut().zip(&self.extremes) {
                let bound: f32 = page
                    .iter()
                    .zip(query.iter())
                    .map(|(&(low, high), &q)| (q * high).max(q * low))
                    .sum();
                *acc = match (count, self.agg) {
                    (0, _) => bound,
                    (_, Aggregation::Max) => acc.max(bound),
                    _ => *acc + bound,
                };
            }
        }
        if self.agg == Aggregation::Mean {
            let n = self.heads.len() as f32;
            bounds.iter_mut().for_each(|b| *b /= n);
        }
        out.clear();
        for (page, &bound) in pages.iter().zip(&bounds) {
            out.extend(std::iter::repeat_n(bound, page.len()));
        }
        Ok(())
    }
}

/// The brute-force rule: per page of cached positions (position / `page_size`) and query head,
/// the sum over channels of the largest `q_c k_c` among the page's keys, the heads combined by
/// `agg`; every position scores its page's bound.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for Quest {
    fn fixture(&self, _seed: u64) -> Vec<(&'static str, serde_json::Value)> {
        vec![("page_size", 3.into())]
    }

    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let at = *positions.last().expect("a cache");
        let bound = |head: usize, page: &[usize]| -> f64 {
            let q = layer.query(head, at);
            (0..q.len())
                .map(|c| {
                    page.iter()
                        .map(|&j| q[c] * layer.key(cache.kv, j)[c])
                        .fold(f64::NEG_INFINITY, f64::max)
                })
                .sum()
        };
        positions
            .iter()
            .map(|&j| {
                let page: Vec<usize> = positions
                    .iter()
                    .copied()
                    .filter(|&p| p / self.page_size == j / self.page_size)
                    .collect();
                let per_head: Vec<f64> = cache.heads.iter().map(|&h| bound(h, &page)).collect();
                reference::combine(self.agg, &per_head)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn a_page_scores_the_upper_bound_of_its_logits() {
        // Pages of 2: keys (1, -1), (3, 2) | (0, 5), (-2, 1) | (4, 0). The newest query (1, -2):
        // page 0: max(1·3, 1·1) + max(-2·2, -2·-1) = 3 + 2 = 5; page 1: max(0, -2) + max(-10, -2)
        // = 0 - 2 = -2; page 2 (one key): 4 + 0 = 4.
        let (q, k, n) = layer_with(
            &[[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, -2.0]],
            &[[1.0, -1.0], [3.0, 2.0], [0.0, 5.0], [-2.0, 1.0], [4.0, 0.0]],
            5,
        );
        let layer = context(&q, &k, n);
        let mut state = Quest {
            page_size: 2,
            agg: Aggregation::Mean,
        }
        .start(&layer, &unit(), Protection::default())
        .unwrap();
        assert_eq!(
            scores_after(state.as_mut(), &layer, 5),
            vec![5.0, 5.0, -2.0, -2.0, 4.0]
        );
        // A sparse cache: pages hold only their cached entries.
        let mut out = Vec::new();
        state.scores(&layer, &[1, 2, 4], &mut out).unwrap();
        // Page 0 = {(3, 2)}: 3 - 4 = -1; page 1 = {(0, 5)}: 0 - 10 = -10; page 2: 4.
        assert_eq!(out, vec![-1.0, -10.0, 4.0]);
    }
}
