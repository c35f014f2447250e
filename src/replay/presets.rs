//! Named presets for the classic methods, each a [`PolicyParams`] as its reference code runs it
//! (docs/policies.md gives each one's source). A preset fixes the allocator, scorer, timing and protection;
//! the budget (and anything else) stays the caller's.

use super::{PolicyError, PolicyParams, Timing};

/// The preset names (`oracle-per-step` is also accepted, as `oracle`).
pub const NAMES: [&str; 10] = [
    "snapkv",
    "pyramidkv",
    "adakv",
    "cake",
    "h2o",
    "streamingllm",
    "tova",
    "h2o-adapted",
    "pyramidkv-adapted",
    "oracle",
];

/// The parameters of preset `name` at `budget`.
pub fn preset(name: &str, budget: usize) -> Result<PolicyParams, PolicyError> {
    let base = PolicyParams {
        budget,
        ..PolicyParams::default()
    };
    let streaming = |scorer: &str, sinks: usize, window: usize| PolicyParams {
        scorer: scorer.into(),
        timing: Timing::Streaming,
        sinks,
        window,
        ..base.clone()
    };
    Ok(match name {
        // SnapKV: W = 8, avg-pool kernel 7 (the class default), flat.
        "snapkv" => base,
        // PyramidKV: the official schedule (beta 20) with SnapKV's selection, max-pool as in the paper's runs.
        "pyramidkv" => PolicyParams {
            allocator: "pyramid".into(),
            ..base
        }
        .with("pool", "max"),
        // AdaKV: SnapKV scores, head-wise budgets with floor 0.2.
        "adakv" => PolicyParams {
            heads: "adakv".into(),
            ..base
        },
        // CAKE's layer preference over SnapKV's selection.
        "cake" => PolicyParams {
            allocator: "cake".into(),
            ..base
        },
        // H2O: cumulative true-query attention during generation, recent half protected.
        "h2o" => streaming("true-query", 0, budget / 2),
        // StreamingLLM: 4 sinks + the most recent tokens.
        "streamingllm" => streaming("recency", 4.min(budget), 0),
        // TOVA: the current query's attention, every step.
        "tova" => streaming("tova", 0, 0),
        // The seed library's H2O-adapted: key-as-query proxy, 4 sinks, no grace window.
        "h2o-adapted" => streaming("key-proxy", 4.min(budget.saturating_sub(1)), 0),
        // The seed library's PyramidKV-adapted: the same with its tapered schedule, beta 2.
        "pyramidkv-adapted" => PolicyParams {
            allocator: "pyramid-taper".into(),
            ..streaming("key-proxy", 4.min(budget.saturating_sub(1)), 0)
        }
        .with("beta", 2.0),
        // The per-step oracle: the current query's attention, re-chosen from the whole cache at
        // every step; the bound no causal policy beats at this budget.
        "oracle" | "oracle-per-step" => PolicyParams {
            timing: Timing::PerStep,
            ..streaming("tova", 0, 0)
        },
        other => {
            return Err(PolicyError::UnknownName {
                kind: "preset",
                name: other.to_owned(),
                valid: NAMES.join(", "),
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_checks() {
        for name in NAMES {
            for budget in [16, 128, 2048] {
                preset(name, budget)
                    .unwrap()
                    .check()
                    .unwrap_or_else(|err| panic!("{name} at {budget}: {err}"));
            }
        }
        assert!(preset("nope", 64)
            .unwrap_err()
            .to_string()
            .contains("valid: snapkv"));
    }
}
