//! Running a sweep: the planned runs of an experiment (or of one shard of it) that are not stored
//! yet, a trace at a time, in batches that share each layer's reading and scoring, each run
//! stored as it finishes.

use super::shard::{plan_shards, Shard};
use super::store::{is_stored, record_failure, store, ClosedLoop};
use super::SweepError;
use super::{Experiment, PlannedRun, TraceFile};
use crate::capture::{self, ModelSlot};
use crate::live::LiveQuestions;
use crate::recipe::{BuiltPrompt, Recipe};
use crate::replay::{replay_many, LayerDone, PolicyError, ReplayReport, ValidPolicy};
use crate::trace::TraceReader;
use std::path::Path;

/// Progress of a sweep: `(done, total)` after each batch, done counting skipped runs.
pub type SweepProgress<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// Runs every planned run (of `shard` only, when given) not stored yet under `results`, storing
/// each as it finishes; `layer_done` is called after each layer of each pass. A trace's policies
/// run in batches ([`batches`]) that share each layer's reading and decode attention, and whose
/// policies with the same scores share one scoring pass. Returns how many runs were run and how
/// many were already there; when some failed on their own (their errors kept under
/// `results/failed/`), the others still run and are stored, and the sweep ends with
/// [`SweepError::RunsFailed`].
pub fn run_sweep(
    experiment: &Experiment,
    traces: &[TraceFile],
    results: &Path,
    shard: Option<Shard>,
    (progress, layer_done): (SweepProgress<'_>, LayerDone<'_>),
    models: &mut ModelSlot,
) -> Result<(usize, usize), SweepError> {
    let planned: Vec<PlannedRun> = match shard {
        Some(shard) => plan_shards(experiment, traces, shard.count)
            .into_iter()
            .filter(|(_, of)| *of == shard.index)
            .map(|(run, _)| run)
            .collect(),
        None => experiment.plan(traces),
    };
    let total = planned.len();
    let pending: Vec<&PlannedRun> = planned
        .iter()
        .filter(|run| !is_stored(results, &run.id))
        .collect();
    let skipped = total - pending.len();
    let mut done = skipped;
    progress(done, total);
    let mut failed: Vec<(&PlannedRun, String)> = Vec::new();
    for unit in units(traces, experiment.closed_loop) {
        let (of_unit, distinct) = pending_in(unit, &pending);
        if distinct.is_empty() {
            continue;
        }
        let runner = match experiment.closed_loop {
            true => live_runner(unit, models)?,
            false => Runner::Replay(TraceReader::open(&unit[0].path).map_err(PolicyError::from)?),
        };
        let checked = distinct
            .into_iter()
            .map(|run| Ok((run, experiment.check(&run.params)?)))
            .collect::<Result<Vec<_>, SweepError>>()?;
        let most = if experiment.closed_loop {
            LIVE_BATCH
        } else {
            REPLAY_BATCH
        };
        for batch in batches(checked, most) {
            let (runs, policies): (Vec<&PlannedRun>, Vec<ValidPolicy>) = batch.into_iter().unzip();
            let outcomes = run_alone_on_failure(&runner, &policies, layer_done);
            for (run, outcome) in runs.iter().zip(outcomes) {
                for (index, of_trace) in of_unit.iter().enumerate() {
                    let same =
                        |other: &&&PlannedRun| other.name == run.name && other.params == run.params;
                    let Some(pending) = of_trace.iter().find(same) else {
                        continue;
                    };
                    match &outcome {
                        Ok(outcomes) => {
                            let (report, closed_loop) = outcomes[index].clone();
                            store(results, pending, &unit[index], &report, closed_loop)?;
                        }
                        Err(error) => {
                            let error = crate::error_text(error);
                            record_failure(results, pending, &error)?;
                            failed.push((*pending, error));
                        }
                    }
                    done += 1;
                }
            }
            progress(done, total);
        }
    }
    match failed.first() {
        None => Ok((total - skipped, skipped)),
        Some((run, error)) => Err(SweepError::RunsFailed {
            count: failed.len(),
            total: total - skipped,
            first_name: run.name.clone(),
            first_trace: run.trace.clone(),
            first_error: error.clone(),
            dir: results.join("failed"),
        }),
    }
}

/// The runs of `pending` on each trace of `unit`, and the unit's policies: each run pending on one
/// of its traces, once (by name and settings).
fn pending_in<'p>(
    unit: &[TraceFile],
    pending: &[&'p PlannedRun],
) -> (Vec<Vec<&'p PlannedRun>>, Vec<&'p PlannedRun>) {
    let of_unit: Vec<Vec<&PlannedRun>> = unit
        .iter()
        .map(|trace| {
            let of_trace = pending.iter().filter(|run| run.trace == trace.path);
            of_trace.copied().collect()
        })
        .collect();
    let mut distinct: Vec<&PlannedRun> = Vec::new();
    for run in of_unit.iter().flatten() {
        if !distinct
            .iter()
            .any(|d| d.name == run.name && d.params == run.params)
        {
            distinct.push(run);
        }
    }
    (of_unit, distinct)
}

/// The live sessions of the questions of `unit`'s recipe, its model from `models`; each question's
/// prompt checked against its trace's.
fn live_runner<'m>(
    unit: &[TraceFile],
    models: &'m mut ModelSlot,
) -> Result<Runner<'m>, SweepError> {
    let recipe = unit[0].recipe.as_ref().expect("a closed loop runs recipes");
    let name = Recipe::load(recipe)
        .map_err(crate::capture::CaptureError::from)?
        .0
        .model()
        .to_owned();
    let model = models.model(&name)?;
    let questions = capture::build_questions(recipe, model)?;
    for (prompt, trace) in questions.prompts.iter().zip(unit) {
        check_same_prompt(recipe, &name, prompt, &trace.path)?;
    }
    let scratch = std::env::temp_dir();
    Ok(Runner::Live(LiveQuestions::start(
        model, &questions, 512, &scratch,
    )?))
}

/// Each of `policies`' outcomes on `runner` (one per trace it runs): one pass for them all, or,
/// when that pass fails (a policy whose error shows only while it runs, such as a Python method
/// that raises), one pass per policy, so that a failure is its own policy's and the others'
/// outcomes stand.
fn run_alone_on_failure(
    runner: &Runner<'_>,
    policies: &[ValidPolicy],
    layer_done: LayerDone<'_>,
) -> Vec<Result<Vec<Outcome>, SweepError>> {
    match runner.run(policies, layer_done) {
        Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
        Err(error) if policies.len() == 1 => vec![Err(error)],
        Err(_) => policies
            .iter()
            .map(|policy| {
                let mut outcome = runner.run(std::slice::from_ref(policy), layer_done)?;
                Ok(outcome.pop().expect("one outcome per policy"))
            })
            .collect(),
    }
}

/// What one runner runs: a trace (open loop), or every trace of one recipe, which a closed loop
/// runs together (the questions a recipe asks of one context share its prefill). `traces` come in
/// the experiment's order, a recipe's questions together.
fn units(traces: &[TraceFile], closed_loop: bool) -> Vec<&[TraceFile]> {
    match closed_loop {
        false => traces.chunks(1).collect(),
        true => traces
            .chunk_by(|a, b| a.recipe == b.recipe && b.question.is_some_and(|q| q > 0))
            .collect(),
    }
}

/// Fails unless the trace captured from `recipe` starts with the prompt `model` builds from it
/// now: a closed-loop run measured against another tokenization's trace would compare two
/// prompts.
fn check_same_prompt(
    recipe: &Path,
    model: &str,
    prompt: &BuiltPrompt,
    trace: &Path,
) -> Result<(), SweepError> {
    let tokens = TraceReader::open(trace)
        .and_then(|reader| reader.tokens())
        .map_err(PolicyError::from)?;
    let recorded = tokens.iter().map(|&t| t as u32);
    let first_difference = recorded
        .zip(&prompt.ids)
        .position(|(a, &b)| a != b)
        .or((tokens.len() < prompt.ids.len()).then_some(tokens.len()));
    match first_difference {
        None => Ok(()),
        Some(position) => Err(SweepError::Tokenization {
            recipe: recipe.to_owned(),
            model: model.to_owned(),
            trace: trace.to_owned(),
            position,
        }),
    }
}

/// The most replayed policies in one pass: their reports (a few hundred KB each at 8K) are what a
/// pass holds besides a layer.
const REPLAY_BATCH: usize = 64;

/// The most live policies in one session pass: a prompt's policies of the calibration, which decode
/// together (the session splits them into batches that fit in memory).
const LIVE_BATCH: usize = 80;

/// `runs` in the fewest passes of at most `most` policies, of near-equal size, ordered by what
/// their scores depend on (score key, then timing), so that the budgets and allocators of one
/// scorer fall into one pass and share its scoring.
fn batches(
    mut runs: Vec<(&PlannedRun, ValidPolicy)>,
    most: usize,
) -> Vec<Vec<(&PlannedRun, ValidPolicy)>> {
    runs.sort_by(|(_, a), (_, b)| {
        (a.score_key(), a.params().timing.name()).cmp(&(b.score_key(), b.params().timing.name()))
    });
    let passes = runs.len().div_ceil(most.max(1)).max(1);
    let size = runs.len().div_ceil(passes).max(1);
    let mut batches = Vec::with_capacity(passes);
    let mut rest = runs.into_iter().peekable();
    while rest.peek().is_some() {
        batches.push(rest.by_ref().take(size).collect());
    }
    batches
}

/// A run's open-loop report, and its closed-loop outcomes when run live.
type Outcome = (ReplayReport, Option<ClosedLoop>);

/// What runs a trace's policies: the open-loop replay of its trace file, or the live sessions of
/// its recipe's questions (closed loop). One is held at a time, so the size of the larger does not
/// matter.
#[allow(clippy::large_enum_variant)]
enum Runner<'m> {
    Replay(TraceReader),
    Live(LiveQuestions<'m>),
}

impl Runner<'_> {
    /// Each policy's open-loop report, and its closed-loop outcomes when run live, on each of the
    /// runner's traces.
    fn run(
        &self,
        policies: &[ValidPolicy],
        layer_done: LayerDone<'_>,
    ) -> Result<Vec<Vec<Outcome>>, SweepError> {
        Ok(match self {
            Runner::Replay(reader) => replay_many(reader, policies, layer_done)?
                .into_iter()
                .map(|report| vec![(report, None)])
                .collect(),
            Runner::Live(questions) => {
                let mut reports = questions.run_many(policies)?;
                let mut by_policy = vec![Vec::new(); policies.len()];
                for question in &mut reports {
                    for (outcomes, live) in by_policy.iter_mut().zip(question.drain(..)) {
                        let closed = ClosedLoop::from(&live);
                        outcomes.push((live.open_loop, Some(closed)));
                    }
                }
                by_policy
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::PolicyParams;

    fn run(index: usize, scorer: &str, budget: usize) -> PlannedRun {
        PlannedRun {
            id: format!("run-{index}"),
            name: scorer.into(),
            trace: "t.safetensors".into(),
            params: PolicyParams {
                scorer: scorer.into(),
                budget,
                ..PolicyParams::default()
            },
        }
    }

    #[test]
    fn batches_keep_a_scorer_together_in_the_fewest_even_passes() {
        // 3 scorers x 4 budgets, interleaved as a plan lists them.
        let planned: Vec<PlannedRun> = (0..12)
            .map(|i| run(i, ["snapkv", "recency", "true-query"][i % 3], 64 << (i / 3)))
            .collect();
        let runs = || {
            planned
                .iter()
                .map(|r| (r, r.params.clone().check().unwrap()))
                .collect::<Vec<_>>()
        };
        let key = |batch: &[(&PlannedRun, ValidPolicy)]| -> Vec<String> {
            let mut keys: Vec<String> = batch.iter().map(|(_, p)| p.score_key().into()).collect();
            keys.dedup();
            keys
        };
        // One pass when they fit.
        let one = batches(runs(), 64);
        assert_eq!(one.len(), 1);
        assert_eq!(key(&one[0]).len(), 3, "sorted: each scorer's runs adjacent");
        // At most 4 a pass: 3 passes of 4, each one scorer's 4 budgets.
        let three = batches(runs(), 4);
        assert_eq!(three.iter().map(Vec::len).collect::<Vec<_>>(), [4, 4, 4]);
        assert!(three.iter().all(|batch| key(batch).len() == 1));
        // At most 5: 3 passes again, near-equal (4 each) rather than 5, 5, 2.
        assert_eq!(
            batches(runs(), 5).iter().map(Vec::len).collect::<Vec<_>>(),
            [4, 4, 4]
        );
        // Every run exactly once.
        let mut ids: Vec<&str> = three.iter().flatten().map(|(r, _)| r.id.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 12);
    }
}
