//! Named presets for the classic methods, each a [`PolicyParams`] as its reference code runs it:
//! the cache layout, pooling, window, timing, order of attend and evict, and GQA handling of the
//! code the method's paper ran (docs/policies.md gives each one's repository, commit, file and
//! lines, and the parity test that checks it). Where kvpress implements a method differently, that
//! is its own preset (`snapkv-kvpress`). A preset fixes everything but the budget.

use super::{
    Granularity, Order, PolicyError, PolicyParams, Timing, TimingSettings, Trigger, ValidPolicy,
};
use serde_json::{Map, Value};

/// The preset names (`oracle-per-step` is also accepted, as `oracle`).
pub const NAMES: [&str; 17] = [
    "snapkv",
    "pyramidkv",
    "adakv",
    "cake",
    "h2o",
    "h2o-kvcache-factory",
    "tova",
    "streamingllm",
    "snapkv-kvpress",
    "h2o-adapted",
    "pyramidkv-adapted",
    "quest",
    "rkv",
    "snapkv-d",
    "defensivekv",
    "layer-defensivekv",
    "oracle",
];

/// KVCache-Factory's `run_longbench.py` settings for SnapKV, PyramidKV, H2O and AdaKV (lines
/// 267-284): observation window 8, max pooling with kernel 7, and the default query-head cache
/// layout (`repeat_kv` before compression, `maybe_repeat_kv_before_cache`).
fn kvcache_factory(base: &PolicyParams) -> PolicyParams {
    PolicyParams {
        gqa: Granularity::QueryHead,
        window: 8,
        ..base.clone()
    }
    .with("pool", "max")
    .with("kernel", 7)
}

/// The timing's settings of a cache whose step query attends before the step's eviction (H2O's
/// and TOVA's generation code, StreamingLLM's), one eviction per token.
fn attend_first() -> TimingSettings {
    TimingSettings {
        order: Order::AttendFirst,
        ..TimingSettings::default()
    }
}

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
        // SnapKV as the PyramidKV paper's runs (KVCache-Factory) run it.
        "snapkv" => kvcache_factory(&base),
        // PyramidKV: the official schedule (beta 20) with the same selection.
        "pyramidkv" => PolicyParams {
            allocator: "pyramid".into(),
            ..kvcache_factory(&base)
        },
        // AdaKV (KVCache-Factory's `AdaKVCluster`): head-wise budgets, floor 0.2, normalised.
        "adakv" => PolicyParams {
            heads: "adakv".into(),
            ..kvcache_factory(&base)
        },
        // CAKE (antgroup/cakekv): layer budgets by dispersion x variance, its own token score,
        // window 32, one cache per KV head scored by the group mean, cut after the prompt and
        // one eviction per decode step before the new query attends; tau 1 (the fallback for
        // models its table does not list).
        "cake" => PolicyParams {
            allocator: "cake".into(),
            scorer: "cake".into(),
            timing: Timing::PrefillThenStream,
            window: 32.min(budget),
            ..base
        },
        // H2O's own generation code (`H2OKVCache_LayerWise`): heavy hitters (half the budget) by
        // all prompt queries' attention plus the recent half, then one eviction per decode step
        // after the new query attends; per query head, as its pre-GQA code runs.
        "h2o" => PolicyParams {
            scorer: "true-query".into(),
            gqa: Granularity::QueryHead,
            window: budget - budget / 2,
            ..base
        }
        .timed(Timing::PrefillThenStream, &attend_first()),
        // The PyramidKV paper's H2O baseline (KVCache-Factory's `H2OKVCluster`): one-shot at the
        // end of the prompt by all prompt queries' attention, the window of 8 kept.
        "h2o-kvcache-factory" => PolicyParams {
            scorer: "true-query".into(),
            gqa: Granularity::QueryHead,
            window: 8,
            ..base
        },
        // TOVA (`TOVACache.reduce`): the last query's attention averaged over all heads of the
        // layer, one kept set per layer, cut after the prompt and one eviction per decode step.
        "tova" => PolicyParams {
            scorer: "tova".into(),
            gqa: Granularity::Layer,
            window: 0,
            ..base
        }
        .timed(Timing::PrefillThenStream, &attend_first()),
        // StreamingLLM (mit-han-lab/streaming-llm `StartRecentKVCache`, run token by token as
        // `eval_long_ppl.py` does): 4 sinks + the most recent tokens; each token attends over the
        // cache and itself, then the cache is cut.
        "streamingllm" => {
            let params = streaming("recency", 4.min(budget), 0);
            params.timed(Timing::Streaming, &attend_first())
        }
        // kvpress's `SnapKVPress`: window 64, avg-pool kernel 5, one cache per KV head scored by
        // the group mean.
        "snapkv-kvpress" => PolicyParams {
            window: 64.min(budget),
            ..base
        }
        .with("pool", "avg")
        .with("kernel", 5)
        .with("agg", "mean"),
        // The seed library's H2O-adapted: key-as-query proxy, 4 sinks, no grace window.
        "h2o-adapted" => streaming("key-proxy", 4.min(budget.saturating_sub(1)), 0),
        // The seed library's PyramidKV-adapted: the same with its tapered schedule, beta 2.
        "pyramidkv-adapted" => PolicyParams {
            allocator: "pyramid-taper".into(),
            ..streaming("key-proxy", 4.min(budget.saturating_sub(1)), 0)
        }
        .with("beta", 2.0),
        // Quest (mit-han-lab/Quest `evaluation/quest_attention.py`): each decode query of each
        // query head reads the pages of 16 with the highest logit bound; nothing is evicted.
        "quest" => PolicyParams {
            timing: Timing::PerStep,
            gqa: Granularity::QueryHead,
            ..streaming("quest", 0, 0)
        },
        // R-KV (Zefan-Cai/R-KV `rkv/compression/r1_kv.py`, run_math.py's defaults): the prompt
        // compressed at its end, the last 8 tokens kept as the window, one cache per KV head.
        "rkv" => PolicyParams {
            scorer: "rkv".into(),
            window: 8.min(budget),
            ..base
        },
        // SnapKV-D, SnapKV applied while decoding as R-KV's code runs it (its `SnapKV`
        // compression in its decode loop): the `rkv` importance alone (`mix_lambda` 1), window 8,
        // kernel 7, the prompt cut at its end and the cache compressed back to the budget after
        // the attention of every step whose position is a multiple of `divide_length` (128).
        "snapkv-d" => PolicyParams {
            scorer: "rkv".into(),
            window: 8.min(budget),
            ..base
        }
        .timed(
            Timing::PrefillThenStream,
            &TimingSettings {
                interval: 128,
                trigger: Trigger::Position,
                ..attend_first()
            },
        )
        .with("mix_lambda", 1.0),
        // DefensiveKV (FFY0/DefensiveKV `EfficientDefensiveKVPress`): window 32, average pooling
        // with kernel 5, stage 1 capped by this budget, then one top-k over the layer's KV heads
        // (`EfficientAdaScorerPress.compress`: AdaKV's flat top-k, no floor, no normalisation).
        "defensivekv" => PolicyParams {
            scorer: "defensivekv".into(),
            heads: "adakv".into(),
            window: 32.min(budget),
            sinks: 0,
            ..base
        }
        .with("alpha", 0.0)
        .with("normalize", false)
        .with("stage1_budget", budget),
        // Layer-DefensiveKV (`efficient_layer_defensivekv_press.py`): the same scores, one top-k
        // over every layer's (`EfficientAdaGlobalScorerPress.compress`), the window of 32 and
        // stage 1 at their layer's largest score, nothing protected.
        "layer-defensivekv" => PolicyParams {
            allocator: "global".into(),
            window: 0,
            ..preset("defensivekv", budget)?
        }
        .with("layer_max", true)
        .with("observation", 32),
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

/// The presets `names` at `budget`, each with `settings` set over it (a quantizer, a budget in
/// bytes), checked, each labelled `name (label)` as `kvreplay compare` labels them (`snapkv
/// (flat+snapkv@prefill)`).
pub fn labelled(
    names: &[String],
    budget: usize,
    settings: &Map<String, Value>,
) -> Result<Vec<(String, ValidPolicy)>, PolicyError> {
    names
        .iter()
        .map(|name| {
            let params = overlay(&preset(name, budget)?, settings)
                .map_err(|err| PolicyError::Malformed(err.to_string()))?;
            let policy = params.check()?;
            Ok((format!("{name} ({})", policy.label()), policy))
        })
        .collect()
}

/// Presets left out, each with the rule of the pair it breaks.
pub type LeftOut = Vec<(String, PolicyError)>;

/// The presets of [`NAMES`] that run on `trace` at `budget` with `settings`, labelled and checked
/// as [`labelled`] gives them, in that order, and each one left out with the rule of the pair it
/// breaks (a method that reads tensors the trace lacks): what a command that runs "every preset"
/// runs.
pub fn runnable_on(
    trace: &crate::trace::TraceReader,
    budget: usize,
    settings: &Map<String, Value>,
) -> Result<(Vec<(String, ValidPolicy)>, LeftOut), PolicyError> {
    let names: Vec<String> = NAMES.iter().map(|name| name.to_string()).collect();
    let mut runnable = Vec::new();
    let mut left_out = Vec::new();
    for (name, (label, policy)) in names.iter().zip(labelled(&names, budget, settings)?) {
        match super::check_fit(trace, &policy) {
            Ok(_) => runnable.push((label, policy)),
            Err(err @ PolicyError::TraceMismatch { .. }) => left_out.push((name.clone(), err)),
            Err(other) => return Err(other),
        }
    }
    Ok((runnable, left_out))
}

/// A policy from settings by key, as an experiment's policy table or Python's keyword arguments
/// give them: the base is `preset` at `budget` when a preset is named (the defaults otherwise),
/// and every other key overrides the base's value; the result is read by serde, so a value of the
/// wrong type is named by its key. What the keys mean is checked later, by
/// [`PolicyParams::check`].
pub fn from_settings(given: &Map<String, Value>) -> Result<PolicyParams, PolicyError> {
    let budget = match given.get("budget") {
        None => PolicyParams::default().budget,
        Some(value) => value.as_u64().ok_or_else(|| PolicyError::Param {
            field: "budget",
            value: super::settings::text(value),
            rule: "must be a whole number of tokens",
        })? as usize,
    };
    let base = match given.get("preset") {
        None => PolicyParams {
            budget,
            ..PolicyParams::default()
        },
        Some(Value::String(name)) => preset(name, budget)?,
        Some(other) => preset(&super::settings::text(other), budget)?,
    };
    let settings = || given.iter().filter(|(key, _)| *key != "preset");
    overlay(&base, settings()).map_err(|err| {
        // The setting that does not read, named with its value.
        match settings().find(|&(key, value)| overlay(&base, [(key, value)]).is_err()) {
            Some((key, value)) => PolicyError::Malformed(format!(
                "setting `{key}` = {}: {err}",
                super::settings::text(value)
            )),
            None => PolicyError::Malformed(err.to_string()),
        }
    })
}

/// `base` with each `(key, value)` set over it, read back by serde.
pub fn overlay<'a>(
    base: &PolicyParams,
    settings: impl IntoIterator<Item = (&'a String, &'a Value)>,
) -> Result<PolicyParams, serde_json::Error> {
    let mut json = serde_json::to_value(base).expect("params serialise");
    for (key, value) in settings {
        json[key] = value.clone();
    }
    serde_json::from_value(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_override_a_preset_at_its_budget() {
        let given = |json: Value| from_settings(json.as_object().unwrap());
        let params =
            given(serde_json::json!({"preset": "snapkv", "budget": 64, "window": 4})).unwrap();
        assert_eq!(params.budget, 64);
        assert_eq!(params.window, 4);
        assert_eq!(params.settings["kernel"], 7);
        assert_eq!(
            given(serde_json::json!({})).unwrap(),
            PolicyParams::default()
        );
        let err = given(serde_json::json!({"budget": "many"})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "parameter `budget` = many: must be a whole number of tokens"
        );
        let err = given(serde_json::json!({"timing": "later"})).unwrap_err();
        assert!(err.to_string().contains("unknown variant `later`"), "{err}");
        let err = given(serde_json::json!({"preset": "nope"})).unwrap_err();
        assert!(
            err.to_string().starts_with("unknown preset `nope`"),
            "{err}"
        );
    }

    #[test]
    fn every_preset_checks() {
        for name in NAMES {
            for budget in [16, 17, 128, 2048] {
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
