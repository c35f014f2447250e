//! A native model at this machine's limits (`kvreplay bench --model NAME`), each timing beside
//! the floor it is held against, both measured in the same run:
//! - the capture's prefill (q/k/v recorded) against its essential work: every weight product of
//!   the prompt's tokens and each query's q·k and weights·v over its causal prefix, at the
//!   model-shaped product peak;
//! - one decode step of one row against the memory-bandwidth floor: its weights (as held) and
//!   its KV cache read once, at a streaming read of a buffer larger than the caches;
//! - the batched decode: one step of many rows, each with its own copy of the prompt's cache.

use super::closed_loop::{multiply_adds, product_peak};
use super::{essay_ids, BenchError};
use crate::capture::{load_model, load_model_quantized};
use crate::model::{KvCache, ModelSpec, Recorder, Row};
use crate::stop::Stop;
use rayon::prelude::*;
use std::time::Instant;

/// Timings taken `REPEATS` times; the best counts, as the peaks they are held against are best runs.
const REPEATS: usize = 3;

/// Bytes of the buffer the streaming read sums: far beyond any cache of the processor, and small
/// beside a model held twice (its weights and, once a decode has run, their strips).
const STREAMED_BYTES: usize = 1 << 30;

/// Rows of the batched decode step.
pub const BATCH_ROWS: usize = 8;

/// What [`model_limits`] measured.
#[derive(Debug, Clone)]
pub struct ModelLimits {
    /// Prompt tokens.
    pub tokens: usize,
    /// Seconds of the capture's prefill, and of its essential work at `peak` GFLOP/s.
    pub prefill: (f64, f64),
    /// The model-shaped product peak, GFLOP/s.
    pub peak: f64,
    /// Milliseconds of one decode step of one row, and of reading its weights and cache once.
    pub step: (f64, f64),
    /// Bytes one such step reads: the weights as held, and the cache.
    pub bytes: (usize, usize),
    /// Streaming read bandwidth, GB/s.
    pub bandwidth: f64,
    /// Milliseconds of one decode step of [`BATCH_ROWS`] rows.
    pub batched_ms: f64,
    /// How the model holds its weights and computes ([`crate::model::ModelSpec::engine`]).
    pub engine: String,
}

/// Measures model `name` (a `kvreplay fetch --model` name or `gguf:PATH`; its weights held as the
/// GGUF stores them where `quantized`) on the first `tokens` tokens of two haystack essays.
/// `stop` is asked after each chunk of the prefill and between timings.
pub fn model_limits(
    (name, quantized): (&str, bool),
    tokens: usize,
    stop: Stop<'_>,
) -> Result<ModelLimits, BenchError> {
    let model = match quantized {
        true => load_model_quantized(name)?,
        false => load_model(name)?,
    };
    let ids = essay_ids(model.as_ref(), tokens)?;
    let weights = model.weight_products_per_token().ok_or_else(|| {
        BenchError::Reference(format!("{name}: its family does not count its weights"))
    })?;
    let peak = product_peak();
    let essential = 2.0 * multiply_adds(weights, model.spec(), (ids.len(), 0)).0 / peak / 1e9;
    let prefill = best_seconds(|| {
        let mut recorder = Recorder::default();
        model.generate(&ids, 0, 512, Some(&mut recorder), &mut |_| stop())?;
        Ok(None)
    })?;
    stop()?;
    let mut cache = KvCache::default();
    let mut logits = Vec::new();
    for chunk in ids.chunks(512) {
        logits = model.forward(chunk, &mut cache, None)?;
    }
    let next = [crate::model::argmax(&logits)];
    let step = best_seconds(|| {
        model.forward(&next, &mut cache.clone(), None)?;
        Ok(None)
    })?;
    stop()?;
    let batched = best_seconds(|| {
        let mut caches: Vec<KvCache> = (0..BATCH_ROWS).map(|_| cache.clone()).collect();
        let started = Instant::now();
        let mut rows: Vec<Row> = caches
            .iter_mut()
            .map(|cache| Row::new(&next, cache, None))
            .collect();
        model.forward_rows(&mut rows)?;
        Ok(Some(started.elapsed().as_secs_f64()))
    })?;
    let bytes = (weights.bytes, cache_bytes(model.spec(), ids.len()));
    let bandwidth = streaming_read(STREAMED_BYTES);
    Ok(ModelLimits {
        tokens: ids.len(),
        prefill: (prefill, essential),
        peak,
        step: (
            1e3 * step,
            1e3 * (bytes.0 + bytes.1) as f64 / bandwidth / 1e9,
        ),
        bytes,
        bandwidth,
        batched_ms: 1e3 * batched,
        engine: model.spec().engine.clone(),
    })
}

/// Bytes of the keys and values a cache holds after `tokens` positions, as f32: each layer keeps
/// what its window shows.
fn cache_bytes(spec: &ModelSpec, tokens: usize) -> usize {
    let held = |window: usize| {
        if window == 0 {
            tokens
        } else {
            window.min(tokens)
        }
    };
    let per_position = 2 * spec.n_kv_heads * spec.head_dim * 4;
    spec.windows.iter().map(|&w| held(w) * per_position).sum()
}

/// The best of [`REPEATS`] timings of `run` (its own seconds where it returns them, else the
/// whole call's).
fn best_seconds(
    mut run: impl FnMut() -> Result<Option<f64>, BenchError>,
) -> Result<f64, BenchError> {
    let mut best = f64::INFINITY;
    for _ in 0..REPEATS {
        let started = Instant::now();
        let own = run()?;
        best = best.min(own.unwrap_or_else(|| started.elapsed().as_secs_f64()));
    }
    Ok(best)
}

/// GB/s of the best of [`REPEATS`] sums of a buffer of `bytes` on every thread: a streaming read,
/// the rate a decode step reads its weights at best.
fn streaming_read(bytes: usize) -> f64 {
    let buffer: Vec<f32> = (0..bytes / 4).map(|i| (i % 7) as f32).collect();
    let mut best = 0.0f64;
    for _ in 0..REPEATS {
        let started = Instant::now();
        let sum: f32 = buffer
            .par_chunks(1 << 16)
            .map(|chunk| {
                let mut lanes = [0f32; 16];
                for block in chunk.chunks_exact(16) {
                    for (lane, value) in lanes.iter_mut().zip(block) {
                        *lane += value;
                    }
                }
                lanes.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(sum);
        best = best.max(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_holds_each_layer_s_window() {
        let spec = ModelSpec {
            family: "llama",
            name: "tiny".into(),
            n_layers: 2,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: vec![0, 2],
            engine: crate::model::F32_ENGINE.into(),
        };
        // A position is a key and a value of 2 f32 per KV head: 16 bytes. Five positions: the
        // global layer holds 5, the windowed one 2.
        assert_eq!(cache_bytes(&spec, 5), 5 * 16 + 2 * 16);
        assert_eq!(cache_bytes(&spec, 1), 2 * 16);
    }
}
