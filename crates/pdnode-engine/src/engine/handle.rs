//! [`EngineHandle`]: the typed, cloneable way into an engine loop. Callers never build commands.
//! Calls that wait for a reply have a deadline (`EngineLoopConfig::call_timeout`); request
//! submission never waits (its errors arrive as the stream's first event).

use super::{EngineError, EngineEvent, EngineInfo, EngineStats};
use crate::sampling::SamplerState;
use pdnode_core::request::GenerateRequest;
use pdnode_core::{BlockId, RequestId};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc as tmpsc, oneshot};

pub(crate) type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

/// Commands an engine loop holds before [`EngineHandle`] refuses more (`EngineError::Busy`):
/// the handle never blocks its caller on a full queue. Aborts never get lost to a full queue
/// (they go on a side list the loop drains every iteration).
pub const COMMAND_QUEUE: usize = 4096;
/// Events one request's stream holds unread. The engine thread never waits for a consumer:
/// when a request's stream is full, the loop aborts the request (its blocks are freed at once)
/// and the stream ends with `EngineError::SlowConsumer`. A decode stream gets one event per
/// step, so this is ~1024 steps of a consumer that reads nothing.
pub const EVENT_QUEUE: usize = 1024;

/// The engine thread's end of a request's event stream: bounded, never blocks.
#[derive(Debug, Clone)]
pub(crate) struct EventTx {
    tx: tmpsc::Sender<EngineEvent>,
    overflowed: Arc<AtomicBool>,
}

impl EventTx {
    /// `Err` when the consumer is gone or has [`EVENT_QUEUE`] events unread (then the stream
    /// ends with `SlowConsumer` once drained); the caller aborts the request either way.
    pub(crate) fn send(&self, ev: EngineEvent) -> Result<(), ()> {
        match self.tx.try_send(ev) {
            Ok(()) => Ok(()),
            Err(tmpsc::error::TrySendError::Full(_)) => {
                self.overflowed.store(true, Ordering::Release);
                Err(())
            }
            Err(tmpsc::error::TrySendError::Closed(_)) => Err(()),
        }
    }

    /// Sends a best-effort note (never the request's last event): only while the queue has
    /// room for it and one more, so a note never takes the place of the event that ends the
    /// request, and a full queue is never an overflow because of one.
    pub(crate) fn note(&self, ev: EngineEvent) {
        if self.tx.capacity() >= 2 {
            let _ = self.tx.try_send(ev);
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A bounded event channel of [`EVENT_QUEUE`] events for request `id`.
pub(crate) fn event_channel(id: RequestId) -> (EventTx, RequestStream) {
    let (tx, rx) = tmpsc::channel(EVENT_QUEUE);
    let overflowed = Arc::new(AtomicBool::new(false));
    (
        EventTx {
            tx,
            overflowed: overflowed.clone(),
        },
        RequestStream {
            id,
            rx,
            overflowed,
            reported: false,
        },
    )
}

/// Takes a staging-arena span for a staged prefill, on the engine thread, when its first
/// prefill chunk has run (not while it queues): the span's byte offset, or `None` when the
/// arena has no room now (asked again after the next chunk). Must not block.
pub type StagingAlloc = Box<dyn FnMut() -> Option<usize> + Send>;

/// What the loop writes behind a staged prefill's span once all of it is gathered (after the
/// step that ends the prompt): the fence records of a device hand-off (docs/protocol.md,
/// "Fencing and verification"), each rank's right behind its KV. `make(ranks, sums)` builds
/// them, one per rank in rank order, from each rank's KVH64 of the span (`hash`; `None`
/// without). Done on the
/// engine thread, which owns the arena's device: the hand-off then only puts them, instead of
/// asking the engine (which answers between steps).
pub struct StagingSeal {
    pub hash: bool,
    pub make: MakeRecords,
}

/// Builds a [`StagingSeal`]'s records: `(ranks, each rank's KVH64)` to one record per rank.
pub type MakeRecords = Box<dyn FnOnce(usize, Option<&[u64]>) -> Vec<Vec<u8>> + Send>;

impl std::fmt::Debug for StagingSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingSeal")
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

/// Runs on the engine thread in a checked scatter ([`EngineHandle::scatter_kv_checked`]), with
/// the arena and, when the scatter hashed what it moved, each rank's KVH64 of the span: reads
/// what else it needs (a hand-off's fence records) and answers whether the KV may be used.
pub type ScatterCheck =
    Box<dyn FnOnce(&mut dyn crate::backend::KvStaging, Option<&[u64]>) -> bool + Send>;

/// What the loop reports about a staged prefill's span.
pub enum StagedReady {
    /// Leading blocks `0..n` of every layer are in the span (gathered after a step).
    Blocks(usize),
    /// Layers `layers` of blocks `blocks` are being gathered into the span inside the running
    /// step (the one that ends the prompt); `gate` opens once they are there.
    Layers {
        blocks: Range<usize>,
        layers: Range<u32>,
        gate: crate::backend::LayerGate,
    },
    /// The whole span is gathered and the [`StagingSeal`]'s records are written behind it
    /// (`written`), or writing them failed (logged; the hand-off writes them itself).
    Sealed { written: bool },
}

impl std::fmt::Debug for StagedReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Blocks(n) => write!(f, "Blocks({n})"),
            Self::Layers { blocks, layers, .. } => {
                write!(f, "Layers {{ blocks: {blocks:?}, layers: {layers:?} }}")
            }
            Self::Sealed { written } => write!(f, "Sealed {{ written: {written} }}"),
        }
    }
}

/// A prefill whose KV the loop gathers into a staging-arena span as it becomes final.
pub(crate) struct StagedGather {
    /// The span's offset, once `alloc` gave one.
    pub offset: Option<usize>,
    pub alloc: StagingAlloc,
    /// Blocks per layer the span has room for (the prompt's blocks).
    pub blocks: usize,
    /// Layers per in-step gather during the prompt's last step (0: after the step).
    pub layer_group: u32,
    /// What is in the span, after each gather. Bounded by the most reports a prefill can
    /// make (one per new block count, one per layer group, the seal): never full.
    pub ready: tmpsc::Sender<StagedReady>,
    /// Records to write behind the span once all of it is in.
    pub seal: Option<StagingSeal>,
}

/// A share of a staging-arena span given with a command that writes into it: the span stays
/// allocated until the engine thread has run (or dropped) the command.
pub type SpanHold = std::sync::Arc<dyn std::any::Any + Send + Sync>;

pub(crate) enum Command {
    Add {
        req: GenerateRequest,
        tx: EventTx,
        staged: Option<StagedGather>,
    },
    AdmitTransferred {
        req: GenerateRequest,
        first_token: u32,
        sampler: Option<SamplerState>,
        tx: EventTx,
    },
    Reserve {
        id: RequestId,
        prompt_len: usize,
        reply: Reply<Vec<BlockId>>,
    },
    ReleaseTransfer {
        id: RequestId,
        reply: Reply<usize>,
    },
    Abort {
        id: RequestId,
    },
    Park {
        id: RequestId,
        reply: Reply<super::Parked>,
    },
    ReadKv {
        id: RequestId,
        layers: Range<u32>,
        reply: Reply<Vec<u8>>,
    },
    WriteKv {
        id: RequestId,
        layers: Range<u32>,
        data: Vec<u8>,
        reply: Reply<()>,
    },
    /// Pool <-> staging arena (`gather`: pool -> arena), device to device.
    StagingKv {
        id: RequestId,
        layers: Range<u32>,
        offset: usize,
        gather: bool,
        /// Keeps the arena span allocated until the engine thread is done with the command.
        hold: Option<SpanHold>,
        reply: Reply<()>,
    },
    /// Staging arena -> pool and `check`, in one visit of the loop.
    ScatterChecked {
        id: RequestId,
        layers: Range<u32>,
        offset: usize,
        hash: bool,
        check: ScatterCheck,
        reply: Reply<bool>,
    },
    /// Bytes of one rank's staging arena (a fence record), outside any request's blocks.
    StagingRead {
        rank: usize,
        offset: usize,
        len: usize,
        reply: Reply<Vec<u8>>,
    },
    StagingWrite {
        rank: usize,
        offset: usize,
        data: Vec<u8>,
        /// Keeps the arena span allocated until the engine thread is done with the command.
        hold: SpanHold,
        reply: Reply<()>,
    },
    /// KVH64 of a span of every rank's arena.
    StagingKvh64 {
        offset: usize,
        len: usize,
        reply: Reply<Vec<u64>>,
    },
    Stats {
        reply: Reply<EngineStats>,
    },
    CheckAccounting {
        reply: Reply<Result<(), pdnode_kvcache::KvError>>,
    },
    Shutdown,
}

/// A request's event stream (bounded: [`EVENT_QUEUE`]). Dropping it aborts the request.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    rx: tmpsc::Receiver<EngineEvent>,
    overflowed: Arc<AtomicBool>,
    reported: bool,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }
    /// The next event; `None` once the stream has ended (after its terminal event). A stream
    /// the engine cut off because it was full ends with `Error { SlowConsumer }`.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        match self.rx.recv().await {
            Some(ev) => Some(ev),
            None if !self.reported && self.overflowed.load(Ordering::Acquire) => {
                self.reported = true;
                Some(EngineEvent::Error {
                    error: EngineError::SlowConsumer {
                        id: self.id,
                        capacity: EVENT_QUEUE,
                    },
                })
            }
            None => None,
        }
    }
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::SyncSender<Command>,
    /// Aborts that found the command queue full; the loop drains them every iteration.
    aborts: Arc<Mutex<Vec<RequestId>>>,
    info: Arc<EngineInfo>,
    timeout: Duration,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
    draining: Arc<AtomicBool>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("info", &self.info)
            .finish()
    }
}

impl EngineHandle {
    pub(crate) fn new(
        tx: mpsc::SyncSender<Command>,
        aborts: Arc<Mutex<Vec<RequestId>>>,
        info: EngineInfo,
        timeout: Duration,
        thread: JoinHandle<()>,
    ) -> Self {
        Self {
            tx,
            aborts,
            info: Arc::new(info),
            timeout,
            thread: Arc::new(Mutex::new(Some(thread))),
            draining: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Never blocks: a full command queue is `Busy` (the caller's request fails, retryable on
    /// another node), a stopped loop is `Stopped`.
    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.try_send(cmd).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => EngineError::Busy {
                capacity: COMMAND_QUEUE,
            },
            mpsc::TrySendError::Disconnected(_) => EngineError::Stopped,
        })
    }

    async fn call<T>(
        &self,
        op: &'static str,
        make: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<T, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply))?;
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(EngineError::Stopped),
            Err(_) => Err(EngineError::Timeout {
                op,
                after: self.timeout,
            }),
        }
    }

    /// Refuses new requests and reservations from now on (`Draining`); in-flight work, hand-offs
    /// and admissions of already reserved transfers continue. For graceful shutdown.
    pub fn stop_admitting(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn check(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        let id = req.id;
        req.sampling
            .validate()
            .map_err(|e| EngineError::InvalidRequest {
                id,
                reason: e.to_string(),
            })?;
        if req.prompt_token_ids.is_empty() {
            return Err(EngineError::InvalidRequest {
                id,
                reason: "empty prompt".into(),
            });
        }
        if req.prompt_token_ids.len() >= self.info.context_length {
            return Err(EngineError::ContextLength {
                id,
                prompt_len: req.prompt_token_ids.len(),
                context_length: self.info.context_length,
            });
        }
        if let Some(t) = req
            .prompt_token_ids
            .iter()
            .find(|t| **t as usize >= self.info.vocab_size)
        {
            return Err(EngineError::InvalidRequest {
                id,
                reason: format!(
                    "token id {t} outside the vocabulary of {}",
                    self.info.vocab_size
                ),
            });
        }
        Ok(())
    }

    /// Queues a prompt (colocated or prefill-only). Never waits; refusals by the loop (queue
    /// full, duplicate id, too large for the pool) arrive as an `Error` event.
    pub fn add_request(&self, req: GenerateRequest) -> Result<RequestStream, EngineError> {
        if self.is_draining() {
            return Err(EngineError::Draining);
        }
        self.check(&req)?;
        let (tx, stream) = event_channel(req.id);
        self.send(Command::Add {
            req,
            tx,
            staged: None,
        })?;
        Ok(stream)
    }

    /// Prefill-only: as [`EngineHandle::add_request`], and the loop gathers the prompt's KV into
    /// a span of every TP rank's staging arena (`[layer][block]`, room for `blocks` blocks per
    /// layer: the prompt's) as it becomes final, so that it can be sent while the
    /// prompt's later chunks compute: after each prefill chunk the whole blocks it completed,
    /// after the last chunk the rest. After each gather the count of leading blocks now in the
    /// span arrives on the returned receiver, which closes when the request leaves the loop
    /// (after `PrefillDone`, or on abort). The span comes from `alloc`, called after the
    /// request's first prefill step (so a queued request holds none) and again after each later
    /// chunk while it answers `None`; the loop drops `alloc` when the request leaves it. A
    /// failed gather, or no span by the last chunk, stops the counts short of `blocks`: the
    /// caller then gathers the rest itself ([`EngineHandle::gather_kv`]).
    ///
    /// With `layer_group` > 0 and a backend that stages inside a step
    /// ([`crate::backend::KvStaging::supports_step_staging`]), the step that ends the prompt
    /// gathers its blocks `layer_group` layers at a time as their KV is written and reports
    /// each group at once with a gate ([`StagedReady::Layers`]), so the hand-off can put them
    /// while the later layers compute.
    ///
    /// With a `seal`, once every block is in the span (after the step that ends the prompt)
    /// the loop writes its records behind the span and reports [`StagedReady::Sealed`].
    pub fn add_request_staged(
        &self,
        req: GenerateRequest,
        blocks: usize,
        alloc: StagingAlloc,
        layer_group: u32,
        seal: Option<StagingSeal>,
    ) -> Result<(RequestStream, tmpsc::Receiver<StagedReady>), EngineError> {
        if self.is_draining() {
            return Err(EngineError::Draining);
        }
        self.check(&req)?;
        let (tx, stream) = event_channel(req.id);
        // One report per new block count, one per layer group and the seal at most: never full.
        let reports = blocks
            .saturating_add(self.info.kv_layout.num_layers as usize)
            .saturating_add(3);
        let (ready, ready_rx) = tmpsc::channel(reports);
        self.send(Command::Add {
            req,
            tx,
            staged: Some(StagedGather {
                offset: None,
                alloc,
                blocks,
                layer_group,
                ready,
                seal,
            }),
        })?;
        Ok((stream, ready_rx))
    }

    /// Decode side: reserves KV blocks for a prompt of `prompt_len` tokens under the request's
    /// transfer lease (the engine's lease duration). Returns the blocks to fill, in order.
    pub async fn reserve_for_transfer(
        &self,
        id: RequestId,
        prompt_len: usize,
    ) -> Result<Vec<BlockId>, EngineError> {
        if self.is_draining() {
            return Err(EngineError::Draining);
        }
        if prompt_len == 0 || prompt_len >= self.info.context_length {
            return Err(EngineError::ContextLength {
                id,
                prompt_len,
                context_length: self.info.context_length,
            });
        }
        self.call("reserve_for_transfer", |reply| Command::Reserve {
            id,
            prompt_len,
            reply,
        })
        .await
    }

    /// Decode side: the prompt's KV is in the reserved blocks; the request joins the batch and
    /// streams the tokens after `first_token`. `sampler` (from `PrefillDone`) continues the
    /// prefill side's random stream; `None` starts from the request's seed.
    pub fn admit_transferred(
        &self,
        req: GenerateRequest,
        first_token: u32,
        sampler: Option<SamplerState>,
    ) -> Result<RequestStream, EngineError> {
        self.check(&req)?;
        let (tx, stream) = event_channel(req.id);
        self.send(Command::AdmitTransferred {
            req,
            first_token,
            sampler,
            tx,
        })?;
        Ok(stream)
    }

    /// Ends a request's hand-off lease and frees its blocks (prefill side after the KV was
    /// sent or the hand-off failed; decode side when a transfer fails before admission).
    pub async fn release_transfer(&self, id: RequestId) -> Result<usize, EngineError> {
        self.call("release_transfer", |reply| Command::ReleaseTransfer {
            id,
            reply,
        })
        .await
    }

    /// Decode side, for a migration: takes a running request out of the batch between two
    /// decode steps and puts its blocks under its transfer lease (read them with
    /// [`EngineHandle::gather_kv`] / [`EngineHandle::read_kv`], then
    /// [`EngineHandle::release_transfer`]); its stream ends without a `Finished` event.
    /// Refused (`Unavailable`) for a request in a step, queued, or still prefilling: ask again
    /// after the next step.
    pub async fn park(&self, id: RequestId) -> Result<super::Parked, EngineError> {
        self.call("park", |reply| Command::Park { id, reply }).await
    }

    /// Aborts a request wherever it is; frees all it owns. Never waits.
    pub fn abort(&self, id: RequestId) {
        if let Err(mpsc::TrySendError::Full(_)) = self.tx.try_send(Command::Abort { id }) {
            // Never lost: the loop drains this list every iteration.
            if let Ok(mut a) = self.aborts.lock() {
                a.push(id);
            }
        }
    }

    /// Copies layers `layers` of the blocks under the request's hand-off lease out of the pool,
    /// ordered `[layer][block][layer-block bytes]`.
    pub async fn read_kv(&self, id: RequestId, layers: Range<u32>) -> Result<Vec<u8>, EngineError> {
        self.call("read_kv", |reply| Command::ReadKv { id, layers, reply })
            .await
    }

    /// Writes `data` (as [`EngineHandle::read_kv`] lays it out) into the request's reserved blocks.
    pub async fn write_kv(
        &self,
        id: RequestId,
        layers: Range<u32>,
        data: Vec<u8>,
    ) -> Result<(), EngineError> {
        self.call("write_kv", |reply| Command::WriteKv {
            id,
            layers,
            data,
            reply,
        })
        .await
    }

    /// Copies layers `layers` of the blocks under the request's hand-off lease into every TP
    /// rank's staging arena ([`EngineInfo::staging_regions`]) at `offset`, laid out as
    /// [`EngineHandle::read_kv`] lays out one rank; done when this returns. The caller owns the
    /// arena span (`offset` is a multiple of `crate::backend::STAGING_ALIGN`) and gives a share
    /// of it, `hold`: the command keeps the span allocated until the engine thread has run (or
    /// dropped) it, so a caller that stops waiting (its call dropped, the engine's timeout)
    /// cannot free the span to another request before the copy lands in it.
    pub async fn gather_kv(
        &self,
        id: RequestId,
        layers: Range<u32>,
        offset: usize,
        hold: SpanHold,
    ) -> Result<(), EngineError> {
        self.call("gather_kv", |reply| Command::StagingKv {
            id,
            layers,
            offset,
            gather: true,
            hold: Some(hold),
            reply,
        })
        .await
    }

    /// The inverse of [`EngineHandle::gather_kv`]: writes each rank's arena bytes at `offset`
    /// into the request's reserved blocks.
    pub async fn scatter_kv(
        &self,
        id: RequestId,
        layers: Range<u32>,
        offset: usize,
    ) -> Result<(), EngineError> {
        self.call("scatter_kv", |reply| Command::StagingKv {
            id,
            layers,
            offset,
            gather: false,
            // Reads the span: a stale scatter writes only the request's own blocks.
            hold: None,
            reply,
        })
        .await
    }

    /// [`EngineHandle::scatter_kv`] and `check`, both on the engine thread in one visit (a
    /// decode node's check of a device hand-off and its scatter, without waiting for a step in
    /// between). Without `hash`, `check` runs first and nothing is scattered unless it passes;
    /// with `hash`, the scatter hashes what it moves (each rank's KVH64, given to `check`) and
    /// so writes the request's reserved blocks before `check` runs: on `Ok(false)` the caller
    /// must release the lease (the blocks go back to the pool unused, never to the prefix
    /// cache). `Ok(false)`: `check` refused.
    pub async fn scatter_kv_checked(
        &self,
        id: RequestId,
        layers: Range<u32>,
        offset: usize,
        hash: bool,
        check: ScatterCheck,
    ) -> Result<bool, EngineError> {
        self.call("scatter_kv_checked", |reply| Command::ScatterChecked {
            id,
            layers,
            offset,
            hash,
            check,
            reply,
        })
        .await
    }

    /// `len` bytes of rank `rank`'s staging arena at `offset` (a fence record a peer put there).
    /// The caller owns the span.
    pub async fn staging_read(
        &self,
        rank: usize,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, EngineError> {
        self.call("staging_read", |reply| Command::StagingRead {
            rank,
            offset,
            len,
            reply,
        })
        .await
    }

    /// Writes `data` into rank `rank`'s staging arena at `offset` (a fence record the transport
    /// then puts); done when this returns. The caller owns the span and gives a share of it,
    /// kept until the engine thread is done with the write (as [`EngineHandle::gather_kv`]).
    pub async fn staging_write(
        &self,
        rank: usize,
        offset: usize,
        data: Vec<u8>,
        hold: SpanHold,
    ) -> Result<(), EngineError> {
        self.call("staging_write", |reply| Command::StagingWrite {
            rank,
            offset,
            data,
            hold,
            reply,
        })
        .await
    }

    /// KVH64 (`pdnode_core::kvh64`) of `len` bytes at `offset` of every rank's staging arena,
    /// in rank order: the checksum of a device hand-off (on the GPU: one read of the span).
    pub async fn staging_kvh64(&self, offset: usize, len: usize) -> Result<Vec<u64>, EngineError> {
        self.call("staging_kvh64", |reply| Command::StagingKvh64 {
            offset,
            len,
            reply,
        })
        .await
    }

    pub async fn stats(&self) -> Result<EngineStats, EngineError> {
        self.call("stats", |reply| Command::Stats { reply }).await
    }

    /// The KV accounting check (`Err(KvError::Accounting)` listing every violation if any block
    /// leaked or has two owners); the outer `Err` is the engine not answering.
    pub async fn check_accounting(
        &self,
    ) -> Result<Result<(), pdnode_kvcache::KvError>, EngineError> {
        self.call("check_accounting", |reply| Command::CheckAccounting {
            reply,
        })
        .await
    }

    /// Stops the loop (in-flight requests end with `Error { Stopped }`) and waits up to
    /// `timeout` for its thread to exit. Returns whether it exited.
    pub async fn shutdown(&self, timeout: Duration) -> bool {
        let _ = self.send(Command::Shutdown);
        let deadline = Instant::now() + timeout;
        loop {
            let finished = match self.thread.lock() {
                Ok(g) => g.as_ref().is_none_or(JoinHandle::is_finished),
                Err(_) => true,
            };
            if finished {
                if let Ok(mut g) = self.thread.lock()
                    && let Some(t) = g.take()
                {
                    let _ = t.join();
                }
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}
