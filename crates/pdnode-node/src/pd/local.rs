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
//! `abort` stops a request only with its KV capability (the target's secret) wherever one
//! exists: a reservation, a claimed request decoding, a prefill running with its target; a
//! reservation still being made (no capability yet) is cancelled without one
//! (docs/protocol.md, "Capabilities").

use super::arena::{ArenaSlice, StagingArena};
use super::fence::{self, FenceCounters, FenceError, FenceStats, RECORD_LEN};
use super::handoff::{ClaimError, Quarantine, QuarantineEnd, Release, ReleaseCause, Reservation};
use super::held::HeldCaps;
use super::kv::{HandoffError, KvMover, copy_ranks, put_ranks};
use super::overlap::OverlapPush;
use super::peers::RegisteredPeers;
use futures::future::BoxFuture;
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::request::{GenerateRequest, SamplerState};
use pdnode_core::{KvLayout, NodeId, Placement, RankTarget, RequestId, Role};
use pdnode_engine::engine::{EngineEvent, EngineHandle, ScatterCheck, StagedReady};
use pdnode_nodeapi::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, NodeClient, NodeError, NodeStats, PrefillCall,
    PrefillOutcome, ReserveKv,
};
use pdnode_transfer::capability::{CapabilityKey, Grant};
use pdnode_transfer::{Registration, Secret};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

mod abort;
mod decode;
mod here;
mod migrate;
mod push;
mod staging;

use abort::EngineAbortOnDrop;
use staging::{FenceSpec, HostStage, Landing, Quarantined};
pub use staging::{HandoffSettings, StagingStats};

/// Where a reservation's KV lands before the scatter.
enum Staging {
    /// In process: the prefill node writes the pool itself.
    None,
    /// A registered host region for this request alone (all ranks back to back).
    Host(HostStage),
    /// A span of the node's staging arena (same offset on every rank).
    Arena(ArenaSlice),
}

struct DecodeSlot {
    /// The reservation's state machine: secret, staging generation (unique per span handed
    /// out by this node), lease and fence deadline (`super::handoff`).
    fsm: Reservation,
    blocks: usize,
    staging: Staging,
    /// Set when the prefill node writes fence records (host staging over UCX).
    fence: Option<FenceSpec>,
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
    /// `transfer.stall_ms`, and `transfer.stall_min_rate_mibps` in bytes per second (prefill).
    stall_ms: AtomicU64,
    stall_rate: AtomicU64,
    /// Reservations in progress (decode: `ReserveKv` not answered yet, e.g. waiting for arena
    /// room); `abort` cancels them. Lock order: `reserving`, then `slots`, then `held`.
    reserving: Mutex<HashMap<RequestId, Arc<CancellationToken>>>,
    /// The KV capabilities of requests running here (prefill: the target's, while `Prefill`
    /// runs; decode: a claimed reservation's, while it decodes): `abort` must present them.
    held: HeldCaps,
    /// Mints this decode node's KV capabilities; random per process.
    cap_key: CapabilityKey,
    /// Decode nodes a push to stalled, until when no push goes there (prefill).
    stalled_peers: Mutex<HashMap<NodeId, push::PeerStall>>,
    /// The registered decode nodes a push may go to (prefill over UCX); unset: any target.
    peers: Mutex<Option<RegisteredPeers>>,
    /// Requests this decode node prefills itself (no hand-off), over its own engine
    /// (`here.rs`).
    here: Arc<super::colocated::ColocatedNode>,
    /// Requests parked for a migration, waiting for their push (`migrate.rs`).
    parked: Mutex<HashMap<RequestId, migrate::ParkedSlot>>,
    /// Set when the node drains by migrating: every decode stream asks its router to move it.
    migrate_asked: tokio::sync::watch::Sender<bool>,
}

/// Removes a reservation in progress from [`PdNode::reserving`] when `ReserveKv` ends.
struct Reserving<'a> {
    node: &'a PdNode,
    id: RequestId,
    token: Arc<CancellationToken>,
}

impl Drop for Reserving<'_> {
    fn drop(&mut self) {
        let mut r = self
            .node
            .reserving
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if r.get(&self.id).is_some_and(|t| Arc::ptr_eq(t, &self.token)) {
            r.remove(&self.id);
        }
    }
}

/// How often a UCX node's quarantined staging spans are looked at.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// How long a prefill node sends no push to a decode node after a push to it stalled
/// (`transfer.stall_ms`); as long as the router avoids a node it found unreachable.
pub const STALLED_PEER_COOL_OFF: Duration = Duration::from_secs(5);

/// The longest a prefill waits for its registry view to show the target's decode node (one
/// that registered a moment ago; the router may see it first).
const PEER_VIEW_WAIT: Duration = Duration::from_secs(1);

/// The longest a hand-off waits for room in a full staging arena (see `PdNode::room_deadline`).
pub const MAX_ARENA_WAIT: Duration = Duration::from_secs(5);

/// Unix time, ms (0 before 1970).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

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
        let here = super::colocated::ColocatedNode::new(id.clone(), engine.clone(), lease);
        let node = Arc::new(Self {
            here,
            parked: Mutex::new(HashMap::new()),
            migrate_asked: tokio::sync::watch::Sender::new(false),
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
            stall_ms: AtomicU64::new(pdnode_core::config::TransferConfig::default().stall_ms),
            stall_rate: AtomicU64::new(
                pdnode_core::config::TransferConfig::default().stall_min_rate_mibps << 20,
            ),
            reserving: Mutex::new(HashMap::new()),
            held: HeldCaps::default(),
            cap_key: CapabilityKey::random(),
            stalled_peers: Mutex::new(HashMap::new()),
            peers: Mutex::new(None),
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

    /// Pushes (prefill over UCX) go only to these decode nodes, at the UCX worker their cards
    /// registered (replaces what was set before).
    pub fn set_registered_peers(&self, peers: RegisteredPeers) {
        *self.peers.lock().unwrap_or_else(|p| p.into_inner()) = Some(peers);
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

    /// Drops reservations and parked requests whose lease has passed (the engine freed their
    /// blocks then) and sweeps the quarantine. A dropped reservation's span is free at once when its writer's
    /// fence record is there (a finished push, or an abandoned one's record); else a prefill
    /// node may still be putting into it until its own push deadline (its start + one lease),
    /// so it stays registered, in quarantine, until the fence deadline. Returns how many were
    /// dropped.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let expired: Vec<(RequestId, DecodeSlot)> = {
            let mut slots = self.slots();
            let ids: Vec<RequestId> = slots
                .iter()
                .filter(|(_, s)| s.fsm.sweepable(now))
                .map(|(id, _)| *id)
                .collect();
            ids.iter()
                .filter_map(|id| slots.remove(id).map(|s| (*id, s)))
                .collect()
        };
        let n = expired.len();
        for (id, slot) in expired {
            self.release_staging(id, slot, ReleaseCause::LeaseEnd);
        }
        self.sweep_quarantine(now);
        n + self.sweep_parked(now) + self.here.sweep()
    }

    /// Reservations waiting for their `decode` call.
    pub fn pending_reservations(&self) -> usize {
        self.slots().len()
    }

    /// Whether a `Prefill` or `Decode` of `id` runs here holding its KV capability (what an
    /// `Abort` of it is checked against). Answered without the engine, which a test polling
    /// its stats would wait on for a whole step.
    pub fn holds_capability(&self, id: RequestId) -> bool {
        self.held.contains(id)
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

    async fn do_prefill(&self, req: PrefillCall) -> Result<PrefillOutcome, NodeError> {
        self.expect_role(Role::Prefill, "Prefill")?;
        let id = req.request_id;
        let target = &req.target;
        // Targets from the wire were checked in the conversion; in-process ones are checked
        // here, so every path sees a well-formed target.
        target
            .validate()
            .map_err(|e| nerr(ErrorKind::InvalidRequest, e.to_string()))?;
        if target.request != id {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("KV target is for request {}, not {id}", target.request),
            ));
        }
        if let Err(m) = self.layout().check_compatible(&target.layout) {
            return Err(nerr(ErrorKind::InvalidRequest, m.to_string()));
        }
        // The target's capability, held while this call runs: the router's `abort` presents it.
        let cap = Secret::from_bytes(&target.secret).ok_or_else(|| {
            nerr(
                ErrorKind::InvalidRequest,
                "the KV target's secret is not a KV capability",
            )
        })?;
        let Some(hold) = self.held.try_hold(id, cap) else {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("request {id} is prefilling on {} already", self.id),
            ));
        };
        // A UCX endpoint only to a registered decode node, at the worker its card names.
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let (KvMover::Ucx(_), Some(peers)) = (&self.mover, peers)
            && let Err(e) = peers.admit(target, PEER_VIEW_WAIT).await
        {
            return Err(nerr(e.kind(), format!("KV target of {id}: {e}")));
        }
        let started = Instant::now();
        // The engine's part: queueing and the prompt's chunks, until the first token.
        let compute = tracing::info_span!(
            "compute",
            cached_tokens = tracing::field::Empty,
            kv_reports = tracing::field::Empty,
        );
        let mut kv_reports = 0u32;
        // The request's wait for its first step, then one span per prompt chunk (from the
        // engine's `Prefilling` notes; each closes when the next starts or prefill ends).
        let mut queue = Some(tracing::info_span!(parent: &compute, "queue"));
        let mut chunk: Option<tracing::Span> = None;
        let failed = |e: HandoffError| self.handoff_failed(id, target, e);
        let _probe = self.check_peer(id, target)?;
        // The engine takes the overlap's arena span when the first chunk has run.
        let mut overlap = self.start_overlap(target).map_err(failed)?;
        let greq = GenerateRequest {
            id,
            prompt_token_ids: req.prompt_token_ids.clone(),
            sampling: super::engine_sampling(req.sampling.clone()),
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
                        o.seal(),
                    )
                    .map_err(|e| eerr(&e))?;
                (s, Some(r))
            }
            None => (self.engine.add_request(greq).map_err(|e| eerr(&e))?, None),
        };
        // From here the engine holds the request (then its blocks under the hand-off lease). A
        // call dropped midway (the router gave up on it: its stream was reset) ends it there, so
        // its blocks and lease are freed at once: the release below is then never reached, and
        // a later abort finds no capability to stop (the call's hold went with it).
        let mut in_engine = EngineAbortOnDrop {
            engine: &self.engine,
            id,
            armed: true,
        };
        let (first, logprob, finish, blocks, sampler, cached) = loop {
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
                            kv_reports += 1;
                            pdnode_telemetry::event(&compute, "kv_ready", format!("{u:?}"));
                            tracing::debug!(
                                request = %id,
                                since_start_us = started.elapsed().as_micros() as u64,
                                report = ?u,
                                "staged KV report"
                            );
                            o.on_ready(u, self.push_deadline(started, target)).map_err(failed)?
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
                    sampler,
                    cached_tokens,
                    ..
                }) => {
                    let sampler = SamplerState {
                        seed: sampler.seed,
                        word_pos: sampler.word_pos,
                    };
                    let cached = u32::try_from(cached_tokens).unwrap_or(u32::MAX);
                    drop((queue.take(), chunk.take()));
                    compute.record("cached_tokens", cached);
                    compute.record("kv_reports", kv_reports);
                    break (first_token, logprob, finish, blocks, sampler, cached);
                }
                Some(EngineEvent::Error { error }) => {
                    pdnode_telemetry::fail(&compute, &error);
                    return Err(eerr(&error));
                }
                // An accepted abort that reached the engine first ends the request there:
                // the call ends Cancelled, as when it lands after the engine's part.
                Some(EngineEvent::Finished { .. }) if hold.stopped() => {
                    return Err(nerr(
                        ErrorKind::Cancelled,
                        format!("prefill of {id} on {} was aborted", self.id),
                    ));
                }
                Some(EngineEvent::Finished { reason, .. }) => {
                    return Err(nerr(
                        ErrorKind::Internal,
                        format!(
                            "prefill engine finished {id} ({}) without a hand-off",
                            reason.as_str()
                        ),
                    ));
                }
                Some(EngineEvent::Prefilling { start_pos, tokens }) => {
                    queue = None;
                    chunk = Some(tracing::info_span!(parent: &compute, "chunk", start_pos, tokens));
                    continue;
                }
                Some(EngineEvent::Token { .. }) => continue,
                None => return Err(nerr(ErrorKind::Unavailable, "the prefill engine stopped")),
            }
        };
        // An abort answered `true` ends the call Cancelled, also when it came after the
        // engine's part (which it could no longer stop).
        let aborted = || {
            nerr(
                ErrorKind::Cancelled,
                format!("prefill of {id} on {} was aborted", self.id),
            )
        };
        if let Some(f) = finish {
            if hold.stopped() {
                return Err(aborted());
            }
            // Finished in its prefill: the engine holds nothing of it any more.
            in_engine.armed = false;
            return Ok(PrefillOutcome {
                first_token_id: first,
                first_logprob: logprob,
                finish: Some(f),
                cached_tokens: cached,
                transfer_bytes: 0,
                transfer_us: 0,
                sampler: Some(sampler),
            });
        }
        drop(compute);
        // What is left of the KV hand-off after the prompt's last step (all of it without
        // the overlap), to the flush at the decode node.
        let handoff = tracing::info_span!(
            "kv_handoff",
            overlap = overlap.is_some(),
            blocks = blocks.len(),
            bytes = tracing::field::Empty,
            transfer_us = tracing::field::Empty,
            via = tracing::field::Empty,
            early_blocks = tracing::field::Empty,
            layer_puts = tracing::field::Empty,
            layer_group = self.push_layer_group.load(Ordering::Relaxed),
            // What the decode node asked for: fence records behind the KV, and a checksum of
            // the bytes in them (checked there before the scatter: `decode_admission`).
            fence_record = target.fence_record,
            verify = target.verify,
        );
        let (result, early) = match overlap.take() {
            Some(o) => {
                self.finish_overlap(id, target, o, ready, blocks.len(), started)
                    .instrument(handoff.clone())
                    .await
            }
            None => (
                self.push(id, target, blocks.len(), started)
                    .instrument(handoff.clone())
                    .await,
                0,
            ),
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
        in_engine.armed = false;
        // A put in flight is not cut (UCX reads its source until it completes): an abort during
        // the hand-off takes effect when the push ends, and the decode node's fence keeps what
        // landed out of any other request's KV (docs/runtime-semantics.md, "Abort").
        let result = if hold.stopped() {
            Err(aborted())
        } else {
            result
        };
        let (bytes, us, via_arena) = result.inspect_err(|e| pdnode_telemetry::fail(&handoff, e))?;
        self.peer_ok(&target.decode_node);
        handoff.record("bytes", bytes);
        handoff.record("transfer_us", us);
        handoff.record("via", if via_arena { "arena" } else { "host" });
        handoff.record("early_blocks", early);
        handoff.record("layer_puts", self.layer_puts.load(Ordering::Relaxed));
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
            cached_tokens: cached,
            transfer_bytes: bytes,
            transfer_us: us,
            sampler: Some(sampler),
        })
    }
}

impl NodeClient for PdNode {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        if self.prefills_here(&req) {
            let span = tracing::info_span!(
                "reservation_here",
                prompt_tokens = req.prompt_token_ids.len()
            );
            return Box::pin(crate::trace::in_span(span, self.reserve_here(req)));
        }
        let span = tracing::info_span!(
            "reservation",
            prompt_tokens = req.prompt_token_ids.len(),
            max_tokens = req.max_tokens,
        );
        Box::pin(crate::trace::in_span(span, self.do_reserve(req)))
    }

    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        if self.holds_here(req.request_id) {
            let span =
                tracing::info_span!("prefill_here", prompt_tokens = req.prompt_token_ids.len());
            return Box::pin(crate::trace::in_span(span, self.here.do_prefill(req)));
        }
        let span = tracing::info_span!(
            "prefill",
            prompt_tokens = req.prompt_token_ids.len(),
            blocks = req.target.blocks.len(),
        );
        Box::pin(crate::trace::in_span(span, self.do_prefill(req)))
    }

    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        if self.holds_here(req.request_id) {
            return Box::pin(self.here.do_decode(req));
        }
        let span = tracing::info_span!(
            "decode_admission",
            checked = tracing::field::Empty,
            verified = tracing::field::Empty,
        );
        Box::pin(crate::trace::in_span(span, self.do_decode(req)))
    }

    fn abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        reason: String,
    ) -> BoxFuture<'_, Result<bool, NodeError>> {
        Box::pin(async move {
            if let Some(r) = self.abort_parked(id, &capability) {
                return r;
            }
            // A request prefilled here is the kept engine's; it checks the capability.
            if self.role == Role::Decode
                && NodeClient::abort(&*self.here, id, capability.clone(), reason.clone()).await?
            {
                return Ok(true);
            }
            self.do_abort(id, capability, reason).await
        })
    }

    fn migrate(
        &self,
        req: pdnode_nodeapi::MigrateCall,
    ) -> BoxFuture<'_, Result<pdnode_nodeapi::MigrateOutcome, NodeError>> {
        let span = tracing::info_span!("migrate", push = req.target.is_some());
        Box::pin(crate::trace::in_span(span, self.do_migrate(req)))
    }

    fn request_migrations(&self) -> usize {
        PdNode::request_migrations(self)
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
                accounting: Some({
                    let mut a = super::engine_accounting(&s);
                    self.staging_accounting(&mut a);
                    a
                }),
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
                ..Default::default()
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
        EngineEvent::PrefillDone { .. } | EngineEvent::Prefilling { .. } => {
            (Err(nerr(ErrorKind::Internal, unexpected)), false)
        }
    }
}
