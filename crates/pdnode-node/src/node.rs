//! One node process: bind, register, start the supervision tree and the servers; shut down
//! gracefully (revoke the lease first, stop admitting, drain, stop).

use crate::board::{HealthBoard, LoadBoard};
use crate::engine::{EngineActor, EngineActorArgs, EngineService};
use crate::registrar::{Registrar, RegistrarArgs, SharedRegistration};
use crate::supervisor::{NodeSupervisor, RestartLimits, SupervisorArgs, SupervisorHandle};
use crate::{NodeError, grpc, http};
use pdnode_core::card::{NodeAddresses, NodeCapacity};
use pdnode_core::config::Config;
use pdnode_core::{NodeCard, NodeId, Role};
use pdnode_registry::{Registry, register_waiting_out_stale};
use ractor::Actor;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Timings of the runtime (not in the config file: they follow from it or are internal).
#[derive(Debug, Clone, Copy)]
pub struct NodeOptions {
    pub limits: RestartLimits,
    /// How often the EngineActor reads the engine's load.
    pub load_refresh: Duration,
    /// How often the Registrar compares the load with the published card.
    pub card_refresh: Duration,
    /// Deadline of calls between the node's actors.
    pub call_timeout: Duration,
    /// An engine that reported its load once and then not for this long (its thread wedged:
    /// the EngineActor's load read never came back) makes `Stats` answer `UNAVAILABLE` and
    /// health `NOT_SERVING`. Well above the longest engine step.
    pub engine_stall: Duration,
}

impl NodeOptions {
    /// The defaults with `node.engine_stall_ms` applied; 0 (its default) picks 5 s, or 60 s
    /// when the engine runs on the CPU (`backend` is the engine's name): a CPU step of
    /// `engine.max_batch_tokens` prompt tokens takes seconds, and a step is not a wedge.
    pub fn from_config(cfg: &pdnode_core::config::Config, backend: &str) -> Self {
        let engine_stall = match cfg.node.engine_stall_ms {
            0 if backend == "cpu" => Duration::from_secs(60),
            0 => Self::default().engine_stall,
            ms => Duration::from_millis(ms),
        };
        Self {
            engine_stall,
            ..Self::default()
        }
    }
}

impl Default for NodeOptions {
    fn default() -> Self {
        Self {
            limits: RestartLimits::default(),
            load_refresh: Duration::from_millis(250),
            card_refresh: Duration::from_secs(1),
            call_timeout: Duration::from_secs(2),
            engine_stall: Duration::from_secs(5),
        }
    }
}

/// What a node runs on besides its config.
pub struct NodeDeps {
    pub registry: Arc<dyn Registry>,
    /// The engine for prefill/decode/all nodes; `None` for routers (and nodes whose engine is
    /// not wired).
    pub engine: Option<Arc<dyn EngineService>>,
    pub options: NodeOptions,
    /// The data path served by `pdnode.v1.Node` ReserveKv/Prefill/Decode/Abort (a
    /// [`crate::pd::PdNode`] on prefill and decode nodes); `None`: those answer UNIMPLEMENTED.
    pub pd: Option<Arc<dyn pdnode_nodeapi::NodeClient>>,
    /// The KV transport's UCX worker address (hex), published in the card.
    pub ucx_worker: Option<String>,
    /// Router frontends (OpenAI HTTP on `router.http_listen`, `pdnode.v1.Inference` gRPC on
    /// `router.grpc_listen`) for role = "router" | "all".
    pub router: Option<pdnode_router::RouterDeps>,
}

/// What a graceful shutdown did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownReport {
    /// The lease was revoked (the key vanished at once).
    pub deregistered: bool,
    /// In-flight requests left when the drain deadline passed (0: drained).
    pub in_flight_left: usize,
    pub elapsed_ms: u64,
}

/// A running node.
pub struct Node {
    card: NodeCard,
    drain_timeout: Duration,
    /// A decode node's data path, whose decodes move on a graceful shutdown with
    /// `node.drain = "migrate"` or a `Drain` asking to migrate.
    migrate_on_drain: Option<Arc<dyn pdnode_nodeapi::NodeClient>>,
    drain_mode: pdnode_core::config::DrainMode,
    supervisor: SupervisorHandle,
    supervisor_join: JoinHandle<()>,
    health: HealthBoard,
    registration: SharedRegistration,
    engine: Option<Arc<dyn EngineService>>,
    grpc_addr: SocketAddr,
    http_addr: Option<SocketAddr>,
    cancel: CancellationToken,
    servers: Vec<JoinHandle<()>>,
}

/// `node.id`, or `{role}-{hostname}-{pid}`.
pub fn node_id(cfg: &Config) -> NodeId {
    if !cfg.node.id.is_empty() {
        return NodeId::new(cfg.node.id.clone());
    }
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "host".into());
    let host: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    NodeId::new(format!("{}-{}-{}", cfg.node.role, host, std::process::id()))
}

/// The model name a node of this config serves.
pub fn served_model(cfg: &Config) -> String {
    let m = &cfg.model;
    if !m.served_name.is_empty() {
        return m.served_name.clone();
    }
    if !m.preset.is_empty() {
        return m.preset.clone();
    }
    std::path::Path::new(&m.path)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("")
        .to_string()
}

async fn bind(what: &'static str, addr: &str) -> Result<TcpListener, NodeError> {
    TcpListener::bind(addr).await.map_err(|e| NodeError::Bind {
        what,
        addr: addr.to_string(),
        reason: e.to_string(),
    })
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The role a node registers (its card, its registry key, what its node API reports): what its
/// node API serves. A role-`all` node serves the data path on its node API only when colocated
/// (one engine answers ReserveKv, Prefill and Decode); the in-process kind keeps its two engines
/// behind its own router, answers UNIMPLEMENTED to the data path, and so registers as a
/// `router`: no registry view ever offers it as a prefill or decode node.
pub fn served_role(cfg: &Config) -> Role {
    match cfg.node.role {
        Role::All if !cfg.engine.colocated => Role::Router,
        r => r,
    }
}

impl Node {
    /// Binds the listeners, registers the card (waiting out a crashed predecessor's lease for
    /// up to one TTL; a live duplicate id fails with `AlreadyRegistered`), starts the
    /// supervision tree and the servers.
    pub async fn start(cfg: &Config, deps: NodeDeps) -> Result<Node, NodeError> {
        let id = node_id(cfg);
        let tls = pdnode_nodeapi::tls::NodeTls::from_config(cfg)?;
        let insecure_node_plane = !cfg.node.listens_on_loopback() && tls.is_none();
        if insecure_node_plane {
            // Validation let it through only with security.allow_insecure.
            tracing::warn!(listen = %cfg.node.listen,
                "the node API is served beyond loopback in plaintext and without authentication (security.allow_insecure): anyone who reaches it can run, read or abort requests");
        }
        if let Some(t) = &tls {
            tracing::info!(identity = %t.identity().uri(), "node API over mutual TLS");
        }
        if cfg.security.trusted_kv_network {
            // Validation accepts the key only for a UCX KV plane beyond loopback.
            tracing::info!(devices = %cfg.transfer.ucx_net_devices,
                "KV plane (UCX) on a network the operator trusts (security.trusted_kv_network): UCX authenticates no peer, so only the cluster's nodes may reach these interfaces");
        }
        let role = cfg.node.role;
        let served = served_role(cfg);
        let grpc_l = bind("node.listen", &cfg.node.listen).await?;
        let grpc_addr = grpc_l.local_addr().map_err(|e| NodeError::Bind {
            what: "node.listen",
            addr: cfg.node.listen.clone(),
            reason: e.to_string(),
        })?;
        let serve_http = !cfg.node.http_listen.is_empty() && role != Role::Router;
        let http_l = if serve_http {
            Some(bind("node.http_listen", &cfg.node.http_listen).await?)
        } else {
            None
        };
        let http_addr = http_l.as_ref().and_then(|l| l.local_addr().ok());
        let advertise = if cfg.node.advertise.is_empty() {
            grpc_addr.to_string()
        } else {
            cfg.node.advertise.clone()
        };
        let desc = deps.engine.as_ref().map(|e| e.describe());
        let card = NodeCard {
            id: id.clone(),
            role: served,
            cluster: cfg.node.cluster.clone(),
            model_id: desc
                .as_ref()
                .map(|d| d.model_id.clone())
                .unwrap_or_else(|| served_model(cfg)),
            model_fingerprint: desc
                .as_ref()
                .map(|d| d.model_fingerprint.clone())
                .unwrap_or_default(),
            kv_layout: desc.as_ref().and_then(|d| d.kv_layout.clone()),
            tp_size: desc
                .as_ref()
                .map_or(cfg.engine.tensor_parallel, |d| d.tp_size),
            addresses: NodeAddresses {
                grpc: advertise,
                http: http_addr.map(|a| a.to_string()),
                ucx_worker: deps.ucx_worker.clone(),
            },
            capacity: NodeCapacity::default(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at_ms: now_ms(),
            colocated: served == Role::All,
            sglang: None,
            draining: false,
        };

        let ttl = Duration::from_secs(cfg.registry.lease_ttl_s);
        let registration =
            register_waiting_out_stale(&*deps.registry, card.clone(), ttl + Duration::from_secs(1))
                .await?;
        tracing::info!(key = %registration.key(), grpc = %card.addresses.grpc, "node registered");
        let keepalive_failures = registration.keepalive_failures_reader();
        let registration: SharedRegistration =
            Arc::new(tokio::sync::Mutex::new(Some(registration)));

        let health = HealthBoard::new();
        let load = LoadBoard::new(NodeCapacity::default());
        let o = deps.options;
        let sup = NodeSupervisor {
            limits: o.limits,
            registrar: Registrar {
                refresh: o.card_refresh,
            },
            engine: EngineActor {
                refresh: o.load_refresh,
            },
        };
        let args = SupervisorArgs {
            registrar: RegistrarArgs {
                registration: registration.clone(),
                load: load.clone(),
            },
            engine: deps.engine.clone().map(|engine| EngineActorArgs {
                engine,
                load: load.clone(),
            }),
            health: health.clone(),
        };
        let (sup_ref, supervisor_join) = match Actor::spawn(None, sup, args).await {
            Ok(x) => x,
            Err(e) => {
                if let Some(r) = registration.lock().await.take() {
                    let _ = r.shutdown().await;
                }
                return Err(NodeError::Spawn {
                    actor: "supervisor",
                    reason: e.to_string(),
                });
            }
        };
        let supervisor = SupervisorHandle::new(sup_ref, o.call_timeout);

        let cancel = CancellationToken::new();
        let mut servers = Vec::new();
        let svc = grpc::NodeGrpc {
            id: id.clone(),
            role: served,
            version: card.version.clone(),
            supervisor: supervisor.clone(),
            load: load.clone(),
            engine_stall: o.engine_stall,
            pd: deps.pd.clone(),
            tls,
            health: health.clone(),
            keepalive: (
                Duration::from_millis(cfg.router.node_keepalive_interval_ms),
                Duration::from_millis(cfg.router.node_keepalive_timeout_ms),
            ),
        };
        let c = cancel.clone();
        let h = health.clone();
        servers.push(tokio::spawn(async move {
            if let Err(e) = grpc::run(grpc_l, svc, c).await {
                tracing::error!(error = %e, "node gRPC server failed");
                h.set_failed(format!("node gRPC server failed: {e}"));
            }
        }));
        if let Some(l) = http_l {
            let deps = http::HttpDeps {
                id: id.clone(),
                role,
                insecure_node_plane,
                supervisor: supervisor.clone(),
                load: load.clone(),
                keepalive_failures,
            };
            let c = cancel.clone();
            let h = health.clone();
            servers.push(tokio::spawn(async move {
                if let Err(e) = http::run(l, deps, c).await {
                    tracing::error!(error = %e, "node HTTP server failed");
                    h.set_failed(format!("node HTTP server failed: {e}"));
                }
            }));
        }
        let mut router_http = None;
        if let Some(rdeps) = deps.router {
            let http_l = bind("router.http_listen", &cfg.router.http_listen).await?;
            router_http = http_l.local_addr().ok();
            let grpc_l = if cfg.router.grpc_listen.is_empty() {
                None
            } else {
                Some(bind("router.grpc_listen", &cfg.router.grpc_listen).await?)
            };
            let router = pdnode_router::Router::new(rdeps);
            let c = cancel.clone();
            let h = health.clone();
            servers.push(tokio::spawn(async move {
                if let Err(e) = pdnode_router::server::serve(router, http_l, grpc_l, c).await {
                    tracing::error!(error = %e, "router frontends failed");
                    h.set_failed(format!("router frontends failed: {e}"));
                }
            }));
        }
        tracing::info!(node = %id, %role, grpc = %grpc_addr, http = ?http_addr, router_http = ?router_http, "node started");
        let migrate_on_drain = (cfg.node.role == Role::Decode)
            .then(|| deps.pd.clone())
            .flatten();
        Ok(Node {
            card,
            drain_timeout: Duration::from_secs(cfg.node.drain_timeout_s),
            migrate_on_drain,
            drain_mode: cfg.node.drain,
            supervisor,
            supervisor_join,
            health,
            registration,
            engine: deps.engine,
            grpc_addr,
            http_addr,
            cancel,
            servers,
        })
    }

    pub fn card(&self) -> &NodeCard {
        &self.card
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    pub fn supervisor(&self) -> &SupervisorHandle {
        &self.supervisor
    }

    /// Resolves when the node failed (restart limit, a server died).
    pub async fn wait_failed(&self) -> String {
        self.health.wait_failed().await
    }

    /// Graceful shutdown: revoke the lease (routers drop the node at once), stop admitting,
    /// drain in-flight requests up to `node.drain_timeout_s`, stop the servers and actors.
    pub async fn shutdown(self) -> ShutdownReport {
        let t0 = Instant::now();
        self.health.set_draining();
        self.supervisor.begin_shutdown();

        // 0. `node.drain = "migrate"`: new requests are refused, every running decode's router
        // is asked to move it, and the node stays registered (its streams are not "lost" to
        // their routers) until they moved or the drain deadline passed.
        let mut drain_deadline = None;
        let migrate = self.drain_mode == pdnode_core::config::DrainMode::Migrate
            || self.health.drain_asked() == Some(true);
        if let (true, Some(pd), Some(engine)) = (migrate, &self.migrate_on_drain, &self.engine) {
            if let Ok(Some(a)) = self.supervisor.engine().await {
                let _ = a.stop_admitting();
            }
            engine.stop_admitting();
            // Routers leave a draining card out of placement (no new request, no moved stream
            // comes here) and keep watching it (its streams are not lost while they move).
            if let Some(r) = self.registration.lock().await.as_ref() {
                let mut card = r.card();
                card.draining = true;
                if let Err(e) = r.update(card) {
                    tracing::warn!(error = %e, "could not mark the card draining");
                }
            }
            let asked = pd.request_migrations();
            let deadline = Instant::now() + self.drain_timeout;
            drain_deadline = Some(deadline);
            let mut left = engine.in_flight().await.unwrap_or(0);
            while left > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
                left = engine.in_flight().await.unwrap_or(0);
            }
            tracing::info!(
                asked,
                left,
                ms = t0.elapsed().as_millis() as u64,
                "drain by migration"
            );
        }

        // 1. Revoke the lease.
        let via_registrar = match self.supervisor.registrar().await {
            Ok(r) => r.deregister().await,
            Err(e) => Err(e),
        };
        let deregistered = match via_registrar {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "registrar could not revoke; revoking directly");
                match self.registration.lock().await.take() {
                    Some(r) => r.shutdown().await.is_ok(),
                    None => true,
                }
            }
        };

        // 2. Stop admitting; 3. drain.
        let mut in_flight_left = 0;
        if let Some(engine) = &self.engine {
            if let Ok(Some(a)) = self.supervisor.engine().await {
                let _ = a.stop_admitting();
            }
            engine.stop_admitting();
            let deadline = drain_deadline.unwrap_or_else(|| Instant::now() + self.drain_timeout);
            loop {
                in_flight_left = engine.in_flight().await.unwrap_or(0);
                if in_flight_left == 0 || Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if in_flight_left > 0 {
                tracing::warn!(
                    in_flight_left,
                    "drain deadline passed; stopping with requests in flight"
                );
            }
            if !engine.shutdown(Duration::from_secs(5)).await {
                tracing::warn!("the engine did not stop within 5 s");
            }
        }

        // 4. Stop servers and actors.
        self.cancel.cancel();
        for s in self.servers {
            let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
        }
        self.supervisor.actor().stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(5), self.supervisor_join).await;
        let report = ShutdownReport {
            deregistered,
            in_flight_left,
            elapsed_ms: t0.elapsed().as_millis() as u64,
        };
        tracing::info!(?report, "node stopped");
        report
    }

    /// Runs until SIGTERM/SIGINT (then shuts down gracefully) or until the node fails (then
    /// shuts down and returns the failure).
    pub async fn run_until_signal(self) -> Result<ShutdownReport, NodeError> {
        #[cfg(unix)]
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| NodeError::Stopped {
                reason: format!("cannot install the SIGTERM handler: {e}"),
            })?;
        #[cfg(unix)]
        let term_fut = term.recv();
        #[cfg(not(unix))]
        let term_fut = std::future::pending::<Option<()>>();
        let failed = tokio::select! {
            _ = term_fut => { tracing::info!("SIGTERM: shutting down"); None }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: shutting down"); None }
            _ = self.health.wait_drain_asked() => { tracing::info!("Drain asked: shutting down"); None }
            r = self.health.wait_failed() => Some(r),
        };
        let report = self.shutdown().await;
        match failed {
            None => Ok(report),
            Some(reason) => Err(NodeError::Stopped { reason }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_stall_limit_follows_the_config_and_the_engine() {
        let mut cfg = pdnode_core::config::Config::default();
        let stall =
            |cfg: &pdnode_core::config::Config, b| NodeOptions::from_config(cfg, b).engine_stall;
        assert_eq!(stall(&cfg, "cpu"), Duration::from_secs(60));
        assert_eq!(stall(&cfg, "cuda:0"), Duration::from_secs(5));
        assert_eq!(stall(&cfg, "mock"), Duration::from_secs(5));
        cfg.node.engine_stall_ms = 1500;
        assert_eq!(stall(&cfg, "cpu"), Duration::from_millis(1500));
        assert_eq!(stall(&cfg, "cuda:0"), Duration::from_millis(1500));
    }
}
