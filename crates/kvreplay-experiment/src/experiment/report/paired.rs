//! Paired comparisons: the mean difference of two policies on the same prompts, its interval over
//! prompts, and a sign test over prompts.

use super::*;
use crate::experiment::intervals::mean_interval;
use crate::experiment::store::prompts_of;

/// The paired comparisons (`[[compare]]`), or nothing.
pub(super) fn paired_section(
    experiment: &Experiment,
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    if experiment.compare.is_empty() {
        return String::new();
    }
    let mut out = "\nPaired comparisons on the same (trace, layer, head, step) positions: mean of a − b (the mean over prompts of each prompt's mean difference) with its 95% Student-t interval over prompts (none over one prompt), the share of positions where a keeps more, and a two-sided sign test over the prompts' mean differences:\n\n".to_string();
    let mut paired = Table::new([
        "a",
        "b",
        "budget",
        "prompts",
        "mean a − b",
        "a > b",
        "sign test p",
    ]);
    for pair in &experiment.compare {
        for &budget in &experiment.budgets {
            // Per trace: its mean difference, and the positions where a keeps more.
            let (mut compared, mut means, mut wins, mut positions) = (Vec::new(), Vec::new(), 0, 0);
            for trace in trace_names {
                if let (Some(a), Some(b)) = (
                    find_run(runs, &pair.a, budget, trace),
                    find_run(runs, &pair.b, budget, trace),
                ) {
                    let differences: Vec<f64> = samples(a)
                        .iter()
                        .zip(samples(b))
                        .map(|(x, y)| x - y)
                        .collect();
                    if differences.is_empty() {
                        continue;
                    }
                    wins += differences.iter().filter(|d| **d > 0.0).count();
                    positions += differences.len();
                    means.push(differences.iter().sum::<f64>() / differences.len() as f64);
                    compared.push(a);
                }
            }
            if compared.is_empty() {
                continue;
            }
            let prompts = prompts_of(compared);
            let interval = mean_interval(&means, &prompts);
            paired.push([
                pair.a.clone(),
                pair.b.clone(),
                budget.to_string(),
                interval.prompts.to_string(),
                signed(&interval),
                format!("{:.1}%", 100.0 * wins as f64 / positions as f64),
                match (prompts.count(), sign_test(&prompts.means(&means))) {
                    (1, _) => "— (1 prompt)".into(),
                    (_, 0.0) => "< 1e-300".into(),
                    (_, p) => format!("{p:.2e}"),
                },
            ]);
        }
    }
    out += &paired.render(Format::Markdown);
    out
}
