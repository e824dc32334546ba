//! The node's gRPC server: `pdnode.v1.Node` and the standard `grpc.health.v1.Health`.
//!
//! Served now: `Health` and `Stats`. `ReserveKv`, `Prefill`, `Decode`, `KvDone` and `Abort`
//! need the engine and the KV transfer wired into the node; until they are, they answer
//! `UNIMPLEMENTED` with a message that says so (never a fake answer).

use crate::board::LoadBoard;
use crate::supervisor::SupervisorHandle;
use pdnode_core::{NodeId, Role};
use pdnode_proto::v1;
use pdnode_proto::v1::node_server::{Node, NodeServer};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// How often the standard health service is refreshed from the supervisor.
const HEALTH_POLL: Duration = Duration::from_millis(500);

#[derive(Clone)]
pub struct NodeGrpc {
    pub id: NodeId,
    pub role: Role,
    pub version: String,
    pub supervisor: SupervisorHandle,
    pub load: LoadBoard,
}

fn not_wired(method: &str) -> Status {
    Status::unimplemented(format!(
        "pdnode.v1.Node/{method} is not served by this node yet: the node runtime does not wire \
         the engine and the KV transfer into the node gRPC API (see docs/runtime-semantics.md)"
    ))
}

#[tonic::async_trait]
impl Node for NodeGrpc {
    async fn reserve_kv(
        &self,
        _r: Request<v1::ReserveKvRequest>,
    ) -> Result<Response<v1::ReserveKvResponse>, Status> {
        Err(not_wired("ReserveKv"))
    }

    async fn prefill(
        &self,
        _r: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        Err(not_wired("Prefill"))
    }

    type DecodeStream = futures::stream::Empty<Result<v1::DecodeResponse, Status>>;

    async fn decode(
        &self,
        _r: Request<v1::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        Err(not_wired("Decode"))
    }

    async fn kv_done(
        &self,
        _r: Request<v1::KvDoneRequest>,
    ) -> Result<Response<v1::KvDoneResponse>, Status> {
        Err(not_wired("KvDone"))
    }

    async fn abort(
        &self,
        _r: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        Err(not_wired("Abort"))
    }

    async fn stats(
        &self,
        _r: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
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
        }))
    }

    async fn health(
        &self,
        _r: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        let h = self.supervisor.health().await;
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
    let poll_stop = shutdown.clone();
    // Keeps grpc.health.v1 in step with the supervisor's view.
    tokio::spawn(async move {
        loop {
            let serving = sup.health().await.serving;
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
    tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(NodeServer::new(svc))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
}
