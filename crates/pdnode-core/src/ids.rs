//! Newtype ids. Each has a canonical string form (`Display`/`FromStr`) used in logs, keys and APIs.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A node's id, unique within a cluster. Also the last segment of its registry key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub String);

impl NodeId {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// Checks the id is usable as a registry key segment: non-empty, at most 128 bytes, only
    /// ASCII letters, digits, `-`, `_` and `.`.
    pub fn is_valid(&self) -> bool {
        !self.0.is_empty()
            && self.0.len() <= 128
            && self
                .0
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! u64_id {
    ($(#[$m:meta])* $name:ident, $prefix:literal) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{:016x}"), self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                let hex = s.strip_prefix($prefix).unwrap_or(s);
                u64::from_str_radix(hex, 16)
                    .map($name)
                    .map_err(|e| format!("invalid {}: {s:?}: {e}", stringify!($name)))
            }
        }
    };
}

u64_id!(
    /// A request's id, minted by the router (or the all-in-one frontend); unique per cluster.
    RequestId,
    "req-"
);
u64_id!(
    /// One KV hand-off between a prefill and a decode node.
    TransferId,
    "xfer-"
);

impl RequestId {
    /// A random id (64 random bits).
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().as_u64_pair().0)
    }
}

impl TransferId {
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().as_u64_pair().0)
    }
}

/// A block of the paged KV pool, an index into the pool of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockId(pub u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blk{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_id_round_trips_through_its_string_form() {
        let id = RequestId(0xdead_beef);
        let s = id.to_string();
        assert_eq!(s, "req-00000000deadbeef");
        assert_eq!(s.parse::<RequestId>().unwrap(), id);
        assert!("req-zz".parse::<RequestId>().is_err());
    }

    #[test]
    fn node_id_validity() {
        assert!(NodeId::new("prefill-0").is_valid());
        assert!(!NodeId::new("").is_valid());
        assert!(!NodeId::new("a/b").is_valid());
        assert!(!NodeId::new("x".repeat(129)).is_valid());
    }
}
