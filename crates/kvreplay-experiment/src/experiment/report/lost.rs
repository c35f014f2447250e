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
        .map(Budget::Tokens)
        .unwrap_or(experiment.budgets[experiment.budgets.len() / 2]);
    let of = |name: &String| -> Vec<&StoredRun> {
        trace_names
            .iter()
            .filter_map(|t| find_run(runs, name, budget, t))
            .collect()
    };
    if names.iter().flat_map(of).next().is_none() || runs.iter().any(|r| r.report.lost.is_empty()) {
        return String::new();
    }
    let columns = lost_columns(runs);
    let regions = columns.len() - crate::replay::metrics::lost::WHEN.len();
    let mut headers = vec!["policy".to_string(), "lost".to_string()];
    headers.extend(columns.iter().cloned());
    let mut table = Table::with_headers(headers);
    for name in names {
        let runs = of(name);
        if runs.is_empty() {
            continue;
        }
        let n = runs.len() as f64;
        let means: Vec<f64> = columns
            .iter()
            .map(|column| runs.iter().map(|r| lost_to(r, column)).sum::<f64>() / n)
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

/// The regions of every run (traces of different tasks have different spans), in order of first
/// appearance, then the times.
fn lost_columns(runs: &[StoredRun]) -> Vec<String> {
    let times = crate::replay::metrics::lost::WHEN.len();
    let mut columns: Vec<String> = Vec::new();
    for run in runs {
        for (region, _) in &run.report.lost[..run.report.lost.len() - times] {
            if !columns.contains(region) {
                columns.push(region.clone());
            }
        }
    }
    let last = &runs[0].report.lost;
    columns.extend(
        last[last.len() - times..]
            .iter()
            .map(|(time, _)| time.clone()),
    );
    columns
}

/// The share `run` lost to `column`: 0 for a region its trace does not have.
fn lost_to(run: &StoredRun, column: &str) -> f64 {
    run.report
        .lost
        .iter()
        .find(|(name, _)| name == column)
        .map_or(0.0, |(_, mass)| *mass)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run;
    use crate::replay::metrics::lost::WHEN;

    #[test]
    fn regions_are_the_union_and_a_missing_one_lost_nothing() {
        let with = |regions: &[(&str, f64)]| {
            let mut run = closed_run("p", [0.5, 0.5], None, 0.1);
            run.report.lost = regions
                .iter()
                .map(|&(name, mass)| (name.to_string(), mass))
                .chain(WHEN.iter().map(|when| (when.to_string(), 0.0)))
                .collect();
            run
        };
        let runs = [
            with(&[("sinks", 0.1), ("needle", 0.2), ("rest", 0.3)]),
            with(&[("sinks", 0.1), ("chain", 0.4), ("rest", 0.3)]),
        ];
        let columns = lost_columns(&runs);
        assert_eq!(columns[..4], ["sinks", "needle", "rest", "chain"]);
        assert_eq!(columns.len(), 4 + WHEN.len());
        assert_eq!(lost_to(&runs[1], "needle"), 0.0);
        assert_eq!(lost_to(&runs[1], "chain"), 0.4);
    }
}
