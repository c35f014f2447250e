//! What one pass over a trace shares between its policies, worked out from the policies once,
//! before any layer is read: which one-shot policies select from one scoring pass (the same
//! [`ValidPolicy::score_key`]: one scorer's budgets, allocators and head splits), which
//! re-selecting policies share one scorer stream and one ranking per step (a family), which
//! one-shot policies may nest (the nested path of the metrics), and how far the decode reference
//! must rank (the largest top-k). The engine then executes the plan layer by layer.

use super::kept::{is_one_shot, is_whole_layer};
use super::ValidPolicy;
use std::collections::BTreeMap;

/// A pass's shared work, by policy index.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan<'p> {
    /// Per distinct score key of the one-shot policies, in key order, the first policy with it:
    /// its scoring pass serves every policy with that key.
    pub scorers: Vec<(&'p str, usize)>,
    /// The policies that re-select at every decode step one cache at a time, grouped by what
    /// their scores depend on and their timing: a family's scores are computed once for all its
    /// members.
    pub reselecting: Vec<Vec<usize>>,
    /// The one-shot policies whose kept sets may nest (one score key, one top-k), two or more to
    /// a family.
    pub nests: Vec<Vec<usize>>,
    /// The largest top-k of the policies: the decode reference ranks that far.
    pub max_top_k: usize,
    /// Whether the pass has one policy (which then runs its KV groups in parallel).
    pub single: bool,
}

impl<'p> Plan<'p> {
    /// The plan of `policies`.
    pub fn new(policies: &[&'p ValidPolicy]) -> Self {
        Self {
            scorers: scorers(policies),
            reselecting: reselecting(policies),
            nests: nests(policies),
            max_top_k: policies.iter().map(|p| p.params().top_k).max().unwrap_or(1),
            single: policies.len() == 1,
        }
    }
}

fn scorers<'p>(policies: &[&'p ValidPolicy]) -> Vec<(&'p str, usize)> {
    let mut first_with_key: BTreeMap<&'p str, usize> = BTreeMap::new();
    for (index, policy) in policies.iter().enumerate() {
        if is_one_shot(policy) {
            first_with_key.entry(policy.score_key()).or_insert(index);
        }
    }
    first_with_key.into_iter().collect()
}

fn reselecting(policies: &[&ValidPolicy]) -> Vec<Vec<usize>> {
    let mut families: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for (index, policy) in policies.iter().enumerate() {
        let timing = policy.params().timing;
        if timing.reselects() && !is_whole_layer(policy) {
            families
                .entry((policy.score_key(), timing.name()))
                .or_default()
                .push(index);
        }
    }
    families.into_values().collect()
}

fn nests(policies: &[&ValidPolicy]) -> Vec<Vec<usize>> {
    let mut families: BTreeMap<(&str, usize), Vec<usize>> = BTreeMap::new();
    for (index, policy) in policies.iter().enumerate() {
        if is_one_shot(policy) {
            families
                .entry((policy.score_key(), policy.params().top_k))
                .or_default()
                .push(index);
        }
    }
    families.into_values().filter(|f| f.len() > 1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{PolicyParams, Timing};

    fn policy(scorer: &str, timing: Timing, budget: usize) -> ValidPolicy {
        PolicyParams {
            scorer: scorer.into(),
            timing,
            budget,
            ..PolicyParams::default()
        }
        .check()
        .unwrap()
    }

    #[test]
    fn one_scoring_pass_per_key_one_stream_per_family() {
        let policies = [
            policy("snapkv", Timing::Prefill, 64),
            policy("tova", Timing::PerStep, 64),
            policy("snapkv", Timing::Prefill, 128),
            policy("tova", Timing::PerStep, 128),
            policy("recency", Timing::Streaming, 64),
            policy("knorm", Timing::Prefill, 64),
        ];
        let refs: Vec<&ValidPolicy> = policies.iter().collect();
        let plan = Plan::new(&refs);
        // SnapKV's two budgets share one scoring pass; knorm has its own; streaming has none.
        let firsts: Vec<usize> = plan.scorers.iter().map(|(_, index)| *index).collect();
        assert_eq!(plan.scorers.len(), 2, "{:?}", plan.scorers);
        assert!(firsts.contains(&0) && firsts.contains(&5), "{firsts:?}");
        assert_eq!(plan.reselecting, vec![vec![1, 3]]);
        assert_eq!(plan.nests, vec![vec![0, 2]]);
        assert_eq!(plan.max_top_k, 10);
        assert!(!plan.single);
    }
}
