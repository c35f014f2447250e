//! Closed loop: a policy holds the native model's real KV cache while the model runs, and what the
//! model then does is measured against the same model with its full cache.
//!
//! One live run of a recipe under a policy:
//! 1. **Full run.** The prompt is prefilled and `generate` tokens are decoded greedily with the
//!    full cache, recording every layer's q, k, v (as a capture does) and the next-token
//!    distribution of every step.
//! 2. **Kept sets.** The run's recording, an f32 kvtrace/1 trace held in memory (the bytes a
//!    capture's file would hold), goes through the same engine code as an open-loop replay
//!    (`replay_keeping`: its layer budgets and kept sets), so a live run chooses exactly what a
//!    replay of that trace chooses.
//!    Under the `prefill` timing the choice reads only the prompt's vectors, which the full run
//!    and the live run share (the eviction happens after the prefill); oracles that need future
//!    queries read them from the full run, and the report says so.
//! 3. **Teacher-forced.** From the prefilled cache, the full run's tokens are fed back with each
//!    query head masked off its evicted positions; at each step the policy's next-token
//!    distribution is compared with the full run's: KL(p_full ‖ p_policy), top-1 agreement, and
//!    the log-probability lost on the full run's token. Step 0's distribution comes from the
//!    prefill itself (identical in both runs) and is left out. Under the question-agnostic
//!    protocol the cut falls where the question starts: the question runs again over the
//!    context's cache without the evicted positions (and is kept), so step 0 is compared too.
//! 4. **Free-running.** From the same prefilled cache, greedy decoding under the policy: its text,
//!    and task success (the share of the recipe's answers the text holds, or, without any, the
//!    same text as the full run).
//!
//! Timings that evict while the prompt runs or while decoding (`streaming`,
//! `prefill-then-stream`, `per-step`, `per-step-prompt`) run inside the model instead
//! ([`streams`]): at each layer the scorer code of the open-loop replay takes the live q, k, v
//! position by position and each query attends over what its cache then held, so later layers'
//! vectors (and the tokens) drift from the full run's as they would in a real compressed cache.
//! Their layer budgets come from the full run's recording (the same as the open-loop replay's;
//! an allocator that reads the prompt's vectors reads the full run's prompt); their scorers must
//! be causal (an oracle needing future queries runs under `prefill` only). A `streaming` policy
//! already changes the prompt's last logits, so its teacher-forced steps start at step 0.
//!
//! Those that evict nothing while the prompt runs start from the full run's prefill instead, their
//! streams fed its recorded prompt vectors (the ones their own prefill makes). Under the
//! question-agnostic protocol (`prefill-then-stream` and `per-step-prompt` too) the streams cut
//! where the question starts: they are fed the context, and the question runs over the context's
//! cache under them, its tokens their first decode steps. The policies of a
//! session decode together ([`batch`]): each step one forward pass whose rows are the policies,
//! each row's numbers those it gets alone.
//!
//! A policy that stores its kept entries otherwise than captured (a quantizer, pruned key
//! channels, merged values) runs on what its caches store ([`stored`]): from the cut on, the
//! entries its storage changes are written over the model's cache before each step's queries
//! attend, so the model reads the dequantized, pruned or merged vectors, of its own making. Such
//! a row takes its tokens one at a time, since what the cache stores changes from step to step.
//!
//! Every run also measures the live attention ([`drift`]): per layer, the share of each live
//! query's attention over the whole live cache that its kept set holds, over the teacher-forced
//! steps; beside the open-loop retained mass it shows where the model's own vectors drift.

mod batch;
mod compare;
mod drift;
mod prefill_start;
mod stored;
pub mod streams;

use crate::capture::{
    input_weights, prefill_questions, recording_bytes, write_question, CaptureError,
    CaptureOptions, Passes, Progress, PromptRun, RecordedPass,
};
use crate::model::Recorder;
use crate::model::{AttentionMask, CausalLm, ChunkVectors, Entry, Evicted, KvCache, ModelError};
use crate::recipe::{BuiltPrompt, BuiltQuestions};
use crate::replay::{
    compressed_layers, protocol_view, replay_keeping, Granularity, Kept, PolicyError, Protocol,
    ReplayReport, Storage, Timing, ValidPolicy,
};
use crate::stop::{Stop, NEVER};
use crate::trace::{AttentionWeights, LayerTensors, StorageDtype, TraceMeta, TraceReader};
use batch::PolicyMask;
use candle_core::Tensor;
pub use compare::compare_step;
pub(crate) use compare::FullStep;
use drift::CompressedLayers;
use prefill_start::prefill_start;
use rayon::prelude::*;
use serde::Serialize;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use stored::{Store, Stored};
use streams::{AttentionShape, LiveStreams};

/// Positions a probe's streams take at a time: it steps fewer than this many past the first
/// query that loses sight of a position.
const PROBE_PIECE: usize = 32;

/// What a live session's recording is called where a trace's file would be named: it is held in
/// memory, never written.
const RECORDING: &str = "the full-cache run's f32 recording";

/// Errors of a live run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LiveError {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The full run could not be recorded.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The policy failed on the full run's recording.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The policy cannot run live yet.
    #[error("live mode: {0}")]
    Unsupported(String),
    /// Live mode was given something other than a recipe.
    #[error("{0}: live mode runs the model on a recipe (a .toml file), not on a trace")]
    NotARecipe(PathBuf),
}

/// One teacher-forced decode step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LiveStep {
    /// KL(p_full ‖ p_policy) of the next-token distributions, nats.
    pub kl: f64,
    /// Whether the policy's most likely token is the full run's.
    pub top1: bool,
    /// log p_full(token) − log p_policy(token) for the full run's token.
    pub logprob_lost: f64,
}

/// What a policy did to the running model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveReport {
    /// The policy's label.
    pub policy: String,
    /// The full run's greedy text.
    pub full_text: String,
    /// The policy's free-running greedy text.
    pub text: String,
    /// Task success of the free-running text: every expected string of the recipe found (or,
    /// for recipes without one, the full run's text).
    pub answer_ok: bool,
    /// Whether the full run itself succeeded (a policy can only lose what the model had).
    pub full_answer_ok: bool,
    /// The free-running text's task score: the share of the recipe's expected strings it
    /// contains (RULER's `string_match_all`), or 1/0 for the full run's text.
    pub answer_score: f64,
    /// The full run's task score.
    pub full_answer_score: f64,
    /// Teacher-forced steps: from step 1 (step 0 comes from the full prefill, identical in both
    /// runs) unless prompt tokens run under the policy (a `streaming` timing, or the question
    /// over the compressed context under the question-agnostic protocol), then from step 0.
    pub steps: Vec<LiveStep>,
    /// Mean KL over the teacher-forced steps.
    pub kl: f64,
    /// Share of steps whose top-1 token agrees.
    pub top1: f64,
    /// Mean log-probability lost.
    pub logprob_lost: f64,
    /// Whether the kept sets read the full run's future queries (an oracle).
    pub uses_full_run_future: bool,
    /// Per layer, the share of each live query's attention over the whole live cache that its
    /// kept set holds, mean over the teacher-forced steps and query heads.
    pub live_layers: Vec<f64>,
    /// Their mean over layers: the live counterpart of the open-loop `retained_mass`.
    pub live_retained_mass: f64,
    /// The open-loop replay of the same policy on the full run's recording.
    pub open_loop: ReplayReport,
}

/// The full-cache run: its tokens, the next-token logits before each, and its cache after the
/// prefill.
struct FullRun {
    prefilled: KvCache,
    /// The prompt positions its prefill ran as one sequence of chunks from position 0: the
    /// context the questions share (the whole prompt for one question).
    first_segment: usize,
    prefill_logits: Vec<f32>,
    tokens: Vec<u32>,
    /// `logits[i]` predicts `tokens[i + 1]`.
    logits: Vec<Vec<f32>>,
    /// The hidden states entering the model's residual layer at every position it ran, where
    /// the model records them ([`CausalLm::residual_layer`]).
    residual: Option<Tensor>,
}

/// A question's full run, its recording and its reconstruction pass (where the recipe asks for
/// one).
type FullRecording = (FullRun, Recorder, Option<Arc<RecordedPass>>);

/// Sees each question's full run as it is recorded: `(question, generated tokens, recording,
/// reconstruction pass)`.
type OnRecording<'a, E> =
    &'a mut dyn FnMut(usize, &[u32], &Recorder, Option<&RecordedPass>) -> Result<(), E>;

/// The full-cache runs of the questions of `questions` ([`prefill_questions`]: the shared context
/// prefilled once, in chunks of `chunk` tokens, recorded under `scratch`, with the attention
/// inputs where `inputs`), each then decoded greedily, with its recording, which
/// `recorded(question, generated tokens, recording)` sees first. One question whose prompt is
/// all context is the plain full run.
fn full_runs<E: From<ModelError> + From<CaptureError>>(
    (model, stop): (&dyn CausalLm, Stop<'_>),
    questions: &BuiltQuestions,
    (chunk, scratch, inputs): (usize, &Path, bool),
    recorded: OnRecording<'_, E>,
) -> Result<Vec<FullRecording>, E> {
    let mut runs = Vec::new();
    let mut passes = Passes::default();
    let mut decode = |index: usize, run: PromptRun, _: &mut Progress<'_>| {
        let PromptRun {
            mut cache,
            logits: prefill_logits,
            mut recorder,
        } = run;
        let prefilled = cache.clone();
        let recorded_pass = passes.of(model, (questions, index), &prefilled, chunk)?;
        let mut logits = Vec::new();
        let tokens = model.decode_greedy(
            &mut cache,
            &prefill_logits,
            questions.prompts[index].generate,
            Some(&mut recorder),
            None,
            &mut |step| {
                logits.push(step.to_vec());
                stop()
            },
        )?;
        recorded(index, &tokens, &recorder, recorded_pass.as_deref())?;
        let residual = recorder.residual()?;
        let run = FullRun {
            residual,
            prefilled,
            first_segment: questions.shared,
            prefill_logits,
            tokens,
            logits,
        };
        runs.push((run, recorder, recorded_pass));
        Ok::<(), E>(())
    };
    prefill_questions(
        model,
        questions,
        (chunk, scratch, inputs),
        &mut |_| stop(),
        &mut decode,
    )?;
    // They came last question first.
    runs.reverse();
    Ok(runs)
}

/// Whether `policy` can run live: an oracle that reads future queries gets them from the full
/// run, which only the `prefill` timing can use (the others run the model's own queries); a cache
/// stored otherwise than captured is one per KV head, as the model's cache is.
pub fn check_live(policy: &ValidPolicy) -> Result<(), LiveError> {
    let timing = policy.params().timing;
    if !policy.storage().is_captured() && policy.params().gqa == Granularity::QueryHead {
        let params = policy.params();
        let axis = match policy.storage() {
            Storage::Quantized(_) => format!("quantizer `{}`", params.quantizer),
            Storage::PrunedKeys(_) => format!("channels `{}`", params.channels),
            _ => format!("merge `{}`", params.merge),
        };
        return Err(LiveError::Unsupported(format!(
            "{axis} runs live on one cache per KV head (`gqa = kv-head` or `layer`), which the \
             query heads of a group share; under `gqa = query-head` each would store its own, \
             which is replayed only (`kvreplay replay` or an open-loop sweep)"
        )));
    }
    if timing != Timing::Prefill && policy.scorer().reads_future() {
        return Err(LiveError::Unsupported(format!(
            "scorer `{}` reads future queries, which live mode takes from the full run under \
             the `prefill` timing only, not `{}`",
            policy.params().scorer,
            timing.name()
        )));
    }
    Ok(())
}

/// Per layer and query head, the positions before the cut `prompt_len` that a policy's kept sets
/// (one [`Kept`] per layer) leave out.
fn evicted_positions(kept: &[Kept], n_heads: usize, prompt_len: usize) -> Evicted {
    kept.iter()
        .map(|layer| {
            let mut heads = vec![Vec::new(); n_heads];
            for (unit, unit_kept) in layer.units.iter().zip(&layer.kept) {
                let mut keep = vec![false; prompt_len];
                for &position in unit_kept.kept_positions(0, prompt_len).iter() {
                    if position < prompt_len {
                        keep[position] = true;
                    }
                }
                let gone: Vec<usize> = (0..prompt_len).filter(|&p| !keep[p]).collect();
                for head in unit.query_heads.clone() {
                    heads[head] = gone.clone();
                }
            }
            heads
        })
        .collect()
}

/// A recipe's full-cache run, shared by every policy run live on it: the cache after the
/// prefill, the full continuation with its next-token logits, and its recording as an f32 trace
/// held in memory ([`TraceReader::from_bytes`]).
pub struct LiveSession<'m> {
    model: &'m dyn CausalLm,
    prompt: BuiltPrompt,
    /// Prefill chunk size.
    chunk: usize,
    full: FullRun,
    trace: TraceReader,
    /// Asked before each decoding step whether to stop there.
    stop: Stop<'m>,
}

impl<'m> LiveSession<'m> {
    /// Runs `prompt` with the full cache (prefill in chunks of `chunk` tokens, the recording
    /// spilled to files under `scratch` while it runs) and holds its recording in memory.
    pub fn start(
        model: &'m dyn CausalLm,
        prompt: &BuiltPrompt,
        chunk: usize,
        scratch: &Path,
    ) -> Result<Self, LiveError> {
        Self::start_stopping((model, NEVER), prompt, chunk, scratch)
    }

    /// [`start`](Self::start), `stop` asked after each chunk and token of the full run and
    /// before each decoding step of the policies.
    pub fn start_stopping(
        (model, stop): (&'m dyn CausalLm, Stop<'m>),
        prompt: &BuiltPrompt,
        chunk: usize,
        scratch: &Path,
    ) -> Result<Self, LiveError> {
        let questions = BuiltQuestions::one(prompt.clone());
        let mut questions =
            LiveQuestions::start_stopping((model, stop), &questions, (chunk, scratch))?;
        Ok(questions.sessions.pop().expect("one question, one session"))
    }

    /// The session of `prompt`'s full run, its recording held in memory as an f32 trace.
    fn recorded(
        (model, stop): (&'m dyn CausalLm, Stop<'m>),
        prompt: &BuiltPrompt,
        (chunk, projections): (usize, Option<&[AttentionWeights]>),
        (full, recorder, recorded_pass): FullRecording,
    ) -> Result<Self, LiveError> {
        if full.tokens.len() < 2 {
            return Err(LiveError::Unsupported(
                "the full run generated fewer than 2 tokens: nothing to compare".into(),
            ));
        }
        let options = CaptureOptions {
            storage: StorageDtype::F32,
            chunk,
            recipe_name: "live".into(),
            model_id: model.spec().name.clone(),
        };
        let recorded = (&recorder, projections, recorded_pass.as_deref());
        let label = Path::new(RECORDING);
        let bytes = recording_bytes(model, prompt, &full.tokens, recorded, &options, label)
            .map_err(CaptureError::from)?;
        drop(recorder);
        // Recorded at f32 for the kept sets' sake; bytes counted as a capture's default dtype
        // stores them, so a budget in bytes keeps what it keeps on a capture of the same run.
        let trace = TraceReader::from_bytes(label, Arc::new(bytes))
            .map_err(PolicyError::from)?
            .counting_elements_at(StorageDtype::default().element_bytes());
        Ok(Self {
            model,
            prompt: prompt.clone(),
            chunk,
            full,
            trace,
            stop,
        })
    }

    /// Runs the prompt live under `policy` and measures it against the full run.
    pub fn run(&self, policy: &ValidPolicy) -> Result<LiveReport, LiveError> {
        let mut reports = self.run_many(std::slice::from_ref(policy))?;
        Ok(reports.pop().expect("one report per policy"))
    }

    /// [`run`](Self::run) for several policies: their open-loop metrics (and the `prefill`
    /// timing's kept sets) come from one replay pass over the recording, then they decode
    /// together ([`Batching::BATCHED`]). The reports come back in the order of `policies`; no
    /// number depends on the batching.
    pub fn run_many(&self, policies: &[ValidPolicy]) -> Result<Vec<LiveReport>, LiveError> {
        self.run_batched(policies, Batching::BATCHED)
    }

    /// [`run_many`](Self::run_many) batched as `batching` says.
    pub fn run_batched(
        &self,
        policies: &[ValidPolicy],
        batching: Batching,
    ) -> Result<Vec<LiveReport>, LiveError> {
        for policy in policies {
            check_live(policy)?;
        }
        let runs = replay_keeping(&self.trace, policies, self.stop)?;
        self.decode_runs(runs.into_iter().zip(policies).collect(), batching)
    }

    /// The policies of `runs`, their open-loop reports and kept sets computed, decoded live as
    /// `batching` says.
    fn decode_runs(
        &self,
        runs: Vec<OpenLoopRun<'_>>,
        batching: Batching,
    ) -> Result<Vec<LiveReport>, LiveError> {
        let groups = self.batches(runs, batching);
        // Collected before the first failure is taken, so that it is the first group's in order
        // whichever thread met it first.
        let outcomes: Vec<Result<Vec<LiveReport>, LiveError>> = match batching.rows {
            Some(1) => groups
                .into_par_iter()
                .map(|group| self.run_group(group, batching))
                .collect(),
            _ => groups
                .into_iter()
                .map(|group| self.run_group(group, batching))
                .collect(),
        };
        let reports = outcomes.into_iter().collect::<Result<Vec<_>, _>>()?;
        Ok(reports.into_iter().flatten().collect())
    }

    /// Whether rows that start from the full run's cache read its prompt positions from it: the
    /// batching asks for it and the model's family can.
    fn shares_prompt(&self, batching: Batching) -> bool {
        batching.shared_prompt && self.model.attends_over_prefixes()
    }

    /// The most positions a live run holds: the prompt, the longer of the full run and the
    /// generation, and one more.
    fn capacity(&self) -> usize {
        self.prompt.ids.len() + self.full.tokens.len().max(self.prompt.generate) + 1
    }

    /// `runs` in batches, in order: at most `batching.rows` each when given, else as many as fit
    /// in half the available memory (by [`batch::row_bytes`]).
    fn batches<'r>(
        &self,
        mut runs: Vec<OpenLoopRun<'r>>,
        batching: Batching,
    ) -> Vec<Vec<OpenLoopRun<'r>>> {
        let capacity = self.capacity();
        let prefixed = self.shares_prompt(batching);
        let bytes: Vec<usize> = runs
            .iter()
            .map(|&(_, policy)| {
                let own = self.prefills_on_its_own(policy);
                let shape = (capacity, own, batching.windowed_copies, prefixed);
                batch::row_bytes(self.trace.meta(), policy, shape)
            })
            .collect();
        let room = crate::sys::available_memory() / 2;
        let mut batches = Vec::new();
        for size in batch_sizes(&bytes, room, batching.rows).into_iter().rev() {
            batches.push(runs.split_off(runs.len() - size));
        }
        batches.reverse();
        batches
    }

    /// One batch: each policy started at the prompt's end (its own masked prefill when it evicts
    /// while the prompt runs, on worker threads), then decoded together.
    fn run_group(
        &self,
        group: Vec<OpenLoopRun<'_>>,
        batching: Batching,
    ) -> Result<Vec<LiveReport>, LiveError> {
        let recorded = RecordedLayers::new(&self.trace);
        let started = group
            .into_par_iter()
            .map(|((mut open_loop, kept), policy)| {
                open_loop.trace = RECORDING.into();
                self.prompt_end(policy, &kept, open_loop, (batching, &recorded))
            })
            .collect::<Result<Vec<_>, LiveError>>()?;
        let full = &self.full;
        let reference = batch::Reference {
            model: self.model,
            meta: self.trace.meta(),
            tokens: &full.tokens,
            logits: &full.logits,
            prefill_logits: &full.prefill_logits,
            generate: self.prompt.generate,
            forced_in_one_pass: batching.forced_in_one_pass,
            resumed_free_runs: batching.resumed_free_runs,
            windowed_copies: batching.windowed_copies,
            shared_prompt: self.shares_prompt(batching),
            stop: self.stop,
        };
        Ok(batch::decode(&reference, started)?
            .into_iter()
            .map(|decoded| self.report(decoded))
            .collect())
    }

    /// `policy` at the prompt's end. A `prefill` cut masks its evicted positions in the full
    /// run's prefilled cache. A policy that streams or re-selects only once decoding starts
    /// shares that cache too when `batching` shares prefills and its prefill
    /// [is the full run's](prefill_is_shareable), its streams fed the full run's recorded
    /// prompt vectors (the ones its own prefill makes); any other prefills on its own, its
    /// streams holding the model's cache, from where it first evicts and, when `batching` enters
    /// prefills, from the first global layer ([`own_prefill_entry`](Self::own_prefill_entry)).
    fn prompt_end<'s>(
        &'s self,
        policy: &'s ValidPolicy,
        kept: &[Kept],
        open_loop: ReplayReport,
        (batching, recorded): (Batching, &RecordedLayers<'_>),
    ) -> Result<batch::Started<'s>, LiveError> {
        let meta = self.trace.meta();
        let compressed = compressed_layers(meta, policy);
        let timing = policy.params().timing;
        let prompt_len = meta.prompt_len;
        let stored = |inner, cut, recorded_until| -> Result<_, LiveError> {
            let layers = (meta, compressed.as_slice());
            let store = Store::new(
                policy,
                layers,
                (cut, self.capacity()),
                (recorded, recorded_until),
            )?;
            Ok(CompressedLayers::new(
                Stored::new(inner, store),
                &compressed,
                meta.n_layers,
            ))
        };
        let cut = self.cut(policy)?;
        let (mask, cache, prompt_logits) = if timing == Timing::Prefill {
            let evicted = evicted_positions(kept, meta.n_heads, cut);
            let mut mask = stored(PolicyMask::Fixed(evicted), cut, cut)?;
            let question = self.question_over_context(cut, &mut mask)?;
            (mask, question.0, question.1)
        } else if batching.share_prefill && prefill_is_shareable(meta, policy) {
            let mut streams = self.streams(policy, (cut, &open_loop))?;
            self.feed_prompt(&mut streams, &compressed, recorded, cut)?;
            let mut mask = stored(PolicyMask::Streams(streams), cut, cut)?;
            let question = self.question_over_context(cut, &mut mask)?;
            (mask, question.0, question.1)
        } else {
            let (start, mut streams) = match batching.share_prefill {
                true => {
                    let probe = self.streams(policy, (cut, &open_loop))?;
                    self.own_prefill_start(probe, &compressed, recorded, cut)?
                }
                false => (0, self.streams(policy, (cut, &open_loop))?),
            };
            self.feed_prompt(&mut streams, &compressed, recorded, start)?;
            let mut mask = stored(PolicyMask::Streams(streams), cut, start)?;
            let mut cache = match start {
                0 => KvCache::default(),
                _ => self
                    .full
                    .prefilled
                    .truncated(start)
                    .with_room(self.capacity() - start)?,
            };
            // The chunks the prefill from position 0 would run, the first cut short at `start`.
            let aligned = start.next_multiple_of(self.chunk.max(1)).min(cut);
            let entry = match batching.entered_prefills {
                true => self.own_prefill_entry(&compressed, cut),
                false => None,
            };
            let mut logits = Vec::new();
            for tokens in [start..aligned, aligned..cut, cut..prompt_len] {
                if !tokens.is_empty() {
                    logits = self.run_tokens((tokens, cut), &mut cache, (&mut mask, entry))?;
                }
            }
            (mask, Some(cache), Some(logits))
        };
        Ok(batch::Started {
            policy,
            mask,
            cache: cache.map_or(Cow::Borrowed(&self.full.prefilled), Cow::Owned),
            prompt_logits: prompt_logits
                .map_or(Cow::Borrowed(&self.full.prefill_logits), Cow::Owned),
            open_loop,
        })
    }

    /// Under the question-agnostic protocol (`cut` before the prompt's end), the question run
    /// over the context's cache under `mask` and appended uncompressed: the cache after it and
    /// its last logits. `(None, None)` when the cut is the prompt's end.
    fn question_over_context(
        &self,
        cut: usize,
        mask: &mut CompressedLayers<Stored<PolicyMask<'_>>>,
    ) -> Result<(Option<KvCache>, Option<Vec<f32>>), LiveError> {
        let prompt_len = self.prompt.ids.len();
        if cut == prompt_len {
            return Ok((None, None));
        }
        let mut cache = self
            .full
            .prefilled
            .truncated(cut)
            .with_room(self.capacity() - cut)?;
        let logits = self.run_tokens((cut..prompt_len, cut), &mut cache, (mask, None))?;
        Ok((Some(cache), Some(logits)))
    }

    /// Runs the prompt's tokens `tokens` over `cache` under `mask`, in the session's chunks (a
    /// token at a time from the cut `cut` on when the caches are stored otherwise than captured,
    /// each token a step of their storage), entering the model at the layer `entry` gives with
    /// the full run's hidden states there, when given; the last logits.
    fn run_tokens(
        &self,
        (tokens, cut): (std::ops::Range<usize>, usize),
        cache: &mut KvCache,
        (mask, entry): (
            &mut CompressedLayers<Stored<PolicyMask<'_>>>,
            Option<(usize, &Tensor)>,
        ),
    ) -> Result<Vec<f32>, LiveError> {
        let piece = match mask.inner().is_captured() || tokens.end <= cut {
            true => self.chunk.max(1),
            false => 1,
        };
        let mut logits = Vec::new();
        let mut first = tokens.start;
        for piece in self.prompt.ids[tokens].chunks(piece) {
            // An own prefill runs a whole prompt: asked at each chunk (or token), a stop ends it
            // there instead of after every policy's prefill.
            (self.stop)().map_err(ModelError::from)?;
            logits = match entry {
                Some((layer, residual)) => {
                    let entry = Entry {
                        layer,
                        hidden: residual
                            .narrow(0, first, piece.len())
                            .map_err(ModelError::from)?,
                        below: &self.full.prefilled,
                    };
                    let mask = Some(&mut *mask as &mut dyn AttentionMask);
                    self.model.forward_entering(piece, cache, mask, entry)?
                }
                None => self
                    .model
                    .forward_masked(piece, cache, None, Some(&mut *mask))?,
            };
            first += piece.len();
        }
        Ok(logits)
    }

    /// Where an own prefill of the prompt cut at `cut` by a policy compressing layers
    /// `compressed` enters the model: the model's residual layer, with the full run's hidden
    /// states there, when no layer below it is compressed and the prefill runs the full run's
    /// chunks (one sequence of them over the whole prompt, not cut), so that the layers below
    /// compute what the full run computed ([`prefill_start`] keeps their sums where the prefill
    /// starts inside a chunk); `None` otherwise.
    fn own_prefill_entry(&self, compressed: &[usize], cut: usize) -> Option<(usize, &Tensor)> {
        let layer = self.model.residual_layer()?;
        let whole = self.prompt.ids.len();
        let runs_the_full_chunks = cut == whole && self.full.first_segment == whole;
        let below_kept = compressed.iter().all(|&compressed| compressed >= layer);
        let residual = self.full.residual.as_ref()?;
        (runs_the_full_chunks && below_kept).then_some((layer, residual))
    }

    /// Whether `policy`, batched, runs the prompt on its own (see [`prefills_on_its_own`]).
    pub fn prefills_on_its_own(&self, policy: &ValidPolicy) -> bool {
        prefills_on_its_own(self.trace.meta(), policy)
    }

    /// Where `policy` cuts the prompt: its end, or under the question-agnostic protocol where
    /// the question starts.
    fn cut(&self, policy: &ValidPolicy) -> Result<usize, LiveError> {
        let view = protocol_view(&self.trace, policy)?;
        Ok(view.map_or(self.trace.meta().prompt_len, |view| view.meta().prompt_len))
    }

    /// The streams of a policy that evicts while the model runs, on the layers it compresses,
    /// with the budgets its open-loop replay `open_loop` gave them, the prompt cut at `cut`.
    fn streams<'s>(
        &'s self,
        policy: &'s ValidPolicy,
        (cut, open_loop): (usize, &ReplayReport),
    ) -> Result<LiveStreams<'s>, LiveError> {
        let meta = self.trace.meta();
        let shape = AttentionShape {
            n_heads: meta.n_heads,
            n_kv_heads: meta.n_kv_heads,
            head_dim: meta.head_dim,
            scale: meta.scale,
            softcap: meta.softcap,
        };
        let capacity = self.capacity();
        let compressed = compressed_layers(meta, policy);
        let budgets = compressed
            .iter()
            .map(|&layer| {
                let report = open_loop.layers.iter().find(|report| report.layer == layer);
                report.map(|report| report.budget).ok_or_else(|| {
                    LiveError::Unsupported(format!(
                        "the open-loop replay measured no layer {layer}, which the policy \
                         compresses"
                    ))
                })
            })
            .collect::<Result<_, _>>()?;
        let rope_thetas = compressed.iter().map(|&l| meta.rope_theta_of(l)).collect();
        let windows = compressed.iter().map(|&l| meta.window(l)).collect();
        Ok(LiveStreams::new(
            policy,
            (budgets, rope_thetas, windows),
            shape,
            cut,
            capacity,
        ))
    }

    /// Feeds the full run's recorded vectors of the prompt's first `until` positions (the
    /// context, under the question-agnostic protocol, or the part of the prompt an own prefill
    /// shares with the full run) to `streams` (on model layers `compressed`) in the prefill's
    /// chunks, as the model's own prefill would; fails if the policy hides any of them from a
    /// query among them, since the prompt then runs differently.
    fn feed_prompt(
        &self,
        streams: &mut LiveStreams<'_>,
        compressed: &[usize],
        recorded: &RecordedLayers<'_>,
        until: usize,
    ) -> Result<(), LiveError> {
        let chunk = self.chunk.max(1);
        match self.first_hidden(streams, compressed, recorded, (until, chunk))? {
            None => Ok(()),
            Some(_) => Err(LiveError::Unsupported(format!(
                "timing `{}` evicted during the prompt, which only `streaming` may",
                streams.policy().params().timing.name()
            ))),
        }
    }

    /// Feeds the full run's recorded vectors of the prompt's first `until` positions to
    /// `streams` (on model layers `compressed`) in pieces of `piece` positions (aligned to its
    /// multiples; the streams take positions one at a time, so their choices do not depend on
    /// it), layer by layer, each layer up to the piece in which a query first loses sight of a
    /// position up to its own, or up to an earlier layer's such query: the first of those
    /// queries' positions, if any.
    fn first_hidden(
        &self,
        streams: &mut LiveStreams<'_>,
        compressed: &[usize],
        recorded: &RecordedLayers<'_>,
        (until, piece): (usize, usize),
    ) -> Result<Option<usize>, LiveError> {
        let mut first: Option<usize> = None;
        for (index, &layer) in compressed.iter().enumerate() {
            let recorded = recorded.layer(layer)?;
            let values = recorded.v.as_ref().expect("a live recording holds values");
            let end = first.map_or(until, |first| first.min(until));
            let mut past = 0;
            while past < end {
                let rows = ndarray::s![.., past..(past + piece - past % piece).min(end), ..];
                let vectors = ChunkVectors {
                    past,
                    q: recorded.q.slice(rows),
                    k: recorded.k.slice(rows),
                    v: values.slice(rows),
                };
                if let Some(query) = streams.first_hiding_query(index, &vectors)? {
                    first = Some(first.map_or(past + query, |first| first.min(past + query)));
                    break;
                }
                past += vectors.q.dim().1;
            }
        }
        Ok(first)
    }

    /// Where the own prefill of the prompt cut at `cut` by the policy of the new streams `probe`
    /// starts ([`prefill_start`]): fed the full run's recorded vectors, [`PROBE_PIECE`] positions
    /// at a time, they show where a query of a layer it compresses first loses sight of a
    /// position up to its own. Returns the start and the streams, restarted.
    fn own_prefill_start<'s>(
        &'s self,
        mut probe: LiveStreams<'s>,
        compressed: &[usize],
        recorded: &RecordedLayers<'_>,
        cut: usize,
    ) -> Result<(usize, LiveStreams<'s>), LiveError> {
        let hidden = self.first_hidden(&mut probe, compressed, recorded, (cut, PROBE_PIECE))?;
        let meta = self.trace.meta();
        let windows: Vec<usize> = (0..meta.n_layers).map(|layer| meta.window(layer)).collect();
        let chunks = (cut, self.chunk.max(1), self.full.first_segment);
        let start = prefill_start(hidden.unwrap_or(cut), chunks, &windows);
        Ok((start, probe.restarted()))
    }

    /// A decoded row's report.
    fn report(&self, decoded: batch::Decoded<'_>) -> LiveReport {
        let tokenizer = self.model.tokenizer();
        let full_text = tokenizer.decode(&self.full.tokens);
        let text = tokenizer.decode(&decoded.generated);
        let score = |candidate: &str| {
            self.prompt
                .answer_score(candidate)
                .unwrap_or(f64::from(u8::from(candidate == full_text)))
        };
        let (answer_score, full_answer_score) = (score(&text), score(&full_text));
        let steps = decoded.steps;
        let n = steps.len() as f64;
        let live_layers = decoded.live_layers;
        LiveReport {
            policy: decoded.policy.label(),
            answer_ok: answer_score == 1.0,
            full_answer_ok: full_answer_score == 1.0,
            answer_score,
            full_answer_score,
            kl: steps.iter().map(|s| s.kl).sum::<f64>() / n,
            top1: steps.iter().filter(|s| s.top1).count() as f64 / n,
            logprob_lost: steps.iter().map(|s| s.logprob_lost).sum::<f64>() / n,
            uses_full_run_future: decoded.policy.reads_future(),
            live_retained_mass: live_layers.iter().sum::<f64>() / live_layers.len() as f64,
            live_layers,
            steps,
            full_text,
            text,
            open_loop: decoded.open_loop,
        }
    }
}

/// The live sessions of the questions asked of one context: one full-cache prefill of the context,
/// then each question's full run from it. Under the question-agnostic protocol a policy that reads
/// no future query compresses the context once, and every question is asked of that same
/// compressed cache (SCBench's shared-context setting).
pub struct LiveQuestions<'m> {
    sessions: Vec<LiveSession<'m>>,
}

impl<'m> LiveQuestions<'m> {
    /// Runs every question of `questions` with the full cache, the context prefilled once (in
    /// chunks of `chunk` tokens), each recorded under `scratch`.
    pub fn start(
        model: &'m dyn CausalLm,
        questions: &BuiltQuestions,
        chunk: usize,
        scratch: &Path,
    ) -> Result<Self, LiveError> {
        Self::start_stopping((model, NEVER), questions, (chunk, scratch))
    }

    /// [`start`](Self::start), `stop` asked after each chunk and token of the full runs and
    /// before each step of the decoding of the policies: one that returns
    /// [`Stopped`](crate::stop::Stopped) ends the work there with [`ModelError::Stopped`].
    pub fn start_stopping(
        (model, stop): (&'m dyn CausalLm, Stop<'m>),
        questions: &BuiltQuestions,
        (chunk, scratch): (usize, &Path),
    ) -> Result<Self, LiveError> {
        Self::start_with((model, stop), questions, (chunk, scratch), false)
    }

    /// [`start_stopping`](Self::start_stopping), the recordings keeping each layer's attention
    /// inputs with the model's projections where `inputs`, as a capture with
    /// `--attention-inputs` does: for policies that read them (DefensiveKV, a press reading
    /// hidden states).
    pub fn start_with(
        (model, stop): (&'m dyn CausalLm, Stop<'m>),
        questions: &BuiltQuestions,
        (chunk, scratch): (usize, &Path),
        inputs: bool,
    ) -> Result<Self, LiveError> {
        let projections = inputs.then(|| input_weights(model)).transpose()?;
        Self::recording(
            (model, stop),
            questions,
            (chunk, scratch, projections.as_deref()),
            &mut |_, _, _, _| Ok(()),
        )
    }

    /// [`start_with`](Self::start_with), each question's full run also written as the trace
    /// that a capture with `options` (and, where `inputs`, `--attention-inputs`) into `out`
    /// writes ([`write_question`]): the same runs, so the same bytes, without running them twice.
    pub fn capturing(
        (model, stop): (&'m dyn CausalLm, Stop<'m>),
        questions: &BuiltQuestions,
        scratch: &Path,
        (options, out, inputs): (&CaptureOptions, &Path, bool),
    ) -> Result<Self, LiveError> {
        let projections = inputs.then(|| input_weights(model)).transpose()?;
        let projections = projections.as_deref();
        Self::recording(
            (model, stop),
            questions,
            (options.chunk, scratch, projections),
            &mut |question, generated, recorder, recorded_pass| {
                let written = (questions, question, generated);
                let recorded = (recorder, projections, recorded_pass);
                write_question(model, written, recorded, (options, out))?;
                Ok(())
            },
        )
    }

    /// The sessions of `questions`' full runs, each run's recording seen by `recorded` first
    /// ([`full_runs`]); the recordings keep the attention inputs where `projections` are given.
    fn recording(
        (model, stop): (&'m dyn CausalLm, Stop<'m>),
        questions: &BuiltQuestions,
        (chunk, scratch, projections): (usize, &Path, Option<&[AttentionWeights]>),
        recorded: OnRecording<'_, LiveError>,
    ) -> Result<Self, LiveError> {
        let inputs = projections.is_some();
        let runs = full_runs((model, stop), questions, (chunk, scratch, inputs), recorded)?;
        let sessions = runs
            .into_iter()
            .zip(&questions.prompts)
            .map(|(run, prompt)| {
                LiveSession::recorded((model, stop), prompt, (chunk, projections), run)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { sessions })
    }

    /// Each question's session.
    pub fn sessions(&self) -> &[LiveSession<'m>] {
        &self.sessions
    }

    /// Each question's reports of `policies` ([`LiveSession::run_many`] on its session), the
    /// context compressed once for every policy that
    /// [cuts it alone](Self::compresses_context_once): its kept sets come from the first
    /// question's pass and serve all of them. Each question's open-loop metrics are its own.
    pub fn run_many(&self, policies: &[ValidPolicy]) -> Result<Vec<Vec<LiveReport>>, LiveError> {
        for policy in policies {
            check_live(policy)?;
        }
        let mut once: Vec<Option<Vec<Kept>>> = Vec::new();
        self.sessions
            .iter()
            .map(|session| {
                let mut runs = replay_keeping(&session.trace, policies, session.stop)?;
                if once.is_empty() {
                    once = runs
                        .iter()
                        .zip(policies)
                        .map(|((_, kept), policy)| {
                            Self::compresses_context_once(policy).then(|| kept.clone())
                        })
                        .collect();
                }
                for ((_, kept), shared) in runs.iter_mut().zip(&once) {
                    if let Some(shared) = shared {
                        kept.clone_from(shared);
                    }
                }
                session.decode_runs(runs.into_iter().zip(policies).collect(), Batching::BATCHED)
            })
            .collect()
    }

    /// Whether `policy`'s kept sets depend on the context alone: it cuts before the question
    /// (the question-agnostic protocol) and reads no future query. (Under a streaming timing the
    /// kept sets are the streams', which start from the same context in every question.)
    pub fn compresses_context_once(policy: &ValidPolicy) -> bool {
        policy.params().protocol == Protocol::QuestionAgnostic && !policy.reads_future()
    }
}

/// The sizes of consecutive batches of rows of `bytes`: at most `rows` each when given, else as
/// many as fit in `room` together (one at least).
fn batch_sizes(bytes: &[usize], room: usize, rows: Option<usize>) -> Vec<usize> {
    let mut sizes: Vec<usize> = Vec::new();
    let mut used = 0;
    for &row in bytes {
        let full = sizes.last().is_none_or(|&size| match rows {
            Some(most) => size >= most.max(1),
            None => used + row > room,
        });
        if full {
            sizes.push(0);
            used = 0;
        }
        used += row;
        *sizes.last_mut().expect("a batch") += 1;
    }
    sizes
}

/// How a session runs its policies live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Policies decoded together at most (`None`: as many as fit in half the available memory).
    /// One decodes each policy alone, side by side on worker threads.
    pub rows: Option<usize>,
    /// Whether a policy that evicts nothing while the prompt runs starts from the full run's
    /// prefill (its streams fed the recorded prompt vectors) instead of running its own.
    pub share_prefill: bool,
    /// Whether the rows whose kept sets are fixed at the prompt's end take the full run's
    /// tokens in one pass ([`CausalLm::forward_steps`]) instead of one pass per token.
    pub forced_in_one_pass: bool,
    /// Whether a free-running row goes on from its teacher-forced state after the tokens on
    /// which its most likely token agreed with the full run's, where that state is at hand (a
    /// row's whose entries are stored as captured, whose cache then only grows, or one's that
    /// agreed on every token), instead of running them again from the prompt's end: the same
    /// states, so the same tokens.
    pub resumed_free_runs: bool,
    /// Whether each row's copy of its cache holds only the window of the sliding-window layers
    /// its policy does not compress ([`KvCache::with_room_holding`]): the same numbers, a
    /// fraction of the memory on a hybrid model's long prompts.
    pub windowed_copies: bool,
    /// Whether the rows that start from the full run's cache, their entries as captured, read
    /// the prompt's positions on the global layers from it, once a layer for all of them
    /// ([`Row::prefix`](crate::model::Row::prefix)), instead of each from a copy of its own: the
    /// same numbers, without the copies and with one read of the prompt's cache a step.
    pub shared_prompt: bool,
    /// Whether an own prefill that runs the full run's chunks, on a family that records the
    /// hidden states entering its first global layer ([`CausalLm::residual_layer`]), enters the
    /// model there with the full run's hidden states, the sliding-window layers below taking the
    /// full run's keys and values, instead of running them again: they compute what the full
    /// run computed (the same inputs, the same chunks), so the same numbers.
    pub entered_prefills: bool,
}

impl Batching {
    /// As many rows as fit in memory, the full run's prefill shared, fixed cuts teacher-forced
    /// in one pass, free runs resumed from the teacher-forced ones, row caches kept to the
    /// sliding layers' windows, the full run's cache read once a step for all the rows that start
    /// from it, own prefills entering at the first global layer.
    pub const BATCHED: Batching = Batching {
        rows: None,
        share_prefill: true,
        forced_in_one_pass: true,
        resumed_free_runs: true,
        windowed_copies: true,
        shared_prompt: true,
        entered_prefills: true,
    };
    /// Each policy alone, with its own prefill unless it cuts at the prompt's end, one pass per
    /// token: the closed loop as it ran before batching, which the bench and the tests compare with.
    pub const ONE_AT_A_TIME: Batching = Batching {
        rows: Some(1),
        share_prefill: false,
        forced_in_one_pass: false,
        resumed_free_runs: false,
        windowed_copies: false,
        shared_prompt: false,
        entered_prefills: false,
    };
}

/// The full run's recorded layers, each read from the recording once for all the policies of a
/// batch whose streams are fed the prompt.
struct RecordedLayers<'t> {
    trace: &'t TraceReader,
    layers: Mutex<Vec<Option<Arc<LayerTensors>>>>,
}

impl<'t> RecordedLayers<'t> {
    fn new(trace: &'t TraceReader) -> Self {
        Self {
            trace,
            layers: Mutex::new(vec![None; trace.meta().n_layers]),
        }
    }

    /// Layer `layer`, read on first use.
    fn layer(&self, layer: usize) -> Result<Arc<LayerTensors>, LiveError> {
        let mut layers = self.layers.lock().expect("no reader panicked");
        if let Some(read) = &layers[layer] {
            return Ok(read.clone());
        }
        let read = Arc::new(self.trace.layer(layer).map_err(PolicyError::from)?);
        layers[layer] = Some(read.clone());
        Ok(read)
    }
}

/// A policy's open-loop report and kept sets, and the policy.
type OpenLoopRun<'p> = ((ReplayReport, Vec<Kept>), &'p ValidPolicy);

/// Whether `policy`, batched on a trace with header `meta`, runs the prompt on its own instead of
/// starting from the full run's prefill: it evicts while the prompt runs, or streams over a
/// sliding-window layer. Each such policy costs a prefill of its own.
pub fn prefills_on_its_own(meta: &TraceMeta, policy: &ValidPolicy) -> bool {
    policy.params().timing != Timing::Prefill && !prefill_is_shareable(meta, policy)
}

/// Whether `policy`'s own prefill is the full run's: it evicts nothing while the prompt runs,
/// and it compresses no sliding-window layer (whose masked attention sums the window among
/// all earlier keys, where the full run's leaves the keys before the window out: the same
/// result up to the order of float sums, not bit for bit).
fn prefill_is_shareable(meta: &TraceMeta, policy: &ValidPolicy) -> bool {
    !policy.params().timing.evicts_in_prompt()
        && compressed_layers(meta, policy)
            .iter()
            .all(|&layer| meta.window(layer) == 0)
}

/// Runs `prompt` live under `policy` and measures it against the full cache: a [`LiveSession`]
/// of one policy.
pub fn live(
    model: &dyn CausalLm,
    prompt: &BuiltPrompt,
    policy: &ValidPolicy,
    chunk: usize,
    scratch: &Path,
) -> Result<LiveReport, LiveError> {
    check_live(policy)?;
    LiveSession::start(model, prompt, chunk, scratch)?.run(policy)
}

/// Runs `recipe` live under each of `policies` (checked for live mode first): its model loaded,
/// the prompt of each question it asks built, the full-cache runs (the context prefilled once, in
/// chunks of `chunk` tokens, recorded under `scratch`), then the policies decoded together
/// ([`LiveQuestions::run_many`]); `stop` is asked after each chunk and token whether to stop
/// there ([`LiveQuestions::start_stopping`]). Returns each question's reports, in the order of
/// `policies`.
pub fn run_recipe(
    recipe: &Path,
    policies: &[ValidPolicy],
    (chunk, scratch): (usize, &Path),
    stop: Stop<'_>,
) -> Result<Vec<Vec<LiveReport>>, LiveError> {
    if recipe.extension().is_none_or(|e| e != "toml") {
        return Err(LiveError::NotARecipe(recipe.to_owned()));
    }
    for policy in policies {
        check_live(policy)?;
    }
    let model = crate::capture::load_recipe_model(recipe)?;
    let questions = crate::capture::build_questions(recipe, model.as_ref())?;
    let model = model.as_ref();
    let inputs = policies.iter().any(|policy| policy.scorer().needs_inputs());
    let recording = (chunk, scratch);
    let sessions = LiveQuestions::start_with((model, stop), &questions, recording, inputs)?;
    let reports = sessions.run_many(policies);
    drop(sessions);
    reports
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_fill_the_room_in_order_and_a_row_too_large_goes_alone() {
        let bytes = [4, 3, 2, 6, 11, 1, 1];
        // Room 9: 4+3+2 | 6 | 11 (alone, over the room) | 1+1.
        assert_eq!(batch_sizes(&bytes, 9, None), [3, 1, 1, 2]);
        assert_eq!(batch_sizes(&bytes, 100, None), [7]);
        // A row count ignores the bytes.
        assert_eq!(batch_sizes(&bytes, 1, Some(3)), [3, 3, 1]);
        assert_eq!(batch_sizes(&bytes, 1, Some(1)), [1; 7]);
        assert!(batch_sizes(&[], 9, None).is_empty());
    }
}
