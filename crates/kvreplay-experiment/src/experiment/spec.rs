//! The experiment file and its expansion into runs.
//!
//! A file may name a base experiment in `extends` (a path relative to its own directory): every
//! top-level key the file sets replaces the base's, the rest come from the base (a slice of a
//! large experiment lists its own `traces` and inherits the policies, budgets and settings, so
//! the two cannot drift apart). A base does not itself extend another.

use super::traces::{self, Capture, NeedleCell, TraceEntry, TraceFile};
use super::Budget;
use super::SweepError;
use crate::replay::{
    all_methods, common_keys, parse_fraction, presets, routing, ExternalMethods, PolicyError,
    PolicyParams, ValidPolicy,
};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Errors of experiment files; each names the file and the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExperimentError {
    /// The file cannot be read.
    #[error("{path}: cannot read experiment: {source}")]
    Io {
        /// The experiment file.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// Malformed TOML or an unknown top-level key.
    #[error("{path}: invalid experiment: {detail}")]
    Parse {
        /// The experiment file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A policy key that no policy has.
    #[error("{path}: policy `{policy}`: unknown key `{key}`; valid: name, preset, {valid}")]
    UnknownKey {
        /// The experiment file.
        path: PathBuf,
        /// The policy's name.
        policy: String,
        /// The key.
        key: String,
        /// Valid keys.
        valid: String,
    },
    /// A policy whose settings do not check.
    #[error("{path}: policy `{policy}`: {detail}")]
    Policy {
        /// The experiment file.
        path: PathBuf,
        /// The policy's name.
        policy: String,
        /// The rule broken.
        detail: String,
    },
}

/// A paired comparison of two policies (by name) on the same trace positions.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Comparison {
    /// First policy.
    pub a: String,
    /// Second policy.
    pub b: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExperimentFile {
    #[serde(default)]
    description: String,
    traces: Vec<PathBuf>,
    #[serde(default)]
    budgets: Vec<usize>,
    #[serde(default)]
    bytes: Vec<toml::Value>,
    #[serde(default)]
    entropy_window: Option<usize>,
    #[serde(default)]
    heatmap_budget: Option<usize>,
    #[serde(default)]
    policy: Vec<toml::Table>,
    #[serde(default)]
    compare: Vec<Comparison>,
    #[serde(default)]
    closed_loop: bool,
    #[serde(default)]
    ranking: Vec<String>,
    #[serde(default)]
    ceiling: Option<String>,
}

/// A parsed, checked experiment.
#[derive(Debug, Clone)]
pub struct Experiment {
    /// The experiment's name (the file stem).
    pub name: String,
    /// What it answers (empty when the file gives none).
    pub description: String,
    /// Trace files or recipes, relative to the working directory.
    pub traces: Vec<PathBuf>,
    /// Budgets, the shared axis: in tokens (`budgets`) or in bytes (`bytes`).
    pub budgets: Vec<Budget>,
    /// When set, the per-layer entropy profile (this many last prompt queries) is reported.
    pub entropy_window: Option<usize>,
    /// When set, needle heatmaps (context length × depth) at this budget.
    pub heatmap_budget: Option<usize>,
    /// Every run to do on each trace: a display name and its parameters.
    pub policies: Vec<(String, PolicyParams)>,
    /// Paired comparisons.
    pub compare: Vec<Comparison>,
    /// Whether every run is also run live in the model (closed loop): traces must be recipes and
    /// policies one-shot at prefill end.
    pub closed_loop: bool,
    /// Metric ids the report ranks the policies by, one ranking table each.
    pub ranking: Vec<String>,
    /// The policy the rankings show every other as a share of (e.g. the per-step oracle).
    pub ceiling: Option<String>,
    /// Methods defined outside the library that its policies may name (the Python package's).
    pub externals: Option<Arc<dyn ExternalMethods>>,
    /// Whether one of its policies reads the attention inputs (DefensiveKV): its recipes are
    /// then captured with them, as `kvreplay capture --attention-inputs` captures.
    pub reads_inputs: bool,
}

/// One run: a policy at a budget on a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedRun {
    /// The run's id: a slug and a hash of the normalised settings and trace.
    pub id: String,
    /// The policy's display name.
    pub name: String,
    /// The trace file.
    pub trace: PathBuf,
    /// The parameters.
    pub params: PolicyParams,
}

/// `ranking` names known metrics, each once, and `ceiling` one of the policies (and needs a
/// The experiment measures something, and its budgets are given once each, in tokens or in bytes,
/// where policies run; returns the budget axis.
fn check_budgets(file: &ExperimentFile) -> Result<Vec<Budget>, String> {
    if file.policy.is_empty() && file.entropy_window.is_none() {
        return Err(
            "no [[policy]] and no `entropy_window`: the experiment measures nothing".into(),
        );
    }
    let bytes = file
        .bytes
        .iter()
        .map(|value| {
            let fraction = match value {
                toml::Value::Float(number) => Some(*number),
                toml::Value::Integer(number) => Some(*number as f64),
                toml::Value::String(text) => parse_fraction(text),
                _ => None,
            };
            fraction.ok_or_else(|| {
                format!("`bytes` lists {value}: each is a fraction of the full cache's bytes (0.125 or \"1/8\")")
            })
        })
        .collect::<Result<Vec<f64>, String>>()?;
    if !file.budgets.is_empty() && !bytes.is_empty() {
        return Err(
            "`budgets` and `bytes` are both given: an experiment's budget axis is in tokens or in bytes".into(),
        );
    }
    if !file.policy.is_empty() && file.budgets.is_empty() && bytes.is_empty() {
        return Err(
            "`budgets` is empty: the policies need at least one budget (tokens in `budgets`, or fractions of the full cache's bytes in `bytes`)".into(),
        );
    }
    if file.policy.is_empty() && !(file.budgets.is_empty() && bytes.is_empty()) {
        return Err("`budgets` are given but no [[policy]] runs at them".into());
    }
    if let Some(budget) = first_repeat(&file.budgets) {
        return Err(format!("budget {budget} is listed twice in `budgets`"));
    }
    if let Some(fraction) = first_repeat(&bytes) {
        return Err(format!("{fraction} is listed twice in `bytes`"));
    }
    if let Some(budget) = file.heatmap_budget {
        if !file.budgets.contains(&budget) {
            return Err(format!(
                "heatmap_budget = {budget} is not one of the budgets {:?} (in tokens)",
                file.budgets
            ));
        }
    }
    Ok(match bytes.is_empty() {
        true => file.budgets.iter().map(|&b| Budget::Tokens(b)).collect(),
        false => bytes.into_iter().map(Budget::Bytes).collect(),
    })
}

/// Every `[[policy]]` table expanded over its listed values and the budgets, each checked: the
/// labelled policies in file order, and whether one of them reads the attention inputs.
fn expand_policies(
    path: &Path,
    file: &ExperimentFile,
    budgets: &[Budget],
    externals: Option<&dyn ExternalMethods>,
) -> Result<(Vec<(String, PolicyParams)>, bool), ExperimentError> {
    let mut policies = Vec::new();
    let mut reads_inputs = false;
    let mut table_names: Vec<String> = Vec::new();
    for table in &file.policy {
        let name = table
            .get("name")
            .map(text)
            .ok_or_else(|| ExperimentError::Parse {
                path: path.to_owned(),
                detail: "every [[policy]] needs a `name`".into(),
            })?;
        if table_names.contains(&name) {
            return Err(ExperimentError::Parse {
                path: path.to_owned(),
                detail: format!(
                    "two [[policy]] tables are named `{name}`: names must be unique (the report has one row per name)"
                ),
            });
        }
        table_names.push(name.clone());
        let policy_error = |detail: String| ExperimentError::Policy {
            path: path.to_owned(),
            policy: name.clone(),
            detail,
        };
        let axes = policy_axes(path, &name, table)?;
        for combo in combinations(&axes) {
            for &column in budgets {
                let (budget, bytes) = match column {
                    Budget::Tokens(tokens) => (tokens, None),
                    Budget::Bytes(fraction) => (PolicyParams::default().budget, Some(fraction)),
                };
                let base = match table.get("preset") {
                    Some(preset) => presets::preset(&text(preset), budget)
                        .map_err(|err| policy_error(err.to_string()))?,
                    None => PolicyParams {
                        budget,
                        ..PolicyParams::default()
                    },
                };
                let base = PolicyParams { bytes, ..base };
                let mut label = name.clone();
                for (key, value) in &combo {
                    if axes.iter().any(|(k, v)| k == key && v.len() > 1) {
                        label = format!("{label} {key}={}", text(value));
                    }
                }
                let settings: Vec<(String, serde_json::Value)> = combo
                    .iter()
                    .map(|(key, value)| (key.clone(), to_json(value)))
                    .collect();
                let params = presets::overlay(&base, settings.iter().map(|(k, v)| (k, v)))
                    .map_err(|err| policy_error(err.to_string()))?;
                let checked = params.clone().check_in(externals).map_err(|err| {
                    policy_error(format!("{label} at {}: {err}", column.header()))
                })?;
                reads_inputs |= checked.scorer().needs_inputs();
                policies.push((label, params));
            }
        }
    }
    Ok((policies, reads_inputs))
}

/// A policy table's settings, each as the list of values it takes (a single value is a list of
/// one), in table order; unknown keys and repeated values are errors.
fn policy_axes(
    path: &Path,
    name: &str,
    table: &toml::Table,
) -> Result<Vec<(String, Vec<toml::Value>)>, ExperimentError> {
    let mut axes = Vec::new();
    for (key, value) in method_tables(path, name, table)? {
        if key == "name" || key == "preset" {
            continue;
        }
        if key == "bytes" {
            return Err(ExperimentError::Policy {
                path: path.to_owned(),
                policy: name.to_owned(),
                detail: "`bytes` in a [[policy]]: an experiment's budgets in bytes are its top-level `bytes` list (`bytes = [\"1/4\", \"1/8\"]`), in place of `budgets`".into(),
            });
        }
        if !is_policy_key(&key) {
            return Err(ExperimentError::UnknownKey {
                path: path.to_owned(),
                policy: name.to_owned(),
                key: key.clone(),
                valid: format!(
                    "{}, or a method's own setting, bare or qualified by its axis (`scorer.kernel`; `kvreplay methods` lists them)",
                    common_keys()
                        .filter(|k| !matches!(*k, "budget" | "bytes"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        let values = as_list(&value);
        if let Some(repeat) = first_repeat(&values) {
            return Err(ExperimentError::Policy {
                path: path.to_owned(),
                policy: name.to_owned(),
                detail: format!("`{key}` lists {} twice", text(repeat)),
            });
        }
        axes.push((key, values));
    }
    Ok(axes)
}

/// A policy table's entries with each method given as a table (`scorer = { name = "rkv",
/// threshold = 0.7 }`, or `scorer.threshold = 0.7` beside a preset's scorer) written out as its
/// name and its qualified settings (`scorer = "rkv"`, `scorer.threshold = 0.7`).
fn method_tables(
    path: &Path,
    policy: &str,
    table: &toml::Table,
) -> Result<Vec<(String, toml::Value)>, ExperimentError> {
    let mut entries = Vec::new();
    for (key, value) in table {
        let toml::Value::Table(method) = value else {
            entries.push((key.clone(), value.clone()));
            continue;
        };
        if !routing::AXES.contains(&key.as_str()) {
            return Err(ExperimentError::Policy {
                path: path.to_owned(),
                policy: policy.to_owned(),
                detail: format!(
                    "`{key}` is a table, but only a method's axis ({}) may be one: its `name` and its settings",
                    routing::AXES.join(", ")
                ),
            });
        }
        for (setting, value) in method {
            match setting.as_str() {
                "name" => entries.push((key.clone(), value.clone())),
                _ => entries.push((format!("{key}.{setting}"), value.clone())),
            }
        }
    }
    Ok(entries)
}

/// The cartesian product of the axes' values, the first axis outermost.
fn combinations(axes: &[(String, Vec<toml::Value>)]) -> Vec<Vec<(String, toml::Value)>> {
    let mut combos: Vec<Vec<(String, toml::Value)>> = vec![Vec::new()];
    for (key, values) in axes {
        combos = combos
            .into_iter()
            .flat_map(|combo| {
                values.iter().map(move |value| {
                    let mut next = combo.clone();
                    next.push((key.clone(), value.clone()));
                    next
                })
            })
            .collect();
    }
    combos
}

/// Every policy a `[[compare]]` pair names exists.
fn check_named(file: &ExperimentFile, names: &[String]) -> Result<(), String> {
    for pair in &file.compare {
        for side in [&pair.a, &pair.b] {
            if !names.contains(side) {
                return Err(format!(
                    "[[compare]] names `{side}`, which is no policy here; policies: {}",
                    policy_list(names)
                ));
            }
        }
    }
    Ok(())
}

/// A closed-loop experiment runs recipes, under policies the live mode can run.
fn check_closed_loop(
    path: &Path,
    file: &ExperimentFile,
    policies: &[(String, PolicyParams)],
    externals: Option<&dyn ExternalMethods>,
) -> Result<(), ExperimentError> {
    if let Some(trace) = file
        .traces
        .iter()
        .find(|t| t.extension().is_none_or(|e| e != "toml"))
    {
        return Err(ExperimentError::Parse {
            path: path.to_owned(),
            detail: format!(
                "closed_loop = true runs the model, so every entry of `traces` must be a recipe (.toml); `{}` is not",
                trace.display()
            ),
        });
    }
    for (label, params) in policies {
        let refused = params
            .clone()
            .check_in(externals)
            .ok()
            .and_then(|policy| crate::live::check_live(&policy).err());
        if let Some(refused) = refused {
            return Err(ExperimentError::Policy {
                path: path.to_owned(),
                policy: label.clone(),
                detail: format!("closed_loop = true: {refused}"),
            });
        }
    }
    Ok(())
}

/// ranking to appear in).
fn check_ranking(file: &ExperimentFile, names: &[String]) -> Result<(), String> {
    let ids: Vec<&str> = crate::replay::metrics::REGISTRY
        .iter()
        .map(|metric| metric.id())
        .collect();
    if let Some(unknown) = file.ranking.iter().find(|id| !ids.contains(&id.as_str())) {
        return Err(format!(
            "ranking names `{unknown}`, which is no metric; metrics: {}",
            ids.join(", ")
        ));
    }
    if let Some(repeat) = first_repeat(&file.ranking) {
        return Err(format!("ranking lists `{repeat}` twice"));
    }
    match &file.ceiling {
        Some(ceiling) if !names.contains(ceiling) => Err(format!(
            "ceiling = `{ceiling}` is no policy here; policies: {}",
            policy_list(names)
        )),
        Some(_) if file.ranking.is_empty() => {
            Err("ceiling is set but `ranking` names no metric to rank by".into())
        }
        _ => Ok(()),
    }
}

/// The policy names of an error message: each once (a name repeats once per budget).
fn policy_list(names: &[String]) -> String {
    let mut unique = names.to_vec();
    unique.dedup();
    unique.join(", ")
}

fn as_list(value: &toml::Value) -> Vec<toml::Value> {
    match value {
        toml::Value::Array(items) => items.clone(),
        other => vec![other.clone()],
    }
}

fn to_json(value: &toml::Value) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

fn text(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl Experiment {
    /// The experiment's trace files, in its order ([`traces::trace_files`]).
    pub fn trace_files(&self, capture: Option<Capture<'_>>) -> Result<Vec<TraceFile>, SweepError> {
        traces::trace_files(&self.traces, capture)
    }

    /// Its traces as found on disk, the recipes not captured yet named
    /// ([`traces::trace_entries`]).
    pub fn trace_entries(&self) -> Result<Vec<TraceEntry>, SweepError> {
        traces::trace_entries(&self.traces)
    }

    /// The needle grid of its traces ([`traces::needle_cells`]).
    pub fn needle_cells(&self, traces: &[TraceFile]) -> Vec<NeedleCell> {
        traces::needle_cells(traces)
    }

    /// Policy names in plan order, without repeats.
    pub fn policy_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for (name, _) in &self.policies {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names
    }
    /// Reads and checks an experiment file: unknown keys and names are errors listing the valid
    /// ones, and every expanded policy is checked before anything runs.
    pub fn load(path: &Path) -> Result<Self, ExperimentError> {
        Self::load_with(path, None)
    }

    /// [`load`](Self::load), its policies free to name the methods of `externals` too.
    pub fn load_with(
        path: &Path,
        externals: Option<Arc<dyn ExternalMethods>>,
    ) -> Result<Self, ExperimentError> {
        let parse_error = |detail: String| ExperimentError::Parse {
            path: path.to_owned(),
            detail,
        };
        let file: ExperimentFile = toml::Value::Table(extended_table(path)?)
            .try_into()
            .map_err(|err: toml::de::Error| parse_error(err.message().to_owned()))?;
        let budgets = check_budgets(&file).map_err(parse_error)?;
        let (policies, reads_inputs) =
            expand_policies(path, &file, &budgets, externals.as_deref())?;
        let names: Vec<String> = policies.iter().map(|(n, _)| n.clone()).collect();
        check_named(&file, &names).map_err(parse_error)?;
        check_ranking(&file, &names).map_err(parse_error)?;
        if file.closed_loop {
            check_closed_loop(path, &file, &policies, externals.as_deref())?;
        }
        Ok(Self {
            name: path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "experiment".into()),
            description: file.description,
            traces: file.traces,
            budgets,
            entropy_window: file.entropy_window,
            heatmap_budget: file.heatmap_budget,
            policies,
            compare: file.compare,
            closed_loop: file.closed_loop,
            ranking: file.ranking,
            ceiling: file.ceiling,
            externals,
            reads_inputs,
        })
    }

    /// Checks `params`, one of its policies, with its external methods.
    pub fn check(&self, params: &PolicyParams) -> Result<ValidPolicy, PolicyError> {
        params.clone().check_in(self.externals.as_deref())
    }

    /// Every run, for the given trace files (recipes already captured), in a stable order.
    pub fn plan(&self, traces: &[TraceFile]) -> Vec<PlannedRun> {
        let mut runs = Vec::new();
        for trace in traces {
            for (name, params) in &self.policies {
                let external = self
                    .externals
                    .as_ref()
                    .and_then(|externals| externals.identity(params));
                runs.push(PlannedRun {
                    id: run_id(name, trace, params, self.closed_loop, external.as_deref()),
                    name: name.clone(),
                    trace: trace.path.clone(),
                    params: params.clone(),
                });
            }
        }
        runs
    }
}

/// The top-level table of the experiment file at `path`.
fn read_table(path: &Path) -> Result<toml::Table, ExperimentError> {
    let source = std::fs::read_to_string(path).map_err(|source| ExperimentError::Io {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&source).map_err(|err: toml::de::Error| ExperimentError::Parse {
        path: path.to_owned(),
        detail: err.message().to_owned(),
    })
}

/// The file's table over its base's (`extends`), the base's keys replaced by the file's own.
fn extended_table(path: &Path) -> Result<toml::Table, ExperimentError> {
    let mut table = read_table(path)?;
    let Some(extends) = table.remove("extends") else {
        return Ok(table);
    };
    let parse_error = |detail: String| ExperimentError::Parse {
        path: path.to_owned(),
        detail,
    };
    let toml::Value::String(base) = extends else {
        return Err(parse_error(
            "`extends` must be a string: the path of the base experiment, relative to this file"
                .into(),
        ));
    };
    let base_path = path.parent().unwrap_or(Path::new("")).join(&base);
    if !base_path.is_file() {
        return Err(parse_error(format!(
            "extends = `{base}`: no such file ({})",
            base_path.display()
        )));
    }
    let mut merged = read_table(&base_path)?;
    if merged.contains_key("extends") {
        return Err(parse_error(format!(
            "extends = `{base}`, which itself extends another experiment: one level only"
        )));
    }
    merged.extend(table);
    Ok(merged)
}

/// The first value that appears twice in `values`.
fn first_repeat<T: PartialEq>(values: &[T]) -> Option<&T> {
    values
        .iter()
        .enumerate()
        .find(|(index, value)| values[..*index].contains(value))
        .map(|(_, value)| value)
}

/// Whether `key` can be set in a `[[policy]]` table: a common setting other than `budget` and
/// `bytes` (the top-level `budgets` list sets the budget), or a setting some registered method
/// declares.
fn is_policy_key(key: &str) -> bool {
    let (axis, bare) = routing::split(key);
    let method_key = all_methods()
        .iter()
        .any(|method| method.takes(bare) && axis.is_none_or(|axis| method.axis_key() == axis));
    (!matches!(key, "budget" | "bytes") && common_keys().any(|common| common == key)) || method_key
}

/// `slug-hash`: the slug is readable, the hash (of the normalised settings, the display name, the
/// trace's file name and the sha256 of its content; for closed-loop runs, of its recipe too; for
/// a policy naming methods defined outside the library, of their `external` identity) makes the
/// id unique and stable across runs and machines, and different for a re-captured trace whose
/// content differs or an external method whose code changed.
pub fn run_id(
    name: &str,
    trace: &TraceFile,
    params: &PolicyParams,
    closed_loop: bool,
    external: Option<&str>,
) -> String {
    let versions = params.method_versions();
    versioned_run_id(name, trace, (params, &versions), closed_loop, external)
}

/// [`run_id`] with the versions of the policy's methods' rules given.
fn versioned_run_id(
    name: &str,
    trace: &TraceFile,
    (params, versions): (&PolicyParams, &BTreeMap<String, u32>),
    closed_loop: bool,
    external: Option<&str>,
) -> String {
    let mut settings = params.canonical();
    // A method whose rule changed (version above 1) names other runs than before; every run of
    // a method still at its first rule keeps its id.
    for (axis, &version) in versions {
        if version > 1 {
            settings.insert(format!("{axis}_version"), version.into());
        }
    }
    let trace_name = trace
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let recipe = closed_loop.then_some(&trace.recipe_sha256);
    let identity = (name, &trace_name, &trace.sha256, settings, recipe);
    let normalised = match external {
        None => serde_json::to_string(&identity),
        Some(external) => serde_json::to_string(&(identity, external)),
    }
    .expect("serialise");
    let hash = format!("{:x}", Sha256::digest(normalised.as_bytes()));
    let slug: String = format!("{name}-b{}", params.budget)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{slug}-{}", &hash[..10])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> TraceFile {
        TraceFile {
            path: "t.safetensors".into(),
            sha256: "ab".into(),
            recipe: None,
            question: None,
            recipe_sha256: None,
            heads: None,
            prompt_len: None,
            model: None,
            global_layers: None,
        }
    }

    /// The id a run had before rule versions existed: its settings alone.
    fn unversioned_id(params: &PolicyParams) -> String {
        let settings = params.canonical();
        let normalised = serde_json::to_string(&(
            "p",
            "t.safetensors",
            "ab",
            settings,
            None::<&Option<String>>,
        ))
        .unwrap();
        let hash = format!("{:x}", Sha256::digest(normalised.as_bytes()));
        format!("p-b{}-{}", params.budget, &hash[..10])
    }

    #[test]
    fn a_method_at_a_new_rule_version_names_new_runs() {
        let first_rule = PolicyParams::default();
        assert_eq!(first_rule.method_versions()["scorer"], 1);
        assert_eq!(
            run_id("p", &trace(), &first_rule, false, None),
            unversioned_id(&first_rule),
            "a method still at its first rule keeps the ids of runs stored before versions"
        );
        // The same policy had its scorer's rule been bumped to version 2 (the core's test scorer
        // `toy` declares one; `method_versions` reads it from the registry).
        let mut bumped = first_rule.method_versions();
        bumped.insert("scorer".into(), 2);
        let id = versioned_run_id("p", &trace(), (&first_rule, &bumped), false, None);
        assert_ne!(id, unversioned_id(&first_rule));
    }
}
