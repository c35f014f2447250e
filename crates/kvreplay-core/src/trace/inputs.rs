//! A trace's optional attention inputs (`docs/trace-format.md`, "Attention inputs"): each layer's
//! input to attention (the normed hidden states, `[T, d_model]`) and its projection weights
//! (`q_proj`, `k_proj`, `v_proj`, `o_proj`, with their biases where the model has them), for the
//! methods that recompute queries or keys from the hidden states (kvpress's LeverageScorePress,
//! CompactorPress) or weigh values through the output projection (CriticalKVPress).
//!
//! For a model that normalises each head's q and k after the projections (Gemma 3, Qwen3), the
//! group also holds those norms' weights and the header their ε (`qk_norm_eps`), so that the
//! projections still give the queries and keys before the rotary.
//!
//! They are one group: a trace has all of them in every layer or none. Every rule is checked
//! when the trace is opened; the values are read (and checked finite) only when asked for.

use super::{TraceError, TraceMeta};
use ndarray::{Array1, Array2};
use safetensors::tensor::{Dtype, Metadata};
use std::path::Path;

/// The four projections, by the name their tensors carry.
pub const PROJECTIONS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];

/// One linear map `y = x Wᵀ + b`, as PyTorch's `nn.Linear` stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct Projection {
    /// `[out, in]`.
    pub weight: Array2<f32>,
    /// `[out]`, when the model has one.
    pub bias: Option<Array1<f32>>,
}

/// The header key of the per-head q/k norms' ε.
pub const QK_NORM_EPS: &str = "qk_norm_eps";

/// The RMS norms a model applies to each head's q and k after the projections and before the
/// rotary: `x / sqrt(mean(x²) + eps) * weight` over each head's `head_dim` values, `weight`
/// being the multiplier as applied (Gemma 3's `1 + w` of its Hugging Face module).
#[derive(Debug, Clone, PartialEq)]
pub struct QkNorms {
    /// The query heads' multiplier, `[head_dim]`.
    pub q: Array1<f32>,
    /// The key heads' multiplier, `[head_dim]`.
    pub k: Array1<f32>,
    /// The ε under the square root.
    pub eps: f32,
}

/// One layer's attention weights: its four projections and, for a model that has them, its
/// per-head q/k norms.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionWeights {
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, in [`PROJECTIONS`]' order.
    pub projections: [Projection; 4],
    /// The per-head q/k norms, where the model has them.
    pub qk_norms: Option<QkNorms>,
}

/// One layer's attention inputs, converted to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerInputs {
    /// The normed hidden states entering attention, `[T, d_model]`.
    pub hidden: Array2<f32>,
    /// The layer's projections and q/k norms.
    pub weights: AttentionWeights,
}

impl LayerInputs {
    /// Projection `name` (one of [`PROJECTIONS`]).
    pub fn projection(&self, name: &str) -> &Projection {
        let index = PROJECTIONS
            .iter()
            .position(|p| *p == name)
            .unwrap_or_else(|| panic!("no projection `{name}`"));
        &self.weights.projections[index]
    }
}

/// What opening a trace learns of its attention inputs: the model width, and the q/k norms' ε
/// where the trace holds q/k norms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct InputsLayout {
    pub d_model: usize,
    pub qk_norm_eps: Option<f32>,
}

/// The layout of a trace's attention inputs, after checking every one of their tensors; `None`
/// when it has none.
pub(super) fn check(
    path: &Path,
    header: &Metadata,
    meta: &TraceMeta,
    n_positions: usize,
) -> Result<Option<InputsLayout>, TraceError> {
    let named = |name: &str| header.info(name);
    let Some(first) = named("layers.0.input") else {
        if let Some(name) = (0..meta.n_layers)
            .flat_map(|layer| names(layer).into_iter())
            .find(|name| named(name).is_some())
        {
            return Err(TraceError::Shape {
                path: path.to_owned(),
                tensor: name,
                found: Vec::new(),
                expected: Vec::new(),
                rule: "attention inputs are one group: every layer has `input` and the four projections, or none does",
            });
        }
        return Ok(None);
    };
    let d_model = first.shape.get(1).copied().unwrap_or(0);
    let shapes = projection_shapes(meta, d_model);
    let qk_norm_eps = qk_norm_eps(path, header, meta)?;
    for layer in 0..meta.n_layers {
        let mut expected = vec![(format!("layers.{layer}.input"), vec![n_positions, d_model])];
        if qk_norm_eps.is_some() {
            for norm in QK_NORMS {
                expected.push((format!("layers.{layer}.{norm}.weight"), vec![meta.head_dim]));
            }
        }
        for (projection, shape) in PROJECTIONS.iter().zip(shapes) {
            expected.push((
                format!("layers.{layer}.{projection}.weight"),
                shape.to_vec(),
            ));
            let bias = format!("layers.{layer}.{projection}.bias");
            if named(&bias).is_some() {
                expected.push((bias, vec![shape[0]]));
            }
        }
        for (name, shape) in expected {
            let info = named(&name).ok_or_else(|| TraceError::MissingTensor {
                path: path.to_owned(),
                tensor: name.clone(),
            })?;
            if !float_dtype(info.dtype) {
                return Err(TraceError::Dtype {
                    path: path.to_owned(),
                    tensor: name,
                    found: format!("{:?}", info.dtype),
                    expected: "F16, BF16 or F32".into(),
                });
            }
            if info.shape != shape || d_model == 0 {
                return Err(TraceError::Shape {
                    path: path.to_owned(),
                    tensor: name,
                    found: info.shape.clone(),
                    expected: shape,
                    rule: "attention inputs: input [T, d_model], q_proj [n_heads·head_dim, d_model], k_proj and v_proj [n_kv_heads·head_dim, d_model], o_proj [d_model, n_heads·head_dim], q_norm and k_norm [head_dim], one d_model in every layer",
                });
            }
        }
    }
    Ok(Some(InputsLayout {
        d_model,
        qk_norm_eps,
    }))
}

/// The names of the per-head q/k norms' tensors (each `.weight`).
pub const QK_NORMS: [&str; 2] = ["q_norm", "k_norm"];

/// The q/k norms' ε of a trace with attention inputs: `Some` where its first layer has a
/// `q_norm`, which then needs the header's `qk_norm_eps`; a header ε without norms is refused.
fn qk_norm_eps(
    path: &Path,
    header: &Metadata,
    meta: &TraceMeta,
) -> Result<Option<f32>, TraceError> {
    let named = header.info("layers.0.q_norm.weight").is_some();
    let bad = |value: &str, expected: &'static str| TraceError::BadValue {
        path: path.to_owned(),
        key: QK_NORM_EPS,
        value: value.to_owned(),
        expected,
    };
    match (named, meta.extra.get(QK_NORM_EPS)) {
        (false, None) => Ok(None),
        (false, Some(value)) => Err(bad(
            value,
            "absent: the trace holds no q_norm/k_norm weights for it to go with",
        )),
        (true, None) => Err(bad(
            "(missing)",
            "a positive finite number, the ε of the q/k norms whose weights the trace holds",
        )),
        (true, Some(value)) => match value.parse::<f32>() {
            Ok(eps) if eps.is_finite() && eps > 0.0 => Ok(Some(eps)),
            _ => Err(bad(value, "a positive finite number")),
        },
    }
}

/// Each projection's weight shape `[out, in]`, in [`PROJECTIONS`]' order (its bias is `[out]`).
pub(super) fn projection_shapes(meta: &TraceMeta, d_model: usize) -> [[usize; 2]; 4] {
    let (q, kv) = (
        meta.n_heads * meta.head_dim,
        meta.n_kv_heads * meta.head_dim,
    );
    [[q, d_model], [kv, d_model], [kv, d_model], [d_model, q]]
}

/// The names of layer `layer`'s attention-input tensors, biases included.
fn names(layer: usize) -> Vec<String> {
    let mut names = vec![format!("layers.{layer}.input")];
    for projection in PROJECTIONS {
        names.push(format!("layers.{layer}.{projection}.weight"));
        names.push(format!("layers.{layer}.{projection}.bias"));
    }
    for norm in QK_NORMS {
        names.push(format!("layers.{layer}.{norm}.weight"));
    }
    names
}

/// Whether `dtype` is one a trace stores vectors and weights in.
pub(super) fn float_dtype(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32)
}
