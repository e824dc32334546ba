//! Subcommands. Each file holds `pub struct Args` (`#[derive(clap::Args)]`) and
//! `pub async fn run(args: Args) -> anyhow::Result<()>`.
//!
//! Shared pieces: [`ConfigArgs`] (`--config FILE`, `--set k=v`), [`load_config`] (which returns
//! [`ConfigErrors`] so the process exits 2), [`UsageError`] (exit 2) and [`report_error`].

pub mod bench;
#[cfg(feature = "bench-engine")]
pub mod bench_engine;
pub mod bench_transfer;
pub mod certs;
pub mod check_config;
pub mod drain;
pub mod generate;
pub mod nodes;
pub mod sglang_register;
pub mod sglang_router;
pub mod start;
pub mod version;

use pdnode_core::config::{self, ConfigError, Loaded};
use std::fmt;
use std::path::PathBuf;

/// `--config FILE [--set key=value]...`, shared by every command that reads a config.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArgs {
    /// TOML config file (see configs/ and docs/configuration.md). Without it: built-in defaults.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one key with a TOML value, applied after the file and PDNODE_* variables;
    /// repeatable. Example: --set engine.backend=cpu --set 'engine.gpus=[0,1]'
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

/// Loads and validates the layered config (defaults, file, `PDNODE_*` env, `--set`), and the
/// node plane's TLS files beyond what validation reads (they chain to the CA, the key is the
/// certificate's, the certificate names this node).
pub fn load_config(args: &ConfigArgs) -> Result<Loaded, ConfigErrors> {
    let loaded = config::load(args.config.as_deref(), &args.sets).map_err(ConfigErrors)?;
    use pdnode_nodeapi::tls::{NodeTls, TlsError};
    if let Err(e) = NodeTls::from_config(&loaded.config) {
        // Every error of loading the node's own files names a key.
        let key = e.key().unwrap_or("security.tls_cert");
        let source_name = loaded.origin_of(key);
        let key = key.to_string();
        return Err(ConfigErrors(vec![match e {
            TlsError::Pem { error, .. } => ConfigError::BadFile {
                source_name,
                key,
                error,
            },
            TlsError::Config { reason, .. } => ConfigError::Invalid {
                source_name,
                key,
                reason,
            },
            TlsError::WrongIdentity {
                path,
                issued_for,
                this_node,
            } => ConfigError::Invalid {
                source_name,
                key,
                reason: pdnode_nodeapi::tls::wrong_identity(&path, &issued_for, &this_node),
            },
            e => ConfigError::Invalid {
                source_name,
                key,
                reason: e.to_string(),
            },
        }]));
    }
    Ok(loaded)
}

/// Every error found in a configuration; the process exits 2.
#[derive(Debug)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "invalid configuration ({n} error{}):",
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.0 {
            write!(f, "\n  - {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A usage error clap cannot see (e.g. two options that exclude each other by value); exits 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A command that exists in the CLI but whose implementation has not landed yet; exits 1.
#[allow(dead_code)] // every command has landed (generate was the last); kept for new stubs
pub fn not_available(command: &str, missing: &str) -> anyhow::Error {
    anyhow::anyhow!("`pdnode {command}` is not available yet: {missing}")
}

/// Prints an error (with its causes) to stderr and returns the exit code: 2 for configuration
/// and usage errors, 1 for everything else.
pub fn report_error(e: &anyhow::Error) -> u8 {
    let usage = e
        .chain()
        .any(|c| c.is::<ConfigErrors>() || c.is::<UsageError>());
    eprintln!("error: {e}");
    for cause in e.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
    if usage { 2 } else { 1 }
}
