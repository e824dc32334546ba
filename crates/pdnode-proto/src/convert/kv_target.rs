//! `pdnode.v1.KvTarget` <-> [`pdnode_core::KvTarget`]: the one place a KV target crosses the
//! wire. Every value from the wire is checked here ([`KvTarget::validate`]): a target a peer
//! got wrong is a [`ConvertError`], and code past this point never adds a wire offset unchecked.

use super::{ConvertError, wire_enum};
use crate::v1;
use pdnode_core::{
    BlockId, KvLayout, KvTarget, NodeId, Placement, RankTarget, RequestId, TargetError,
    TargetTransport,
};

impl From<TargetError> for ConvertError {
    fn from(e: TargetError) -> Self {
        match e {
            TargetError::Invalid { field, reason } => ConvertError::Invalid { field, reason },
            other => ConvertError::Invalid {
                field: "kv_target",
                reason: other.to_string(),
            },
        }
    }
}

impl From<&KvTarget> for v1::KvTarget {
    fn from(t: &KvTarget) -> Self {
        let (placement, staging_offset, pool_num_blocks) = match t.placement {
            Placement::Staging { offset } => (v1::KvPlacement::Staging, offset, 0),
            Placement::Pool { num_blocks } => (v1::KvPlacement::Pool, 0, num_blocks),
        };
        v1::KvTarget {
            request_id: t.request.0,
            decode_node_id: t.decode_node.0.clone(),
            decode_grpc_addr: t.decode_grpc_addr.clone(),
            transport: match t.transport {
                TargetTransport::Ucx => v1::TransportKind::Ucx,
                TargetTransport::InProcess => v1::TransportKind::InProcess,
            } as i32,
            ucx_worker_address: t.worker_address.clone(),
            ranks: t
                .ranks
                .iter()
                .map(|r| v1::RankTarget {
                    rank: r.rank,
                    rkey: r.rkey.clone(),
                    remote_base_addr: r.base_addr,
                    region_len: r.region_len,
                    ucx_worker_address: r.worker_address.clone(),
                    device_memory: r.device_memory,
                })
                .collect(),
            block_ids: t.blocks.iter().map(|b| b.0).collect(),
            layout: Some(v1::KvLayout::from(&t.layout)),
            secret: t.secret.clone(),
            lease_deadline_ms: t.lease_deadline_ms,
            placement: placement as i32,
            staging_offset,
            pool_num_blocks,
            staging_generation: t.staging_generation,
            fence_record: t.fence_record,
            verify: t.verify,
        }
    }
}

impl TryFrom<v1::KvTarget> for KvTarget {
    type Error = ConvertError;
    fn try_from(t: v1::KvTarget) -> Result<Self, ConvertError> {
        let transport = match wire_enum::<v1::TransportKind>("kv_target.transport", t.transport)? {
            v1::TransportKind::Unspecified => {
                return Err(ConvertError::Unspecified {
                    field: "kv_target.transport",
                });
            }
            v1::TransportKind::Ucx => TargetTransport::Ucx,
            v1::TransportKind::InProcess => TargetTransport::InProcess,
        };
        let placement = match wire_enum::<v1::KvPlacement>("kv_target.placement", t.placement)? {
            // Read as STAGING (the field's documented default).
            v1::KvPlacement::Unspecified | v1::KvPlacement::Staging => Placement::Staging {
                offset: t.staging_offset,
            },
            v1::KvPlacement::Pool => {
                if t.pool_num_blocks == 0 {
                    return Err(ConvertError::Invalid {
                        field: "kv_target.pool_num_blocks",
                        reason: "must be at least 1".into(),
                    });
                }
                Placement::Pool {
                    num_blocks: t.pool_num_blocks,
                }
            }
        };
        let layout = KvLayout::try_from(t.layout.ok_or(ConvertError::Missing {
            field: "kv_target.layout",
        })?)?;
        let target = KvTarget {
            request: RequestId(t.request_id),
            decode_node: NodeId::new(t.decode_node_id),
            decode_grpc_addr: t.decode_grpc_addr,
            transport,
            worker_address: t.ucx_worker_address,
            ranks: t
                .ranks
                .into_iter()
                .map(|r| RankTarget {
                    rank: r.rank,
                    rkey: r.rkey,
                    base_addr: r.remote_base_addr,
                    region_len: r.region_len,
                    worker_address: r.ucx_worker_address,
                    device_memory: r.device_memory,
                })
                .collect(),
            blocks: t.block_ids.into_iter().map(BlockId).collect(),
            layout,
            secret: t.secret,
            lease_deadline_ms: t.lease_deadline_ms,
            placement,
            staging_generation: t.staging_generation,
            fence_record: t.fence_record,
            verify: t.verify,
        };
        target.validate()?;
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire() -> v1::KvTarget {
        v1::KvTarget {
            request_id: 9,
            decode_node_id: "d".into(),
            decode_grpc_addr: "127.0.0.1:2".into(),
            transport: v1::TransportKind::Ucx as i32,
            ucx_worker_address: vec![1; 8],
            ranks: vec![v1::RankTarget {
                rank: 0,
                rkey: vec![2; 8],
                remote_base_addr: 4096,
                region_len: 1 << 20,
                ucx_worker_address: Vec::new(),
                device_memory: true,
            }],
            block_ids: vec![5, 1],
            layout: Some(v1::KvLayout {
                dtype: v1::Dtype::Bf16 as i32,
                num_layers: 2,
                block_size: 16,
                kv_heads_per_rank: 1,
                head_dim: 64,
                tp_size: 1,
                model_fingerprint: "f".into(),
                kind: v1::KvKind::KeyValue as i32,
            }),
            secret: vec![3; pdnode_core::kv_target::SECRET_LEN],
            lease_deadline_ms: 77,
            placement: v1::KvPlacement::Staging as i32,
            staging_offset: 512,
            pool_num_blocks: 0,
            staging_generation: 4,
            fence_record: true,
            verify: false,
        }
    }

    #[test]
    fn round_trips() {
        let t = KvTarget::try_from(wire()).unwrap();
        assert_eq!(t.placement, Placement::Staging { offset: 512 });
        assert_eq!(t.blocks, vec![BlockId(5), BlockId(1)]);
        assert!(t.ranks[0].device_memory);
        assert_eq!(v1::KvTarget::from(&t), wire());
    }

    #[test]
    fn bad_wire_values_are_errors_not_panics() {
        type Spoil = Box<dyn Fn(&mut v1::KvTarget)>;
        let spoil: Vec<(&str, Spoil)> = vec![
            ("kv_target.transport", Box::new(|t| t.transport = 0)),
            ("kv_target.transport", Box::new(|t| t.transport = 99)),
            ("kv_target.placement", Box::new(|t| t.placement = 42)),
            ("kv_target.layout", Box::new(|t| t.layout = None)),
            (
                "kv_target.pool_num_blocks",
                Box::new(|t| t.placement = v1::KvPlacement::Pool as i32),
            ),
            (
                "ranks.region_len",
                Box::new(|t| t.ranks[0].remote_base_addr = u64::MAX - 1),
            ),
            ("kv_target", Box::new(|t| t.staging_offset = (1 << 20) + 1)),
            ("secret", Box::new(|t| t.secret.clear())),
            ("block_ids", Box::new(|t| t.block_ids.clear())),
            ("ranks.rank", Box::new(|t| t.ranks[0].rank = 3)),
        ];
        for (field, f) in spoil {
            let mut w = wire();
            f(&mut w);
            let err = KvTarget::try_from(w).unwrap_err();
            let named = match &err {
                ConvertError::UnknownEnumValue { field, .. }
                | ConvertError::Unspecified { field }
                | ConvertError::Missing { field }
                | ConvertError::Invalid { field, .. } => *field,
            };
            assert_eq!(named, field, "{err}");
        }
    }
}
