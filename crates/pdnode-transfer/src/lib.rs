//! pdnode-transfer: the KV hand-off's transports and wire formats between prefill and decode.
//!
//! - [`KvTransport`]: register memory, connect to a peer region, put spans, flush. Two
//!   implementations: [`UcxTransport`] (between processes and hosts; a dedicated thread owns the
//!   UCP worker and, with `UcxConfig::cuda_device`, binds that device's context:
//!   [`ucx::cuda_ctx`]) and [`InProcessTransport`] (role = "all": memory copies).
//! - [`checksum`]: CRC32C, the per-rank checksum of a hand-off's KV bytes.
//! - [`fence`]: the 64-byte fence record written behind each rank's KV (generation, request,
//!   length, CRC32C).
//! - [`region`]: regions, spans, the pool geometry, host gather/scatter and span planning.
//! - [`Secret`]: the per-reservation secret; [`capability`] mints it as a KV capability (an
//!   HMAC over the reservation it grants, under the decode node's key) and tags fence records
//!   with it.
//!
//! The hand-off protocol itself (reservation, push, fences) runs in `pdnode-node`'s `pd`
//! module; the KV target is `pdnode_core::KvTarget`. The benchmark (`pdnode bench-transfer`)
//! lives in `pdnode-transfer-bench`. This crate depends on neither the engine nor a bench.

pub mod capability;
pub mod checksum;
pub mod completion;
mod error;
pub mod fence;
pub mod inproc;
pub use pdnode_core::kvh64;
pub mod region;
mod secret;
pub mod transport;
pub mod ucx;

pub use completion::Completion;
pub use error::TransferError;
pub use inproc::InProcessTransport;
pub use region::{LocalRegion, MemKind, PoolGeometry, RemoteRegion, Span};
pub use secret::Secret;
pub use transport::{KvTransport, Registration, RemoteTarget, TransportKind};
pub use ucx::{Gate, GateFailure, PutPaths, UcxConfig, UcxTransport};
