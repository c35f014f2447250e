//! A policy's parameters as the user gives them ([`PolicyParams`]) and as the engine accepts them
//! ([`ValidPolicy`]): every rule is checked once, before any layer is read (linfa's ParamGuard).

use super::allocator::{self, Allocator};
use super::scorer::{self, Scorer};
use super::PolicyError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// When eviction happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Timing {
    /// One-shot at the end of the prompt; generated tokens are appended and never evicted
    /// (SnapKV, PyramidKV, AdaKV, CAKE).
    Prefill,
    /// From the first token over budget, every token, prefill and decode alike (H2O,
    /// StreamingLLM, TOVA, the seed library's adapted methods).
    Streaming,
}

/// The unit that owns a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Granularity {
    /// One cache per KV head; the group's query-head scores are aggregated (kvpress, AdaKV).
    KvHead,
    /// One cache per query head, K/V repeated (the official SnapKV/PyramidKV code); memory is
    /// counted per query head.
    QueryHead,
}

/// How a GQA group's query-head scores become one score per cached token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Mean over the group (default; kvpress, AdaKV).
    Mean,
    /// Max over the group.
    Max,
    /// Sum over the group.
    Sum,
}

impl Aggregation {
    /// Combines one score per query head into one.
    pub fn combine(self, values: impl Iterator<Item = f32>) -> f32 {
        let mut count = 0usize;
        let mut acc = match self {
            Aggregation::Max => f32::NEG_INFINITY,
            _ => 0.0,
        };
        for value in values {
            count += 1;
            acc = match self {
                Aggregation::Max => acc.max(value),
                _ => acc + value,
            };
        }
        match self {
            Aggregation::Mean if count > 0 => acc / count as f32,
            _ => acc,
        }
    }
}

/// SnapKV's 1-D pooling of window scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Pooling {
    /// Average pooling; the zero padding counts (divides by the kernel), as torch's avg_pool1d.
    Avg,
    /// Max pooling (the PyramidKV paper's runs).
    Max,
}

/// PyramidKV's rounding of its linear schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Rounding {
    /// The official code's floor division (its mean overshoots the nominal budget).
    Official,
    /// The same line, rounded by largest remainder so the mean is exactly the budget.
    ExactMean,
}

/// How a layer's budget is split among its caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum HeadBudget {
    /// Every cache of the layer gets the layer's budget.
    Uniform,
    /// AdaKV's head-wise rule (arXiv:2407.11550), with floor `alpha`.
    Adakv,
}

/// A policy as given on the command line or in an experiment file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyParams {
    /// Allocator name (registry key).
    pub allocator: String,
    /// Scorer name (registry key).
    pub scorer: String,
    /// When eviction happens.
    pub timing: Timing,
    /// Nominal tokens kept per cache (mean over layers), sinks and window included.
    pub budget: usize,
    /// Recent tokens always kept; also SnapKV's observation window.
    pub window: usize,
    /// SnapKV's pooling kernel (odd).
    pub kernel: usize,
    /// SnapKV's pooling.
    pub pool: Pooling,
    /// First positions always kept (attention sinks).
    pub sinks: usize,
    /// `pyramid`: the divisor beta of the official code (default 20); `pyramid-taper`: the
    /// steepness >= 1 of the seed library (default 2).
    pub beta: Option<f64>,
    /// `pyramid` rounding.
    pub rounding: Rounding,
    /// Cache granularity under grouped-query attention.
    pub gqa: Granularity,
    /// Aggregation of a group's scores.
    pub agg: Aggregation,
    /// Split of a layer's budget among its caches.
    pub heads: HeadBudget,
    /// AdaKV's floor (share of each head's budget guaranteed).
    pub alpha: f64,
    /// CAKE's entropy temperature.
    pub tau1: f64,
    /// CAKE's variance temperature.
    pub tau2: f64,
    /// Seed of the `random` scorer.
    pub seed: u64,
    /// k of the top-k recall metric.
    pub top_k: usize,
}

impl Default for PolicyParams {
    fn default() -> Self {
        Self {
            allocator: "flat".into(),
            scorer: "snapkv".into(),
            timing: Timing::Prefill,
            budget: 128,
            window: 8,
            kernel: 7,
            pool: Pooling::Avg,
            sinks: 0,
            beta: None,
            rounding: Rounding::Official,
            gqa: Granularity::KvHead,
            agg: Aggregation::Mean,
            heads: HeadBudget::Uniform,
            alpha: 0.2,
            tau1: 1.0,
            tau2: 1.0,
            seed: 0,
            top_k: 10,
        }
    }
}

/// A checked policy: the only thing the engine runs.
pub struct ValidPolicy {
    params: PolicyParams,
    pub(crate) allocator: Box<dyn Allocator>,
    pub(crate) scorer: Box<dyn Scorer>,
}

impl std::fmt::Debug for ValidPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValidPolicy")
            .field("params", &self.params)
            .finish()
    }
}

impl PolicyParams {
    /// Checks every rule that does not depend on the trace.
    pub fn check(self) -> Result<ValidPolicy, PolicyError> {
        let invalid = |field: &'static str, value: String, rule: &'static str| PolicyError::Param {
            field,
            value,
            rule,
        };
        if self.budget == 0 {
            return Err(invalid("budget", "0".into(), "must be at least 1"));
        }
        if self.budget < self.sinks + self.window {
            return Err(PolicyError::BudgetBelowProtected {
                budget: self.budget,
                sinks: self.sinks,
                window: self.window,
                layer: None,
            });
        }
        if self.kernel == 0 || self.kernel % 2 == 0 {
            return Err(invalid(
                "kernel",
                self.kernel.to_string(),
                "must be odd (same-length pooling needs a centred kernel)",
            ));
        }
        if let Some(beta) = self.beta {
            if !beta.is_finite() || beta <= 0.0 {
                return Err(invalid(
                    "beta",
                    beta.to_string(),
                    "must be a positive finite number",
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(invalid(
                "alpha",
                self.alpha.to_string(),
                "must be in [0, 1]",
            ));
        }
        for (field, tau) in [("tau1", self.tau1), ("tau2", self.tau2)] {
            if !tau.is_finite() || tau <= 0.0 {
                return Err(invalid(
                    field,
                    tau.to_string(),
                    "must be a positive finite number",
                ));
            }
        }
        if self.top_k == 0 {
            return Err(invalid("top_k", "0".into(), "must be at least 1"));
        }
        let allocator = allocator::build(&self)?;
        let scorer = scorer::build(&self)?;
        if !scorer.supports(self.timing) {
            return Err(PolicyError::Unsupported {
                what: format!("scorer `{}`", self.scorer),
                rule: "selects once at prefill end: use --timing prefill",
            });
        }
        if self.heads == HeadBudget::Adakv && self.timing != Timing::Prefill {
            return Err(PolicyError::Unsupported {
                what: "--heads adakv".into(),
                rule: "allocates head budgets from prefill scores: use --timing prefill",
            });
        }
        if allocator.needs_mass_curves() && (self.timing != Timing::Prefill || scorer.reselects()) {
            return Err(PolicyError::Unsupported {
                what: format!("allocator `{}`", self.allocator),
                rule: "needs a one-shot ranking: use --timing prefill and a scorer other than oracle-per-step",
            });
        }
        Ok(ValidPolicy {
            params: self,
            allocator,
            scorer,
        })
    }
}

impl ValidPolicy {
    /// The checked parameters.
    pub fn params(&self) -> &PolicyParams {
        &self.params
    }

    /// Passes over the trace the allocator needs before the replay (0 or 1).
    pub fn budget_passes(&self) -> usize {
        usize::from(self.allocator.needs_profile() || self.allocator.needs_mass_curves())
    }

    /// A short name, e.g. `pyramid+snapkv@prefill`.
    pub fn label(&self) -> String {
        format!(
            "{}+{}@{}",
            self.params.allocator,
            self.params.scorer,
            match self.params.timing {
                Timing::Prefill => "prefill",
                Timing::Streaming => "streaming",
            }
        )
    }

    /// The settings as text, in a stable order, for reports.
    pub fn settings(&self) -> BTreeMap<String, String> {
        let value = serde_json::to_value(&self.params).expect("params serialise");
        value
            .as_object()
            .expect("params are an object")
            .iter()
            .map(|(key, value)| {
                let text = match value {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (key.clone(), text)
            })
            .collect()
    }
}
