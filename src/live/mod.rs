//! Closed loop: a policy holds the native model's real KV cache while the model runs, and what the
//! model then does is measured against the same model with its full cache.
//!
//! One live run of a recipe under a policy:
//! 1. **Full run.** The prompt is prefilled and `generate` tokens are decoded greedily with the
//!    full cache, recording every layer's q, k, v (as a capture does) and the next-token
//!    distribution of every step.
//! 2. **Kept sets.** The run's recording, written as an f32 kvtrace/1 file in a scratch directory,
//!    goes through the same engine code as an open-loop replay (`layer_budgets`, `kept_sets`), so
//!    a live run chooses exactly what a replay of that trace chooses. Under the `prefill` timing
//!    the choice reads only the prompt's vectors, which the full run and the live run share (the
//!    eviction happens after the prefill); oracles that need future queries read them from the
//!    full run, and the report says so.
//! 3. **Teacher-forced.** From the prefilled cache, the full run's tokens are fed back with each
//!    query head masked off its evicted positions; at each step the policy's next-token
//!    distribution is compared with the full run's: KL(p_full ‖ p_policy), top-1 agreement, and
//!    the log-probability lost on the full run's token. Step 0's distribution comes from the
//!    prefill itself (identical in both runs) and is left out.
//! 4. **Free-running.** From the same prefilled cache, greedy decoding under the policy: its text,
//!    and task success (the recipe's `answer` in the text, or, without one, the same text as the
//!    full run).
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
//! Every run also measures the live attention ([`drift`]): per layer, the share of each live
//! query's attention over the whole live cache that its kept set holds, over the teacher-forced
//! steps; beside the open-loop retained mass it shows where the model's own vectors drift.

mod drift;
pub(crate) mod streams;

use crate::capture::{write_recording, CaptureError, CaptureOptions};
use crate::model::{argmax, AttentionMask, CausalLm, Evicted, KvCache, ModelError, Recorder};
use crate::recipe::BuiltPrompt;
use crate::replay::{
    compressed_layers, layer_budgets, replay_keeping, Kept, PolicyError, Protocol, ReplayReport,
    Timing, ValidPolicy,
};
use crate::trace::{StorageDtype, TraceReader};
use drift::{CompressedLayers, LiveMass};
use rayon::prelude::*;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use streams::{AttentionShape, LiveStreams};

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
    /// Task success of the free-running text, when the recipe defines one (an `answer`, or the
    /// full run's text for recipes without one).
    pub answer_ok: bool,
    /// Whether the full run itself succeeded (a policy can only lose what the model had).
    pub full_answer_ok: bool,
    /// Teacher-forced steps: from step 1 (step 0 comes from the full prefill, identical in both
    /// runs) unless the timing evicts during the prompt (`streaming`), then from step 0.
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
    prefill_logits: Vec<f32>,
    tokens: Vec<u32>,
    /// `logits[i]` predicts `tokens[i + 1]`.
    logits: Vec<Vec<f32>>,
}

fn full_run(
    model: &dyn CausalLm,
    prompt: &BuiltPrompt,
    chunk: usize,
    recorder: &mut Recorder,
) -> Result<FullRun, ModelError> {
    let mut cache = KvCache::default();
    let mut prefill_logits = Vec::new();
    for piece in prompt.ids.chunks(chunk.max(1)) {
        prefill_logits = model.forward(piece, &mut cache, Some(recorder))?;
    }
    let prefilled = cache.clone();
    let mut logits = Vec::new();
    let tokens = model.decode_greedy(
        &mut cache,
        &prefill_logits,
        prompt.generate,
        Some(recorder),
        None,
        &mut |step| logits.push(step.to_vec()),
    )?;
    Ok(FullRun {
        prefilled,
        prefill_logits,
        tokens,
        logits,
    })
}

/// Natural log-softmax in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let total: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let log_total = total.ln() + max;
    logits.iter().map(|&x| x as f64 - log_total).collect()
}

/// Compares the policy's next-token logits with the full run's, for the full run's `token`.
pub fn compare_step(full: &[f32], policy: &[f32], token: u32) -> LiveStep {
    let (p, q) = (log_softmax(full), log_softmax(policy));
    let kl = p
        .iter()
        .zip(&q)
        .map(|(lp, lq)| lp.exp() * (lp - lq))
        .sum::<f64>()
        .max(0.0);
    LiveStep {
        kl,
        top1: argmax(policy) == argmax(full),
        logprob_lost: p[token as usize] - q[token as usize],
    }
}

/// Whether `policy` can run live: an oracle that reads future queries gets them from the full
/// run, which only the `prefill` timing can use (the others run the model's own queries).
pub fn check_live(policy: &ValidPolicy) -> Result<(), LiveError> {
    let timing = policy.params().timing;
    let protocol = policy.params().protocol;
    if protocol != Protocol::QuestionInPrompt {
        return Err(LiveError::Unsupported(format!(
            "protocol `{}` is replayed but not yet run live: the model would have to run the \
             question over the compressed context; use `kvreplay replay` or an open-loop sweep",
            protocol.name()
        )));
    }
    if timing != Timing::Prefill && policy.scorer.reads_future() {
        return Err(LiveError::Unsupported(format!(
            "scorer `{}` reads future queries, which live mode takes from the full run under \
             the `prefill` timing only, not `{}`",
            policy.params().scorer,
            timing.name()
        )));
    }
    Ok(())
}

/// Per layer and query head, the prompt positions a policy's kept sets (one [`Kept`] per layer)
/// leave out.
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
/// in a scratch file (removed when the session is dropped).
pub struct LiveSession<'m> {
    model: &'m dyn CausalLm,
    prompt: BuiltPrompt,
    /// Prefill chunk size.
    chunk: usize,
    full: FullRun,
    trace: TraceReader,
    path: PathBuf,
}

impl<'m> LiveSession<'m> {
    /// Runs `prompt` with the full cache (prefill in chunks of `chunk` tokens) and records it in
    /// a scratch file under `scratch`.
    pub fn start(
        model: &'m dyn CausalLm,
        prompt: &BuiltPrompt,
        chunk: usize,
        scratch: &Path,
    ) -> Result<Self, LiveError> {
        let mut recorder = Recorder::spilling(scratch);
        let full = full_run(model, prompt, chunk, &mut recorder)?;
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
        static SESSIONS: AtomicUsize = AtomicUsize::new(0);
        let path = scratch.join(format!(
            "live-{}-{}.safetensors",
            std::process::id(),
            SESSIONS.fetch_add(1, Ordering::Relaxed)
        ));
        write_recording(model, prompt, &full.tokens, &recorder, &options, &path)
            .map_err(CaptureError::from)?;
        drop(recorder);
        let trace = TraceReader::open(&path).map_err(PolicyError::from)?;
        Ok(Self {
            model,
            prompt: prompt.clone(),
            chunk,
            full,
            trace,
            path,
        })
    }

    /// Runs the prompt live under `policy` and measures it against the full run.
    pub fn run(&self, policy: &ValidPolicy) -> Result<LiveReport, LiveError> {
        let mut reports = self.run_many(std::slice::from_ref(policy))?;
        Ok(reports.pop().expect("one report per policy"))
    }

    /// [`run`](Self::run) for several policies: their open-loop metrics (and the `prefill`
    /// timing's kept sets) come from one replay pass over the recording, then they run live side
    /// by side, one per worker thread. A decode step's products are too small for the model to
    /// spread over threads, so a run keeps about one core busy; each run is computed alone and
    /// the reports come back in the order of `policies`, so the thread count changes no result.
    pub fn run_many(&self, policies: &[ValidPolicy]) -> Result<Vec<LiveReport>, LiveError> {
        for policy in policies {
            check_live(policy)?;
        }
        let meta = self.trace.meta();
        replay_keeping(&self.trace, policies)?
            .into_par_iter()
            .zip(policies)
            .map(|((mut open_loop, kept), policy)| {
                // The scratch file is gone after the session: name what it was.
                open_loop.trace = "the full-cache run's f32 recording".into();
                if policy.params().timing == Timing::Prefill {
                    let evicted = evicted_positions(&kept, meta.n_heads, meta.prompt_len);
                    let full = &self.full;
                    self.decode(
                        policy,
                        evicted,
                        full.prefilled.clone(),
                        &full.prefill_logits,
                        open_loop,
                    )
                } else {
                    self.run_streaming(policy, open_loop)
                }
            })
            .collect()
    }

    /// A policy that evicts while the model runs: the prompt in chunks through its streams,
    /// then the decoding.
    fn run_streaming(
        &self,
        policy: &ValidPolicy,
        open_loop: ReplayReport,
    ) -> Result<LiveReport, LiveError> {
        let meta = self.trace.meta();
        let shape = AttentionShape {
            n_heads: meta.n_heads,
            n_kv_heads: meta.n_kv_heads,
            head_dim: meta.head_dim,
            scale: meta.scale,
            softcap: meta.softcap,
        };
        let capacity = self.prompt.ids.len() + self.full.tokens.len().max(self.prompt.generate) + 1;
        let compressed = compressed_layers(meta, policy);
        let budgets = layer_budgets(&self.trace, policy)?;
        let budgets = compressed.iter().map(|&layer| budgets[layer]).collect();
        let rope_thetas = compressed.iter().map(|&l| meta.rope_theta_of(l)).collect();
        let windows = compressed.iter().map(|&l| meta.window(l)).collect();
        let streams = LiveStreams::new(
            policy,
            (budgets, rope_thetas, windows),
            shape,
            meta.prompt_len,
            capacity,
        );
        let mut streams = CompressedLayers::new(streams, &compressed, meta.n_layers);
        let mut cache = KvCache::default();
        let mut logits = Vec::new();
        for piece in self.prompt.ids.chunks(self.chunk.max(1)) {
            logits = self
                .model
                .forward_masked(piece, &mut cache, None, Some(&mut streams))?;
        }
        self.decode(policy, streams.into_inner(), cache, &logits, open_loop)
    }

    /// Teacher-forced and free-running decoding from `cache` (the prompt run under `mask`, whose
    /// last logits are `prompt_logits`), attending as `mask` decides.
    fn decode<M: AttentionMask + Clone>(
        &self,
        policy: &ValidPolicy,
        mask: M,
        cache: KvCache,
        prompt_logits: &[f32],
        open_loop: ReplayReport,
    ) -> Result<LiveReport, LiveError> {
        let (model, full) = (self.model, &self.full);
        let meta = self.trace.meta();
        let compressed = compressed_layers(meta, policy);
        let mut free = CompressedLayers::new(mask.clone(), &compressed, meta.n_layers);
        let windows = compressed.iter().map(|&l| meta.window(l)).collect();
        let measured = LiveMass::new(
            mask,
            &cache,
            (&compressed, windows),
            meta.n_heads / meta.n_kv_heads,
            meta.scale,
            meta.softcap,
        )?;
        let mut measured = CompressedLayers::new(measured, &compressed, meta.n_layers);
        let mut steps = Vec::with_capacity(full.tokens.len());
        if policy.params().timing == Timing::Streaming {
            steps.push(compare_step(
                &full.prefill_logits,
                prompt_logits,
                full.tokens[0],
            ));
        }
        let mut teacher_cache = cache.clone();
        // Every generated token is fed, the last one too (its logits predict nothing compared),
        // so the live attention covers the decode steps the open-loop replay measures.
        for (index, &token) in full.tokens.iter().enumerate() {
            let logits =
                model.forward_masked(&[token], &mut teacher_cache, None, Some(&mut measured))?;
            if let Some(&next) = full.tokens.get(index + 1) {
                steps.push(compare_step(&full.logits[index], &logits, next));
            }
        }
        let mut free_cache = cache;
        let generated = model.decode_greedy(
            &mut free_cache,
            prompt_logits,
            self.prompt.generate,
            None,
            Some(&mut free),
            &mut |_| {},
        )?;
        let tokenizer = model.tokenizer();
        let full_text = tokenizer.decode(&full.tokens);
        let text = tokenizer.decode(&generated);
        let success = |candidate: &str| match &self.prompt.answer {
            Some(answer) => candidate.contains(answer.as_str()),
            None => candidate == full_text,
        };
        let n = steps.len() as f64;
        let live_layers = measured.inner().per_layer();
        Ok(LiveReport {
            policy: policy.label(),
            answer_ok: success(&text),
            full_answer_ok: success(&full_text),
            kl: steps.iter().map(|s| s.kl).sum::<f64>() / n,
            top1: steps.iter().filter(|s| s.top1).count() as f64 / n,
            logprob_lost: steps.iter().map(|s| s.logprob_lost).sum::<f64>() / n,
            uses_full_run_future: policy.reads_future(),
            live_retained_mass: live_layers.iter().sum::<f64>() / live_layers.len() as f64,
            live_layers,
            steps,
            full_text,
            text,
            open_loop,
        })
    }
}

impl Drop for LiveSession<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn kl_and_lost_logprob_by_hand() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]; q = softmax([0, 0]) = [0.5, 0.5].
        // KL(p || q) = 0.25 ln(0.5) + 0.75 ln(1.5) = 0.130812; token 1: ln 0.75 - ln 0.5 = 0.405465.
        let step = compare_step(&[0.0, 3f32.ln()], &[0.0, 0.0], 1);
        assert_abs_diff_eq!(step.kl, 0.130_812, epsilon = 1e-6);
        assert_abs_diff_eq!(step.logprob_lost, 0.405_465, epsilon = 1e-6);
        // Equal tops: argmax of [0, 0] is index 0, of p index 1.
        assert!(!step.top1);
        let same = compare_step(&[1.0, 2.0, 0.5], &[1.0, 2.0, 0.5], 2);
        assert_eq!((same.kl, same.top1, same.logprob_lost), (0.0, true, 0.0));
    }
}
