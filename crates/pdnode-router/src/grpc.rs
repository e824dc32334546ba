//! The `pdnode.v1.Inference` gRPC frontend: `Generate` (server streaming), `Health`,
//! `ListNodes`. API keys come as `authorization: Bearer <key>` metadata.

// Wire messages are built with `..Default::default()` even when every field is set today, so
// fields added to pdnode.v1 (additive within v1) do not break this code.
#![allow(clippy::needless_update)]

use crate::error::RouterError;
use crate::router::{GenEvent, GenRequest, Router};
use crate::tokenize::ChatMessage;
use futures::Stream;
use futures::stream;
use pdnode_core::{FinishReason, Role, SamplingParams};
use pdnode_proto::convert::{
    error_message, finish_reason_to_wire, role_filter_from_wire, status_of,
};
use pdnode_proto::v1;
use pdnode_proto::v1::generate_request::Prompt;
use pdnode_proto::v1::generate_response::Event;
use std::pin::Pin;
use std::sync::Arc;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

pub struct InferenceService {
    router: Arc<Router>,
}

/// The longest `model` a client may name (a served name is far shorter); a longer one is refused
/// before it is echoed into any error (a gRPC status travels in a header).
pub const MAX_MODEL_NAME: usize = 256;

/// A `model` longer than [`MAX_MODEL_NAME`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{len} bytes, more than the {MAX_MODEL_NAME} a model name may have")]
pub struct ModelNameTooLong {
    pub len: usize,
}

/// Refuses a `model` longer than [`MAX_MODEL_NAME`].
pub fn check_model_name(model: &str) -> Result<(), ModelNameTooLong> {
    if model.len() > MAX_MODEL_NAME {
        return Err(ModelNameTooLong { len: model.len() });
    }
    Ok(())
}

/// The bearer API key check of a client-facing gRPC service, run on the call's metadata
/// before tonic reads its message: an unauthenticated caller gets `UNAUTHENTICATED` and no
/// request body is buffered for it. No keys: every call passes.
#[derive(Clone)]
pub struct ApiKeyCheck {
    keys: Arc<[String]>,
    refused: fn() -> Status,
}

impl ApiKeyCheck {
    /// `refused` makes the status a refused call gets.
    pub fn new(keys: Vec<String>, refused: fn() -> Status) -> Self {
        Self {
            keys: keys.into(),
            refused,
        }
    }
}

impl tonic::service::Interceptor for ApiKeyCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let h = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if crate::http::authorized(&self.keys, h) {
            Ok(req)
        } else {
            Err((self.refused)())
        }
    }
}

impl InferenceService {
    pub fn new(router: Arc<Router>) -> Self {
        Self { router }
    }

    /// The tonic service, ready to add to a server: the API key is checked on the call's
    /// metadata before its message is read ([`ApiKeyCheck`]).
    pub fn into_server(
        self,
    ) -> InterceptedService<v1::inference_server::InferenceServer<Self>, ApiKeyCheck> {
        let check = ApiKeyCheck::new(self.router.deps().api_keys.clone(), || {
            status_of(&RouterError::Unauthenticated)
        });
        v1::inference_server::InferenceServer::with_interceptor(self, check)
    }

    fn prepare(&self, req: v1::GenerateRequest) -> Result<GenRequest, RouterError> {
        let deps = self.router.deps();
        check_model_name(&req.model).map_err(|e| RouterError::param("model", e.to_string()))?;
        if !req.model.is_empty() && req.model != deps.model.served_name {
            return Err(RouterError::UnknownModel {
                model: req.model,
                served: deps.model.served_name.clone(),
            });
        }
        let tok = |text: &str, special: bool| {
            deps.tokenizer
                .encode(text, special)
                .map_err(|e| RouterError::Tokenize { message: e.0 })
        };
        let tokens = match req.prompt {
            None => return Err(RouterError::param("prompt", "the prompt is missing")),
            Some(Prompt::Text(t)) => tok(&t, true)?,
            Some(Prompt::TokenIds(ids)) => ids.ids,
            Some(Prompt::Chat(c)) => {
                if c.messages.is_empty() {
                    return Err(RouterError::param(
                        "chat.messages",
                        "at least one message is needed",
                    ));
                }
                let msgs = c
                    .messages
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| {
                        let role = crate::http::openai::chat_role(&m.role, || {
                            format!("chat.messages[{i}].role")
                        })?;
                        Ok(ChatMessage {
                            role: role.to_string(),
                            content: m.content,
                        })
                    })
                    .collect::<Result<Vec<_>, RouterError>>()?;
                let text = deps
                    .chat
                    .render(&msgs)
                    .map_err(|e| RouterError::Tokenize { message: e.0 })?;
                tok(&text, false)?
            }
        };
        let sampling: SamplingParams = req.sampling.map(Into::into).unwrap_or_default();
        sampling
            .validate()
            .map_err(|e| RouterError::param(e.param, e.reason))?;
        Ok(GenRequest {
            prompt_token_ids: tokens,
            sampling,
            endpoint: "grpc",
            routing_key: None,
            slo: Default::default(),
        })
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

fn usage_wire(u: &crate::router::Usage) -> v1::Usage {
    v1::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_prompt_tokens: u.cached_tokens,
        ..Default::default()
    }
}

struct StreamState {
    events: tokio::sync::mpsc::Receiver<GenEvent>,
    pending: Option<GenEvent>,
    done: bool,
    request_id: String,
    client_request_id: String,
    return_text: bool,
}

#[tonic::async_trait]
impl v1::inference_server::Inference for InferenceService {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let key = crate::router::routing_key(
            request
                .metadata()
                .get(crate::router::ROUTING_KEY_HEADER)
                .map(|v| v.as_bytes()),
        )
        .map_err(|e| status_of(&e))?;
        let slo = crate::router::Slo::from_values(
            request
                .metadata()
                .get(crate::router::SLO_TTFT_HEADER)
                .map(|v| v.as_bytes()),
            request
                .metadata()
                .get(crate::router::SLO_TPOT_HEADER)
                .map(|v| v.as_bytes()),
        )
        .map_err(|e| status_of(&e))?;
        // The client's W3C `traceparent` metadata, if any, parents the request's trace.
        let remote = pdnode_telemetry::Remote::from_metadata(request.metadata());
        let req = request.into_inner();
        let client_request_id = req.client_request_id.clone();
        let return_text = req.return_text.unwrap_or(true);
        let mut gen_req = self.prepare(req).map_err(|e| status_of(&e))?;
        gen_req.routing_key = key;
        gen_req.slo = slo;
        let mut generation = self
            .router
            .generate_queued(gen_req, remote)
            .await
            .map_err(|e| status_of(&e))?;
        // Errors before the first token are the RPC status.
        let first = match generation.events.recv().await {
            None => {
                return Err(status_of(&RouterError::Internal {
                    message: "the request ended without a result".into(),
                }));
            }
            Some(GenEvent::Error(e)) => return Err(status_of(&e)),
            Some(ev) => ev,
        };
        let st = StreamState {
            events: generation.events,
            pending: Some(first),
            done: false,
            request_id: generation.request_id.to_string(),
            client_request_id,
            return_text,
        };
        let s = stream::unfold(st, |mut st| async move {
            if st.done {
                return None;
            }
            let ev = match st.pending.take() {
                Some(ev) => Some(ev),
                None => st.events.recv().await,
            };
            let done = |st: &StreamState,
                        finish: FinishReason,
                        usage: Option<v1::Usage>,
                        error: Option<v1::Error>| {
                Event::Done(v1::GenerateDone {
                    finish_reason: finish_reason_to_wire(Some(finish)),
                    usage,
                    request_id: st.request_id.clone(),
                    client_request_id: st.client_request_id.clone(),
                    error,
                    ..Default::default()
                })
            };
            let event = match ev {
                Some(GenEvent::Tokens {
                    token_ids,
                    text,
                    logprobs,
                }) => Event::Chunk(v1::TokenChunk {
                    token_ids,
                    text: if st.return_text { text } else { String::new() },
                    logprobs: logprobs.iter().map(Into::into).collect(),
                    ..Default::default()
                }),
                Some(GenEvent::Done { finish, usage }) => {
                    st.done = true;
                    done(&st, finish, Some(usage_wire(&usage)), None)
                }
                Some(GenEvent::Error(e)) => {
                    st.done = true;
                    let err = error_message(pdnode_core::error::Classify::kind(&e), e.to_string());
                    done(&st, FinishReason::Error, None, Some(err))
                }
                None => {
                    st.done = true;
                    let err = error_message(
                        pdnode_core::ErrorKind::Internal,
                        "the request ended without a finish",
                    );
                    done(&st, FinishReason::Error, None, Some(err))
                }
            };
            Some((Ok(v1::GenerateResponse { event: Some(event) }), st))
        });
        Ok(Response::new(Box::pin(s)))
    }

    async fn health(
        &self,
        _request: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        let (p, d) = self.router.usable_nodes();
        let (status, detail) = if self.router.is_draining() {
            (v1::ServingStatus::NotServing, "shutting down".to_string())
        } else if p > 0 && d > 0 {
            (v1::ServingStatus::Serving, String::new())
        } else {
            (
                v1::ServingStatus::NotServing,
                format!("{p} prefill and {d} decode nodes available"),
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
        let filter =
            role_filter_from_wire("role", request.get_ref().role).map_err(|e| status_of(&e))?;
        let roles: Vec<Role> = match filter {
            Some(r) => vec![r],
            None => vec![Role::Prefill, Role::Decode],
        };
        let mem = &self.router.deps().membership;
        // A role-`all` node is a prefill and a decode worker: list it once, as role `all`.
        let mut seen = std::collections::HashSet::new();
        let nodes = roles
            .into_iter()
            .flat_map(|r| mem.workers(r))
            .filter(|w| seen.insert(w.card.id.clone()))
            .map(|w| v1::NodeCard::from(&w.card))
            .collect();
        Ok(Response::new(v1::ListNodesResponse {
            nodes,
            ..Default::default()
        }))
    }
}
