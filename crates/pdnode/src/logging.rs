//! Tracing to stderr: env-filter directives from `log.filter` (`RUST_LOG` overrides), human or
//! JSON lines per `log.format`; and, with `[telemetry]`, OpenTelemetry spans exported over OTLP
//! (pdnode-telemetry). The filter applies to the log lines only: the exporter takes pdnode's
//! `info` spans whatever `log.filter` says.

use pdnode_core::config::{Config, LogConfig, LogFormat};
use pdnode_telemetry::Telemetry;
use pdnode_telemetry::export::ServiceInfo;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// Installs the global subscriber. A second call is a no-op (the first one wins), so commands
/// may call it after loading their config without caring who ran first.
pub fn init(cfg: &LogConfig) -> anyhow::Result<()> {
    install(cfg, None)
}

/// [`init`] plus the span exporter `[telemetry]` asks for (none when it is off). The caller
/// keeps the returned exporter and calls [`shutdown_telemetry`] before exiting.
pub fn init_node(cfg: &Config) -> anyhow::Result<Option<Telemetry>> {
    let who = ServiceInfo {
        node_id: pdnode_node::node_id(cfg).to_string(),
        cluster: cfg.node.cluster.clone(),
        role: cfg.node.role.to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let telemetry = Telemetry::start(&cfg.telemetry, &who)
        .map_err(|e| super::cmd::UsageError(e.to_string()))?;
    install(&cfg.log, telemetry.as_ref())?;
    if telemetry.is_some() {
        tracing::info!(
            endpoint = %cfg.telemetry.endpoint,
            sampling_ratio = cfg.telemetry.sampling_ratio,
            "exporting traces over OTLP"
        );
    }
    Ok(telemetry)
}

/// Exports the spans still batched (a clean stop loses none).
pub async fn shutdown_telemetry(t: Option<Telemetry>) {
    let Some(t) = t else { return };
    match tokio::task::spawn_blocking(move || t.shutdown()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "traces not flushed"),
        Err(e) => tracing::warn!(error = %e, "traces not flushed"),
    }
}

fn install(cfg: &LogConfig, telemetry: Option<&Telemetry>) -> anyhow::Result<()> {
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
    // Colour only on a terminal: a log file or a journal gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    // Span fields (request_id, trace_id of the per-request spans) show in both formats: as
    // `span{request_id=.. trace_id=..}:` prefixes, or as the JSON `span` and `spans` objects.
    let lines: Box<dyn Layer<Registry> + Send + Sync> = match cfg.format {
        LogFormat::Human => fmt.with_filter(filter).boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).with_filter(filter).boxed(),
    };
    let mut layers = vec![lines];
    layers.extend(telemetry.map(|t| t.layer::<Registry>()));
    // try_init fails only when a subscriber is already installed: keep that one.
    let _ = tracing_subscriber::registry().with(layers).try_init();
    Ok(())
}

/// Logging for commands without a config file.
pub fn init_default() -> anyhow::Result<()> {
    init(&LogConfig::default())
}
