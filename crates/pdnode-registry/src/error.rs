//! The registry's one error type.

use pdnode_core::error::{Classify, ErrorKind};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RegistryError {
    /// Another live process holds this node's key: node ids must be unique in a cluster.
    #[error(
        "node id `{id}` is already registered in cluster `{cluster}` (key {key}, held by {holder}): \
         node ids must be unique; stop the other node or set another node.id"
    )]
    AlreadyRegistered {
        key: String,
        id: String,
        cluster: String,
        holder: String,
    },
    #[error("registry at {endpoints} is unreachable: {reason}")]
    Unavailable { endpoints: String, reason: String },
    #[error("registry call `{op}` timed out after {timeout_ms} ms")]
    Timeout { op: &'static str, timeout_ms: u64 },
    #[error("lease {lease:x} not found (expired or revoked)")]
    LeaseNotFound { lease: i64 },
    #[error("watch start revision {revision} was compacted; resync needed")]
    Compacted { revision: i64 },
    #[error("invalid node card at {key}: {reason}")]
    BadCard { key: String, reason: String },
    #[error("registry call `{op}` failed: {reason}")]
    Backend { op: &'static str, reason: String },
    #[error("the registration of {key} is closed")]
    Closed { key: String },
}

impl Classify for RegistryError {
    fn kind(&self) -> ErrorKind {
        match self {
            RegistryError::AlreadyRegistered { .. } => ErrorKind::InvalidRequest,
            RegistryError::Unavailable { .. } => ErrorKind::Unavailable,
            RegistryError::Timeout { .. } => ErrorKind::Timeout,
            RegistryError::LeaseNotFound { .. }
            | RegistryError::Compacted { .. }
            | RegistryError::Backend { .. } => ErrorKind::Retryable,
            RegistryError::BadCard { .. } | RegistryError::Closed { .. } => ErrorKind::Internal,
        }
    }
}
