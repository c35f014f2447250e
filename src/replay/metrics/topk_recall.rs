//! `topk_recall`: the share of the full attention's k largest weights (ties to the lower
//! position) whose positions are kept (Quest, arXiv:2406.10774, reports it as the recall of its
//! page selection).

use super::{Metric, Sample};

/// The share of the top-k positions kept.
pub struct TopkRecall;

impl Metric for TopkRecall {
    fn id(&self) -> &'static str {
        "topk_recall"
    }

    fn title(&self) -> &'static str {
        "top-k recall"
    }

    fn sample(&self, sample: &Sample<'_>) -> f64 {
        let k = sample.top_k.min(sample.top.len());
        sample.top[..k].iter().filter(|&&j| sample.in_set[j]).count() as f64 / k as f64
    }
}
