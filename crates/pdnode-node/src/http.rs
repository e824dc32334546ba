//! HTTP `/health` and `/metrics` for prefill/decode/all nodes (`node.http_listen`). Routers serve
//! their own HTTP frontends.
//!
//! `/metrics` exports what the node's own board holds: the KV and staging accounting read with
//! the engine's load (docs/runtime-semantics.md, "Reading KV accounting"), the pool size and the
//! old `pdnode_kv_blocks_in_use` (owned + cached), labelled `node`; and the process's own
//! counters: actor restarts (from the supervisor) and failed registry keepalives.

use crate::board::LoadBoard;
use crate::supervisor::SupervisorHandle;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use pdnode_core::metrics as m;
use pdnode_core::{NodeId, Role};
use pdnode_router::metrics::{Metrics, describe_accounting, export_accounting};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
pub struct HttpDeps {
    pub id: NodeId,
    pub role: Role,
    /// The node API listens beyond loopback in plaintext (`security.allow_insecure`).
    pub insecure_node_plane: bool,
    pub supervisor: SupervisorHandle,
    pub load: LoadBoard,
    pub keepalive_failures: pdnode_registry::KeepaliveFailures,
}

/// Counters of the node process itself, beside its board's gauges.
#[derive(Debug, Default)]
pub struct ProcessCounters {
    /// (actor, restarts) of every actor restarted at least once.
    pub actor_restarts: Vec<(String, u64)>,
    /// Registry keepalives or re-registrations that failed.
    pub keepalive_failures: u64,
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
        "insecure_node_plane": d.insecure_node_plane,
    });
    let code = if h.serving {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body))
}

/// The node's metrics in the Prometheus text format, from its load board and `counters`.
pub fn render_metrics(id: &NodeId, load: &LoadBoard, counters: &ProcessCounters) -> String {
    let mx = Metrics::new();
    describe_accounting(&mx);
    mx.describe(
        m::NODE_ACTOR_RESTARTS_TOTAL,
        "Restarts of one of the node's actors by its supervisor.",
    );
    mx.describe(
        m::REGISTRY_KEEPALIVE_FAILURES_TOTAL,
        "Registry keepalives or re-registrations of this node that failed.",
    );
    mx.describe(m::KV_BLOCKS_TOTAL, "KV blocks in the node's pool.");
    mx.describe(
        m::KV_BLOCKS_IN_USE,
        "KV blocks not free: owned + cached (evictable prefix cache included).",
    );
    let node = id.as_str();
    let l = [("node", node)];
    let c = load.current();
    mx.set(m::KV_BLOCKS_TOTAL, &l, c.kv_blocks_total as f64);
    mx.set(
        m::KV_BLOCKS_IN_USE,
        &l,
        c.kv_blocks_total.saturating_sub(c.kv_blocks_free) as f64,
    );
    mx.set(
        m::ENGINE_RUNNING_REQUESTS,
        &l,
        f64::from(c.running_requests),
    );
    mx.set(m::ENGINE_QUEUE_DEPTH, &l, f64::from(c.queued_requests));
    if let Some(a) = load.accounting() {
        export_accounting(&mx, node, &a);
    }
    mx.set_counter(
        m::REGISTRY_KEEPALIVE_FAILURES_TOTAL,
        &l,
        counters.keepalive_failures as f64,
    );
    for (actor, n) in &counters.actor_restarts {
        mx.set_counter(
            m::NODE_ACTOR_RESTARTS_TOTAL,
            &[("node", node), ("actor", actor)],
            *n as f64,
        );
    }
    mx.render()
}

async fn metrics(State(d): State<HttpDeps>) -> impl IntoResponse {
    let counters = ProcessCounters {
        actor_restarts: d.supervisor.health().await.restarts,
        keepalive_failures: d.keepalive_failures.get(),
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        render_metrics(&d.id, &d.load, &counters),
    )
}

/// Serves `/health` and `/metrics` on `listener` until `shutdown`.
pub async fn run(
    listener: TcpListener,
    deps: HttpDeps,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(deps);
    pdnode_router::net::serve_http(
        listener,
        app,
        pdnode_router::net::SCRAPE_HEADER_TIMEOUT,
        shutdown,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::Accounting;
    use pdnode_core::card::NodeCapacity;

    #[test]
    fn metrics_split_blocks_and_keep_in_use_as_owned_plus_cached() {
        let b = LoadBoard::new(NodeCapacity::default());
        let id = NodeId::new("d0");
        assert!(
            !render_metrics(&id, &b, &ProcessCounters::default())
                .contains("pdnode_kv_owned_blocks{"),
            "no accounting read yet: nothing to claim"
        );
        b.publish_accounting(Some(Accounting {
            kv_blocks_owned_request: 1,
            kv_blocks_owned_transfer: 2,
            kv_blocks_cached: 30,
            kv_blocks_free: 67,
            staging_spans_owned: 1,
            engine_preemptions_total: 2,
            engine_step_decode: {
                let mut t = pdnode_core::StepTimes::default();
                t.observe(std::time::Duration::from_millis(3));
                t
            },
            ..Accounting::default()
        }));
        b.publish(NodeCapacity {
            kv_blocks_total: 100,
            kv_blocks_free: 67,
            ..NodeCapacity::default()
        });
        let t = render_metrics(&id, &b, &ProcessCounters::default());
        for line in [
            "pdnode_kv_owned_blocks{node=\"d0\",owner=\"request\"} 1",
            "pdnode_kv_owned_blocks{node=\"d0\",owner=\"transfer_lease\"} 2",
            "pdnode_kv_cached_blocks{node=\"d0\"} 30",
            "pdnode_kv_free_blocks{node=\"d0\"} 67",
            "pdnode_kv_blocks_in_use{node=\"d0\"} 33",
            "pdnode_staging_owned_spans{node=\"d0\"} 1",
            "pdnode_engine_preemptions_total{node=\"d0\"} 2",
            "# TYPE pdnode_engine_step_seconds histogram",
            "pdnode_engine_step_seconds_bucket{node=\"d0\",phase=\"decode\",le=\"0.0025\"} 0",
            "pdnode_engine_step_seconds_bucket{node=\"d0\",phase=\"decode\",le=\"0.005\"} 1",
            "pdnode_engine_step_seconds_count{node=\"d0\",phase=\"decode\"} 1",
            "pdnode_engine_step_seconds_sum{node=\"d0\",phase=\"decode\"} 0.003",
            "pdnode_engine_step_seconds_count{node=\"d0\",phase=\"prefill\"} 0",
        ] {
            assert!(t.contains(line), "{line} missing from:\n{t}");
        }
        assert!(t.contains("pdnode_registry_keepalive_failures_total{node=\"d0\"} 0"));
        assert!(
            !t.contains("pdnode_node_actor_restarts_total{"),
            "no restart yet"
        );
    }

    #[test]
    fn actor_restarts_and_keepalive_failures_are_counters_per_node() {
        let b = LoadBoard::new(NodeCapacity::default());
        let counters = ProcessCounters {
            actor_restarts: vec![("engine".into(), 2), ("registrar".into(), 1)],
            keepalive_failures: 7,
        };
        let t = render_metrics(&NodeId::new("p1"), &b, &counters);
        for line in [
            "# TYPE pdnode_node_actor_restarts_total counter",
            "pdnode_node_actor_restarts_total{node=\"p1\",actor=\"engine\"} 2",
            "pdnode_node_actor_restarts_total{node=\"p1\",actor=\"registrar\"} 1",
            "# TYPE pdnode_registry_keepalive_failures_total counter",
            "pdnode_registry_keepalive_failures_total{node=\"p1\"} 7",
        ] {
            assert!(t.contains(line), "{line} missing from:\n{t}");
        }
    }
}
