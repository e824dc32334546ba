//! The KV target: where and how the prefill node writes one request's KV on the decode node.
//!
//! This is the only Rust `KvTarget`. The decode node builds it in `ReserveKv`, the router
//! passes it to the prefill node unread, the prefill node pushes to it. On the wire it is
//! `pdnode.v1.KvTarget`; `pdnode-proto` converts both ways in one place and checks every value
//! there ([`KvTarget::validate`]). The accessors that turn wire values into offsets
//! ([`KvTarget::remote_offset`], [`RankTarget::check_range`]) use checked arithmetic and answer
//! a [`TargetError`], never a wrapped or panicking sum.

use crate::error::{Classify, ErrorKind};
use crate::{BlockId, KvLayout, NodeId, RequestId};
use serde::{Deserialize, Serialize};

/// Largest accepted UCX worker address or packed rkey (UCX parses both without a length).
pub const MAX_DESCRIPTOR_BYTES: usize = 64 << 10;
/// Largest number of TP ranks a target may name.
pub const MAX_RANKS: usize = 1024;
/// Largest number of destination blocks a target may name (a 16M-token prompt of 16-token blocks).
pub const MAX_BLOCKS: usize = 1 << 20;
/// Length of the per-reservation secret.
pub const SECRET_LEN: usize = 16;

/// How the KV bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TargetTransport {
    /// UCX RMA between processes and hosts.
    Ucx,
    /// A memory copy inside one process (role = `all`).
    InProcess,
}

/// Where in each rank's region the request's KV goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Placement {
    /// A staging span at `offset` in the region, laid out `[layer][i][layer-block]` over the
    /// target's blocks in order; the decode node scatters it into its pool.
    Staging { offset: u64 },
    /// Straight into the decode pool (the region is the pool of `num_blocks` blocks).
    Pool { num_blocks: u32 },
}

/// One TP rank's destination region on the decode node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTarget {
    pub rank: u32,
    /// Packed UCX remote key of the region (empty for in-process targets).
    pub rkey: Vec<u8>,
    /// Remote virtual address where the region starts.
    pub base_addr: u64,
    /// Region length: writes outside `[base_addr, base_addr + region_len)` are refused.
    pub region_len: u64,
    /// This rank's own UCX worker address; empty: the target's `worker_address`.
    pub worker_address: Vec<u8>,
    /// The region is device memory (the decode node's device staging arena).
    pub device_memory: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTarget {
    pub request: RequestId,
    /// The decode node that holds the reservation.
    pub decode_node: NodeId,
    /// Its node gRPC address (informational).
    pub decode_grpc_addr: String,
    pub transport: TargetTransport,
    /// The decode node's UCX worker address (opaque bytes from `ucp_worker_get_address`).
    pub worker_address: Vec<u8>,
    /// One entry per TP rank, in rank order.
    pub ranks: Vec<RankTarget>,
    /// Destination blocks in prompt order.
    pub blocks: Vec<BlockId>,
    pub layout: KvLayout,
    /// Per-reservation random token; `Decode` presents it.
    pub secret: Vec<u8>,
    /// Unix time (ms) after which the decode node frees the reservation; 0: none given.
    pub lease_deadline_ms: u64,
    pub placement: Placement,
    /// The decode node's generation of the staging span (unique per span on that node).
    pub staging_generation: u64,
    /// The prefill node writes a fence record behind each rank's KV (docs/protocol.md).
    pub fence_record: bool,
    /// The fence record must carry the CRC32C of the rank's bytes.
    pub verify: bool,
}

/// A target value that cannot be used as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("KV target field `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error(
        "KV target rank {rank}: bytes [{offset}, {offset}+{len}) fall outside its region of {region_len} bytes"
    )]
    OutOfRange {
        rank: usize,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("KV target has no rank {rank} ({ranks} ranks)")]
    NoRank { rank: usize, ranks: usize },
    #[error("KV target places the KV in the decode pool; this node writes staging spans only")]
    NotStaging,
    /// The sender's tensor-parallel ranks cannot fill the target's: key/value heads are split
    /// over the ranks (equal `tp_size` needed); only a latent goes whole to any rank count.
    #[error(
        "KV target of {targets} tensor-parallel ranks cannot take {kind} KV from {sources} ranks \
         (only a latent, the same on every rank, goes between TP degrees)"
    )]
    RankSplit {
        kind: crate::KvKind,
        sources: usize,
        targets: usize,
    },
}

impl Classify for TargetError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidRequest
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> TargetError {
    TargetError::Invalid {
        field,
        reason: reason.into(),
    }
}

impl RankTarget {
    /// Checks that `len` bytes at `offset` of this region lie inside it; answers the remote
    /// address of the first byte.
    pub fn check_range(&self, index: usize, offset: u64, len: u64) -> Result<u64, TargetError> {
        let out = || TargetError::OutOfRange {
            rank: index,
            offset,
            len,
            region_len: self.region_len,
        };
        let end = offset.checked_add(len).ok_or_else(out)?;
        if end > self.region_len {
            return Err(out());
        }
        self.base_addr.checked_add(offset).ok_or_else(out)
    }
}

impl KvTarget {
    /// Checks every value a peer could have sent wrong: called by the wire conversion, so a
    /// target in Rust hands is always well-formed.
    pub fn validate(&self) -> Result<(), TargetError> {
        // An in-process target names no rank regions (the prefill node writes the pool).
        let need_ranks = self.transport == TargetTransport::Ucx;
        if (need_ranks && self.ranks.is_empty()) || self.ranks.len() > MAX_RANKS {
            return Err(invalid(
                "ranks",
                format!("{} ranks (1..={MAX_RANKS})", self.ranks.len()),
            ));
        }
        for (i, r) in self.ranks.iter().enumerate() {
            if r.rank as usize != i {
                return Err(invalid(
                    "ranks.rank",
                    format!("entry {i} names rank {}", r.rank),
                ));
            }
            if r.base_addr.checked_add(r.region_len).is_none() {
                return Err(invalid(
                    "ranks.region_len",
                    format!(
                        "rank {i}: base {:#x} + length {} overflows",
                        r.base_addr, r.region_len
                    ),
                ));
            }
            if r.rkey.len() > MAX_DESCRIPTOR_BYTES || r.worker_address.len() > MAX_DESCRIPTOR_BYTES
            {
                return Err(invalid(
                    "ranks.rkey",
                    format!("rank {i}: descriptor over 64 KiB"),
                ));
            }
            if self.transport == TargetTransport::Ucx && r.rkey.is_empty() {
                return Err(invalid("ranks.rkey", format!("rank {i}: empty")));
            }
        }
        if self.worker_address.len() > MAX_DESCRIPTOR_BYTES {
            return Err(invalid("ucx_worker_address", "over 64 KiB"));
        }
        if self.transport == TargetTransport::Ucx
            && self.worker_address.is_empty()
            && self.ranks.iter().any(|r| r.worker_address.is_empty())
        {
            return Err(invalid("ucx_worker_address", "empty"));
        }
        if (need_ranks && self.blocks.is_empty()) || self.blocks.len() > MAX_BLOCKS {
            return Err(invalid(
                "block_ids",
                format!("{} blocks (1..={MAX_BLOCKS})", self.blocks.len()),
            ));
        }
        if self.secret.len() != SECRET_LEN {
            return Err(invalid(
                "secret",
                format!("{} bytes, expected {SECRET_LEN}", self.secret.len()),
            ));
        }
        if self.decode_node.as_str().is_empty() {
            return Err(invalid("decode_node_id", "empty"));
        }
        if !self.ranks.is_empty() && self.layout.tp_size as usize != self.ranks.len() {
            return Err(invalid(
                "ranks",
                format!(
                    "{} ranks for a layout of tp_size {}",
                    self.ranks.len(),
                    self.layout.tp_size
                ),
            ));
        }
        if let Placement::Staging { offset } = self.placement {
            for (i, r) in self.ranks.iter().enumerate() {
                if offset > r.region_len {
                    return Err(TargetError::OutOfRange {
                        rank: i,
                        offset,
                        len: 0,
                        region_len: r.region_len,
                    });
                }
            }
        }
        Ok(())
    }

    /// The staging span's offset in every rank's region.
    pub fn staging_offset(&self) -> Result<u64, TargetError> {
        match self.placement {
            Placement::Staging { offset } => Ok(offset),
            Placement::Pool { .. } => Err(TargetError::NotStaging),
        }
    }

    pub fn rank(&self, r: usize) -> Result<&RankTarget, TargetError> {
        self.ranks.get(r).ok_or(TargetError::NoRank {
            rank: r,
            ranks: self.ranks.len(),
        })
    }

    /// Offset in rank `r`'s region of byte `at` of the staging span, checked so that `len`
    /// bytes from there stay inside the region.
    pub fn remote_offset(&self, r: usize, at: u64, len: u64) -> Result<u64, TargetError> {
        let rank = self.rank(r)?;
        let base = self.staging_offset()?;
        let offset = base.checked_add(at).ok_or(TargetError::OutOfRange {
            rank: r,
            offset: base,
            len: at.saturating_add(len),
            region_len: rank.region_len,
        })?;
        rank.check_range(r, offset, len)?;
        Ok(offset)
    }

    /// Which of the sender's `sources` tensor-parallel ranks writes each of the target's
    /// `layout.tp_size` ranks: rank `j` from `j % sources`. Equal counts map each rank to itself
    /// (any kind); different counts only for a latent ([`crate::KvKind::Latent`]), which every
    /// rank holds whole: 2 -> 1 sends rank 0's copy, 1 -> 2 sends the one latent to both.
    pub fn source_ranks(&self, sources: usize) -> Result<Vec<usize>, TargetError> {
        let targets = self.layout.tp_size as usize;
        let split = || TargetError::RankSplit {
            kind: self.layout.kind,
            sources,
            targets,
        };
        if sources == 0 || targets == 0 || sources > MAX_RANKS || targets > MAX_RANKS {
            return Err(split());
        }
        if sources != targets && self.layout.kind != crate::KvKind::Latent {
            return Err(split());
        }
        Ok((0..targets).map(|j| j % sources).collect())
    }

    /// The UCX worker address to connect to for rank `r`.
    pub fn worker_for(&self, r: usize) -> Result<&[u8], TargetError> {
        let rank = self.rank(r)?;
        Ok(if rank.worker_address.is_empty() {
            &self.worker_address
        } else {
            &rank.worker_address
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn target() -> KvTarget {
        KvTarget {
            request: RequestId(7),
            decode_node: NodeId::new("d0"),
            decode_grpc_addr: "127.0.0.1:1".into(),
            transport: TargetTransport::Ucx,
            worker_address: vec![1; 32],
            ranks: vec![RankTarget {
                rank: 0,
                rkey: vec![2; 16],
                base_addr: 0x1000,
                region_len: 4096,
                worker_address: Vec::new(),
                device_memory: false,
            }],
            blocks: vec![BlockId(3), BlockId(4)],
            layout: KvLayout {
                dtype: DType::Bf16,
                num_layers: 2,
                block_size: 16,
                kv_heads_per_rank: 1,
                head_dim: 8,
                tp_size: 1,
                model_fingerprint: "m".into(),
                kind: crate::KvKind::KeyValue,
            },
            secret: vec![9; SECRET_LEN],
            lease_deadline_ms: 1,
            placement: Placement::Staging { offset: 1024 },
            staging_generation: 5,
            fence_record: true,
            verify: true,
        }
    }

    #[test]
    fn a_good_target_validates() {
        target().validate().unwrap();
    }

    #[test]
    fn every_wire_value_is_checked() {
        type Spoil = Box<dyn Fn(&mut KvTarget)>;
        let cases: Vec<(&str, Spoil)> = vec![
            ("ranks", Box::new(|t| t.ranks.clear())),
            ("ranks.rank", Box::new(|t| t.ranks[0].rank = 1)),
            (
                "ranks.region_len",
                Box::new(|t| t.ranks[0].region_len = u64::MAX),
            ),
            ("ranks.rkey", Box::new(|t| t.ranks[0].rkey.clear())),
            (
                "ranks.rkey",
                Box::new(|t| t.ranks[0].rkey = vec![0; MAX_DESCRIPTOR_BYTES + 1]),
            ),
            ("ucx_worker_address", Box::new(|t| t.worker_address.clear())),
            ("block_ids", Box::new(|t| t.blocks.clear())),
            ("secret", Box::new(|t| t.secret.pop().map(drop).unwrap())),
            (
                "decode_node_id",
                Box::new(|t| t.decode_node = NodeId::new("")),
            ),
            ("ranks", Box::new(|t| t.layout.tp_size = 2)),
        ];
        let mut inproc = target();
        inproc.transport = TargetTransport::InProcess;
        inproc.ranks.clear();
        inproc.worker_address.clear();
        inproc.validate().unwrap();
        for (field, spoil) in cases {
            let mut t = target();
            spoil(&mut t);
            match t.validate() {
                Err(TargetError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        let mut t = target();
        t.placement = Placement::Staging { offset: 4097 };
        assert!(matches!(
            t.validate(),
            Err(TargetError::OutOfRange { offset: 4097, .. })
        ));
    }

    #[test]
    fn offsets_are_checked_not_wrapped() {
        let t = target();
        // The span starts at 1024: byte 0 of it is at 1024, 3072 bytes fit.
        assert_eq!(t.remote_offset(0, 0, 3072).unwrap(), 1024);
        assert!(matches!(
            t.remote_offset(0, 1, 3072),
            Err(TargetError::OutOfRange { .. })
        ));
        assert!(matches!(
            t.remote_offset(0, u64::MAX, 1),
            Err(TargetError::OutOfRange { .. })
        ));
        assert!(matches!(
            t.remote_offset(0, 0, u64::MAX),
            Err(TargetError::OutOfRange { .. })
        ));
        assert!(matches!(
            t.remote_offset(1, 0, 1),
            Err(TargetError::NoRank { .. })
        ));
        assert_eq!(t.ranks[0].check_range(0, 4000, 96).unwrap(), 0x1000 + 4000);
        let mut pool = target();
        pool.placement = Placement::Pool { num_blocks: 4 };
        assert_eq!(pool.staging_offset(), Err(TargetError::NotStaging));
        assert_eq!(t.worker_for(0).unwrap(), &[1u8; 32][..]);
    }

    #[test]
    fn a_latent_maps_each_target_rank_to_a_source_rank_and_key_value_needs_equal_counts() {
        let mut t = target();
        t.layout.kind = crate::KvKind::Latent;
        let map = |t: &KvTarget, tp: u32, sources| {
            let mut t = t.clone();
            t.layout.tp_size = tp;
            t.source_ranks(sources)
        };
        assert_eq!(map(&t, 1, 2).unwrap(), vec![0]);
        assert_eq!(map(&t, 2, 1).unwrap(), vec![0, 0]);
        assert_eq!(map(&t, 4, 2).unwrap(), vec![0, 1, 0, 1]);
        assert_eq!(map(&t, 2, 4).unwrap(), vec![0, 1]);
        assert_eq!(map(&t, 2, 2).unwrap(), vec![0, 1]);
        for (tp, sources) in [(1, 0), (0, 1), (1, MAX_RANKS + 1), (u32::MAX, 1)] {
            assert!(
                matches!(map(&t, tp, sources), Err(TargetError::RankSplit { .. })),
                "{tp} <- {sources}"
            );
        }
        t.layout.kind = crate::KvKind::KeyValue;
        assert_eq!(map(&t, 2, 2).unwrap(), vec![0, 1]);
        let e = map(&t, 1, 2).unwrap_err();
        assert_eq!(
            e,
            TargetError::RankSplit {
                kind: crate::KvKind::KeyValue,
                sources: 2,
                targets: 1
            }
        );
        assert!(e.to_string().contains("key_value KV from 2 ranks"), "{e}");
        assert!(map(&t, 2, 1).is_err());
    }
}
