//! pdnode-node: the runtime of one node process.
//!
//! [`Node::start`] binds the node gRPC listener (and `/health` HTTP when `node.http_listen` is
//! set), registers the node card under a lease, and starts the supervision tree:
//!
//! ```text
//! NodeSupervisor ── Registrar    (card refresh with load; lease + keepalive in pdnode-registry)
//!                └─ EngineActor  (prefill/decode/all: wraps an EngineService; engine threads
//!                                 live outside the actor and survive its restarts)
//! servers (tokio tasks): pdnode.v1.Node + grpc.health.v1 (tonic), /health (axum)
//! ```
//! [`Node::shutdown`] revokes the lease first, stops admission, drains up to
//! `node.drain_timeout_s`, then stops everything. See `docs/runtime-semantics.md`.

pub mod affinity;
pub mod assemble;
mod board;
pub mod engine;
mod error;
pub mod grpc;
pub mod http;
mod node;
pub mod pd;
pub mod registrar;
pub mod supervisor;
mod trace;

pub use board::{HealthBoard, LoadBoard};
pub use engine::{EngineDescription, EngineLoad, EngineService};
pub use error::NodeError;
pub use node::{Node, NodeDeps, NodeOptions, ShutdownReport, node_id, served_model, served_role};
pub use supervisor::{NodeHealth, RestartLimits, SupervisorHandle};
