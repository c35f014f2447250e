//! Native capture: run a recipe's prompt through the model, greedy-decode, and write what every
//! layer's attention saw as a kvtrace/1 file.

use crate::assets::{model_asset, AssetError, Assets};
use crate::model::{family, CausalLm, HfModel, KvCache, ModelError, Recorder};
use crate::recipe::reconstruction::{self as pass, PlannedPass};
use crate::recipe::{BuiltPrompt, BuiltQuestions, Recipe, RecipeError};
use crate::stop::Stopped;
use crate::trace::{
    trace_bytes, write_trace, AttentionWeights, Extras, InputsSource, LayerInputs, LayerSource,
    PassRows, ReconstructionSource, StorageDtype, TraceError, TraceMeta,
};
use ndarray::{Array3, Axis};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How to capture.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureOptions {
    /// On-disk dtype of q, k, v.
    pub storage: StorageDtype,
    /// Prefill chunk size in tokens (bounds the attention matrix held at once).
    pub chunk: usize,
    /// A name for the `source` field (the recipe's file name).
    pub recipe_name: String,
    /// Model id written to the header.
    pub model_id: String,
}

/// Errors of a capture.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The trace could not be assembled or written.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The recipe is invalid.
    #[error(transparent)]
    Recipe(#[from] RecipeError),
    /// The model or the essays are missing or could not be fetched.
    #[error(transparent)]
    Asset(#[from] AssetError),
    /// A model name no asset has.
    #[error("unknown model `{0}` (see `kvreplay fetch --help`)")]
    UnknownModel(String),
    /// Attention inputs asked of a family that does not give its attention weights.
    #[error("--attention-inputs: model family `{0}` does not give kvreplay its attention weights, so its attention inputs are not recorded (traces/capture_hf.py --attention-inputs records them through transformers)")]
    NoAttentionInputs(&'static str),
    /// A recipe's reconstruction pass that cannot run on its prompt.
    #[error("reconstruction = \"kvzip\": {0}")]
    Reconstruction(String),
    /// The lock that lets concurrent sweeps capture a recipe once could not be taken.
    #[error("{path}: cannot take the capture lock: {source}")]
    Lock {
        /// The lock file.
        path: std::path::PathBuf,
        /// The failure.
        source: std::io::Error,
    },
}

/// What a recipe's capture wrote (of one question).
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureSummary {
    /// The trace file.
    pub path: PathBuf,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// The generated text.
    pub generated_text: String,
}

/// Model `name`: a native one (a [`MODELS`](crate::assets::MODELS) name, fetching the assets
/// first if they are missing, or `gguf:PATH`, a GGUF on disk), or a Hugging Face one (`hf:…`,
/// [`HfModel`]).
pub fn load_model(name: &str) -> Result<Box<dyn CausalLm + Send>, CaptureError> {
    if name.starts_with(crate::model::hf::PREFIX) {
        return Ok(Box::new(HfModel::load(name)?));
    }
    Ok(family::load(&model_file(name)?)?)
}

/// [`load_model`] for a native model, its weights held as its GGUF stores them whatever their size
/// (the path a model above 8 GB as f32 takes).
pub fn load_model_quantized(name: &str) -> Result<Box<dyn CausalLm + Send>, CaptureError> {
    Ok(family::load_quantized(&model_file(name)?)?)
}

/// The model loaded last, by name: the steps of one command that ask for the same model (a sweep's
/// captures, then its recipes' live runs) load it once. Another model replaces it, the first
/// dropped before the second loads, so that two never need to fit side by side.
#[derive(Default)]
pub struct ModelSlot {
    loaded: Option<(String, Box<dyn CausalLm + Send>)>,
}

impl ModelSlot {
    /// Model `name` ([`load_model`]), loaded unless it is the one held.
    pub fn model(&mut self, name: &str) -> Result<&(dyn CausalLm + Send), CaptureError> {
        if self.loaded.as_ref().is_none_or(|(held, _)| held != name) {
            self.loaded = None;
            self.loaded = Some((name.to_owned(), load_model(name)?));
        }
        Ok(self
            .loaded
            .as_ref()
            .map(|(_, model)| model.as_ref())
            .expect("loaded"))
    }
}

/// The GGUF of model `name`: the file a `gguf:PATH` names, or the asset fetched (with the
/// essays) if missing. A file already there is used as
/// it is: a corrupted one is named when it loads, never replaced behind the user's back.
fn model_file(name: &str) -> Result<std::path::PathBuf, CaptureError> {
    if let Some(path) = family::gguf_path(name) {
        return Ok(path);
    }
    let asset = model_asset(name).ok_or_else(|| CaptureError::UnknownModel(name.to_owned()))?;
    let assets = Assets::from_env();
    let path = assets.model_file(asset);
    if path.is_file() {
        return Ok(path);
    }
    if assets.require_essays().is_err() || assets.require_model().is_err() {
        assets.fetch()?;
    }
    Ok(assets.fetch_model(asset)?)
}

/// The model recipe file `recipe` names, loaded.
pub fn load_recipe_model(recipe: &Path) -> Result<Box<dyn CausalLm + Send>, CaptureError> {
    let (parsed, _) = Recipe::load(recipe)?;
    load_model(parsed.model())
}

/// The prompt recipe file `recipe` builds for `model` (needle and word-list recipes read the
/// essays).
pub fn build_prompt(recipe: &Path, model: &dyn CausalLm) -> Result<BuiltPrompt, CaptureError> {
    let (parsed, base, essays) = load_with_essays(recipe)?;
    Ok(parsed.build(model.tokenizer(), &essays, &base)?)
}

/// The prompts of the questions recipe file `recipe` asks of its context, built for `model`.
pub fn build_questions(
    recipe: &Path,
    model: &dyn CausalLm,
) -> Result<BuiltQuestions, CaptureError> {
    let (parsed, base, essays) = load_with_essays(recipe)?;
    let mut questions = parsed.build_questions(model.tokenizer(), &essays, &base)?;
    questions.reconstruction = pass::pass_chunk(recipe)?;
    Ok(questions)
}

/// Recipe file `recipe`, the folder its paths are relative to, and the essays if it reads them.
fn load_with_essays(recipe: &Path) -> Result<(Recipe, PathBuf, Vec<PathBuf>), CaptureError> {
    let (parsed, base) = Recipe::load(recipe)?;
    let essays = match parsed.reads_essays() {
        true => Assets::from_env().require_essays()?,
        false => Vec::new(),
    };
    Ok((parsed, base, essays))
}

/// The trace of question `question` (from 0) of a recipe that asks `questions` of one context and
/// captures into `trace`: `trace` itself for one question, else `<stem>.q<question + 1>.safetensors`
/// beside it.
pub fn question_trace(trace: &Path, question: usize, questions: usize) -> PathBuf {
    match questions {
        1 => trace.to_owned(),
        _ => trace.with_extension(format!("q{}.safetensors", question + 1)),
    }
}

/// The trace of a question's shared context: [`question_trace`]'s `<stem>.q<N>.safetensors` less
/// its `.q<N>`; any other trace is its own.
pub fn shared_context(trace: &str) -> &str {
    let Some(stem) = trace.strip_suffix(".safetensors") else {
        return trace;
    };
    match stem.rsplit_once(".q") {
        Some((context, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => context,
        _ => trace,
    }
}

/// Captures `recipe` into `trace` (each of its questions' traces) unless it exists, holding a lock beside it (dropped by
/// the OS if the holder dies), so that sweeps or shards that start together capture a recipe once;
/// `capture` runs the capture (with a progress display of the caller's, or none).
pub fn capture_once(
    recipe: &Path,
    trace: &Path,
    capture: &mut dyn FnMut(&Path, &Path) -> Result<(), CaptureError>,
) -> Result<(), CaptureError> {
    let lock = trace.with_extension("safetensors.lock");
    // A recipe of several questions writes its first question's trace last.
    let questions = Recipe::load(recipe)?.0.questions();
    let written_last = question_trace(trace, 0, questions);
    crate::atomic::with_lock(&lock, || {
        if written_last.is_file() {
            return Ok(());
        }
        capture(recipe, trace)
    })
    .map_err(|source| CaptureError::Lock {
        path: lock.clone(),
        source,
    })?
}

/// Captures recipe file `recipe` with its model (from `models`) into `out` (a recipe of several
/// questions into each one's [`question_trace`], the first written last), fetching the assets
/// first if they are missing. The context the questions share is prefilled once.
/// `progress(done, total)` counts tokens. Returns each question's summary, in the questions'
/// order.
pub fn capture_recipe(
    recipe: &Path,
    out: &Path,
    (storage, chunk, inputs): (StorageDtype, usize, bool),
    models: &mut ModelSlot,
    progress: &mut dyn FnMut(usize, usize) -> Result<(), Stopped>,
) -> Result<Vec<CaptureSummary>, CaptureError> {
    let (parsed, _) = Recipe::load(recipe)?;
    let model = models.model(parsed.model())?;
    let projections = inputs.then(|| input_weights(model)).transpose()?;
    let questions = build_questions(recipe, model)?;
    let options = recipe_options(recipe, (parsed.model(), model), (storage, chunk))?;
    let mut passes = Passes::default();
    let spill_dir = out.parent().filter(|p| !p.as_os_str().is_empty());
    let spill_dir = spill_dir.unwrap_or(Path::new("."));
    let total = questions.shared
        + questions
            .prompts
            .iter()
            .map(|p| p.ids.len() - questions.shared + p.generate)
            .sum::<usize>();
    let mut done = 0;
    let mut summaries = Vec::new();
    let mut tick = |n: usize| {
        done += n;
        progress(done, total)
    };
    let mut write = |index: usize, run: PromptRun, tick: &mut Progress<'_>| {
        let PromptRun {
            mut cache,
            logits,
            mut recorder,
        } = run;
        let recorded_pass = passes.of(model, (&questions, index), &cache, chunk)?;
        let generated = model.decode_greedy(
            &mut cache,
            &logits,
            questions.prompts[index].generate,
            Some(&mut recorder),
            None,
            &mut |_| tick(1),
        )?;
        let written = (&questions, index, generated.as_slice());
        let recorded = (&recorder, projections.as_deref(), recorded_pass.as_deref());
        summaries.push(write_question(model, written, recorded, (&options, out))?);
        Ok::<(), CaptureError>(())
    };
    let recording = (chunk, spill_dir, inputs);
    prefill_questions(model, &questions, recording, &mut tick, &mut write)?;
    summaries.reverse();
    Ok(summaries)
}

/// What a capture of a recipe will write, at most (its generated tokens may stop early): the
/// positions of its longest question, and the bytes of q, k and v, of the attention inputs and of
/// the projections over every question's trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannedSize {
    /// The most positions one of its traces holds.
    pub positions: usize,
    /// Its traces.
    pub traces: usize,
    /// Bytes of q, k and v.
    pub vectors: u64,
    /// Bytes of the attention inputs' hidden states (0 when not recorded).
    pub hidden: u64,
    /// Bytes of the projections (0 when not recorded).
    pub projections: u64,
}

impl std::fmt::Display for PlannedSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let megabytes = |bytes: u64| bytes as f64 / 1e6;
        write!(
            f,
            "up to {} positions in {} trace(s): q, k, v {:.1} MB",
            self.positions,
            self.traces,
            megabytes(self.vectors)
        )?;
        if self.projections > 0 {
            write!(
                f,
                ", attention inputs {:.1} MB, projections {:.1} MB",
                megabytes(self.hidden),
                megabytes(self.projections)
            )?;
        }
        Ok(())
    }
}

/// What capturing `recipe` with `(storage, chunk, inputs)` will write at most, before it starts.
pub fn planned_size(
    recipe: &Path,
    models: &mut ModelSlot,
    (storage, _, inputs): (StorageDtype, usize, bool),
) -> Result<PlannedSize, CaptureError> {
    let (parsed, _) = Recipe::load(recipe)?;
    let model = models.model(parsed.model())?;
    let questions = build_questions(recipe, model)?;
    let spec = model.spec();
    let positions: Vec<u64> = questions
        .prompts
        .iter()
        .map(|prompt| (prompt.ids.len() + prompt.generate) as u64)
        .collect();
    let total: u64 = positions.iter().sum();
    let (layers, element) = (spec.n_layers as u64, storage.element_bytes() as u64);
    let heads = (spec.n_heads + 2 * spec.n_kv_heads) as u64 * spec.head_dim as u64;
    let (q, kv) = (
        (spec.n_heads * spec.head_dim) as u64,
        (spec.n_kv_heads * spec.head_dim) as u64,
    );
    // The model width, and per layer the q/k norms' elements (two `[head_dim]` vectors where
    // the family has them).
    let (d_model, norms) = match inputs {
        true => match model.attention_weights(0)? {
            Some(first) => (
                first.projections[0].weight.ncols() as u64,
                first.qk_norms.map_or(0, |_| 2 * spec.head_dim as u64),
            ),
            None => return Err(CaptureError::NoAttentionInputs(spec.family)),
        },
        false => (0, 0),
    };
    let traces = positions.len() as u64;
    Ok(PlannedSize {
        positions: positions.iter().copied().max().unwrap_or(0) as usize,
        traces: traces as usize,
        vectors: layers * total * heads * element,
        hidden: layers * total * d_model * element,
        projections: traces * layers * 4 * (2 * q * d_model + 2 * kv * d_model + norms),
    })
}

/// How a capture of recipe file `recipe` by `model` (the model the recipe names `name`) writes
/// its traces: at `storage`, prefilled in chunks of `chunk` tokens, the header naming the
/// recipe's file and model.
pub fn recipe_options(
    recipe: &Path,
    (name, model): (&str, &dyn CausalLm),
    (storage, chunk): (StorageDtype, usize),
) -> Result<CaptureOptions, CaptureError> {
    Ok(CaptureOptions {
        storage,
        chunk,
        recipe_name: recipe
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        model_id: match name {
            name if name.starts_with(crate::model::hf::PREFIX) => name.to_owned(),
            name => model_file(name)?
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| model.spec().name.clone()),
        },
    })
}

/// Every layer's attention weights, for a trace that stores its attention inputs; an error for a
/// family that does not give them.
pub fn input_weights(model: &dyn CausalLm) -> Result<Vec<AttentionWeights>, CaptureError> {
    (0..model.spec().n_layers)
        .map(|layer| {
            model
                .attention_weights(layer)?
                .ok_or(CaptureError::NoAttentionInputs(model.spec().family))
        })
        .collect()
}

/// Writes the trace of question `index` of `questions` that a capture into `out` writes
/// ([`question_trace`]): its run with the full cache as `recorder` recorded it (with its
/// attention inputs and the model's `projections`, and its reconstruction pass, where given),
/// its prompt and then the `generated` tokens fed back.
pub fn write_question(
    model: &dyn CausalLm,
    (questions, index, generated): (&BuiltQuestions, usize, &[u32]),
    recorded: Recorded<'_>,
    (options, out): (&CaptureOptions, &Path),
) -> Result<CaptureSummary, CaptureError> {
    let prompt = &questions.prompts[index];
    let count = questions.prompts.len();
    let mut meta = trace_meta(model, prompt, generated, options);
    if count > 1 {
        for (key, value) in [
            ("question", (index + 1).to_string()),
            ("questions", count.to_string()),
            ("shared_context", questions.shared.to_string()),
        ] {
            meta.extra.insert(key.into(), value);
        }
    }
    let tokens = token_ids(prompt, generated);
    let path = question_trace(out, index, count);
    write_layers(&path, &meta, options.storage, &tokens, recorded)?;
    Ok(CaptureSummary {
        path,
        prompt_tokens: prompt.ids.len(),
        generated_tokens: generated.len(),
        generated_text: model.tokenizer().decode(generated),
    })
}

/// The ids a trace of `prompt` stores: the prompt's, then the `generated` tokens fed back.
fn token_ids(prompt: &BuiltPrompt, generated: &[u32]) -> Vec<i64> {
    prompt
        .ids
        .iter()
        .chain(generated)
        .map(|id| *id as i64)
        .collect()
}

/// A question's prompt run with the full cache: the cache at its end, the logits there, and its
/// recording so far (the shared context's, continued).
pub struct PromptRun {
    /// The cache after the prompt.
    pub cache: KvCache,
    /// The logits at the prompt's last position.
    pub logits: Vec<f32>,
    /// What attention saw of the prompt.
    pub recorder: Recorder,
}

/// Called with the tokens run since the last call, after each chunk or token; one that returns
/// [`Stopped`] ends the run there.
pub type Progress<'a> = dyn FnMut(usize) -> Result<(), Stopped> + 'a;

/// What a caller does with each question's run of a shared prompt: its index, the run, and a
/// progress hook.
pub type OnPromptRun<'a, E> = dyn FnMut(usize, PromptRun, &mut Progress<'_>) -> Result<(), E> + 'a;

/// Runs the prompt of every question of `questions` with the full cache: their shared context
/// prefilled once (in chunks of `chunk` tokens, recorded in files under `spill_dir`), then each
/// question's own tokens from a copy of that cache, its recorder continuing the context's. Hands
/// each run to `then` with the question's index and `progress`, the last question first (a
/// capture writes the first question's trace last, so that it stands for them all). `progress(n)`
/// after each chunk of `n` tokens. One question whose prompt is all context is a plain prefill.
pub fn prefill_questions<E: From<ModelError>>(
    model: &dyn CausalLm,
    questions: &BuiltQuestions,
    (chunk, spill_dir, inputs): (usize, &Path, bool),
    progress: &mut Progress<'_>,
    then: &mut OnPromptRun<'_, E>,
) -> Result<(), E> {
    let shared = questions.shared;
    let recorder = || Recorder::spilling(spill_dir).keeping_inputs(inputs);
    let mut context = recorder();
    let mut cache = KvCache::default();
    let first = &questions.prompts[0].ids[..shared];
    let logits = prefill_onto(model, first, chunk, &mut cache, &mut context, progress)?;
    let context = Arc::new(context);
    for (index, prompt) in questions.prompts.iter().enumerate().rev() {
        let mut run = PromptRun {
            cache: cache.clone(),
            logits: logits.clone(),
            recorder: recorder().continuing(context.clone()),
        };
        let rest = &prompt.ids[shared..];
        if !rest.is_empty() {
            run.logits = prefill_onto(
                model,
                rest,
                chunk,
                &mut run.cache,
                &mut run.recorder,
                progress,
            )?;
        }
        then(index, run, progress)?;
    }
    Ok(())
}

/// Prefills `ids` in chunks of `chunk` tokens onto `cache`, recorded; `progress(n)` after each
/// chunk of `n` tokens. Returns the last logits (empty for no tokens).
fn prefill_onto(
    model: &dyn CausalLm,
    ids: &[u32],
    chunk: usize,
    cache: &mut KvCache,
    recorder: &mut Recorder,
    progress: &mut Progress<'_>,
) -> Result<Vec<f32>, ModelError> {
    let mut logits = Vec::new();
    for piece in ids.chunks(chunk.max(1)) {
        logits = model.forward(piece, cache, Some(recorder))?;
        progress(piece.len())?;
    }
    Ok(logits)
}

/// A finished capture, not yet written.
pub struct Captured {
    /// The generated token ids (all fed back, so part of the trace).
    pub generated: Vec<u32>,
    /// The generated text.
    pub generated_text: String,
    /// The recorder, for checks against the forward pass.
    pub recorder: Recorder,
    /// Every layer's attention projections, where the recorder kept attention inputs.
    projections: Option<Vec<AttentionWeights>>,
    meta: TraceMeta,
    tokens: Vec<i64>,
    storage: StorageDtype,
}

impl Captured {
    /// Writes the trace atomically, one layer of it in memory at a time.
    pub fn write(&self, path: &Path) -> Result<(), TraceError> {
        let recorded = (&self.recorder, self.projections.as_deref(), None);
        write_layers(path, &self.meta, self.storage, &self.tokens, recorded)
    }
}

/// The trace of a live run's recording ([`trace_meta`] with `options`; its attention inputs
/// where projections are given), its bytes in memory: the bytes [`write_question`] would write
/// to a file; `label` names it in errors.
pub fn recording_bytes(
    model: &dyn CausalLm,
    prompt: &BuiltPrompt,
    generated: &[u32],
    recorded: Recorded<'_>,
    options: &CaptureOptions,
    label: &Path,
) -> Result<Vec<u8>, TraceError> {
    let meta = trace_meta(model, prompt, generated, options);
    let tokens = token_ids(prompt, generated);
    with_layers(recorded, |layers, extras| {
        trace_bytes(label, &meta, options.storage, &tokens, layers, extras)
    })
}

/// What a run recorded: its recorder, the model's projections where it kept attention inputs,
/// and its reconstruction pass where the recipe asks for one.
pub type Recorded<'a> = (
    &'a Recorder,
    Option<&'a [AttentionWeights]>,
    Option<&'a RecordedPass>,
);

/// Writes what `recorder` recorded, with its attention inputs where `projections` are given and
/// its reconstruction pass where given.
fn write_layers(
    path: &Path,
    meta: &TraceMeta,
    storage: StorageDtype,
    tokens: &[i64],
    recorded: Recorded<'_>,
) -> Result<(), TraceError> {
    with_layers(recorded, |layers, extras| {
        write_trace(path, meta, storage, tokens, layers, extras)
    })
}

/// What `recorder` recorded as a trace writer reads it, with its attention inputs where
/// `projections` are given and its reconstruction pass where given, handed to `then`.
fn with_layers<R>(
    (recorder, projections, recorded_pass): Recorded<'_>,
    then: impl FnOnce((bool, LayerSource<'_>), Extras<'_>) -> R,
) -> R {
    let layer = |layer: usize| {
        recorder
            .layer(layer)
            .map(|(q, k, v)| (q, k, Some(v)))
            .map_err(|err| err.to_string())
    };
    let inputs_of = |layer: usize| -> Result<LayerInputs, String> {
        let projections = projections.expect("inputs are written with projections");
        let hidden = recorder.layer_input(layer).map_err(|err| err.to_string())?;
        Ok(LayerInputs {
            hidden: hidden.ok_or("the recorder kept no attention inputs")?,
            weights: projections[layer].clone(),
        })
    };
    let inputs = projections.and_then(|projections| {
        let first = projections.first()?;
        Some(InputsSource {
            d_model: first.projections[0].weight.ncols(),
            biases: first.projections.each_ref().map(|p| p.bias.is_some()),
            qk_norm_eps: first.qk_norms.as_ref().map(|norms| norms.eps),
            layer: &inputs_of,
        })
    });
    let rows = |layer: usize| -> Result<PassRows, String> {
        let recorded = recorded_pass.expect("rows are written with a pass");
        Ok(recorded.layers[layer].clone())
    };
    let reconstruction = recorded_pass.map(|recorded| ReconstructionSource {
        pass: recorded.planned.pass.clone(),
        tokens: recorded.planned.token_ids(),
        layer: &rows,
    });
    let extras = Extras {
        inputs: inputs.as_ref(),
        reconstruction: reconstruction.as_ref(),
    };
    then((true, &layer), extras)
}

/// KVzip's reconstruction passes of a recipe's questions, each cut's run once: the questions of
/// one context all cut where their question starts, so they share one.
#[derive(Default)]
pub struct Passes(Vec<(usize, Arc<RecordedPass>)>);

impl Passes {
    /// The pass of question `index` of `questions` from `cache`, its prompt's full cache (none
    /// when the recipe asks for none), prefilled in pieces of `prefill` tokens.
    pub fn of(
        &mut self,
        model: &dyn CausalLm,
        (questions, index): (&BuiltQuestions, usize),
        cache: &KvCache,
        prefill: usize,
    ) -> Result<Option<Arc<RecordedPass>>, CaptureError> {
        let Some(size) = questions.reconstruction else {
            return Ok(None);
        };
        let prompt = &questions.prompts[index];
        let cut = pass::cut_of(&prompt.ids, &prompt.spans);
        if let Some((_, done)) = self.0.iter().find(|(at, _)| *at == cut) {
            return Ok(Some(done.clone()));
        }
        let recorded = Arc::new(record_pass(model, (prompt, cut), cache, (size, prefill))?);
        self.0.push((cut, recorded.clone()));
        Ok(Some(recorded))
    }
}

/// KVzip's reconstruction pass of one prompt, run and recorded.
pub struct RecordedPass {
    /// Its chunks and rows.
    pub planned: PlannedPass,
    /// Per layer, the rows' queries `[n_heads, rows, d]` and keys `[n_kv_heads, rows, d]`.
    pub layers: Vec<PassRows>,
}

/// Runs KVzip's reconstruction pass of `prompt` cut at `cut` ([`pass::plan`], chunks of `size`
/// tokens) on `cache`, the prompt's full cache: each chunk's rows from the cache cut there,
/// prefilled in pieces of `prefill` tokens, their queries and keys recorded.
fn record_pass(
    model: &dyn CausalLm,
    (prompt, cut): (&BuiltPrompt, usize),
    cache: &KvCache,
    (size, prefill): (usize, usize),
) -> Result<RecordedPass, CaptureError> {
    let planned = pass::plan(&prompt.ids, cut, model.tokenizer(), size)
        .map_err(CaptureError::Reconstruction)?;
    let n_layers = model.spec().n_layers;
    let mut per_chunk: Vec<Vec<PassRows>> = Vec::new();
    for rows in &planned.rows {
        let mut branch = cache.truncated(cut);
        let mut recorder = Recorder::default();
        prefill_onto(
            model,
            rows,
            prefill,
            &mut branch,
            &mut recorder,
            &mut |_| Ok(()),
        )?;
        let layers = (0..n_layers)
            .map(|layer| recorder.layer(layer).map(|(q, k, _)| (q, k)))
            .collect::<Result<Vec<_>, _>>()?;
        per_chunk.push(layers);
    }
    let joined = |layer: usize, pick: fn(&PassRows) -> &Array3<f32>| {
        let views: Vec<_> = per_chunk.iter().map(|c| pick(&c[layer]).view()).collect();
        ndarray::concatenate(Axis(1), &views).expect("one head count and head size")
    };
    let layers = (0..n_layers)
        .map(|layer| (joined(layer, |p| &p.0), joined(layer, |p| &p.1)))
        .collect();
    Ok(RecordedPass { planned, layers })
}

/// Runs the prompt and the greedy continuation, recording every layer. `progress(done, total)`
/// is called after each prefill chunk and each generated token; one that returns [`Stopped`]
/// ends the capture there.
pub fn capture(
    model: &dyn CausalLm,
    prompt: &BuiltPrompt,
    options: &CaptureOptions,
    mut recorder: Recorder,
    progress: &mut dyn FnMut(usize, usize) -> Result<(), Stopped>,
) -> Result<Captured, CaptureError> {
    let total = prompt.ids.len() + prompt.generate;
    // Checked before the run: a family without them fails at once.
    let projections = match recorder.keeps_inputs() {
        true => Some(input_weights(model)?),
        false => None,
    };
    let generated = model.generate(
        &prompt.ids,
        prompt.generate,
        options.chunk,
        Some(&mut recorder),
        &mut |done| progress(done, total),
    )?;
    Ok(captured(
        model,
        prompt,
        options,
        (recorder, projections),
        generated,
    ))
}

/// The capture of `prompt` that generated `generated`, recorded by `recorder` (with the model's
/// `projections` where it kept attention inputs).
fn captured(
    model: &dyn CausalLm,
    prompt: &BuiltPrompt,
    options: &CaptureOptions,
    (recorder, projections): (Recorder, Option<Vec<AttentionWeights>>),
    generated: Vec<u32>,
) -> Captured {
    Captured {
        projections,
        meta: trace_meta(model, prompt, &generated, options),
        tokens: token_ids(prompt, &generated),
        storage: options.storage,
        generated_text: model.tokenizer().decode(&generated),
        generated,
        recorder,
    }
}

/// The kvtrace/1 header of a run: `prompt` and the `generated` tokens fed back.
fn trace_meta(
    model: &dyn CausalLm,
    prompt: &BuiltPrompt,
    generated: &[u32],
    options: &CaptureOptions,
) -> TraceMeta {
    let spec = model.spec();
    let tokenizer = model.tokenizer();
    let mut extra = BTreeMap::new();
    extra.insert("prompt_text".into(), tokenizer.decode(&prompt.ids));
    extra.insert("generated_text".into(), tokenizer.decode(generated));
    extra.insert(
        "source".into(),
        format!(
            "kvreplay {} {}; recipe {}; prefill chunk {}; storage {:?}",
            env!("CARGO_PKG_VERSION"),
            spec.engine,
            options.recipe_name,
            options.chunk,
            options.storage
        ),
    );
    TraceMeta {
        model: options.model_id.clone(),
        n_layers: spec.n_layers,
        n_heads: spec.n_heads,
        n_kv_heads: spec.n_kv_heads,
        head_dim: spec.head_dim,
        prompt_len: prompt.ids.len(),
        scale: spec.scale,
        softcap: None,
        rope_theta: spec.rope_theta,
        rope_thetas: spec.rope_thetas.clone(),
        windows: spec.windows.clone(),
        spans: prompt.spans.clone(),
        extra,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_questions_trace_leads_back_to_its_shared_context() {
        assert_eq!(
            shared_context("r/niah_questions.q2.safetensors"),
            "r/niah_questions"
        );
        assert_eq!(shared_context("r/niah.safetensors"), "r/niah.safetensors");
        assert_eq!(
            shared_context("r/a.quest.safetensors"),
            "r/a.quest.safetensors"
        );
        assert_eq!(shared_context("r/a.q.safetensors"), "r/a.q.safetensors");
        let trace = Path::new("r/niah_questions.safetensors");
        for question in 0..4 {
            let asked = question_trace(trace, question, 4);
            assert_eq!(
                shared_context(&asked.display().to_string()),
                "r/niah_questions"
            );
        }
    }
}
