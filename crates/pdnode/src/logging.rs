//! Tracing to stderr: env-filter directives from `log.filter` (`RUST_LOG` overrides), human or
//! JSON lines per `log.format`.

use pdnode_core::config::{LogConfig, LogFormat};
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. A second call is a no-op (the first one wins), so commands
/// may call it after loading their config without caring who ran first.
pub fn init(cfg: &LogConfig) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v)
            .map_err(|e| anyhow::anyhow!("RUST_LOG={v:?} is not a valid filter: {e}"))?,
        _ => EnvFilter::try_new(&cfg.filter).map_err(|e| {
            super::cmd::UsageError(format!(
                "log.filter = {:?} is not a valid filter: {e}",
                cfg.filter
            ))
        })?,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // try_init fails only when a subscriber is already installed: keep that one.
    let _ = match cfg.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    Ok(())
}

/// Logging for commands without a config file.
pub fn init_default() -> anyhow::Result<()> {
    init(&LogConfig::default())
}
