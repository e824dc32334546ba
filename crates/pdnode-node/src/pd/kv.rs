//! How a node moves a request's KV to a decode node: in process (role = "all": the decode
//! engine's handle is looked up by node id) or over UCX (a registered receive staging region on
//! the decode side, one put from a registered send staging region on the prefill side, then a
//! flush). The KV target is the checked [`pdnode_core::KvTarget`]; every remote offset comes from
//! its checked accessors.

use super::fence::{self, FenceRecord, RECORD_LEN, SourceHold};
use super::handoff::{PushError, PushWait};
use pdnode_core::kv_target::TargetError;
use pdnode_core::{ErrorKind, KvTarget, NodeId, RequestId, TargetTransport};
use pdnode_engine::engine::{EngineError, EngineHandle};
use pdnode_transfer::fence::FenceError;
use pdnode_transfer::{
    Completion, KvTransport, MemKind, Registration, RemoteRegion, RemoteTarget, Secret, Span,
    TransferError, UcxTransport,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Why a step of a KV hand-off failed. [`HandoffError::kind`] is the class the node answers
/// with: the transport's back-pressure is `Unavailable` (another pair may have room), a failed
/// or late put is `Retryable`, an engine error keeps the engine's class, and a target or a
/// progress report that does not fit this node is `Internal` (retrying elsewhere would not help).
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// A transport call failed; `step` says which (e.g. "put rank 1").
    #[error("{step}: {source}")]
    Transfer {
        step: String,
        #[source]
        source: TransferError,
    },
    /// The engine failed a write or gather of the request's KV.
    #[error("{step}: {source}")]
    Engine {
        step: String,
        #[source]
        source: EngineError,
    },
    #[error("KV target: {0}")]
    Target(#[from] TargetError),
    #[error("fence record: {0}")]
    Fence(#[from] FenceError),
    #[error(transparent)]
    Push(#[from] PushError),
    /// Puts or flushes not over `waited_ms` after they were issued, past the time their `bytes`
    /// need at the slowest expected rate plus `transfer.stall_ms`: the link or the decode node
    /// stalls. The puts stay in flight (their source is held; the decode node fences them).
    #[error(
        "{step}: stalled, not over after {waited_ms} ms for {bytes} bytes (transfer.stall_ms, transfer.stall_min_rate_mibps)"
    )]
    Stalled {
        step: String,
        waited_ms: u64,
        bytes: u64,
    },
    /// This node's KV and the target (or its own staging) do not fit together.
    #[error("{0}")]
    Mismatch(String),
}

impl HandoffError {
    /// A `map_err` for a transport call at `step`.
    pub fn at(step: impl Into<String>) -> impl FnOnce(TransferError) -> Self {
        let step = step.into();
        move |source| Self::Transfer { step, source }
    }

    pub fn kind(&self) -> ErrorKind {
        use pdnode_core::error::Classify;
        match self {
            Self::Transfer {
                source: TransferError::Busy { .. },
                ..
            } => ErrorKind::Unavailable,
            Self::Transfer { .. } | Self::Stalled { .. } | Self::Push(PushError::PastDeadline) => {
                ErrorKind::Retryable
            }
            Self::Engine { source, .. } => source.kind(),
            Self::Target(_) | Self::Fence(_) | Self::Push(_) | Self::Mismatch(_) => {
                ErrorKind::Internal
            }
        }
    }
}

/// The reservation's KV capability, which tags every fence record the prefill node writes.
pub(super) fn capability(target: &KvTarget) -> Result<Secret, HandoffError> {
    Secret::from_bytes(&target.secret).ok_or_else(|| {
        HandoffError::Mismatch(format!(
            "the KV target carries a capability of {} bytes, not 16",
            target.secret.len()
        ))
    })
}

/// Waits for `ops` (puts and flushes moving `bytes` in all, issued at `from`) under `wait`: a
/// stall (see [`PushWait`]) is [`HandoffError::Stalled`], the push deadline or a failed
/// operation a [`HandoffError::Transfer`] naming `step` and the operation's index.
pub(super) async fn wait_ops<'a>(
    ops: impl IntoIterator<Item = &'a Completion>,
    bytes: u64,
    from: Instant,
    wait: &PushWait,
    step: &str,
) -> Result<(), HandoffError> {
    let (until, stall) = wait.give_up(from, bytes);
    for (i, op) in ops.into_iter().enumerate() {
        match op.wait_async(until).await {
            Ok(()) => {}
            Err(TransferError::Timeout { .. }) if stall => {
                return Err(HandoffError::Stalled {
                    step: format!("{step} {i}"),
                    waited_ms: from.elapsed().as_millis() as u64,
                    bytes,
                });
            }
            Err(source) => {
                return Err(HandoffError::Transfer {
                    step: format!("{step} {i}"),
                    source,
                });
            }
        }
    }
    Ok(())
}

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
    pub fn transport_kind(&self) -> TargetTransport {
        match self {
            KvMover::InProcess(_) => TargetTransport::InProcess,
            KvMover::Ucx(_) => TargetTransport::Ucx,
        }
    }

    /// Decode side: a registered host receive region of `len` bytes (UCX only), for a hand-off
    /// that does not go through the staging arena.
    pub fn receive_staging(&self, len: usize) -> Result<Option<Registration>, HandoffError> {
        match self {
            KvMover::InProcess(_) => Ok(None),
            KvMover::Ucx(t) => {
                t.allocate_registered(len.max(1))
                    .map(Some)
                    .map_err(HandoffError::at(format!(
                        "allocating {len} bytes of receive staging"
                    )))
            }
        }
    }

    /// Prefill side: writes `data` (this node's `ranks` tensor-parallel ranks back to back,
    /// each `[layer][block][layer-block bytes]`) into the decode node's reservation described
    /// by `target`, and returns once the bytes are visible there; each target rank gets the
    /// bytes of its source rank ([`KvTarget::source_ranks`]: its own, or with a latent between
    /// TP degrees, any rank's whole copy). The host staging it puts from is kept by the
    /// [`SourceHold`] `hold` makes until its puts are done.
    #[allow(clippy::too_many_arguments)]
    pub async fn push(
        &self,
        id: RequestId,
        target: &KvTarget,
        layers: u32,
        ranks: usize,
        data: Vec<u8>,
        wait: PushWait,
        hold: impl FnOnce(Box<dyn std::any::Any + Send>) -> SourceHold,
    ) -> Result<(), HandoffError> {
        let map = target.source_ranks(ranks)?;
        if !data.len().is_multiple_of(ranks) {
            return Err(HandoffError::Mismatch(format!(
                "KV of {} bytes does not split over this node's {ranks} ranks",
                data.len()
            )));
        }
        let per_rank = data.len() / ranks;
        match (self, target.transport) {
            (KvMover::InProcess(dir), TargetTransport::InProcess) => {
                let node = target.decode_node.clone();
                let engine = dir.get(&node).ok_or_else(|| {
                    HandoffError::Mismatch(format!("decode node {node} is not in this process"))
                })?;
                // The decode engine takes its own ranks' bytes back to back.
                let data = for_target_ranks(data, per_rank, &map)?;
                engine
                    .write_kv(id, 0..layers, data)
                    .await
                    .map_err(|source| HandoffError::Engine {
                        step: format!("writing KV into decode node {node}"),
                        source,
                    })
            }
            (KvMover::Ucx(t), TargetTransport::Ucx) => {
                // Rank `r`'s bytes at `r * stride`, with room for its fence record behind them.
                let stride = per_rank + if target.fence_record { RECORD_LEN } else { 0 };
                let total = stride
                    .checked_mul(ranks)
                    .ok_or_else(|| HandoffError::Mismatch("send staging overflows".into()))?;
                let reg = Arc::new(t.allocate_registered(total.max(1)).map_err(
                    HandoffError::at(format!("allocating {total} bytes of send staging")),
                )?);
                for (r, chunk) in data.chunks(per_rank.max(1)).enumerate() {
                    copy_into(&reg, r * stride, chunk)?;
                }
                let mut hold = hold(Box::new(reg.clone()));
                let sources: Vec<(&Registration, u64)> =
                    (0..ranks).map(|r| (&*reg, (r * stride) as u64)).collect();
                put_ranks(
                    t,
                    id,
                    target,
                    &sources,
                    per_rank as u64,
                    wait,
                    &mut hold,
                    None,
                )
                .await
            }
            (_, other) => Err(HandoffError::Mismatch(format!(
                "KV target asks for transport {other:?}, this node moves KV with {:?}",
                self.transport_kind()
            ))),
        }
    }
}

/// Puts source rank `s`'s `len` bytes, at `sources[s].1` of `sources[s].0`, to each target rank
/// `j` it fills (`s = j % sources.len()`, [`KvTarget::source_ranks`]: rank `j` itself at equal
/// TP degrees; a latent, whole on every rank, between different ones) at `staging_offset` (one
/// put per target rank, all issued before any is waited for), then flushes every target rank:
/// on return the bytes are visible at the decode node. When the target asks for fence records,
/// each source's record (written into the source right behind its bytes, which must have room)
/// follows once the KV is flushed, and is flushed too. Every put goes into `hold`, which keeps
/// the sources until they are done. `engine`: the engine whose staging arena the sources are,
/// when it is device memory (records and checksums go through it).
#[allow(clippy::too_many_arguments)]
pub async fn put_ranks(
    t: &Arc<UcxTransport>,
    id: RequestId,
    target: &KvTarget,
    sources: &[(&Registration, u64)],
    len: u64,
    wait: PushWait,
    hold: &mut SourceHold,
    engine: Option<&EngineHandle>,
) -> Result<(), HandoffError> {
    let map = target.source_ranks(sources.len())?;
    if map.len() != target.ranks.len() {
        return Err(HandoffError::Mismatch(format!(
            "KV target has {} rank regions for a layout of {} ranks",
            target.ranks.len(),
            map.len()
        )));
    }
    let record = if target.fence_record {
        RECORD_LEN as u64
    } else {
        0
    };
    let remotes = connect_ranks(t, target, len.saturating_add(record))?;
    let mut at = Vec::with_capacity(map.len());
    for r in 0..map.len() {
        at.push(target.remote_offset(r, 0, len)?);
    }
    // From the first put on, a push that fails owes the decode node its abandoned record.
    if let Some((rec, cap)) = abandoned_record(target, len)? {
        let owed = remotes
            .iter()
            .zip(&at)
            .map(|(remote, at)| (Arc::clone(remote), at.saturating_add(len)))
            .collect();
        hold.on_abandon(send_abandoned(t.clone(), owed, rec, cap));
    }
    let first = hold.puts().len();
    let issued = Instant::now();
    for (r, (&s, remote)) in map.iter().zip(&remotes).enumerate() {
        let (reg, local_offset) = &sources[s];
        let span = Span {
            local_offset: *local_offset,
            remote_offset: at[r],
            len,
        };
        hold.push(
            t.put(reg, remote, &[span])
                .map_err(HandoffError::at(format!("put rank {r}")))?,
        );
    }
    // Flushed right behind the puts (a flush completes after every put issued before it on the
    // endpoint): no wake-up of this task between the last put and the flush.
    let mut flushes = Vec::with_capacity(remotes.len());
    for (r, remote) in remotes.iter().enumerate() {
        flushes.push(
            t.flush(remote)
                .map_err(HandoffError::at(format!("flush rank {r}")))?,
        );
    }
    let bytes = len.saturating_mul(remotes.len() as u64);
    wait_ops(&hold.puts()[first..], bytes, issued, &wait, "put rank").await?;
    wait_ops(&flushes, bytes, issued, &wait, "flush rank").await?;
    if target.fence_record {
        let spans: Vec<_> = sources
            .iter()
            .map(|(reg, at)| (*reg, *at as usize, len as usize))
            .collect();
        let io = RecordIo {
            sources: &spans,
            map: &map,
            remotes: &remotes,
        };
        put_records(t, id, target, io, &wait, hold, engine, false).await?;
    }
    hold.settled();
    drop(remotes);
    Ok(())
}

/// The "abandoned" fence record a push of `per_rank` bytes a rank owes `target` if it fails
/// after its first put, and the capability that tags it; `None` when the target asks for no
/// records or has device memory (a record goes from a fresh host region, which UCX cannot put
/// into a peer's device memory: a device span waits out its fence deadline).
pub(super) fn abandoned_record(
    target: &KvTarget,
    per_rank: u64,
) -> Result<Option<(FenceRecord, Secret)>, HandoffError> {
    if !target.fence_record || target.ranks.iter().any(|r| r.device_memory) {
        return Ok(None);
    }
    let rec = FenceRecord {
        generation: target.staging_generation,
        request: target.request.0,
        len: per_rank,
        sum: None,
        aborted: true,
    };
    Ok(Some((rec, capability(target)?)))
}

/// What an abandoned push sends once every put it issued is over
/// ([`SourceHold::on_abandon`]): a flush of each rank's endpoint (every put issued before it is
/// then visible at the peer), then `rec` at each rank's offset in `owed`, flushed. The decode
/// node's quarantine of the span ends when it reads the record, not at its fence deadline.
/// Every wait ends by the hold deadline it is given, not sooner: a decode node frozen or cut
/// off for a while gets the record when it comes back within it.
pub(super) fn send_abandoned(
    t: Arc<UcxTransport>,
    owed: Vec<(Arc<RemoteTarget>, u64)>,
    rec: FenceRecord,
    cap: Secret,
) -> fence::Abandon {
    Box::new(move |until| {
        for (r, _) in &owed {
            if t.flush(r).and_then(|f| f.wait(until)).is_err() {
                tracing::debug!(
                    generation = rec.generation,
                    "abandoned KV push: its endpoint failed or stayed stalled; no record sent"
                );
                return;
            }
        }
        let Ok(reg) = t.allocate_registered(RECORD_LEN) else {
            return;
        };
        if fence::write_record(&reg, 0, &rec, &cap).is_err() {
            return;
        }
        let puts: Vec<_> = owed
            .iter()
            .filter_map(|(r, at)| {
                let span = Span {
                    local_offset: 0,
                    remote_offset: *at,
                    len: RECORD_LEN as u64,
                };
                t.put(&reg, r, &[span]).ok()
            })
            .collect();
        for p in &puts {
            let _ = p.wait(until);
        }
        for (r, _) in &owed {
            let _ = t.flush(r).and_then(|f| f.wait(until));
        }
        tracing::debug!(
            generation = rec.generation,
            "abandoned KV push: fence record sent"
        );
    })
}

/// Where [`put_records`] reads and writes: each source rank's `(region, at, len)` (rank `s`'s
/// at index `s`), and for each target rank `j` (its endpoint `remotes[j]`) the source rank
/// `map[j]` whose KV it took.
pub(super) struct RecordIo<'a> {
    pub sources: &'a [(&'a Registration, usize, usize)],
    pub map: &'a [usize],
    pub remotes: &'a [Arc<RemoteTarget>],
}

/// Behind KV already flushed to the decode node: each source rank's fence record (generation,
/// request, length, and the checksum of the rank's source bytes when the target asks for it:
/// CRC32C into host staging, KVH64 into device staging), written once into the source right
/// behind its `len` bytes at `at`, put to the same place behind the KV of every target rank
/// that took that source's KV, and flushed. Sources in device memory (the engine's staging
/// arena, rank `s`'s at index `s`) are summed and written through `engine`, unless `sealed`: the
/// engine wrote the records there already ([`pdnode_engine::engine::StagingSeal`]), and they
/// are only put.
#[allow(clippy::too_many_arguments)]
pub(super) async fn put_records(
    t: &UcxTransport,
    id: RequestId,
    target: &KvTarget,
    io: RecordIo<'_>,
    wait: &PushWait,
    hold: &mut SourceHold,
    engine: Option<&EngineHandle>,
    sealed: bool,
) -> Result<(), HandoffError> {
    let RecordIo {
        sources,
        map,
        remotes,
    } = io;
    if map.len() != remotes.len() || map.iter().any(|&s| s >= sources.len()) {
        return Err(HandoffError::Mismatch(format!(
            "fence records of {} source ranks for {} target ranks (map {map:?})",
            sources.len(),
            remotes.len()
        )));
    }
    let first = hold.puts().len();
    let issued = Instant::now();
    let cap = capability(target)?;
    let on_device = |reg: &Registration| reg.region().mem != MemKind::Host;
    let engine_step = |step: &str| {
        let step = step.to_string();
        move |source| HandoffError::Engine { step, source }
    };
    // Device sources: the KVH64 of every rank's span at once (one read of each on its GPU).
    let device_sums = match sources.first() {
        Some((reg, at, len)) if on_device(reg) && target.verify && !sealed => {
            let engine = engine.ok_or_else(|| {
                HandoffError::Mismatch("device KV source without its engine".into())
            })?;
            let t0 = Instant::now();
            let sums = engine
                .staging_kvh64(*at, *len)
                .await
                .map_err(engine_step("summing the staged KV"))?;
            tracing::debug!(request = %id, bytes = len * sources.len(),
                sum_us = t0.elapsed().as_micros() as u64, "device KV summed (KVH64)");
            Some(sums)
        }
        _ => None,
    };
    // Each source's record once (the first target rank it fills says which staging kind the
    // checksum is for), before any record is put.
    for (s, &(reg, at, len)) in sources.iter().enumerate() {
        let Some(j) = map.iter().position(|&m| m == s) else {
            continue;
        };
        if !(sealed && on_device(reg)) {
            let sum = device_sums.as_ref().and_then(|v| v.get(s)).copied();
            let engine = engine.map(|e| (e, hold.span()));
            write_source_record(target, id, (s, j), (reg, at, len), sum, &cap, engine).await?;
        }
    }
    for (r, (&s, remote)) in map.iter().zip(remotes).enumerate() {
        let (reg, at, len) = sources[s];
        let rec_at = at
            .checked_add(len)
            .ok_or_else(|| HandoffError::Mismatch("fence record offset overflows".into()))?;
        let span = Span {
            local_offset: rec_at as u64,
            remote_offset: target.remote_offset(r, len as u64, RECORD_LEN as u64)?,
            len: RECORD_LEN as u64,
        };
        hold.push(
            t.put(reg, remote, &[span])
                .map_err(HandoffError::at(format!("fence record put rank {r}")))?,
        );
    }
    let mut flushes = Vec::with_capacity(remotes.len());
    for (r, remote) in remotes.iter().enumerate() {
        flushes.push(
            t.flush(remote)
                .map_err(HandoffError::at(format!("fence record flush rank {r}")))?,
        );
    }
    let bytes = (RECORD_LEN * remotes.len()) as u64;
    wait_ops(
        &hold.puts()[first..],
        bytes,
        issued,
        wait,
        "fence record put",
    )
    .await?;
    wait_ops(&flushes, bytes, issued, wait, "fence record flush").await?;
    Ok(())
}

/// Source rank `r`'s fence record, written into its source right behind the `len` bytes at
/// `at`: the checksum the target asks for (CRC32C into host staging, KVH64 into device staging,
/// as target rank `j`'s region is; `device_sum`: a device source's KVH64, summed by the
/// engine), tagged under `cap`. A host source is written in place, a device source through
/// `engine`, given a share of the arena span it writes into (kept until the write ran).
async fn write_source_record(
    target: &KvTarget,
    id: RequestId,
    (r, j): (usize, usize),
    (reg, at, len): (&Registration, usize, usize),
    device_sum: Option<u64>,
    cap: &Secret,
    engine: Option<(&EngineHandle, Option<pdnode_engine::engine::SpanHold>)>,
) -> Result<(), HandoffError> {
    let on_device = reg.region().mem != MemKind::Host;
    let kind = fence::SumKind::for_staging(target.rank(j)?.device_memory);
    let sum = match (target.verify, on_device, kind) {
        (false, _, _) => None,
        (true, false, kind) => Some(fence::sum_at(reg, at, len, kind)?),
        (true, true, fence::SumKind::Kvh64) => {
            Some(fence::Sum::Kvh64(device_sum.ok_or_else(|| {
                HandoffError::Mismatch(format!("no KVH64 of staging rank {r}"))
            })?))
        }
        (true, true, fence::SumKind::Crc32c) => {
            return Err(HandoffError::Mismatch(
                "device KV into host staging: no device CRC32C on the hand-off path".into(),
            ));
        }
    };
    let rec_at = at
        .checked_add(len)
        .ok_or_else(|| HandoffError::Mismatch("fence record offset overflows".into()))?;
    let record = FenceRecord {
        generation: target.staging_generation,
        request: id.0,
        len: len as u64,
        sum,
        aborted: false,
    };
    if !on_device {
        fence::write_record(reg, rec_at, &record, cap)?;
        return Ok(());
    }
    let (engine, span) = engine
        .ok_or_else(|| HandoffError::Mismatch("device KV source without its engine".into()))?;
    let span = span.ok_or_else(|| {
        HandoffError::Mismatch("a device KV source's fence record outside an arena span".into())
    })?;
    engine
        .staging_write(r, rec_at, record.encode(cap).to_vec(), span)
        .await
        .map_err(|source| HandoffError::Engine {
            step: "writing the fence record".into(),
            source,
        })
}

/// `data` (source ranks of `per_rank` bytes back to back) laid out for the target's ranks:
/// target rank `j` gets source rank `map[j]`'s bytes ([`KvTarget::source_ranks`]); as is when
/// every rank maps to itself.
fn for_target_ranks(
    data: Vec<u8>,
    per_rank: usize,
    map: &[usize],
) -> Result<Vec<u8>, HandoffError> {
    if map.iter().enumerate().all(|(j, &s)| j == s) && map.len() * per_rank == data.len() {
        return Ok(data);
    }
    let parts = map
        .iter()
        .map(|&s| {
            s.checked_mul(per_rank)
                .and_then(|a| data.get(a..a.checked_add(per_rank)?))
                .ok_or_else(|| {
                    HandoffError::Mismatch(format!(
                        "no source rank {s} of {per_rank} bytes in {} bytes of KV",
                        data.len()
                    ))
                })
        })
        .collect::<Result<Vec<&[u8]>, _>>()?;
    Ok(parts.concat())
}

/// Copies `data` into a registered host region at `offset`.
fn copy_into(reg: &Registration, offset: usize, data: &[u8]) -> Result<(), HandoffError> {
    let r = reg.region();
    if r.mem != MemKind::Host || offset.checked_add(data.len()).is_none_or(|e| e > r.len) {
        return Err(HandoffError::Mismatch(format!(
            "staging region {:?} of {} bytes cannot take {} host bytes at {offset}",
            r.mem,
            r.len,
            data.len()
        )));
    }
    // SAFETY: the registration owns `r.len` bytes of host memory at `r.addr` that stay
    // allocated while `reg` lives, and the range is inside (checked); no transfer uses this
    // fresh region yet.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), (r.addr + offset) as *mut u8, data.len())
    };
    Ok(())
}

/// Copies `ranks` runs of `len` bytes, rank `r`'s at `r * stride`, out of a registered host
/// region, back to back.
pub fn copy_ranks(
    reg: &Registration,
    ranks: usize,
    len: usize,
    stride: usize,
) -> Result<Vec<u8>, HandoffError> {
    let r = reg.region();
    let need = ranks
        .checked_sub(1)
        .map_or(Some(0), |last| last.checked_mul(stride)?.checked_add(len));
    if r.mem != MemKind::Host || stride < len || need.is_none_or(|n| n > r.len) {
        return Err(HandoffError::Mismatch(format!(
            "staging region {:?} of {} bytes cannot give {ranks} x {len} host bytes (stride {stride})",
            r.mem, r.len
        )));
    }
    let mut out = vec![0u8; ranks * len];
    for (i, dst) in out.chunks_mut(len.max(1)).enumerate() {
        // SAFETY: the registration owns `r.len` bytes of host memory at `r.addr`, and
        // `i * stride + len <= r.len` (checked above); the writer's puts were flushed before its
        // fence record, which the caller checked.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (r.addr + i * stride) as *const u8,
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
    }
    Ok(out)
}

/// Checks that `len` bytes at the target's staging offset fit rank `r`'s region, and connects to
/// that region (the rank's own worker address, else the target's).
/// [`connect_rank`] for every rank region of `target`. A connection to a peer not yet greeted
/// waits for the peer's answer (up to the transport's call timeout, from a frozen decode node):
/// on a multi-threaded runtime the wait tells the runtime so (`block_in_place`: its other tasks
/// move to other workers) instead of silently holding a worker. Not cancellable: a push whose
/// call is dropped after this still owes its decode node the abandoned record.
pub(super) fn connect_ranks(
    t: &UcxTransport,
    target: &KvTarget,
    len: u64,
) -> Result<Vec<Arc<RemoteTarget>>, HandoffError> {
    let connect = || {
        (0..target.ranks.len())
            .map(|r| connect_rank(t, target, r, len).map(Arc::new))
            .collect()
    };
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(connect),
        _ => connect(),
    }
}

pub(super) fn connect_rank(
    t: &UcxTransport,
    target: &KvTarget,
    r: usize,
    len: u64,
) -> Result<RemoteTarget, HandoffError> {
    // The whole span (KV and fence record) must fit the region: checked, not added blindly.
    target.remote_offset(r, 0, len)?;
    let rank = target.rank(r)?;
    let worker = target.worker_for(r)?;
    t.connect(
        worker,
        &RemoteRegion {
            base_addr: rank.base_addr,
            len: rank.region_len,
            rkey: rank.rkey.clone(),
        },
    )
    .map_err(HandoffError::at(format!(
        "connecting to decode node {} rank {r}",
        target.decode_node
    )))
}

#[cfg(test)]
mod tests;
