//! pdnode-kvcache: paged KV cache bookkeeping: block pool, block tables, ownership by lease,
//! radix prefix cache.
//!
//! [`KvCache`] is plain synchronous state owned by one engine loop; it never touches KV memory,
//! only block ids. See [`cache`] for the ownership model and [`prefix`] for the prefix index.

pub mod cache;
mod check;
pub mod error;
mod prefix;

pub use cache::{KvCache, KvStats, Owner};
pub use error::KvError;
