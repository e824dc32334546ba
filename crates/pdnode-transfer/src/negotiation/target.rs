//! The KV target: where and how prefill writes one request's KV on the decode node. The node
//! runtime converts it to and from `pdnode.v1.KvTarget`.

use super::Secret;
use crate::region::{PoolGeometry, RemoteRegion};
use pdnode_core::{BlockId, KvLayout, NodeId, RequestId};
use serde::{Deserialize, Serialize};

/// Where in the decode node's registered region a request's KV goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Placement {
    /// A receive staging area at `offset` in the region, laid out `[layer][i][layer-block]`
    /// over the target's blocks in order; decode scatters it into its pool after KvDone.
    Staging { offset: u64 },
    /// Straight into the decode pool (the region is the pool of `num_blocks` blocks): each
    /// layer-block goes to its destination block's offset; contiguous runs make one span.
    Pool { num_blocks: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTarget {
    pub request: RequestId,
    pub decode_node: NodeId,
    /// The decode side's transport address (UCX worker address).
    pub worker_address: Vec<u8>,
    pub region: RemoteRegion,
    pub placement: Placement,
    /// Destination blocks in prompt order.
    pub blocks: Vec<BlockId>,
    pub layout: KvLayout,
    pub secret: Secret,
    /// Unix time (ms) when decode frees the reservation if no KvDone arrived.
    pub lease_deadline_ms: u64,
}

impl KvTarget {
    /// Bytes of one layer of this request's KV.
    pub fn layer_bytes(&self) -> u64 {
        self.blocks.len() as u64 * self.layout.block_layer_bytes() as u64
    }

    /// The destination pool geometry for [`Placement::Pool`].
    pub fn pool_geometry(&self) -> Option<PoolGeometry> {
        match self.placement {
            Placement::Pool { num_blocks } => Some(PoolGeometry {
                num_layers: self.layout.num_layers,
                num_blocks,
                block_layer_bytes: self.layout.block_layer_bytes() as u64,
            }),
            Placement::Staging { .. } => None,
        }
    }
}

/// How a push ended, as prefill reports it in KvDone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DoneStatus {
    /// Every byte written and flushed.
    Ok,
    Failed(String),
    Aborted(String),
}
