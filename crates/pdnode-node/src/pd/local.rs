//! [`PdNode`]: one prefill or decode engine behind the router's `NodeClient` seam. The all-in-one
//! node hands these to its router directly; prefill and decode processes serve them over the
//! `pdnode.v1.Node` gRPC API (`super::wire`).
//!
//! Decode side: `reserve_kv` reserves blocks under the engine's transfer lease, mints a secret and
//! (UCX) a span of the node's registered staging arena (every TP rank's, at one offset), or, when
//! there is no arena or it is full, a fresh registered host staging region; then answers the KV
//! target (one rank region per TP rank). `decode` checks the secret, scatters the staged bytes
//! into the reserved blocks (device to device from the arena), admits the request and streams.
//! Prefill side: `prefill` runs the prompt (prefill-only engine), gathers the request's KV from
//! its hand-off lease into a span of its own arena (or reads it to the host when it has no arena
//! span, or its arena is device memory and the target is not), puts rank `r`'s bytes to the
//! target's rank `r` region, flushes, releases the lease and the span, and answers the first
//! token. Every failure after a reservation or a lease releases it; a reservation nobody claims
//! is freed by the engine at its lease deadline, and its staging here by [`PdNode::sweep`].

use super::arena::{ArenaSlice, StagingArena};
use super::fence::{self, FenceCounters, FenceError, FenceStats, RECORD_LEN};
use super::kv::{KvMover, copy_ranks, put_ranks};
use super::overlap::OverlapPush;
use futures::future::BoxFuture;
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::request::GenerateRequest;
use pdnode_core::{KvLayout, NodeId, RequestId, Role};
use pdnode_engine::engine::{EngineEvent, EngineHandle, StagedReady};
use pdnode_proto::v1;
use pdnode_router::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, NodeClient, NodeError, NodeStats, PrefillCall,
    PrefillOutcome, ReserveKv,
};
use pdnode_transfer::{Registration, Secret};
use prost::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod push;

/// Where a reservation's KV lands before the scatter.
enum Staging {
    /// In process: the prefill node writes the pool itself.
    None,
    /// A registered host region for this request alone (all ranks back to back).
    Host(HostStage),
    /// A span of the node's staging arena (same offset on every rank).
    Arena(ArenaSlice),
}

/// A per-request host staging region, counted in the node's host staging budget
/// (`transfer.host_staging_bytes`) until it is dropped.
struct HostStage {
    reg: Registration,
    bytes: u64,
    used: Arc<AtomicU64>,
}

impl Drop for HostStage {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// How the KV of a fenced staging span is laid out: rank `r`'s bytes at its data offset
/// (arena: the span's offset in rank `r`'s arena; host: `r * stride`), its fence record right
/// behind them.
#[derive(Debug, Clone, Copy)]
struct FenceSpec {
    per_rank: usize,
    stride: usize,
    ranks: usize,
    verify: bool,
}

struct DecodeSlot {
    secret: Secret,
    blocks: usize,
    staging: Staging,
    /// This reservation's staging generation (unique per span handed out by this node).
    generation: u64,
    /// Set when the prefill node writes fence records (host staging over UCX).
    fence: Option<FenceSpec>,
    expires: Instant,
}

/// A span released by an abort, a lease end or a failed check while its writer may still be
/// putting into it: freed when the writer's record shows it finished, or at `until`.
struct Quarantined {
    request: RequestId,
    staging: Staging,
    generation: u64,
    fence: Option<FenceSpec>,
    /// Whether an intact record of the generation ends the quarantine early (not after a
    /// checksum mismatch: some other writer touched the span).
    trust_record: bool,
    until: Instant,
}

/// Staging spans of a decode node by state (the arena's and per-request host regions alike).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Held by a reservation waiting for its `decode` call.
    pub owned: usize,
    /// Released but fenced (a late put may still land).
    pub quarantined: usize,
    /// Bytes of the arena free for the next reservation (0 without an arena).
    pub arena_free_bytes: usize,
    pub arena_bytes: usize,
    /// Bytes of per-request host staging held (owned and quarantined).
    pub host_bytes: u64,
}

/// Where rank `r`'s bytes of a fenced staging span start, in which registration.
fn rank_data<'a>(
    staging: &'a Staging,
    spec: &FenceSpec,
    r: usize,
) -> Option<(&'a Registration, usize)> {
    match staging {
        Staging::None => None,
        Staging::Arena(slice) => slice
            .arena()
            .registration(r)
            .map(|reg| (reg, slice.offset())),
        Staging::Host(h) => r.checked_mul(spec.stride).map(|at| (&h.reg, at)),
    }
}

/// Whether every rank of the span carries an intact fence record of `generation`.
fn records_present(staging: &Staging, spec: &FenceSpec, generation: u64) -> bool {
    (0..spec.ranks).all(|r| {
        rank_data(staging, spec, r)
            .and_then(|(reg, at)| at.checked_add(spec.per_rank).map(|o| (reg, o)))
            .and_then(|(reg, o)| fence::read_record(reg, o).ok().flatten())
            .is_some_and(|rec| rec.generation == generation)
    })
}

/// A prefill or decode engine as a router sees it.
pub struct PdNode {
    id: NodeId,
    role: Role,
    engine: EngineHandle,
    mover: KvMover,
    lease: Duration,
    slots: Mutex<HashMap<RequestId, DecodeSlot>>,
    arena: Option<Arc<StagingArena>>,
    /// Whether the fall-back to host staging was logged (once per node).
    fallback_logged: AtomicBool,
    /// Hand-offs (prefill: pushes; decode: reservations) through the arena and through the host.
    via_arena: AtomicU64,
    via_host: AtomicU64,
    /// Blocks pushed while the prompt's later chunks were still computing (prefill node).
    early_blocks: AtomicU64,
    /// `engine.kv_push_layer_group`: layers per in-step gather and put of a prompt's last step.
    push_layer_group: AtomicU32,
    /// Puts issued for layer groups gathered inside a prefill step.
    layer_puts: AtomicU64,
    /// The next staging generation (decode).
    generation: AtomicU64,
    /// Staging spans released while a writer may still put into them (decode).
    quarantine: Mutex<Vec<Quarantined>>,
    fence: Arc<FenceCounters>,
    /// `transfer.verify`: ask for and check a CRC32C of the landed KV (decode).
    verify: AtomicBool,
    /// `transfer.host_staging_bytes`, and the bytes of per-request host staging held now
    /// (decode: owned and quarantined).
    host_cap: AtomicU64,
    host_used: Arc<AtomicU64>,
}

/// How often a UCX node's quarantined staging spans are looked at.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// The longest a hand-off waits for room in a full staging arena (see `PdNode::room_deadline`).
pub const MAX_ARENA_WAIT: Duration = Duration::from_secs(5);

fn nerr(kind: ErrorKind, msg: impl Into<String>) -> NodeError {
    NodeError::new(kind, msg)
}

fn eerr(e: &pdnode_engine::engine::EngineError) -> NodeError {
    NodeError::new(e.kind(), e.to_string())
}

impl PdNode {
    pub fn new(
        id: NodeId,
        role: Role,
        engine: EngineHandle,
        mover: KvMover,
        lease: Duration,
    ) -> Arc<Self> {
        Self::with_staging(id, role, engine, mover, lease, None)
    }

    /// As [`PdNode::new`], with the node's registered KV staging arena (UCX movers; one region
    /// per TP rank of the engine).
    pub fn with_staging(
        id: NodeId,
        role: Role,
        engine: EngineHandle,
        mover: KvMover,
        lease: Duration,
        arena: Option<Arc<StagingArena>>,
    ) -> Arc<Self> {
        let ucx = matches!(mover, KvMover::Ucx(_));
        let node = Arc::new(Self {
            id,
            role,
            engine,
            mover,
            lease,
            slots: Mutex::new(HashMap::new()),
            arena,
            fallback_logged: AtomicBool::new(false),
            via_arena: AtomicU64::new(0),
            via_host: AtomicU64::new(0),
            early_blocks: AtomicU64::new(0),
            push_layer_group: AtomicU32::new(
                pdnode_core::config::EngineConfig::default().kv_push_layer_group,
            ),
            layer_puts: AtomicU64::new(0),
            generation: AtomicU64::new(1),
            quarantine: Mutex::new(Vec::new()),
            fence: Arc::new(FenceCounters::default()),
            verify: AtomicBool::new(pdnode_core::config::TransferConfig::default().verify),
            host_cap: AtomicU64::new(
                pdnode_core::config::TransferConfig::default().host_staging_bytes,
            ),
            host_used: Arc::new(AtomicU64::new(0)),
        });
        // Quarantined spans come back without waiting for the next reservation's sweep (a
        // reservation waiting for arena room is woken by the free).
        if ucx && let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&node);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(SWEEP_EVERY).await;
                    let Some(n) = weak.upgrade() else { break };
                    n.sweep();
                }
            });
        }
        node
    }

    /// `transfer.verify`: whether this decode node asks for and checks a CRC32C of the KV that
    /// lands in its host staging.
    pub fn set_verify(&self, on: bool) {
        self.verify.store(on, Ordering::Relaxed);
    }

    /// `transfer.host_staging_bytes`: the most bytes of per-request host staging this decode
    /// node holds at once; a reservation that would need more is refused (Unavailable).
    pub fn set_host_staging_bytes(&self, cap: u64) {
        self.host_cap.store(cap, Ordering::Relaxed);
    }

    /// Fencing counters, with the number of spans in quarantine now.
    pub fn fence_stats(&self) -> FenceStats {
        self.fence.snapshot(self.quarantined().len() as u64)
    }

    /// Staging spans by state: owned by a reservation, quarantined, and the arena's free bytes.
    pub fn staging_stats(&self) -> StagingStats {
        let owned = self
            .slots()
            .values()
            .filter(|s| !matches!(s.staging, Staging::None))
            .count();
        let quarantined = self.quarantined().len();
        StagingStats {
            owned,
            quarantined,
            arena_free_bytes: self.arena.as_ref().map(|a| a.free_bytes()).unwrap_or(0),
            arena_bytes: self.arena.as_ref().map(|a| a.len()).unwrap_or(0),
            host_bytes: self.host_used.load(Ordering::Relaxed),
        }
    }

    fn quarantined(&self) -> std::sync::MutexGuard<'_, Vec<Quarantined>> {
        self.quarantine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases a reservation's staging: at once when nothing can write it any more (no
    /// staging, or every rank carries its writer's record, which is put only after that
    /// writer's KV puts were flushed), else into quarantine until one lease past its lease.
    fn release_staging(&self, id: RequestId, slot: DecodeSlot, trust_record: bool) {
        if matches!(slot.staging, Staging::None) {
            return;
        }
        if trust_record
            && slot
                .fence
                .is_some_and(|f| records_present(&slot.staging, &f, slot.generation))
        {
            return;
        }
        self.fence.quarantined.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(request = %id, generation = slot.generation, "staging span quarantined");
        self.quarantined().push(Quarantined {
            request: id,
            staging: slot.staging,
            generation: slot.generation,
            fence: slot.fence,
            trust_record,
            until: slot.expires + self.lease,
        });
    }

    /// Frees quarantined spans whose writer finished (its record is there) or whose fence
    /// deadline passed.
    fn sweep_quarantine(&self, now: Instant) {
        let mut q = self.quarantined();
        // Freed after the lock is let go (a host region's deregistration waits for UCX).
        let mut freed = Vec::new();
        let mut keep = Vec::new();
        for e in q.drain(..) {
            let done = e.trust_record
                && e.fence
                    .is_some_and(|f| records_present(&e.staging, &f, e.generation));
            if done {
                self.fence
                    .released_by_record
                    .fetch_add(1, Ordering::Relaxed);
            } else if now >= e.until {
                self.fence
                    .released_at_deadline
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(request = %e.request, generation = e.generation,
                    "quarantined staging span freed at its fence deadline");
            }
            if !done && now < e.until {
                keep.push(e);
            } else {
                freed.push(e);
            }
        }
        *q = keep;
        drop(q);
        drop(freed);
    }

    /// Checks what landed in a fenced span before the scatter: every rank's record of this
    /// reservation's generation, request and length, and (with `verify`) the checksum.
    fn check_landed(&self, id: RequestId, slot: &DecodeSlot) -> Result<(), FenceError> {
        let Some(spec) = slot.fence else {
            return Ok(());
        };
        for r in 0..spec.ranks {
            let (reg, at) = rank_data(&slot.staging, &spec, r).ok_or(FenceError::NotHost {
                what: "rank region",
                offset: 0,
                len: spec.per_rank,
            })?;
            let rec_at = at.checked_add(spec.per_rank).ok_or(FenceError::NotHost {
                what: "record offset",
                offset: at,
                len: spec.per_rank,
            })?;
            let rec = fence::read_record(reg, rec_at)?.ok_or(FenceError::Missing { rank: r })?;
            let crc = if spec.verify {
                Some(fence::crc_at(reg, at, spec.per_rank)?)
            } else {
                None
            };
            rec.check(r, slot.generation, id.0, spec.per_rank as u64, crc)?;
        }
        Ok(())
    }

    /// Layers per in-step gather and put during a prompt's last prefill step
    /// (`engine.kv_push_layer_group`; 0: the whole KV after the step).
    pub fn set_push_layer_group(&self, layers: u32) {
        self.push_layer_group.store(layers, Ordering::Relaxed);
    }

    /// Puts this prefill node issued for layer groups gathered inside a prefill step.
    pub fn layer_puts(&self) -> u64 {
        self.layer_puts.load(Ordering::Relaxed)
    }

    /// The node's staging arena, if it has one.
    pub fn staging_arena(&self) -> Option<&Arc<StagingArena>> {
        self.arena.as_ref()
    }

    /// Hand-offs so far through the staging arena and through host staging (prefill node:
    /// pushes; decode node: reservations over UCX).
    pub fn staging_counts(&self) -> (u64, u64) {
        (
            self.via_arena.load(Ordering::Relaxed),
            self.via_host.load(Ordering::Relaxed),
        )
    }

    /// Blocks (per layer) this prefill node pushed while later prefill chunks were computing.
    pub fn overlapped_blocks(&self) -> u64 {
        self.early_blocks.load(Ordering::Relaxed)
    }

    /// Arena reservations that found it full and waited, and those that then gave up (the
    /// hand-off went through the host).
    pub fn arena_wait_counts(&self) -> (u64, u64) {
        self.arena
            .as_ref()
            .map(|a| a.wait_counts())
            .unwrap_or((0, 0))
    }

    /// How long a hand-off waits for room in a full staging arena before it stages through
    /// the host: a quarter of the lease, at most [`MAX_ARENA_WAIT`], and never past `limit`.
    fn room_deadline(&self, limit: Instant) -> Instant {
        (Instant::now() + (self.lease / 4).min(MAX_ARENA_WAIT)).min(limit)
    }

    fn tp_ranks(&self) -> usize {
        self.layout().tp_size.max(1) as usize
    }

    fn note_fallback(&self, side: &str, bytes: usize) {
        self.via_host.fetch_add(1, Ordering::Relaxed);
        if !self.fallback_logged.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                node = %self.id,
                side,
                bytes,
                arena = self.arena.as_ref().map(|a| a.len()).unwrap_or(0),
                "KV staging arena absent, full or not usable for this peer: host staging (logged once)"
            );
        }
    }

    pub fn id(&self) -> &NodeId {
        &self.id
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    fn layout(&self) -> &KvLayout {
        &self.engine.info().kv_layout
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, DecodeSlot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops reservations whose lease has passed, after a grace of one more lease: the engine
    /// freed their blocks at the deadline already, but a prefill node may still be putting into
    /// the receive staging until its own push deadline (its start + one lease), so the staging
    /// region stays registered until then. Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let grace = self.lease;
        let expired: Vec<DecodeSlot> = {
            let mut slots = self.slots();
            let ids: Vec<RequestId> = slots
                .iter()
                .filter(|(_, s)| s.expires + grace <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| slots.remove(id)).collect()
        };
        let n = expired.len();
        // Held one lease past their lease already: their fence deadline has passed.
        drop(expired);
        self.sweep_quarantine(now);
        n
    }

    /// Reservations waiting for their `decode` call.
    pub fn pending_reservations(&self) -> usize {
        self.slots().len()
    }

    fn expect_role(&self, want: Role, what: &str) -> Result<(), NodeError> {
        if self.role == want || self.role == Role::All {
            Ok(())
        } else {
            Err(nerr(
                ErrorKind::InvalidRequest,
                format!(
                    "{what} goes to a {want} node; {} is a {} node",
                    self.id, self.role
                ),
            ))
        }
    }

    async fn do_reserve(&self, req: ReserveKv) -> Result<KvTarget, NodeError> {
        self.expect_role(Role::Decode, "ReserveKv")?;
        self.sweep();
        let id = req.request_id;
        let prompt_len = req.prompt_token_ids.len();
        let blocks = self
            .engine
            .reserve_for_transfer(id, prompt_len)
            .await
            .map_err(|e| eerr(&e))?;
        let layout = self.layout().clone();
        let per_rank = layout.num_layers as usize * blocks.len() * layout.block_layer_bytes();
        let (staging, ranks, staging_offset, fence) = match self.receive_staging(id, per_rank).await
        {
            Ok(s) => s,
            Err(e) => {
                let _ = self.engine.release_transfer(id).await;
                return Err(e);
            }
        };
        let generation = self.generation.fetch_add(1, Ordering::Relaxed);
        let secret = Secret::random();
        let deadline_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
            + self.lease.as_millis() as u64;
        let mut target = v1::KvTarget {
            request_id: id.0,
            decode_node_id: self.id.to_string(),
            transport: self.mover.transport_kind() as i32,
            block_ids: blocks.iter().map(|b| b.0).collect(),
            layout: Some((&layout).into()),
            secret: secret.as_bytes().to_vec(),
            lease_deadline_ms: deadline_ms,
            placement: v1::KvPlacement::Staging as i32,
            staging_offset,
            ranks,
            staging_generation: generation,
            fence_record: fence.is_some(),
            verify: fence.is_some_and(|f| f.verify),
            ..Default::default()
        };
        if let KvMover::Ucx(t) = &self.mover {
            use pdnode_transfer::KvTransport;
            target.ucx_worker_address = t.local_address();
        }
        self.slots().insert(
            id,
            DecodeSlot {
                secret,
                blocks: blocks.len(),
                staging,
                generation,
                fence,
                expires: Instant::now() + self.lease,
            },
        );
        Ok(KvTarget {
            decode_node: self.id.clone(),
            secret: target.secret.clone(),
            encoded: target.encode_to_vec().into(),
        })
    }

    /// Decode side: where a reservation of `per_rank` bytes per TP rank lands, the rank regions
    /// of its KV target, the target's `staging_offset`, and how its fence records lie (host
    /// memory only: each rank's span has room for one behind its KV).
    /// A full arena is waited on (until [`PdNode::room_deadline`]) before host staging.
    async fn receive_staging(
        &self,
        id: RequestId,
        per_rank: usize,
    ) -> Result<(Staging, Vec<v1::RankTarget>, u64, Option<FenceSpec>), NodeError> {
        if matches!(self.mover, KvMover::InProcess(_)) {
            return Ok((Staging::None, Vec::new(), 0, None));
        }
        let ranks = self.tp_ranks();
        let verify = self.verify.load(Ordering::Relaxed);
        let overflow = || nerr(ErrorKind::InvalidRequest, "the KV of this prompt overflows");
        let with_record = per_rank.checked_add(RECORD_LEN).ok_or_else(overflow)?;
        let slice = match self.arena.as_ref().filter(|a| a.ranks() == ranks) {
            Some(a) => {
                let t0 = Instant::now();
                let want = if a.is_device() { per_rank } else { with_record };
                let s = a
                    .reserve_wait(want, self.room_deadline(t0 + self.lease))
                    .await;
                let waited = t0.elapsed();
                if waited > Duration::from_millis(1) {
                    let (waits, gave_up) = a.wait_counts();
                    tracing::debug!(request = %id, bytes = per_rank * ranks,
                        waited_ms = waited.as_millis() as u64, got = s.is_some(),
                        arena_waits = waits, arena_wait_timeouts = gave_up,
                        "KV reservation waited for staging arena room");
                }
                s
            }
            None => None,
        };
        if let Some(slice) = slice {
            let arena = slice.arena().clone();
            let targets = (0..ranks)
                .filter_map(|r| arena.registration(r).map(|reg| (r, reg.descriptor())))
                .map(|(r, d)| v1::RankTarget {
                    rank: r as u32,
                    rkey: d.rkey.clone(),
                    remote_base_addr: d.base_addr,
                    region_len: d.len,
                    ucx_worker_address: Vec::new(),
                    device_memory: arena.is_device(),
                })
                .collect();
            let offset = slice.offset() as u64;
            let fence = (!arena.is_device()).then_some(FenceSpec {
                per_rank,
                stride: 0,
                ranks,
                verify,
            });
            self.via_arena.fetch_add(1, Ordering::Relaxed);
            return Ok((Staging::Arena(slice), targets, offset, fence));
        }
        // Rank `r`'s KV at `r * stride`, its fence record right behind it.
        let stride = with_record;
        let total = stride.checked_mul(ranks).ok_or_else(overflow)?;
        // Host staging is capped: past the cap the reservation is refused (the router tries
        // another decode node or answers 503), never an allocation without bound.
        let cap = self.host_cap.load(Ordering::Relaxed);
        let taken = self
            .host_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(total as u64).filter(|n| *n <= cap)
            });
        if let Err(in_use) = taken {
            return Err(nerr(
                ErrorKind::Unavailable,
                format!(
                    "decode node {}: no staging arena room for {id} and host staging is full                      ({in_use} of transfer.host_staging_bytes = {cap} bytes in use, {total} more needed)",
                    self.id
                ),
            ));
        }
        let budget = HostStage {
            reg: match self.mover.receive_staging(total) {
                Ok(Some(reg)) => reg,
                other => {
                    self.host_used.fetch_sub(total as u64, Ordering::Relaxed);
                    return match other {
                        Err(e) => Err(nerr(ErrorKind::Retryable, e)),
                        _ => Ok((Staging::None, Vec::new(), 0, None)),
                    };
                }
            },
            bytes: total as u64,
            used: self.host_used.clone(),
        };
        self.note_fallback("decode", total);
        let reg = &budget.reg;
        let d = reg.descriptor();
        let targets = (0..ranks)
            .map(|r| v1::RankTarget {
                rank: r as u32,
                rkey: d.rkey.clone(),
                remote_base_addr: d.base_addr + (r * stride) as u64,
                region_len: stride as u64,
                ucx_worker_address: Vec::new(),
                device_memory: false,
            })
            .collect();
        let fence = FenceSpec {
            per_rank,
            stride,
            ranks,
            verify,
        };
        Ok((Staging::Host(budget), targets, 0, Some(fence)))
    }

    async fn do_prefill(&self, req: PrefillCall) -> Result<PrefillOutcome, NodeError> {
        self.expect_role(Role::Prefill, "Prefill")?;
        let id = req.request_id;
        let target = v1::KvTarget::decode(req.target.encoded.clone()).map_err(|e| {
            nerr(
                ErrorKind::InvalidRequest,
                format!("KV target does not decode: {e}"),
            )
        })?;
        if target.request_id != id.0 {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("KV target is for request {:x}, not {id}", target.request_id),
            ));
        }
        let theirs: KvLayout = target
            .layout
            .as_ref()
            .ok_or_else(|| nerr(ErrorKind::InvalidRequest, "KV target has no layout"))
            .and_then(|l| {
                KvLayout::try_from(l).map_err(|e| nerr(ErrorKind::InvalidRequest, e.to_string()))
            })?;
        if let Err(m) = self.layout().check_compatible(&theirs) {
            return Err(nerr(ErrorKind::InvalidRequest, m.to_string()));
        }
        let started = Instant::now();
        let failed = |m: String| nerr(ErrorKind::Retryable, format!("KV hand-off of {id}: {m}"));
        // The engine takes the overlap's arena span when the first chunk has run.
        let mut overlap = self.start_overlap(&target).map_err(failed)?;
        let greq = GenerateRequest {
            id,
            prompt_token_ids: req.prompt_token_ids.clone(),
            sampling: req.sampling.clone(),
        };
        let (mut stream, mut ready) = match &overlap {
            Some(o) => {
                let (s, r) = self
                    .engine
                    .add_request_staged(
                        greq,
                        o.blocks(),
                        o.alloc(),
                        self.push_layer_group.load(Ordering::Relaxed),
                    )
                    .map_err(|e| eerr(&e))?;
                (s, Some(r))
            }
            None => (self.engine.add_request(greq).map_err(|e| eerr(&e))?, None),
        };
        let (first, logprob, finish, blocks) = loop {
            let ev = tokio::select! {
                biased;
                u = async {
                    match ready.as_mut() {
                        Some(r) => r.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    match (u, overlap.as_mut()) {
                        (Some(u), Some(o)) => {
                            tracing::debug!(
                                request = %id,
                                since_start_us = started.elapsed().as_micros() as u64,
                                report = ?u,
                                "staged KV report"
                            );
                            o.on_ready(u, self.push_deadline(started, &target)).map_err(failed)?
                        }
                        _ => ready = None,
                    }
                    continue;
                }
                ev = stream.next() => ev,
            };
            match ev {
                Some(EngineEvent::PrefillDone {
                    first_token,
                    logprob,
                    finish,
                    blocks,
                    ..
                }) => break (first_token, logprob, finish, blocks),
                Some(EngineEvent::Error { error }) => return Err(eerr(&error)),
                Some(EngineEvent::Finished { reason, .. }) => {
                    return Err(nerr(
                        ErrorKind::Internal,
                        format!(
                            "prefill engine finished {id} ({}) without a hand-off",
                            reason.as_str()
                        ),
                    ));
                }
                Some(EngineEvent::Token { .. }) => continue,
                None => return Err(nerr(ErrorKind::Unavailable, "the prefill engine stopped")),
            }
        };
        if let Some(f) = finish {
            return Ok(PrefillOutcome {
                first_token_id: first,
                first_logprob: logprob,
                finish: Some(f),
                cached_tokens: 0,
                transfer_bytes: 0,
                transfer_us: 0,
            });
        }
        let (result, early) = match overlap.take() {
            Some(o) => {
                self.finish_overlap(id, &target, o, ready, blocks.len(), started)
                    .await
            }
            None => (self.push(id, &target, blocks.len(), started).await, 0),
        };
        // The lease is released off the answer's path: the call waits for the engine's current
        // step (tens of ms under load), which must not delay the first token. The KV is at the
        // decode node already (or the hand-off failed); a release that fails leaves the blocks
        // to the lease's deadline.
        let engine = self.engine.clone();
        tokio::spawn(async move {
            if let Err(e) = engine.release_transfer(id).await {
                tracing::warn!(request = %id, error = %e, "releasing the prefill KV lease failed; freed at its deadline");
            }
        });
        let (bytes, us, via_arena) = result?;
        let (arena_waits, arena_wait_timeouts) = self.arena_wait_counts();
        let ucx_endpoints = match &self.mover {
            KvMover::Ucx(t) => t.endpoints_created(),
            _ => 0,
        };
        tracing::debug!(
            request = %id,
            bytes,
            transfer_us = us,
            via = if via_arena { "arena" } else { "host" },
            early_blocks = early,
            blocks = blocks.len(),
            arena_waits,
            arena_wait_timeouts,
            ucx_endpoints,
            layer_puts = self.layer_puts.load(Ordering::Relaxed),
            host_fallbacks = self.via_host.load(Ordering::Relaxed),
            gbps = %format_args!("{:.2}", bytes as f64 / (us.max(1) as f64 * 1e3)),
            "KV hand-off done"
        );
        Ok(PrefillOutcome {
            first_token_id: first,
            first_logprob: logprob,
            finish: None,
            cached_tokens: 0,
            transfer_bytes: bytes,
            transfer_us: us,
        })
    }

    async fn do_decode(&self, req: DecodeCall) -> Result<DecodeStream, NodeError> {
        self.expect_role(Role::Decode, "Decode")?;
        let id = req.request_id;
        let slot = {
            let mut slots = self.slots();
            match slots.get(&id) {
                None => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!(
                            "no KV reservation for {id} on {} (expired or never made)",
                            self.id
                        ),
                    ));
                }
                Some(s) if !s.secret.matches(&req.secret) => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!("wrong secret for the KV reservation of {id}"),
                    ));
                }
                Some(_) => match slots.remove(&id) {
                    Some(s) => s,
                    None => return Err(nerr(ErrorKind::Internal, "reservation vanished")),
                },
            }
        };
        // Nothing is scattered unless this reservation's own writer finished (its fence record)
        // and, with `transfer.verify`, the bytes are the ones it sent.
        if let Err(e) = self.check_landed(id, &slot) {
            let counter = if e.is_checksum() {
                &self.fence.checksum_failures
            } else {
                &self.fence.record_failures
            };
            counter.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(request = %id, generation = slot.generation, error = %e,
                "landed KV refused before the scatter; the request fails and frees its blocks");
            let _ = self.engine.release_transfer(id).await;
            self.release_staging(id, slot, false);
            return Err(nerr(
                ErrorKind::Retryable,
                format!("KV hand-off of {id} refused before the scatter: {e}"),
            ));
        }
        let layout = self.layout();
        let layers = layout.num_layers;
        let per_rank = layers as usize * slot.blocks * layout.block_layer_bytes();
        let stride = slot.fence.map_or(per_rank, |f| f.stride);
        let scattered = match &slot.staging {
            Staging::None => Ok(()),
            Staging::Arena(slice) => self
                .engine
                .scatter_kv(id, 0..layers, slice.offset())
                .await
                .map_err(|e| eerr(&e)),
            Staging::Host(h) => match copy_ranks(&h.reg, self.tp_ranks(), per_rank, stride) {
                Ok(data) => self
                    .engine
                    .write_kv(id, 0..layers, data)
                    .await
                    .map_err(|e| eerr(&e)),
                Err(m) => Err(nerr(ErrorKind::Internal, m)),
            },
        };
        // The writer finished (its records are there, or the prefill node answered after its
        // flush): the staging (arena span or host region) is free from here on.
        drop(slot);
        if let Err(e) = scattered {
            let _ = self.engine.release_transfer(id).await;
            return Err(e);
        }
        let prompt = req.prompt_token_ids.clone();
        if prompt.is_empty() {
            self.engine.abort(id);
            return Err(nerr(
                ErrorKind::InvalidRequest,
                "Decode needs the prompt token ids",
            ));
        }
        let stream = self
            .engine
            .admit_transferred(
                GenerateRequest {
                    id,
                    prompt_token_ids: prompt,
                    sampling: req.sampling.clone(),
                },
                req.first_token_id,
                None,
            )
            .map_err(|e| eerr(&e))?;
        let rx = stream.into_receiver();
        let s = futures::stream::unfold((rx, false), |(mut rx, done)| async move {
            if done {
                return None;
            }
            let ev = rx.recv().await?;
            let (item, last) = decode_chunk(ev, "decode engine answered like a prefill engine");
            Some((item, (rx, last)))
        });
        Ok(Box::pin(s))
    }
}

impl NodeClient for PdNode {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        Box::pin(self.do_reserve(req))
    }

    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        Box::pin(self.do_prefill(req))
    }

    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        Box::pin(self.do_decode(req))
    }

    fn abort(&self, id: RequestId, reason: String) -> BoxFuture<'_, Result<bool, NodeError>> {
        Box::pin(async move {
            tracing::debug!(request = %id, %reason, node = %self.id, "abort");
            // The engine frees whatever the request holds (queued, running, lease); a
            // reservation's staging goes with its slot.
            let slot = self.slots().remove(&id);
            let had_slot = slot.is_some();
            if let Some(slot) = slot {
                // A prefill node may still be putting into it: fenced until its writer's
                // record shows up or the fence deadline passes.
                self.release_staging(id, slot, true);
            }
            self.engine.abort(id);
            Ok(had_slot || self.role != Role::Decode)
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<NodeStats, NodeError>> {
        Box::pin(async move {
            let s = self.engine.stats().await.map_err(|e| eerr(&e))?;
            let sch = s.scheduler;
            Ok(NodeStats {
                running_requests: sch.running as u32,
                queued_requests: (sch.waiting + sch.transferred) as u32,
                max_running_requests: self.engine.info().max_running_requests as u32,
                kv_blocks_free: sch.kv.free as u64,
                kv_blocks_total: sch.kv.total as u64,
                kv_blocks_reserved: sch.kv.leases as u64,
            })
        })
    }
}

/// One engine event of a decode stream as a [`DecodeChunk`], and whether it is the last one.
/// `PrefillDone` never belongs in a decode stream: it becomes an internal error saying `unexpected`.
pub(super) fn decode_chunk(
    ev: EngineEvent,
    unexpected: &'static str,
) -> (Result<DecodeChunk, NodeError>, bool) {
    match ev {
        EngineEvent::Token { token, logprob, .. } => (
            Ok(DecodeChunk {
                token_ids: vec![token],
                logprobs: logprob.into_iter().collect(),
                finish: None,
                error: None,
            }),
            false,
        ),
        EngineEvent::Finished { reason, .. } => (
            Ok(DecodeChunk {
                finish: Some(reason),
                ..Default::default()
            }),
            true,
        ),
        EngineEvent::Error { error } => (Err(eerr(&error)), true),
        EngineEvent::PrefillDone { .. } => (Err(nerr(ErrorKind::Internal, unexpected)), false),
    }
}
