//! The bench crate's errors.

use pdnode_core::error::{Classify, ErrorKind};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A bad option value or combination.
    #[error("invalid bench option `{option}`: {reason}")]
    InvalidOption {
        option: &'static str,
        reason: String,
    },
    /// A trace file that cannot be read or parsed.
    #[error("trace {path}: line {line}: {reason}")]
    Trace {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("cannot write {path}: {reason}")]
    Write { path: PathBuf, reason: String },
    /// The endpoint did not answer a setup request (e.g. `/v1/models`).
    #[error("endpoint {url}: {reason}")]
    Endpoint { url: String, reason: String },
    #[error("cannot draw the plot: {reason}")]
    Plot { reason: String },
}

impl Classify for BenchError {
    fn kind(&self) -> ErrorKind {
        match self {
            BenchError::InvalidOption { .. } | BenchError::Trace { .. } => {
                ErrorKind::InvalidRequest
            }
            BenchError::Endpoint { .. } => ErrorKind::Unavailable,
            BenchError::Read { .. } | BenchError::Write { .. } | BenchError::Plot { .. } => {
                ErrorKind::Internal
            }
        }
    }
}
