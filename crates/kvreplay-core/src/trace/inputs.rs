//! A trace's optional attention inputs (`docs/trace-format.md`, "Attention inputs"): each layer's
//! input to attention (the normed hidden states, `[T, d_model]`) and its projection weights
//! (`q_proj`, `k_proj`, `v_proj`, `o_proj`, with their biases where the model has them), for the
//! methods that recompute queries or keys from the hidden states (kvpress's LeverageScorePress,
//! CompactorPress) or weigh values through the output projection (CriticalKVPress).
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

/// One layer's attention inputs, converted to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerInputs {
    /// The normed hidden states entering attention, `[T, d_model]`.
    pub hidden: Array2<f32>,
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, in [`PROJECTIONS`]' order.
    pub projections: [Projection; 4],
}

impl LayerInputs {
    /// Projection `name` (one of [`PROJECTIONS`]).
    pub fn projection(&self, name: &str) -> &Projection {
        let index = PROJECTIONS
            .iter()
            .position(|p| *p == name)
            .unwrap_or_else(|| panic!("no projection `{name}`"));
        &self.projections[index]
    }
}

/// The model width `d_model` of a trace whose header lists attention inputs, after checking every
/// one of their tensors; `None` when it has none.
pub(super) fn check(
    path: &Path,
    header: &Metadata,
    meta: &TraceMeta,
    n_positions: usize,
) -> Result<Option<usize>, TraceError> {
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
    for layer in 0..meta.n_layers {
        let mut expected = vec![(format!("layers.{layer}.input"), vec![n_positions, d_model])];
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
                    rule: "attention inputs: input [T, d_model], q_proj [n_heads·head_dim, d_model], k_proj and v_proj [n_kv_heads·head_dim, d_model], o_proj [d_model, n_heads·head_dim], one d_model in every layer",
                });
            }
        }
    }
    Ok(Some(d_model))
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
    names
}

/// Whether `dtype` is one a trace stores vectors and weights in.
pub(super) fn float_dtype(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32)
}
