//! Helpers of the configuration tests (`config.rs`, `config_security.rs`).

use pdnode_core::config::{ConfigError, load_from_str};

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
