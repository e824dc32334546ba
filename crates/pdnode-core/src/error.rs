//! The one classification of errors. Every crate's error enum has a `kind()` returning an
//! [`ErrorKind`]; HTTP status, gRPC code and metric labels are derived from it in one place each.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The caller sent something wrong (HTTP 400, gRPC INVALID_ARGUMENT). Retrying won't help.
    InvalidRequest,
    /// The prompt does not fit the context (HTTP 400 `context_length_exceeded`).
    ContextLengthExceeded,
    /// Authentication failed (HTTP 401, gRPC UNAUTHENTICATED).
    Unauthenticated,
    /// The caller is known but may not do this, e.g. an `Abort` without the request's KV
    /// capability (HTTP 403, gRPC PERMISSION_DENIED).
    PermissionDenied,
    /// Too much load right now (HTTP 429, gRPC RESOURCE_EXHAUSTED).
    Overloaded,
    /// No node can serve this now (HTTP 503, gRPC UNAVAILABLE).
    Unavailable,
    /// A transient failure; the same request may succeed on retry (HTTP 503, gRPC UNAVAILABLE).
    Retryable,
    /// A deadline passed (HTTP 504, gRPC DEADLINE_EXCEEDED).
    Timeout,
    /// The request was cancelled by its client (gRPC CANCELLED; HTTP 499 in logs).
    Cancelled,
    /// A bug or an unexpected state (HTTP 500, gRPC INTERNAL).
    Internal,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::ContextLengthExceeded => "context_length_exceeded",
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Retryable => "retryable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Internal => "internal",
        }
    }

    /// The HTTP status for this kind.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::ContextLengthExceeded => 400,
            ErrorKind::Unauthenticated => 401,
            ErrorKind::PermissionDenied => 403,
            ErrorKind::Overloaded => 429,
            ErrorKind::Cancelled => 499,
            ErrorKind::Internal => 500,
            ErrorKind::Unavailable | ErrorKind::Retryable => 503,
            ErrorKind::Timeout => 504,
        }
    }

    /// Whether retrying the same request elsewhere may help.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Retryable | ErrorKind::Unavailable)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Implemented by every crate's error type.
pub trait Classify {
    fn kind(&self) -> ErrorKind;
}
