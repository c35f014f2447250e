//! How far open-loop numbers predict closed-loop behaviour: for a closed-loop experiment, the
//! report's calibration section. Every run is one point (policy, budget, trace) with its open-loop
//! metrics (retained mass, top-k recall, output error) and its closed-loop outcomes (KL of the
//! next-token distributions, top-1 agreement, log-probability lost, task success).
//!
//! - Rank correlations: Spearman's ρ (Pearson on average ranks) and Kendall's τ-b (ties counted as
//!   in scipy's `kendalltau`), pooled over all points and per protocol with a 95% cluster-bootstrap
//!   interval over prompts ([`super::intervals`]: 2,000 resamples of the prompts, each keeping all
//!   its runs, from a seeded SplitMix64 stream, so reports are reproducible), and per trace
//!   without one (a trace is one prompt).
//! - Rankings: per (trace, budget), the policies ordered by open-loop retained mass (high first)
//!   and by closed-loop KL (low first); Kendall's τ-b between the two orders, and whether both put
//!   the same policy first.
//! - Disagreements: the pairs of policies on one (trace, budget) where the higher retained mass
//!   came with the higher KL by the widest margins.

use super::figures::{scatter, FigureFiles, Series};
use super::intervals::{rank_interval, BOOTSTRAP_RESAMPLES};
use super::protocols::protocol;
use super::stats::{best_index, kendall, spearman};
use super::store::{prompts_of, StoredRun};
use super::SweepError;
use super::{Budget, Experiment};
use crate::export::{Format, Table};
use crate::replay::{metrics, RETAINED_MASS};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::path::PathBuf;

/// A closed-loop outcome of a run: its title, its value, and the runs it is defined on (answers
/// only on traces whose full cache answers: a policy cannot keep an answer the model never gives,
/// so such a trace's runs would only add ties at "no answer").
struct Outcome {
    title: &'static str,
    value: fn(&StoredRun) -> f64,
    counts: fn(&StoredRun) -> bool,
}

fn every(_: &StoredRun) -> bool {
    true
}

fn full_answers(run: &StoredRun) -> bool {
    closed(run).full_answer_ok
}

/// The open-loop retained mass of a run.
fn mass(run: &StoredRun) -> f64 {
    run.report.metric(RETAINED_MASS).unwrap_or(f64::NAN)
}

fn closed(run: &StoredRun) -> &super::ClosedLoop {
    run.closed_loop.as_ref().expect("closed-loop runs")
}

const OUTCOMES: [Outcome; 4] = [
    Outcome {
        title: "KL full‖policy",
        value: |r| closed(r).kl,
        counts: every,
    },
    Outcome {
        title: "top-1 agreement",
        value: |r| closed(r).top1,
        counts: every,
    },
    Outcome {
        title: "logprob lost",
        value: |r| closed(r).logprob_lost,
        counts: every,
    },
    Outcome {
        title: "answer ok",
        value: |r| f64::from(u8::from(closed(r).answer_ok)),
        counts: full_answers,
    },
];

/// RULER's score (the share of the expected strings found), on traces whose full cache scores
/// above 0.
const ANSWER_SCORE: Outcome = Outcome {
    title: "answer score",
    value: |r| closed(r).answer_score(),
    counts: |r| closed(r).full_answer_score() > 0.0,
};

/// What a correlation's interval rests on, for the paragraph above its table.
fn intervals_note() -> String {
    format!(
        "each with its 95% cluster-bootstrap interval over prompts ({BOOTSTRAP_RESAMPLES} resamples of the prompts, each keeping all its runs, seeded; the runs of one prompt share its difficulty, so they are not resampled as independent draws). An interval is not given over fewer than 5 prompts or where more than 5% of the resamples are undefined (one side constant), and says why; a smaller share of undefined resamples is printed beside it"
    )
}

/// The calibration section of a closed-loop experiment's report, and its scatter plot. `layers`:
/// the model's numbers of the compressed layers, when only some are (see [`super::drift`]).
pub(crate) fn section(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
    layers: Option<&[usize]>,
    files: &FigureFiles<'_>,
) -> Result<(String, Vec<PathBuf>), SweepError> {
    let mut out = outcome_table(experiment, names, runs, trace_names);
    out += &correlations(runs, trace_names);
    out += &rankings(experiment, names, runs, trace_names);
    out += &super::protocols::section(&experiment.budgets, runs, trace_names);
    let (drift, mut figures) = super::drift::section(names, runs, layers, files)?;
    out += &drift;
    let series: Vec<Series> = names
        .iter()
        .map(|name| {
            let points = runs
                .iter()
                .filter(|r| &r.name == name)
                .map(|r| (mass(r), closed(r).kl))
                .collect();
            (name.clone(), points)
        })
        .collect();
    figures.extend(scatter(
        &files.stem("calibration"),
        "open-loop retained mass against closed-loop KL (one dot per policy, budget, trace)",
        "retained mass (open loop)",
        "KL(p_full ‖ p_policy), nats (closed loop)",
        &series,
    )?);
    Ok((out, figures))
}

/// Per policy and budget, over traces: mean KL, top-1 agreement, and the answers kept.
fn outcome_table(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    let full = answers(
        runs.iter()
            .filter(|r| r.name == names[0] && r.ran_at(experiment.budgets[0]))
            .map(|r| closed(r).full_answer_score()),
    );
    let partial = runs.iter().any(|r| {
        let closed = closed(r);
        closed.answer_score().fract() != 0.0 || closed.full_answer_score().fract() != 0.0
    });
    let scored = match partial {
        true => ", counted by task score: each trace adds the share of its expected answers the text gives",
        false => "",
    };
    let out = format!(
        "\nClosed loop: the policy holds the model's real KV cache. Mean KL(p_full ‖ p_policy) of the next-token distributions / top-1 agreement, teacher-forced along the full-cache continuation, and the answers the free-running policy still gives (the full cache answers {full} of {} traces{scored}):\n\n",
        trace_names.len()
    );
    let mut headers = vec!["policy".to_string()];
    headers.extend(experiment.budgets.iter().map(Budget::header));
    let mut table = Table::with_headers(headers);
    for name in names {
        let mut row = vec![name.clone()];
        for &budget in &experiment.budgets {
            let of: Vec<&StoredRun> = runs
                .iter()
                .filter(|r| &r.name == name && r.ran_at(budget))
                .collect();
            if of.is_empty() {
                row.push("—".into());
                continue;
            }
            let n = of.len() as f64;
            row.push(format!(
                "{:.3} / {:.2} / {}",
                of.iter().map(|r| closed(r).kl).sum::<f64>() / n,
                of.iter().map(|r| closed(r).top1).sum::<f64>() / n,
                answers(of.iter().map(|r| closed(r).answer_score()))
            ));
        }
        table.push(row);
    }
    out + &table.render(Format::Markdown)
}

/// Answers given, as the sum of the runs' task scores (1 for a text that gives every expected
/// answer): a whole sum as a whole number, any other to two decimals.
fn answers(scores: impl Iterator<Item = f64>) -> String {
    let sum = scores.fold(0.0, |sum, score| sum + score);
    match sum.fract() == 0.0 {
        true => format!("{sum}"),
        false => format!("{sum:.2}"),
    }
}

/// Rank correlations per protocol, with intervals over prompts, then per trace.
fn correlations(runs: &[StoredRun], trace_names: &[String]) -> String {
    let answered = runs.iter().filter(|r| closed(r).full_answer_ok).count();
    let answered_note = match answered {
        0 => " (answer ok left out: the full cache answers none of the traces)".to_string(),
        n if n < runs.len() => format!(" (answer ok only over the {n} points on traces the full cache answers: a policy cannot keep an answer the model never gives)"),
        _ => String::new(),
    };
    let protocols: BTreeSet<&str> = runs.iter().map(protocol).collect();
    let per_protocol = match protocols.len() {
        1 => String::new(),
        _ => ", per protocol: under question-agnostic the question's and the answer prefix's queries count as decode queries, so the open-loop metrics measure another set of queries than under question-in-prompt and are never pooled across protocols".into(),
    };
    let partial = runs.iter().any(|r| closed(r).answer_score().fract() != 0.0);
    let outcomes: Vec<&Outcome> = match partial {
        true => OUTCOMES.iter().chain([&ANSWER_SCORE]).collect(),
        false => OUTCOMES.iter().collect(),
    };
    let mut out = format!(
        "\nRank correlations between open-loop metrics and closed-loop outcomes over all {} (policy, budget, trace) points of {}{per_protocol}{answered_note}{}: Spearman ρ and Kendall τ-b, {}:\n\n",
        runs.len(),
        prompts_of(runs).describe(),
        match partial {
            true => "; the answer score, the share of expected strings found, on traces where the full cache scores above 0",
            false => "",
        },
        intervals_note()
    );
    let mut headers: Vec<String> = ["open-loop metric", "closed-loop outcome", "prompts, runs"]
        .into_iter()
        .chain(["Spearman ρ", "Kendall τ-b"])
        .map(String::from)
        .collect();
    if protocols.len() > 1 {
        headers.insert(0, "protocol".into());
    }
    let mut table = Table::with_headers(headers);
    for &name in &protocols {
        let of: Vec<&StoredRun> = runs.iter().filter(|r| protocol(r) == name).collect();
        for row in metric_rows(&of, &outcomes) {
            let mut cells = row.to_vec();
            if protocols.len() > 1 {
                cells.insert(0, name.to_string());
            }
            table.push(cells);
        }
    }
    out += &table.render(Format::Markdown);
    out + &per_trace(runs, trace_names)
}

/// Each open-loop metric (that every run has) against each outcome over `runs`: the metric, the
/// outcome, the prompts and runs counted, ρ and τ-b with their intervals. Each bootstrap is seeded
/// by the protocol, metric and outcome names.
fn metric_rows(runs: &[&StoredRun], outcomes: &[&Outcome]) -> Vec<[String; 5]> {
    let mut rows = Vec::new();
    for metric in metrics::REGISTRY.iter() {
        let Some(values) = runs
            .iter()
            .map(|r| r.report.metric(metric.id()))
            .collect::<Option<Vec<f64>>>()
        else {
            continue;
        };
        for outcome in outcomes {
            let counted: Vec<(&StoredRun, f64)> = runs
                .iter()
                .zip(values.iter().copied())
                .filter(|(r, _)| (outcome.counts)(r))
                .map(|(r, value)| (*r, value))
                .collect();
            if counted.is_empty() {
                continue;
            }
            let (x, y): (Vec<f64>, Vec<f64>) = counted
                .iter()
                .map(|&(r, value)| (value, (outcome.value)(r)))
                .unzip();
            let prompts = prompts_of(counted.iter().map(|&(r, _)| r));
            let seed = name_seed(&format!(
                "{} {} {}",
                protocol(runs[0]),
                metric.id(),
                outcome.title
            ));
            rows.push([
                metric.title().to_string(),
                outcome.title.to_string(),
                format!("{}, {}", prompts.count(), prompts.points()),
                rank_interval(&x, &y, &prompts, spearman, seed).to_string(),
                rank_interval(&x, &y, &prompts, kendall, seed).to_string(),
            ]);
        }
    }
    rows
}

/// Per trace: retained mass against KL over the trace's runs. A trace is one prompt, so there is
/// no interval over prompts: the correlations describe that prompt alone.
fn per_trace(runs: &[StoredRun], trace_names: &[String]) -> String {
    let mut table = Table::new(["trace", "runs", "Spearman ρ", "Kendall τ-b"]);
    for trace in trace_names {
        let of: Vec<&StoredRun> = runs.iter().filter(|r| &r.trace == trace).collect();
        let x: Vec<f64> = of.iter().map(|r| mass(r)).collect();
        let y: Vec<f64> = of.iter().map(|r| closed(r).kl).collect();
        let show = |value: f64| match value.is_nan() {
            true => "— (one side constant)".to_string(),
            false => format!("{value:+.3}"),
        };
        table.push([
            trace.clone(),
            of.len().to_string(),
            show(spearman(&x, &y)),
            show(kendall(&x, &y)),
        ]);
    }
    format!(
        "\nPer trace: retained mass against KL (a good open-loop metric has ρ near −1). Each trace is one prompt, so these describe that prompt and have no interval over prompts:\n\n{}",
        table.render(Format::Markdown)
    )
}

/// A bootstrap seed from a name: the first eight bytes of its SHA-256.
fn name_seed(trace: &str) -> u64 {
    let digest = Sha256::digest(trace.as_bytes());
    u64::from_le_bytes(digest[..8].try_into().expect("eight bytes"))
}

/// Per budget: does ranking the policies by open-loop mass give their closed-loop KL order?
fn rankings(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
) -> String {
    let mut out = "\nRankings of the policies on each (trace, budget): Kendall τ-b between the order by open-loop retained mass (high first) and by closed-loop KL (low first), mean over traces; and on how many traces both orders put the same policy first:\n\n".to_string();
    let mut table = Table::new(["budget", "mean τ-b of the two orders", "same best policy"]);
    let mut disagreements: Vec<(f64, String)> = Vec::new();
    for &budget in &experiment.budgets {
        let (mut taus, mut same_best, mut cells) = (Vec::new(), 0, 0);
        for trace in trace_names {
            let of: Vec<&StoredRun> = names
                .iter()
                .filter_map(|name| {
                    runs.iter()
                        .find(|r| &r.name == name && &r.trace == trace && r.ran_at(budget))
                })
                .collect();
            if of.len() < 2 {
                continue;
            }
            cells += 1;
            let mass: Vec<f64> = of.iter().map(|r| mass(r)).collect();
            let kl: Vec<f64> = of.iter().map(|r| -closed(r).kl).collect();
            let tau = kendall(&mass, &kl);
            if tau.is_finite() {
                taus.push(tau);
            }
            if best_index(&mass) == best_index(&kl) {
                same_best += 1;
            }
            for a in 0..of.len() {
                for b in 0..of.len() {
                    let (ma, mb) = (mass[a], mass[b]);
                    let (ka, kb) = (closed(of[a]).kl, closed(of[b]).kl);
                    if ma > mb && ka > kb {
                        disagreements.push((
                            (ma - mb) * (ka - kb),
                            format!(
                                "| {trace} | {budget} | {} keeps more mass ({ma:.4} vs {mb:.4}) but drifts more (KL {ka:.3} vs {kb:.3}) than {} |",
                                of[a].name, of[b].name
                            ),
                        ));
                    }
                }
            }
        }
        let mean = taus.iter().sum::<f64>() / taus.len().max(1) as f64;
        table.push([
            budget.to_string(),
            format!("{mean:+.3}"),
            format!("{same_best} of {cells}"),
        ]);
    }
    out += &table.render(Format::Markdown);
    disagreements.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    if !disagreements.is_empty() {
        out += "\nThe widest disagreements (mass gap × KL gap):\n\n| trace | budget | what happened |\n|---|---|---|\n";
        for (_, line) in disagreements.iter().take(8) {
            out += line;
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run;

    #[test]
    fn a_trace_is_one_prompt_and_gets_no_interval() {
        let kls = [0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.8, 0.4];
        let runs: Vec<StoredRun> = kls
            .iter()
            .enumerate()
            .map(|(i, &kl)| {
                let mass = 0.1 * i as f64;
                let mut run = closed_run(&format!("p{i}"), [mass, mass], None, kl);
                run.trace = "t".into();
                run
            })
            .collect();
        let table = per_trace(&runs, &["t".into()]);
        let row = table.lines().find(|l| l.starts_with("| t ")).unwrap();
        // ρ of mass 0..7 against those KLs: KL ranks [5, 1, 8, 3, 6, 2, 7, 4], Σd² = 76,
        // 1 − 6 · 76 / (8 · 63) = 0.095238.
        assert!(row.contains("| 8    | +0.095 "), "{table}");
        assert!(!row.contains('['), "{table}");
        assert!(table.contains("no interval over prompts"), "{table}");
        assert_ne!(name_seed("s"), name_seed("t"));
    }

    #[test]
    fn answers_sum_the_task_scores() {
        assert_eq!(answers([1.0, 0.0, 1.0].into_iter()), "2");
        assert_eq!(answers([0.5, 0.25, 0.0].into_iter()), "0.75");
        assert_eq!(answers(std::iter::empty()), "0");
    }

    #[test]
    fn each_protocol_gets_its_own_correlations_and_none_pooled() {
        // Under question-in-prompt KL falls as mass rises; under question-agnostic it rises, and
        // the answer score follows mass only where the full cache scores above 0. Pooled, the two
        // would cancel out.
        let runs: Vec<StoredRun> = (0..12)
            .map(|i| {
                let agnostic = i % 2 == 1;
                let mass = 0.05 * f64::from(i);
                let kl = if agnostic { mass } else { 1.0 - mass };
                let mut run = closed_run(&format!("p{i}"), [mass, mass], None, kl);
                run.trace = format!("t{}", i / 2);
                let protocol = ["question-in-prompt", "question-agnostic"][usize::from(agnostic)];
                run.report
                    .settings
                    .insert("protocol".into(), protocol.into());
                let closed = run.closed_loop.as_mut().expect("closed loop");
                closed.answer_score = Some(mass);
                closed.full_answer_score = Some(if i < 8 { 0.5 } else { 0.0 });
                run
            })
            .collect();
        let table = correlations(&runs, &[]);
        let row = |protocol: &str, outcome: &str| {
            table
                .lines()
                .find(|l| {
                    l.starts_with(&format!("| {protocol} "))
                        && l.contains("| retained mass ")
                        && l.contains(outcome)
                })
                .unwrap_or_else(|| panic!("{protocol} {outcome}: {table}"))
                .to_owned()
        };
        // Six prompts a protocol, one run of each: an interval over prompts.
        assert!(
            row("question-in-prompt", "KL").contains("| 6, 6 ")
                && row("question-in-prompt", "KL").contains(" -1.000 [-1.000, -1.000] "),
            "{table}"
        );
        assert!(
            row("question-agnostic", "KL").contains("+1.000 [+1.000, +1.000]"),
            "{table}"
        );
        // Eight runs score above 0 in full, four per protocol: too few prompts for an interval.
        assert!(
            row("question-agnostic", "answer score").contains("| 4, 4 ")
                && row("question-agnostic", "answer score").contains("(no interval: 4 prompts)"),
            "{table}"
        );
        assert!(table.contains("never pooled across protocols"), "{table}");
        assert!(
            !table.lines().any(|l| l.starts_with("| retained mass")),
            "{table}"
        );
        let one: Vec<StoredRun> = runs.iter().step_by(2).cloned().collect();
        let one = correlations(&one, &[]);
        assert!(!one.contains("| protocol"), "{one}");
    }

    #[test]
    fn answers_count_only_on_traces_the_full_cache_answers() {
        // On "t" the full cache answers and the policies with the most mass keep the answer; on
        // "u" it does not, no policy answers, and KL rises with mass instead.
        let runs_on = |trace: &str, full_answers: bool| -> Vec<StoredRun> {
            (0..6)
                .map(|i| {
                    let mass = 0.1 * f64::from(i);
                    let kl = if full_answers { 1.0 - mass } else { mass };
                    let mut run = closed_run(&format!("p{i}"), [mass, mass], None, kl);
                    run.trace = trace.into();
                    let closed = run.closed_loop.as_mut().expect("closed loop");
                    closed.full_answer_ok = full_answers;
                    closed.answer_ok = full_answers && i >= 3;
                    run
                })
                .collect()
        };
        let row = |report: &str, outcome: &str| {
            report
                .lines()
                .find(|l| l.starts_with("| retained mass") && l.contains(outcome))
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        };
        let answered = runs_on("t", true);
        let mut both = runs_on("u", false);
        both.extend(answered.clone());
        let pooled = correlations(&both, &["u".into(), "t".into()]);
        let alone = correlations(&answered, &["t".into()]);
        assert!(row(&alone, "answer ok").is_some());
        assert_eq!(row(&pooled, "answer ok"), row(&alone, "answer ok"));
        assert_ne!(row(&pooled, "KL"), row(&alone, "KL"));
        assert!(
            pooled.contains("answer ok only over the 6 points"),
            "{pooled}"
        );
        assert!(!alone.contains("answer ok only"), "{alone}");
        let unanswered = correlations(&runs_on("u", false), &["u".into()]);
        assert_eq!(row(&unanswered, "answer ok"), None);
        assert!(row(&unanswered, "KL").is_some());
        assert!(unanswered.contains("answer ok left out"), "{unanswered}");
    }
}
