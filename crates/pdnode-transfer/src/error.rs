//! The transfer crate's one error type.

use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::layout::LayoutMismatch;
use pdnode_core::{NodeId, RequestId};

#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    /// UCX is configured but its library cannot be loaded or a UCX call failed.
    #[error("UCX: {0}")]
    Ucx(#[from] ucx_sys::UcxError),
    #[error("transport {transport} is closed")]
    Closed { transport: &'static str },
    /// The transport's command queue is full (back-pressure): retry later or elsewhere.
    #[error("transport {transport} is busy: {queued} commands queued")]
    Busy {
        transport: &'static str,
        queued: usize,
    },
    #[error("region {id} is not registered with this transport")]
    UnknownRegion { id: u64 },
    #[error("remote target {id} is not connected on this transport")]
    UnknownTarget { id: u64 },
    #[error("span {offset}+{len} exceeds the {side} region of {region_len} bytes")]
    SpanOutOfRange {
        side: &'static str,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("memory {mem} is not supported by the {transport} transport")]
    UnsupportedMemory {
        transport: &'static str,
        mem: String,
    },
    #[error("invalid descriptor: {reason}")]
    InvalidDescriptor { reason: String },
    #[error("peer {peer} is gone: {reason}")]
    PeerGone { peer: String, reason: String },
    /// The peer refused KV bytes (outside its registered host memory, or out of order).
    #[error("peer {peer} refused KV bytes: {reason}")]
    Refused { peer: String, reason: String },
    #[error("{what} did not finish before its deadline")]
    Timeout { what: String },
    #[error("request {request} refused: {mismatch}")]
    LayoutMismatch {
        request: RequestId,
        mismatch: LayoutMismatch,
    },
    #[error("request {request}: wrong secret")]
    WrongSecret { request: RequestId },
    #[error("request {request}: unknown peer {peer} (expected {expected})")]
    UnknownPeer {
        request: RequestId,
        peer: NodeId,
        expected: NodeId,
    },
    #[error("request {request} is unknown here")]
    UnknownRequest { request: RequestId },
    #[error("request {request}: duplicate done")]
    DuplicateDone { request: RequestId },
    #[error("request {request}: {event} after the transfer ended ({state})")]
    LateEvent {
        request: RequestId,
        event: &'static str,
        state: &'static str,
    },
    #[error("request {request}: {event} not allowed in state {state}")]
    BadTransition {
        request: RequestId,
        event: &'static str,
        state: &'static str,
    },
    #[error("request {request}: lease expired")]
    LeaseExpired { request: RequestId },
    #[error("request {request} aborted: {reason}")]
    Aborted { request: RequestId, reason: String },
    #[error("request {request}: the peer reported failure: {reason}")]
    RemoteFailed { request: RequestId, reason: String },
    #[error("KV geometry: {reason}")]
    Geometry { reason: String },
    #[error("control channel: {reason}")]
    Control { reason: String },
    #[error("verification failed: {reason}")]
    Verify { reason: String },
    /// A CUDA driver call failed (device memory of `bench-transfer --mem cuda:N`).
    #[error("CUDA {op}: {reason}")]
    Device { op: &'static str, reason: String },
}

impl Classify for TransferError {
    fn kind(&self) -> ErrorKind {
        use TransferError::*;
        match self {
            Ucx(_)
            | Closed { .. }
            | Busy { .. }
            | PeerGone { .. }
            | Refused { .. }
            | Control { .. }
            | Device { .. } => ErrorKind::Unavailable,
            UnknownRegion { .. }
            | UnknownTarget { .. }
            | SpanOutOfRange { .. }
            | BadTransition { .. }
            | Geometry { .. }
            | Verify { .. } => ErrorKind::Internal,
            UnsupportedMemory { .. }
            | InvalidDescriptor { .. }
            | LayoutMismatch { .. }
            | UnknownRequest { .. }
            | DuplicateDone { .. }
            | LateEvent { .. } => ErrorKind::InvalidRequest,
            WrongSecret { .. } | UnknownPeer { .. } => ErrorKind::Unauthenticated,
            Timeout { .. } | LeaseExpired { .. } => ErrorKind::Timeout,
            Aborted { .. } => ErrorKind::Cancelled,
            RemoteFailed { .. } => ErrorKind::Retryable,
        }
    }
}
