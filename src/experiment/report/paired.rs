//! Paired comparisons: the mean difference of two policies on the same samples, its interval, and a sign test.

use super::*;

/// The paired comparisons (`[[compare]]`), or nothing.
pub(super) fn paired_section(
    experiment: &Experiment,
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    if experiment.compare.is_empty() {
        return String::new();
    }
    let mut out = "\nPaired comparisons on the same (trace, layer, head, step) positions: mean of a − b with its 95% CI, the share of positions where a keeps more, and a two-sided sign test:\n\n".to_string();
    let mut paired = Table::new(["a", "b", "budget", "mean a − b", "a > b", "sign test p"]);
    for pair in &experiment.compare {
        for &budget in &experiment.budgets {
            let mut differences = Vec::new();
            for trace in trace_names {
                if let (Some(a), Some(b)) = (
                    find_run(runs, &pair.a, budget, trace),
                    find_run(runs, &pair.b, budget, trace),
                ) {
                    differences.extend(samples(a).iter().zip(samples(b)).map(|(x, y)| x - y));
                }
            }
            if differences.is_empty() {
                continue;
            }
            let (mean, half) = mean_ci(&differences);
            let wins =
                differences.iter().filter(|d| **d > 0.0).count() as f64 / differences.len() as f64;
            paired.push([
                pair.a.clone(),
                pair.b.clone(),
                budget.to_string(),
                format!("{mean:+.4} ± {half:.4}"),
                format!("{:.1}%", 100.0 * wins),
                match sign_test(&differences) {
                    0.0 => "< 1e-300".into(),
                    p => format!("{p:.2e}"),
                },
            ]);
        }
    }
    out += &paired.render(Format::Markdown);
    out
}
