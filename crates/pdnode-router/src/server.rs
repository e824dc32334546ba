//! The router's entry point: serve HTTP (and gRPC, when given a listener) until `shutdown`, then
//! drain in-flight requests.

use crate::grpc::InferenceService;
use crate::router::{Router, RouterDeps};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Longest a node's stats call may take during the periodic refresh.
const STATS_TIMEOUT: Duration = Duration::from_secs(2);

/// A failure to serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),
    #[error("gRPC server: {0}")]
    Grpc(#[source] tonic::transport::Error),
    #[error("gRPC reflection: {0}")]
    Reflection(String),
}

impl pdnode_core::error::Classify for ServeError {
    fn kind(&self) -> pdnode_core::ErrorKind {
        pdnode_core::ErrorKind::Internal
    }
}

/// Serves the OpenAI HTTP API on `http` and `pdnode.v1.Inference` (with reflection) on `grpc`
/// until `shutdown` is cancelled; then stops accepting and waits for in-flight requests (bounded
/// by `router.request_timeout_s`). Node stats are refreshed every
/// `router.power_of_two.load_refresh_ms`.
pub async fn run(
    http: TcpListener,
    grpc: Option<TcpListener>,
    deps: RouterDeps,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let router = Router::new(deps);
    serve(router, http, grpc, shutdown).await
}

/// [`run`] over an existing [`Router`] (e.g. to read its metrics in tests).
pub async fn serve(
    router: Arc<Router>,
    http: TcpListener,
    grpc: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let deps = router.deps();
    tracing::info!(
        http = ?http.local_addr().ok(),
        grpc = ?grpc.as_ref().and_then(|l| l.local_addr().ok()),
        model = %deps.model.served_name,
        simulated_engine = deps.model.simulated.as_deref().unwrap_or("no"),
        prefill_policy = ?deps.config.prefill_policy,
        decode_policy = ?deps.config.decode_policy,
        auth = !deps.api_keys.is_empty(),
        "router serving"
    );
    if let Some(b) = &deps.model.simulated {
        tracing::warn!(backend = %b, "the engine is SIMULATED: outputs are not model outputs");
    }
    let refresh = Duration::from_millis(deps.config.power_of_two.load_refresh_ms);
    let stats_task = {
        let router = router.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                router.refresh_stats(STATS_TIMEOUT).await;
                // New prefill/decode pairs warmed before they take traffic.
                router.warm_ahead();
                router.rebalance_now();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(refresh) => {}
                }
            }
        })
    };

    let app = crate::http::app(router.clone());
    let http_stop = shutdown.clone();
    // A client's headers, like its body, within `router.client_send_timeout_s`.
    let header_timeout = Duration::from_secs(router.deps().config.client_send_timeout_s);
    let http_task = tokio::spawn(async move {
        crate::net::serve_http(http, app, header_timeout, http_stop)
            .await
            .map_err(ServeError::Http)
    });

    let grpc_task = match grpc {
        None => None,
        Some(listener) => {
            // The client port serves the client API and reflection (v1, and v1alpha for the
            // clients that still speak only it), over the client API's descriptors only: never
            // `pdnode.v1.Node`, which lives on the node's own listener.
            let reflection = || {
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(pdnode_proto::CLIENT_FILE_DESCRIPTOR_SET)
            };
            let reflection_v1 = reflection()
                .build_v1()
                .map_err(|e| ServeError::Reflection(e.to_string()))?;
            let reflection_v1alpha = reflection()
                .build_v1alpha()
                .map_err(|e| ServeError::Reflection(e.to_string()))?;
            let svc = crate::net::BodyDeadline::new(
                InferenceService::new(router.clone()).into_server(),
                Duration::from_secs(router.deps().config.client_send_timeout_s),
            );
            let stop = shutdown.clone();
            let incoming = crate::net::grpc_incoming(listener);
            Some(tokio::spawn(async move {
                crate::net::client_grpc_server()
                    .add_service(reflection_v1)
                    .add_service(reflection_v1alpha)
                    .add_service(svc)
                    .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                    .await
                    .map_err(ServeError::Grpc)
            }))
        }
    };

    shutdown.cancelled().await;
    router.start_draining();
    // Drain: the servers stop accepting and finish open connections; flows end on their own
    // (every step has a deadline), bounded here by the request timeout.
    let drain = Duration::from_secs(router.deps().config.request_timeout_s);
    let deadline = tokio::time::Instant::now() + drain;
    let mut result = Ok(());
    if let Ok(Ok(Err(e))) = tokio::time::timeout_at(deadline, http_task).await {
        result = Err(e);
    }
    if let Some(t) = grpc_task
        && let Ok(Ok(Err(e))) = tokio::time::timeout_at(deadline, t).await
    {
        result = result.and(Err(e));
    }
    while router.inflight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stats_task.abort();
    result
}
