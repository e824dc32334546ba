//! The router's one error enum. `kind()` maps every variant to a [`ErrorKind`], from which the HTTP
//! status, the gRPC code and the metric label are derived (in `http::error`, `grpc` and `metrics`).

use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::{NodeId, RequestId, Role};

/// A failure of a call to a prefill or decode node (defined in `pdnode-nodeapi`).
pub use pdnode_nodeapi::NodeError;

/// Which step of the prefill/decode flow failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    ReserveKv,
    Prefill,
    Decode,
    /// Moving a decode to another decode node (`Migrate`).
    Migrate,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::ReserveKv => "reserve_kv",
            Step::Prefill => "prefill",
            Step::Decode => "decode",
            Step::Migrate => "migrate",
        })
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    #[error("invalid parameter `{param}`: {message}")]
    InvalidParam { param: String, message: String },
    #[error("invalid request: {message}")]
    InvalidRequest { message: String },
    #[error(
        "this model's maximum context length is {context_length} tokens; the request has {prompt_tokens} prompt tokens and asks for {max_tokens} more"
    )]
    ContextLength {
        prompt_tokens: usize,
        max_tokens: u32,
        context_length: u32,
    },
    #[error("request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The client did not send its whole body within `router.client_send_timeout_s`.
    #[error("the request body did not arrive within {after_s} s")]
    BodyTimeout { after_s: u64 },
    #[error("invalid or missing API key")]
    Unauthenticated,
    #[error("the router is at its limit of {limit} in-flight requests; retry later")]
    Overloaded { limit: u32 },
    /// SLO admission refused the request: it would miss its target (docs/runtime-semantics.md,
    /// "SLO admission").
    #[error(
        "{what} would be about {predicted_ms} ms, above the request's target of {target_ms} ms; retry in {retry_after_s} s"
    )]
    SloUnmet {
        what: &'static str,
        predicted_ms: u64,
        target_ms: u64,
        retry_after_s: u64,
    },
    #[error("no {role} node is available")]
    NoNode { role: Role },
    #[error("the router is shutting down")]
    Draining,
    #[error("model `{model}` is not served here (served: `{served}`)")]
    UnknownModel { model: String, served: String },
    #[error("{step} on node {node} failed for {request}: {source}")]
    Node {
        step: Step,
        node: NodeId,
        request: RequestId,
        #[source]
        source: NodeError,
    },
    #[error("{step} on node {node} timed out after {after_ms} ms for {request}")]
    Timeout {
        step: Step,
        node: NodeId,
        request: RequestId,
        after_ms: u64,
    },
    #[error(
        "decode node {node} was lost while {request} was in prefill ({reason}); the prefill was aborted"
    )]
    DecodeLost {
        node: NodeId,
        request: RequestId,
        reason: String,
    },
    #[error("tokenizer: {message}")]
    Tokenize { message: String },
    #[error("request {request} was cancelled")]
    Cancelled { request: RequestId },
    #[error("internal error: {message}")]
    Internal { message: String },
}

impl RouterError {
    /// Seconds a refused client should wait before it tries again (`Retry-After`), if the
    /// error says.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            RouterError::SloUnmet { retry_after_s, .. } => Some(*retry_after_s),
            RouterError::Overloaded { .. } => Some(1),
            _ => None,
        }
    }

    pub fn param(param: impl Into<String>, message: impl Into<String>) -> Self {
        RouterError::InvalidParam {
            param: param.into(),
            message: message.into(),
        }
    }
}

impl Classify for RouterError {
    fn kind(&self) -> ErrorKind {
        match self {
            RouterError::InvalidParam { .. }
            | RouterError::InvalidRequest { .. }
            | RouterError::BodyTooLarge { .. }
            | RouterError::BodyTimeout { .. }
            | RouterError::UnknownModel { .. } => ErrorKind::InvalidRequest,
            RouterError::ContextLength { .. } => ErrorKind::ContextLengthExceeded,
            RouterError::Unauthenticated => ErrorKind::Unauthenticated,
            RouterError::Overloaded { .. } | RouterError::SloUnmet { .. } => ErrorKind::Overloaded,
            RouterError::NoNode { .. } | RouterError::Draining | RouterError::DecodeLost { .. } => {
                ErrorKind::Unavailable
            }
            RouterError::Node { source, .. } => match source.kind {
                // A node's own invalid-request verdict stays one; anything else is the server's.
                k @ (ErrorKind::InvalidRequest | ErrorKind::ContextLengthExceeded) => k,
                ErrorKind::Cancelled => ErrorKind::Cancelled,
                ErrorKind::Timeout => ErrorKind::Timeout,
                ErrorKind::Overloaded => ErrorKind::Overloaded,
                ErrorKind::Internal => ErrorKind::Internal,
                _ => ErrorKind::Unavailable,
            },
            RouterError::Timeout { .. } => ErrorKind::Timeout,
            RouterError::Tokenize { .. } => ErrorKind::InvalidRequest,
            RouterError::Cancelled { .. } => ErrorKind::Cancelled,
            RouterError::Internal { .. } => ErrorKind::Internal,
        }
    }
}
