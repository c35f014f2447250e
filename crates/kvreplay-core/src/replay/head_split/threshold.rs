//! `threshold`: each cache keeps the prompt positions whose score is at least a threshold, beside
//! its protected ones, instead of a budget's worth (Dynamic Memory Sparsification's inference rule
//! as kvpress 0.5.5 runs it without trained evictors: `DMSPress`, `kvpress/presses/dms_press.py`
//! lines 99-106, with `decoding = False`: the scorer press scores the prompt, the last
//! `sliding_window_size` positions are kept, and every earlier one scoring below `threshold` is
//! masked, per KV head; Łańcucki et al., 2025, arXiv:2506.05345). So memory follows the content:
//! the report's KV entries say what each run kept. Deliberate deviation: the layer's budget caps
//! each cache (at or above the prompt's length it is DMS exactly), so a threshold policy still
//! fits a sweep's budgets. Its protected window plays DMS's sliding window, and the policy must
//! protect at least one position, or a cache could keep nothing.

use super::HeadSplit;
use crate::replay::allocator::LayerBudget;
use crate::replay::{LayerContext, Protection};

crate::settings! {
    /// DMS's rule: keep the prompt positions scoring at least `threshold` (kvpress `DMSPress`,
    /// arXiv:2506.05345), with the protected window as its sliding window; the budget caps a cache.
    pub struct Threshold = "threshold" {
        /// Positions scoring below it are evicted (`threshold` of kvpress's `DMSPress`); its
        /// scale is the scorer's own (knorm: minus the key's norm).
        threshold: f64 = 0.0,
    }
}

impl HeadSplit for Threshold {
    fn needs_scores(&self) -> bool {
        true
    }

    fn needs_protection(&self) -> bool {
        true
    }

    fn split(
        &self,
        _layer: &LayerContext<'_>,
        budget: LayerBudget,
        scores: &[Vec<f32>],
        candidates: &[usize],
        protect: Protection,
    ) -> Vec<usize> {
        let cap = budget.per_cache();
        let prompt_len = candidates.last().map_or(0, |&last| last + 1);
        scores
            .iter()
            .map(|unit_scores| {
                let (protected, above) = candidates.iter().zip(unit_scores).fold(
                    (0, 0),
                    |(protected, above), (&position, &score)| match protect
                        .covers(position, prompt_len)
                    {
                        true => (protected + 1, above),
                        false => (
                            protected,
                            above + usize::from(score as f64 >= self.threshold),
                        ),
                    },
                );
                (protected + above).min(cap)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_by_hand() {
        // Prompt 6, the last 2 protected. Cache 0 scores 0.5, 0.1, 0.7, 0.3 before the window:
        // 0.5 and 0.7 reach 0.4, so 2 + 2 = 4; cache 1 has none: 2 (the window alone).
        let scores = vec![
            vec![0.5, 0.1, 0.7, 0.3, 0.0, 0.0],
            vec![0.2, 0.1, 0.0, 0.3, 0.9, 0.9],
        ];
        let window = Protection {
            sinks: 0,
            window: 2,
        };
        let (q, k) = (
            ndarray::Array3::zeros((2, 6, 2)),
            ndarray::Array3::zeros((2, 6, 2)),
        );
        let layer = crate::replay::scorer::testing::context(&q, &k, 6);
        let split = |threshold, cap| {
            Threshold { threshold }.split(
                &layer,
                LayerBudget::uniform(cap, 2),
                &scores,
                &[0, 1, 2, 3, 4, 5],
                window,
            )
        };
        assert_eq!(split(0.4, 64), vec![4, 2]);
        // A score equal to the threshold stays (DMS evicts `scores < threshold`).
        assert_eq!(split(0.5, 64), vec![4, 2]);
        // The budget caps each cache.
        assert_eq!(split(0.4, 3), vec![3, 2]);
        // Below every score, everything stays.
        assert_eq!(split(-1.0, 64), vec![6, 6]);
    }
}
