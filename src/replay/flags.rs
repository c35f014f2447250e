//! The policy as command-line flags: the settings every policy has ([`PolicyArgs`]) and one flag
//! per setting key of every registered method ([`method_flags`]), its help naming each method
//! that takes it. Both become the same [`PolicyParams`] an experiment file's policy table does,
//! checked by the same code.

use super::settings::{self, Method};
use super::{
    all_methods, allocator, head_split, scorer, Granularity, Layers, Order, PolicyParams, Timing,
};

/// A policy, flag by flag: the settings every policy has. Each registered method's own settings
/// are flags too, added from the registries ([`method_flags`]).
#[derive(clap::Args)]
pub struct PolicyArgs {
    /// How many tokens each layer keeps (an allocator; `kvreplay methods` lists them).
    #[arg(long, default_value = "flat", help = axis_help("How many tokens each layer keeps", allocator::REGISTRY))]
    pub allocator: String,
    /// Which tokens (a scorer).
    #[arg(long, default_value = "snapkv", help = axis_help("Which tokens", scorer::REGISTRY))]
    pub scorer: String,
    /// How a layer's budget is shared among its caches (a head split).
    #[arg(long, default_value = "uniform", help = axis_help("How a layer's budget is shared among its caches", head_split::REGISTRY))]
    pub heads: String,
    /// When the kept set is chosen.
    #[arg(long, value_enum, default_value_t = Timing::Prefill)]
    pub timing: Timing,
    /// Under a streaming timing: whether a step's query attends before or after its eviction.
    #[arg(long, value_enum, default_value_t = Order::EvictFirst)]
    pub order: Order,
    /// Nominal tokens per cache (mean over layers), sinks and window included.
    #[arg(long, default_value_t = 128)]
    pub budget: usize,
    /// Protected recent tokens; SnapKV's observation window.
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    /// Protected first tokens (attention sinks).
    #[arg(long, default_value_t = 0)]
    pub sinks: usize,
    /// Cache granularity under grouped-query attention.
    #[arg(long, value_enum, default_value_t = Granularity::KvHead)]
    pub gqa: Granularity,
    /// On a model with sliding-window layers, which layers the budget compresses.
    #[arg(long, value_enum, default_value_t = Layers::Global)]
    pub layers: Layers,
    /// k of the top-k recall.
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
}

/// `what` and the registered names of an axis, for `--help`.
fn axis_help<T: ?Sized>(what: &str, registry: &[Method<T>]) -> String {
    format!("{what}: {}", settings::names(registry))
}

/// One flag per method setting key of every registry (`--beta`, `--kernel`, ...), its help naming
/// each method that takes it, with its meaning and default.
pub fn method_flags() -> Vec<clap::Arg> {
    // Per key, the methods that take it with the meaning and default each gives it; methods
    // that agree on both share one line of help.
    type Meaning = (String, Vec<String>);
    let mut keys: Vec<(&'static str, Vec<Meaning>)> = Vec::new();
    for method in all_methods() {
        let defaults = (method.defaults)();
        for param in method.params {
            let meaning = format!(
                "{} (default {})",
                param.doc.trim(),
                settings::text(&defaults[param.key])
            );
            let index = match keys.iter().position(|(key, _)| *key == param.key) {
                Some(index) => index,
                None => {
                    keys.push((param.key, Vec::new()));
                    keys.len() - 1
                }
            };
            let meanings = &mut keys[index].1;
            match meanings.iter_mut().find(|(text, _)| *text == meaning) {
                Some((_, methods)) => methods.push(method.label()),
                None => meanings.push((meaning, vec![method.label()])),
            }
        }
    }
    keys.into_iter()
        .map(|(key, meanings)| {
            let help: Vec<String> = meanings
                .into_iter()
                .map(|(meaning, methods)| format!("{}: {meaning}", methods.join(", ")))
                .collect();
            clap::Arg::new(key)
                .long(key.replace('_', "-"))
                .value_name("VALUE")
                .help(help.join("; "))
                .help_heading("Method settings")
        })
        .collect()
}

impl PolicyArgs {
    /// The policy, with the method settings given as flags in `matches`.
    pub fn params(&self, matches: &clap::ArgMatches) -> PolicyParams {
        let mut settings = std::collections::BTreeMap::new();
        for arg in method_flags() {
            let key = arg.get_id().as_str();
            if let Some(value) = matches.get_one::<String>(key) {
                settings.insert(key.to_owned(), settings::from_flag(value));
            }
        }
        PolicyParams {
            allocator: self.allocator.clone(),
            scorer: self.scorer.clone(),
            heads: self.heads.clone(),
            timing: self.timing,
            order: self.order,
            budget: self.budget,
            window: self.window,
            sinks: self.sinks,
            gqa: self.gqa,
            layers: self.layers,
            top_k: self.top_k,
            settings,
        }
    }
}
