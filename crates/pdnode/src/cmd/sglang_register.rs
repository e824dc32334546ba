//! `pdnode sglang-register`: keeps one SGLang worker's card in the registry while the worker
//! answers `GET /health`, so that routers with `router.sglang.discover = true` route to it.
//! Run one beside each SGLang server; the card goes when the worker turns unhealthy
//! (`router.sglang.health_*` rules), when this process stops, or when its lease runs out.

use super::{ConfigArgs, UsageError, load_config};
use anyhow::Context;
use pdnode_core::Role;
use pdnode_core::config::{RegistryKind, worker_url_host};
use pdnode_sglang::discovery::{WorkerSpec, keep_registered};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// `prefill` or `decode`.
    #[arg(long)]
    pub role: String,
    /// The worker's HTTP server, `http://host:port`.
    #[arg(long)]
    pub url: String,
    /// Prefill workers: the port of their KV bootstrap server (sent to decode workers).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// The card's node id (default: `sglang-<role>-<host>-<port>`).
    #[arg(long)]
    pub id: Option<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// The worker this process registers, from the flags; usage errors name the flag.
pub fn spec(a: &Args, cluster: &str) -> Result<WorkerSpec, UsageError> {
    let role = match a.role.as_str() {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => {
            return Err(UsageError(format!(
                "--role {other:?}: expected prefill or decode"
            )));
        }
    };
    let url = a.url.trim_end_matches('/').to_string();
    let host = worker_url_host(&url)
        .ok_or_else(|| UsageError(format!("--url {:?}: expected http://host:port", a.url)))?;
    if role == Role::Decode && a.bootstrap_port.is_some() {
        return Err(UsageError(
            "--bootstrap-port: only prefill workers have a bootstrap server".into(),
        ));
    }
    let port = url.rsplit_once(':').map_or("80", |(_, p)| p);
    let id = a.id.clone().unwrap_or_else(|| {
        let host: String = host
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        format!("sglang-{role}-{host}-{port}")
    });
    if id.is_empty() || id.contains('/') || id.contains(char::is_whitespace) {
        return Err(UsageError(format!(
            "--id {id:?}: no slashes or spaces, not empty"
        )));
    }
    Ok(WorkerSpec {
        id,
        cluster: cluster.to_string(),
        role,
        url,
        bootstrap_port: a.bootstrap_port,
    })
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let loaded = load_config(&a.config)?;
    crate::logging::init(&loaded.config.log)?;
    let c = &loaded.config;
    if c.registry.kind != RegistryKind::Etcd {
        return Err(UsageError(
            "pdnode sglang-register needs the cluster's registry: set registry.kind = \"etcd\" and registry.endpoints".into(),
        )
        .into());
    }
    let spec = spec(&a, &c.node.cluster)?;
    let registry = pdnode_registry::from_config(&c.registry)
        .await
        .with_context(|| format!("cannot reach the registry at {:?}", c.registry.endpoints))?;
    tracing::info!(id = %spec.id, role = %spec.role, url = %spec.url, cluster = %spec.cluster, "registering the SGLang worker while it is healthy");
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(keep_registered(
        registry,
        spec,
        c.router.sglang.clone(),
        stop.clone(),
    ));
    super::sglang_router::shutdown_signal().await;
    stop.cancel();
    task.await
        .context("the registration task")?
        .context("removing the card")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(role: &str, url: &str, port: Option<u16>) -> Args {
        Args {
            role: role.into(),
            url: url.into(),
            bootstrap_port: port,
            id: None,
            config: ConfigArgs {
                config: None,
                sets: Vec::new(),
            },
        }
    }

    #[test]
    fn the_flags_make_a_spec_or_a_usage_error_naming_the_flag() {
        let s = spec(&args("prefill", "http://10.0.0.1:30000/", Some(8998)), "c").unwrap();
        assert_eq!(s.id, "sglang-prefill-10-0-0-1-30000");
        assert_eq!(s.url, "http://10.0.0.1:30000");
        assert_eq!((s.role, s.bootstrap_port), (Role::Prefill, Some(8998)));
        let bad = |a: Args, flag: &str| {
            let e = spec(&a, "c").unwrap_err();
            assert!(e.0.contains(flag), "{flag}: {}", e.0);
        };
        bad(args("router", "http://h:1", None), "--role");
        bad(args("decode", "h:1", None), "--url");
        bad(args("decode", "http://h:1", Some(1)), "--bootstrap-port");
        let mut a = args("decode", "http://h:1", None);
        a.id = Some("a/b".into());
        bad(a, "--id");
    }
}
