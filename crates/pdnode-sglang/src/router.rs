//! One client request through a (prefill, decode) pair of SGLang workers: the same body, plus
//! the bootstrap fields, goes to both at once; the prefill answer is read to its end; the
//! decode answer is the client's. Retries (new room, other workers where there are) happen
//! only while nothing was sent to the client; every wait has a deadline.

use crate::metrics::Metrics;
use crate::request::{Bootstrap, ClientRequest, Route, new_room};
use crate::worker::{FailureCause, Worker, WorkerInfo, WorkerRole, WorkerRules};
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use parking_lot::{Mutex, RwLock};
use pdnode_core::NodeId;
use pdnode_core::config::{RouterConfig, SglangConfig, worker_url_host};
use pdnode_router::ROUTING_KEY_HEADER;
use pdnode_router::policy::{Policy, PolicyContext, WorkerLoad, build_policy};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tracing::Instrument;

mod answer;
mod stream;

pub(crate) use answer::error_response;
pub use answer::merge_input_logprobs;
use answer::{pass_through, read_body, read_limited, unavailable};

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("router.sglang.{role}: {url:?} is not http://host:port")]
    BadUrl { role: &'static str, url: String },
    #[error("router.sglang: list at least one prefill and one decode worker, or set discover")]
    NoWorkers,
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// The router over SGLang workers.
pub struct SglangRouter {
    pub(crate) cfg: SglangConfig,
    request_timeout: Duration,
    prefill_timeout: Duration,
    token_timeout: Duration,
    pub(crate) client_send_timeout: Duration,
    /// The workers of each role: the configured ones, then those discovered in the registry.
    /// Swapped whole when discovery changes them; a request keeps the list it picked from.
    prefill: RwLock<Arc<Vec<Arc<Worker>>>>,
    decode: RwLock<Arc<Vec<Arc<Worker>>>>,
    rules: WorkerRules,
    prefill_policy: Mutex<Box<dyn Policy>>,
    decode_policy: Mutex<Box<dyn Policy>>,
    pub(crate) client: reqwest::Client,
    pub(crate) metrics: Metrics,
    pub(crate) api_keys: Vec<String>,
    max_inflight: u32,
    inflight: std::sync::atomic::AtomicU32,
}

/// Headers passed from the client to both workers.
const FORWARDED: [header::HeaderName; 5] = [
    header::CONTENT_TYPE,
    header::AUTHORIZATION,
    header::HeaderName::from_static("x-request-id"),
    header::HeaderName::from_static("traceparent"),
    header::HeaderName::from_static("tracestate"),
];

/// Most bytes of already-arrived chunks sent to a client in one write.
const COALESCE_MAX: usize = 64 << 10;

/// Largest error or non-streamed answer read from a worker, bytes.
const MAX_ANSWER: usize = 256 << 20;

type PrefillResult = Result<(StatusCode, Bytes), (FailureCause, String)>;

enum AttemptEnd {
    Done(Response),
    Retry {
        worker: Arc<Worker>,
        cause: FailureCause,
        message: String,
        /// The failure is already counted (the prefill task counts its own).
        counted: bool,
    },
}

impl SglangRouter {
    pub fn new(router: &RouterConfig, api_keys: Vec<String>) -> Result<Arc<Self>, BuildError> {
        let cfg = router.sglang.clone();
        if !cfg.discover && (cfg.prefill.is_empty() || cfg.decode.is_empty()) {
            return Err(BuildError::NoWorkers);
        }
        let rules = WorkerRules {
            health_fail: cfg.health_failure_threshold,
            health_ok: cfg.health_success_threshold,
            breaker_failures: cfg.breaker_failure_threshold,
            breaker_open_for: Duration::from_secs(cfg.breaker_timeout_s),
        };
        let worker = |url: &str, role: WorkerRole, port: Option<u16>| {
            let host = worker_url_host(url).ok_or_else(|| BuildError::BadUrl {
                role: role.as_str(),
                url: url.to_string(),
            })?;
            Ok::<_, BuildError>(Worker::new(url, role, host.to_string(), port, rules))
        };
        let prefill = (cfg.prefill.iter())
            .map(|p| worker(&p.url, WorkerRole::Prefill, p.bootstrap_port))
            .collect::<Result<Vec<_>, _>>()?;
        let decode = (cfg.decode.iter())
            .map(|d| worker(&d.url, WorkerRole::Decode, None))
            .collect::<Result<Vec<_>, _>>()?;
        let client = reqwest::Client::builder()
            .tcp_nodelay(true)
            .no_proxy()
            .connect_timeout(Duration::from_secs(cfg.health_check_timeout_s))
            .pool_idle_timeout(Duration::from_secs(90))
            .build()
            .map_err(|e| BuildError::Client(e.to_string()))?;
        Ok(Arc::new(Self {
            request_timeout: Duration::from_secs(router.request_timeout_s),
            prefill_timeout: Duration::from_secs(router.prefill_timeout_s),
            token_timeout: Duration::from_secs(router.token_timeout_s),
            client_send_timeout: Duration::from_secs(router.client_send_timeout_s),
            prefill_policy: Mutex::new(build_policy(router.prefill_policy, router, router.seed)),
            decode_policy: Mutex::new(build_policy(router.decode_policy, router, router.seed)),
            prefill: RwLock::new(Arc::new(prefill)),
            decode: RwLock::new(Arc::new(decode)),
            rules,
            client,
            metrics: Metrics::default(),
            api_keys,
            max_inflight: router.max_inflight_requests,
            inflight: std::sync::atomic::AtomicU32::new(0),
            cfg,
        }))
    }

    /// Client requests in flight (a stream counts until it ends).
    pub fn inflight(&self) -> u32 {
        self.inflight.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The current workers of `role`.
    pub fn list(&self, role: WorkerRole) -> Arc<Vec<Arc<Worker>>> {
        match role {
            WorkerRole::Prefill => self.prefill.read().clone(),
            WorkerRole::Decode => self.decode.read().clone(),
        }
    }

    pub fn workers(&self) -> Vec<Arc<Worker>> {
        let (p, d) = (
            self.list(WorkerRole::Prefill),
            self.list(WorkerRole::Decode),
        );
        p.iter().chain(d.iter()).cloned().collect()
    }

    /// Usable (healthy, no breaker open) prefill and decode workers.
    pub fn usable(&self) -> (usize, usize) {
        let now = Instant::now();
        let n = |ws: &[Arc<Worker>]| ws.iter().filter(|w| w.usable(now)).count();
        (
            n(&self.list(WorkerRole::Prefill)),
            n(&self.list(WorkerRole::Decode)),
        )
    }

    /// Makes the discovered workers of `role` exactly `found` (`(url, bootstrap_port)`),
    /// keeping the configured ones and the state of workers still present. Returns the workers
    /// added (their probe loops are the caller's to start); removed ones are retired.
    pub fn set_discovered(
        &self,
        role: WorkerRole,
        found: &[(String, Option<u16>)],
    ) -> Vec<Arc<Worker>> {
        let slot = match role {
            WorkerRole::Prefill => &self.prefill,
            WorkerRole::Decode => &self.decode,
        };
        let configured: Vec<String> = match role {
            WorkerRole::Prefill => self.cfg.prefill.iter().map(|w| norm(&w.url)).collect(),
            WorkerRole::Decode => self.cfg.decode.iter().map(|w| norm(&w.url)).collect(),
        };
        let mut guard = slot.write();
        let mut next: Vec<Arc<Worker>> = Vec::new();
        let mut added = Vec::new();
        for w in guard.iter() {
            let keep = configured.contains(&w.url)
                || found
                    .iter()
                    .any(|(u, port)| norm(u) == w.url && *port == w.bootstrap_port);
            if keep {
                next.push(w.clone());
            } else {
                w.retire();
            }
        }
        for (url, port) in found {
            if next.iter().any(|w| w.url == norm(url)) {
                continue;
            }
            let Some(host) = worker_url_host(url) else {
                tracing::warn!(%url, "a registered SGLang worker's URL is not http://host:port; skipped");
                continue;
            };
            let w = Worker::new(url, role, host.to_string(), *port, self.rules);
            next.push(w.clone());
            added.push(w);
        }
        *guard = Arc::new(next);
        added
    }

    /// The model names the decode workers serve (`/v1/models`).
    pub fn model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .list(WorkerRole::Decode)
            .iter()
            .filter_map(|w| w.info().model_name())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    pub fn worker_info(&self) -> Vec<(Arc<Worker>, WorkerInfo)> {
        self.workers()
            .into_iter()
            .map(|w| {
                let i = w.info();
                (w, i)
            })
            .collect()
    }

    /// Picks a worker of `role` by its policy among the usable ones, avoiding `avoid` while
    /// others are usable.
    fn pick(
        &self,
        role: WorkerRole,
        req: &ClientRequest,
        avoid: &[Arc<Worker>],
    ) -> Option<Arc<Worker>> {
        let workers = self.list(role);
        let policy = match role {
            WorkerRole::Prefill => &self.prefill_policy,
            WorkerRole::Decode => &self.decode_policy,
        };
        let now = Instant::now();
        let usable: Vec<&Arc<Worker>> = workers.iter().filter(|w| w.usable(now)).collect();
        let fresh: Vec<&Arc<Worker>> = usable
            .iter()
            .copied()
            .filter(|w| !avoid.iter().any(|a| Arc::ptr_eq(a, w)))
            .collect();
        let cands = if fresh.is_empty() { usable } else { fresh };
        if cands.is_empty() {
            return None;
        }
        let loads: Vec<WorkerLoad> = cands
            .iter()
            .map(|w| WorkerLoad {
                running: w.inflight(),
                ..WorkerLoad::idle(NodeId::new(w.url.clone()).0)
            })
            .collect();
        let tokens: Vec<u32> = req.routing_text.bytes().map(u32::from).collect();
        let ctx = PolicyContext {
            workers: &loads,
            token_ids: &tokens,
            routing_key: req.routing_key.as_deref(),
            now,
        };
        let i = policy.lock().select(&ctx)?;
        let w = cands.get(i)?;
        w.admit(now).then(|| (*w).clone())
    }

    /// Serves one client request on `route`.
    pub async fn handle(
        self: &Arc<Self>,
        route: Route,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        use std::sync::atomic::Ordering;
        let before = self.inflight.fetch_add(1, Ordering::AcqRel);
        // Held until the answer's body is dropped (a stream counts until it ends), or released
        // early when a streaming client stops reading.
        let slot = Arc::new(Slot::new(self.clone()));
        let resp = if before >= self.max_inflight {
            error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                &format!(
                    "{} requests in flight (router.max_inflight_requests)",
                    self.max_inflight
                ),
            )
        } else {
            // The request's span: a child of the client's `traceparent`, if any; the workers
            // get this trace's context in their `traceparent` header (`post`).
            let span = tracing::info_span!(
                parent: None,
                "request",
                otel.kind = "server",
                route = route.path(),
                trace_id = tracing::field::Empty,
                status = tracing::field::Empty,
            );
            pdnode_telemetry::Remote::from_headers(&headers).adopt(&span);
            let resp = self
                .dispatch(route, &headers, body, &slot)
                .instrument(span.clone())
                .await;
            span.record("status", resp.status().as_u16());
            if resp.status().is_server_error() {
                pdnode_telemetry::fail(&span, &resp.status());
            }
            resp
        };
        self.metrics.request(route.label(), resp.status().as_u16());
        let (parts, body) = resp.into_parts();
        let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _ = &slot;
            chunk
        }));
        Response::from_parts(parts, body)
    }

    async fn dispatch(
        self: &Arc<Self>,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
        slot: &Arc<Slot>,
    ) -> Response {
        let key = headers.get(ROUTING_KEY_HEADER).map(|v| v.as_bytes());
        let req = match ClientRequest::parse_with_key(route, &body, key) {
            Ok(r) => r,
            Err(e) => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &e.to_string(),
                );
            }
        };
        let started = Instant::now();
        let mut tried: Vec<Arc<Worker>> = Vec::new();
        let mut last: Option<String> = None;
        let mut last_cause = FailureCause::Connect;
        for attempt in 0..=self.cfg.max_retries {
            if started.elapsed() >= self.request_timeout {
                break;
            }
            if attempt > 0 {
                self.metrics.retry();
            }
            let Some(p) = self.pick(WorkerRole::Prefill, &req, &tried) else {
                return unavailable("prefill", last.as_deref());
            };
            let Some(d) = self.pick(WorkerRole::Decode, &req, &tried) else {
                return unavailable("decode", last.as_deref());
            };
            let attempt_span = tracing::info_span!(
                "attempt",
                attempt,
                prefill = %p.url,
                decode = %d.url,
            );
            match self
                .attempt(&req, headers, p, d, started, slot)
                .instrument(attempt_span.clone())
                .await
            {
                AttemptEnd::Done(resp) => return resp,
                AttemptEnd::Retry {
                    worker,
                    cause,
                    message,
                    counted,
                } => {
                    if !counted {
                        self.count_failure(&worker, cause);
                    }
                    pdnode_telemetry::fail(&attempt_span, &message);
                    tracing::warn!(
                        worker = %worker.url, role = worker.role.as_str(), cause = cause.as_str(),
                        attempt, "sglang attempt failed: {message}"
                    );
                    last = Some(format!(
                        "{} worker {}: {message}",
                        worker.role.as_str(),
                        worker.url
                    ));
                    last_cause = cause;
                    tried.push(worker);
                }
            }
        }
        let msg = last.unwrap_or_else(|| "request deadline passed".into());
        let status = if last_cause == FailureCause::Timeout {
            StatusCode::GATEWAY_TIMEOUT
        } else {
            StatusCode::BAD_GATEWAY
        };
        error_response(
            status,
            "upstream_error",
            &format!("no attempt succeeded; last: {msg}"),
        )
    }

    pub(crate) fn count_failure(&self, w: &Worker, cause: FailureCause) {
        let opened = w.failure(cause, Instant::now());
        if opened {
            tracing::warn!(worker = %w.url, cause = cause.as_str(), "breaker opened");
        }
        self.metrics.worker_failure(&w.url, cause, opened);
    }

    fn post(
        &self,
        w: &Worker,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
    ) -> reqwest::RequestBuilder {
        let mut h = HeaderMap::new();
        for name in &FORWARDED {
            if let Some(v) = headers.get(name) {
                h.insert(name.clone(), v.clone());
            }
        }
        if !h.contains_key(header::CONTENT_TYPE) {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        if !self.cfg.worker_api_key.is_empty()
            && let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", self.cfg.worker_api_key))
        {
            h.insert(header::AUTHORIZATION, v);
        }
        // This router's trace context replaces the client's `traceparent` (forwarded as is
        // while traces are off): the worker's spans are children of this attempt.
        pdnode_telemetry::inject_headers(&tracing::Span::current(), &mut h);
        self.client
            .post(format!("{}{}", w.url, route.path()))
            .headers(h)
            .body(body)
    }

    async fn attempt(
        self: &Arc<Self>,
        req: &ClientRequest,
        headers: &HeaderMap,
        p: Arc<Worker>,
        d: Arc<Worker>,
        started: Instant,
        slot: &Arc<Slot>,
    ) -> AttemptEnd {
        let rooms = {
            let mut rng = rand::rng();
            (0..req.sequences()).map(|_| new_room(&mut rng)).collect()
        };
        let body = Bytes::from(req.body_with(&Bootstrap {
            host: p.bootstrap_host.clone(),
            port: p.bootstrap_port,
            rooms,
        }));
        let deadline_all = started + self.request_timeout;
        let mut prefill =
            self.spawn_prefill(p.clone(), req.route, headers, body.clone(), deadline_all);
        let d_guard = d.book();
        let send = self.post(&d, req.route, headers, body).send();
        let mut send = std::pin::pin!(send);
        // The decode worker answers once the prefill worker's KV arrived.
        let first_deadline =
            (Instant::now() + self.prefill_timeout + self.token_timeout).min(deadline_all);
        let mut prefill_result: Option<PrefillResult> = None;

        let decoded = loop {
            tokio::select! {
                r = &mut prefill, if prefill_result.is_none() => {
                    let r = r.unwrap_or_else(|e| Err((FailureCause::Connect, format!("prefill task: {e}"))));
                    match r {
                        Err((cause, message)) => {
                            return AttemptEnd::Retry { worker: p, cause, message, counted: true };
                        }
                        Ok((status, bytes)) if status.is_client_error() => {
                            // The prefill worker refused the request itself: the client's answer.
                            return AttemptEnd::Done(pass_through(status, bytes));
                        }
                        ok => prefill_result = Some(ok),
                    }
                }
                r = tokio::time::timeout_at(first_deadline.into(), &mut send) => break r,
            }
        };
        let resp = match decoded {
            Err(_) => {
                prefill.abort();
                return AttemptEnd::Retry {
                    worker: d,
                    cause: FailureCause::Timeout,
                    message: "no answer within its deadline".into(),
                    counted: false,
                };
            }
            Ok(Err(e)) => {
                prefill.abort();
                return AttemptEnd::Retry {
                    worker: d,
                    cause: FailureCause::Connect,
                    message: e.to_string(),
                    counted: false,
                };
            }
            Ok(Ok(resp)) => resp,
        };
        let status = resp.status();
        if status.is_server_error() {
            prefill.abort();
            let text = read_limited(resp, deadline_all).await.unwrap_or_default();
            return AttemptEnd::Retry {
                worker: d,
                cause: FailureCause::ServerError,
                message: format!(
                    "HTTP {status}: {}",
                    String::from_utf8_lossy(&text[..text.len().min(300)])
                ),
                counted: false,
            };
        }
        if !status.is_success() {
            let bytes = read_limited(resp, deadline_all).await.unwrap_or_default();
            d.success();
            return AttemptEnd::Done(pass_through(status, bytes));
        }
        if req.stream {
            self.stream_answer(
                req,
                resp,
                d_guard,
                p,
                prefill,
                prefill_result,
                first_deadline,
                deadline_all,
                slot,
            )
            .await
        } else {
            let bytes = match tokio::time::timeout_at(deadline_all.into(), read_body(resp)).await {
                Err(_) => {
                    return AttemptEnd::Retry {
                        worker: d,
                        cause: FailureCause::Timeout,
                        message: "answer not complete within the request deadline".into(),
                        counted: false,
                    };
                }
                Ok(Err(e)) => {
                    return AttemptEnd::Retry {
                        worker: d,
                        cause: FailureCause::Connect,
                        message: e.to_string(),
                        counted: false,
                    };
                }
                Ok(Ok(b)) => b,
            };
            let Ok(mut answer) = serde_json::from_slice::<Value>(&bytes) else {
                self.count_failure(&d, FailureCause::Malformed);
                return AttemptEnd::Done(error_response(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    &format!(
                        "decode worker {} answered with something that is not JSON",
                        d.url
                    ),
                ));
            };
            d.success();
            if req.wants_logprobs && req.route == Route::Generate {
                let pr = match prefill_result {
                    Some(r) => Some(r),
                    None => tokio::time::timeout_at(deadline_all.into(), &mut prefill)
                        .await
                        .ok()
                        .and_then(Result::ok),
                };
                if let Some(Ok((_, pbytes))) = pr
                    && let Ok(pv) = serde_json::from_slice::<Value>(&pbytes)
                {
                    merge_input_logprobs(&mut answer, &pv);
                }
            }
            AttemptEnd::Done((StatusCode::OK, axum::Json(answer)).into_response())
        }
    }

    /// The prefill request, read to its end under its deadline, in its own task: it counts its
    /// own success or failure on the worker (the decode side never blames it).
    fn spawn_prefill(
        self: &Arc<Self>,
        p: Arc<Worker>,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
        deadline_all: Instant,
    ) -> JoinHandle<PrefillResult> {
        let guard = p.book();
        let send = self.post(&p, route, headers, body).send();
        let deadline = (Instant::now() + self.prefill_timeout).min(deadline_all);
        let me = self.clone();
        tokio::spawn(async move {
            let _guard = guard;
            let r = tokio::time::timeout_at(deadline.into(), async {
                let resp = send
                    .await
                    .map_err(|e| (FailureCause::Connect, e.to_string()))?;
                let status = resp.status();
                let bytes = read_body(resp)
                    .await
                    .map_err(|e| (FailureCause::Connect, e.to_string()))?;
                if status.is_server_error() {
                    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
                    return Err((FailureCause::ServerError, format!("HTTP {status}: {text}")));
                }
                Ok((status, bytes))
            })
            .await
            .unwrap_or_else(|_| {
                Err((
                    FailureCause::Timeout,
                    format!(
                        "no complete answer within {} s",
                        me.prefill_timeout.as_secs()
                    ),
                ))
            });
            match &r {
                Ok(_) => p.success(),
                Err((cause, _)) => me.count_failure(&p, *cause),
            }
            r
        })
    }
}

fn norm(url: &str) -> String {
    url.trim_end_matches('/').to_string()
}

/// One request counted in flight on the router, until it is released or dropped.
struct Slot {
    router: Arc<SglangRouter>,
    released: std::sync::atomic::AtomicBool,
}

impl Slot {
    fn new(router: Arc<SglangRouter>) -> Self {
        Self {
            router,
            released: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Gives the slot back (once).
    fn release(&self) {
        use std::sync::atomic::Ordering;
        if !self.released.swap(true, Ordering::AcqRel) {
            self.router.inflight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::config::{SglangDecodeWorker, SglangPrefillWorker};

    /// The health and breaker keys of `[router.sglang]` are the workers' rules.
    #[test]
    fn the_health_and_breaker_keys_are_the_workers_rules() {
        let mut rc = RouterConfig::default();
        rc.sglang.prefill = vec![SglangPrefillWorker {
            url: "http://127.0.0.1:30000".into(),
            bootstrap_port: None,
        }];
        rc.sglang.decode = vec![SglangDecodeWorker {
            url: "http://127.0.0.1:30001".into(),
        }];
        rc.sglang.health_failure_threshold = 4;
        rc.sglang.health_success_threshold = 3;
        rc.sglang.breaker_failure_threshold = 9;
        rc.sglang.breaker_timeout_s = 17;
        let r = SglangRouter::new(&rc, Vec::new()).unwrap();
        let w = r.rules;
        assert_eq!(
            (
                w.health_fail,
                w.health_ok,
                w.breaker_failures,
                w.breaker_open_for
            ),
            (4, 3, 9, Duration::from_secs(17))
        );
    }
}
