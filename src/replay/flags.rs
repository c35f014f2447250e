//! The policy as command-line flags, made from the same declarations as the experiment files'
//! keys: one flag per setting every policy has ([`COMMON`], [`common_flags`]) and one per setting
//! key of every registered method ([`method_flags`]), its help naming each method that takes it.
//! Both become the same [`PolicyParams`] an experiment file's policy table does, read by serde and
//! checked by the same code.

use super::{all_methods, presets, settings, PolicyParams, COMMON};
use clap::parser::ValueSource;

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

/// Every policy flag: a preset to start from, the common settings, then each method's.
pub fn policy_flags() -> Vec<clap::Arg> {
    let mut flags = vec![clap::Arg::new("preset")
        .long("preset")
        .value_name("NAME")
        .value_parser(clap::builder::PossibleValuesParser::new(presets::NAMES))
        .help("Start from a named preset of a classic method, as `compare` and the tables name it, at --budget; the other flags given set its settings over it")];
    flags.extend(common_flags());
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
    let mut flags: Vec<clap::Arg> = keys
        .into_iter()
        .map(|(key, meanings)| {
            let help: Vec<String> = meanings
                .into_iter()
                .map(|(meaning, methods)| format!("{}: {meaning}", methods.join(", ")))
                .collect();
            let axes = axes_declaring(key);
            let qualified = match axes.len() {
                1 => String::new(),
                _ => {
                    let spellings: Vec<String> = axes
                        .iter()
                        .map(|axis| format!("--{axis}.{}", key.replace('_', "-")))
                        .collect();
                    format!(
                        " (where two chosen methods take it: {})",
                        spellings.join(", ")
                    )
                }
            };
            clap::Arg::new(key)
                .long(key.replace('_', "-"))
                .value_name("VALUE")
                .allow_negative_numbers(true)
                .help(format!("{}{qualified}", help.join("; ")))
                .help_heading("Method settings")
        })
        .collect();
    flags.extend(qualified_flags());
    flags
}

/// The axes whose methods declare `key`, in listing order.
fn axes_declaring(key: &str) -> Vec<&'static str> {
    let mut axes: Vec<&'static str> = Vec::new();
    for method in all_methods().iter().filter(|method| method.takes(key)) {
        if !axes.contains(&method.axis_key()) {
            axes.push(method.axis_key());
        }
    }
    axes
}

/// One flag per method setting qualified by its axis (`--scorer.kernel`, the experiment files'
/// `scorer.kernel`): shown in the help where two axes declare the key, hidden elsewhere.
fn qualified_flags() -> Vec<clap::Arg> {
    let mut flags: Vec<clap::Arg> = Vec::new();
    for method in all_methods() {
        for param in method.params {
            let id = format!("{}.{}", method.axis_key(), param.key);
            if flags.iter().any(|flag| flag.get_id() == id.as_str()) {
                continue;
            }
            let shown = axes_declaring(param.key).len() > 1;
            flags.push(
                clap::Arg::new(id.clone())
                    .long(format!(
                        "{}.{}",
                        method.axis_key(),
                        param.key.replace('_', "-")
                    ))
                    .value_name("VALUE")
                    .allow_negative_numbers(true)
                    .help(format!("`{}` of the chosen {}", param.key, method.axis))
                    .help_heading("Method settings")
                    .hide(!shown),
            );
        }
    }
    flags
}

/// The policy the flags of [`policy_flags`] in `matches` give, read as an experiment file's
/// policy table is (the same keys, values and checks). With `--preset`, the preset at the budget
/// the flags give, and over it only the flags given on the command line.
pub fn policy_params(matches: &clap::ArgMatches) -> Result<PolicyParams, String> {
    let preset = matches.get_one::<String>("preset");
    let mut given = serde_json::Map::new();
    for common in COMMON {
        let Some(text) = matches.get_one::<String>(common.key) else {
            continue;
        };
        let typed = matches.value_source(common.key) == Some(ValueSource::CommandLine);
        if preset.is_some() && !typed && common.key != "budget" {
            continue;
        }
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
    match preset {
        Some(name) => {
            given.insert("preset".into(), serde_json::Value::from(name.as_str()));
            presets::from_settings(&given).map_err(|err| format!("policy flags: {err}"))
        }
        None => serde_json::from_value(serde_json::Value::Object(given))
            .map_err(|err| format!("policy flags: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> Result<PolicyParams, String> {
        let command = clap::Command::new("replay").args(policy_flags());
        let matches = command
            .try_get_matches_from(std::iter::once("replay").chain(args.iter().copied()))
            .map_err(|err| err.to_string())?;
        policy_params(&matches)
    }

    #[test]
    fn a_preset_is_the_policy_an_experiment_table_of_it_gives() {
        let settings =
            |json: serde_json::Value| presets::from_settings(json.as_object().unwrap()).unwrap();
        assert_eq!(
            parsed(&["--preset", "snapkv", "--budget", "64"]).unwrap(),
            settings(serde_json::json!({"preset": "snapkv", "budget": 64}))
        );
        // Flags given set their settings over it; flags left at their defaults do not.
        let over = parsed(&["--preset", "snapkv", "--window", "4", "--kernel", "3"]).unwrap();
        assert_eq!(
            over,
            settings(serde_json::json!({"preset": "snapkv", "window": 4, "kernel": 3}))
        );
        assert_eq!(over.budget, PolicyParams::default().budget);
        assert_eq!(
            over.settings["pool"], "max",
            "the preset's own pooling stays"
        );
        // Without a preset, the flags alone.
        assert_eq!(parsed(&[]).unwrap(), PolicyParams::default());
        let err = parsed(&["--preset", "snapk"]).unwrap_err();
        assert!(err.contains("snapkv"), "{err}");
    }

    #[test]
    fn a_setting_qualified_by_its_axis_is_a_flag() {
        let both = ["--scorer", "rkv", "--heads", "threshold"];
        let apart = parsed(
            &[
                &both[..],
                &["--scorer.threshold", "0.7", "--heads.threshold", "-1"],
            ]
            .concat(),
        )
        .unwrap();
        let settings = apart.check().unwrap().settings();
        assert_eq!(settings["scorer.threshold"], "0.7");
        assert_eq!(settings["heads.threshold"], "-1");
        let bare = parsed(&[&both[..], &["--threshold", "0.7"]].concat()).unwrap();
        let err = bare.check().unwrap_err().to_string();
        assert!(
            err.contains("write `scorer.threshold` or `heads.threshold`"),
            "{err}"
        );
        // Every setting has its qualified flag; only those two axes declare are in the help.
        let qualified = parsed(&["--scorer.kernel", "5"]).unwrap();
        assert_eq!(
            qualified.canonical(),
            parsed(&["--kernel", "5"]).unwrap().canonical()
        );
        let help = clap::Command::new("replay")
            .args(policy_flags())
            .render_help()
            .to_string();
        assert!(help.contains("--heads.threshold"), "{help}");
        assert!(!help.contains("--scorer.kernel"), "{help}");
    }
}
