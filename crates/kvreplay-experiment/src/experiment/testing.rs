//! Test fixtures: stored closed-loop runs built by hand.

use super::{ClosedLoop, StoredReport, StoredRun};
use crate::replay::RETAINED_MASS;
use std::collections::BTreeMap;

/// A closed-loop run of policy `name` on trace "t" at budget 64 over two layers: open-loop
/// retained mass `open` per layer, live mass `live` per layer (if any), closed-loop KL `kl`.
pub fn closed_run(name: &str, open: [f64; 2], live: Option<[f64; 2]>, kl: f64) -> StoredRun {
    let report = StoredReport {
        nominal_budget: 64,
        settings: BTreeMap::new(),
        metrics: BTreeMap::from([(RETAINED_MASS.to_string(), (open[0] + open[1]) / 2.0)]),
        mean_kept: 64.0,
        layer_budgets: vec![64, 64],
        layer_kept: vec![64.0, 64.0],
        layer_bytes: Vec::new(),
        layer_metrics: BTreeMap::from([(RETAINED_MASS.to_string(), open.to_vec())]),
        samples: BTreeMap::new(),
        spans: Vec::new(),
        kv_entries: None,
        kv_bytes: None,
        lost: Vec::new(),
    };
    StoredRun {
        id: format!("{name}-{kl}"),
        name: name.into(),
        trace: "t".into(),
        trace_sha256: String::new(),
        report,
        closed_loop: Some(ClosedLoop {
            kl,
            top1: 1.0,
            logprob_lost: 0.0,
            answer_ok: true,
            full_answer_ok: true,
            answer_score: Some(1.0),
            full_answer_score: Some(1.0),
            text: String::new(),
            uses_full_run_future: false,
            live_retained_mass: live.map(|l| (l[0] + l[1]) / 2.0),
            live_layers: live.map(|l| l.to_vec()),
        }),
        versions: Default::default(),
    }
}
