//! The batched closed loop against the unbatched one, side by side in one process on one recipe:
//! the same live runs one policy at a time, each with its own prefill (on worker threads, as the
//! closed loop ran before batching), and as the rows of one forward pass sharing the full run's
//! prefill, their reports required identical; and a single decode step of many rows against the
//! step of one.

use super::BenchError;
use crate::capture::{build_prompt, load_model, CaptureError};
use crate::live::{Batching, LiveError, LiveSession};
use crate::model::{CausalLm, Evicted, KvCache, Row};
use crate::replay::{presets, PolicyError, ValidPolicy};
use std::path::Path;
use std::time::Instant;

/// The presets the closed-loop rows run, at one budget: every timing, prompt-time evictions
/// included.
pub const PRESETS: [&str; 14] = [
    "snapkv",
    "pyramidkv",
    "adakv",
    "snapkv-kvpress",
    "h2o-kvcache-factory",
    "rkv",
    "cake",
    "h2o",
    "tova",
    "quest",
    "oracle",
    "streamingllm",
    "h2o-adapted",
    "pyramidkv-adapted",
];

/// Their budget.
const BUDGET: usize = 128;

/// Rows of the single-step measurement, at most.
const STEP_ROWS: usize = 80;

/// One recipe's closed-loop speed.
#[derive(Debug, Clone)]
pub struct ClosedLoopSpeed {
    /// The model's name.
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Live runs timed (one per preset).
    pub runs: usize,
    /// Seconds for them one at a time, then batched.
    pub seconds: (f64, f64),
    /// Milliseconds per decode step per row, one at a time then batched: the `prefill`-timing
    /// presets alone (no prefill of their own), over their teacher-forced and free-running steps.
    pub decode_ms: (f64, f64),
    /// Decode steps (teacher-forced plus free-running) per run of that measurement.
    pub steps: usize,
    /// Rows of the single-step measurement, and its milliseconds for one row and for them all.
    pub step: (usize, f64, f64),
}

fn model_error(error: impl Into<LiveError>) -> BenchError {
    BenchError::Reference(error.into().to_string())
}

/// Measures `recipe` (a needle recipe, captured or not: it runs live).
pub fn closed_loop_speed(recipe: &Path) -> Result<ClosedLoopSpeed, BenchError> {
    let model = load_model_of(recipe)?;
    let prompt = build_prompt(recipe, model.as_ref()).map_err(capture_error)?;
    let scratch = std::env::temp_dir();
    let session =
        LiveSession::start(model.as_ref(), &prompt, 512, &scratch).map_err(model_error)?;
    let policies = PRESETS
        .iter()
        .map(|name| presets::preset(name, BUDGET)?.check())
        .collect::<Result<Vec<ValidPolicy>, PolicyError>>()?;
    let (unbatched, batched) = side_by_side(&session, &policies)?;
    let one_shot = policies
        .iter()
        .filter(|p| p.params().timing == crate::replay::Timing::Prefill)
        .map(|p| p.params().clone().check())
        .collect::<Result<Vec<ValidPolicy>, PolicyError>>()?;
    let (decode_one, decode_all) = side_by_side(&session, &one_shot)?;
    let steps = 2 * prompt.generate;
    let per_row_step = |seconds: f64| 1e3 * seconds / (one_shot.len() * steps) as f64;
    Ok(ClosedLoopSpeed {
        model: model.spec().name.clone(),
        prompt_tokens: prompt.ids.len(),
        runs: policies.len(),
        seconds: (unbatched, batched),
        decode_ms: (per_row_step(decode_one), per_row_step(decode_all)),
        steps,
        step: single_step(model.as_ref(), &prompt.ids)?,
    })
}

fn capture_error(error: CaptureError) -> BenchError {
    BenchError::Reference(error.to_string())
}

fn load_model_of(recipe: &Path) -> Result<Box<dyn CausalLm + Send>, BenchError> {
    let (parsed, _) =
        crate::recipe::Recipe::load(recipe).map_err(|e| capture_error(CaptureError::from(e)))?;
    load_model(parsed.model()).map_err(capture_error)
}

/// Seconds for `policies` decoded one at a time, then batched; fails unless both give the same
/// reports.
fn side_by_side(
    session: &LiveSession<'_>,
    policies: &[ValidPolicy],
) -> Result<(f64, f64), BenchError> {
    let started = Instant::now();
    let alone = session
        .run_batched(policies, Batching::ONE_AT_A_TIME)
        .map_err(model_error)?;
    let unbatched = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let together = session
        .run_batched(policies, Batching::BATCHED)
        .map_err(model_error)?;
    let batched = started.elapsed().as_secs_f64();
    if alone != together {
        return Err(BenchError::Reference(
            "the batched closed loop's reports differ from the unbatched ones".into(),
        ));
    }
    Ok((unbatched, batched))
}

/// One decode step after the prompt `ids`: milliseconds for one row, then for as many rows as fit
/// in a third of the available memory (at most [`STEP_ROWS`]), each masked as a `prefill` cut is
/// (one that evicts nothing); best of three.
fn single_step(model: &dyn CausalLm, ids: &[u32]) -> Result<(usize, f64, f64), BenchError> {
    let mut prefilled = KvCache::default();
    for piece in ids.chunks(512) {
        model.forward(piece, &mut prefilled, None)?;
    }
    let spec = model.spec();
    let cache_bytes = spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim * (ids.len() + 1) * 4;
    let rows = (crate::sys::available_memory() / 3 / cache_bytes.max(1)).clamp(1, STEP_ROWS);
    let token = [ids[ids.len() - 1]];
    let timed = |rows: usize| -> Result<f64, BenchError> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut caches: Vec<KvCache> = (0..rows).map(|_| prefilled.clone()).collect();
            let nothing: Evicted = vec![vec![Vec::new(); spec.n_heads]; spec.n_layers];
            let mut masks = vec![nothing; rows];
            let mut batch: Vec<Row<'_, '_>> = caches
                .iter_mut()
                .zip(&mut masks)
                .map(|(cache, mask)| Row::new(&token, cache, Some(mask)))
                .collect();
            let started = Instant::now();
            model.forward_rows(&mut batch)?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        Ok(1e3 * best)
    };
    Ok((rows, timed(1)?, timed(rows)?))
}
