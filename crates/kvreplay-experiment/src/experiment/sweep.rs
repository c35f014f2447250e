//! Running a sweep: the planned runs of an experiment (or of one shard of it) that are not stored
//! yet, a trace at a time, in batches that share each layer's reading and scoring, each run
//! stored as it finishes.

use super::shard::{plan_shards, Shard};
use super::store::{is_stored, record_failure, store, ClosedLoop};
use super::traces::{captured_into, captured_traces, recipe_traces};
use super::SweepError;
use super::{Experiment, PlannedRun, TraceEntry, TraceFile};
use crate::capture::{self, ModelSlot};
use crate::live::{LiveError, LiveQuestions};
use crate::model::{CausalLm, ModelError};
use crate::recipe::{BuiltPrompt, BuiltQuestions, Recipe};
use crate::replay::{replay_many, Checkpoints, PolicyError, ReplayReport, ValidPolicy};
use crate::stop::Stop;
use crate::trace::StorageDtype;
use crate::trace::TraceReader;
use std::path::Path;

/// Progress of a sweep: `(done, total)` after each batch, done counting skipped runs.
pub type SweepProgress<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// What a sweep did.
#[derive(Debug)]
pub struct Swept {
    /// Runs run.
    pub ran: usize,
    /// Runs already stored.
    pub skipped: usize,
    /// The experiment's traces, in its order (those the sweep captured included).
    pub traces: Vec<TraceFile>,
}

/// Runs every planned run (of `shard` only, when given) of the experiment's traces `entries` not
/// stored yet under `results`, storing each as it finishes; `checkpoints` is called after each
/// layer of each pass and asked within it. A trace's policies run in batches ([`batches`]) that
/// share each layer's reading and decode attention, and whose policies with the same scores share
/// one scoring pass.
/// A recipe not captured yet is captured first (in f16, chunks of 512 tokens); in a closed loop
/// (not a shard), right before its runs, by the live session that runs them: its full runs are
/// the capture's, so they are written as the trace ([`LiveQuestions::capturing`]) instead of
/// run twice. When some runs failed on their own (their errors kept under `results/failed/`),
/// the others still run and are stored, and the sweep ends with [`SweepError::RunsFailed`].
pub fn run_sweep(
    experiment: &Experiment,
    entries: &[TraceEntry],
    results: &Path,
    shard: Option<Shard>,
    (progress, checkpoints): (SweepProgress<'_>, Checkpoints<'_>),
    models: &mut ModelSlot,
) -> Result<Swept, SweepError> {
    let live_capture = experiment.closed_loop && shard.is_none();
    let mut units = Vec::with_capacity(entries.len());
    for entry in entries {
        units.push(match entry {
            TraceEntry::Uncaptured(recipe) if !live_capture => {
                capture_first(recipe, experiment.reads_inputs, models, checkpoints.stop)?
            }
            entry => entry.clone(),
        });
    }
    let sharded = shard.map(|shard| {
        let traces: Vec<TraceFile> = captured(&units).cloned().collect();
        plan_shards(experiment, &traces, shard.count)
            .into_iter()
            .filter(|(_, of)| *of == shard.index)
            .map(|(run, _)| run)
            .collect::<Vec<_>>()
    });
    let total = match &sharded {
        Some(runs) => runs.len(),
        None => experiment.policies.len() * trace_count(&units)?,
    };
    let mut sweep = Sweep {
        experiment,
        results,
        done: 0,
        total,
        skipped: 0,
        failed: Vec::new(),
        progress,
        checkpoints,
    };
    progress(0, total);
    let mut traces = Vec::new();
    for entry in &units {
        let plan = |unit: &[TraceFile]| match &sharded {
            Some(runs) => runs
                .iter()
                .filter(|run| unit.iter().any(|trace| trace.path == run.trace))
                .cloned()
                .collect(),
            None => experiment.plan(unit),
        };
        match entry {
            TraceEntry::Captured(files) => {
                for unit in grouped(files, experiment.closed_loop) {
                    let stop = sweep.checkpoints.stop;
                    sweep.unit(unit, plan(unit), || {
                        runner_of(unit, experiment, (models, stop))
                    })?;
                }
                traces.extend_from_slice(files);
            }
            TraceEntry::Uncaptured(recipe) => {
                let (files, live) =
                    capturing_runner(recipe, experiment, (models, sweep.checkpoints.stop))?;
                sweep.unit(&files, plan(&files), || Ok(live))?;
                traces.extend(files);
            }
        }
    }
    sweep.finish(traces)
}

/// The traces of `entries` captured already.
fn captured(entries: &[TraceEntry]) -> impl Iterator<Item = &TraceFile> {
    entries.iter().flat_map(|entry| match entry {
        TraceEntry::Captured(files) => files.as_slice(),
        TraceEntry::Uncaptured(..) => &[],
    })
}

/// How many traces `entries` stand for, captured or not.
fn trace_count(entries: &[TraceEntry]) -> Result<usize, SweepError> {
    entries
        .iter()
        .map(|entry| match entry {
            TraceEntry::Captured(files) => Ok(files.len()),
            TraceEntry::Uncaptured(recipe) => Ok(recipe_traces(recipe)?.len()),
        })
        .sum()
}

/// Recipe `recipe` captured (in f16, chunks of [`LIVE_CHUNK`], with its attention inputs where
/// `inputs`) unless a concurrent sweep did, and its traces; `stop` is asked after each chunk and
/// token whether to stop there.
fn capture_first(
    recipe: &Path,
    inputs: bool,
    models: &mut ModelSlot,
    stop: Stop<'_>,
) -> Result<TraceEntry, SweepError> {
    capture::capture_once(recipe, &captured_into(recipe), &mut |recipe, trace| {
        let storage = (StorageDtype::F16, LIVE_CHUNK, inputs);
        capture::capture_recipe(recipe, trace, storage, models, &mut |_, _| stop()).map(drop)
    })?;
    Ok(TraceEntry::Captured(captured_traces(recipe)?))
}

/// A sweep under way: where it stores, how far it is, what failed.
struct Sweep<'a> {
    experiment: &'a Experiment,
    results: &'a Path,
    done: usize,
    total: usize,
    skipped: usize,
    failed: Vec<(PlannedRun, String)>,
    progress: SweepProgress<'a>,
    checkpoints: Checkpoints<'a>,
}

impl<'a> Sweep<'a> {
    /// Runs the runs of `planned` on `unit` (one runner's traces) not stored yet, on the runner
    /// `runner` makes (only when some are pending).
    fn unit<'m>(
        &mut self,
        unit: &[TraceFile],
        planned: Vec<PlannedRun>,
        runner: impl FnOnce() -> Result<Runner<'m>, SweepError>,
    ) -> Result<(), SweepError> {
        let pending: Vec<&PlannedRun> = planned
            .iter()
            .filter(|run| !is_stored(self.results, &run.id))
            .collect();
        self.skipped += planned.len() - pending.len();
        self.done += planned.len() - pending.len();
        (self.progress)(self.done, self.total);
        let (of_unit, distinct) = pending_in(unit, &pending);
        if distinct.is_empty() {
            return Ok(());
        }
        let runner = runner()?;
        let checked = distinct
            .into_iter()
            .map(|run| Ok((run, self.experiment.check(&run.params)?)))
            .collect::<Result<Vec<_>, SweepError>>()?;
        let most = match self.experiment.closed_loop {
            true => LIVE_BATCH,
            false => REPLAY_BATCH,
        };
        for batch in batches(checked, most) {
            let (runs, policies): (Vec<&PlannedRun>, Vec<ValidPolicy>) = batch.into_iter().unzip();
            let mut outcomes = run_alone_on_failure(&runner, &policies, self.checkpoints);
            // Asked to stop: what is stored stays, nothing of this batch is stored or failed.
            if let Some(index) = outcomes.iter().position(|o| o.as_ref().is_err_and(stopped)) {
                return Err(outcomes.swap_remove(index).expect_err("a stop"));
            }
            for (run, outcome) in runs.iter().zip(outcomes) {
                for (index, of_trace) in of_unit.iter().enumerate() {
                    let same =
                        |other: &&&PlannedRun| other.name == run.name && other.params == run.params;
                    let Some(pending) = of_trace.iter().find(same) else {
                        continue;
                    };
                    self.store(pending, &unit[index], &outcome.as_ref().map(|o| &o[index]))?;
                }
            }
            (self.progress)(self.done, self.total);
            // A replay hears a stop after each layer, a live batch after each token; between
            // batches too.
            (self.checkpoints.stop)().map_err(PolicyError::from)?;
        }
        Ok(())
    }

    /// Stores `run`'s outcome on `trace`, or its failure.
    fn store(
        &mut self,
        run: &PlannedRun,
        trace: &TraceFile,
        outcome: &Result<&Outcome, &SweepError>,
    ) -> Result<(), SweepError> {
        match outcome {
            Ok((report, closed_loop)) => {
                store(self.results, run, trace, report, closed_loop.clone())?
            }
            Err(error) => {
                let error = crate::error_text(*error);
                record_failure(self.results, run, &error)?;
                self.failed.push((run.clone(), error));
            }
        }
        self.done += 1;
        Ok(())
    }

    /// What the sweep did, or [`SweepError::RunsFailed`] when some runs failed.
    fn finish(self, traces: Vec<TraceFile>) -> Result<Swept, SweepError> {
        let ran = self.total - self.skipped;
        match self.failed.first() {
            None => Ok(Swept {
                ran,
                skipped: self.skipped,
                traces,
            }),
            Some((run, error)) => Err(SweepError::RunsFailed {
                count: self.failed.len(),
                total: ran,
                first_name: run.name.clone(),
                first_trace: run.trace.clone(),
                first_error: error.clone(),
                dir: self.results.join("failed"),
            }),
        }
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

/// The prefill chunk of live sessions and of the captures a sweep makes.
const LIVE_CHUNK: usize = 512;

/// What runs `unit`'s policies: its trace replayed, or in a closed loop the live sessions of its
/// recipe's questions, whose full runs and decoding ask `stop` after each chunk and token.
fn runner_of<'m>(
    unit: &[TraceFile],
    experiment: &Experiment,
    (models, stop): (&'m mut ModelSlot, Stop<'m>),
) -> Result<Runner<'m>, SweepError> {
    if !experiment.closed_loop {
        return Ok(Runner::Replay(
            TraceReader::open(&unit[0].path).map_err(PolicyError::from)?,
        ));
    }
    let recipe = unit[0].recipe.as_ref().expect("a closed loop runs recipes");
    let (name, model, questions) = recipe_questions(recipe, models)?;
    for (prompt, trace) in questions.prompts.iter().zip(unit) {
        check_same_prompt(recipe, &name, prompt, &trace.path)?;
    }
    let scratch = std::env::temp_dir();
    Ok(Runner::Live(LiveQuestions::start_with(
        (model, stop),
        &questions,
        (LIVE_CHUNK, &scratch),
        experiment.reads_inputs,
    )?))
}

/// The live sessions of recipe `recipe`'s questions, which write its traces (unless a concurrent
/// sweep did first, under the capture lock), and those traces; `stop` asked as in [`runner_of`].
fn capturing_runner<'m>(
    recipe: &Path,
    experiment: &Experiment,
    (models, stop): (&'m mut ModelSlot, Stop<'m>),
) -> Result<(Vec<TraceFile>, Runner<'m>), SweepError> {
    let (name, model, questions) = recipe_questions(recipe, models)?;
    let storage = (StorageDtype::F16, LIVE_CHUNK);
    let options = capture::recipe_options(recipe, (&name, model), storage)?;
    let scratch = std::env::temp_dir();
    let mut started = None;
    capture::capture_once(recipe, &captured_into(recipe), &mut |_, trace| {
        let written = (&options, trace, experiment.reads_inputs);
        let live = LiveQuestions::capturing((model, stop), &questions, &scratch, written);
        started = Some(live);
        Ok(())
    })?;
    // A full run that failed or was stopped wrote no trace: its error first.
    let started = started.transpose()?;
    let traces = captured_traces(recipe)?;
    let live = match started {
        Some(started) => started,
        None => {
            for (prompt, trace) in questions.prompts.iter().zip(&traces) {
                check_same_prompt(recipe, &name, prompt, &trace.path)?;
            }
            let recording = (LIVE_CHUNK, scratch.as_path());
            LiveQuestions::start_with(
                (model, stop),
                &questions,
                recording,
                experiment.reads_inputs,
            )?
        }
    };
    Ok((traces, Runner::Live(live)))
}

/// Recipe file `recipe`'s model name, the model (from `models`) and its questions.
fn recipe_questions<'m>(
    recipe: &Path,
    models: &'m mut ModelSlot,
) -> Result<(String, &'m (dyn CausalLm + Send), BuiltQuestions), SweepError> {
    let name = Recipe::load(recipe)
        .map_err(crate::capture::CaptureError::from)?
        .0
        .model()
        .to_owned();
    let model = models.model(&name)?;
    let questions = capture::build_questions(recipe, model)?;
    Ok((name, model, questions))
}

/// Each of `policies`' outcomes on `runner` (one per trace it runs): one pass for them all, or,
/// when that pass fails (a policy whose error shows only while it runs, such as a Python method
/// that raises), one pass per policy, so that a failure is its own policy's and the others'
/// outcomes stand.
fn run_alone_on_failure(
    runner: &Runner<'_>,
    policies: &[ValidPolicy],
    checkpoints: Checkpoints<'_>,
) -> Vec<Result<Vec<Outcome>, SweepError>> {
    match runner.run(policies, checkpoints) {
        Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
        Err(error) if policies.len() == 1 || stopped(&error) => vec![Err(error)],
        Err(_) => policies
            .iter()
            .map(|policy| {
                let mut outcome = runner.run(std::slice::from_ref(policy), checkpoints)?;
                Ok(outcome.pop().expect("one outcome per policy"))
            })
            .collect(),
    }
}

/// Whether `error` is a stop the caller asked for (Ctrl-C), not a failure of the run.
fn stopped(error: &SweepError) -> bool {
    match error {
        SweepError::Policy(PolicyError::Stopped(_)) => true,
        SweepError::Live(live) => matches!(
            **live,
            LiveError::Policy(PolicyError::Stopped(_)) | LiveError::Model(ModelError::Stopped(_))
        ),
        _ => false,
    }
}

/// What one runner runs: a trace (open loop), or every trace of one recipe, which a closed loop
/// runs together (the questions a recipe asks of one context share its prefill). `traces` come in
/// the experiment's order, a recipe's questions together.
fn grouped(traces: &[TraceFile], closed_loop: bool) -> Vec<&[TraceFile]> {
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
        checkpoints: Checkpoints<'_>,
    ) -> Result<Vec<Vec<Outcome>>, SweepError> {
        Ok(match self {
            Runner::Replay(reader) => replay_many(reader, policies, checkpoints)?
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
