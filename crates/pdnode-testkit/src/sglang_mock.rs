//! A **mock** SGLang worker (tests and benchmarks only; never the product): it speaks the PD
//! wire contract sglang-router 0.3.2 uses, without a model. A prefill mock deposits each
//! request's `(bootstrap_host, bootstrap_port, bootstrap_room)` in a rendezvous shared with
//! the decode mocks of the same test; a decode mock answers only once every room of its
//! request has been deposited by the prefill worker those fields name, so a wrong injection
//! fails the request. Fault switches: hang, malformed JSON, HTTP 500, drop mid-stream, kill.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Rooms deposited by prefill mocks: `(host, port, room)`.
#[derive(Default)]
pub struct Rendezvous {
    rooms: Mutex<HashSet<(String, Option<u16>, u64)>>,
    changed: Notify,
}

impl Rendezvous {
    fn deposit(&self, key: (String, Option<u16>, u64)) {
        self.rooms.lock().insert(key);
        self.changed.notify_waiters();
    }

    async fn wait(&self, key: &(String, Option<u16>, u64), timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if self.rooms.lock().remove(key) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// Accepts requests (generation and health) and never answers.
    Hang,
    /// Answers generation requests with a body that is not JSON (streams: a line that is not).
    Malformed,
    /// Answers generation requests with HTTP 500.
    Http500,
    /// Streams `n` chunks, then closes the connection without `[DONE]`.
    DropMidStream(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MockRole {
    Prefill,
    Decode,
}

pub struct MockWorker {
    pub role: MockRole,
    pub url: String,
    /// The port a prefill mock deposits its rooms under (what the router must inject).
    pub bootstrap_port: Option<u16>,
    fault: Mutex<Fault>,
    rendezvous: Arc<Rendezvous>,
    /// Generation requests received.
    pub requests: AtomicU64,
    /// The last generation request's body and forwarded headers.
    pub last: Mutex<Option<(Value, HeaderMap)>>,
    /// Time per streamed token.
    pub token_delay: Duration,
    /// How long a decode mock waits for its rooms.
    pub room_timeout: Duration,
    killed: CancellationToken,
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl MockWorker {
    pub async fn start(
        role: MockRole,
        bootstrap_port: Option<u16>,
        rendezvous: Arc<Rendezvous>,
        token_delay: Duration,
    ) -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the mock worker");
        let url = format!(
            "http://{}",
            listener.local_addr().expect("the mock's local address")
        );
        let w = Arc::new(Self {
            role,
            url,
            bootstrap_port,
            fault: Mutex::new(Fault::None),
            rendezvous,
            requests: AtomicU64::new(0),
            last: Mutex::new(None),
            token_delay,
            room_timeout: Duration::from_secs(5),
            killed: CancellationToken::new(),
            server: Mutex::new(None),
        });
        let app = axum::Router::new()
            .route("/health", get(health))
            .route("/server_info", get(server_info))
            .route("/get_server_info", get(server_info))
            .route("/model_info", get(model_info))
            .route("/get_model_info", get(model_info))
            .route(
                "/get_load",
                get(|| async { axum::Json(json!({"load": 0})) }),
            )
            .route("/generate", post(generate))
            .route("/v1/completions", post(generate))
            .route("/v1/chat/completions", post(generate))
            .with_state(w.clone());
        // Like SGLang's own server (asyncio sets TCP_NODELAY): without it every streamed
        // token waits for the client's delayed ACK, and a router benchmark measures Nagle.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let handle = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        *w.server.lock() = Some(handle);
        w
    }

    pub fn set_fault(&self, f: Fault) {
        *self.fault.lock() = f;
    }

    fn fault(&self) -> Fault {
        *self.fault.lock()
    }

    /// Like SIGKILL: the listener closes and every open stream breaks.
    pub fn kill(&self) {
        self.killed.cancel();
        if let Some(h) = self.server.lock().take() {
            h.abort();
        }
    }

    pub fn host(&self) -> &str {
        self.url
            .trim_start_matches("http://")
            .rsplit_once(':')
            .map(|(h, _)| h)
            .unwrap_or("")
    }
}

async fn hang_if(w: &MockWorker) {
    if w.fault() == Fault::Hang {
        w.killed.cancelled().await;
        std::future::pending::<()>().await;
    }
}

async fn health(State(w): State<Arc<MockWorker>>) -> StatusCode {
    hang_if(&w).await;
    StatusCode::OK
}

async fn server_info(State(w): State<Arc<MockWorker>>) -> axum::Json<Value> {
    let mode = match w.role {
        MockRole::Prefill => "prefill",
        MockRole::Decode => "decode",
    };
    axum::Json(json!({
        "model_path": "mock/model", "served_model_name": "mock-model", "dp_size": 1, "tp_size": 1,
        "disaggregation_mode": mode, "max_total_num_tokens": 65536,
    }))
}

async fn model_info() -> axum::Json<Value> {
    axum::Json(
        json!({"model_path": "mock/model", "tokenizer_path": "mock/model",
                      "is_generation": true, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}),
    )
}

fn bad(msg: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({"error": {"message": msg}})),
    )
        .into_response()
}

/// Why a request's bootstrap fields are refused (HTTP 400, as SGLang does).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum RoomsError {
    #[error("bootstrap_host missing")]
    HostMissing,
    #[error("bad bootstrap_port")]
    BadPort,
    #[error("bootstrap_room missing")]
    RoomMissing,
    #[error("bootstrap_room above 2^63-1")]
    RoomTooLarge,
    #[error("batch of {batch} with bootstrap arrays of {hosts}/{ports}/{rooms}")]
    ArrayLengths {
        batch: usize,
        hosts: usize,
        ports: usize,
        rooms: usize,
    },
    #[error("batch of {batch} without bootstrap arrays")]
    NotArrays { batch: usize },
}

/// The rooms a request names: one per sequence, checked against the batch's shape.
fn rooms_of(body: &Value) -> Result<Vec<(String, Option<u16>, u64)>, RoomsError> {
    let (host, port, room) = (
        &body["bootstrap_host"],
        &body["bootstrap_port"],
        &body["bootstrap_room"],
    );
    let one = |h: &Value, p: &Value, r: &Value| -> Result<(String, Option<u16>, u64), RoomsError> {
        let h = h.as_str().ok_or(RoomsError::HostMissing)?.to_string();
        let p = if p.is_null() {
            None
        } else {
            Some(
                p.as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or(RoomsError::BadPort)?,
            )
        };
        let r = r.as_u64().ok_or(RoomsError::RoomMissing)?;
        if r >= 1 << 63 {
            return Err(RoomsError::RoomTooLarge);
        }
        Ok((h, p, r))
    };
    let batch = body["text"]
        .as_array()
        .map(Vec::len)
        .or_else(|| {
            body["prompt"]
                .as_array()
                .filter(|a| !a.iter().all(Value::is_number))
                .map(Vec::len)
        })
        .or_else(|| body["n"].as_u64().filter(|&n| n > 1).map(|n| n as usize));
    match (batch, host, port, room) {
        (Some(n), Value::Array(h), Value::Array(p), Value::Array(r)) => {
            if h.len() != n || p.len() != n || r.len() != n {
                return Err(RoomsError::ArrayLengths {
                    batch: n,
                    hosts: h.len(),
                    ports: p.len(),
                    rooms: r.len(),
                });
            }
            (0..n).map(|i| one(&h[i], &p[i], &r[i])).collect()
        }
        (Some(n), ..) => Err(RoomsError::NotArrays { batch: n }),
        (None, ..) => Ok(vec![one(host, port, room)?]),
    }
}

async fn generate(
    State(w): State<Arc<MockWorker>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    w.requests.fetch_add(1, Ordering::Relaxed);
    hang_if(&w).await;
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return bad("body is not JSON");
    };
    let hdr = |name: &str| -> Value {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map_or(Value::Null, |s| json!(s))
    };
    let forwarded = json!({
        "x_request_id": hdr("x-request-id"),
        "traceparent": hdr("traceparent"),
        "authorization": hdr("authorization"),
    });
    *w.last.lock() = Some((body.clone(), headers));
    let rooms = match rooms_of(&body) {
        Ok(r) => r,
        Err(e) => return bad(&e.to_string()),
    };
    match w.fault() {
        Fault::Http500 => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "worker exploded").into_response();
        }
        Fault::Malformed if !body["stream"].as_bool().unwrap_or(false) => {
            return (StatusCode::OK, "{'text': 'a Python dict'}").into_response();
        }
        _ => {}
    }
    if w.role == MockRole::Prefill {
        for r in &rooms {
            // A prefill worker deposits under its own address: only a decode told this
            // worker's host and bootstrap port finds it.
            w.rendezvous
                .deposit((w.host().to_string(), w.bootstrap_port, r.2));
        }
        let mut meta = json!({"id": "p", "prompt_tokens": 3});
        if body["return_logprob"].as_bool() == Some(true) {
            meta["input_token_logprobs"] = json!([[null, 1, null], [-0.5, 2, null]]);
        }
        return axum::Json(json!({"text": "", "meta_info": meta})).into_response();
    }
    for r in &rooms {
        if !w.rendezvous.wait(r, w.room_timeout).await {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(json!({"error": {"message": format!("no KV arrived in room {r:?}")}})),
            )
                .into_response();
        }
    }
    let max_tokens = body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_new_tokens"].as_u64())
        .or_else(|| body["sampling_params"]["max_new_tokens"].as_u64())
        .unwrap_or(8) as usize;
    let seen = json!({
        "bootstrap_host": body["bootstrap_host"], "bootstrap_port": body["bootstrap_port"],
        "bootstrap_room": body["bootstrap_room"], "headers": forwarded,
    });
    if !body["stream"].as_bool().unwrap_or(false) {
        let text: String = (0..max_tokens).map(|i| format!("t{i} ")).collect();
        let mut meta = json!({"id": "d", "completion_tokens": max_tokens, "mock_seen": seen});
        if body["return_logprob"].as_bool() == Some(true) {
            meta["input_token_logprobs"] = json!([[-0.25, 3, null]]);
        }
        return axum::Json(json!({"text": text, "meta_info": meta,
            "choices": [{"index": 0, "text": text, "message": {"role": "assistant", "content": text}}]}))
            .into_response();
    }
    let fault = w.fault();
    let delay = w.token_delay;
    // Like SGLang: with `return_logprob` every stream chunk carries this worker's input logprobs.
    let logprobs = body["return_logprob"].as_bool() == Some(true);
    let top_n = body["top_logprobs_num"].as_u64().unwrap_or(0);
    let native = uri.path() == "/generate";
    let killed = w.killed.clone();
    let stream = futures::stream::unfold(0usize, move |i| {
        let killed = killed.clone();
        let seen = seen.clone();
        async move {
            if i > max_tokens {
                return None;
            }
            if let Fault::DropMidStream(n) = fault
                && i >= n
            {
                return Some((Err(std::io::Error::other("dropped")), i + 1));
            }
            if !delay.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = killed.cancelled() => return Some((Err(std::io::Error::other("killed")), i + 1)),
                }
            }
            if killed.is_cancelled() {
                return Some((Err(std::io::Error::other("killed")), i + 1));
            }
            let line = if i == max_tokens {
                "data: [DONE]\n\n".to_string()
            } else if fault == Fault::Malformed && i == 1 {
                "data: {'error': 'a Python dict'}\n\n".to_string()
            } else if native {
                // `/generate` as SGLang streams it by default: the text and the output ids so
                // far, and `meta_info` with the counts and, on the last event, the finish
                // reason. Output token i is id 100 + i, text "t{i} ", logprob -(i + 1) / 10.
                let text: String = (0..=i).map(|k| format!("t{k} ")).collect();
                let ids: Vec<usize> = (0..=i).map(|k| 100 + k).collect();
                let finish = if i + 1 == max_tokens {
                    json!({"type": "length", "length": max_tokens})
                } else {
                    Value::Null
                };
                let mut meta = json!({"id": "d", "prompt_tokens": 3, "completion_tokens": i + 1,
                                      "cached_tokens": 1, "finish_reason": finish});
                if logprobs {
                    let lp = |k: usize| json!([-((k + 1) as f64) / 10.0, 100 + k, null]);
                    meta["input_token_logprobs"] = json!([[-0.25, 3, null]]);
                    meta["output_token_logprobs"] = (0..=i).map(lp).collect();
                    if top_n > 0 {
                        meta["output_top_logprobs"] =
                            (0..=i).map(|k| json!([lp(k), [-5.0, 7, null]])).collect();
                    }
                }
                let chunk = json!({"text": text, "output_ids": ids, "meta_info": meta,
                                   "index": 0, "mock_seen": seen});
                format!("data: {chunk}\n\n")
            } else {
                let mut chunk = json!({"text": format!("t{i} "), "index": i, "mock_seen": seen,
                                   "choices": [{"index": 0, "text": format!("t{i} "), "delta": {"content": format!("t{i} ")}}]});
                if i + 1 == max_tokens {
                    chunk["choices"][0]["finish_reason"] = json!("length");
                    chunk["usage"] = json!({"prompt_tokens": 3, "completion_tokens": max_tokens,
                                            "prompt_tokens_details": {"cached_tokens": 1}});
                }
                if logprobs {
                    chunk["meta_info"] = json!({"input_token_logprobs": [[-0.25, 3, null]]});
                }
                format!("data: {chunk}\n\n")
            };
            Some((Ok::<_, std::io::Error>(line), i + 1))
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    r
}
