//! Running a sweep: the planned runs of an experiment (or of one shard of it) that are not stored
//! yet, a trace at a time, in batches that share each layer's reading and scoring, each run
//! stored as it finishes.

use super::shard::{plan_shards, Shard};
use super::store::{is_stored, record_failure, store, ClosedLoop};
use super::SweepError;
use super::{Experiment, PlannedRun, TraceFile};
use crate::capture;
use crate::live::LiveSession;
use crate::model::CausalLm;
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
    progress: SweepProgress<'_>,
    layer_done: LayerDone<'_>,
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
    let mut model: Option<(String, Box<dyn CausalLm + Send>)> = None;
    let mut failed: Vec<(&PlannedRun, String)> = Vec::new();
    for (entry, trace) in experiment.traces.iter().zip(traces) {
        let of_trace: Vec<&&PlannedRun> =
            pending.iter().filter(|r| r.trace == trace.path).collect();
        if of_trace.is_empty() {
            continue;
        }
        let runner = if experiment.closed_loop {
            let name = Recipe::load(entry)
                .map_err(crate::capture::CaptureError::from)?
                .0
                .model()
                .to_owned();
            if model.as_ref().is_none_or(|(loaded, _)| *loaded != name) {
                model = Some((name.clone(), capture::load_model(&name)?));
            }
            let model = model
                .as_ref()
                .map(|(_, model)| model.as_ref())
                .expect("loaded");
            let prompt = capture::build_prompt(entry, model)?;
            check_same_prompt(entry, &name, &prompt, &trace.path)?;
            Runner::Live(LiveSession::start(
                model,
                &prompt,
                512,
                &std::env::temp_dir(),
            )?)
        } else {
            Runner::Replay(TraceReader::open(&trace.path).map_err(PolicyError::from)?)
        };
        let checked = of_trace
            .iter()
            .map(|run| Ok((**run, experiment.check(&run.params)?)))
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
                match outcome {
                    Ok((report, closed_loop)) => store(results, run, trace, &report, closed_loop)?,
                    Err(error) => {
                        let error = crate::error_text(&error);
                        record_failure(results, run, &error)?;
                        failed.push((*run, error));
                    }
                }
            }
            done += runs.len();
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

/// Each of `policies`' outcome on `runner`: one pass for them all, or, when that pass fails (a
/// policy whose error shows only while it runs, such as a Python method that raises), one pass
/// per policy, so that a failure is its own policy's and the others' outcomes stand.
fn run_alone_on_failure(
    runner: &Runner<'_>,
    policies: &[ValidPolicy],
    layer_done: LayerDone<'_>,
) -> Vec<Result<Outcome, SweepError>> {
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

/// What runs a trace's policies: the open-loop replay of its trace file, or a live session of its
/// recipe (closed loop). One is held per trace, so the size of the larger does not matter.
#[allow(clippy::large_enum_variant)]
enum Runner<'m> {
    Replay(TraceReader),
    Live(LiveSession<'m>),
}

impl Runner<'_> {
    /// Each policy's open-loop report, and its closed-loop outcomes when run live.
    fn run(
        &self,
        policies: &[ValidPolicy],
        layer_done: LayerDone<'_>,
    ) -> Result<Vec<Outcome>, SweepError> {
        Ok(match self {
            Runner::Replay(reader) => replay_many(reader, policies, layer_done)?
                .into_iter()
                .map(|report| (report, None))
                .collect(),
            Runner::Live(session) => session
                .run_many(policies)?
                .into_iter()
                .map(|live| {
                    let closed = ClosedLoop::from(&live);
                    (live.open_loop, Some(closed))
                })
                .collect(),
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
