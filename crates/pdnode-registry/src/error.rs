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
    /// A file a `registry.etcd_*` key names is missing or not what it must hold.
    #[error("key `{key}`: {error}")]
    BadFile {
        key: &'static str,
        error: pdnode_core::config::FileError,
    },
    /// `registry.etcd_*` keys that do not fit together (what `Config::validate` refuses, for
    /// a config that did not go through it).
    #[error("key `{key}`: {reason}")]
    BadConfig { key: &'static str, reason: String },
    /// etcd refused the user and password (`registry.etcd_user`, `registry.etcd_password_file`).
    #[error(
        "etcd at {endpoints} refused user {user:?} (registry.etcd_user, registry.etcd_password_file): {reason}"
    )]
    AuthFailed {
        endpoints: String,
        user: String,
        reason: String,
    },
    /// etcd auth is on and the call was refused: no credentials, or the user's roles do not
    /// grant it (e.g. a read-only user registering a card).
    #[error("etcd refused `{op}` {}: {reason}", who(.user))]
    NotAuthorized {
        op: &'static str,
        /// The etcd user the call ran as; empty: none (no `registry.etcd_user`).
        user: String,
        reason: String,
    },
}

fn who(user: &str) -> String {
    if user.is_empty() {
        "without etcd credentials (registry.etcd_user is not set)".into()
    } else {
        format!("to user {user:?} (registry.etcd_user)")
    }
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
            RegistryError::BadFile { .. } | RegistryError::BadConfig { .. } => {
                ErrorKind::InvalidRequest
            }
            RegistryError::AuthFailed { .. } | RegistryError::NotAuthorized { .. } => {
                ErrorKind::Unauthenticated
            }
        }
    }
}
