//! The OpenAI-compatible HTTP frontend (axum): `/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, `/health`, `/metrics`.

mod completions;
pub mod openai;

use crate::error::RouterError;
use crate::router::Router;
use axum::Router as AxumRouter;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pdnode_core::error::Classify;
use serde_json::json;
use std::sync::Arc;

/// Largest request body accepted (413 above).
pub const MAX_BODY_BYTES: usize = 8 << 20;

#[derive(Clone)]
pub(crate) struct AppState {
    pub router: Arc<Router>,
}

/// The HTTP service over `router`.
pub fn app(router: Arc<Router>) -> AxumRouter {
    let state = AppState { router };
    let v1 = AxumRouter::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    AxumRouter::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// An OpenAI-style error response (chat's parameter names; see [`error_body`]).
pub struct ApiError(pub RouterError);

impl From<RouterError> for ApiError {
    fn from(e: RouterError) -> Self {
        ApiError(e)
    }
}

/// `(status, body)` of an error, OpenAI style, for `/v1/chat/completions` (a context-length
/// error names `messages`). See [`error_body_for`] for other endpoints.
pub fn error_body(e: &RouterError) -> (StatusCode, serde_json::Value) {
    error_body_for(e, "messages")
}

/// `(status, body)` of an error, OpenAI style; a context-length error names `prompt_param`, the
/// request field holding the prompt (`prompt` on `/v1/completions`, `messages` on chat).
pub fn error_body_for(e: &RouterError, prompt_param: &str) -> (StatusCode, serde_json::Value) {
    let kind = e.kind();
    let status = match e {
        RouterError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        RouterError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
        // As OpenAI and vLLM answer an unknown model (their clients raise NotFoundError).
        RouterError::UnknownModel { .. } => StatusCode::NOT_FOUND,
        _ => StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    };
    let (etype, code) = match e {
        RouterError::ContextLength { .. } => {
            ("invalid_request_error", json!("context_length_exceeded"))
        }
        RouterError::UnknownModel { .. } => ("invalid_request_error", json!("model_not_found")),
        RouterError::BodyTooLarge { .. } => ("invalid_request_error", json!("request_too_large")),
        RouterError::BodyTimeout { .. } => ("invalid_request_error", json!("request_timeout")),
        RouterError::Unauthenticated => ("authentication_error", json!("invalid_api_key")),
        RouterError::Overloaded { .. } => ("rate_limit_error", json!("overloaded")),
        RouterError::SloUnmet { .. } => ("rate_limit_error", json!("slo_unmet")),
        _ => match kind {
            pdnode_core::ErrorKind::InvalidRequest => {
                ("invalid_request_error", serde_json::Value::Null)
            }
            pdnode_core::ErrorKind::Unavailable | pdnode_core::ErrorKind::Retryable => {
                ("service_unavailable", json!(kind.as_str()))
            }
            pdnode_core::ErrorKind::Timeout => ("timeout", json!("timeout")),
            _ => ("server_error", json!(kind.as_str())),
        },
    };
    let param = match e {
        RouterError::InvalidParam { param, .. } => json!(param),
        RouterError::ContextLength { .. } => json!(prompt_param),
        RouterError::UnknownModel { .. } => json!("model"),
        _ => serde_json::Value::Null,
    };
    let body =
        json!({"error": {"message": e.to_string(), "type": etype, "param": param, "code": code}});
    (status, body)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = error_body(&self.0);
        with_retry_after(&self.0, (status, axum::Json(body)).into_response())
    }
}

/// Adds `Retry-After` (seconds) to the response of an error that says when to come back.
pub(crate) fn with_retry_after(e: &RouterError, mut r: Response) -> Response {
    if let Some(s) = e.retry_after_s()
        && let Ok(v) = axum::http::HeaderValue::from_str(&s.to_string())
    {
        r.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
    }
    r
}

/// Why a request body was not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyRead {
    /// Over the limit (declared by `Content-Length` or as it arrived).
    TooLarge,
    /// Not whole within the wait.
    TimedOut,
}

/// A request's whole body, at most `limit` bytes (a larger declared `Content-Length` is refused
/// before reading), within `wait`: a client that trickles or stalls its body holds no connection
/// and buffer past it. The one body read of the router's and the SGLang router's endpoints.
pub async fn read_body_within(
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
    limit: usize,
    wait: std::time::Duration,
) -> Result<bytes::Bytes, BodyRead> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyRead::TooLarge);
    }
    match tokio::time::timeout(wait, axum::body::to_bytes(body, limit)).await {
        Ok(read) => read.map_err(|_| BodyRead::TooLarge),
        Err(_) => Err(BodyRead::TimedOut),
    }
}

/// Whether `headers` carry one of `keys` as `Authorization: Bearer <key>` (always, when `keys`
/// is empty).
pub fn authorized(keys: &[String], authorization: Option<&str>) -> bool {
    if keys.is_empty() {
        return true;
    }
    let Some(given) = authorization.and_then(|h| h.strip_prefix("Bearer ")) else {
        return false;
    };
    let given = given.trim().as_bytes();
    // Compare every key in full so timing does not reveal a prefix.
    keys.iter().fold(false, |ok, k| {
        let k = k.as_bytes();
        let same = k.len() == given.len()
            && k.iter().zip(given).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        ok | same
    })
}

async fn auth(
    State(st): State<AppState>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    let h = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !authorized(&st.router.deps().api_keys, h) {
        return ApiError(RouterError::Unauthenticated).into_response();
    }
    next.run(req).await
}

async fn models(State(st): State<AppState>) -> Response {
    let m = &st.router.deps().model;
    let owned_by = match &m.simulated {
        Some(b) => format!("pdnode ({b}: simulated engine)"),
        None => "pdnode".to_string(),
    };
    let mut card = json!({
        "id": m.served_name,
        "object": "model",
        "created": 0,
        "owned_by": owned_by,
        "max_model_len": m.context_length,
    });
    if let Some(b) = &m.simulated {
        card["simulated_engine"] = json!(b);
    }
    axum::Json(json!({"object": "list", "data": [card]})).into_response()
}

async fn health(State(st): State<AppState>) -> Response {
    let (p, d) = st.router.usable_nodes();
    let draining = st.router.is_draining();
    let ok = p > 0 && d > 0 && !draining;
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if draining { "draining" } else if ok { "ok" } else { "unavailable" },
        "prefill_nodes": p,
        "decode_nodes": d,
        "inflight_requests": st.router.inflight(),
        "insecure_node_plane": st.router.deps().insecure_node_plane,
    });
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.router.metrics().render(),
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    let body = json!({"error": {
        "message": format!("no route {} {}", req.method(), req.uri().path()),
        "type": "invalid_request_error", "param": null, "code": "not_found"}});
    (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::Role;

    #[test]
    fn api_keys_are_checked_exactly() {
        assert!(authorized(&[], None));
        let keys = vec!["k1".to_string(), "secret".to_string()];
        assert!(authorized(&keys, Some("Bearer secret")));
        assert!(authorized(&keys, Some("Bearer k1")));
        assert!(!authorized(&keys, Some("Bearer secre")));
        assert!(!authorized(&keys, Some("secret")));
        assert!(!authorized(&keys, None));
    }

    #[test]
    fn statuses_follow_the_error_kind() {
        let cases = [
            (RouterError::param("x", "bad"), 400),
            (
                RouterError::ContextLength {
                    prompt_tokens: 9,
                    max_tokens: 1,
                    context_length: 8,
                },
                400,
            ),
            (RouterError::BodyTooLarge { limit: 1 }, 413),
            (RouterError::BodyTimeout { after_s: 1 }, 408),
            (
                RouterError::UnknownModel {
                    model: "a".into(),
                    served: "b".into(),
                },
                404,
            ),
            (RouterError::Unauthenticated, 401),
            (RouterError::Overloaded { limit: 1 }, 429),
            (RouterError::NoNode { role: Role::Decode }, 503),
        ];
        for (e, status) in cases {
            assert_eq!(error_body(&e).0.as_u16(), status, "{e}");
        }
        let (_, b) = error_body(&RouterError::ContextLength {
            prompt_tokens: 9,
            max_tokens: 1,
            context_length: 8,
        });
        assert_eq!(b["error"]["code"], "context_length_exceeded");
        assert_eq!(b["error"]["param"], "messages");
        let (s, b) = error_body_for(
            &RouterError::ContextLength {
                prompt_tokens: 9,
                max_tokens: 1,
                context_length: 8,
            },
            "prompt",
        );
        assert_eq!(s.as_u16(), 400);
        assert_eq!(b["error"]["param"], "prompt");
        // Only the context-length error takes the prompt's name.
        let (_, b) = error_body_for(&RouterError::param("top_p", "bad"), "prompt");
        assert_eq!(b["error"]["param"], "top_p");
    }
}
