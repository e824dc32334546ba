//! The HTTP surface of the SGLang router and its background health probes.

use crate::request::Route;
use crate::router::{SglangRouter, error_response};
use crate::worker::{Worker, WorkerInfo};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pdnode_router::http::BodyRead;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves the router on `listener` (every accepted socket with `TCP_NODELAY`) and probes the
/// workers until `shutdown`; in-flight requests drain before it returns.
pub async fn serve(
    listener: TcpListener,
    router: Arc<SglangRouter>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    start_probes(&router, shutdown.clone());
    // A client's headers, like its body, within `router.client_send_timeout_s`.
    let header_timeout = router.client_send_timeout;
    let app = app(router);
    pdnode_router::net::serve_http(listener, app, header_timeout, shutdown).await
}

/// Serves `pdnode.v1.Inference` over the same workers on `listener` (every accepted socket with
/// `TCP_NODELAY`), with gRPC reflection v1 and v1alpha over the client API's descriptors, until
/// `shutdown`. The probes are [`serve`]'s.
pub async fn serve_grpc(
    listener: TcpListener,
    router: Arc<SglangRouter>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pdnode_proto::CLIENT_FILE_DESCRIPTOR_SET)
    };
    let v1 = reflection().build_v1().map_err(std::io::Error::other)?;
    let v1alpha = reflection()
        .build_v1alpha()
        .map_err(std::io::Error::other)?;
    pdnode_router::net::client_grpc_server()
        .add_service(v1)
        .add_service(v1alpha)
        .add_service(pdnode_router::net::BodyDeadline::new(
            crate::grpc::SglangInference::new(router.clone()).into_server(),
            router.client_send_timeout,
        ))
        .serve_with_incoming_shutdown(
            pdnode_router::net::grpc_incoming(listener),
            shutdown.cancelled_owned(),
        )
        .await
        .map_err(std::io::Error::other)
}

/// Serves only `/metrics` (sglang-router's `--prometheus-host/--prometheus-port`).
pub async fn serve_metrics(
    listener: TcpListener,
    router: Arc<SglangRouter>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let header_timeout = router.client_send_timeout;
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .with_state(router);
    pdnode_router::net::serve_http(listener, app, header_timeout, shutdown).await
}

/// The routes: generation on the three paths sglang-router serves, plus health, metrics,
/// models and the workers' info.
pub fn app(router: Arc<SglangRouter>) -> axum::Router {
    // The body limit (`--max-payload-size`) and its deadline: `route`.
    let client = axum::Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .layer(axum::middleware::from_fn_with_state(router.clone(), auth));
    axum::Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(client)
        .fallback(not_found)
        .with_state(router)
}

async fn auth(State(r): State<Arc<SglangRouter>>, req: Request, next: Next) -> Response {
    let h = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !pdnode_router::http::authorized(&r.api_keys, h) {
        return error_response(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key (Authorization: Bearer <key>)",
        );
    }
    next.run(req).await
}

async fn generate(State(r): State<Arc<SglangRouter>>, h: HeaderMap, body: Body) -> Response {
    route(r, Route::Generate, h, body).await
}

async fn completions(State(r): State<Arc<SglangRouter>>, h: HeaderMap, body: Body) -> Response {
    route(r, Route::Completions, h, body).await
}

async fn chat(State(r): State<Arc<SglangRouter>>, h: HeaderMap, body: Body) -> Response {
    route(r, Route::ChatCompletions, h, body).await
}

/// Reads the body (at most `--max-payload-size`, whole within `router.client_send_timeout_s`:
/// a client that trickles its body holds no connection and buffer past it), then routes it.
async fn route(r: Arc<SglangRouter>, what: Route, h: HeaderMap, body: Body) -> Response {
    let limit = usize::try_from(r.cfg.max_payload_bytes).unwrap_or(usize::MAX);
    let wait = r.client_send_timeout;
    let body = match pdnode_router::http::read_body_within(&h, body, limit, wait).await {
        Ok(b) => b,
        Err(BodyRead::TooLarge) => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                &format!("the request body is larger than {limit} bytes"),
            );
        }
        Err(BodyRead::TimedOut) => {
            return error_response(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                &format!(
                    "the request body did not arrive within {} s",
                    wait.as_secs()
                ),
            );
        }
    };
    r.handle(what, h, body).await
}

async fn health(State(r): State<Arc<SglangRouter>>) -> Response {
    let (p, d) = r.usable();
    let ok = p > 0 && d > 0;
    let now = std::time::Instant::now();
    let workers: Vec<Value> = r
        .workers()
        .iter()
        .map(|w| {
            json!({
                "url": w.url,
                "role": w.role.as_str(),
                "healthy": w.healthy(),
                "open_breakers": w.open_breakers(now).iter().map(|c| c.as_str()).collect::<Vec<_>>(),
                "inflight_requests": w.inflight(),
            })
        })
        .collect();
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if ok { "ok" } else { "unavailable" },
        "usable_prefill_workers": p,
        "usable_decode_workers": d,
        "workers": workers,
    });
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(r): State<Arc<SglangRouter>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        r.metrics.render(&r.workers()),
    )
        .into_response()
}

async fn models(State(r): State<Arc<SglangRouter>>) -> Response {
    let data: Vec<Value> = r
        .model_names()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "sglang"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn server_info(State(r): State<Arc<SglangRouter>>) -> Response {
    info_of(&r, |i| i.server_info.clone())
}

async fn model_info(State(r): State<Arc<SglangRouter>>) -> Response {
    info_of(&r, |i| i.model_info.clone())
}

/// The first decode worker's answer that the router has (decode workers serve the clients'
/// tokens), else 503.
fn info_of(r: &SglangRouter, f: impl Fn(&WorkerInfo) -> Option<Value>) -> Response {
    let infos = r.worker_info();
    let pick = infos
        .iter()
        .filter(|(w, _)| w.role == crate::worker::WorkerRole::Decode)
        .chain(infos.iter())
        .find_map(|(_, i)| f(i));
    match pick {
        Some(v) => axum::Json(v).into_response(),
        None => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "no worker has answered its info yet",
        ),
    }
}

async fn not_found(req: Request) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        &format!("no route {} {}", req.method(), req.uri().path()),
    )
}

/// One probe loop per worker: `GET /health` every `health_check_interval_s` (every second
/// while the worker is unhealthy, so a worker that starts late joins at once); on becoming
/// healthy, its `/server_info` and `/model_info` are read.
pub fn start_probes(router: &Arc<SglangRouter>, shutdown: CancellationToken) {
    for w in router.workers() {
        spawn_probe(router, w, shutdown.clone());
    }
}

/// The probe loop of one worker; it ends at `shutdown` or when the worker is retired.
pub fn spawn_probe(router: &Arc<SglangRouter>, w: Arc<Worker>, stop: CancellationToken) {
    let r = router.clone();
    tokio::spawn(async move {
        let interval = Duration::from_secs(r.cfg.health_check_interval_s);
        while !w.retired() {
            let ok = probe(&r, &w).await;
            if let Some(now_healthy) = w.observe_probe(ok) {
                tracing::info!(worker = %w.url, role = w.role.as_str(), healthy = now_healthy, "worker health changed");
                if now_healthy {
                    let info = fetch_info(&r, &w).await;
                    w.set_info(info);
                }
            }
            let wait = if w.healthy() {
                interval
            } else {
                interval.min(Duration::from_secs(1))
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    });
}

fn get_req(r: &SglangRouter, url: String) -> reqwest::RequestBuilder {
    let mut b = r
        .client
        .get(url)
        .timeout(Duration::from_secs(r.cfg.health_check_timeout_s));
    if !r.cfg.worker_api_key.is_empty() {
        b = b.bearer_auth(&r.cfg.worker_api_key);
    }
    b
}

async fn probe(r: &SglangRouter, w: &Worker) -> bool {
    match get_req(r, format!("{}/health", w.url)).send().await {
        Ok(resp) => resp.status().is_success(),
        Err(_) => false,
    }
}

async fn get_json(r: &SglangRouter, url: String) -> Option<Value> {
    let resp = get_req(r, url).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json::<Value>().await.ok()
}

async fn fetch_info(r: &SglangRouter, w: &Worker) -> WorkerInfo {
    let mut info = WorkerInfo::default();
    for path in ["/server_info", "/get_server_info"] {
        if let Some(v) = get_json(r, format!("{}{path}", w.url)).await {
            info.server_info = Some(v);
            break;
        }
    }
    for path in ["/model_info", "/get_model_info"] {
        if let Some(v) = get_json(r, format!("{}{path}", w.url)).await {
            info.model_info = Some(v);
            break;
        }
    }
    info
}
