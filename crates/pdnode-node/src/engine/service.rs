//! The narrow seam between the node runtime and an engine.
//!
//! The EngineActor only needs an engine's identity, its load, and a way to stop admitting and
//! drain. An adapter over `pdnode_engine::engine::EngineHandle` implements this when the engine
//! is wired; tests use their own implementations (in `tests/`).

use futures::future::BoxFuture;
use pdnode_core::KvLayout;
use pdnode_core::card::NodeCapacity;
use pdnode_engine::engine::EngineError;
use std::time::Duration;

/// What an engine tells the registry about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDescription {
    /// Backend name for logs and cards ("cpu", "cuda", "mock").
    pub backend: String,
    pub model_id: String,
    pub model_fingerprint: String,
    pub kv_layout: Option<KvLayout>,
    pub tp_size: u32,
}

/// One load read: what the card publishes, and the accounting `Stats` and `/metrics` export.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineLoad {
    pub capacity: NodeCapacity,
    /// `None`: this engine does not report it.
    pub accounting: Option<pdnode_core::Accounting>,
}

/// Reads fail with the engine loop's own error (it stopped, the call timed out, ...), so the
/// caller keeps its class (`Classify::kind`).
pub trait EngineService: Send + Sync + 'static {
    fn describe(&self) -> EngineDescription;
    /// Current capacity and load, and who holds the KV blocks (one read of the engine).
    fn load(&self) -> BoxFuture<'_, Result<EngineLoad, EngineError>>;
    /// Stop admitting new requests (in-flight ones continue).
    fn stop_admitting(&self);
    /// Requests admitted and not finished, and KV hand-offs in flight (reservations not yet
    /// claimed by their `Decode`, pushes not yet acknowledged).
    fn in_flight(&self) -> BoxFuture<'_, Result<usize, EngineError>>;
    /// Stops the engine (its threads), waiting at most `timeout`; whether it stopped in time.
    fn shutdown(&self, timeout: Duration) -> BoxFuture<'_, bool>;
}
