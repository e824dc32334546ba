//! The node runtime's one error type.

use pdnode_core::error::{Classify, ErrorKind};
use pdnode_registry::RegistryError;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("registry: {0}")]
    Registry(#[from] RegistryError),
    #[error(
        "cannot reach the registry at {endpoints} (tried for {waited_s} s, registry.start_wait_s): {source}"
    )]
    RegistryUnreachable {
        endpoints: String,
        waited_s: u64,
        source: Box<RegistryError>,
    },
    #[error("cannot listen on {addr} ({what}): {reason}")]
    Bind {
        what: &'static str,
        addr: String,
        reason: String,
    },
    #[error("cannot start actor `{actor}`: {reason}")]
    Spawn { actor: &'static str, reason: String },
    #[error("actor `{actor}` failed {restarts} times within {window_s} s; stopping the node")]
    RestartLimit {
        actor: String,
        restarts: usize,
        window_s: u64,
    },
    #[error("call `{op}` to actor `{actor}` failed: {reason}")]
    Call {
        actor: &'static str,
        op: &'static str,
        reason: String,
    },
    #[error("CPU affinity {cores:?}: {reason}")]
    Affinity { cores: Vec<u32>, reason: String },
    #[error("engine: {0}")]
    Engine(String),
    /// A read of a running engine failed; keeps the engine's own error and its class.
    #[error("engine: {0}")]
    EngineCall(#[from] pdnode_engine::engine::EngineError),
    #[error("the node stopped: {reason}")]
    Stopped { reason: String },
    /// The node plane's TLS files do not fit together or do not name this node.
    #[error("node plane TLS: {0}")]
    Tls(#[from] pdnode_nodeapi::tls::TlsError),
}

impl Classify for NodeError {
    fn kind(&self) -> ErrorKind {
        match self {
            NodeError::Registry(e) => e.kind(),
            NodeError::RegistryUnreachable { source, .. } => source.kind(),
            NodeError::Bind { .. } | NodeError::Affinity { .. } | NodeError::Tls(_) => {
                ErrorKind::InvalidRequest
            }
            NodeError::Call { .. } | NodeError::Stopped { .. } => ErrorKind::Unavailable,
            NodeError::EngineCall(e) => e.kind(),
            NodeError::Spawn { .. } | NodeError::RestartLimit { .. } | NodeError::Engine(_) => {
                ErrorKind::Internal
            }
        }
    }
}
