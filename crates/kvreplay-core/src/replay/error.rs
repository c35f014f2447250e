//! Errors of policies and replays: one variant per rule, naming the parameter and value.

use crate::trace::TraceError;

/// A policy that cannot run, or a replay that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A method name not in its axis's registry.
    #[error("unknown {kind} `{name}`; valid: {valid}")]
    UnknownName {
        /// The axis: `allocator`, `scorer`, `head split` or `preset`.
        kind: &'static str,
        /// The name given.
        name: String,
        /// The registered names.
        valid: String,
    },
    /// A name that was renamed, with its new spelling.
    #[error("{old} was renamed: {new}")]
    Renamed {
        /// The old name.
        old: String,
        /// The new spelling.
        new: String,
    },
    /// A method setting that none of the chosen methods takes.
    #[error("setting `{key}` is not taken by {chosen}; {owners}")]
    UnknownSetting {
        /// The key given.
        key: String,
        /// The chosen methods and the settings each takes.
        chosen: String,
        /// Which methods do take it.
        owners: String,
    },
    /// A bare method setting that two chosen methods declare.
    #[error("setting `{key}` is declared by {owners}: write {spellings}")]
    AmbiguousSetting {
        /// The key given.
        key: String,
        /// The chosen methods that declare it.
        owners: String,
        /// Its qualified spellings.
        spellings: String,
    },
    /// A qualified method setting whose axis does not exist.
    #[error("setting `{key}`: `{axis}` is not an axis ({valid})")]
    UnknownAxis {
        /// The key given.
        key: String,
        /// Its axis part.
        axis: String,
        /// The axes.
        valid: String,
    },
    /// A method setting given both bare and qualified.
    #[error("setting `{key}` of {method} is given twice (bare and qualified)")]
    SettingTwice {
        /// The bare key.
        key: String,
        /// The method it is for.
        method: String,
    },
    /// A method setting of the wrong type or out of range.
    #[error("{method}: setting `{key}` = {value}: {rule}")]
    Setting {
        /// The method, e.g. "allocator `pyramid`".
        method: String,
        /// The setting.
        key: String,
        /// Its value.
        value: String,
        /// The rule or the type expected.
        rule: String,
    },
    /// Settings that do not read as a policy (a value of the wrong type for its key).
    #[error("policy settings: {0}")]
    Malformed(String),
    /// A parameter out of range.
    #[error("parameter `{field}` = {value}: {rule}")]
    Param {
        /// The parameter.
        field: &'static str,
        /// Its value.
        value: String,
        /// The rule.
        rule: &'static str,
    },
    /// A budget that cannot hold the protected tokens.
    #[error("budget {budget}{} is below sinks {sinks} + window {window}: nothing could ever be evicted; raise the budget or lower --sinks/--window", layer.map(|l| format!(" of layer {l}")).unwrap_or_default())]
    BudgetBelowProtected {
        /// The budget.
        budget: usize,
        /// Protected first positions.
        sinks: usize,
        /// Protected recent positions.
        window: usize,
        /// The layer, when a schedule produced the budget.
        layer: Option<usize>,
    },
    /// An allocator that left a layer nothing, where nothing is protected.
    #[error("the `{allocator}` allocator gives layer {layer} no entries at budget {budget}: an empty cache attends to nothing, which kvreplay does not replay; raise the budget")]
    EmptyLayer {
        /// The allocator.
        allocator: String,
        /// The layer.
        layer: usize,
        /// The nominal budget per cache.
        budget: usize,
    },
    /// A combination the method does not define.
    #[error("{what} {rule}")]
    Unsupported {
        /// What was asked.
        what: String,
        /// Why not.
        rule: &'static str,
    },
    /// The policy does not fit this trace.
    #[error("{path}: {rule}")]
    TraceMismatch {
        /// The trace.
        path: String,
        /// The rule.
        rule: String,
    },
    /// A method's call failed where the engine made it (a method defined outside the library:
    /// a Python object raised).
    #[error(transparent)]
    Failed(#[from] MethodFailed),
    /// Reading the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The caller asked the work to stop (Ctrl-C), at one of its
    /// [`Checkpoints`](super::Checkpoints). Not transparent: the [`Stopped`] stays in the chain of
    /// causes, where a caller finds it through wrapping errors.
    #[error("{0}")]
    Stopped(#[from] Stopped),
}

/// A call of a scorer, scorer state or allocator failed: what those calls return instead of a
/// result. The library's own methods never fail; a method written outside it (Python) says
/// where and why, and the engine stops with the first failure in the order of layers and caches.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MethodFailed(pub String);

/// The work was asked to stop: what a [`Checkpoints`](super::Checkpoints) callback returns to end
/// it where it stands.
pub use crate::stop::Stopped;
