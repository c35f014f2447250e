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
        sample.top_kept as f64 / sample.top_k as f64
    }
}
