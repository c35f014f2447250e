//! The table of `kvreplay live`: closed-loop outcomes beside the open-loop metrics of the same
//! policy on the same run.

use super::{Format, Table};
use crate::live::LiveReport;
use crate::replay::metrics::REGISTRY;
use crate::replay::{Protocol, Timing};

/// One row: the policy, its open-loop metrics and its closed-loop outcomes; then the texts.
pub fn live_table(report: &LiveReport, format: Format) -> String {
    let open = &report.open_loop;
    let mut headers = vec!["policy".to_string(), "budget".into(), "mean kept".into()];
    headers.extend(
        REGISTRY
            .iter()
            .filter(|metric| open.metric(metric.id()).is_some())
            .map(|metric| format!("{} (open loop)", metric.title())),
    );
    headers.extend(
        [
            "retained mass (live)",
            "KL full‖policy",
            "top-1 agreement",
            "logprob lost",
            "answer score",
        ]
        .map(String::from),
    );
    let mut table = Table::with_headers(headers);
    let mut row = vec![
        report.policy.clone(),
        open.nominal_budget.to_string(),
        format!("{:.1}", open.mean_kept),
    ];
    row.extend(
        REGISTRY
            .iter()
            .filter_map(|metric| open.metric(metric.id()))
            .map(|value| format!("{value:.4}")),
    );
    row.extend([
        format!("{:.4}", report.live_retained_mass),
        format!("{:.4}", report.kl),
        format!("{:.4}", report.top1),
        format!("{:.4}", report.logprob_lost),
        format!(
            "{:.2} (full cache: {:.2})",
            report.answer_score, report.full_answer_score
        ),
    ]);
    table.push(row);
    let mut out = table.render(format);
    if format == Format::Markdown {
        let setting = |key: &str| report.open_loop.settings.get(key).map(String::as_str);
        let streams_prompt = setting("timing") == Some(Timing::Streaming.name());
        let agnostic = setting("protocol") == Some(Protocol::QuestionAgnostic.name());
        let first = if streams_prompt {
            "the policy evicts during the prompt, so the first token is compared too"
        } else if agnostic {
            "the question runs over the compressed context, so the first token is compared too"
        } else {
            "the first token comes from the full prefill"
        };
        out += &format!(
            "\nTeacher-forced along the full-cache continuation, {} steps (means over steps; \
             {first}). Free-running greedy text under the policy: {:?}\nFull cache: {:?}\n",
            report.steps.len(),
            report.text,
            report.full_text
        );
        out += &drift_line(report);
        if report.uses_full_run_future {
            out += "The kept sets read the full-cache run's future queries (an oracle).\n";
        }
    }
    out
}

/// A policy's reports on the questions asked of one context, a row each, then their means (each
/// question weighs the same): the open-loop retained mass and the closed-loop outcomes.
pub fn live_questions_table(reports: &[LiveReport], format: Format) -> String {
    let headers = [
        "question",
        "retained mass (open loop)",
        "retained mass (live)",
        "KL full‖policy",
        "top-1 agreement",
        "logprob lost",
        "answer score",
        "full cache's answer score",
    ];
    let mut table = Table::with_headers(headers.map(String::from).to_vec());
    let values = |r: &LiveReport| {
        [
            r.open_loop.metric("retained_mass").unwrap_or(f64::NAN),
            r.live_retained_mass,
            r.kl,
            r.top1,
            r.logprob_lost,
            r.answer_score,
            r.full_answer_score,
        ]
    };
    let row = |name: String, values: [f64; 7]| {
        let mut row = vec![name];
        row.extend(values.iter().map(|value| format!("{value:.4}")));
        row
    };
    let mut sum = [0.0; 7];
    for (index, report) in reports.iter().enumerate() {
        let report = values(report);
        sum.iter_mut()
            .zip(report)
            .for_each(|(sum, value)| *sum += value);
        table.push(row((index + 1).to_string(), report));
    }
    let n = reports.len() as f64;
    table.push(row("mean".into(), sum.map(|total| total / n)));
    let mut out = table.render(format);
    if format == Format::Markdown {
        if let Some(first) = reports.first() {
            out = format!(
                "{}: {} questions of one context\n\n{out}",
                first.policy,
                reports.len()
            );
        }
        out += "\nFree-running greedy texts under the policy:\n";
        for (index, report) in reports.iter().enumerate() {
            out += &format!(
                "Question {}: {:?} (full cache: {:?})\n",
                index + 1,
                report.text,
                report.full_text
            );
        }
    }
    out
}

/// Per layer, the live retained mass minus the open-loop one: where the model's own vectors
/// drift once tokens are gone (layer 0's vectors do not depend on any eviction: 0 there). On a
/// model whose policies compress only some layers (a hybrid model's global ones) each value is
/// named by its layer.
fn drift_line(report: &LiveReport) -> String {
    let layers = &report.open_loop.layers;
    let every_layer = layers.iter().enumerate().all(|(i, l)| l.layer == i);
    let drift: Vec<String> = report
        .live_layers
        .iter()
        .zip(layers)
        .map(|(live, open)| {
            let value = live - open.metrics[crate::replay::RETAINED_MASS];
            match every_layer {
                true => format!("{value:+.3}"),
                false => format!("{}: {value:+.3}", open.layer),
            }
        })
        .collect();
    format!(
        "Retained mass, live minus open loop, by layer: {}\n",
        drift.join(if every_layer { " " } else { ", " })
    )
}
