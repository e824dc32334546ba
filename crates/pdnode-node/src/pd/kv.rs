//! How a node moves a request's KV to a decode node: in process (role = "all": the decode
//! engine's handle is looked up by node id) or over UCX (a registered receive staging region on
//! the decode side, one put from a registered send staging region on the prefill side, then a
//! flush). The KV target travels as an encoded `pdnode.v1.KvTarget`.

use pdnode_core::{NodeId, RequestId};
use pdnode_engine::engine::EngineHandle;
use pdnode_proto::v1;
use pdnode_transfer::{
    KvTransport, MemKind, Registration, RemoteRegion, RemoteTarget, Span, UcxTransport,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Decode engines of this process, by node id (role = "all").
#[derive(Default)]
pub struct InProcessDirectory {
    engines: Mutex<HashMap<NodeId, EngineHandle>>,
}

impl InProcessDirectory {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    pub fn insert(&self, id: NodeId, engine: EngineHandle) {
        self.engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, engine);
    }
    pub fn get(&self, id: &NodeId) -> Option<EngineHandle> {
        self.engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }
}

/// The KV mover of a node.
#[derive(Clone)]
pub enum KvMover {
    InProcess(Arc<InProcessDirectory>),
    Ucx(Arc<UcxTransport>),
}

impl KvMover {
    pub fn transport_kind(&self) -> v1::TransportKind {
        match self {
            KvMover::InProcess(_) => v1::TransportKind::InProcess,
            KvMover::Ucx(_) => v1::TransportKind::Ucx,
        }
    }

    /// Decode side: a registered host receive region of `len` bytes (UCX only), for a hand-off
    /// that does not go through the staging arena.
    pub fn receive_staging(&self, len: usize) -> Result<Option<Registration>, String> {
        match self {
            KvMover::InProcess(_) => Ok(None),
            KvMover::Ucx(t) => t
                .allocate_registered(len.max(1))
                .map(Some)
                .map_err(|e| format!("allocating {len} bytes of receive staging: {e}")),
        }
    }

    /// Prefill side: writes `data` (`[layer][block][layer-block bytes]`) into the decode node's
    /// reservation described by `target`, and returns once the bytes are visible there.
    pub async fn push(
        &self,
        id: RequestId,
        target: &v1::KvTarget,
        layers: u32,
        data: Vec<u8>,
        deadline: Instant,
    ) -> Result<(), String> {
        let transport = v1::TransportKind::try_from(target.transport)
            .map_err(|_| format!("KV target names unknown transport {}", target.transport))?;
        match (self, transport) {
            (KvMover::InProcess(dir), v1::TransportKind::InProcess) => {
                let node = NodeId::new(target.decode_node_id.clone());
                let engine = dir
                    .get(&node)
                    .ok_or_else(|| format!("decode node {node} is not in this process"))?;
                engine
                    .write_kv(id, 0..layers, data)
                    .await
                    .map_err(|e| format!("writing KV into decode node {node}: {e}"))
            }
            (KvMover::Ucx(t), v1::TransportKind::Ucx) => {
                let ranks = target.ranks.len();
                if ranks == 0 || !data.len().is_multiple_of(ranks) {
                    return Err(format!(
                        "KV of {} bytes does not split over the target's {ranks} rank regions",
                        data.len()
                    ));
                }
                let per_rank = data.len() / ranks;
                let reg = t
                    .allocate_registered(data.len().max(1))
                    .map_err(|e| format!("allocating {} bytes of send staging: {e}", data.len()))?;
                copy_into(&reg, &data)?;
                let sources: Vec<(&Registration, u64)> =
                    (0..ranks).map(|r| (&reg, (r * per_rank) as u64)).collect();
                put_ranks(t, target, &sources, per_rank as u64, deadline).await
            }
            (_, other) => Err(format!(
                "KV target asks for transport {other:?}, this node moves KV with {:?}",
                self.transport_kind()
            )),
        }
    }
}

/// Puts rank `r`'s `len` bytes, at `sources[r].1` of `sources[r].0`, to the target's rank `r`
/// region at `staging_offset` (one put per rank, all issued before any is waited for), then
/// flushes every rank: on return the bytes are visible at the decode node.
pub async fn put_ranks(
    t: &UcxTransport,
    target: &v1::KvTarget,
    sources: &[(&Registration, u64)],
    len: u64,
    deadline: Instant,
) -> Result<(), String> {
    if sources.len() != target.ranks.len() {
        return Err(format!(
            "KV target has {} rank regions, this node sends {} ranks",
            target.ranks.len(),
            sources.len()
        ));
    }
    let mut remotes = Vec::with_capacity(sources.len());
    let mut puts = Vec::with_capacity(sources.len());
    for (r, ((reg, local_offset), rank)) in sources.iter().zip(&target.ranks).enumerate() {
        let remote = connect_rank(t, target, r, rank, len)?;
        let span = Span {
            local_offset: *local_offset,
            remote_offset: target.staging_offset,
            len,
        };
        puts.push(
            t.put(reg, &remote, &[span])
                .map_err(|e| format!("put rank {r}: {e}"))?,
        );
        remotes.push(remote);
    }
    // Flushed right behind the puts (a flush completes after every put issued before it on the
    // endpoint): no wake-up of this task between the last put and the flush.
    let mut flushes = Vec::with_capacity(remotes.len());
    for (r, remote) in remotes.iter().enumerate() {
        flushes.push(
            t.flush(remote)
                .map_err(|e| format!("flush rank {r}: {e}"))?,
        );
    }
    for (r, p) in puts.into_iter().enumerate() {
        p.wait_async(deadline)
            .await
            .map_err(|e| format!("put rank {r}: {e}"))?;
    }
    for (r, f) in flushes.into_iter().enumerate() {
        f.wait_async(deadline)
            .await
            .map_err(|e| format!("flush rank {r}: {e}"))?;
    }
    drop(remotes);
    Ok(())
}

/// Copies `data` into a registered host region.
fn copy_into(reg: &Registration, data: &[u8]) -> Result<(), String> {
    let r = reg.region();
    if r.mem != MemKind::Host || r.len < data.len() {
        return Err(format!(
            "staging region {:?} of {} bytes cannot take {} host bytes",
            r.mem,
            r.len,
            data.len()
        ));
    }
    // SAFETY: the registration owns `r.len` bytes of host memory at `r.addr` that stay
    // allocated while `reg` lives; no transfer uses this fresh region yet.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), r.addr as *mut u8, data.len()) };
    Ok(())
}

/// Copies the first `len` bytes out of a registered host region.
pub fn copy_out(reg: &Registration, len: usize) -> Result<Vec<u8>, String> {
    let r = reg.region();
    if r.mem != MemKind::Host || r.len < len {
        return Err(format!(
            "staging region {:?} of {} bytes cannot give {len} host bytes",
            r.mem, r.len
        ));
    }
    let mut out = vec![0u8; len];
    // SAFETY: the registration owns `r.len >= len` bytes of host memory at `r.addr`; the put
    // into it was flushed by the prefill node before it answered, and nothing writes it now.
    unsafe { std::ptr::copy_nonoverlapping(r.addr as *const u8, out.as_mut_ptr(), len) };
    Ok(out)
}

/// Checks that `len` bytes at the target's staging offset fit rank `r`'s region, and connects to
/// that region (the rank's own worker address, else the target's).
pub(super) fn connect_rank(
    t: &UcxTransport,
    target: &v1::KvTarget,
    r: usize,
    rank: &v1::RankTarget,
    len: u64,
) -> Result<RemoteTarget, String> {
    if target.staging_offset.saturating_add(len) > rank.region_len {
        return Err(format!(
            "KV of {len} bytes does not fit rank {r}'s region of {} bytes at offset {}",
            rank.region_len, target.staging_offset
        ));
    }
    let worker = if rank.ucx_worker_address.is_empty() {
        &target.ucx_worker_address
    } else {
        &rank.ucx_worker_address
    };
    t.connect(
        worker,
        &RemoteRegion {
            base_addr: rank.remote_base_addr,
            len: rank.region_len,
            rkey: rank.rkey.clone(),
        },
    )
    .map_err(|e| {
        format!(
            "connecting to decode node {} rank {r}: {e}",
            target.decode_node_id
        )
    })
}
