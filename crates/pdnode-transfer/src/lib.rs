//! pdnode-transfer: the KV hand-off between prefill and decode.
//!
//! - [`KvTransport`]: register memory, connect to a peer region, put spans, flush. Two
//!   implementations: [`UcxTransport`] (between processes and hosts; a dedicated thread owns the
//!   UCP worker) and [`InProcessTransport`] (role = "all": memory copies).
//! - [`checksum`]: CRC32C, the per-rank checksum of a hand-off's KV bytes.
//! - [`region`]: regions, spans, the pool geometry, host gather/scatter and span planning.
//! - [`negotiation`]: the KV target, the per-request secret, and the synchronous state
//!   machines [`Reservation`] (decode) and [`Push`] (prefill); see docs/protocol.md.
//! - [`bench`]: the `pdnode bench-transfer` runner (server, client, `--local`).
//!
//! This crate does not depend on the engine: the node runtime turns the engine's `KvMemory`
//! regions into [`LocalRegion`]s.

pub mod bench;
pub mod checksum;
pub mod completion;
mod error;
pub mod inproc;
pub mod negotiation;
pub mod region;
pub mod transport;
pub mod ucx;

pub use completion::Completion;
pub use error::TransferError;
pub use inproc::InProcessTransport;
pub use negotiation::{
    BlockGuard, DoneStatus, KvTarget, Placement, Push, PushRelease, PushState, PutPlan,
    Reservation, ReservationEnd, ReservationState, Secret,
};
pub use region::{LocalRegion, MemKind, PoolGeometry, RemoteRegion, Span};
pub use transport::{KvTransport, Registration, RemoteTarget, TransportKind};
pub use ucx::{Gate, UcxConfig, UcxTransport};
