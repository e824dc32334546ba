//! The narrow seam between the router and a prefill or decode node: [`NodeClient`] and its
//! types, defined in `pdnode-nodeapi` (so a node process does not need the router) and
//! re-exported here.

pub use pdnode_nodeapi::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, MigrateCall, MigrateOutcome, NodeClient,
    NodeError, NodeStats, PrefillCall, PrefillOutcome, ReserveKv,
};
