//! SGLang workers found in the registry (`router.sglang.discover`): the router follows the
//! cluster's SGLang cards, which `pdnode sglang-register` keeps alive while a worker answers
//! `/health`; a worker joins when its card appears and leaves (requests on it finish) when the
//! card goes. [`keep_registered`] is that registration side.

use crate::router::SglangRouter;
use crate::server::spawn_probe;
use crate::worker::WorkerRole;
use pdnode_core::card::{NodeAddresses, NodeCapacity};
use pdnode_core::config::SglangConfig;
use pdnode_core::{NodeCard, NodeId, Role, SglangWorker};
use pdnode_registry::{LiveMembership, Registration, Registry, RegistryError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// Follows `live` until `stop`: every membership change re-derives the discovered workers.
pub async fn follow(router: Arc<SglangRouter>, live: LiveMembership, stop: CancellationToken) {
    let mut changes = live.changes();
    loop {
        for (role, wrole) in [
            (Role::Prefill, WorkerRole::Prefill),
            (Role::Decode, WorkerRole::Decode),
        ] {
            let found: Vec<(String, Option<u16>)> = live
                .sglang_workers(role)
                .into_iter()
                .filter_map(|c| c.sglang.map(|s| (s.url, s.bootstrap_port)))
                .collect();
            for w in router.set_discovered(wrole, &found) {
                tracing::info!(worker = %w.url, role = wrole.as_str(), "SGLang worker discovered");
                spawn_probe(&router, w, stop.clone());
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            r = changes.changed() => if r.is_err() { return },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// What `pdnode sglang-register` registers.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub id: String,
    pub cluster: String,
    pub role: Role,
    pub url: String,
    pub bootstrap_port: Option<u16>,
}

impl WorkerSpec {
    fn card(&self, model: String) -> NodeCard {
        let started_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        NodeCard {
            id: NodeId::new(self.id.clone()),
            role: self.role,
            cluster: self.cluster.clone(),
            model_id: model,
            model_fingerprint: String::new(),
            kv_layout: None,
            tp_size: 1,
            addresses: NodeAddresses::default(),
            capacity: NodeCapacity::default(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at_ms,
            colocated: false,
            sglang: Some(SglangWorker {
                url: self.url.clone(),
                bootstrap_port: self.bootstrap_port,
            }),
            draining: false,
        }
    }
}

/// Keeps `spec`'s card in `registry` while the worker is healthy (the router's probe rules:
/// `health_check_*`, `health_*_threshold`); deletes it when the worker turns unhealthy and at
/// `stop`. Returns only at `stop` (or with the registry's error on the way out).
pub async fn keep_registered(
    registry: Arc<dyn Registry>,
    spec: WorkerSpec,
    cfg: SglangConfig,
    stop: CancellationToken,
) -> Result<(), DiscoveryError> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(cfg.health_check_timeout_s))
        .build()
        .map_err(|e| DiscoveryError::Client(e.to_string()))?;
    let auth = |b: reqwest::RequestBuilder| {
        if cfg.worker_api_key.is_empty() {
            b
        } else {
            b.bearer_auth(&cfg.worker_api_key)
        }
    };
    let mut health =
        crate::worker::Health::new(cfg.health_failure_threshold, cfg.health_success_threshold);
    let mut reg: Option<Registration> = None;
    let interval = Duration::from_secs(cfg.health_check_interval_s);
    loop {
        let ok = auth(http.get(format!("{}/health", spec.url)))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        health.observe(ok);
        match (health.healthy(), reg.is_some()) {
            (true, false) => {
                let model = model_name(&http, &spec.url, &auth).await;
                match registry.register(spec.card(model)).await {
                    Ok(r) => {
                        tracing::info!(key = %r.key(), "SGLang worker registered");
                        reg = Some(r);
                    }
                    Err(e) => tracing::warn!("registering the SGLang worker failed: {e}"),
                }
            }
            (false, true) => {
                if let Some(r) = reg.take() {
                    tracing::warn!(key = %r.key(), "SGLang worker unhealthy; card removed");
                    if let Err(e) = r.shutdown().await {
                        tracing::warn!("removing the card: {e}");
                    }
                }
            }
            _ => {}
        }
        let wait = if health.healthy() {
            interval
        } else {
            interval.min(Duration::from_secs(1))
        };
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    match reg {
        Some(r) => Ok(r.shutdown().await?),
        None => Ok(()),
    }
}

async fn model_name(
    http: &reqwest::Client,
    url: &str,
    auth: &impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
) -> String {
    for path in ["/server_info", "/get_server_info"] {
        let Ok(r) = auth(http.get(format!("{url}{path}"))).send().await else {
            continue;
        };
        let Ok(v) = r.json::<serde_json::Value>().await else {
            continue;
        };
        let info = crate::worker::WorkerInfo {
            server_info: Some(v),
            model_info: None,
        };
        if let Some(m) = info.model_name() {
            return m;
        }
    }
    String::new()
}
