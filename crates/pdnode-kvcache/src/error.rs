//! The crate's one error type.

use crate::Owner;
use pdnode_core::error::Classify;
use pdnode_core::{BlockId, ErrorKind, TransferId};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Not enough free (or evictable) blocks right now.
    #[error("out of KV blocks: {needed} needed, {available} available")]
    OutOfBlocks { needed: usize, available: usize },
    /// The request can never fit the pool, whatever is freed.
    #[error("{needed} KV blocks needed, the pool has {total}")]
    TooLarge { needed: usize, total: usize },
    /// No block table for this owner.
    #[error("{owner} holds no KV blocks")]
    UnknownOwner { owner: Owner },
    /// The owner already holds a block table.
    #[error("{owner} already holds KV blocks")]
    OwnerExists { owner: Owner },
    /// A block id outside the pool.
    #[error("{block} is outside the pool of {total} blocks")]
    UnknownBlock { block: BlockId, total: usize },
    /// A prefix block handed to `allocate` that the prefix cache does not hold.
    #[error("{block} is not a prefix-cache block")]
    NotCached { block: BlockId },
    /// The lease is unknown (never reserved, already committed, released or expired).
    #[error("unknown transfer lease {lease}")]
    UnknownLease { lease: TransferId },
    /// `PrefixCache` is not a valid owner for this operation.
    #[error("{owner} cannot hold a block table")]
    InvalidOwner { owner: Owner },
    /// The bookkeeping invariant is broken (a bug); `details` lists every violation found.
    #[error("KV accounting broken: {details}")]
    Accounting { details: String },
}

impl Classify for KvError {
    fn kind(&self) -> ErrorKind {
        match self {
            KvError::OutOfBlocks { .. } => ErrorKind::Overloaded,
            KvError::TooLarge { .. } => ErrorKind::ContextLengthExceeded,
            KvError::UnknownLease { .. } => ErrorKind::Timeout,
            KvError::UnknownOwner { .. }
            | KvError::OwnerExists { .. }
            | KvError::UnknownBlock { .. }
            | KvError::NotCached { .. }
            | KvError::InvalidOwner { .. }
            | KvError::Accounting { .. } => ErrorKind::Internal,
        }
    }
}
