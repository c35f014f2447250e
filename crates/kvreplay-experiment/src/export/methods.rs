//! `kvreplay methods`: every registered method of every axis, with its parameters, defaults and
//! source, every metric, straight from the registries, and the presets built on them. The
//! committed `docs/methods.md` is this listing (a test keeps them equal).

use crate::replay::metrics;
use crate::replay::settings::{self, Declared, Method, Param};
use crate::replay::{
    allocator, channels, common_keys, head_split, merge, presets, quantizer, scorer, Layers,
    PolicyParams, Timing, TimingSettings,
};
use serde_json::{Map, Value};
use std::fmt::Write;

/// The listing, as Markdown.
pub fn methods_markdown() -> String {
    let common: Vec<String> = common_keys().map(|key| format!("`{key}`")).collect();
    let mut out = format!(
        "# Methods\n\nEvery policy has the common settings {}; each chosen method adds its own, \
         listed below with their defaults. A setting is given bare (`kernel`) or qualified by \
         the axis of the method it is for (`scorer.kernel`, `heads.threshold`; in an experiment \
         file also `scorer = {{ name = \"rkv\", threshold = 0.7 }}`); each method is built from its \
         own. A setting that none of the chosen methods takes is an error, and so is a bare one \
         that two of them declare.\n",
        common.join(", ")
    );
    axis(
        &mut out,
        "Allocators (`allocator`): how many tokens each layer keeps",
        allocator::REGISTRY,
    );
    axis(
        &mut out,
        "Head splits (`heads`): how a layer's budget is shared among its caches",
        head_split::REGISTRY,
    );
    axis(
        &mut out,
        "Scorers (`scorer`): which tokens",
        scorer::REGISTRY,
    );
    axis(
        &mut out,
        "Quantizers (`quantizer`): how the kept keys and values are stored",
        quantizer::REGISTRY,
    );
    axis(
        &mut out,
        "Key channels (`channels`): which channels of the kept keys are stored",
        channels::REGISTRY,
    );
    axis(
        &mut out,
        "Merges (`merge`): what becomes of the values evicted at the cut",
        merge::REGISTRY,
    );
    out += "\n## Timings (`timing`): when the kept set is chosen\n\n";
    for timing in Timing::ALL {
        let _ = writeln!(out, "- `{}`: {}", timing.name(), timing.about());
    }
    timing_settings(&mut out);
    out += "\n## Layers (`layers`): which layers a budget compresses on a hybrid model\n\n";
    for layers in [Layers::Global, Layers::All] {
        let _ = writeln!(out, "- `{}`: {}", layers.name(), layers_about(layers));
    }
    out += "\n## Metrics: what a kept set costs, per query head and decode step\n\n";
    for metric in metrics::REGISTRY {
        let _ = writeln!(
            out,
            "- `{}` ({}): {}",
            metric.id(),
            metric.title(),
            metric.about()
        );
    }
    out += "\n## Presets (`preset`, `kvreplay compare --presets`)\n\n";
    for name in presets::NAMES {
        let params = presets::preset(name, 128).expect("every listed preset builds");
        let mut own: Vec<String> = params
            .settings
            .iter()
            .filter(|(key, _)| !TimingSettings::PARAMS.iter().any(|p| p.key == *key))
            .map(|(key, value)| format!("{key} = {}", settings::text(value)))
            .collect();
        own.sort();
        let _ = writeln!(
            out,
            "- `{name}`: allocator `{}`, scorer `{}`, heads `{}`, timing `{}`{}, gqa `{}`, sinks {}, window {}{}",
            params.allocator,
            params.scorer,
            params.heads,
            params.timing.name(),
            schedule(&params),
            params.gqa.name(),
            params.sinks,
            params.window,
            if own.is_empty() {
                String::new()
            } else {
                format!(", {}", own.join(", "))
            }
        );
    }
    out
}

/// A streaming preset's order, and its compression interval and trigger unless one token is
/// evicted per token.
fn schedule(params: &PolicyParams) -> String {
    if !params.timing.streams() {
        return String::new();
    }
    let policy = params.clone().check().expect("every listed preset checks");
    let own = policy.timing_settings();
    let mut schedule = format!(", order `{}`", own.order.name());
    if own.interval > 1 {
        let _ = write!(
            schedule,
            ", interval {}, trigger `{}`",
            own.interval,
            own.trigger.name()
        );
    }
    schedule
}

fn layers_about(layers: Layers) -> &'static str {
    match layers {
        Layers::Global => {
            "the global layers (the default); a sliding-window layer keeps its window and is not measured"
        }
        Layers::All => {
            "every layer; a sliding-window layer's scorer, cache and reference attention stay inside its window, and allocators spread the budget over all layers"
        }
    }
}

/// The timing's own settings: every timing takes them, the streaming ones alone other than
/// their defaults.
fn timing_settings(out: &mut String) {
    let streaming: Vec<String> = TimingSettings::STREAMING
        .iter()
        .map(|timing| format!("`{}`", timing.name()))
        .collect();
    let _ = writeln!(
        out,
        "\nA timing's own settings (bare, or `timing.interval`; in an experiment file also \
         `timing = {{ name = \"decoding\", interval = 4 }}`), which only the streaming timings ({}) \
         take other than at their defaults:\n",
        streaming.join(", ")
    );
    settings_list(
        out,
        TimingSettings::PARAMS,
        &settings::defaults::<TimingSettings>(),
    );
}

/// One line per setting: its key, its default and what it means.
fn settings_list(out: &mut String, params: &[Param], defaults: &Map<String, Value>) {
    for param in params {
        let _ = writeln!(
            out,
            "- `{}` (default `{}`): {}",
            param.key,
            settings::text(&defaults[param.key]),
            param.doc.trim()
        );
    }
}

fn axis<T: ?Sized>(out: &mut String, title: &str, registry: &[Method<T>]) {
    let _ = writeln!(out, "\n## {title}\n");
    for method in registry {
        let _ = writeln!(out, "### `{}`\n\n{}\n", method.name, method.about.trim());
        if method.version > 1 {
            let _ = writeln!(out, "Rule version {}.\n", method.version);
        }
        settings_list(out, method.params, &(method.defaults)());
        if !method.params.is_empty() {
            out.push('\n');
        }
    }
}
