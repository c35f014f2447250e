//! Errors of policies and replays: one variant per rule, naming the parameter and value.

use crate::trace::TraceError;

/// A policy that cannot run, or a replay that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// An allocator or scorer name not in the registry.
    #[error("unknown {kind} `{name}`; valid: {valid}")]
    UnknownName {
        /// `allocator` or `scorer`.
        kind: &'static str,
        /// The name given.
        name: String,
        /// The registered names.
        valid: String,
    },
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
    /// Reading the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
}
