//! ucx-sys: run-time loaded bindings for the UCP subset pdnode uses.
//!
//! - [`ffi`]: the raw declarations, written by hand from the UCX 1.13 headers and checked against
//!   the C compiler (`layout/check.sh`, `tests/layout.rs`). They also run against UCX 1.22 (the
//!   PyPI wheel on GPU hosts): every parameter struct is read through its field mask and only
//!   1.13 fields are set.
//! - [`Ucp`]: the library, loaded with libloading from a configurable path (default
//!   `libucp.so.0`, then `libucp.so`). Building needs neither UCX nor its headers; a missing
//!   library is an [`UcxError::LibraryNotFound`], never a panic.
//! - [`Context`], [`Worker`], [`Endpoint`], [`MemHandle`], [`RemoteKey`], [`Request`]: owners
//!   with `Drop`, single-threaded (`!Send`): one thread owns a worker and everything under it.

pub mod ffi;
mod loader;
mod safe;

pub use loader::{DEFAULT_LIBRARY_NAMES, Ucp};
pub use safe::{
    Context, Endpoint, MemHandle, MemoryType, RemoteKey, Request, RequestState, Worker, am_send_raw,
};

/// Errors of the UCX bindings.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UcxError {
    #[error("UCX library not found (tried {tried}): {reason}")]
    LibraryNotFound { tried: String, reason: String },
    #[error("UCX library {library} lacks symbol {symbol}: {reason}")]
    MissingSymbol {
        library: String,
        symbol: &'static str,
        reason: String,
    },
    #[error("{call} failed: {message} (status {status})")]
    Call {
        call: &'static str,
        status: i8,
        message: String,
    },
    #[error("{call} did not complete before its deadline")]
    Timeout { call: &'static str },
    #[error("invalid argument: {what}")]
    InvalidArgument { what: String },
}
