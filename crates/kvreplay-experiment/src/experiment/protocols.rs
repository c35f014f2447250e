//! Two report sections of a closed-loop experiment that runs its policies under both protocols
//! (the cut at the prompt's end, or before the question): which open-loop metric predicts the
//! closed-loop KL on each trace under each protocol, and whether the protocol changes the ranking
//! of the methods (the question kvpress's authors raise about SnapKV's window vote).
//!
//! - Metrics: per (trace, protocol), Spearman's ρ between each open-loop metric and KL over that
//!   cell's (policy, budget) points. Output error is negated, so for every metric higher is a
//!   better cache and a perfect predictor has ρ = −1; the best is the lowest ρ. The answer-span
//!   mass is the share of the full attention on the spans that state the answer (`needle…`,
//!   `chain…`) that the kept sets hold, Σ kept mass / Σ full mass.
//! - Every outcome: per (trace, protocol) again, each metric's ρ with each closed-loop outcome
//!   (KL, top-1 agreement, log-probability lost, and the answer score on the traces where the
//!   full cache scores above 0), oriented so that +1 is a perfect predictor; per outcome, each
//!   metric's median over the cells and the cells where it predicts best.
//! - Rankings: per (trace, budget), the methods (a policy's name less its `protocol=` part)
//!   ordered by KL under each protocol; Kendall's τ-b between the two orders, and whether both
//!   put the same method first.

use super::stats::{best_index, kendall, spearman};
use super::store::StoredRun;
use super::Budget;
use crate::export::{Format, Table};
use crate::replay::{Protocol, RETAINED_MASS};
use std::collections::BTreeSet;

/// An open-loop number of a run, oriented so that higher is a better cache.
struct Predictor {
    title: &'static str,
    value: fn(&StoredRun) -> Option<f64>,
}

const PREDICTORS: [Predictor; 5] = [
    Predictor {
        title: "retained mass",
        value: |r| r.report.metric(RETAINED_MASS),
    },
    Predictor {
        title: "top-k recall",
        value: |r| r.report.metric("topk_recall"),
    },
    Predictor {
        title: "−output error",
        value: |r| r.report.metric("output_error").map(|e| -e),
    },
    Predictor {
        title: "value-weighted mass",
        value: |r| r.report.metric("value_weighted_mass"),
    },
    Predictor {
        title: "answer-span mass",
        value: answer_span_mass,
    },
];

/// The share of the full attention on the answer-bearing spans (`needle…`, `chain…`) that the
/// kept sets hold; `None` for a trace without such spans.
fn answer_span_mass(run: &StoredRun) -> Option<f64> {
    let answer = |name: &str| name.starts_with("needle") || name.starts_with("chain");
    let (kept, full) = run
        .report
        .spans
        .iter()
        .filter(|(name, ..)| answer(name))
        .fold((0.0, 0.0), |(kept, full), (_, _, k, f)| {
            (kept + k, full + f)
        });
    (full > 0.0).then(|| kept / full)
}

/// A run's protocol, by name.
pub(crate) fn protocol(run: &StoredRun) -> &str {
    run.report
        .settings
        .get("protocol")
        .map_or(Protocol::QuestionInPrompt.name(), String::as_str)
}

/// A run's method: its name less the `protocol=` part an experiment's label gives it.
fn method(run: &StoredRun) -> String {
    let suffix = format!(" protocol={}", protocol(run));
    run.name.replace(&suffix, "")
}

fn kl(run: &StoredRun) -> f64 {
    run.closed_loop.as_ref().expect("closed-loop runs").kl
}

/// A closed-loop outcome of a run, and whether a lower value is a better cache.
struct Outcome {
    title: &'static str,
    value: fn(&StoredRun) -> Option<f64>,
    lower_is_better: bool,
}

const OUTCOMES: [Outcome; 4] = [
    Outcome {
        title: "KL full‖policy",
        value: |r| Some(kl(r)),
        lower_is_better: true,
    },
    Outcome {
        title: "top-1 agreement",
        value: |r| r.closed_loop.as_ref().map(|c| c.top1),
        lower_is_better: false,
    },
    Outcome {
        title: "logprob lost",
        value: |r| r.closed_loop.as_ref().map(|c| c.logprob_lost),
        lower_is_better: true,
    },
    Outcome {
        title: "answer score",
        value: answer_score,
        lower_is_better: false,
    },
];

/// The free-running text's task score, on a trace where the full cache scores above 0 (a policy
/// cannot keep an answer the model never gives).
fn answer_score(run: &StoredRun) -> Option<f64> {
    let closed = run.closed_loop.as_ref()?;
    let score = |given: Option<f64>, ok: bool| given.unwrap_or(f64::from(u8::from(ok)));
    let full = score(closed.full_answer_score, closed.full_answer_ok);
    (full > 0.0).then(|| score(closed.answer_score, closed.answer_ok))
}

/// Both sections, at the experiment's `budgets`, when the runs hold more than one protocol; empty
/// otherwise.
pub(crate) fn section(budgets: &[Budget], runs: &[StoredRun], traces: &[String]) -> String {
    let protocols: BTreeSet<&str> = runs.iter().map(protocol).collect();
    if protocols.len() < 2 {
        return String::new();
    }
    let per_cell = match cells(runs, traces, &protocols).is_empty() {
        true => "\nWhich open-loop metric predicts KL per (trace, protocol): not computed, as no cell has the three (policy, budget) points a rank correlation within one trace and protocol needs; the correlations over prompts above hold what the runs say.\n".to_string(),
        false => predictors(runs, traces, &protocols) + &every_outcome(runs, traces, &protocols),
    };
    per_cell + &rankings(budgets, runs, traces)
}

/// Each (trace, protocol) cell with at least three points, with its runs.
fn cells<'a>(
    runs: &'a [StoredRun],
    traces: &'a [String],
    protocols: &BTreeSet<&'a str>,
) -> Vec<(&'a str, &'a str, Vec<&'a StoredRun>)> {
    let mut cells = Vec::new();
    for trace in traces {
        for &name in protocols {
            let cell: Vec<&StoredRun> = runs
                .iter()
                .filter(|r| &r.trace == trace && protocol(r) == name)
                .collect();
            if cell.len() >= 3 {
                cells.push((trace.as_str(), name, cell));
            }
        }
    }
    cells
}

/// Per outcome and predictor: the median over the cells of ρ oriented so that +1 is a perfect
/// predictor, the cells where it is defined, and those where it is the best predictor.
fn every_outcome(runs: &[StoredRun], traces: &[String], protocols: &BTreeSet<&str>) -> String {
    let cells = cells(runs, traces, protocols);
    let mut table = Table::new([
        "closed-loop outcome",
        "open-loop metric",
        "cells",
        "median oriented ρ",
        "cells it predicts best",
    ]);
    for outcome in &OUTCOMES {
        let sign = if outcome.lower_is_better { -1.0 } else { 1.0 };
        let per_cell: Vec<Vec<Option<f64>>> = cells
            .iter()
            .map(|(_, _, cell)| {
                let points: Vec<&&StoredRun> = cell
                    .iter()
                    .filter(|r| (outcome.value)(r).is_some())
                    .collect();
                let y: Vec<f64> = points.iter().filter_map(|r| (outcome.value)(r)).collect();
                PREDICTORS
                    .iter()
                    .map(|p| {
                        let x: Option<Vec<f64>> = points.iter().map(|r| (p.value)(r)).collect();
                        let x = x.filter(|_| points.len() >= 3)?;
                        Some(sign * spearman(&x, &y)).filter(|rho| rho.is_finite())
                    })
                    .collect()
            })
            .collect();
        let mut wins = vec![0usize; PREDICTORS.len()];
        for rhos in &per_cell {
            let best = (0..rhos.len())
                .filter_map(|i| rhos[i].map(|rho| (i, rho)))
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
            if let Some((i, _)) = best {
                wins[i] += 1;
            }
        }
        for (i, predictor) in PREDICTORS.iter().enumerate() {
            let mut rhos: Vec<f64> = per_cell.iter().filter_map(|rhos| rhos[i]).collect();
            rhos.sort_by(f64::total_cmp);
            let median = match rhos.len() {
                0 => "—".to_string(),
                n if n % 2 == 1 => format!("{:+.3}", rhos[n / 2]),
                n => format!("{:+.3}", (rhos[n / 2 - 1] + rhos[n / 2]) / 2.0),
            };
            table.push([
                outcome.title.to_string(),
                predictor.title.to_string(),
                rhos.len().to_string(),
                median,
                wins[i].to_string(),
            ]);
        }
    }
    format!(
        "
Which open-loop metric predicts which closed-loop outcome: per (trace, protocol) cell as above, Spearman ρ with each outcome, oriented so that +1 is a perfect predictor (negated for KL and log-probability lost); the answer score only on traces where the full cache scores above 0, over the cells where the policies' scores differ. Per outcome and metric, the median over the cells where ρ is defined, and in how many cells the metric predicts best:\n\n{}",
        table.render(Format::Markdown)
    )
}

/// Per (trace, protocol): each predictor's ρ with KL and the best of them.
fn predictors(runs: &[StoredRun], traces: &[String], protocols: &BTreeSet<&str>) -> String {
    let mut headers = vec!["trace".to_string(), "protocol".into(), "points".into()];
    headers.extend(PREDICTORS.iter().map(|p| format!("ρ {}", p.title)));
    headers.push("best".into());
    let mut table = Table::with_headers(headers);
    let mut wins = vec![0usize; PREDICTORS.len()];
    for (trace, name, cell) in cells(runs, traces, protocols) {
        let rhos: Vec<Option<f64>> = PREDICTORS
            .iter()
            .map(|p| {
                let x: Option<Vec<f64>> = cell.iter().map(|r| (p.value)(r)).collect();
                let y: Vec<f64> = cell.iter().map(|r| kl(r)).collect();
                x.map(|x| spearman(&x, &y)).filter(|rho| rho.is_finite())
            })
            .collect();
        let best = (0..rhos.len())
            .filter_map(|i| rhos[i].map(|rho| (i, rho)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let mut row = vec![trace.to_owned(), name.to_owned(), cell.len().to_string()];
        row.extend(
            rhos.iter()
                .map(|rho| rho.map_or("—".into(), |r| format!("{r:+.3}"))),
        );
        row.push(best.map_or("—".into(), |(i, _)| PREDICTORS[i].title.to_owned()));
        if let Some((i, _)) = best {
            wins[i] += 1;
        }
        table.push(row);
    }
    let tally: Vec<String> = PREDICTORS
        .iter()
        .zip(&wins)
        .map(|(p, n)| format!("{} {n}", p.title))
        .collect();
    format!(
        "\nWhich open-loop metric predicts KL, per trace and protocol: Spearman ρ over the cell's (policy, budget) points, every metric oriented so that higher is a better cache (output error negated), so a perfect predictor has ρ = −1 and the best is the lowest; the answer-span mass is the share of the full attention on the spans stating the answer (`needle…`, `chain…`) that is kept (— where a trace has none):\n\n{}\nBest per cell: {}.\n",
        table.render(Format::Markdown),
        tally.join(", ")
    )
}

/// Per budget: how far the order of the methods by KL under one protocol is the order under the
/// other.
fn rankings(budgets: &[Budget], runs: &[StoredRun], traces: &[String]) -> String {
    let protocols: Vec<&str> = runs
        .iter()
        .map(protocol)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let (first, second) = (protocols[0], protocols[1]);
    let mut table = Table::new([
        "budget",
        "mean τ-b of the two orders",
        "same best method",
        &format!("best methods, {first}"),
        &format!("best methods, {second}"),
    ]);
    for &budget in budgets {
        let (mut taus, mut same, mut cells) = (Vec::new(), 0, 0);
        let mut bests: [Vec<String>; 2] = [Vec::new(), Vec::new()];
        for trace in traces {
            let of = |name: &str| -> Vec<&StoredRun> {
                runs.iter()
                    .filter(|r| &r.trace == trace && r.ran_at(budget) && protocol(r) == name)
                    .collect()
            };
            let (a, b) = (of(first), of(second));
            let paired: Vec<(f64, f64, String)> = a
                .iter()
                .filter_map(|ra| {
                    let rb = b.iter().find(|rb| method(rb) == method(ra))?;
                    Some((-kl(ra), -kl(rb), method(ra)))
                })
                .collect();
            if paired.len() < 2 {
                continue;
            }
            cells += 1;
            let (x, y): (Vec<f64>, Vec<f64>) = paired.iter().map(|(x, y, _)| (*x, *y)).unzip();
            let tau = kendall(&x, &y);
            if tau.is_finite() {
                taus.push(tau);
            }
            let best = |values: &[f64]| best_index(values).expect("two or more");
            let (bx, by) = (best(&x), best(&y));
            same += usize::from(bx == by);
            bests[0].push(paired[bx].2.clone());
            bests[1].push(paired[by].2.clone());
        }
        let mean = taus.iter().sum::<f64>() / taus.len().max(1) as f64;
        table.push([
            budget.to_string(),
            format!("{mean:+.3}"),
            format!("{same} of {cells}"),
            tally(&bests[0]),
            tally(&bests[1]),
        ]);
    }
    format!(
        "\nDoes the protocol change the ranking of the methods? Per (trace, budget), the methods (a policy's name less its protocol) ordered by closed-loop KL under each protocol: Kendall τ-b between the two orders, mean over traces; on how many traces both put the same method first; and which methods come first under each (traces each):\n\n{}",
        table.render(Format::Markdown)
    )
}

/// `names` counted, most frequent first: "snapkv 6, knorm 3".
fn tally(names: &[String]) -> String {
    let mut counts: Vec<(usize, &String)> = names
        .iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|name| (names.iter().filter(|n| *n == name).count(), name))
        .collect();
    counts.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    counts
        .iter()
        .map(|(n, name)| format!("{name} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run;

    /// A run of `name` under `protocol` on trace `t`: retained mass `mass`, KL `kl`.
    fn run(name: &str, protocol: &str, mass: f64, kl: f64) -> StoredRun {
        let mut run = closed_run(
            &format!("{name} protocol={protocol}"),
            [mass, mass],
            None,
            kl,
        );
        run.report
            .settings
            .insert("protocol".into(), protocol.into());
        run.report.metrics.insert("output_error".into(), kl / 10.0);
        run.report.spans = vec![
            ("needle".into(), 0.5, mass / 2.0, 0.5),
            ("question".into(), 1.0, 0.1, 0.1),
        ];
        run
    }

    #[test]
    fn the_answer_span_mass_is_the_kept_share_of_the_answer_spans() {
        let mut r = run("a", "question-agnostic", 0.6, 1.0);
        r.report.spans.push(("chain-2".into(), 1.0, 0.2, 0.5));
        // (0.3 + 0.2) / (0.5 + 0.5); the question's span is not an answer's.
        assert_eq!(answer_span_mass(&r), Some(0.5));
        r.report.spans.clear();
        assert_eq!(answer_span_mass(&r), None);
    }

    #[test]
    fn a_reversed_order_under_the_other_protocol_is_tau_minus_one() {
        // Under question-in-prompt a < b < c by KL; question-agnostic reverses it.
        let runs = vec![
            run("a", "question-in-prompt", 0.9, 0.1),
            run("b", "question-in-prompt", 0.8, 0.2),
            run("c", "question-in-prompt", 0.7, 0.3),
            run("a", "question-agnostic", 0.7, 0.3),
            run("b", "question-agnostic", 0.8, 0.2),
            run("c", "question-agnostic", 0.9, 0.1),
        ];
        let text = section(&[Budget::Tokens(64)], &runs, &["t".into()]);
        let cells: Vec<&str> = text
            .lines()
            .find(|l| l.starts_with("| 64 "))
            .unwrap()
            .split('|')
            .map(str::trim)
            .collect();
        assert_eq!(
            cells[1..6],
            ["64", "-1.000", "0 of 1", "c 1", "a 1"],
            "{text}"
        );
        // KL is retained mass reversed, and output error is KL: ρ = −1 for both, mass first.
        let row = text
            .lines()
            .find(|l| l.starts_with("| t ") && l.contains("question-in-prompt"))
            .unwrap();
        assert!(
            row.contains("-1.000") && row.trim_end().ends_with("retained mass |"),
            "{row}"
        );
        assert!(
            text.contains("Best per cell: retained mass 2, top-k recall 0"),
            "{text}"
        );
    }

    #[test]
    fn every_outcome_is_oriented_so_that_plus_one_predicts_perfectly() {
        // Two cells of three runs. KL falls as the mass rises (a perfect predictor: oriented ρ
        // +1); top-1 rises with the mass in the first cell and falls in the second (+1, −1:
        // median 0); logprob lost is constant (ρ undefined: no cell); the answer score falls
        // where the mass rises in one cell, is constant in the other, and counts only where
        // the full cache answers. Output error and the answer-span mass follow the mass here, so
        // every defined metric ties, and the first listed predicts best.
        let mut runs = Vec::new();
        for (protocol, top1_sign, answers) in [
            ("question-in-prompt", 1.0, [1.0, 0.5, 0.0]),
            ("question-agnostic", -1.0, [1.0, 1.0, 1.0]),
        ] {
            for (i, mass) in [0.9, 0.8, 0.7].into_iter().enumerate() {
                let mut r = run(&format!("m{i}"), protocol, mass, 1.0 - mass);
                let closed = r.closed_loop.as_mut().unwrap();
                closed.top1 = 0.5 + top1_sign * (mass - 0.8);
                closed.answer_score = Some(answers[2 - i]);
                runs.push(r);
            }
        }
        let text = every_outcome(&runs, &["t".into()], &protocols_of(&runs));
        let row = |outcome: &str, metric: &str| -> Vec<String> {
            text.lines()
                .find(|l| {
                    l.starts_with(&format!("| {outcome} ")) && l.contains(&format!("| {metric} "))
                })
                .unwrap_or_else(|| panic!("{outcome} {metric}: {text}"))
                .split('|')
                .map(|c| c.trim().to_owned())
                .filter(|c| !c.is_empty())
                .collect()
        };
        assert_eq!(
            row("KL full‖policy", "retained mass")[2..],
            ["2", "+1.000", "2"]
        );
        assert_eq!(
            row("top-1 agreement", "retained mass")[2..],
            ["2", "+0.000", "2"]
        );
        assert_eq!(row("logprob lost", "retained mass")[2..], ["0", "—", "0"]);
        assert_eq!(
            row("answer score", "retained mass")[2..],
            ["1", "-1.000", "1"]
        );
    }

    fn protocols_of(runs: &[StoredRun]) -> BTreeSet<&str> {
        runs.iter().map(protocol).collect()
    }

    #[test]
    fn cells_too_small_for_a_correlation_say_so_instead_of_empty_tables() {
        // One policy under two protocols: two points per (trace, protocol) cell.
        let runs: Vec<StoredRun> = ["question-in-prompt", "question-agnostic"]
            .iter()
            .map(|protocol| {
                let mut run = closed_run("p", [0.5, 0.5], None, 0.1);
                run.report
                    .settings
                    .insert("protocol".into(), protocol.to_string());
                run
            })
            .collect();
        let text = section(&[Budget::Tokens(64)], &runs, &["t".into()]);
        assert!(
            text.contains("not computed, as no cell has the three"),
            "{text}"
        );
        assert!(!text.contains("| cells "), "{text}");
    }

    #[test]
    fn one_protocol_adds_nothing() {
        let runs = vec![
            run("a", "question-in-prompt", 0.9, 0.1),
            run("b", "question-in-prompt", 0.8, 0.2),
        ];
        assert_eq!(section(&[Budget::Tokens(64)], &runs, &["t".into()]), "");
    }
}
