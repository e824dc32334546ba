//! HTTP `/health` for prefill/decode/all nodes (`node.http_listen`). Routers serve their own
//! HTTP frontends.

use crate::supervisor::SupervisorHandle;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use pdnode_core::{NodeId, Role};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
pub struct HttpDeps {
    pub id: NodeId,
    pub role: Role,
    pub supervisor: SupervisorHandle,
}

async fn health(State(d): State<HttpDeps>) -> impl IntoResponse {
    let h = d.supervisor.health().await;
    let restarts: serde_json::Map<String, serde_json::Value> = h
        .restarts
        .iter()
        .map(|(k, v)| (k.clone(), (*v).into()))
        .collect();
    let body = serde_json::json!({
        "status": if h.serving { "serving" } else { "not_serving" },
        "node_id": d.id.as_str(),
        "role": d.role.as_str(),
        "detail": h.detail,
        "restarts": restarts,
    });
    let code = if h.serving {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body))
}

/// Serves `/health` on `listener` until `shutdown`.
pub async fn run(
    listener: TcpListener,
    deps: HttpDeps,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new().route("/health", get(health)).with_state(deps);
    axum::serve(pdnode_router::net::http_listener(listener), app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}
