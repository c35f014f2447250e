//! The ranking section of a report (`ranking = [...]`, `ceiling = "..."` in the experiment file):
//! per metric, the policies ordered by its mean over budgets (each budget's figure the mean over
//! the part's traces), every budget's figure beside it, and, when a ceiling policy is named, each
//! figure as a share of the ceiling's at the same budget. With two or more metrics, Kendall's τ-b
//! between the first two orders says whether the metrics rank the methods alike, and the largest
//! rank moves are named.

use super::stats::{kendall, mean_ci};
use super::store::{find_run, StoredRun};
use super::{Budget, Experiment};
use crate::export::{Format, Table};
use crate::replay::metrics::REGISTRY;

/// One policy's figures for one metric: per budget the mean over traces (`None` without runs).
struct Standing {
    name: String,
    per_budget: Vec<Option<f64>>,
}

impl Standing {
    /// The mean over the budgets that have runs.
    fn mean(&self) -> f64 {
        let present: Vec<f64> = self.per_budget.iter().flatten().copied().collect();
        mean_ci(&present).0
    }
}

/// The ranking tables, or nothing when the experiment asks for none.
pub(super) fn section(
    experiment: &Experiment,
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    if experiment.ranking.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let mut orders: Vec<(String, Vec<String>)> = Vec::new();
    for id in &experiment.ranking {
        let metric = REGISTRY.iter().find(|metric| metric.id() == id);
        let title = metric.map_or(id.as_str(), |metric| metric.title());
        let lower_first = metric.is_some_and(|metric| metric.lower_is_better());
        let standings = standings(experiment, runs, trace_names, id);
        let (ceiling, mut ranked): (Vec<Standing>, Vec<Standing>) = standings
            .into_iter()
            .partition(|s| Some(&s.name) == experiment.ceiling.as_ref());
        ranked.retain(|s| s.per_budget.iter().any(Option::is_some));
        ranked.sort_by(|a, b| {
            let order = match lower_first {
                true => a.mean().total_cmp(&b.mean()),
                false => b.mean().total_cmp(&a.mean()),
            };
            order.then(a.name.cmp(&b.name))
        });
        let first = match lower_first {
            true => "lowest",
            false => "highest",
        };
        out += &format!(
            "\nRanking by {title} (mean over the traces at each budget; ranked by the mean over budgets, {first} first{}):\n\n",
            match &experiment.ceiling {
                Some(name) => format!(
                    "; in brackets, the share of the ceiling `{name}` at the same budget, and its mean over budgets in the last column"
                ),
                None => String::new(),
            }
        );
        out += &table(experiment, &ranked, ceiling.first()).render(Format::Markdown);
        orders.push((
            title.to_owned(),
            ranked.into_iter().map(|s| s.name).collect(),
        ));
    }
    if let [(first, a), (second, b), ..] = orders.as_slice() {
        out += &agreement(first, a, second, b);
    }
    out
}

/// Every policy's standing on metric `id`, in plan order.
fn standings(
    experiment: &Experiment,
    runs: &[StoredRun],
    trace_names: &[String],
    id: &str,
) -> Vec<Standing> {
    experiment
        .policy_names()
        .into_iter()
        .map(|name| {
            let per_budget = experiment
                .budgets
                .iter()
                .map(|&budget| {
                    let values: Vec<f64> = trace_names
                        .iter()
                        .filter_map(|trace| find_run(runs, &name, budget, trace))
                        .filter_map(|run| run.report.metric(id))
                        .collect();
                    (!values.is_empty()).then(|| mean_ci(&values).0)
                })
                .collect();
            Standing { name, per_budget }
        })
        .collect()
}

/// The ranking table: the ceiling first (unranked), then the ranked policies.
fn table(experiment: &Experiment, ranked: &[Standing], ceiling: Option<&Standing>) -> Table {
    let mut headers = vec!["rank".to_string(), "policy".to_string()];
    headers.extend(experiment.budgets.iter().map(Budget::header));
    headers.push("mean".into());
    if ceiling.is_some() {
        headers.push("share of ceiling".into());
    }
    let mut table = Table::with_headers(headers);
    if let Some(ceiling) = ceiling {
        let mut row = vec!["ceiling".to_string(), ceiling.name.clone()];
        row.extend(ceiling.per_budget.iter().map(|value| match value {
            Some(value) => format!("{value:.4}"),
            None => "—".into(),
        }));
        row.push(format!("{:.4}", ceiling.mean()));
        row.push("—".into());
        table.push(row);
    }
    for (rank, standing) in ranked.iter().enumerate() {
        let mut row = vec![(rank + 1).to_string(), standing.name.clone()];
        let mut shares = Vec::new();
        for (value, top) in standing
            .per_budget
            .iter()
            .zip(budget_tops(ceiling, experiment))
        {
            row.push(match (value, top) {
                (None, _) => "—".into(),
                (Some(value), Some(top)) => {
                    shares.push(value / top);
                    format!("{value:.4} ({:.0}%)", 100.0 * value / top)
                }
                (Some(value), None) => format!("{value:.4}"),
            });
        }
        row.push(format!("{:.4}", standing.mean()));
        if ceiling.is_some() {
            row.push(match shares.is_empty() {
                true => "—".into(),
                false => format!("{:.1}%", 100.0 * mean_ci(&shares).0),
            });
        }
        table.push(row);
    }
    table
}

/// The ceiling's figure at each budget (all `None` without a ceiling).
fn budget_tops(ceiling: Option<&Standing>, experiment: &Experiment) -> Vec<Option<f64>> {
    match ceiling {
        Some(ceiling) => ceiling.per_budget.clone(),
        None => vec![None; experiment.budgets.len()],
    }
}

/// Kendall's τ-b between two orders of the same policies, and the largest rank moves.
fn agreement(first: &str, a: &[String], second: &str, b: &[String]) -> String {
    let rank_in = |order: &[String], name: &String| order.iter().position(|n| n == name);
    let pairs: Vec<(f64, f64, &String)> = a
        .iter()
        .filter_map(|name| {
            let (ra, rb) = (rank_in(a, name)?, rank_in(b, name)?);
            Some((ra as f64, rb as f64, name))
        })
        .collect();
    let (x, y): (Vec<f64>, Vec<f64>) = pairs.iter().map(|&(x, y, _)| (x, y)).unzip();
    let tau = kendall(&x, &y);
    let mut moves: Vec<&(f64, f64, &String)> = pairs.iter().filter(|(x, y, _)| x != y).collect();
    moves.sort_by(|p, q| {
        (q.1 - q.0)
            .abs()
            .total_cmp(&(p.1 - p.0).abs())
            .then(p.2.cmp(q.2))
    });
    let listed: Vec<String> = moves
        .iter()
        .take(3)
        .map(|(x, y, name)| format!("`{name}` {} → {}", *x as usize + 1, *y as usize + 1))
        .collect();
    format!(
        "\nThe order by {first} and the order by {second} agree with Kendall's τ-b = {tau:.2} over {} policies{}.\n",
        pairs.len(),
        match listed.is_empty() {
            true => " (the same order)".to_string(),
            false => format!("; the largest moves: {}", listed.join(", ")),
        }
    )
}
