//! Which chosen method each given setting is for. A policy names one method per axis (allocator,
//! scorer, head split, quantizer, key channels, merge) and a timing, and gives their settings by
//! key: a bare key (`kernel`, `interval`) is for the one chosen method (or the timing) that
//! declares it, a qualified key (`scorer.kernel`, `heads.threshold`, `timing.interval`) for the
//! one chosen on that axis. Each method is built from its own
//! routed settings alone, so two methods that declare one key never share a value: a bare key two
//! chosen methods declare is an error that names both spellings.

use super::settings::Param;
use super::PolicyError;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The config keys of the axes whose methods declare settings, in the policy's order; a
/// qualified setting is `axis.key`.
pub const AXES: [&str; 7] = [
    "allocator",
    "scorer",
    "heads",
    "quantizer",
    "channels",
    "merge",
    "timing",
];

/// The method chosen on one axis, as routing sees it.
pub struct Owner {
    /// The axis's config key (one of [`AXES`]).
    pub axis: &'static str,
    /// `axis `name``, for messages.
    pub label: String,
    /// The settings it declares (none for a method defined outside the registries).
    pub params: &'static [Param],
}

impl Owner {
    fn takes(&self, key: &str) -> bool {
        self.params.iter().any(|param| param.key == key)
    }

    /// Its label and the settings it declares, for messages.
    pub fn described(&self) -> String {
        let keys: Vec<&str> = self.params.iter().map(|param| param.key).collect();
        match keys.is_empty() {
            true => format!("{} (no settings)", self.label),
            false => format!("{} ({})", self.label, keys.join(", ")),
        }
    }
}

/// A setting's key split into its axis, when qualified, and its bare key.
pub fn split(key: &str) -> (Option<&str>, &str) {
    match key.split_once('.') {
        Some((axis, bare)) => (Some(axis), bare),
        None => (None, key),
    }
}

/// The given settings routed to their owners: one map per owner, in `owners`' order, of bare
/// keys. `unknown(key)` is the error for a key no chosen method takes.
pub fn route(
    given: &BTreeMap<String, Value>,
    owners: &[Owner],
    unknown: impl Fn(&str) -> PolicyError,
) -> Result<Vec<Map<String, Value>>, PolicyError> {
    let mut routed = vec![Map::new(); owners.len()];
    for (key, value) in given {
        let index = owner_of(key, owners).map_err(|unrouted| match unrouted {
            Unrouted::NoTaker => unknown(key),
            Unrouted::NoAxis(axis) => PolicyError::UnknownAxis {
                key: key.to_owned(),
                axis: axis.to_owned(),
                valid: AXES.join(", "),
            },
            Unrouted::Several(takers) => ambiguous(key, &takers, owners),
        })?;
        let (_, bare) = split(key);
        if routed[index]
            .insert(bare.to_owned(), value.clone())
            .is_some()
        {
            return Err(PolicyError::SettingTwice {
                key: bare.to_owned(),
                method: owners[index].label.clone(),
            });
        }
    }
    Ok(routed)
}

/// Why a key is for none of the chosen methods.
pub enum Unrouted<'k> {
    /// No chosen method (on its axis, if qualified) declares it.
    NoTaker,
    /// It is qualified by this, which is not an axis.
    NoAxis(&'k str),
    /// It is bare and these owners declare it.
    Several(Vec<usize>),
}

/// The index of the owner `key` is for: the one chosen method on its axis that declares it, or,
/// for a bare key, the one chosen method that does.
pub fn owner_of<'k>(key: &'k str, owners: &[Owner]) -> Result<usize, Unrouted<'k>> {
    let (axis, bare) = split(key);
    if let Some(axis) = axis.filter(|axis| !AXES.contains(axis)) {
        return Err(Unrouted::NoAxis(axis));
    }
    let takers: Vec<usize> = (0..owners.len())
        .filter(|&index| owners[index].takes(bare))
        .filter(|&index| axis.is_none_or(|axis| owners[index].axis == axis))
        .collect();
    match takers[..] {
        [] => Err(Unrouted::NoTaker),
        [one] => Ok(one),
        _ => Err(Unrouted::Several(takers)),
    }
}

/// The error for bare `key`, which the owners `takers` all declare.
fn ambiguous(key: &str, takers: &[usize], owners: &[Owner]) -> PolicyError {
    let listed = |item: &dyn Fn(&Owner) -> String, separator: &str| {
        let items: Vec<String> = takers.iter().map(|&index| item(&owners[index])).collect();
        items.join(separator)
    };
    PolicyError::AmbiguousSetting {
        key: key.to_owned(),
        owners: listed(&|owner| owner.label.clone(), " and "),
        spellings: listed(&|owner| format!("`{}.{key}`", owner.axis), " or "),
    }
}

/// How `owner`'s setting `bare` is written where the settings of several methods stand together
/// (run ids, reports): bare where it is the only chosen method that declares it, else qualified
/// by its axis.
pub fn canonical_key(bare: &str, owner: &Owner, owners: &[Owner]) -> String {
    let takers = owners.iter().filter(|other| other.takes(bare)).count();
    match takers {
        0 | 1 => bare.to_owned(),
        _ => format!("{}.{bare}", owner.axis),
    }
}

/// How a given setting's key is written in a policy's canonical form: [`canonical_key`] of the
/// method it is for, or the key as given when no chosen method is (the policy does not check).
pub fn canonical_given(key: &str, owners: &[Owner]) -> String {
    match owner_of(key, owners) {
        Ok(index) => canonical_key(split(key).1, &owners[index], owners),
        Err(_) => key.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THRESHOLD: &[Param] = &[Param {
        key: "threshold",
        doc: "",
    }];
    const BOTH: &[Param] = &[
        Param {
            key: "kernel",
            doc: "",
        },
        Param {
            key: "threshold",
            doc: "",
        },
    ];

    fn owners() -> Vec<Owner> {
        vec![
            Owner {
                axis: "scorer",
                label: "scorer `s`".into(),
                params: BOTH,
            },
            Owner {
                axis: "heads",
                label: "head split `h`".into(),
                params: THRESHOLD,
            },
            Owner {
                axis: "allocator",
                label: "allocator `a`".into(),
                params: &[],
            },
        ]
    }

    fn given(pairs: &[(&str, i64)]) -> BTreeMap<String, Value> {
        pairs
            .iter()
            .map(|&(key, value)| (key.to_owned(), Value::from(value)))
            .collect()
    }

    fn unknown(key: &str) -> PolicyError {
        PolicyError::UnknownSetting {
            key: key.to_owned(),
            chosen: String::new(),
            owners: String::new(),
        }
    }

    #[test]
    fn each_setting_reaches_only_its_own_method() {
        let routed = route(
            &given(&[
                ("kernel", 5),
                ("scorer.threshold", 1),
                ("heads.threshold", 2),
            ]),
            &owners(),
            unknown,
        )
        .unwrap();
        assert_eq!(
            Value::Object(routed[0].clone()),
            serde_json::json!({"kernel": 5, "threshold": 1})
        );
        assert_eq!(
            Value::Object(routed[1].clone()),
            serde_json::json!({"threshold": 2})
        );
        assert!(routed[2].is_empty());
    }

    #[test]
    fn a_bare_key_two_chosen_methods_declare_names_both_spellings() {
        let err = route(&given(&[("threshold", 1)]), &owners(), unknown).unwrap_err();
        assert_eq!(
            err.to_string(),
            "setting `threshold` is declared by scorer `s` and head split `h`: write `scorer.threshold` or `heads.threshold`"
        );
    }

    #[test]
    fn qualified_keys_must_name_an_axis_whose_method_takes_them() {
        let err = route(&given(&[("scorer.kernal", 1)]), &owners(), unknown).unwrap_err();
        assert!(
            matches!(err, PolicyError::UnknownSetting { ref key, .. } if key == "scorer.kernal")
        );
        let err = route(&given(&[("heads.kernel", 1)]), &owners(), unknown).unwrap_err();
        assert!(
            matches!(err, PolicyError::UnknownSetting { ref key, .. } if key == "heads.kernel")
        );
        let err = route(&given(&[("score.kernel", 1)]), &owners(), unknown).unwrap_err();
        assert_eq!(
            err.to_string(),
            "setting `score.kernel`: `score` is not an axis (allocator, scorer, heads, quantizer, channels, merge, timing)"
        );
        let err = route(
            &given(&[("kernel", 1), ("scorer.kernel", 2)]),
            &owners(),
            unknown,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "setting `kernel` of scorer `s` is given twice (bare and qualified)"
        );
    }

    #[test]
    fn canonical_keys_are_qualified_only_where_two_methods_declare_them() {
        let owners = owners();
        assert_eq!(canonical_key("kernel", &owners[0], &owners), "kernel");
        assert_eq!(
            canonical_key("threshold", &owners[0], &owners),
            "scorer.threshold"
        );
        assert_eq!(
            canonical_key("threshold", &owners[1], &owners),
            "heads.threshold"
        );
        assert_eq!(canonical_given("scorer.kernel", &owners), "kernel");
        assert_eq!(canonical_given("kernel", &owners), "kernel");
        assert_eq!(
            canonical_given("scorer.threshold", &owners),
            "scorer.threshold"
        );
        assert_eq!(
            canonical_given("threshold", &owners),
            "threshold",
            "ambiguous: as given"
        );
        assert_eq!(
            canonical_given("heads.kernel", &owners),
            "heads.kernel",
            "nobody's: as given"
        );
    }
}
