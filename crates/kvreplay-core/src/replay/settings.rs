//! Method settings as data. Every pluggable method (allocator, scorer, head split) declares its
//! parameters once, in its own file, with [`settings!`](crate::settings): a struct whose fields
//! are the config keys, each with a default and a doc line saying what it means and where it comes
//! from. One line in its axis's [`registry!`](crate::registry) makes the method known by its name;
//! the experiment parser, the command-line flags and their help, `kvreplay methods`, and the errors
//! for an unknown name or for a setting the chosen method does not take all follow from these
//! declarations.

use serde::{de::DeserializeOwned, Serialize};
use serde_json::{Map, Value};

/// One declared parameter of a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    /// The config key; the command-line flag is the key with `-` for `_`.
    pub key: &'static str,
    /// What it means and where it comes from.
    pub doc: &'static str,
}

/// A method's declaration: its name and its parameters, each with a default.
pub trait Declared: Serialize + DeserializeOwned + Default + Send + Sync + 'static {
    /// The registry key (the file name, `_` spelled `-`).
    const NAME: &'static str;
    /// One paragraph: what the method does and its source.
    const ABOUT: &'static str;
    /// Every parameter, in declaration order.
    const PARAMS: &'static [Param];
    /// The version of its rule: 1, bumped whenever a change of its code changes what it keeps
    /// under the same settings, so stored runs computed with the old rule are not reused.
    const VERSION: u32;
}

/// A rule a method's checked settings broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    /// The parameter.
    pub key: &'static str,
    /// The rule, e.g. "must be odd", or what failed while loading what the setting names.
    pub rule: std::borrow::Cow<'static, str>,
}

impl Broken {
    /// The rule of a setting that is a share: `value` must lie in [0, 1]; `meaning`, when given,
    /// says of what (`"a cosine similarity"`).
    pub fn unless_share(
        key: &'static str,
        value: f64,
        meaning: Option<&'static str>,
    ) -> Result<(), Broken> {
        if (0.0..=1.0).contains(&value) {
            return Ok(());
        }
        let rule = match meaning {
            Some(meaning) => format!("must be in [0, 1]: {meaning}").into(),
            None => "must be in [0, 1]".into(),
        };
        Err(Broken { key, rule })
    }
}

/// Why settings could not become a method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingError {
    /// The parameter.
    pub key: String,
    /// The value given, as text.
    pub value: String,
    /// The rule or the type expected.
    pub rule: String,
}

/// A registered method of one axis; `T` is the axis's trait object (`dyn Allocator`, ...).
pub struct Method<T: ?Sized> {
    /// The registry key.
    pub name: &'static str,
    /// What it does and its source.
    pub about: &'static str,
    /// Its parameters.
    pub params: &'static [Param],
    /// The version of its rule ([`Declared::VERSION`]).
    pub version: u32,
    /// Its defaults, as config values.
    pub defaults: fn() -> Map<String, Value>,
    /// Builds it from settings that it declares (checked).
    pub build: Build<T>,
}

/// Builds a method from settings that it declares (checked).
pub type Build<T> = fn(&Map<String, Value>) -> Result<Box<T>, SettingError>;

impl<T: ?Sized> Method<T> {
    /// Whether it declares `key`.
    pub fn takes(&self, key: &str) -> bool {
        self.params.iter().any(|param| param.key == key)
    }

    /// Its defaults overlaid with the given settings it declares: every value it will run with.
    pub fn resolve(&self, given: &Map<String, Value>) -> Map<String, Value> {
        let mut settings = (self.defaults)();
        for (key, value) in given {
            if self.takes(key) {
                settings.insert(key.clone(), value.clone());
            }
        }
        settings
    }
}

/// The defaults of `S` as config values.
pub fn defaults<S: Declared>() -> Map<String, Value> {
    values(&S::default())
}

/// The settings `settings` as config values.
pub fn values<S: Declared>(settings: &S) -> Map<String, Value> {
    match serde_json::to_value(settings).expect("settings serialise") {
        Value::Object(map) => map,
        other => panic!("settings of {} serialise to {other}, not a table", S::NAME),
    }
}

/// Parses the settings of `S` from `given` (keys it declares; the rest are ignored): defaults
/// first, then each given value, so a value of the wrong type is named by its key.
pub fn parse<S: Declared>(given: &Map<String, Value>) -> Result<S, SettingError> {
    let mut settings = defaults::<S>();
    for (key, value) in given {
        if !S::PARAMS.iter().any(|param| param.key == key) {
            continue;
        }
        settings.insert(key.clone(), value.clone());
        serde_json::from_value::<S>(Value::Object(settings.clone())).map_err(|err| {
            SettingError {
                key: key.clone(),
                value: text(value),
                rule: expected(&err.to_string()),
            }
        })?;
    }
    Ok(serde_json::from_value(Value::Object(settings)).expect("checked value by value"))
}

/// [`parse`], then `check` (the rules beyond the types): a broken rule names its setting and the
/// value given, or "its default".
pub fn parse_checked<S: Declared>(
    given: &Map<String, Value>,
    check: impl FnOnce(&S) -> Result<(), Broken>,
) -> Result<S, SettingError> {
    let settings = parse::<S>(given)?;
    check(&settings).map_err(|broken| SettingError {
        key: broken.key.to_owned(),
        value: given
            .get(broken.key)
            .map(text)
            .unwrap_or_else(|| "its default".into()),
        rule: broken.rule.into_owned(),
    })?;
    Ok(settings)
}

/// A config value as a person wrote it (strings without quotes).
pub fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The "expected ..." part of a serde message, which names the type or the variants.
fn expected(message: &str) -> String {
    match message.find("expected") {
        Some(start) => message[start..].to_owned(),
        None => message.to_owned(),
    }
}

/// A setting given on the command line, as a config value: a number where it reads as one
/// (integers stay integers), `true` or `false` a boolean, else the text.
pub fn from_flag(text: &str) -> Value {
    if let Ok(flag) = text.parse::<bool>() {
        return Value::from(flag);
    }
    if let Ok(integer) = text.parse::<u64>() {
        return Value::from(integer);
    }
    if let Ok(integer) = text.parse::<i64>() {
        return Value::from(integer);
    }
    match text.parse::<f64>() {
        Ok(number) if number.is_finite() => Value::from(number),
        _ => Value::from(text),
    }
}

/// Declares a method's settings struct: its registry name (and, when its rule changed since its
/// first version, `version N`), what it does, and each field with its doc line and default; an
/// optional `loaded { … }` block holds what `check` loads from the settings (not settings
/// themselves: never parsed, listed or serialised). The struct derives serde (unknown keys rejected, missing keys defaulted)
/// and implements [`Declared`].
///
/// ```ignore
/// settings! {
///     /// PyramidKV's linear schedule (arXiv:2406.02069).
///     pub struct Pyramid = "pyramid" {
///         /// The divisor beta of the official code.
///         beta: f64 = 20.0,
///     }
/// }
/// ```
#[macro_export]
macro_rules! settings {
    (
        $(#[doc = $about:literal])+
        $vis:vis struct $name:ident = $key:literal $(, version $version:literal)? {
            $( $(#[doc = $doc:literal])+ $field:ident : $ty:ty = $default:expr ),* $(,)?
        }
        $( loaded {
            $( $(#[doc = $loaded_doc:literal])+ $loaded:ident : $loaded_ty:ty ),* $(,)?
        } )?
    ) => {
        $(#[doc = $about])+
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        $vis struct $name {
            $( $(#[doc = $doc])+ pub $field: $ty, )*
            $( $( $(#[doc = $loaded_doc])+ #[serde(skip)] pub $loaded: $loaded_ty, )* )?
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    $( $field: $default, )*
                    $( $( $loaded: Default::default(), )* )?
                }
            }
        }

        impl $crate::replay::settings::Declared for $name {
            const NAME: &'static str = $key;
            const ABOUT: &'static str = concat!($($about),+);
            const VERSION: u32 = {
                let versions: &[u32] = &[$($version)?];
                if versions.is_empty() { 1 } else { versions[0] }
            };
            const PARAMS: &'static [$crate::replay::settings::Param] = &[
                $( $crate::replay::settings::Param {
                    key: stringify!($field),
                    doc: concat!($($doc),+),
                }, )*
            ];
        }
    };
}

/// Registers an axis's methods: one line per method, `module::Type`, in listing order (a line may
/// carry attributes, e.g. `#[cfg(test)]`). Declares `REGISTRY`, the list every lookup, flag and
/// listing reads; the modules are declared beside it, written out so that rustfmt and clippy see
/// them. Each type implements [`Declared`] (through [`settings!`](crate::settings)) and the
/// axis's trait.
#[macro_export]
macro_rules! registry {
    ($axis:ident: $( $(#[$attr:meta])* $module:ident :: $method:ident ),+ $(,)?) => {
        /// Every registered method of this axis, in listing order.
        pub const REGISTRY: &[$crate::replay::settings::Method<dyn $axis>] = &[
            $( $(#[$attr])* $crate::replay::settings::Method {
                name: <$module::$method as $crate::replay::settings::Declared>::NAME,
                about: <$module::$method as $crate::replay::settings::Declared>::ABOUT,
                params: <$module::$method as $crate::replay::settings::Declared>::PARAMS,
                version: <$module::$method as $crate::replay::settings::Declared>::VERSION,
                defaults: $crate::replay::settings::defaults::<$module::$method>,
                build: |given| {
                    let method = $crate::replay::settings::parse_checked::<$module::$method>(
                        given,
                        |method| $axis::check(method),
                    )?;
                    Ok(Box::new(method))
                },
            }, )+
        ];
    };
}

/// A setting whose values are a fixed set of names (a timing, an order, a layout): every value,
/// spelled as its serde form spells it, for flags, listings and errors.
pub trait Choices: serde::Serialize + Copy + 'static {
    /// Every value, in listing order.
    const ALL: &'static [Self];
}

/// The names of `T`'s values, in listing order.
pub fn choice_names<T: Choices>() -> Vec<String> {
    T::ALL.iter().map(|value| choice_name(*value)).collect()
}

/// The name of one value of a [`Choices`] setting.
pub fn choice_name<T: Choices>(value: T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => name,
        other => panic!("a choice serialises to its name, not {other:?}"),
    }
}

/// A registered method of any axis, as listings and flags see it.
#[derive(Clone, Copy)]
pub struct Described {
    /// The axis: `allocator`, `scorer` or `head split`.
    pub axis: &'static str,
    /// The registry key.
    pub name: &'static str,
    /// What it does and its source.
    pub about: &'static str,
    /// Its parameters.
    pub params: &'static [Param],
    /// Its defaults.
    pub defaults: fn() -> Map<String, Value>,
}

impl Described {
    /// Whether it declares `key`.
    pub fn takes(&self, key: &str) -> bool {
        self.params.iter().any(|param| param.key == key)
    }

    /// The config key of its axis, which qualifies its settings (`heads.threshold`): the axis,
    /// but `heads` for a head split.
    pub fn axis_key(&self) -> &'static str {
        match self.axis {
            "head split" => "heads",
            axis => axis,
        }
    }

    /// `axis `name``, for messages.
    pub fn label(&self) -> String {
        format!("{} `{}`", self.axis, self.name)
    }
}

/// The methods of `registry`, described, on `axis`.
pub fn describe<T: ?Sized>(axis: &'static str, registry: &[Method<T>]) -> Vec<Described> {
    registry
        .iter()
        .map(|method| Described {
            axis,
            name: method.name,
            about: method.about,
            params: method.params,
            defaults: method.defaults,
        })
        .collect()
}

/// The method of `registry` called `name`.
pub fn find<'r, T: ?Sized>(registry: &'r [Method<T>], name: &str) -> Option<&'r Method<T>> {
    registry.iter().find(|method| method.name == name)
}

/// The names of `registry`, comma-separated.
pub fn names<T: ?Sized>(registry: &[Method<T>]) -> String {
    let names: Vec<&str> = registry.iter().map(|method| method.name).collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::settings! {
        /// A test method.
        pub struct Toy = "toy" {
            /// A count.
            count: usize = 3,
            /// A weight.
            weight: f64 = 0.5,
        }
    }

    #[test]
    fn defaults_docs_and_parsing_follow_the_declaration() {
        assert_eq!(Toy::NAME, "toy");
        assert_eq!(Toy::PARAMS[0].key, "count");
        assert_eq!(Toy::PARAMS[1].doc.trim(), "A weight.");
        let defaults = defaults::<Toy>();
        assert_eq!(defaults["count"], Value::from(3));
        let mut given = Map::new();
        given.insert("weight".into(), Value::from(2));
        given.insert("not-mine".into(), Value::from("x"));
        let toy = parse::<Toy>(&given).unwrap();
        assert_eq!(
            toy,
            Toy {
                count: 3,
                weight: 2.0
            }
        );
        given.insert("count".into(), Value::from("many"));
        let err = parse::<Toy>(&given).unwrap_err();
        assert_eq!(err.key, "count");
        assert_eq!(err.value, "many");
        assert!(err.rule.starts_with("expected usize"), "{}", err.rule);
    }

    #[test]
    fn flags_read_as_numbers_where_they_can() {
        assert_eq!(from_flag("7"), Value::from(7u64));
        assert_eq!(from_flag("-1"), Value::from(-1i64));
        assert_eq!(from_flag("2.5"), Value::from(2.5));
        assert_eq!(from_flag("max"), Value::from("max"));
        assert_eq!(from_flag("inf"), Value::from("inf"));
        assert_eq!(from_flag("false"), Value::from(false));
        assert_eq!(from_flag("true"), Value::from(true));
    }
}
