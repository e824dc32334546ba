//! The node's gRPC server: `pdnode.v1.Node` and the standard `grpc.health.v1.Health`.
//!
//! `Health` and `Stats` are always served. Both go by the engine's liveness: an engine that
//! stopped reporting its load for `NodeOptions::engine_stall` makes `Stats` answer
//! `UNAVAILABLE` (a router's liveness probe then counts the node as gone) and health
//! `NOT_SERVING` (both `pdnode.v1.Node/Health` and `grpc.health.v1`). `ReserveKv`, `Prefill`, `Decode` and `Abort` go to the
//! node's data path ([`crate::pd::PdNode`], see `crate::pd::wire`); a node without one (a router)
//! answers `UNIMPLEMENTED` with a message that says so. `KvDone` is unused in protocol v1.
//!
//! With `NodeGrpc::tls` the server speaks mutual TLS only (a client certificate signed by the
//! cluster CA is required) and every `pdnode.v1.Node` RPC first checks the caller's role as its
//! certificate names it ([`pdnode_nodeapi::tls::NodeRpc::allowed`]): `PERMISSION_DENIED`
//! otherwise. `grpc.health.v1` needs the certificate only.

use crate::board::LoadBoard;
use crate::pd::wire;
use crate::supervisor::SupervisorHandle;
use pdnode_core::{NodeId, Role};
use pdnode_nodeapi::tls::{NodeRpc, NodeTls, peer_identity};
use pdnode_proto::v1;
use pdnode_proto::v1::node_server::{Node, NodeServer};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// How often the standard health service is refreshed from the supervisor.
const HEALTH_POLL: Duration = Duration::from_millis(500);

#[derive(Clone)]
pub struct NodeGrpc {
    pub id: NodeId,
    pub role: Role,
    pub version: String,
    pub supervisor: SupervisorHandle,
    pub load: LoadBoard,
    /// See [`crate::NodeOptions::engine_stall`].
    pub engine_stall: Duration,
    /// The data path; `None` on nodes without one (routers, engine-less nodes).
    pub pd: Option<std::sync::Arc<dyn pdnode_nodeapi::NodeClient>>,
    /// Mutual TLS and the role check; `None`: plaintext, every caller allowed (loopback, or
    /// `security.allow_insecure`).
    pub tls: Option<NodeTls>,
    /// Where `Drain` asks the node to shut down.
    pub health: crate::board::HealthBoard,
    /// HTTP/2 keepalive of every accepted connection (`router.node_keepalive_interval_ms` /
    /// `_timeout_ms`): a caller that stops answering (its host died, the network split) is hung
    /// up on, which ends its calls and streams here (and frees what they hold).
    pub keepalive: (Duration, Duration),
}

impl NodeGrpc {
    /// `Err(UNAVAILABLE)` when the engine stopped reporting (wedged): a liveness probe must not
    /// be answered from a stale board.
    fn engine_alive(&self) -> Result<(), Status> {
        match self.load.stalled(self.engine_stall) {
            None => Ok(()),
            Some(age) => Err(Status::unavailable(format!(
                "the engine has not reported its load for {} ms, past node.engine_stall_ms ({} ms): its thread is stuck, or one step runs longer than that",
                age.as_millis(),
                self.engine_stall.as_millis()
            ))),
        }
    }

    /// Whether the caller of `r` may call `rpc` (always, without TLS).
    fn authorize<T>(&self, rpc: NodeRpc, r: &Request<T>) -> Result<(), Status> {
        let Some(tls) = &self.tls else {
            return Ok(());
        };
        let caller = peer_identity(r)?;
        tls.authorize(rpc, &caller).inspect_err(|e| {
            tracing::warn!(caller = %caller.uri(), rpc = rpc.name(), "refused: {}", e.message());
        })
    }

    fn pd(&self, method: &str) -> Result<&dyn pdnode_nodeapi::NodeClient, Status> {
        self.pd.as_deref().ok_or_else(|| not_wired(method))
    }
}

/// The server span of one data-path RPC: a child of the router's span in the call's
/// `traceparent` metadata, with the request id and trace id every log line inside it shows.
fn rpc_span(
    method: &'static str,
    request_id: u64,
    md: &tonic::metadata::MetadataMap,
) -> tracing::Span {
    let span = tracing::info_span!(
        parent: None,
        "node",
        otel.name = format!("node.{method}"),
        otel.kind = "server",
        rpc = method,
        request_id = %pdnode_core::RequestId(request_id),
        trace_id = tracing::field::Empty,
        tokens = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
    );
    pdnode_telemetry::Remote::from_metadata(md).adopt(&span);
    span
}

/// `out`, its error recorded on `span`.
fn traced_answer<T>(span: &tracing::Span, out: Result<T, Status>) -> Result<T, Status> {
    if let Err(s) = &out {
        pdnode_telemetry::fail(span, &format_args!("{:?}: {}", s.code(), s.message()));
    }
    out
}

fn not_wired(method: &str) -> Status {
    Status::unimplemented(format!(
        "pdnode.v1.Node/{method} is not served by this node: it has no prefill or decode engine"
    ))
}

#[tonic::async_trait]
impl Node for NodeGrpc {
    async fn reserve_kv(
        &self,
        r: Request<v1::ReserveKvRequest>,
    ) -> Result<Response<v1::ReserveKvResponse>, Status> {
        self.authorize(NodeRpc::ReserveKv, &r)?;
        let span = rpc_span("ReserveKv", r.get_ref().request_id, r.metadata());
        let out = wire::reserve_kv(self.pd("ReserveKv")?, r.into_inner())
            .instrument(span.clone())
            .await;
        traced_answer(&span, out).map(Response::new)
    }

    async fn prefill(
        &self,
        r: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        self.authorize(NodeRpc::Prefill, &r)?;
        let span = rpc_span("Prefill", r.get_ref().request_id, r.metadata());
        let out = wire::prefill(self.pd("Prefill")?, r.into_inner())
            .instrument(span.clone())
            .await;
        traced_answer(&span, out).map(Response::new)
    }

    type DecodeStream = wire::WireDecodeStream;

    async fn decode(
        &self,
        r: Request<v1::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        self.authorize(NodeRpc::Decode, &r)?;
        let span = rpc_span("Decode", r.get_ref().request_id, r.metadata());
        let out = wire::decode(self.pd("Decode")?, r.into_inner())
            .instrument(span.clone())
            .await;
        // The span lasts as long as the stream: tokens and the finish reason end up on it.
        traced_answer(&span, out)
            .map(|s| Response::new(crate::trace::traced_stream(span, s) as Self::DecodeStream))
    }

    async fn kv_done(
        &self,
        r: Request<v1::KvDoneRequest>,
    ) -> Result<Response<v1::KvDoneResponse>, Status> {
        self.authorize(NodeRpc::KvDone, &r)?;
        Err(wire::kv_done_unused())
    }

    async fn abort(
        &self,
        r: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        self.authorize(NodeRpc::Abort, &r)?;
        let span = rpc_span("Abort", r.get_ref().request_id, r.metadata());
        let out = wire::abort(self.pd("Abort")?, r.into_inner())
            .instrument(span.clone())
            .await;
        traced_answer(&span, out).map(Response::new)
    }

    async fn migrate(
        &self,
        r: Request<v1::MigrateRequest>,
    ) -> Result<Response<v1::MigrateResponse>, Status> {
        self.authorize(NodeRpc::Migrate, &r)?;
        let span = rpc_span("Migrate", r.get_ref().request_id, r.metadata());
        let out = wire::migrate(self.pd("Migrate")?, r.into_inner())
            .instrument(span.clone())
            .await;
        traced_answer(&span, out).map(Response::new)
    }

    async fn drain(
        &self,
        r: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        self.authorize(NodeRpc::Drain, &r)?;
        let asked = r.into_inner().migrate;
        // Only a decode node with a data path moves decodes.
        let migrate = asked && self.role == Role::Decode && self.pd.is_some();
        tracing::info!(migrate, "drain asked over the node API");
        self.health.ask_drain(migrate);
        Ok(Response::new(v1::DrainResponse { migrate }))
    }

    async fn stats(
        &self,
        r: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
        self.authorize(NodeRpc::Stats, &r)?;
        self.engine_alive()?;
        let c = self.load.current();
        let busy = f64::from(c.running_requests) + f64::from(c.queued_requests);
        let load = if c.max_running_requests == 0 {
            0.0
        } else {
            (busy / f64::from(c.max_running_requests)).min(1.0)
        };
        Ok(Response::new(v1::StatsResponse {
            node_id: self.id.to_string(),
            role: v1::Role::from(self.role) as i32,
            load,
            kv_blocks_free: c.kv_blocks_free,
            kv_blocks_total: c.kv_blocks_total,
            running_requests: c.running_requests,
            queued_requests: c.queued_requests,
            max_running_requests: c.max_running_requests,
            kv_blocks_reserved: 0,
            // As read with the load (same board, same age); see pdnode_core::Accounting.
            accounting: self.load.accounting().map(|a| v1::Accounting::from(&a)),
        }))
    }

    async fn health(
        &self,
        r: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        self.authorize(NodeRpc::Health, &r)?;
        let mut h = self.supervisor.health().await;
        if let Err(e) = self.engine_alive() {
            h.serving = false;
            h.detail = e.message().to_string();
        }
        let status = if h.serving {
            v1::ServingStatus::Serving
        } else {
            v1::ServingStatus::NotServing
        };
        Ok(Response::new(v1::HealthResponse {
            status: status as i32,
            detail: h.detail,
            node_id: self.id.to_string(),
            role: v1::Role::from(self.role) as i32,
            version: self.version.clone(),
        }))
    }
}

/// Serves the node API and gRPC health on `listener` until `shutdown`.
pub async fn run(
    listener: TcpListener,
    svc: NodeGrpc,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health_svc) = tonic_health::server::health_reporter();
    let sup = svc.supervisor.clone();
    let probe = svc.clone();
    let poll_stop = shutdown.clone();
    // Keeps grpc.health.v1 in step with the supervisor's view.
    tokio::spawn(async move {
        loop {
            let serving = sup.health().await.serving && probe.engine_alive().is_ok();
            let st = if serving {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status("", st).await;
            reporter.set_service_status("pdnode.v1.Node", st).await;
            tokio::select! {
                _ = poll_stop.cancelled() => return,
                _ = tokio::time::sleep(HEALTH_POLL) => {}
            }
        }
    });
    let (interval, timeout) = svc.keepalive;
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(interval))
        .http2_keepalive_timeout(Some(timeout));
    if let Some(tls) = &svc.tls {
        server = server.tls_config(tls.server_config())?;
    }
    server
        .add_service(health_svc)
        .add_service(NodeServer::new(svc))
        .serve_with_incoming_shutdown(
            pdnode_router::net::grpc_incoming(listener),
            shutdown.cancelled_owned(),
        )
        .await
}
