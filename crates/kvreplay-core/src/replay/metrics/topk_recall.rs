//! `topk_recall`: the share of the full attention's k largest weights (ties to the lower
//! position) whose positions are kept (Quest, arXiv:2406.10774, reports it as the recall of its
//! page selection).

use super::{Metric, Sample};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference;

/// The share of the top-k positions kept.
pub struct TopkRecall;

impl Metric for TopkRecall {
    fn id(&self) -> &'static str {
        "topk_recall"
    }

    fn title(&self) -> &'static str {
        "top-k recall"
    }

    fn about(&self) -> &'static str {
        "The share of the query's k most attended positions (k = the policy's `top_k`, default 10; ties to the lower position) that the cache keeps."
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self, sample: &reference::Sample<'_>) -> Option<f64> {
        Some({
            let p = sample.weights();
            let mut order: Vec<usize> = (0..p.len()).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let k = sample.top_k.min(order.len());
            let kept = order[..k]
                .iter()
                .filter(|j| sample.kept().contains(j))
                .count();
            kept as f64 / k as f64
        })
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        sample.top_kept as f64 / sample.top_k as f64
    }
}
