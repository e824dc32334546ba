//! Helpers of the configuration tests (`config.rs`, `config_cuda.rs`, `config_security.rs`).

#![allow(dead_code)]

use pdnode_core::config::{ConfigError, ConfigSource, load_from_str};
use std::path::PathBuf;

/// The file name the tests' TOML text loads under.
pub const FILE: &str = "test.toml";

pub fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

/// The errors of loading `text` with `--set` values `set`; panics if it loads.
pub fn errors(text: &str, set: &[&str]) -> Vec<ConfigError> {
    match load_from_str(FILE, text, &sets(set)) {
        Ok(l) => panic!(
            "expected errors, got a valid config:\n{}",
            l.effective_toml()
        ),
        Err(e) => e,
    }
}

/// Environment variables as `load_from_str_with_env` takes them.
pub fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The source the tests' TOML text loads under.
pub fn file_src() -> ConfigSource {
    ConfigSource::File(PathBuf::from(FILE))
}
