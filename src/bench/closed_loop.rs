//! The batched closed loop against the unbatched one, side by side in one process on one recipe:
//! the same live runs one policy at a time, each with its own prefill (on worker threads, as the
//! closed loop ran before batching), and as the rows of one forward pass sharing the full run's
//! prefill, their reports required identical; and a single decode step of many rows against the
//! step of one.

use super::BenchError;
use crate::capture::{build_prompt, build_questions, load_model, CaptureError, ModelSlot};
use crate::experiment::{Experiment, TraceFile};
use crate::live::{prefills_on_its_own, Batching, LiveSession};
use crate::model::{CausalLm, Evicted, KvCache, ModelSpec, Row, WeightProducts};
use crate::recipe::Recipe;
use crate::replay::{presets, PolicyError, ValidPolicy};
use crate::stop::Stop;
use crate::trace::TraceReader;
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    /// Milliseconds per decode step per row, one at a time, batched one pass per token, and
    /// batched with the teacher-forced tokens in one pass and the free runs going on from them
    /// (`Batching::BATCHED`): the `prefill`-timing presets alone (no prefill of their own), over
    /// their teacher-forced and free-running steps (those a free run takes over from its
    /// teacher-forced run counted too).
    pub decode_ms: (f64, f64, f64),
    /// Decode steps (teacher-forced plus free-running) per run of that measurement.
    pub steps: usize,
    /// Rows of the single-step measurement, and its milliseconds for one row and for them all.
    pub step: (usize, f64, f64),
    /// The batched run's essential work, where the model's family knows its weights.
    pub essential: Option<EssentialWork>,
}

/// The work a batched run of the presets cannot avoid: one prefill per distinct prompt-time
/// cache (the full run's, and one per policy that runs the prompt on its own) and every row's
/// decode steps (the weight products and the attention over its context, within each layer's
/// window), timed at the model-shaped matrix-product peak measured in the same run.
#[derive(Debug, Clone, Copy)]
pub struct EssentialWork {
    /// Prefills.
    pub prefills: usize,
    /// Multiply-adds of the prefills and of the decode steps.
    pub multiply_adds: (f64, f64),
    /// Multiply-adds of the single decode step of many rows.
    pub step: f64,
    /// The peak, GFLOP/s (two per multiply-add), on every thread.
    pub peak: f64,
}

impl EssentialWork {
    /// Seconds of the prefills and of the decode steps at the peak.
    pub fn seconds(&self) -> (f64, f64) {
        let at_peak = |macs: f64| 2.0 * macs / (self.peak * 1e9);
        (at_peak(self.multiply_adds.0), at_peak(self.multiply_adds.1))
    }

    /// Milliseconds of the single decode step of many rows at the peak.
    pub fn step_ms(&self) -> f64 {
        2e3 * self.step / (self.peak * 1e9)
    }
}

/// Measures `recipe` (a needle recipe, captured or not: it runs live); `stop` is asked after each
/// chunk and token of the live runs.
pub fn closed_loop_speed(recipe: &Path, stop: Stop<'_>) -> Result<ClosedLoopSpeed, BenchError> {
    let model = load_model_of(recipe)?;
    let prompt = build_prompt(recipe, model.as_ref())?;
    let scratch = std::env::temp_dir();
    let session = LiveSession::start_stopping((model.as_ref(), stop), &prompt, 512, &scratch)?;
    let policies = PRESETS
        .iter()
        .map(|name| presets::preset(name, BUDGET)?.check())
        .collect::<Result<Vec<ValidPolicy>, PolicyError>>()?;
    let (unbatched, batched) = side_by_side(&session, &policies, Batching::BATCHED)?;
    let one_shot = policies
        .iter()
        .filter(|p| p.params().timing == crate::replay::Timing::Prefill)
        .map(|p| p.params().clone().check())
        .collect::<Result<Vec<ValidPolicy>, PolicyError>>()?;
    let stepped = Batching {
        forced_in_one_pass: false,
        resumed_free_runs: false,
        ..Batching::BATCHED
    };
    let (decode_one, decode_stepped) = side_by_side(&session, &one_shot, stepped)?;
    let (_, decode_all) = side_by_side(&session, &one_shot, Batching::BATCHED)?;
    let steps = 2 * prompt.generate;
    let step = single_step(model.as_ref(), &prompt.ids)?;
    let per_row_step = |seconds: f64| 1e3 * seconds / (one_shot.len() * steps) as f64;
    Ok(ClosedLoopSpeed {
        model: model.spec().name.clone(),
        prompt_tokens: prompt.ids.len(),
        runs: policies.len(),
        seconds: (unbatched, batched),
        decode_ms: (
            per_row_step(decode_one),
            per_row_step(decode_stepped),
            per_row_step(decode_all),
        ),
        steps,
        step,
        essential: essential_work(
            &session,
            model.as_ref(),
            &policies,
            (prompt.ids.len(), steps, step.0),
        ),
    })
}

/// The essential work of `policies` batched on `session`'s prompt of `prompt` tokens, each row
/// decoding `steps` tokens (teacher-forced and free-running), and of one decode step of
/// `step_rows` rows; `None` where the family does not count its weights.
fn essential_work(
    session: &LiveSession<'_>,
    model: &dyn CausalLm,
    policies: &[ValidPolicy],
    (prompt, steps, step_rows): (usize, usize, usize),
) -> Option<EssentialWork> {
    let weights = model.weight_products_per_token()?;
    let (prefill, row, step) = multiply_adds(weights, model.spec(), (prompt, steps));
    let prefills = 1 + policies
        .iter()
        .filter(|p| session.prefills_on_its_own(p))
        .count();
    Some(EssentialWork {
        prefills,
        multiply_adds: (prefills as f64 * prefill, policies.len() as f64 * row),
        step: step_rows as f64 * step,
        peak: product_peak(),
    })
}

/// One recipe's part of an experiment's closed-loop essential work: its full run's prefill and
/// one prefill per run that prefills on its own, and every run's decode steps.
#[derive(Debug, Clone)]
pub struct RecipeWork {
    /// The trace captured from the recipe (one per question).
    pub trace: PathBuf,
    /// The model's name.
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Live runs (policies × budgets).
    pub runs: usize,
    /// Prefills: the full run's, and one per run that prefills on its own.
    pub prefills: usize,
    /// Decode steps of each run (teacher-forced and free-running).
    pub steps: usize,
    /// Multiply-adds of the prefills and of the runs' decode steps; `None` where the model's
    /// family does not count its weights.
    pub multiply_adds: Option<(f64, f64)>,
}

/// The closed-loop essential work of `experiment`'s live runs on `traces` (captured): per trace,
/// as [`RecipeWork`] counts it, and the model-shaped product peak (GFLOP/s) measured now, which
/// turns multiply-adds into seconds.
pub fn experiment_work(
    (path, experiment): (&Path, &Experiment),
    traces: &[TraceFile],
) -> Result<(Vec<RecipeWork>, f64), BenchError> {
    if !experiment.closed_loop {
        return Err(BenchError::NotClosedLoop(path.to_owned()));
    }
    let plan = experiment.plan(traces);
    let mut models = ModelSlot::default();
    let mut work = Vec::with_capacity(traces.len());
    for trace in traces {
        let recipe = trace.recipe.as_deref().expect("a closed loop runs recipes");
        let name = Recipe::load(recipe)
            .map_err(CaptureError::from)?
            .0
            .model()
            .to_owned();
        let loaded = models.model(&name)?;
        let runs = plan.iter().filter(|run| run.trace == trace.path);
        let policies = runs
            .map(|run| experiment.check(&run.params))
            .collect::<Result<Vec<ValidPolicy>, _>>()?;
        work.push(recipe_work(trace, loaded, &policies)?);
    }
    Ok((work, product_peak()))
}

/// What `policies` cost on `trace`'s recipe run live by `model` ([`RecipeWork`]).
fn recipe_work(
    trace: &TraceFile,
    model: &dyn CausalLm,
    policies: &[ValidPolicy],
) -> Result<RecipeWork, BenchError> {
    let recipe = trace.recipe.as_deref().expect("a closed loop runs recipes");
    let questions = build_questions(recipe, model)?;
    let prompt = &questions.prompts[trace.question.unwrap_or(0)];
    let reader = TraceReader::open(&trace.path)?;
    let own = policies
        .iter()
        .filter(|p| prefills_on_its_own(reader.meta(), p))
        .count();
    let steps = 2 * prompt.generate;
    let multiply_adds = model.weight_products_per_token().map(|weights| {
        let (prefill, row, _) = multiply_adds(weights, model.spec(), (prompt.ids.len(), steps));
        ((1 + own) as f64 * prefill, policies.len() as f64 * row)
    });
    Ok(RecipeWork {
        trace: trace.path.clone(),
        model: model.spec().name.clone(),
        prompt_tokens: prompt.ids.len(),
        runs: policies.len(),
        prefills: 1 + own,
        steps,
        multiply_adds,
    })
}

/// Multiply-adds of one prefill of `prompt` tokens, of one row's `steps` decode steps after it,
/// and of one decode step right after the prompt: the weight products (the logits of a
/// prefill's last token only, of every decode step) and each query's q·k and weights·v over
/// what each layer's window shows it.
pub(super) fn multiply_adds(
    weights: WeightProducts,
    spec: &ModelSpec,
    (prompt, steps): (usize, usize),
) -> (f64, f64, f64) {
    let (blocks, output) = (weights.blocks as f64, weights.output as f64);
    let attention = |position: usize| -> f64 {
        let seen = |window: usize| match window {
            0 => position + 1,
            window => window.min(position + 1),
        };
        let per_head = spec.windows.iter().map(|&w| seen(w)).sum::<usize>();
        (2 * spec.n_heads * spec.head_dim * per_head) as f64
    };
    let prefill = output + (0..prompt).map(|t| blocks + attention(t)).sum::<f64>();
    let row = (prompt..prompt + steps)
        .map(|t| blocks + output + attention(t))
        .sum::<f64>();
    (prefill, row, blocks + output + attention(prompt))
}

/// Products at least, and time at least, over which [`product_peak`] takes the best.
const PEAK_PRODUCTS: usize = 5;
const PEAK_SPAN: Duration = Duration::from_millis(500);

/// Best GFLOP/s of a model-shaped product (a 512-token chunk through a 1,024 → 2,048
/// projection), as the model runs its products: candle on every thread, over half a second of
/// products at least (a few products alone read anywhere from 60% to all of the peak on a
/// shared machine).
pub(super) fn product_peak() -> f64 {
    let (m, k, n) = (512, 1024, 2048);
    let operand = |rows: usize, columns: usize| {
        let values = (0..rows * columns)
            .map(|i| (i % 13) as f32 * 0.01)
            .collect();
        Tensor::from_vec(values, (rows, columns), &Device::Cpu)
    };
    let (Ok(a), Ok(b)) = (operand(m, k), operand(k, n)) else {
        return f64::NAN;
    };
    let (mut best, mut products, began) = (0.0f64, 0, Instant::now());
    while products < PEAK_PRODUCTS || began.elapsed() < PEAK_SPAN {
        let started = Instant::now();
        if a.matmul(&b).is_err() {
            return f64::NAN;
        }
        best = best.max(2.0 * (m * k * n) as f64 / started.elapsed().as_secs_f64() / 1e9);
        products += 1;
    }
    best
}

fn load_model_of(recipe: &Path) -> Result<Box<dyn CausalLm + Send>, BenchError> {
    let (parsed, _) = Recipe::load(recipe).map_err(CaptureError::from)?;
    Ok(load_model(parsed.model())?)
}

/// Seconds for `policies` decoded one at a time, then as `batched` says; fails unless both give
/// the same reports.
fn side_by_side(
    session: &LiveSession<'_>,
    policies: &[ValidPolicy],
    batched: Batching,
) -> Result<(f64, f64), BenchError> {
    let started = Instant::now();
    let alone = session.run_batched(policies, Batching::ONE_AT_A_TIME)?;
    let unbatched = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let together = session.run_batched(policies, batched)?;
    let batched = started.elapsed().as_secs_f64();
    if alone != together {
        return Err(BenchError::BatchedDiffers);
    }
    Ok((unbatched, batched))
}

/// One decode step after the prompt `ids`: milliseconds for one row, then for as many rows as fit
/// in a third of the available memory (at most [`STEP_ROWS`]), each masked as a `prefill` cut is
/// (one that evicts nothing, on every layer), its cache as a live row's of such a policy (with
/// room for the step, and reading the prompt's positions on the global layers from the prefilled
/// cache where the family can); best of three.
fn single_step(model: &dyn CausalLm, ids: &[u32]) -> Result<(usize, f64, f64), BenchError> {
    let mut prefilled = KvCache::default();
    for piece in ids.chunks(512) {
        model.forward(piece, &mut prefilled, None)?;
    }
    let spec = model.spec();
    let prefix = model.attends_over_prefixes().then_some(&prefilled);
    let holding: Vec<usize> = spec
        .windows
        .iter()
        .map(|&window| match (window, prefix.is_some()) {
            (0, true) => 0,
            _ => usize::MAX,
        })
        .collect();
    let held: usize = holding.iter().map(|&last| last.min(ids.len()) + 1).sum();
    let cache_bytes = held * 2 * spec.n_kv_heads * spec.head_dim * 4;
    let rows = (crate::sys::available_memory() / 3 / cache_bytes.max(1)).clamp(1, STEP_ROWS);
    let token = [ids[ids.len() - 1]];
    let timed = |rows: usize| -> Result<f64, BenchError> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut caches = (0..rows)
                .map(|_| prefilled.with_room_holding(1, &holding))
                .collect::<Result<Vec<KvCache>, _>>()?;
            let nothing: Evicted = vec![vec![Vec::new(); spec.n_heads]; spec.n_layers];
            let mut masks = vec![nothing; rows];
            let mut batch: Vec<Row<'_, '_>> = caches
                .iter_mut()
                .zip(&mut masks)
                .map(|(cache, mask)| Row::new(&token, cache, Some(mask)).over_prefix(prefix))
                .collect();
            let started = Instant::now();
            model.forward_rows(&mut batch)?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        Ok(1e3 * best)
    };
    Ok((rows, timed(1)?, timed(rows)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn essential_multiply_adds_by_hand() {
        // One head of one dimension, a global layer and a layer of window 2; blocks 10, logits 3.
        let spec = ModelSpec {
            family: "llama",
            name: "tiny".into(),
            n_layers: 2,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 1,
            scale: 1.0,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: vec![0, 2],
            engine: crate::model::F32_ENGINE.into(),
        };
        let weights = WeightProducts {
            blocks: 10,
            output: 3,
            bytes: 52,
        };
        // A query at t sees t + 1 and min(2, t + 1) positions, each twice (q·k, weights·v):
        // attention 4, 8, 10, 12, 14 at t = 0..=4. Prefill of 3: 3 + (10+4) + (10+8) + (10+10)
        // = 55; two steps at t = 3, 4: (13+12) + (13+14) = 52; one step at t = 3: 25.
        assert_eq!(multiply_adds(weights, &spec, (3, 2)), (55.0, 52.0, 25.0));
    }
}
