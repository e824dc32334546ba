//! `/v1/completions` and `/v1/chat/completions`: parse, tokenize, admit, then answer in one JSON
//! body or as server-sent events ending with `data: [DONE]`.

use super::openai::{self, ChatRequest, CompletionRequest, PromptInput};
use super::{AppState, MAX_BODY_BYTES, error_body_for};
use crate::error::RouterError;
use crate::router::{GenEvent, GenRequest, Generation, Router, Usage};
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream, StreamExt};
use pdnode_core::request::TokenLogprob;
use pdnode_core::{FinishReason, RequestId};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Completion,
    Chat,
}

impl Api {
    /// The request field holding the prompt, named by a context-length error (as OpenAI does).
    fn prompt_param(self) -> &'static str {
        match self {
            Api::Completion => "prompt",
            Api::Chat => "messages",
        }
    }
}

/// The OpenAI-style error response of `e` on the `api` endpoint.
fn error_response(e: &RouterError, api: Api) -> Response {
    let (status, body) = error_body_for(e, api.prompt_param());
    super::with_retry_after(e, (status, axum::Json(body)).into_response())
}

/// What shapes the response.
struct Shape {
    api: Api,
    model: String,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

/// The request's body, at most [`MAX_BODY_BYTES`], whole within `router.client_send_timeout_s`.
async fn read_body(
    router: &Router,
    headers: &HeaderMap,
    body: Body,
) -> Result<bytes::Bytes, RouterError> {
    let wait = router.deps().config.client_send_timeout_s;
    super::read_body_within(
        headers,
        body,
        MAX_BODY_BYTES,
        std::time::Duration::from_secs(wait),
    )
    .await
    .map_err(|e| match e {
        super::BodyRead::TooLarge => RouterError::BodyTooLarge {
            limit: MAX_BODY_BYTES,
        },
        super::BodyRead::TimedOut => RouterError::BodyTimeout { after_s: wait },
    })
}

fn check_model(router: &Router, model: &Option<String>) -> Result<String, RouterError> {
    let served = &router.deps().model.served_name;
    match model.as_deref() {
        None | Some("") => Ok(served.clone()),
        Some(m) if m == served => Ok(served.clone()),
        Some(m) => Err(RouterError::UnknownModel {
            model: m.to_string(),
            served: served.clone(),
        }),
    }
}

fn encode(router: &Router, text: &str, special: bool) -> Result<Vec<u32>, RouterError> {
    router
        .deps()
        .tokenizer
        .encode(text, special)
        .map_err(|e| RouterError::Tokenize { message: e.0 })
}

pub(super) async fn completions(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match completions_inner(st.router, headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e, Api::Completion),
    }
}

async fn completions_inner(
    router: Arc<Router>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, RouterError> {
    let bytes = read_body(&router, &headers, body).await?;
    let req: CompletionRequest = openai::parse(&bytes)?;
    req.check_unsupported()?;
    let common = req.common();
    let model = check_model(&router, &common.model)?;
    let tokens = match req.prompt.clone().into_input()? {
        // vLLM's default for completions: add the model's special tokens (BOS).
        PromptInput::Text(s) => encode(&router, &s, common.add_special_tokens.unwrap_or(true))?,
        PromptInput::Tokens(t) => t,
    };
    let sampling = common.sampling(16, req.logprobs)?;
    let shape = Shape {
        api: Api::Completion,
        model,
        stream: common.stream(),
        include_usage: common.include_usage(),
        logprobs: req.logprobs.is_some(),
    };
    submit(router, &headers, tokens, sampling, "completions", shape).await
}

pub(super) async fn chat(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match chat_inner(st.router, headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e, Api::Chat),
    }
}

async fn chat_inner(
    router: Arc<Router>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, RouterError> {
    let bytes = read_body(&router, &headers, body).await?;
    let req: ChatRequest = openai::parse(&bytes)?;
    req.check_unsupported()?;
    let common = req.common();
    let model = check_model(&router, &common.model)?;
    let messages = req.messages()?;
    let text = router
        .deps()
        .chat
        .render(&messages)
        .map_err(|e| RouterError::Tokenize { message: e.0 })?;
    // The chat template writes the special tokens itself (vLLM's default: false).
    let tokens = encode(&router, &text, common.add_special_tokens.unwrap_or(false))?;
    let ctx = router.deps().model.context_length;
    let default_max = ctx.saturating_sub(tokens.len() as u32).max(1);
    let logprobs = (req.logprobs == Some(true)).then(|| req.top_logprobs.unwrap_or(0));
    let sampling = common.sampling(default_max, logprobs)?;
    let shape = Shape {
        api: Api::Chat,
        model,
        stream: common.stream(),
        include_usage: common.include_usage(),
        logprobs: logprobs.is_some(),
    };
    submit(router, &headers, tokens, sampling, "chat", shape).await
}

/// Places the request (routing key and SLO from the headers; the client's W3C `traceparent`, if
/// any, parents its trace) and answers in the request's shape.
async fn submit(
    router: Arc<Router>,
    headers: &HeaderMap,
    prompt_token_ids: Vec<u32>,
    sampling: pdnode_core::SamplingParams,
    endpoint: &'static str,
    shape: Shape,
) -> Result<Response, RouterError> {
    let header = |name: &str| headers.get(name).map(|v| v.as_bytes());
    let req = GenRequest {
        prompt_token_ids,
        sampling,
        endpoint,
        routing_key: crate::router::routing_key(header(crate::router::ROUTING_KEY_HEADER))?,
        slo: crate::router::Slo::from_values(
            header(crate::router::SLO_TTFT_HEADER),
            header(crate::router::SLO_TPOT_HEADER),
        )?,
    };
    let generation = router
        .generate_queued(req, pdnode_telemetry::Remote::from_headers(headers))
        .await?;
    respond(router, generation, shape).await
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn response_id(api: Api, id: RequestId) -> String {
    match api {
        Api::Completion => format!("cmpl-{id}"),
        Api::Chat => format!("chatcmpl-{id}"),
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn token_str(router: &Router, id: u32) -> String {
    router.deps().tokenizer.decode(&[id]).unwrap_or_default()
}

/// Logprobs in the shape of each API.
fn logprobs_json(router: &Router, api: Api, lps: &[TokenLogprob]) -> Value {
    match api {
        Api::Completion => {
            let tokens: Vec<String> = lps.iter().map(|l| token_str(router, l.token_id)).collect();
            let top: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let m: serde_json::Map<String, Value> = l
                        .top
                        .iter()
                        .map(|(t, p)| (token_str(router, *t), json!(p)))
                        .collect();
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": tokens,
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": top,
            })
        }
        Api::Chat => {
            let content: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let s = token_str(router, l.token_id);
                    let top: Vec<Value> = l
                        .top
                        .iter()
                        .map(|(t, p)| {
                            let ts = token_str(router, *t);
                            json!({"token": ts, "logprob": p, "bytes": ts.as_bytes()})
                        })
                        .collect();
                    json!({"token": s, "logprob": l.logprob, "bytes": s.as_bytes(), "top_logprobs": top})
                })
                .collect();
            json!({"content": content})
        }
    }
}

async fn respond(
    router: Arc<Router>,
    mut generation: Generation,
    shape: Shape,
) -> Result<Response, RouterError> {
    // Errors before the first token become the HTTP status.
    let first = match generation.events.recv().await {
        None => {
            return Err(RouterError::Internal {
                message: "the request ended without a result".into(),
            });
        }
        Some(GenEvent::Error(e)) => return Err(e),
        Some(ev) => ev,
    };
    if shape.stream {
        Ok(sse(router, generation, first, shape).into_response())
    } else {
        whole(router, generation, first, shape).await
    }
}

async fn whole(
    router: Arc<Router>,
    mut generation: Generation,
    first: GenEvent,
    shape: Shape,
) -> Result<Response, RouterError> {
    let mut text = String::new();
    let mut lps: Vec<TokenLogprob> = Vec::new();
    let mut ev = Some(first);
    let (finish, usage) = loop {
        match ev.take() {
            Some(GenEvent::Tokens {
                text: t, logprobs, ..
            }) => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Some(GenEvent::Done { finish, usage }) => break (finish, usage),
            Some(GenEvent::Error(e)) => return Err(e),
            None => {
                return Err(RouterError::Internal {
                    message: "the request ended without a finish".into(),
                });
            }
        }
        ev = generation.events.recv().await;
    };
    let logprobs = if shape.logprobs {
        logprobs_json(&router, shape.api, &lps)
    } else {
        Value::Null
    };
    let choice = match shape.api {
        Api::Completion => json!({
            "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.as_str(),
        }),
        Api::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish.as_str(),
        }),
    };
    let body = json!({
        "id": response_id(shape.api, generation.request_id),
        "object": if shape.api == Api::Chat { "chat.completion" } else { "text_completion" },
        "created": now_s(),
        "model": shape.model,
        "choices": [choice],
        "usage": usage_json(&usage),
    });
    Ok(axum::Json(body).into_response())
}

struct SseState {
    router: Arc<Router>,
    generation: Generation,
    shape: Shape,
    pending: Option<GenEvent>,
    started: bool,
    done: bool,
    created: u64,
}

fn chunk(st: &SseState, choice: Option<Value>, usage: Option<&Usage>) -> Event {
    let mut v = json!({
        "id": response_id(st.shape.api, st.generation.request_id),
        "object": if st.shape.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": st.created,
        "model": st.shape.model,
        "choices": choice.map(|c| vec![c]).unwrap_or_default(),
    });
    if let Some(u) = usage {
        v["usage"] = usage_json(u);
    }
    Event::default().data(v.to_string())
}

fn delta_choice(
    st: &SseState,
    text: &str,
    lps: &[TokenLogprob],
    finish: Option<FinishReason>,
) -> Value {
    let logprobs = if st.shape.logprobs && !lps.is_empty() {
        logprobs_json(&st.router, st.shape.api, lps)
    } else {
        Value::Null
    };
    let finish = finish.map(|f| f.as_str());
    match st.shape.api {
        Api::Completion => {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
        }
        Api::Chat => {
            let delta = if text.is_empty() && finish.is_some() {
                json!({})
            } else {
                json!({"content": text})
            };
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        }
    }
}

fn sse(
    router: Arc<Router>,
    generation: Generation,
    first: GenEvent,
    shape: Shape,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let st = SseState {
        router,
        generation,
        shape,
        pending: Some(first),
        started: false,
        done: false,
        created: now_s(),
    };
    let s = stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out: Vec<Event> = Vec::new();
        if !st.started {
            st.started = true;
            if st.shape.api == Api::Chat {
                let c = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                out.push(chunk(&st, Some(c), None));
            }
        }
        let ev = match st.pending.take() {
            Some(ev) => Some(ev),
            None => st.generation.events.recv().await,
        };
        match ev {
            Some(GenEvent::Tokens { text, logprobs, .. }) => {
                if !text.is_empty() || (st.shape.logprobs && !logprobs.is_empty()) {
                    let c = delta_choice(&st, &text, &logprobs, None);
                    out.push(chunk(&st, Some(c), None));
                }
            }
            Some(GenEvent::Done { finish, usage }) => {
                let c = delta_choice(&st, "", &[], Some(finish));
                out.push(chunk(&st, Some(c), None));
                if st.shape.include_usage {
                    out.push(chunk(&st, None, Some(&usage)));
                }
                out.push(Event::default().data("[DONE]"));
                st.done = true;
            }
            Some(GenEvent::Error(e)) => {
                out.push(Event::default().data(error_body_for(&e, st.shape.api.prompt_param()).1.to_string()));
                out.push(Event::default().data("[DONE]"));
                st.done = true;
            }
            None => {
                let e = RouterError::Internal {
                    message: "the request ended without a finish".into(),
                };
                out.push(Event::default().data(error_body_for(&e, st.shape.api.prompt_param()).1.to_string()));
                out.push(Event::default().data("[DONE]"));
                st.done = true;
            }
        }
        Some((stream::iter(out.into_iter().map(Ok)), st))
    })
    .flatten();
    Sse::new(s)
}
