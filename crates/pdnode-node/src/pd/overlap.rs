//! Prefill side: the KV hand-off overlapped with the prompt's forward pass, chunk by chunk.
//!
//! The prefill engine takes the request's span of the node's staging arena when its first
//! prefill chunk has run (through [`OverlapPush::alloc`]: a queued request holds none), gathers
//! each chunk's finished blocks into it as soon as the chunk's step ends, the last ones right
//! after the step that ends the prompt ([`EngineHandle::add_request_staged`]), and reports how
//! many leading blocks are there; for
//! each report this issues, per TP rank, one UCX put with one span per layer (the span is
//! `[layer][block]`, so the new blocks of a layer are contiguous in it), which the copy engines
//! carry while later chunks compute. After `PrefillDone` the last blocks follow, then one flush
//! per rank. Only the part after `PrefillDone` adds to the time to first token.

use super::arena::{ArenaSlice, StagingArena};
use super::fence::{self, FenceCounters, FenceRecord, RECORD_LEN, SourceHold};
use super::handoff::{PushEnd, PushProgress, PushWait};
use super::kv::HandoffError;
use pdnode_core::{KvLayout, KvTarget, RequestId};
use pdnode_engine::engine::EngineHandle;
use pdnode_engine::engine::{StagedReady, StagingAlloc, StagingSeal};
use pdnode_transfer::region::coalesce_spans;
use pdnode_transfer::{KvTransport, RemoteTarget, Span, UcxTransport};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The request's arena span, once the engine took it.
type SliceCell = Arc<Mutex<Option<ArenaSlice>>>;

/// One request's overlapped push: its arena span (taken by the engine when the first chunk
/// ran), the decode node's rank regions, the puts in flight. The span outlives this push until
/// every put reading it is done ([`SourceHold`]) and the engine let go of it.
pub(super) struct OverlapPush {
    t: Arc<UcxTransport>,
    arena: Arc<StagingArena>,
    per_rank: usize,
    /// Bytes of the span: the KV, and room for the fence record when the target asks for one.
    span_len: usize,
    slice: SliceCell,
    remotes: Vec<Arc<RemoteTarget>>,
    staging_offset: u64,
    blocks: usize,
    layers: u32,
    layer_block: u64,
    /// Which blocks went out, none after the push deadline, and how the push ended
    /// (`super::handoff`).
    progress: PushProgress,
    /// The puts issued, and the span they read (kept until they are done).
    hold: SourceHold,
    /// Puts of layer groups gathered inside the prompt's last step.
    pub layer_puts: usize,
    /// The record to send when this push is abandoned (the target asked for fence records),
    /// and the capability that tags it.
    abandon_record: Option<(FenceRecord, pdnode_transfer::Secret)>,
    /// A device arena's fence records, for the engine to write behind the span once all of it
    /// is gathered ([`OverlapPush::seal`]): the record without its checksum, whether to sum,
    /// and the capability.
    seal: Option<(FenceRecord, bool, pdnode_transfer::Secret)>,
    /// The engine wrote the records behind the whole span ([`StagedReady::Sealed`]).
    sealed: bool,
}

impl Drop for OverlapPush {
    /// An abandoned push (failed, or its call dropped: the client went away) tells the decode
    /// node, once every put it issued is over and flushed, that it wrote its last byte: an
    /// "abandoned" fence record of the span's generation, which ends the span's quarantine
    /// there at once instead of at its fence deadline (and is never scattered).
    fn drop(&mut self) {
        let Some((rec, cap)) = self
            .abandon_record
            .take()
            .filter(|_| self.progress.abandoned())
        else {
            return;
        };
        let Some(at) = self.staging_offset.checked_add(self.per_rank as u64) else {
            return;
        };
        let owed = std::mem::take(&mut self.remotes)
            .into_iter()
            .map(|r| (r, at))
            .collect();
        self.hold
            .on_abandon(super::kv::send_abandoned(self.t.clone(), owed, rec, cap));
    }
}

impl OverlapPush {
    /// Connects to every rank region of `target`, for `blocks` blocks per layer, putting nothing
    /// after the push deadline and holding the sources until `hold_until`; the span of
    /// `arena` comes later ([`OverlapPush::alloc`]). `Ok(None)`: the KV can never fit the arena
    /// (the caller pushes after prefill, through the host).
    pub fn start(
        t: &Arc<UcxTransport>,
        arena: &Arc<StagingArena>,
        target: &KvTarget,
        layout: &KvLayout,
        blocks: usize,
        (deadline, hold_until): (Instant, Instant),
        counters: &Arc<FenceCounters>,
    ) -> Result<Option<Self>, HandoffError> {
        let layer_block = layout.block_layer_bytes() as u64;
        let per_rank = (layout.num_layers as u64)
            .checked_mul(blocks as u64)
            .and_then(|n| n.checked_mul(layer_block))
            .ok_or_else(|| HandoffError::Mismatch("KV size overflows".into()))?;
        let record = if target.fence_record {
            RECORD_LEN as u64
        } else {
            0
        };
        let span_len = per_rank.saturating_add(record);
        if per_rank == 0 || span_len > arena.len() as u64 {
            return Ok(None);
        }
        let remotes = super::kv::connect_ranks(t, target, span_len)?;
        let slice: SliceCell = Arc::new(Mutex::new(None));
        // The span's record, without a checksum: the seal's template. The abandoned one goes
        // into host staging only (`super::kv::abandoned_record`).
        let template = FenceRecord {
            generation: target.staging_generation,
            request: target.request.0,
            len: per_rank,
            sum: None,
            aborted: false,
        };
        let abandon_record = super::kv::abandoned_record(target, per_rank)?;
        // A device arena: the engine writes the records (it owns the GPU; asking it later would
        // wait for its current step). Host arenas: the push writes them in place.
        let seal = if target.fence_record && arena.is_device() {
            Some((template, target.verify, super::kv::capability(target)?))
        } else {
            None
        };
        Ok(Some(Self {
            t: t.clone(),
            arena: arena.clone(),
            per_rank: per_rank as usize,
            span_len: span_len as usize,
            hold: SourceHold::of_span(slice.clone(), hold_until, counters.clone()),
            slice,
            remotes,
            staging_offset: target.staging_offset()?,
            blocks,
            layers: layout.num_layers,
            layer_block,
            progress: PushProgress::new(blocks, layout.num_layers, deadline),
            abandon_record,
            seal,
            sealed: false,
            layer_puts: 0,
        }))
    }

    fn cell(&self) -> std::sync::MutexGuard<'_, Option<ArenaSlice>> {
        self.slice.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// For the engine ([`EngineHandle::add_request_staged`]): takes the request's span of the
    /// arena without waiting (the engine thread must not block) and keeps it here; `None` while
    /// the arena is full.
    pub fn alloc(&self) -> StagingAlloc {
        let (arena, n, cell) = (self.arena.clone(), self.span_len, self.slice.clone());
        Box::new(move || {
            let mut c = cell.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(s) = c.as_ref() {
                return Some(s.offset());
            }
            let s = arena.reserve(n)?;
            let offset = s.offset();
            *c = Some(s);
            Some(offset)
        })
    }

    /// For the engine ([`EngineHandle::add_request_staged`]): the fence records of a device
    /// arena's span, each with its rank's KVH64 when the target asks to verify (`None`: host
    /// arena, or no records asked).
    pub fn seal(&self) -> Option<StagingSeal> {
        let (rec, hash, cap) = self.seal?;
        Some(StagingSeal {
            hash,
            make: Box::new(move |ranks: usize, sums: Option<&[u64]>| {
                (0..ranks)
                    .map(|r| {
                        let sum = sums.and_then(|s| s.get(r)).map(|h| fence::Sum::Kvh64(*h));
                        FenceRecord { sum, ..rec }.encode(&cap).to_vec()
                    })
                    .collect()
            }),
        })
    }

    /// Whether the engine took a span (if not by the end of prefill, the caller pushes after
    /// prefill instead, waiting for room).
    pub fn has_slice(&self) -> bool {
        self.cell().is_some()
    }

    fn offset(&self) -> Result<usize, HandoffError> {
        self.cell().as_ref().map(|s| s.offset()).ok_or_else(|| {
            HandoffError::Mismatch("the engine reported staged blocks without an arena span".into())
        })
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn bytes(&self) -> u64 {
        self.remotes.len() as u64 * self.layers as u64 * self.blocks as u64 * self.layer_block
    }

    /// What the engine reports about the span: leading blocks after a step, or a layer group
    /// being gathered inside the prompt's last step (put once its gate opens, until `deadline`).
    pub fn on_ready(&mut self, r: StagedReady, deadline: Instant) -> Result<(), HandoffError> {
        match r {
            StagedReady::Blocks(upto) => self.ready(upto),
            StagedReady::Layers {
                blocks,
                layers,
                mut gate,
            } => {
                // The transport's gate fails with any error; the engine's keeps its class in
                // the put's failure.
                let gate: pdnode_transfer::Gate = Box::new(move || gate().map_err(Box::from));
                self.ready_layers(blocks, layers, gate, deadline)
            }
            StagedReady::Sealed { written } => {
                self.sealed = written;
                Ok(())
            }
        }
    }

    /// Layers `layers` of blocks `blocks` (the blocks after those already sent) are being
    /// gathered in the running step: one gated put (spans coalesced) to the decode node's span.
    /// The engine stages inside a step only on one GPU (one rank).
    fn ready_layers(
        &mut self,
        blocks: Range<usize>,
        layers: Range<u32>,
        gate: pdnode_transfer::Gate,
        deadline: Instant,
    ) -> Result<(), HandoffError> {
        if self.remotes.len() != 1 {
            return Err(HandoffError::Mismatch(format!(
                "in-step staging for {} ranks (one is supported)",
                self.remotes.len()
            )));
        }
        self.progress
            .layers_ready(&blocks, &layers, Instant::now())?;
        let spans = self.spans(blocks.clone(), layers.clone())?;
        let reg = self
            .arena
            .registration(0)
            .ok_or_else(|| HandoffError::Mismatch("no staging arena for rank 0".into()))?;
        let put = self
            .t
            .put_when(reg, &self.remotes[0], &spans, gate, deadline)
            .map_err(HandoffError::at("gated put"))?;
        self.hold.push(put);
        self.layer_puts += 1;
        Ok(())
    }

    /// The spans (same offsets on both sides of the `[layer][block]` span) of `blocks` in
    /// `layers`: one per layer, coalesced where the layers are adjacent (all of a request's
    /// blocks at once: one put instead of one per layer).
    fn spans(&self, blocks: Range<usize>, layers: Range<u32>) -> Result<Vec<Span>, HandoffError> {
        let (n, lb) = (self.blocks as u64, self.layer_block);
        let (from, len) = (blocks.start as u64, (blocks.end - blocks.start) as u64 * lb);
        let base = self.offset()? as u64;
        let overflow = || HandoffError::Mismatch("KV span offset overflows".into());
        let spans = layers
            .map(|l| {
                let at = (l as u64)
                    .checked_mul(n)
                    .and_then(|x| x.checked_add(from))
                    .and_then(|x| x.checked_mul(lb))
                    .ok_or_else(overflow)?;
                Ok(Span {
                    local_offset: base.checked_add(at).ok_or_else(overflow)?,
                    remote_offset: self.staging_offset.checked_add(at).ok_or_else(overflow)?,
                    len,
                })
            })
            .collect::<Result<Vec<Span>, HandoffError>>()?;
        Ok(coalesce_spans(&spans))
    }

    /// The engine reports leading blocks `0..upto` in the span: put the new ones, every rank.
    pub fn ready(&mut self, upto: usize) -> Result<(), HandoffError> {
        let Some(blocks) = self.progress.blocks_ready(upto, Instant::now())? else {
            return Ok(());
        };
        self.put_blocks(blocks)
    }

    /// Puts every layer of `blocks`, every rank.
    fn put_blocks(&mut self, blocks: Range<usize>) -> Result<(), HandoffError> {
        let spans = self.spans(blocks, 0..self.layers)?;
        let arena = self.arena.clone();
        for (r, remote) in self.remotes.iter().enumerate() {
            let reg = arena
                .registration(r)
                .ok_or_else(|| HandoffError::Mismatch(format!("no staging arena for rank {r}")))?;
            let put = self
                .t
                .put(reg, remote, &spans)
                .map_err(HandoffError::at(format!("put rank {r}")))?;
            self.hold.push(put);
        }
        Ok(())
    }

    /// Blocks sent before `PrefillDone` (the overlapped part).
    pub fn sent_early(&self) -> usize {
        self.progress.sent_early()
    }

    /// Another push takes over the hand-off (the engine never got a span): nothing to tell the
    /// decode node when this one is dropped.
    pub fn hand_over(&mut self) {
        self.progress.settle(PushEnd::HandedOver);
    }

    /// Puts finished so far, of those issued.
    pub fn puts_done(&self) -> (usize, usize) {
        let puts = self.hold.puts();
        let done = puts.iter().filter(|p| p.try_result().is_some()).count();
        (done, puts.len())
    }

    /// After `PrefillDone`: the rest of the span (gathered here if the engine's staged gather
    /// stopped short), every put waited for, then every rank flushed, then the fence records
    /// when the target asks for them. Returns the bytes.
    pub async fn finish(
        mut self,
        engine: &EngineHandle,
        id: RequestId,
        target: &KvTarget,
        wait: PushWait,
    ) -> Result<u64, HandoffError> {
        if !self.progress.complete() {
            // Wait for the puts reading the span before the gather rewrites it.
            let bytes = self.bytes();
            super::kv::wait_ops(self.hold.puts(), bytes, Instant::now(), &wait, "put").await?;
            let offset = self.offset()?;
            // The engine's command keeps the span until it ran: this call may be dropped.
            engine
                .gather_kv(id, 0..self.layers, offset, self.slice.clone())
                .await
                .map_err(|source| HandoffError::Engine {
                    step: format!("gathering the KV of {id}"),
                    source,
                })?;
            let all = self.progress.resend_all(Instant::now())?;
            self.put_blocks(all)?;
            // Gathered again here: whatever the engine wrote is not trusted for these bytes.
            self.sealed = false;
        }
        // Flushed right behind the last puts (a flush completes after every put issued before it
        // on the endpoint), then everything waited for.
        let mut flushes = Vec::with_capacity(self.remotes.len());
        for (r, remote) in self.remotes.iter().enumerate() {
            flushes.push(
                self.t
                    .flush(remote)
                    .map_err(HandoffError::at(format!("flush rank {r}")))?,
            );
        }
        // The bytes still on their way were issued up to a prefill ago: the stall allowance
        // counts from here, for all of them.
        let (from, bytes) = (Instant::now(), self.bytes());
        super::kv::wait_ops(self.hold.puts(), bytes, from, &wait, "put").await?;
        super::kv::wait_ops(&flushes, bytes, from, &wait, "flush rank").await?;
        if target.fence_record {
            let offset = self.offset()?;
            let arena = self.arena.clone();
            let mut sources = Vec::with_capacity(self.remotes.len());
            for r in 0..self.remotes.len() {
                let reg = arena.registration(r).ok_or_else(|| {
                    HandoffError::Mismatch(format!("no staging arena for rank {r}"))
                })?;
                sources.push((reg, offset, self.per_rank));
            }
            // one arena rank per target rank (start_overlap checked the counts)
            let map: Vec<usize> = (0..sources.len()).collect();
            let io = super::kv::RecordIo {
                sources: &sources,
                map: &map,
                remotes: &self.remotes,
            };
            super::kv::put_records(
                &self.t,
                id,
                target,
                io,
                &wait,
                &mut self.hold,
                Some(engine),
                self.sealed,
            )
            .await?;
        }
        self.progress.settle(PushEnd::Done);
        Ok(self.bytes())
    }
}
