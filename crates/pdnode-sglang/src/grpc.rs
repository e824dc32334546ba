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
use serde_json::{Map, Value, json};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Largest error answer read from the router before the stream, bytes.
const MAX_ERROR: usize = 64 << 10;

/// Longest SSE line kept while waiting for its end, bytes (a worker that never ends a line
/// cannot grow the buffer without bound).
const MAX_LINE: usize = 64 << 20;

/// Metadata passed on to the workers as HTTP headers (the routing key picks the `manual`
/// policy's worker).
const FORWARDED: [&str; 4] = [
    "authorization",
    "x-request-id",
    "traceparent",
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

    pub fn into_server(self) -> v1::inference_server::InferenceServer<Self> {
        v1::inference_server::InferenceServer::new(self)
    }

    fn check_auth<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let h = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if pdnode_router::http::authorized(&self.router.api_keys, h) {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "missing or wrong API key (authorization: Bearer <key>)",
            ))
        }
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
        self.check_auth(&request)?;
        let mut headers = HeaderMap::new();
        for name in FORWARDED {
            if let Some(v) = request.metadata().get(name)
                && let Ok(v) = HeaderValue::from_bytes(v.as_bytes())
            {
                headers.insert(HeaderName::from_static(name), v);
            }
        }
        let req = request.into_inner();
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
        request: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        self.check_auth(&request)?;
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
        self.check_auth(&request)?;
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
mod tests {
    use super::*;

    fn chunks(out: &[v1::GenerateResponse]) -> (Vec<u32>, String) {
        let mut ids = Vec::new();
        let mut text = String::new();
        for m in out {
            if let Some(Event::Chunk(c)) = &m.event {
                ids.extend(&c.token_ids);
                text.push_str(&c.text);
            }
        }
        (ids, text)
    }

    fn done(out: &[v1::GenerateResponse]) -> &v1::GenerateDone {
        match out.last().and_then(|m| m.event.as_ref()) {
            Some(Event::Done(d)) => d,
            other => panic!("the last message is not done: {other:?}"),
        }
    }

    fn ev(v: Value) -> Vec<u8> {
        format!("data: {v}\n\n").into_bytes()
    }

    #[test]
    fn whole_so_far_events_become_deltas() {
        let mut r = EventReader::new(Route::Generate, true, "c1".into());
        let mut out = Vec::new();
        out.extend(r.push(&ev(json!({"text": "He", "output_ids": [5],
            "meta_info": {"id": "r1", "completion_tokens": 1, "finish_reason": null}}))));
        out.extend(r.push(&ev(json!({"text": "Hello", "output_ids": [5, 6],
            "meta_info": {"id": "r1", "completion_tokens": 2, "prompt_tokens": 3, "cached_tokens": 1,
                          "finish_reason": {"type": "length", "length": 2}}}))));
        out.extend(r.push(b"data: [DONE]\n\n"));
        assert_eq!(chunks(&out), (vec![5, 6], "Hello".to_string()));
        let d = done(&out);
        assert_eq!(d.finish_reason, v1::FinishReason::Length as i32);
        assert_eq!(d.request_id, "r1");
        assert_eq!(d.client_request_id, "c1");
        let u = d.usage.as_ref().unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
            (3, 2, 1)
        );
        assert!(r.done && r.finish().is_none());
    }

    #[test]
    fn delta_events_and_split_lines_are_read_too() {
        let mut r = EventReader::new(Route::Generate, true, String::new());
        let a = ev(json!({"text": "ab", "output_ids": [1],
            "meta_info": {"completion_tokens": 1, "finish_reason": null}}));
        let b = ev(json!({"text": "ab", "output_ids": [2],
            "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "stop", "matched": 2}}}));
        let all = [a, b, b"data: [DONE]\n\n".to_vec()].concat();
        let mut out = Vec::new();
        for piece in all.chunks(7) {
            out.extend(r.push(piece));
        }
        // Incremental output_ids (fewer than completion_tokens): the second "ab" is new text.
        assert_eq!(chunks(&out), (vec![1, 2], "abab".to_string()));
        assert_eq!(done(&out).finish_reason, v1::FinishReason::Stop as i32);
    }

    #[test]
    fn logprobs_of_the_new_tokens_only() {
        let mut r = EventReader::new(Route::Generate, false, String::new());
        let mut out = r.push(&ev(json!({"text": "x", "output_ids": [7],
            "meta_info": {"completion_tokens": 1,
                          "output_token_logprobs": [[-0.5, 7, null]],
                          "output_top_logprobs": [[[-0.5, 7, null], [-1.5, 8, null]]]}})));
        out.extend(r.push(&ev(json!({"text": "xy", "output_ids": [7, 9],
            "meta_info": {"completion_tokens": 2,
                          "output_token_logprobs": [[-0.5, 7, null], [-0.25, 9, null]],
                          "output_top_logprobs": [[[-0.5, 7, null]], [[-0.25, 9, null], [-2.0, 3, null]]],
                          "finish_reason": {"type": "length"}}}))));
        let lps: Vec<&v1::TokenLogprob> = out
            .iter()
            .filter_map(|m| match &m.event {
                Some(Event::Chunk(c)) => Some(&c.logprobs),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(lps.len(), 2);
        assert_eq!((lps[0].token_id, lps[0].logprob), (7, -0.5));
        assert_eq!(lps[0].top.len(), 2);
        assert_eq!((lps[1].token_id, lps[1].logprob), (9, -0.25));
        assert_eq!((lps[1].top[1].token_id, lps[1].top[1].logprob), (3, -2.0));
        // return_text = false: no text, the ids still come.
        assert_eq!(chunks(&out), (vec![7, 9], String::new()));
    }

    #[test]
    fn error_events_malformed_lines_and_cut_streams_end_with_an_error() {
        let mut r = EventReader::new(Route::Generate, true, String::new());
        let out = r.push(b"data: {\"error\": {\"message\": \"decode broke\"}}\n\n");
        let d = done(&out);
        assert_eq!(d.finish_reason, v1::FinishReason::Error as i32);
        assert!(d.error.as_ref().unwrap().message.contains("decode broke"));

        let mut r = EventReader::new(Route::Generate, true, String::new());
        let out = r.push(b"data: {'text': 'a Python dict'}\n\n");
        assert!(
            done(&out)
                .error
                .as_ref()
                .unwrap()
                .message
                .contains("not JSON")
        );

        let mut r = EventReader::new(Route::Generate, true, String::new());
        let mut out = r.push(&ev(
            json!({"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}}),
        ));
        out.extend(r.finish());
        let d = done(&out);
        assert_eq!(d.finish_reason, v1::FinishReason::Error as i32);
        assert!(d.error.as_ref().unwrap().message.contains("without [DONE]"));

        // [DONE] with no finish reason ever seen is not a success either.
        let mut r = EventReader::new(Route::Generate, true, String::new());
        let out = r.push(b"data: [DONE]\n\n");
        assert_eq!(done(&out).finish_reason, v1::FinishReason::Error as i32);

        // An abort carries the worker's message.
        let mut r = EventReader::new(Route::Generate, true, String::new());
        let mut out = r.push(&ev(
            json!({"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0,
            "finish_reason": {"type": "abort", "message": "prompt too long"}}}),
        ));
        out.extend(r.push(b"data: [DONE]\n\n"));
        assert!(
            done(&out)
                .error
                .as_ref()
                .unwrap()
                .message
                .contains("prompt too long")
        );
    }

    #[test]
    fn chat_events_give_text_and_usage() {
        let mut r = EventReader::new(Route::ChatCompletions, true, String::new());
        let mut out = Vec::new();
        for e in [
            json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            json!({"id": "c", "choices": [{"index": 0, "delta": {"content": "Pa"}}]}),
            json!({"id": "c", "choices": [{"index": 0, "delta": {"content": "ris"}, "finish_reason": "stop"}]}),
            json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                   "prompt_tokens_details": {"cached_tokens": 4}}}),
        ] {
            out.extend(r.push(&ev(e)));
        }
        out.extend(r.push(b"data: [DONE]\n\n"));
        assert_eq!(chunks(&out), (vec![], "Paris".to_string()));
        let d = done(&out);
        assert_eq!(d.finish_reason, v1::FinishReason::Stop as i32);
        assert_eq!(d.request_id, "c");
        let u = d.usage.as_ref().unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
            (9, 2, 4)
        );
    }

    #[test]
    fn bodies_carry_the_prompt_and_the_sampling_fields() {
        let req = v1::GenerateRequest {
            prompt: Some(Prompt::TokenIds(v1::TokenIds { ids: vec![1, 2, 3] })),
            sampling: Some(v1::SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(5),
                seed: Some(7),
                logprobs: Some(2),
                stop: vec!["\n".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let (route, body) = request_body(&req).unwrap();
        assert_eq!(route, Route::Generate);
        assert_eq!(body["input_ids"], json!([1, 2, 3]));
        assert_eq!(body["stream"], json!(true));
        assert_eq!(body["sampling_params"]["max_new_tokens"], json!(5));
        assert_eq!(body["sampling_params"]["temperature"], json!(0.0));
        assert_eq!(body["sampling_params"]["sampling_seed"], json!(7));
        assert_eq!(body["sampling_params"]["stop"], json!(["\n"]));
        assert!(body["sampling_params"].get("top_k").is_none());
        assert_eq!(body["return_logprob"], json!(true));
        assert_eq!(body["top_logprobs_num"], json!(2));

        let chat = v1::GenerateRequest {
            model: "m".into(),
            prompt: Some(Prompt::Chat(v1::ChatMessages {
                messages: vec![v1::ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
            ..Default::default()
        };
        let (route, body) = request_body(&chat).unwrap();
        assert_eq!(route, Route::ChatCompletions);
        assert_eq!(body["messages"][0]["content"], json!("hi"));
        assert_eq!(body["model"], json!("m"));
        assert_eq!(body["max_tokens"], json!(16));
        assert_eq!(body["stream_options"]["include_usage"], json!(true));

        // Refused before any worker is asked.
        let mut bad = chat.clone();
        bad.sampling = Some(v1::SamplingParams {
            logprobs: Some(1),
            ..Default::default()
        });
        assert_eq!(
            request_body(&bad).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        let none = v1::GenerateRequest::default();
        assert_eq!(
            request_body(&none).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        let temp = v1::GenerateRequest {
            prompt: Some(Prompt::Text("a".into())),
            sampling: Some(v1::SamplingParams {
                temperature: Some(-1.0),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            request_body(&temp).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }

    #[test]
    fn http_errors_map_to_grpc_codes() {
        let b = br#"{"error": {"message": "no usable decode worker"}}"#;
        let s = status_from_http(StatusCode::SERVICE_UNAVAILABLE, b);
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(s.message().contains("no usable decode worker"));
        assert_eq!(
            status_from_http(StatusCode::GATEWAY_TIMEOUT, b"").code(),
            tonic::Code::DeadlineExceeded
        );
        assert_eq!(
            status_from_http(StatusCode::TOO_MANY_REQUESTS, b"").code(),
            tonic::Code::ResourceExhausted
        );
        assert_eq!(
            status_from_http(StatusCode::BAD_REQUEST, b"x").code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            status_from_http(StatusCode::BAD_GATEWAY, b"x").code(),
            tonic::Code::Unavailable
        );
    }
}
