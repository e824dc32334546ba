//! `pdnode.v1.Inference` over SGLang workers: a gRPC client's `Generate` becomes a streamed
//! SGLang request through the same path as an HTTP client's (one prefill and one decode worker,
//! bootstrap fields, retries before the first byte, every wait under a deadline), and the
//! decode worker's SSE events become `TokenChunk`s and one `GenerateDone`.
//!
//! - `text` and `token_ids` prompts go to `/generate` (`text` / `input_ids`), whose events carry
//!   the output token ids, the text and, when asked, the logprobs. SGLang sends each of these
//!   either whole so far (its default) or as deltas (`--stream-output`); both are read.
//! - `chat` prompts go to `/v1/chat/completions`: the workers render their chat template.
//!   SGLang's chat events carry text but no token ids, so chunks of a chat stream have empty
//!   `token_ids`, and logprobs (token strings there, not ids) are refused for chat.
//!
//! Errors before the first event are the RPC status (mapped from the HTTP status the HTTP path
//! would have answered); an error event after it ends the stream with
//! `FINISH_REASON_ERROR`.

// Wire messages are built with `..Default::default()` even when every field is set today, so
// fields added to pdnode.v1 (additive within v1) do not break this code.
#![allow(clippy::needless_update)]

use crate::request::Route;
use crate::router::SglangRouter;
use crate::worker::WorkerRole;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use pdnode_core::{ErrorKind, Role, SamplingParams};
use pdnode_proto::convert::{error_message, role_filter_from_wire};
use pdnode_proto::v1;
use pdnode_proto::v1::generate_request::Prompt;
use pdnode_proto::v1::generate_response::Event;
use pdnode_router::grpc::{ApiKeyCheck, check_model_name};
use serde_json::{Map, Value, json};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

/// Largest error answer read from the router before the stream, bytes.
const MAX_ERROR: usize = 64 << 10;

/// Longest SSE line kept while waiting for its end, bytes (a worker that never ends a line
/// cannot grow the buffer without bound).
const MAX_LINE: usize = 64 << 20;

/// Metadata passed on to the workers as HTTP headers (the routing key picks the `manual`
/// policy's worker).
const FORWARDED: [&str; 5] = [
    "authorization",
    "x-request-id",
    "traceparent",
    "tracestate",
    pdnode_router::ROUTING_KEY_HEADER,
];

/// The `pdnode.v1.Inference` service over an [`SglangRouter`].
pub struct SglangInference {
    router: Arc<SglangRouter>,
}

impl SglangInference {
    pub fn new(router: Arc<SglangRouter>) -> Self {
        Self { router }
    }

    /// The tonic service: the API key is checked on the call's metadata before its message is
    /// read (`pdnode_router::grpc::ApiKeyCheck`).
    pub fn into_server(
        self,
    ) -> InterceptedService<v1::inference_server::InferenceServer<Self>, ApiKeyCheck> {
        let check = ApiKeyCheck::new(self.router.api_keys.clone(), || {
            Status::unauthenticated("missing or wrong API key (authorization: Bearer <key>)")
        });
        v1::inference_server::InferenceServer::with_interceptor(self, check)
    }
}

/// The route and JSON body an SGLang worker pair gets for `req` (always streamed).
pub fn request_body(req: &v1::GenerateRequest) -> Result<(Route, Value), Status> {
    let sampling: SamplingParams = req.sampling.clone().map(Into::into).unwrap_or_default();
    sampling
        .validate()
        .map_err(|e| Status::invalid_argument(format!("{}: {}", e.param, e.reason)))?;
    let mut body = Map::new();
    let route = match &req.prompt {
        None => return Err(Status::invalid_argument("prompt: the prompt is missing")),
        Some(Prompt::Text(t)) => {
            body.insert("text".into(), json!(t));
            Route::Generate
        }
        Some(Prompt::TokenIds(ids)) => {
            if ids.ids.is_empty() {
                return Err(Status::invalid_argument(
                    "token_ids: at least one token id is needed",
                ));
            }
            body.insert("input_ids".into(), json!(ids.ids));
            Route::Generate
        }
        Some(Prompt::Chat(c)) => {
            if c.messages.is_empty() {
                return Err(Status::invalid_argument(
                    "chat.messages: at least one message is needed",
                ));
            }
            if sampling.logprobs.is_some() {
                return Err(Status::invalid_argument(
                    "sampling.logprobs: SGLang's chat API returns logprobs of token strings, not \
                     ids; send the prompt as text or token_ids to get them",
                ));
            }
            let msgs: Vec<Value> = (c.messages.iter())
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            body.insert("messages".into(), Value::Array(msgs));
            Route::ChatCompletions
        }
    };
    body.insert("stream".into(), json!(true));
    if !req.model.is_empty() {
        body.insert("model".into(), json!(req.model));
    }
    let s = &sampling;
    let mut p = Map::new();
    p.insert("temperature".into(), json!(s.temperature));
    p.insert("top_p".into(), json!(s.top_p));
    if s.top_k > 0 {
        p.insert("top_k".into(), json!(s.top_k));
    }
    p.insert("min_p".into(), json!(s.min_p));
    p.insert("repetition_penalty".into(), json!(s.repetition_penalty));
    p.insert("presence_penalty".into(), json!(s.presence_penalty));
    p.insert("frequency_penalty".into(), json!(s.frequency_penalty));
    if !s.stop.is_empty() {
        p.insert("stop".into(), json!(s.stop));
    }
    if !s.stop_token_ids.is_empty() {
        p.insert("stop_token_ids".into(), json!(s.stop_token_ids));
    }
    p.insert("ignore_eos".into(), json!(s.ignore_eos));
    match route {
        Route::Generate => {
            p.insert("max_new_tokens".into(), json!(s.max_tokens));
            if let Some(seed) = s.seed {
                p.insert("sampling_seed".into(), json!(seed));
            }
            body.insert("sampling_params".into(), Value::Object(p));
            if let Some(n) = s.logprobs {
                body.insert("return_logprob".into(), json!(true));
                body.insert("top_logprobs_num".into(), json!(n));
            }
        }
        _ => {
            // The OpenAI routes take the sampling fields at the top level.
            p.insert("max_tokens".into(), json!(s.max_tokens));
            if let Some(seed) = s.seed {
                p.insert("seed".into(), json!(seed));
            }
            body.extend(p);
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    Ok((route, Value::Object(body)))
}

/// The gRPC status for an HTTP error answer of the router.
fn status_from_http(status: StatusCode, body: &[u8]) -> Status {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned());
    let message = format!("HTTP {}: {message}", status.as_u16());
    match status {
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => {
            Status::invalid_argument(message)
        }
        StatusCode::PAYLOAD_TOO_LARGE => Status::out_of_range(message),
        StatusCode::UNAUTHORIZED => Status::unauthenticated(message),
        StatusCode::FORBIDDEN => Status::permission_denied(message),
        StatusCode::NOT_FOUND => Status::not_found(message),
        StatusCode::TOO_MANY_REQUESTS => Status::resource_exhausted(message),
        StatusCode::GATEWAY_TIMEOUT | StatusCode::REQUEST_TIMEOUT => {
            Status::deadline_exceeded(message)
        }
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => Status::unavailable(message),
        s if s.is_client_error() => Status::failed_precondition(message),
        _ => Status::internal(message),
    }
}

/// Turns the decode worker's SSE events (as the router relays them) into `GenerateResponse`s.
#[derive(Debug)]
pub struct EventReader {
    route: Route,
    return_text: bool,
    client_request_id: String,
    /// Token ids sent to the client so far.
    ids_sent: usize,
    /// The text seen so far (SGLang's `/generate` sends the whole text at each event).
    text_seen: String,
    finish: Option<(v1::FinishReason, Option<v1::Error>)>,
    usage: Option<v1::Usage>,
    request_id: String,
    partial: Vec<u8>,
    /// The stream's last message was produced.
    pub done: bool,
}

impl EventReader {
    pub fn new(route: Route, return_text: bool, client_request_id: String) -> Self {
        Self {
            route,
            return_text,
            client_request_id,
            ids_sent: 0,
            text_seen: String::new(),
            finish: None,
            usage: None,
            request_id: String::new(),
            partial: Vec::new(),
            done: false,
        }
    }

    /// Feeds bytes of the SSE stream; returns the messages they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<v1::GenerateResponse> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.partial.extend_from_slice(bytes);
        while let Some(i) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=i).collect();
            self.line(&line[..i], &mut out);
            if self.done {
                self.partial.clear();
                return out;
            }
        }
        if self.partial.len() > MAX_LINE {
            self.partial.clear();
            out.push(self.fail(ErrorKind::Internal, "a worker event line is too long"));
        }
        out
    }

    /// The stream's end: the last message if it was not sent yet.
    pub fn finish(&mut self) -> Option<v1::GenerateResponse> {
        if self.done {
            return None;
        }
        Some(self.fail(
            ErrorKind::Unavailable,
            "the worker's stream ended without [DONE]",
        ))
    }

    fn fail(&mut self, kind: ErrorKind, message: &str) -> v1::GenerateResponse {
        self.finish = Some((v1::FinishReason::Error, Some(error_message(kind, message))));
        self.done_message()
    }

    fn done_message(&mut self) -> v1::GenerateResponse {
        self.done = true;
        let (reason, error) = self.finish.take().unwrap_or_else(|| {
            (
                v1::FinishReason::Error,
                Some(error_message(
                    ErrorKind::Internal,
                    "the worker's stream ended without a finish reason",
                )),
            )
        });
        v1::GenerateResponse {
            event: Some(Event::Done(v1::GenerateDone {
                finish_reason: reason as i32,
                usage: self.usage.take(),
                request_id: std::mem::take(&mut self.request_id),
                client_request_id: self.client_request_id.clone(),
                error,
                ..Default::default()
            })),
        }
    }

    fn line(&mut self, line: &[u8], out: &mut Vec<v1::GenerateResponse>) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return; // blank separators, comments, other SSE fields
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data == b"[DONE]" {
            out.push(self.done_message());
            return;
        }
        let ev: Value = match serde_json::from_slice(data) {
            Ok(v) => v,
            Err(e) => {
                out.push(self.fail(
                    ErrorKind::Internal,
                    &format!("a worker event is not JSON: {e}"),
                ));
                return;
            }
        };
        if let Some(err) = ev.get("error") {
            let message = err["message"]
                .as_str()
                .unwrap_or("the worker reported an error");
            out.push(self.fail(ErrorKind::Unavailable, message));
            return;
        }
        let chunk = match self.route {
            Route::Generate => self.generate_event(&ev),
            _ => self.chat_event(&ev),
        };
        if let Some(c) = chunk {
            out.push(v1::GenerateResponse {
                event: Some(Event::Chunk(c)),
            });
        }
    }

    /// One `/generate` event: `text`, `output_ids` and `meta_info`.
    fn generate_event(&mut self, ev: &Value) -> Option<v1::TokenChunk> {
        let meta = &ev["meta_info"];
        if let Some(id) = meta["id"].as_str() {
            self.request_id = id.to_string();
        }
        let completion = meta["completion_tokens"].as_u64();
        if let Some(u) = usage_of(meta) {
            self.usage = Some(u);
        }
        if let Some(f) = finish_of(&meta["finish_reason"]) {
            self.finish = Some(f);
        }
        let ids: Vec<u32> = (ev["output_ids"].as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect()
            })
            .unwrap_or_default();
        // Whole so far (SGLang's default) when the ids are as many as the completion tokens;
        // on the first event both readings agree.
        let whole =
            completion.is_some_and(|c| c as usize == ids.len()) && ids.len() >= self.ids_sent;
        let new_ids: Vec<u32> = if whole {
            ids[self.ids_sent..].to_vec()
        } else {
            ids
        };
        self.ids_sent += new_ids.len();
        let text = ev["text"].as_str().unwrap_or("");
        let delta = if text.starts_with(self.text_seen.as_str())
            && (whole || self.text_seen.is_empty() || new_ids.is_empty())
        {
            let d = text[self.text_seen.len()..].to_string();
            self.text_seen = text.to_string();
            d
        } else {
            self.text_seen.push_str(text);
            text.to_string()
        };
        let logprobs = logprobs_of(meta, new_ids.len());
        if new_ids.is_empty() && delta.is_empty() {
            return None;
        }
        Some(v1::TokenChunk {
            token_ids: new_ids,
            text: if self.return_text {
                delta
            } else {
                String::new()
            },
            logprobs,
            ..Default::default()
        })
    }

    /// One `/v1/chat/completions` event: `choices[0].delta.content`, then `usage`.
    fn chat_event(&mut self, ev: &Value) -> Option<v1::TokenChunk> {
        if let Some(id) = ev["id"].as_str() {
            self.request_id = id.to_string();
        }
        if let Some(u) = ev.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(v1::Usage {
                prompt_tokens: u32_of(&u["prompt_tokens"]),
                completion_tokens: u32_of(&u["completion_tokens"]),
                cached_prompt_tokens: u32_of(&u["prompt_tokens_details"]["cached_tokens"]),
                ..Default::default()
            });
        }
        let choice = &ev["choices"][0];
        if let Some(f) = finish_of(&choice["finish_reason"]) {
            self.finish = Some(f);
        }
        let text = choice["delta"]["content"].as_str().unwrap_or("");
        if text.is_empty() {
            return None;
        }
        Some(v1::TokenChunk {
            token_ids: Vec::new(),
            text: if self.return_text {
                text.to_string()
            } else {
                String::new()
            },
            ..Default::default()
        })
    }
}

fn u32_of(v: &Value) -> u32 {
    v.as_u64()
        .map_or(0, |x| u32::try_from(x).unwrap_or(u32::MAX))
}

fn usage_of(meta: &Value) -> Option<v1::Usage> {
    meta.get("completion_tokens")?;
    Some(v1::Usage {
        prompt_tokens: u32_of(&meta["prompt_tokens"]),
        completion_tokens: u32_of(&meta["completion_tokens"]),
        cached_prompt_tokens: u32_of(&meta["cached_tokens"]),
        ..Default::default()
    })
}

/// SGLang's finish reason: `{"type": "stop" | "length" | "abort", ...}` on `/generate`, a
/// string on the OpenAI routes; `null` while running.
fn finish_of(v: &Value) -> Option<(v1::FinishReason, Option<v1::Error>)> {
    let kind = v.as_str().or_else(|| v["type"].as_str())?;
    Some(match kind {
        "stop" | "eos" => (v1::FinishReason::Stop, None),
        "length" => (v1::FinishReason::Length, None),
        other => {
            let message = v["message"].as_str().map_or_else(
                || format!("the worker ended the request: {other}"),
                str::to_string,
            );
            (
                v1::FinishReason::Error,
                Some(error_message(ErrorKind::Internal, message)),
            )
        }
    })
}

/// The logprobs of the last `n` tokens: `meta_info.output_token_logprobs` entries
/// `[logprob, token_id, text?]` and `output_top_logprobs` lists of them (whole or deltas: the
/// last `n` entries are the new tokens' either way).
fn logprobs_of(meta: &Value, n: usize) -> Vec<v1::TokenLogprob> {
    let Some(lps) = meta["output_token_logprobs"].as_array() else {
        return Vec::new();
    };
    if n == 0 || lps.len() < n {
        return Vec::new();
    }
    let tops = meta["output_top_logprobs"].as_array();
    let entry = |e: &Value| -> (u32, f32) {
        let lp = e[0].as_f64().unwrap_or(f64::NEG_INFINITY) as f32;
        (u32_of(&e[1]), lp)
    };
    let first = lps.len() - n;
    (first..lps.len())
        .map(|i| {
            let (token_id, logprob) = entry(&lps[i]);
            let top = tops
                .and_then(|t| {
                    // The top lists line up with the token list from its end.
                    let j = (i + t.len()).checked_sub(lps.len())?;
                    t.get(j)?.as_array().cloned()
                })
                .unwrap_or_default()
                .iter()
                .map(|e| {
                    let (token_id, logprob) = entry(e);
                    v1::TopLogprob {
                        token_id,
                        logprob,
                        ..Default::default()
                    }
                })
                .collect();
            v1::TokenLogprob {
                token_id,
                logprob,
                top,
                ..Default::default()
            }
        })
        .collect()
}

type GenStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

struct StreamState {
    body: futures::stream::BoxStream<'static, Result<Bytes, axum::Error>>,
    reader: EventReader,
    queue: VecDeque<v1::GenerateResponse>,
}

#[tonic::async_trait]
impl v1::inference_server::Inference for SglangInference {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let mut headers = HeaderMap::new();
        for name in FORWARDED {
            if let Some(v) = request.metadata().get(name)
                && let Ok(v) = HeaderValue::from_bytes(v.as_bytes())
            {
                headers.insert(HeaderName::from_static(name), v);
            }
        }
        let req = request.into_inner();
        check_model_name(&req.model)
            .map_err(|r| Status::invalid_argument(format!("model: {r}")))?;
        if !req.model.is_empty() {
            let served = self.router.model_names();
            if !served.is_empty() && !served.contains(&req.model) {
                return Err(Status::not_found(format!(
                    "model {:?} is not served here (served: {})",
                    req.model,
                    served.join(", ")
                )));
            }
        }
        let (route, body) = request_body(&req)?;
        let body = Bytes::from(body.to_string());
        let resp = self.router.handle(route, headers, body).await;
        let status = resp.status();
        let body = resp.into_body();
        if !status.is_success() {
            let bytes = axum::body::to_bytes(body, MAX_ERROR)
                .await
                .unwrap_or_default();
            return Err(status_from_http(status, &bytes));
        }
        let st = StreamState {
            body: body.into_data_stream().boxed(),
            reader: EventReader::new(
                route,
                req.return_text.unwrap_or(true),
                req.client_request_id,
            ),
            queue: VecDeque::new(),
        };
        // The router's relay bounds every wait on the worker (token timeout, request deadline)
        // and ends a failed stream with an error event; a client that goes away drops this
        // stream, and with it the relay and the worker's connection.
        let s = futures::stream::unfold(st, |mut st| async move {
            loop {
                if let Some(m) = st.queue.pop_front() {
                    return Some((Ok(m), st));
                }
                if st.reader.done {
                    return None;
                }
                match st.body.next().await {
                    Some(Ok(b)) => st.queue.extend(st.reader.push(&b)),
                    Some(Err(e)) => {
                        let m = st.reader.fail(ErrorKind::Unavailable, &e.to_string());
                        st.queue.push_back(m);
                    }
                    None => st.queue.extend(st.reader.finish()),
                }
            }
        });
        Ok(Response::new(Box::pin(s)))
    }

    async fn health(
        &self,
        _request: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        let (p, d) = self.router.usable();
        let (status, detail) = if p > 0 && d > 0 {
            (v1::ServingStatus::Serving, String::new())
        } else {
            (
                v1::ServingStatus::NotServing,
                format!("{p} prefill and {d} decode SGLang workers usable"),
            )
        };
        Ok(Response::new(v1::HealthResponse {
            status: status as i32,
            detail,
            node_id: String::new(),
            role: v1::Role::Router as i32,
            version: env!("CARGO_PKG_VERSION").to_string(),
            ..Default::default()
        }))
    }

    async fn list_nodes(
        &self,
        request: Request<v1::ListNodesRequest>,
    ) -> Result<Response<v1::ListNodesResponse>, Status> {
        let filter = role_filter_from_wire("role", request.get_ref().role)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let roles: Vec<(WorkerRole, v1::Role)> = [
            (WorkerRole::Prefill, Role::Prefill, v1::Role::Prefill),
            (WorkerRole::Decode, Role::Decode, v1::Role::Decode),
        ]
        .into_iter()
        .filter(|(_, r, _)| filter.is_none_or(|f| f == *r))
        .map(|(w, _, v)| (w, v))
        .collect();
        let mut nodes = Vec::new();
        for (role, wire) in roles {
            for w in self.router.list(role).iter() {
                let info = w.info();
                let server = info.server_info.as_ref();
                let tp = server
                    .and_then(|s| s["tp_size"].as_u64())
                    .and_then(|t| u32::try_from(t).ok())
                    .unwrap_or(0);
                nodes.push(v1::NodeCard {
                    id: w.url.clone(),
                    role: wire as i32,
                    model_id: info.model_name().unwrap_or_default(),
                    tp_size: tp,
                    addresses: Some(v1::NodeAddresses {
                        http: Some(w.url.clone()),
                        ..Default::default()
                    }),
                    capacity: Some(v1::NodeCapacity {
                        running_requests: w.inflight(),
                        ..Default::default()
                    }),
                    ..Default::default()
                });
            }
        }
        Ok(Response::new(v1::ListNodesResponse {
            nodes,
            ..Default::default()
        }))
    }
}

#[cfg(test)]
mod tests;
