//! `pdnode sglang-router`: a drop-in for `python -m sglang_router.launch_router
//! --pd-disaggregation ...` (sglang-router 0.3.2). Its PD flags map onto `[router.sglang]` and
//! the router keys (see docs/sglang.md); the result is the same config `pdnode start` runs, so
//! `--config`/`--set` work too. A flag of sglang-router's that this router does not implement
//! is refused by name (clap's "unexpected argument"), never ignored.

use super::{ConfigArgs, UsageError, load_config};
use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Required: only sglang-router's PD mode is offered.
    #[arg(long)]
    pub pd_disaggregation: bool,
    /// Prefill worker URL and optional bootstrap port (a number, `none`, or omitted);
    /// repeatable.
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"])]
    pub prefill: Vec<String>,
    /// Decode worker URL; repeatable.
    #[arg(long, value_name = "URL")]
    pub decode: Vec<String>,
    /// Address to serve on (sglang-router's default: every interface).
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Policy of both sides unless --prefill-policy / --decode-policy say otherwise.
    #[arg(long, default_value = "cache_aware")]
    pub policy: String,
    #[arg(long)]
    pub prefill_policy: Option<String>,
    #[arg(long)]
    pub decode_policy: Option<String>,
    #[arg(long)]
    pub cache_threshold: Option<f32>,
    #[arg(long)]
    pub balance_abs_threshold: Option<u32>,
    #[arg(long)]
    pub balance_rel_threshold: Option<f32>,
    #[arg(long)]
    pub eviction_interval_secs: Option<u64>,
    #[arg(long)]
    pub max_tree_size: Option<u64>,
    /// `manual` policy: a routing key unused this long is forgotten, seconds.
    #[arg(long)]
    pub max_idle_secs: Option<u64>,
    /// `manual` policy: how a new routing key is placed (`random`, `min_load`, `min_group`).
    #[arg(long)]
    pub assignment_mode: Option<String>,
    /// Deadline of a whole request, seconds (sglang-router's default: 1800).
    #[arg(long, default_value_t = 1800)]
    pub request_timeout_secs: u64,
    #[arg(long)]
    pub max_payload_size: Option<u64>,
    #[arg(long)]
    pub prometheus_host: Option<String>,
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Sent to the workers as `Authorization: Bearer <key>`.
    #[arg(long)]
    pub api_key: Option<String>,
    #[arg(long)]
    pub retry_max_retries: Option<u32>,
    #[arg(long)]
    pub disable_retries: bool,
    #[arg(long)]
    pub cb_failure_threshold: Option<u32>,
    #[arg(long)]
    pub cb_timeout_duration_secs: Option<u64>,
    #[arg(long)]
    pub disable_circuit_breaker: bool,
    #[arg(long)]
    pub health_failure_threshold: Option<u32>,
    #[arg(long)]
    pub health_success_threshold: Option<u32>,
    #[arg(long)]
    pub health_check_timeout_secs: Option<u64>,
    #[arg(long)]
    pub health_check_interval_secs: Option<u64>,
    /// pdnode's own: also serve `pdnode.v1.Inference` (gRPC) on this port of --host (off when
    /// not given; sglang-router has no gRPC frontend).
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// Log filter (`debug`, `info`, `warn`, `error`).
    #[arg(long)]
    pub log_level: Option<String>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// A string as a TOML basic string (JSON's escapes are TOML's).
fn toml_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

fn policy(flag: &str, name: &str) -> Result<String, UsageError> {
    match name {
        "random" | "round_robin" | "cache_aware" | "power_of_two" | "bucket" | "manual" => {
            Ok(toml_str(name))
        }
        other => Err(UsageError(format!(
            "{flag} {other:?}: expected random, round_robin, cache_aware, power_of_two, bucket or manual"
        ))),
    }
}

/// The `--set` overrides the flags stand for (applied before the user's own `--set`s).
pub fn overrides(a: &Args) -> Result<Vec<String>, UsageError> {
    if !a.pd_disaggregation {
        return Err(UsageError(
            "pdnode sglang-router serves sglang-router's PD mode only: pass --pd-disaggregation"
                .into(),
        ));
    }
    if a.prefill.is_empty() || a.decode.is_empty() {
        return Err(UsageError(
            "give at least one --prefill URL [BOOTSTRAP_PORT] and one --decode URL".into(),
        ));
    }
    let mut sets = vec![
        "node.role=\"router\"".to_string(),
        "registry.kind=\"memory\"".to_string(),
    ];
    let host = if a.host.contains(':') && !a.host.starts_with('[') {
        format!("[{}]", a.host)
    } else {
        a.host.clone()
    };
    sets.push(format!(
        "router.http_listen={}",
        toml_str(&format!("{host}:{}", a.port))
    ));
    let grpc = a
        .grpc_port
        .map(|p| format!("{host}:{p}"))
        .unwrap_or_default();
    sets.push(format!("router.grpc_listen={}", toml_str(&grpc)));
    // clap flattens the occurrences: a URL starts a worker, a value after it is its port.
    let mut groups: Vec<Vec<&str>> = Vec::new();
    for v in &a.prefill {
        let is_url = v.starts_with("http://") || v.starts_with("https://");
        if is_url {
            groups.push(vec![v]);
            continue;
        }
        match groups.last_mut() {
            Some(g) if g.len() == 1 => g.push(v),
            _ => {
                return Err(UsageError(format!(
                    "--prefill {v}: expected a worker URL (http://host:port) before it"
                )));
            }
        }
    }
    let mut prefill = Vec::new();
    for p in &groups {
        let url = p[0];
        let port = match p.get(1).copied() {
            None | Some("none") | Some("None") => "".to_string(),
            Some(n) => {
                let n: u16 = n.parse().map_err(|_| {
                    UsageError(format!(
                        "--prefill {url} {n}: the bootstrap port must be a port number or none"
                    ))
                })?;
                format!(", bootstrap_port = {n}")
            }
        };
        prefill.push(format!("{{ url = {}{port} }}", toml_str(url)));
    }
    sets.push(format!("router.sglang.prefill=[{}]", prefill.join(", ")));
    let decode: Vec<String> = a
        .decode
        .iter()
        .map(|u| format!("{{ url = {} }}", toml_str(u)))
        .collect();
    sets.push(format!("router.sglang.decode=[{}]", decode.join(", ")));
    let pp = a.prefill_policy.as_deref().unwrap_or(&a.policy);
    let dp = a.decode_policy.as_deref().unwrap_or(&a.policy);
    sets.push(format!(
        "router.prefill_policy={}",
        policy("--prefill-policy", pp)?
    ));
    if dp == "bucket" {
        return Err(UsageError(
            "--decode-policy bucket: bucket is a prefill policy".into(),
        ));
    }
    sets.push(format!(
        "router.decode_policy={}",
        policy("--decode-policy", dp)?
    ));
    let mut num = |key: &str, v: Option<String>| {
        if let Some(v) = v {
            sets.push(format!("{key}={v}"));
        }
    };
    num(
        "router.cache_aware.cache_threshold",
        a.cache_threshold.map(|v| v.to_string()),
    );
    num(
        "router.cache_aware.balance_abs_threshold",
        a.balance_abs_threshold.map(|v| v.to_string()),
    );
    num(
        "router.cache_aware.balance_rel_threshold",
        a.balance_rel_threshold.map(|v| v.to_string()),
    );
    num(
        "router.cache_aware.eviction_interval_secs",
        a.eviction_interval_secs.map(|v| v.to_string()),
    );
    num(
        "router.cache_aware.max_tree_size",
        a.max_tree_size.map(|v| v.to_string()),
    );
    num(
        "router.manual.max_idle_secs",
        a.max_idle_secs.map(|v| v.to_string()),
    );
    let mode = match a.assignment_mode.as_deref() {
        None => None,
        Some(m @ ("random" | "min_load" | "min_group")) => Some(toml_str(m)),
        Some(m) => {
            return Err(UsageError(format!(
                "--assignment-mode {m:?}: expected random, min_load or min_group"
            )));
        }
    };
    num("router.manual.assignment_mode", mode);
    num(
        "router.request_timeout_s",
        Some(a.request_timeout_secs.to_string()),
    );
    num(
        "router.sglang.max_payload_bytes",
        a.max_payload_size.map(|v| v.to_string()),
    );
    num(
        "router.sglang.worker_api_key",
        a.api_key.as_deref().map(toml_str),
    );
    let retries = if a.disable_retries {
        Some(0)
    } else {
        a.retry_max_retries
    };
    num("router.sglang.max_retries", retries.map(|v| v.to_string()));
    let cb = if a.disable_circuit_breaker {
        Some(u32::MAX)
    } else {
        a.cb_failure_threshold
    };
    num(
        "router.sglang.breaker_failure_threshold",
        cb.map(|v| v.to_string()),
    );
    num(
        "router.sglang.breaker_timeout_s",
        a.cb_timeout_duration_secs.map(|v| v.to_string()),
    );
    num(
        "router.sglang.health_failure_threshold",
        a.health_failure_threshold.map(|v| v.to_string()),
    );
    num(
        "router.sglang.health_success_threshold",
        a.health_success_threshold.map(|v| v.to_string()),
    );
    num(
        "router.sglang.health_check_timeout_s",
        a.health_check_timeout_secs.map(|v| v.to_string()),
    );
    num(
        "router.sglang.health_check_interval_s",
        a.health_check_interval_secs.map(|v| v.to_string()),
    );
    num("log.filter", a.log_level.as_deref().map(toml_str));
    match (&a.prometheus_host, a.prometheus_port) {
        (None, None) => {}
        (h, p) => {
            let h = h.as_deref().unwrap_or("0.0.0.0");
            let h = if h.contains(':') && !h.starts_with('[') {
                format!("[{h}]")
            } else {
                h.to_string()
            };
            let addr = format!("{h}:{}", p.unwrap_or(29000));
            sets.push(format!(
                "router.sglang.prometheus_listen={}",
                toml_str(&addr)
            ));
        }
    }
    Ok(sets)
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let mut sets = overrides(&a)?;
    sets.extend(a.config.sets.iter().cloned());
    let cfg_args = ConfigArgs {
        config: a.config.config.clone(),
        sets,
    };
    let loaded = load_config(&cfg_args)?;
    let telemetry = crate::logging::init_node(&loaded.config)?;
    tracing::info!("effective configuration:\n{}", loaded.effective_toml());
    let result = serve(&loaded.config).await;
    crate::logging::shutdown_telemetry(telemetry).await;
    result
}

/// Serves the router in front of SGLang workers (`pdnode start` with `[router.sglang]`, and
/// `pdnode sglang-router`) until SIGTERM/SIGINT, then drains.
pub async fn serve(c: &pdnode_core::config::Config) -> anyhow::Result<()> {
    // `security.api_keys` and the lines of `security.api_keys_file`, as a pdnode router reads them
    let api_keys = pdnode_node::pd::api_keys(c)?;
    let router = pdnode_sglang::SglangRouter::new(&c.router, api_keys)?;
    let listener = tokio::net::TcpListener::bind(&c.router.http_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on router.http_listen {}",
                c.router.http_listen
            )
        })?;
    let addr = listener.local_addr()?;
    if addr.ip().is_unspecified() {
        tracing::warn!(%addr, "the SGLang router listens on every interface");
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    if !c.router.sglang.prometheus_listen.is_empty() {
        let l = tokio::net::TcpListener::bind(&c.router.sglang.prometheus_listen)
            .await
            .with_context(|| format!("cannot listen on {}", c.router.sglang.prometheus_listen))?;
        tracing::info!(addr = %l.local_addr()?, "metrics listener");
        tasks.spawn(pdnode_sglang::serve_metrics(
            l,
            router.clone(),
            stop.clone(),
        ));
    }
    if c.router.sglang.discover {
        let registry = pdnode_registry::from_config(&c.registry)
            .await
            .with_context(|| format!("cannot reach the registry at {:?}", c.registry.endpoints))?;
        let live = pdnode_registry::LiveMembership::start(registry.as_ref(), &c.node.cluster)
            .await
            .context("cannot list the cluster's SGLang workers")?;
        let (r, s) = (router.clone(), stop.clone());
        tasks.spawn(async move {
            pdnode_sglang::discovery::follow(r, live, s).await;
            Ok(())
        });
    }
    if !c.router.grpc_listen.is_empty() {
        let l = tokio::net::TcpListener::bind(&c.router.grpc_listen)
            .await
            .with_context(|| {
                format!(
                    "cannot listen on router.grpc_listen {}",
                    c.router.grpc_listen
                )
            })?;
        tracing::info!(addr = %l.local_addr()?, "pdnode.v1.Inference (gRPC) listener");
        tasks.spawn(pdnode_sglang::serve_grpc(l, router.clone(), stop.clone()));
    }
    tracing::info!(%addr, prefill = c.router.sglang.prefill.len(), decode = c.router.sglang.decode.len(), discover = c.router.sglang.discover, "SGLang router serving");
    tasks.spawn(pdnode_sglang::serve(listener, router.clone(), stop.clone()));
    let signal = shutdown_signal();
    tokio::select! {
        _ = signal => tracing::info!("shutting down"),
        r = tasks.join_next() => {
            if let Some(Ok(Err(e))) = r {
                return Err(e).context("the SGLang router stopped");
            }
        }
    }
    stop.cancel();
    // Requests in flight finish (each under its deadlines), bounded by the drain timeout. The
    // servers then get a second to close their connections: tonic's graceful shutdown waits for
    // every gRPC client connection to close, idle ones included, and a connected but idle
    // client must not hold the process until the drain deadline.
    let drain = std::time::Duration::from_secs(c.node.drain_timeout_s);
    let deadline = tokio::time::Instant::now() + drain;
    while router.inflight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let grace = deadline.min(tokio::time::Instant::now() + std::time::Duration::from_secs(1));
    let _ =
        tokio::time::timeout_at(grace, async { while tasks.join_next().await.is_some() {} }).await;
    tasks.abort_all();
    Ok(())
}

/// SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        a: Args,
    }

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        T::try_parse_from(std::iter::once("x").chain(argv.iter().copied())).map(|t| t.a)
    }

    fn config(argv: &[&str]) -> pdnode_core::config::Config {
        let sets = overrides(&parse(argv).unwrap()).unwrap();
        pdnode_core::config::load_from_str("flags", "", &sets)
            .unwrap_or_else(|e| panic!("{e:?}"))
            .config
    }

    #[test]
    fn the_reference_command_maps_onto_the_config() {
        let c = config(&[
            "--pd-disaggregation",
            "--prefill",
            "http://10.0.0.1:30000",
            "8998",
            "--prefill",
            "http://10.0.0.2:30000",
            "--decode",
            "http://10.0.0.3:30000",
            "--prefill-policy",
            "cache_aware",
            "--decode-policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            "8080",
            "--prometheus-port",
            "29001",
            "--api-key",
            "k",
            "--retry-max-retries",
            "2",
            "--cb-failure-threshold",
            "4",
            "--health-check-interval-secs",
            "10",
        ]);
        let r = &c.router;
        assert_eq!(c.node.role, pdnode_core::Role::Router);
        assert_eq!(r.http_listen, "127.0.0.1:8080");
        assert_eq!(r.sglang.prefill.len(), 2);
        assert_eq!(r.sglang.prefill[0].bootstrap_port, Some(8998));
        assert_eq!(r.sglang.prefill[1].bootstrap_port, None);
        assert_eq!(r.sglang.decode[0].url, "http://10.0.0.3:30000");
        assert_eq!(
            r.prefill_policy,
            pdnode_core::config::PolicyName::CacheAware
        );
        assert_eq!(r.decode_policy, pdnode_core::config::PolicyName::RoundRobin);
        assert_eq!(r.sglang.prometheus_listen, "0.0.0.0:29001");
        assert_eq!(r.sglang.worker_api_key, "k");
        assert_eq!(r.sglang.max_retries, 2);
        assert_eq!(r.sglang.breaker_failure_threshold, 4);
        assert_eq!(r.sglang.health_check_interval_s, 10);
        assert_eq!(r.request_timeout_s, 1800);
        // No gRPC frontend unless asked for (sglang-router has none).
        assert_eq!(r.grpc_listen, "");
        let c = config(&[
            "--pd-disaggregation",
            "--prefill",
            "http://10.0.0.1:30000",
            "--decode",
            "http://10.0.0.3:30000",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "50061",
        ]);
        assert_eq!(c.router.grpc_listen, "127.0.0.1:50061");
    }

    #[test]
    fn the_manual_policy_flags_map_onto_router_manual() {
        let c = config(&[
            "--pd-disaggregation",
            "--prefill",
            "http://a:1",
            "--decode",
            "http://b:1",
            "--policy",
            "manual",
            "--max-idle-secs",
            "120",
            "--assignment-mode",
            "min_group",
        ]);
        let r = &c.router;
        assert_eq!(r.prefill_policy, pdnode_core::config::PolicyName::Manual);
        assert_eq!(r.decode_policy, pdnode_core::config::PolicyName::Manual);
        assert_eq!(r.manual.max_idle_secs, 120);
        assert_eq!(
            r.manual.assignment_mode,
            pdnode_core::config::AssignmentMode::MinGroup
        );
    }

    #[test]
    fn unsupported_flags_are_refused_by_name() {
        for flag in [
            "--dp-aware",
            "--service-discovery",
            "--retry-jitter-factor",
            "--worker-urls",
        ] {
            let e = parse(&["--pd-disaggregation", flag]).unwrap_err();
            assert!(e.to_string().contains(flag), "{flag}: {e}");
        }
        let e = overrides(&parse(&["--prefill", "http://a:1", "--decode", "http://b:1"]).unwrap())
            .unwrap_err();
        assert!(e.0.contains("--pd-disaggregation"));
        let a = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://a:1",
            "--decode",
            "http://b:1",
            "--policy",
            "sticky",
        ])
        .unwrap();
        assert!(overrides(&a).unwrap_err().0.contains("sticky"));
        let a = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://a:1",
            "--decode",
            "http://b:1",
            "--assignment-mode",
            "fewest",
        ])
        .unwrap();
        assert!(overrides(&a).unwrap_err().0.contains("--assignment-mode"));
        let a = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://a:1",
            "x",
            "--decode",
            "http://b:1",
        ])
        .unwrap();
        assert!(overrides(&a).unwrap_err().0.contains("bootstrap port"));
        let a = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://a:1",
            "--decode",
            "http://b:1",
            "--disable-retries",
        ])
        .unwrap();
        let sets = overrides(&a).unwrap();
        assert!(
            sets.contains(&"router.sglang.max_retries=0".to_string()),
            "{sets:?}"
        );
    }

    #[test]
    fn bad_worker_urls_are_config_errors_naming_the_key() {
        let a = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "10.0.0.1:1",
            "--decode",
            "http://b:1",
        ]);
        assert!(overrides(&a.unwrap()).unwrap_err().0.contains("worker URL"));
        let a = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://10.0.0.1:30000/generate",
            "--decode",
            "http://b:1",
        ])
        .unwrap();
        let errs =
            pdnode_core::config::load_from_str("flags", "", &overrides(&a).unwrap()).unwrap_err();
        assert!(
            errs.iter()
                .any(|e| e.key() == Some("router.sglang.prefill")),
            "{errs:?}"
        );
    }
}
