//! Where the lost attention went: by region and by when it left the cache.

use super::*;

/// Where the lost mass went at the heatmap budget (else the middle budget): per policy, the mean
/// over traces of each region's and each time's share of the attention not kept. Empty when a run
/// was stored before it was measured.
pub(super) fn lost_section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    let budget = experiment
        .heatmap_budget
        .unwrap_or(experiment.budgets[experiment.budgets.len() / 2]);
    let of = |name: &String| -> Vec<&StoredRun> {
        trace_names
            .iter()
            .filter_map(|t| find_run(runs, name, budget, t))
            .collect()
    };
    let Some(first) = names.iter().flat_map(of).next() else {
        return String::new();
    };
    if runs.iter().any(|r| r.report.lost.is_empty()) {
        return String::new();
    }
    let mut headers = vec!["policy".to_string(), "lost".to_string()];
    headers.extend(first.report.lost.iter().map(|(name, _)| name.clone()));
    let mut table = Table::with_headers(headers);
    let regions = first.report.lost.len() - crate::replay::metrics::lost::WHEN.len();
    for name in names {
        let runs = of(name);
        if runs.is_empty() {
            continue;
        }
        let n = runs.len() as f64;
        let means: Vec<f64> = (0..first.report.lost.len())
            .map(|index| runs.iter().map(|r| r.report.lost[index].1).sum::<f64>() / n)
            .collect();
        let mut row = vec![
            name.clone(),
            format!("{:.4}", means[..regions].iter().sum::<f64>()),
        ];
        row.extend(means.iter().map(|m| format!("{m:.4}")));
        table.push(row);
    }
    format!(
        "\nWhere the lost mass went at budget {budget} (mean over traces, layers, heads and steps of the share of the full attention not kept), by region — the first 4 positions, each span, the 32 positions up to the query, the rest — and by when it left the cache:\n\n{}",
        table.render(Format::Markdown)
    )
}
