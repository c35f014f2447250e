//! What kvreplay's integration tests share (each crate's test binary builds on it): tiny fixture
//! traces the tests build themselves and the policies each scorer's brute-force reference runs
//! them with; with the `models` feature (the models' and the command line's tests, not the
//! core's), the real assets fetched once per binary and the Python environments of the reference
//! implementations.

use kvreplay_core::replay::reference::ScorerRule;
use kvreplay_core::replay::{scorer, settings, PolicyParams, Timing};
use kvreplay_core::trace::{
    AttentionWeights, Chunk, LayerInputs, LayerReconstruction, Projection, Reconstruction, Span,
    StorageDtype, TraceMeta, TraceWriter,
};
use ndarray::{Array1, Array2, Array3};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[cfg(feature = "models")]
mod models;
#[cfg(feature = "models")]
pub use models::*;

/// Asserts logits `ours` within `tolerance` times the range (largest minus smallest) of
/// `theirs`, printing the largest difference.
pub fn assert_logits_near(ours: &[f32], theirs: &[f32], tolerance: f32) {
    let range = theirs.iter().cloned().fold(f32::MIN, f32::max)
        - theirs.iter().cloned().fold(f32::MAX, f32::min);
    let worst = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("max |Δ logit| = {worst:e} over a range of {range}");
    assert_eq!(ours.len(), theirs.len(), "as many logits");
    assert!(worst < tolerance * range, "logits differ by {worst}");
}

/// SplitMix64: a tiny seeded generator, so fixtures need no RNG crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    /// A multiple of 0.25 in [-2, 2]: dot products are exact in f32, so the only rounding is in
    /// the softmax, and identical keys tie exactly in every implementation.
    pub fn quarter(&mut self) -> f32 {
        (self.next_u64() % 17) as f32 * 0.25 - 2.0
    }
}

/// The shape of a fixture.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub prompt_len: usize,
    pub generated: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            prompt_len: 20,
            generated: 5,
        }
    }
}

/// The header of a fixture of this shape (a `needle` span in the middle of the prompt).
pub fn meta(shape: Shape) -> TraceMeta {
    let middle = shape.prompt_len / 2;
    TraceMeta {
        model: "fixture".into(),
        n_layers: shape.n_layers,
        n_heads: shape.n_heads,
        n_kv_heads: shape.n_kv_heads,
        head_dim: shape.head_dim,
        prompt_len: shape.prompt_len,
        scale: 1.0 / (shape.head_dim as f32).sqrt(),
        softcap: None,
        rope_theta: Some(ROPE_THETA),
        rope_thetas: Vec::new(),
        windows: Vec::new(),
        spans: vec![Span {
            name: "needle".into(),
            start: middle.saturating_sub(1),
            end: middle + 2,
        }],
        extra: BTreeMap::new(),
    }
}

/// The tensors of a random fixture: per layer q, k, v.
pub fn tensors(shape: Shape, seed: u64) -> Vec<(Array3<f32>, Array3<f32>, Array3<f32>)> {
    let mut rng = Rng(seed);
    let t = shape.prompt_len + shape.generated;
    (0..shape.n_layers)
        .map(|_| {
            let q =
                Array3::from_shape_simple_fn((shape.n_heads, t, shape.head_dim), || rng.quarter());
            let k = Array3::from_shape_simple_fn((shape.n_kv_heads, t, shape.head_dim), || {
                rng.quarter()
            });
            let v = Array3::from_shape_simple_fn((shape.n_kv_heads, t, shape.head_dim), || {
                rng.quarter()
            });
            (q, k, v)
        })
        .collect()
}

/// Writes a random fixture trace (f32 storage, values included) and returns its tensors.
pub fn write_fixture(
    path: &Path,
    shape: Shape,
    seed: u64,
) -> Vec<(Array3<f32>, Array3<f32>, Array3<f32>)> {
    let layers = tensors(shape, seed);
    let t = shape.prompt_len + shape.generated;
    let tokens: Vec<i64> = (0..t as i64).collect();
    let mut writer = TraceWriter::new(meta(shape), StorageDtype::F32, tokens);
    for (q, k, v) in &layers {
        writer.push_layer(q.clone(), k.clone(), Some(v.clone()));
    }
    with_extras(writer, shape, seed, shape.prompt_len)
        .write(path)
        .expect("fixture writes");
    layers
}

/// A random reconstruction pass of a fixture of `shape` (the `kvzip` scorer's), run at `cut`:
/// positions `[2, cut)` repeated in two chunks, each with 3 rows of instruction before its own.
pub fn fixture_pass(shape: Shape, seed: u64, cut: usize) -> Vec<LayerReconstruction> {
    let middle = (2 + cut) / 2;
    let chunks = vec![
        Chunk {
            context: 2..middle,
            rows: middle - 2 + 3,
        },
        Chunk {
            context: middle..cut,
            rows: cut - middle + 3,
        },
    ];
    let pass = Reconstruction { chunks };
    let rows = pass.rows();
    let mut rng = Rng(seed ^ 0x6b767a6970);
    (0..shape.n_layers)
        .map(|_| LayerReconstruction {
            pass: pass.clone(),
            q: Array3::from_shape_simple_fn((shape.n_heads, rows, shape.head_dim), || {
                rng.quarter()
            }),
            k: Array3::from_shape_simple_fn((shape.n_kv_heads, rows, shape.head_dim), || {
                rng.quarter()
            }),
        })
        .collect()
}

/// Random attention inputs of a fixture of `shape` (`defensivekv` reads `o_proj`): hidden states
/// of width [`D_MODEL`] and the four projections, `q_proj` and `k_proj` with biases.
pub fn fixture_inputs(shape: Shape, seed: u64) -> Vec<LayerInputs> {
    let mut rng = Rng(seed ^ 0x696e70757473);
    random_inputs(shape, D_MODEL, || rng.quarter())
}

/// Attention inputs of a trace of `shape` with model width `d_model`, every element drawn from
/// `value`: hidden states and the four projections, `q_proj` and `k_proj` with biases of 0.25.
pub fn random_inputs(
    shape: Shape,
    d_model: usize,
    mut value: impl FnMut() -> f32,
) -> Vec<LayerInputs> {
    let t = shape.prompt_len + shape.generated;
    let (q, kv) = (
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
    );
    let mut matrix =
        |rows: usize, columns: usize| Array2::from_shape_simple_fn((rows, columns), &mut value);
    (0..shape.n_layers)
        .map(|_| {
            let hidden = matrix(t, d_model);
            let mut projection = |rows: usize, columns: usize, bias: bool| Projection {
                weight: matrix(rows, columns),
                bias: bias.then(|| Array1::from_elem(rows, 0.25)),
            };
            LayerInputs {
                hidden,
                weights: AttentionWeights {
                    projections: [
                        projection(q, d_model, true),
                        projection(kv, d_model, true),
                        projection(kv, d_model, false),
                        projection(d_model, q, false),
                    ],
                    qk_norms: None,
                },
            }
        })
        .collect()
}

/// The model width of the fixtures' attention inputs.
pub const D_MODEL: usize = 6;

/// `writer` with [`fixture_pass`] and [`fixture_inputs`] added.
pub fn with_extras(writer: TraceWriter, shape: Shape, seed: u64, cut: usize) -> TraceWriter {
    let layers = fixture_pass(shape, seed, cut);
    let pass = layers[0].pass.clone();
    let tokens = (0..pass.rows() as i64).collect();
    let rows = layers.into_iter().map(|layer| (layer.q, layer.k)).collect();
    writer
        .with_reconstruction(pass, tokens, rows)
        .with_inputs(fixture_inputs(shape, seed))
}

/// Writes `layers` (f32, values included) as a trace of `shape` whose layers have attention
/// windows `windows` (empty: every layer global).
pub fn write_windowed(
    path: &Path,
    shape: Shape,
    layers: &[(Array3<f32>, Array3<f32>, Array3<f32>)],
    windows: Vec<usize>,
) {
    let mut meta = meta(shape);
    meta.windows = windows;
    let t = shape.prompt_len + shape.generated;
    let mut writer = TraceWriter::new(meta, StorageDtype::F32, (0..t as i64).collect());
    for (q, k, v) in layers {
        writer.push_layer(q.clone(), k.clone(), Some(v.clone()));
    }
    with_extras(writer, shape, 0, shape.prompt_len)
        .write(path)
        .expect("fixture writes");
}

/// The rotary base of the fixtures.
pub const ROPE_THETA: f32 = 10_000.0;

/// The brute-force rule of `params`' scorer with its settings there, or a failure naming the
/// scorer: every registered scorer must have one.
pub fn scorer_rule(params: &PolicyParams) -> Box<dyn ScorerRule> {
    let method = settings::find(scorer::REGISTRY, &params.scorer).expect("a registered scorer");
    let given: serde_json::Map<String, serde_json::Value> =
        params.settings.clone().into_iter().collect();
    let built = (method.build)(&method.resolve(&given)).expect("the scorer's settings check");
    built.reference().unwrap_or_else(|| {
        panic!(
            "scorer `{}` has no brute-force reference rule: give it `Scorer::reference` \
             (docs/adding-a-method.md)",
            params.scorer
        )
    })
}

/// A policy of `scorer` on the fixtures (window 2, one sink), with the settings its reference
/// rule asks for on fixture `seed`.
pub fn fixture_policy(scorer: &str, timing: Timing, budget: usize, seed: u64) -> PolicyParams {
    let base = PolicyParams {
        scorer: scorer.into(),
        timing,
        budget,
        window: 2,
        sinks: 1,
        ..PolicyParams::default()
    };
    let fixture = scorer_rule(&base).fixture(seed);
    fixture
        .into_iter()
        .fold(base, |params, (key, value)| params.with(key, value))
}

/// The repository's root: its `tests/`, `traces/` and `experiments/` folders.
pub fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
