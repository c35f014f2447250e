//! A policy's parameters as the user gives them ([`PolicyParams`]) and as the engine accepts them
//! ([`ValidPolicy`]): every rule is checked once, before any layer is read (linfa's ParamGuard).

use super::allocator::{self, Allocator};
use super::channels::{self, KeyChannels};
use super::head_split::{self, HeadSplit};
use super::merge::{self, Merge};
use super::quantizer::{self, Quantizer, Scheme};
use super::routing::{self, Owner};
use super::scorer::{self, Scorer};
use super::settings::{self, Declared, Described, Method, SettingError};
use super::storage::Storage;
use super::{
    Granularity, Layers, Order, PolicyError, Protection, Protocol, Timing, TimingSettings, Trigger,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// A policy as given on the command line or in an experiment file: the methods of each axis by
/// name, the settings every policy has, and the chosen methods' own settings by key. Its run-id
/// form is [`PolicyParams::canonical`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyParams {
    /// Allocator name (registry key).
    pub allocator: String,
    /// Scorer name (registry key).
    pub scorer: String,
    /// Head split name (registry key).
    pub heads: String,
    /// When the kept set is chosen; its own settings ([`TimingSettings`]: `order`, `interval`,
    /// `trigger`) are given among [`settings`](Self::settings), as a method's are.
    pub timing: Timing,
    /// Nominal tokens kept per cache (mean over layers), sinks and window included.
    pub budget: usize,
    /// A budget in bytes, in place of `budget`: a fraction of the full prompt cache's bytes (0.125
    /// or "1/8"), resolved on each trace to the most tokens whose cache, as the quantizer stores
    /// it, fits in it at the prompt's end.
    #[serde(deserialize_with = "fraction::deserialize")]
    pub bytes: Option<f64>,
    /// First positions always kept (attention sinks).
    pub sinks: usize,
    /// Recent tokens always kept; also SnapKV's observation window.
    pub window: usize,
    /// Cache granularity under grouped-query attention.
    pub gqa: Granularity,
    /// The layers the budget compresses on a model with sliding-window layers.
    pub layers: Layers,
    /// Where the cut falls relative to the question.
    pub protocol: Protocol,
    /// k of the top-k recall metric.
    pub top_k: usize,
    /// Quantizer name (registry key): how the kept keys and values are stored.
    pub quantizer: String,
    /// Key-channel rule name (registry key): which channels of the kept keys are stored.
    pub channels: String,
    /// Merge rule name (registry key): what becomes of the values evicted at the cut.
    pub merge: String,
    /// The chosen methods' and the timing's own settings, by key as given: bare (`kernel`, for
    /// the one chosen method that declares it) or qualified by its axis (`scorer.threshold`,
    /// `timing.interval`); see [`routing`](super::routing).
    #[serde(flatten)]
    pub settings: BTreeMap<String, Value>,
}

/// The common settings added after runs were first stored, which a policy's canonical form leaves
/// out at their defaults so that the runs stored before each existed keep their ids (the timing's
/// own settings likewise, [`PolicyParams::canonical`]).
const ADDED_LATER: [&str; 6] = [
    "bytes",
    "layers",
    "protocol",
    "quantizer",
    "channels",
    "merge",
];

/// A fraction given as a number or as `"a/b"`.
mod fraction {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Number(f64),
        Text(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<f64>, D::Error> {
        let given: Option<Given> = Option::deserialize(deserializer)?;
        given
            .map(|given| match given {
                Given::Number(number) => Ok(number),
                Given::Text(text) => super::parse_fraction(&text).ok_or_else(|| {
                    serde::de::Error::custom(format!("`{text}` is not a fraction (0.125 or 1/8)"))
                }),
            })
            .transpose()
    }
}

/// A fraction as a person writes it: `a/b`, or a number.
pub fn parse_fraction(text: &str) -> Option<f64> {
    match text.split_once('/') {
        Some((a, b)) => Some(a.trim().parse::<f64>().ok()? / b.trim().parse::<f64>().ok()?),
        None => text.trim().parse().ok(),
    }
}

/// Whether `quantizer` names the default, the cache as captured.
fn is_unquantized(quantizer: &str) -> bool {
    quantizer == "none"
}

/// Whether `channels` names the default, every key channel stored.
fn keeps_every_channel(channels: &str) -> bool {
    channels == "none"
}

/// Whether `merge` names the default, evicted entries dropped.
fn drops_evicted(merge: &str) -> bool {
    merge == "none"
}

/// A setting every policy has, beside its methods' own: its key (a field of [`PolicyParams`], a
/// key of an experiment's policy table, a `--flag` with `-` for `_`), what it means, and the
/// values it takes. The command line's flags and their help, the experiment files' valid keys and
/// `kvreplay methods` are all made from [`COMMON`].
pub struct Common {
    /// The key.
    pub key: &'static str,
    /// What it means, one line.
    pub about: &'static str,
    /// The values it takes, when they are a set (empty for a number).
    pub values: fn() -> Vec<String>,
    /// Whether only those values parse (a fixed set); otherwise they are the registered names,
    /// which the policy's check looks up with its own message.
    pub fixed: bool,
    /// For a number (no values): whether it is a whole number; otherwise a fraction, given as a
    /// number or `a/b`.
    pub whole: bool,
}

/// The names of a setting's fixed values.
fn variants<T: super::settings::Choices>() -> Vec<String> {
    super::settings::choice_names::<T>()
}

/// The names registered on an axis.
fn registered<T: ?Sized>(registry: &[Method<T>]) -> Vec<String> {
    registry.iter().map(|m| m.name.to_owned()).collect()
}

/// The settings every policy has.
pub const COMMON: &[Common] = &[
    Common {
        key: "allocator",
        about: "How many tokens each layer keeps",
        values: || registered(allocator::REGISTRY),
        fixed: false,
        whole: true,
    },
    Common {
        key: "scorer",
        about: "Which tokens",
        values: || registered(scorer::REGISTRY),
        fixed: false,
        whole: true,
    },
    Common {
        key: "heads",
        about: "How a layer's budget is shared among its caches (a head split)",
        values: || registered(head_split::REGISTRY),
        fixed: false,
        whole: true,
    },
    Common {
        key: "timing",
        about: "When the kept set is chosen",
        values: variants::<Timing>,
        fixed: true,
        whole: true,
    },
    Common {
        key: "budget",
        about: "Nominal tokens per cache (mean over layers), sinks and window included",
        values: Vec::new,
        fixed: true,
        whole: true,
    },
    Common {
        key: "bytes",
        about: "A budget as a fraction of the full cache's bytes (0.125 or 1/8), in place of `budget`: the most tokens whose cache, as stored, fits it at the prompt's end",
        values: Vec::new,
        fixed: true,
        whole: false,
    },
    Common {
        key: "sinks",
        about: "Protected first tokens (attention sinks)",
        values: Vec::new,
        fixed: true,
        whole: true,
    },
    Common {
        key: "window",
        about: "Protected recent tokens; SnapKV's observation window",
        values: Vec::new,
        fixed: true,
        whole: true,
    },
    Common {
        key: "gqa",
        about: "Cache granularity under grouped-query attention",
        values: variants::<Granularity>,
        fixed: true,
        whole: true,
    },
    Common {
        key: "layers",
        about: "On a model with sliding-window layers, which layers the budget compresses",
        values: variants::<Layers>,
        fixed: true,
        whole: true,
    },
    Common {
        key: "protocol",
        about:
            "Where the cut falls: at the prompt's end, or before the question (kvpress's pipeline)",
        values: variants::<Protocol>,
        fixed: true,
        whole: true,
    },
    Common {
        key: "top_k",
        about: "k of the top-k recall",
        values: Vec::new,
        fixed: true,
        whole: true,
    },
    Common {
        key: "quantizer",
        about: "How the kept keys and values are stored",
        values: || registered(quantizer::REGISTRY),
        fixed: false,
        whole: true,
    },
    Common {
        key: "channels",
        about: "Which channels of the kept keys are stored (ThinK prunes them)",
        values: || registered(channels::REGISTRY),
        fixed: false,
        whole: true,
    },
    Common {
        key: "merge",
        about: "What becomes of the values evicted at the cut (kvpress's MergingPress folds them into kept ones)",
        values: || registered(merge::REGISTRY),
        fixed: false,
        whole: true,
    },
];

/// The keys of [`COMMON`].
pub fn common_keys() -> impl Iterator<Item = &'static str> {
    COMMON.iter().map(|common| common.key)
}

impl Default for PolicyParams {
    fn default() -> Self {
        Self {
            allocator: "flat".into(),
            scorer: "snapkv".into(),
            heads: "uniform".into(),
            timing: Timing::Prefill,
            budget: 128,
            bytes: None,
            sinks: 0,
            window: 8,
            gqa: Granularity::KvHead,
            layers: Layers::Global,
            protocol: Protocol::QuestionInPrompt,
            top_k: 10,
            quantizer: "none".into(),
            channels: "none".into(),
            merge: "none".into(),
            settings: BTreeMap::new(),
        }
    }
}

impl PolicyParams {
    /// Whether some prompt tokens run under the policy, so the prompt's last logits differ from
    /// the full cache's: it evicts while the prompt runs, or the question runs over the
    /// compressed context (question-agnostic).
    pub fn changes_the_prompt(&self) -> bool {
        self.timing.evicts_in_prompt() || self.protocol == Protocol::QuestionAgnostic
    }

    /// The same policy with method setting `key` set to `value`.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.settings.insert(key.to_owned(), value.into());
        self
    }

    /// The same policy under `timing` with its settings `own`: those other than their defaults
    /// given among [`settings`](Self::settings) by their bare keys.
    pub fn timed(mut self, timing: Timing, own: &TimingSettings) -> Self {
        self.timing = timing;
        for param in TimingSettings::PARAMS {
            self.settings.remove(param.key);
        }
        self.settings.extend(own.changed());
        self
    }

    /// Every setting of [`COMMON`] with its value, by key (`layers` included, which the
    /// serialised form leaves out at its default).
    pub fn common_values(&self) -> Map<String, Value> {
        let mut values = match serde_json::to_value(self).expect("params serialise") {
            Value::Object(map) => map,
            _ => unreachable!("params serialise to an object"),
        };
        values.retain(|key, _| common_keys().any(|common| common == key));
        values.insert("bytes".into(), Value::from(self.bytes));
        values.insert("layers".into(), Value::from(self.layers.name()));
        values.insert("protocol".into(), Value::from(self.protocol.name()));
        values.insert("quantizer".into(), Value::from(self.quantizer.as_str()));
        values.insert("channels".into(), Value::from(self.channels.as_str()));
        values.insert("merge".into(), Value::from(self.merge.as_str()));
        values
    }

    /// The rule version of each chosen method (`allocator`, `scorer`, `heads`; unknown names
    /// left out), the stored runs' record of which rules computed them.
    pub fn method_versions(&self) -> BTreeMap<String, u32> {
        let version = |name: &str, found: Option<u32>| found.map(|v| (name.to_owned(), v));
        [
            version(
                "allocator",
                settings::find(allocator::REGISTRY, &self.allocator).map(|m| m.version),
            ),
            version(
                "scorer",
                settings::find(scorer::REGISTRY, &self.scorer).map(|m| m.version),
            ),
            version(
                "heads",
                settings::find(head_split::REGISTRY, &self.heads).map(|m| m.version),
            ),
            version(
                "quantizer",
                settings::find(quantizer::REGISTRY, &self.quantizer)
                    .filter(|_| !is_unquantized(&self.quantizer))
                    .map(|m| m.version),
            ),
            version(
                "channels",
                settings::find(channels::REGISTRY, &self.channels)
                    .filter(|_| !keeps_every_channel(&self.channels))
                    .map(|m| m.version),
            ),
            version(
                "merge",
                settings::find(merge::REGISTRY, &self.merge)
                    .filter(|_| !drops_evicted(&self.merge))
                    .map(|m| m.version),
            ),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// What is protected from eviction.
    pub fn protection(&self) -> Protection {
        Protection {
            sinks: self.sinks,
            window: self.window,
        }
    }
}

/// A chosen method and the axis it was chosen on, for error messages.
struct Chosen<'r, T: ?Sized> {
    axis: &'static str,
    method: &'r Method<T>,
}

impl<T: ?Sized> Chosen<'_, T> {
    fn label(&self) -> String {
        format!("{} `{}`", self.axis, self.method.name)
    }
}

/// Looks `name` up in `registry`, or says what the valid names are (and, for names that were
/// renamed, the new spelling).
fn lookup<'r, T: ?Sized>(
    axis: &'static str,
    registry: &'r [Method<T>],
    name: &str,
) -> Result<Chosen<'r, T>, PolicyError> {
    let method = settings::find(registry, name).ok_or_else(|| match renamed(axis, name) {
        Some(spelling) => PolicyError::Renamed {
            old: format!("{axis} `{name}`"),
            new: spelling,
        },
        None => PolicyError::UnknownName {
            kind: axis,
            name: name.to_owned(),
            valid: settings::names(registry),
        },
    })?;
    Ok(Chosen { axis, method })
}

/// Old spellings users may have in scripts, with their new ones.
fn renamed(axis: &str, name: &str) -> Option<String> {
    match (axis, name) {
        ("scorer", "oracle-per-step") => Some(
            "the per-step oracle is the `tova` scorer under `--timing per-step` (preset `oracle`); \
             under `--timing prefill` it was `--timing per-step-prompt`"
                .into(),
        ),
        _ => None,
    }
}

fn build<T: ?Sized>(
    chosen: &Chosen<'_, T>,
    given: &Map<String, Value>,
) -> Result<Box<T>, PolicyError> {
    (chosen.method.build)(given).map_err(|SettingError { key, value, rule }| PolicyError::Setting {
        method: chosen.label(),
        key,
        value,
        rule,
    })
}

/// Methods defined outside the library's registries (a Python object), for
/// [`PolicyParams::check_with`]. A scorer comes with an identity that tells two scorers of one name
/// apart, so policies share one scoring pass only when their scorer is the same object.
#[derive(Default)]
pub struct External {
    /// The scorer and its identity.
    pub scorer: Option<(Box<dyn Scorer>, String)>,
    /// The allocator.
    pub allocator: Option<Box<dyn Allocator>>,
}

/// Methods defined outside the library's registries, by the names policies give them: what an
/// experiment may name beside the registered methods (the Python package's objects).
pub trait ExternalMethods: std::fmt::Debug + Send + Sync {
    /// Fresh methods for the policy `params` (the names it gives that are external ones), or
    /// `None` when it names none.
    fn methods(&self, params: &PolicyParams) -> Option<External>;
    /// What identifies the external methods `params` names beyond their names (their code),
    /// for run ids; `None` when it names none.
    fn identity(&self, params: &PolicyParams) -> Option<String>;
}

/// Every value a chosen method runs with (none for a method defined outside the registries).
fn resolved<T: ?Sized>(
    chosen: Option<&Chosen<'_, T>>,
    given: &Map<String, Value>,
) -> Map<String, Value> {
    chosen.map(|c| c.method.resolve(given)).unwrap_or_default()
}

/// A checked policy: the only thing the engine runs.
pub struct ValidPolicy {
    params: PolicyParams,
    timing: TimingSettings,
    settings: BTreeMap<String, String>,
    /// What a one-shot selection's scores depend on (see [`ValidPolicy::score_key`]).
    score_key: String,
    pub(crate) allocator: Box<dyn Allocator>,
    pub(crate) scorer: Box<dyn Scorer>,
    pub(crate) heads: Box<dyn HeadSplit>,
    quantizer: Box<dyn Quantizer>,
    channels: Box<dyn KeyChannels>,
    merge: Box<dyn Merge>,
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
        self.check_with(External::default())
    }

    /// [`check`](Self::check), with the external methods among `externals` the policy names.
    pub fn check_in(
        self,
        externals: Option<&dyn ExternalMethods>,
    ) -> Result<ValidPolicy, PolicyError> {
        match externals.and_then(|externals| externals.methods(&self)) {
            Some(external) => self.check_with(external),
            None => self.check(),
        }
    }

    /// [`check`](Self::check) with methods defined outside the library (Python objects) in place
    /// of registered ones, named by `self.scorer` / `self.allocator` in labels and results. They
    /// declare no settings.
    pub fn check_with(self, external: External) -> Result<ValidPolicy, PolicyError> {
        let invalid = |field: &'static str, value: String, rule: &'static str| PolicyError::Param {
            field,
            value,
            rule,
        };
        if self.budget == 0 {
            return Err(invalid("budget", "0".into(), "must be at least 1"));
        }
        if self.budget < self.protection().tokens() {
            return Err(PolicyError::BudgetBelowProtected {
                budget: self.budget,
                sinks: self.sinks,
                window: self.window,
                layer: None,
            });
        }
        if self.top_k == 0 {
            return Err(invalid("top_k", "0".into(), "must be at least 1"));
        }
        if let Some(bytes) = self.bytes.filter(|b| !(*b > 0.0 && *b <= 1.0)) {
            return Err(invalid(
                "bytes",
                bytes.to_string(),
                "must be a fraction of the full cache's bytes in (0, 1]",
            ));
        }
        let registered_allocator = match external.allocator {
            None => Some(lookup("allocator", allocator::REGISTRY, &self.allocator)?),
            Some(_) => None,
        };
        let registered = match external.scorer {
            None => Some(lookup("scorer", scorer::REGISTRY, &self.scorer)?),
            Some(_) => None,
        };
        let heads = lookup("head split", head_split::REGISTRY, &self.heads)?;
        let quantizer = lookup("quantizer", quantizer::REGISTRY, &self.quantizer)?;
        let key_channels = lookup("channels", channels::REGISTRY, &self.channels)?;
        let merge_rule = lookup("merge", merge::REGISTRY, &self.merge)?;
        let mut owners = self.registered_owners();
        // A method defined outside the registries declares no settings, whatever its name.
        if registered_allocator.is_none() {
            owners[0].params = &[];
        }
        if registered.is_none() {
            owners[1].params = &[];
        }
        let chosen = self.chosen_methods(&owners);
        let routed = routing::route(&self.settings, &owners, |key| PolicyError::UnknownSetting {
            key: key.to_owned(),
            chosen: chosen.clone(),
            owners: owners_of(routing::split(key).1),
        })?;
        let [allocator_given, scorer_given, heads_given, quantizer_given, channels_given, merge_given, timing_given] =
            &routed[..]
        else {
            unreachable!("one map per axis")
        };
        let timing = self.timing_settings(timing_given)?;
        let scorer_settings = resolved(registered.as_ref(), scorer_given);
        let identity = external
            .scorer
            .as_ref()
            .map_or("", |(_, identity)| identity.as_str());
        let score_key = format!(
            "{} {identity} {} {:?} {:?}",
            self.scorer,
            Value::Object(scorer_settings.clone()),
            self.protection(),
            self.gqa
        );
        let mut settings = self.common_settings(&timing);
        let every_resolved = [
            resolved(registered_allocator.as_ref(), allocator_given),
            scorer_settings,
            heads.method.resolve(heads_given),
            quantizer.method.resolve(quantizer_given),
            key_channels.method.resolve(channels_given),
            merge_rule.method.resolve(merge_given),
        ];
        for (resolved, owner) in every_resolved.iter().zip(&owners) {
            settings.extend(resolved.iter().map(|(bare, value)| {
                let key = routing::canonical_key(bare, owner, &owners);
                (key, settings::text(value))
            }));
        }
        let scorer = match external.scorer {
            Some((scorer, _)) => scorer,
            None => build(registered.as_ref().expect("looked up above"), scorer_given)?,
        };
        let allocator = match external.allocator {
            Some(allocator) => allocator,
            None => build(
                registered_allocator.as_ref().expect("looked up above"),
                allocator_given,
            )?,
        };
        let policy = ValidPolicy {
            allocator,
            scorer,
            heads: build(&heads, heads_given)?,
            quantizer: build(&quantizer, quantizer_given)?,
            channels: build(&key_channels, channels_given)?,
            merge: build(&merge_rule, merge_given)?,
            settings,
            score_key,
            timing,
            params: self,
        };
        policy.check_combination()
    }

    /// The timing's own settings from those routed to it, checked.
    fn timing_settings(&self, given: &Map<String, Value>) -> Result<TimingSettings, PolicyError> {
        let broken = |SettingError { key, value, rule }| PolicyError::Setting {
            method: format!("timing `{}`", self.timing.name()),
            key,
            value,
            rule,
        };
        settings::parse_checked(given, TimingSettings::check).map_err(broken)
    }

    /// The chosen methods with the settings each declares, for the error naming a setting none
    /// of them takes: the allocator, scorer and head split, the storage methods chosen, and the
    /// timing.
    fn chosen_methods(&self, owners: &[Owner; 7]) -> String {
        let shown = [
            true,
            true,
            true,
            !is_unquantized(&self.quantizer),
            !keeps_every_channel(&self.channels),
            !drops_evicted(&self.merge),
            true,
        ];
        let mut chosen: Vec<String> = owners
            .iter()
            .zip(shown)
            .filter(|(_, shown)| *shown)
            .map(|(owner, _)| owner.described())
            .collect();
        let last = chosen.pop().expect("four to seven owners");
        format!("{} or {last}", chosen.join(", "))
    }

    /// The common settings as text, as the canonical form gives them, and the timing's own:
    /// `order` always, `interval` and `trigger` where they are not their defaults.
    fn common_settings(&self, timing: &TimingSettings) -> BTreeMap<String, String> {
        let mut common: BTreeMap<String, String> = self
            .canonical()
            .into_iter()
            .filter(|(key, _)| common_keys().any(|common| common == key.as_str()))
            .map(|(key, value)| (key, settings::text(&value)))
            .collect();
        common.insert("order".into(), timing.order.name().into());
        for (key, value) in timing.changed() {
            common.insert(key, settings::text(&value));
        }
        common
    }

    /// The policy as its run id hashes it: every common setting, less those [`ADDED_LATER`] at
    /// their defaults, and each given method setting under its canonical key (bare unless two
    /// chosen methods declare it, then `axis.key`), so two spellings of one policy, `kernel` and
    /// `scorer.kernel`, are one policy; the timing's own settings are left out at their defaults,
    /// as when they were common settings, so the runs stored then keep their ids.
    pub fn canonical(&self) -> BTreeMap<String, Value> {
        let serialised = |params: &PolicyParams| match serde_json::to_value(params) {
            Ok(Value::Object(fields)) => fields,
            other => unreachable!("params serialise to an object, not {other:?}"),
        };
        let defaults = serialised(&PolicyParams::default());
        let mut form: BTreeMap<String, Value> = serialised(self)
            .into_iter()
            .filter(|(key, value)| {
                let at_later_default =
                    ADDED_LATER.contains(&key.as_str()) && defaults.get(key) == Some(value);
                common_keys().any(|common| common == key) && !at_later_default
            })
            .collect();
        let owners = self.registered_owners();
        for (key, value) in &self.settings {
            let canonical = routing::canonical_given(key, &owners);
            let timings = routing::owner_of(key, &owners).is_ok_and(|index| index == TIMING);
            if !(timings && TimingSettings::is_default(&canonical, value)) {
                form.insert(canonical, value.clone());
            }
        }
        form
    }

    /// The chosen methods and the timing as routing sees them, looked up by name (a name no
    /// registry knows, a method defined outside them, declares no settings), labelled as messages
    /// name them; the timing last ([`TIMING`]).
    fn registered_owners(&self) -> [Owner; 7] {
        fn on<T: ?Sized>(
            (axis, kind): (&'static str, &str),
            registry: &[Method<T>],
            name: &str,
        ) -> Owner {
            Owner {
                axis,
                label: format!("{kind} `{name}`"),
                params: settings::find(registry, name).map_or(&[], |method| method.params),
            }
        }
        [
            on(
                ("allocator", "allocator"),
                allocator::REGISTRY,
                &self.allocator,
            ),
            on(("scorer", "scorer"), scorer::REGISTRY, &self.scorer),
            on(("heads", "head split"), head_split::REGISTRY, &self.heads),
            on(
                ("quantizer", "quantizer"),
                quantizer::REGISTRY,
                &self.quantizer,
            ),
            on(("channels", "channels"), channels::REGISTRY, &self.channels),
            on(("merge", "merge"), merge::REGISTRY, &self.merge),
            Owner {
                axis: "timing",
                label: format!("timing `{}`", self.timing.name()),
                params: TimingSettings::PARAMS,
            },
        ]
    }
}

/// Where the timing stands among a policy's owners of settings.
const TIMING: usize = 6;

/// Every registered method of every axis: allocators, scorers, head splits, quantizers, key
/// channels, merges; and the streaming timings, which take settings of their own.
pub fn all_methods() -> Vec<Described> {
    let mut methods = settings::describe("allocator", allocator::REGISTRY);
    methods.extend(settings::describe("scorer", scorer::REGISTRY));
    methods.extend(settings::describe("head split", head_split::REGISTRY));
    methods.extend(settings::describe("quantizer", quantizer::REGISTRY));
    methods.extend(settings::describe("channels", channels::REGISTRY));
    methods.extend(settings::describe("merge", merge::REGISTRY));
    methods.extend(TimingSettings::STREAMING.map(|timing| Described {
        axis: "timing",
        name: timing.name(),
        about: timing.about(),
        params: TimingSettings::PARAMS,
        defaults: settings::defaults::<TimingSettings>,
    }));
    methods
}

/// Which methods of any axis take `key`, for the error that names a setting nobody chosen takes.
fn owners_of(key: &str) -> String {
    let owners: Vec<String> = all_methods()
        .iter()
        .filter(|method| method.takes(key))
        .map(Described::label)
        .collect();
    if owners.is_empty() {
        "no method takes it".into()
    } else {
        format!("it is a setting of {}", owners.join(", "))
    }
}

impl ValidPolicy {
    /// Rules between axes.
    fn check_combination(self) -> Result<Self, PolicyError> {
        let params = &self.params;
        if !self.scorer.supports(params.timing) {
            let supported: Vec<&str> = Timing::ALL
                .into_iter()
                .filter(|&timing| self.scorer.supports(timing))
                .map(Timing::name)
                .collect();
            return Err(PolicyError::Unsupported {
                what: format!(
                    "scorer `{}` (timings: {})",
                    params.scorer,
                    supported.join(", ")
                ),
                rule: "is not defined for this timing: choose one of its timings",
            });
        }
        if params.protocol == Protocol::QuestionAgnostic && !params.timing.cuts_the_prompt() {
            return Err(PolicyError::Unsupported {
                what: format!("protocol `{}`", params.protocol.name()),
                rule: "moves the prompt-end cut before the question: use --timing prefill, prefill-then-stream or per-step-prompt",
            });
        }
        let timing = &self.timing;
        if timing.interval > 1 && !params.timing.streams() {
            return Err(PolicyError::Unsupported {
                what: format!("interval {}", timing.interval),
                rule: "spaces a streaming eviction: use --timing streaming, prefill-then-stream or decoding",
            });
        }
        if timing.interval > 1 && !self.scorer.cuts_while_decoding() {
            return Err(PolicyError::Unsupported {
                what: format!(
                    "scorer `{}` with interval {}",
                    params.scorer, timing.interval
                ),
                rule: "keeps its own cache order through single evictions: use interval 1",
            });
        }
        if timing.trigger != Trigger::Growth && timing.interval == 1 {
            return Err(PolicyError::Unsupported {
                what: format!("trigger `{}`", timing.trigger.name()),
                rule: "places the compressions an interval makes: give an interval above 1",
            });
        }
        if timing.order == Order::AttendFirst && !params.timing.streams() {
            return Err(PolicyError::Unsupported {
                what: format!("order `{}`", timing.order.name()),
                rule: "orders a streaming eviction: use --timing streaming, prefill-then-stream or decoding",
            });
        }
        if self.heads.needs_scores() && params.timing != Timing::Prefill {
            return Err(PolicyError::Unsupported {
                what: format!("head split `{}`", params.heads),
                rule: "shares head budgets from prefill scores: use --timing prefill",
            });
        }
        if self.heads.needs_one_shot() && params.timing != Timing::Prefill {
            return Err(PolicyError::Unsupported {
                what: format!("head split `{}`", params.heads),
                rule: "splits the heads once, at the prompt's end: use --timing prefill",
            });
        }
        if self.heads.needs_protection() && params.protection().tokens() == 0 {
            return Err(PolicyError::Unsupported {
                what: format!("head split `{}`", params.heads),
                rule: "may leave a cache only its protected positions, which may be nothing: protect a sliding window or sinks (--window or --sinks at least 1)",
            });
        }
        if self.scheme().is_some() && self.channels.pruning().is_some() {
            return Err(PolicyError::Unsupported {
                what: format!(
                    "quantizer `{}` with channels `{}`",
                    params.quantizer, params.channels
                ),
                rule: "are not combined yet: a cache either quantizes or prunes key channels",
            });
        }
        if self.merge.merging().is_some() && params.timing != Timing::Prefill {
            return Err(PolicyError::Unsupported {
                what: format!("merge `{}`", params.merge),
                rule: "folds what the one cut at the prompt's end evicts: use --timing prefill",
            });
        }
        if self.merge.decode_merging().is_some() && !params.timing.streams() {
            return Err(PolicyError::Unsupported {
                what: format!("merge `{}`", params.merge),
                rule: "folds what the compressions made while decoding evict: use --timing decoding, prefill-then-stream or streaming",
            });
        }
        if (self.merge.merging().is_some() || self.merge.decode_merging().is_some())
            && (self.scheme().is_some() || self.channels.pruning().is_some())
        {
            return Err(PolicyError::Unsupported {
                what: format!(
                    "merge `{}` with quantizer `{}` and channels `{}`",
                    params.merge, params.quantizer, params.channels
                ),
                rule: "are not combined yet: a cache merges, quantizes or prunes key channels",
            });
        }
        if self.allocator.needs_mass_curves() && params.timing != Timing::Prefill {
            return Err(PolicyError::Unsupported {
                what: format!("allocator `{}`", params.allocator),
                rule: "needs a one-shot ranking: use --timing prefill",
            });
        }
        if self.allocator.needs_prompt_scores() && params.timing != Timing::Prefill {
            return Err(PolicyError::Unsupported {
                what: format!("allocator `{}`", params.allocator),
                rule: "ranks every layer's prompt scores once, at the prompt's end: use --timing prefill",
            });
        }
        Ok(self)
    }

    /// The checked parameters.
    pub fn params(&self) -> &PolicyParams {
        &self.params
    }

    /// The timing's own settings, checked.
    pub fn timing_settings(&self) -> &TimingSettings {
        &self.timing
    }

    /// What is protected from eviction.
    pub fn protection(&self) -> Protection {
        self.params.protection()
    }

    /// Its scorer.
    pub fn scorer(&self) -> &dyn Scorer {
        self.scorer.as_ref()
    }

    /// Whether any of its methods reads queries beyond the current position (an oracle).
    pub fn reads_future(&self) -> bool {
        self.scorer.reads_future() || self.allocator.reads_future()
    }

    /// Everything a one-shot selection's prompt scores depend on: the scorer and its settings, the
    /// protection and the cache layout — not the budget, the allocator or the head split. Policies
    /// with equal keys share one scoring pass over a layer.
    pub fn score_key(&self) -> &str {
        &self.score_key
    }

    /// Passes over the trace the allocator needs before the replay (0 or 1).
    pub fn budget_passes(&self) -> usize {
        let allocator = &self.allocator;
        usize::from(
            allocator.needs_profile()
                || allocator.needs_mass_curves()
                || allocator.needs_prompt_scores(),
        )
    }

    /// A short name, e.g. `pyramid+snapkv@prefill`, `flat/adakv+snapkv@prefill` with a head
    /// split other than `uniform`, `flat+snapkv@prefill kivi 2-bit` with a quantizer.
    pub fn label(&self) -> String {
        let protocol = match self.params.protocol {
            Protocol::QuestionInPrompt => "",
            Protocol::QuestionAgnostic => " question-agnostic",
        };
        let heads = match self.params.heads == PolicyParams::default().heads {
            true => String::new(),
            false => format!("/{}", self.params.heads),
        };
        let interval = match (self.timing.interval, self.timing.trigger) {
            (1, _) => String::new(),
            (n, Trigger::Growth) => format!(" every {n}"),
            (n, Trigger::Position) => format!(" at positions divisible by {n}"),
            (n, Trigger::Steps) => format!(" every {n} tokens"),
        };
        let quantized = match self.scheme() {
            Some(scheme) => format!(" {} {}-bit", self.params.quantizer, scheme.bits),
            None => String::new(),
        };
        let quantized = match self.channels.pruning() {
            Some(pruning) => format!(
                "{quantized} {} {} of key channels pruned",
                self.params.channels, pruning.fraction
            ),
            None => quantized,
        };
        let merges = self.merge.merging().is_some() || self.merge.decode_merging().is_some();
        let quantized = match merges {
            true => format!("{quantized} merging by {}", self.params.merge),
            false => quantized,
        };
        let quantized = match self.params.bytes {
            Some(bytes) => format!("{quantized} at {bytes} of the bytes"),
            None => quantized,
        };
        format!(
            "{}{heads}+{}@{}{interval}{protocol}{quantized}",
            self.params.allocator,
            self.params.scorer,
            self.params.timing.name()
        )
    }

    /// How its caches store their entries: `None` for the cache as captured.
    pub fn scheme(&self) -> Option<Scheme> {
        self.quantizer.scheme()
    }

    /// How its caches store their kept entries: quantized, with pruned key channels, with evicted
    /// values merged in, or as captured (they are not combined, [`PolicyParams::check`]).
    pub fn storage(&self) -> Storage {
        let merge = (self.merge.merging(), self.merge.decode_merging());
        match (self.scheme(), self.channels.pruning(), merge) {
            (Some(scheme), _, _) => Storage::Quantized(scheme),
            (None, Some(pruning), _) => Storage::PrunedKeys(pruning),
            (None, None, (Some(merge), _)) => Storage::Merged(merge),
            (None, None, (None, Some(merge))) => Storage::MergedWhileDecoding(merge),
            (None, None, (None, None)) => Storage::Captured,
        }
    }

    /// Every setting it runs with, as text in a stable order: the common ones and each chosen
    /// method's own (defaults included), for reports.
    pub fn settings(&self) -> BTreeMap<String, String> {
        self.settings.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A head split and a scorer that both declare `threshold` each get their own: qualified
    /// keys route to their axis, a bare key is refused naming both spellings, and the settings
    /// the reports print keep them apart.
    #[test]
    fn a_key_two_chosen_methods_declare_is_theirs_apart() {
        let both = PolicyParams {
            scorer: "rkv".into(),
            heads: "threshold".into(),
            ..PolicyParams::default()
        };
        let err = both.clone().with("threshold", 0.25).check().unwrap_err();
        assert_eq!(
            err.to_string(),
            "setting `threshold` is declared by scorer `rkv` and head split `threshold`: write `scorer.threshold` or `heads.threshold`"
        );
        let apart = both
            .with("scorer.threshold", 0.75)
            .with("heads.threshold", -2.0);
        let settings = apart.clone().check().unwrap().settings();
        assert_eq!(settings["scorer.threshold"], "0.75");
        assert_eq!(settings["heads.threshold"], "-2.0");
        assert!(!settings.contains_key("threshold"));
        // Each method is built from its own value: qfilter reads its calibration file when it is
        // checked, duo when it meets a trace, so only a bad path given to qfilter fails here.
        let calibrated = PolicyParams {
            scorer: "qfilter".into(),
            heads: "duo".into(),
            ..PolicyParams::default()
        };
        let missing = "/no/such/calibration.safetensors";
        calibrated
            .clone()
            .with("scorer.calibration", "prompt")
            .with("heads.calibration", missing)
            .check()
            .unwrap();
        let err = calibrated
            .with("scorer.calibration", missing)
            .with("heads.calibration", "prompt")
            .check()
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("scorer `qfilter`: setting `calibration` = /no/such"),
            "{err}"
        );
        let canonical = apart.canonical();
        assert_eq!(canonical["scorer.threshold"], 0.75);
        assert_eq!(canonical["heads.threshold"], -2.0);
    }

    /// `scorer.kernel` and `kernel` spell one policy where one chosen method declares `kernel`:
    /// one canonical form, so one run id.
    #[test]
    fn two_spellings_of_one_policy_have_one_canonical_form() {
        let bare = PolicyParams::default().with("kernel", 5);
        let qualified = PolicyParams::default().with("scorer.kernel", 5);
        assert_eq!(bare.canonical(), qualified.canonical());
        assert_eq!(
            bare.check().unwrap().settings(),
            qualified.check().unwrap().settings()
        );
    }

    /// The timing owns `order`, `interval` and `trigger`: given bare, qualified (`timing.`) or
    /// typed ([`PolicyParams::timed`]) they are one policy, whose canonical form writes them as
    /// the common settings they were (left out at their defaults), so stored run ids stand.
    #[test]
    fn the_timings_settings_are_its_own_and_keep_their_canonical_form() {
        let decoding = PolicyParams {
            scorer: "knorm".into(),
            timing: Timing::Decoding,
            ..PolicyParams::default()
        };
        let typed = decoding.clone().timed(
            Timing::Decoding,
            &TimingSettings {
                interval: 4,
                trigger: Trigger::Steps,
                ..TimingSettings::default()
            },
        );
        let bare = decoding
            .clone()
            .with("interval", 4)
            .with("trigger", "steps");
        let qualified = decoding
            .clone()
            .with("timing.interval", 4)
            .with("timing.trigger", "steps")
            .with("timing.order", "evict-first");
        for spelling in [&bare, &qualified] {
            assert_eq!(spelling.canonical(), typed.canonical());
        }
        let canonical = typed.canonical();
        assert_eq!(canonical["interval"], 4);
        assert_eq!(canonical["trigger"], "steps");
        assert!(!canonical.contains_key("order"));
        assert!(!decoding
            .with("interval", 1)
            .canonical()
            .contains_key("interval"));
        let checked = qualified.check().unwrap();
        assert_eq!(checked.timing_settings().interval, 4);
        assert_eq!(checked.timing_settings().trigger, Trigger::Steps);
        let settings = checked.settings();
        assert_eq!(settings["interval"], "4");
        assert_eq!(settings["order"], "evict-first");
        assert_eq!(checked.label(), "flat+knorm@decoding every 4 tokens");
    }

    /// A timing's settings are checked as a method's are, naming the timing, and the streaming
    /// rules still hold across timings.
    #[test]
    fn the_timings_settings_are_checked() {
        let error = |params: PolicyParams| params.check().unwrap_err().to_string();
        let streaming = PolicyParams {
            timing: Timing::Streaming,
            ..PolicyParams::default()
        };
        let zero = error(streaming.clone().with("interval", 0));
        assert!(
            zero.contains("timing `streaming`") && zero.contains("must be at least 1"),
            "{zero}"
        );
        let sideways = error(streaming.with("order", "sideways"));
        assert!(
            sideways.contains("`order`") && sideways.contains("attend-first"),
            "{sideways}"
        );
        let prefill = error(PolicyParams::default().with("interval", 4));
        assert!(prefill.contains("spaces a streaming eviction"), "{prefill}");
        let unknown = error(PolicyParams::default().with("timing.kernel", 7));
        assert!(
            unknown.contains("timing `prefill` (order, interval, trigger)"),
            "{unknown}"
        );
        assert!(PolicyParams::default().with("interval", 1).check().is_ok());
    }

    /// [`COMMON`] lists exactly the fields of [`PolicyParams`] beside the methods' settings, so
    /// the flags, the experiment keys and the struct cannot drift apart.
    #[test]
    fn common_settings_are_the_fields_of_a_policy() {
        let params = PolicyParams {
            bytes: Some(0.5),
            layers: Layers::All,
            protocol: Protocol::QuestionAgnostic,
            quantizer: "kivi".into(),
            channels: "think".into(),
            merge: "similarity".into(),
            ..PolicyParams::default()
        };
        let Value::Object(fields) = serde_json::to_value(&params).unwrap() else {
            panic!("params serialise to an object")
        };
        let mut fields: Vec<&str> = fields.keys().map(String::as_str).collect();
        let mut keys: Vec<&str> = common_keys().collect();
        fields.sort_unstable();
        keys.sort_unstable();
        assert_eq!(fields, keys);
        let defaults = PolicyParams::default().common_values();
        assert_eq!(defaults.len(), COMMON.len());
        assert_eq!(defaults["layers"], "global");
        assert_eq!(defaults["budget"], 128);
    }
}
