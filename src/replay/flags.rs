//! The policy as command-line flags, made from the same declarations as the experiment files'
//! keys: one flag per setting every policy has ([`COMMON`], [`common_flags`]) and one per setting
//! key of every registered method ([`method_flags`]), its help naming each method that takes it.
//! Both become the same [`PolicyParams`] an experiment file's policy table does, read by serde and
//! checked by the same code.

use super::settings;
use super::{all_methods, PolicyParams, COMMON};

/// One flag per setting every policy has ([`COMMON`]), with its default and the values it takes.
pub fn common_flags() -> Vec<clap::Arg> {
    let defaults = PolicyParams::default().common_values();
    COMMON
        .iter()
        .map(|common| {
            let values = (common.values)();
            let arg = clap::Arg::new(common.key)
                .long(common.key.replace('_', "-"))
                .value_name(common.key.to_uppercase());
            // A setting without a default (`bytes`) is left out unless given.
            let arg = match &defaults[common.key] {
                serde_json::Value::Null => arg,
                default => arg.default_value(settings::text(default)),
            };
            match (values.is_empty(), common.fixed) {
                (true, _) => arg.help(common.about),
                (false, true) => arg
                    .help(common.about)
                    .value_parser(clap::builder::PossibleValuesParser::new(values)),
                (false, false) => arg.help(format!("{}: {}", common.about, values.join(", "))),
            }
        })
        .collect()
}

/// Every policy flag: the common settings, then each method's.
pub fn policy_flags() -> Vec<clap::Arg> {
    let mut flags = common_flags();
    flags.extend(method_flags());
    flags
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

/// The policy the flags of [`policy_flags`] in `matches` give, read as an experiment file's
/// policy table is (the same keys, values and checks).
pub fn policy_params(matches: &clap::ArgMatches) -> Result<PolicyParams, String> {
    let mut given = serde_json::Map::new();
    for common in COMMON {
        let Some(text) = matches.get_one::<String>(common.key) else {
            continue;
        };
        // A name stays a string even where it reads as a number (`--scorer 1`).
        let value = match ((common.values)().is_empty(), common.whole) {
            (false, _) => serde_json::Value::from(text.as_str()),
            (true, false) => settings::from_flag(text),
            (true, true) => serde_json::Value::from(text.parse::<u64>().map_err(|_| {
                let flag = common.key.replace('_', "-");
                format!("--{flag}: `{text}` is not a whole number of tokens")
            })?),
        };
        given.insert(common.key.to_owned(), value);
    }
    for arg in method_flags() {
        let key = arg.get_id().as_str();
        if let Some(value) = matches.get_one::<String>(key) {
            given.insert(key.to_owned(), settings::from_flag(value));
        }
    }
    serde_json::from_value(serde_json::Value::Object(given))
        .map_err(|err| format!("policy flags: {err}"))
}
