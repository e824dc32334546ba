//! Layered loading: defaults -> file -> environment -> `--set`, with the origin of every key kept
//! so errors can say which file, variable or argument set it.

use super::schema::Config;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use toml::Value;

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigSource {
    Default,
    File(PathBuf),
    Env(String),
    Set(String),
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigSource::Default => f.write_str("built-in defaults"),
            ConfigSource::File(p) => write!(f, "{}", p.display()),
            ConfigSource::Env(v) => write!(f, "environment variable {v}"),
            ConfigSource::Set(a) => write!(f, "--set {a}"),
        }
    }
}

/// Everything that can be wrong with a configuration. Each variant names the key (dotted path)
/// and the source; `Display` says what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{source_name}: cannot read: {reason}")]
    Io {
        source_name: ConfigSource,
        reason: String,
    },
    #[error("{source_name}: not valid TOML: {reason}")]
    Syntax {
        source_name: ConfigSource,
        reason: String,
    },
    #[error("{source_name}: unknown key `{key}`{}", expected_list(.expected))]
    UnknownKey {
        source_name: ConfigSource,
        key: String,
        expected: Vec<String>,
    },
    #[error("{source_name}: key `{key}`: {reason}")]
    WrongType {
        source_name: ConfigSource,
        key: String,
        reason: String,
    },
    #[error("{source_name}: key `{key}`: {reason}")]
    Invalid {
        source_name: ConfigSource,
        key: String,
        reason: String,
    },
    /// A file the key names (a certificate, a key, a password) is missing or not what it must
    /// hold.
    #[error("{source_name}: key `{key}`: {error}")]
    BadFile {
        source_name: ConfigSource,
        key: String,
        error: super::pem::FileError,
    },
    #[error("--set {arg:?}: {reason}")]
    BadSet { arg: String, reason: String },
    /// One source brought more bad keys than are reported; the rest of it was not checked.
    #[error("{source_name}: more than {max} bad keys; the rest of it was not checked")]
    TooManyBadKeys {
        source_name: ConfigSource,
        max: usize,
    },
}

fn expected_list(e: &[String]) -> String {
    if e.is_empty() {
        String::new()
    } else {
        format!(" (expected one of: {})", e.join(", "))
    }
}

impl ConfigError {
    /// The dotted key this error is about, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. }
            | ConfigError::WrongType { key, .. }
            | ConfigError::Invalid { key, .. }
            | ConfigError::BadFile { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// A loaded, validated configuration with the origin of every key that was set.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub origins: BTreeMap<String, ConfigSource>,
    pub file: Option<PathBuf>,
}

impl Loaded {
    /// The effective configuration as TOML.
    pub fn effective_toml(&self) -> String {
        toml::to_string_pretty(&self.config).unwrap_or_else(|e| format!("# unprintable: {e}\n"))
    }

    pub fn origin_of(&self, key: &str) -> ConfigSource {
        origin_of(&self.origins, key)
    }
}

fn origin_of(origins: &BTreeMap<String, ConfigSource>, key: &str) -> ConfigSource {
    // The most specific recorded origin: the key itself or its closest parent.
    let mut k = key;
    loop {
        if let Some(s) = origins.get(k) {
            return s.clone();
        }
        match k.rfind('.') {
            Some(i) => k = &k[..i],
            None => return ConfigSource::Default,
        }
    }
}

/// The largest config file read (the reference configs are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Bad keys reported from one layer before the rest of it is left unchecked: each one costs a
/// check of the whole layer.
pub const MAX_KEY_ERRORS: usize = 32;

/// Loads from a file (or none), the process environment and `--set` arguments, then validates.
/// Returns every error found.
pub fn load(file: Option<&Path>, sets: &[String]) -> Result<Loaded, Vec<ConfigError>> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    let text = match file {
        Some(p) => {
            let io = |reason: String| {
                vec![ConfigError::Io {
                    source_name: ConfigSource::File(p.to_path_buf()),
                    reason,
                }]
            };
            let bytes = super::pem::read_limited(&p.to_string_lossy(), MAX_CONFIG_BYTES)
                .map_err(|e| io(e.to_string()))?;
            let text = String::from_utf8(bytes).map_err(|_| io("not UTF-8 text".into()))?;
            Some((p.to_path_buf(), text))
        }
        None => None,
    };
    load_layers(
        text.as_ref().map(|(p, t)| (p.as_path(), t.as_str())),
        &env,
        sets,
    )
}

/// Loads from TOML text (as if read from `name`), with no environment; for tests and embedding.
pub fn load_from_str(name: &str, text: &str, sets: &[String]) -> Result<Loaded, Vec<ConfigError>> {
    load_layers(Some((Path::new(name), text)), &[], sets)
}

/// Like [`load_from_str`], with `PDNODE_*` variables taken from `env` instead of the process
/// environment (pairs of name and value; other names are ignored). For tests and embedding.
pub fn load_from_str_with_env(
    name: &str,
    text: &str,
    env: &[(String, String)],
    sets: &[String],
) -> Result<Loaded, Vec<ConfigError>> {
    load_layers(Some((Path::new(name), text)), env, sets)
}

pub(crate) fn load_layers(
    file: Option<(&Path, &str)>,
    env: &[(String, String)],
    sets: &[String],
) -> Result<Loaded, Vec<ConfigError>> {
    let mut merged = Value::try_from(Config::default()).expect("defaults serialize");
    let mut origins = BTreeMap::new();
    let mut errors = Vec::new();

    if let Some((path, text)) = file {
        let src = ConfigSource::File(path.to_path_buf());
        match text.parse::<toml::Table>() {
            Ok(t) => apply_layer(
                &mut merged,
                &mut origins,
                Value::Table(t),
                &src,
                &mut errors,
            ),
            Err(e) => errors.push(ConfigError::Syntax {
                source_name: src,
                reason: e.to_string(),
            }),
        }
    }

    for (name, raw) in env {
        let Some(rest) = name.strip_prefix("PDNODE_") else {
            continue;
        };
        if !rest.contains("__") {
            continue; // not a config key (e.g. PDNODE_LOG): left to whoever reads it
        }
        let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
        let src = ConfigSource::Env(name.clone());
        let layer = nested(&path, parse_value(raw));
        apply_layer(&mut merged, &mut origins, layer, &src, &mut errors);
    }

    for arg in sets {
        let Some((k, v)) = arg.split_once('=') else {
            errors.push(ConfigError::BadSet {
                arg: arg.clone(),
                reason: "expected key=value, e.g. --set engine.backend=cpu".into(),
            });
            continue;
        };
        let k = k.trim();
        if k.is_empty() || k.split('.').any(|s| s.is_empty()) {
            errors.push(ConfigError::BadSet {
                arg: arg.clone(),
                reason: "the key must be a dotted path such as engine.gpus".into(),
            });
            continue;
        }
        let path: Vec<String> = k.split('.').map(str::to_string).collect();
        let src = ConfigSource::Set(arg.clone());
        apply_layer(
            &mut merged,
            &mut origins,
            nested(&path, parse_value(v.trim())),
            &src,
            &mut errors,
        );
    }

    // A file that is not TOML at all: validating the rest would blame the defaults.
    if errors
        .iter()
        .any(|e| matches!(e, ConfigError::Syntax { .. }))
    {
        return Err(errors);
    }
    // Bad keys were dropped from their layers, so this normally succeeds; validation then
    // reports what is wrong with the rest, and the caller sees every error at once.
    let config = match deserialize(merged) {
        Ok(c) => c,
        Err((key, reason, expected)) => {
            let source_name = origin_of(&origins, &key);
            errors.push(if let Some(expected) = expected {
                ConfigError::UnknownKey {
                    source_name,
                    key,
                    expected,
                }
            } else {
                ConfigError::WrongType {
                    source_name,
                    key,
                    reason,
                }
            });
            return Err(errors);
        }
    };
    let loaded = Loaded {
        config,
        origins,
        file: file.map(|(p, _)| p.to_path_buf()),
    };
    // A key nobody set is blamed on the file being loaded (where the user fixes it, e.g. a
    // role that needs registry.kind = "etcd"), not on the built-in defaults.
    let blame = |k: &str| match loaded.origin_of(k) {
        ConfigSource::Default => loaded
            .file
            .clone()
            .map_or(ConfigSource::Default, ConfigSource::File),
        s => s,
    };
    errors.extend(super::validate::validate(&loaded.config, &blame));
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(errors)
    }
}

/// Parses a value as TOML (`4`, `true`, `[0,1]`, `"x"`, `{a=1}`); anything else is a string.
fn parse_value(raw: &str) -> Value {
    let doc = format!("v = {raw}");
    match doc.parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| Value::String(raw.to_string())),
        Err(_) => Value::String(raw.to_string()),
    }
}

fn nested(path: &[String], v: Value) -> Value {
    path.iter().rev().fold(v, |acc, k| {
        let mut t = toml::Table::new();
        t.insert(k.clone(), acc);
        Value::Table(t)
    })
}

/// Deep-merges `layer` into `base`, first checking the layer against the schema so that an
/// unknown key or a wrong type is blamed on the layer that brought it. A bad key is reported and
/// dropped from the layer, and the check repeats, so one run reports every bad key and the rest
/// of the layer still counts (and is validated).
fn apply_layer(
    base: &mut Value,
    origins: &mut BTreeMap<String, ConfigSource>,
    mut layer: Value,
    src: &ConfigSource,
    errors: &mut Vec<ConfigError>,
) {
    // Each round removes one key, so this ends; the bound guards against a key that cannot be
    // removed (an error that is not about a key of this layer).
    for round in 0..=count_keys(&layer) {
        if round == MAX_KEY_ERRORS {
            errors.push(ConfigError::TooManyBadKeys {
                source_name: src.clone(),
                max: MAX_KEY_ERRORS,
            });
            return;
        }
        let mut trial = base.clone();
        merge(&mut trial, layer.clone(), "", &mut BTreeMap::new(), src);
        let Err((key, reason, expected)) = deserialize(trial) else {
            merge(base, layer, "", origins, src);
            return;
        };
        errors.push(match expected {
            Some(expected) => ConfigError::UnknownKey {
                source_name: src.clone(),
                key: key.clone(),
                expected,
            },
            None => ConfigError::WrongType {
                source_name: src.clone(),
                key: key.clone(),
                reason,
            },
        });
        if !remove_key(&mut layer, &key) {
            return;
        }
    }
}

fn count_keys(v: &Value) -> usize {
    match v {
        Value::Table(t) => t.values().map(|v| 1 + count_keys(v)).sum(),
        _ => 0,
    }
}

/// Removes a dotted key (`engine.gpus`, `engine.gpus[1]` removes `engine.gpus`) from a table.
fn remove_key(v: &mut Value, key: &str) -> bool {
    let key = key.split('[').next().unwrap_or(key);
    let mut parts: Vec<&str> = key.split('.').filter(|s| !s.is_empty()).collect();
    let Some(last) = parts.pop() else {
        return false;
    };
    let mut cur = v;
    for p in parts {
        match cur {
            Value::Table(t) => match t.get_mut(p) {
                Some(next) => cur = next,
                None => return false,
            },
            _ => return false,
        }
    }
    match cur {
        Value::Table(t) => t.remove(last).is_some(),
        _ => false,
    }
}

fn merge(
    base: &mut Value,
    layer: Value,
    prefix: &str,
    origins: &mut BTreeMap<String, ConfigSource>,
    src: &ConfigSource,
) {
    match (base, layer) {
        (Value::Table(b), Value::Table(l)) => {
            for (k, v) in l {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                match b.get_mut(&k) {
                    Some(existing @ Value::Table(_)) if v.is_table() => {
                        merge(existing, v, &key, origins, src)
                    }
                    _ => {
                        origins.insert(key, src.clone());
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, l) => {
            origins.insert(prefix.to_string(), src.clone());
            *b = l;
        }
    }
}

type DeError = (String, String, Option<Vec<String>>);

fn deserialize(v: Value) -> Result<Config, DeError> {
    serde_path_to_error::deserialize::<_, Config>(v).map_err(|e| {
        let path = e.path().to_string();
        let full = e.inner().to_string();
        // toml appends "\nin `section`"; the key is already named separately.
        let msg = full.lines().next().unwrap_or("").trim().to_string();
        if let Some(rest) = msg.strip_prefix("unknown field `") {
            let field = rest.split('`').next().unwrap_or("").to_string();
            let key = if path == "." || path.is_empty() {
                field
            } else if path.ends_with(&field) {
                path
            } else {
                format!("{path}.{field}")
            };
            let expected = msg
                .split("expected ")
                .nth(1)
                .map(|s| {
                    // serde: "`a`", "`a` or `b`", "one of `a`, `b`, `c`"
                    s.split(", ")
                        .flat_map(|x| x.split(" or "))
                        .map(|x| {
                            x.trim_start_matches("one of ")
                                .trim_matches(|c| c == '`' || c == ' ')
                                .to_string()
                        })
                        .collect()
                })
                .unwrap_or_default();
            (key, msg, Some(expected))
        } else {
            (path, msg, None)
        }
    })
}
