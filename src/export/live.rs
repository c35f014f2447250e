//! The table of `kvreplay live`: closed-loop outcomes beside the open-loop metrics of the same
//! policy on the same run.

use super::{Format, Table};
use crate::live::LiveReport;

/// One row: the policy, its open-loop metrics and its closed-loop outcomes; then the texts.
pub fn live_table(report: &LiveReport, format: Format) -> String {
    let open = &report.open_loop;
    let mut table = Table::new([
        "policy",
        "budget",
        "mean kept",
        "retained mass (open loop)",
        "top-k recall (open loop)",
        "KL full‖policy",
        "top-1 agreement",
        "logprob lost",
        "answer ok",
    ]);
    table.push([
        report.policy.clone(),
        open.nominal_budget.to_string(),
        format!("{:.1}", open.mean_kept),
        format!("{:.4}", open.retained_mass),
        format!("{:.4}", open.topk_recall),
        format!("{:.4}", report.kl),
        format!("{:.4}", report.top1),
        format!("{:.4}", report.logprob_lost),
        format!(
            "{} (full cache: {})",
            report.answer_ok, report.full_answer_ok
        ),
    ]);
    let mut out = table.render(format);
    if format == Format::Markdown {
        out += &format!(
            "\nTeacher-forced along the full-cache continuation, {} steps (means over steps; the \
             first token comes from the shared prefill). Free-running greedy text under the \
             policy: {:?}\nFull cache: {:?}\n",
            report.steps.len(),
            report.text,
            report.full_text
        );
        if report.uses_full_run_future {
            out += "The kept sets read the full-cache run's future queries (an oracle).\n";
        }
    }
    out
}
