//! Span survival: the share of each span's tokens and attention each policy keeps.

use super::*;

/// One table per named span of the traces (in order of first appearance; traces of different
/// tasks name different spans): tokens kept / mass kept, over the traces that have the span.
pub(super) fn span_sections(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    let mut out = String::new();
    let mut span_names: Vec<&str> = Vec::new();
    for run in runs {
        for (span, ..) in &run.report.spans {
            if !span_names.contains(&span.as_str()) {
                span_names.push(span);
            }
        }
    }
    for span in span_names {
        out += &format!("\nSpan `{span}`: share of its tokens kept / share of its full-attention mass kept (mean over traces, layers, heads, steps):\n\n");
        let mut table = budget_table(experiment);
        for name in names {
            let mut row = vec![name.clone()];
            for &budget in &experiment.budgets {
                let of = trace_names
                    .iter()
                    .filter_map(|t| find_run(runs, name, budget, t));
                row.push(match kept_share(of, span) {
                    Some((tokens, mass)) => format!("{tokens:.3} / {mass:.3}"),
                    None => "—".into(),
                });
            }
            table.push(row);
        }
        out += &table.render(Format::Markdown);
    }
    out
}

/// The mean share of `span`'s tokens and of its full-attention mass kept, over the runs that
/// have the span (`None` if none has).
fn kept_share<'a>(runs: impl Iterator<Item = &'a StoredRun>, span: &str) -> Option<(f64, f64)> {
    let values: Vec<(f64, f64)> = runs
        .filter_map(|r| r.report.spans.iter().find(|s| s.0 == span))
        .map(|(_, fraction, kept, full)| (*fraction, if *full > 0.0 { kept / full } else { 0.0 }))
        .collect();
    if values.is_empty() {
        return None;
    }
    let n = values.len() as f64;
    Some((
        values.iter().map(|v| v.0).sum::<f64>() / n,
        values.iter().map(|v| v.1).sum::<f64>() / n,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run;

    #[test]
    fn spans_are_found_by_name_in_traces_that_name_different_ones() {
        let mut needle = closed_run("p", [0.5, 0.5], None, 0.1);
        needle.report.spans = vec![
            ("needle".into(), 1.0, 0.4, 0.8),
            ("question".into(), 1.0, 0.2, 0.2),
        ];
        let mut words = closed_run("p", [0.5, 0.5], None, 0.1);
        words.report.spans = vec![("question".into(), 0.5, 0.1, 0.4)];
        let runs = [needle, words];
        assert_eq!(kept_share(runs.iter(), "needle"), Some((1.0, 0.5)));
        assert_eq!(kept_share(runs.iter(), "question"), Some((0.75, 0.625)));
        assert_eq!(kept_share(runs.iter(), "chain"), None);
    }
}
