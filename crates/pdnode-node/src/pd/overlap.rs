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
use pdnode_core::{KvLayout, RequestId};
use pdnode_engine::engine::EngineHandle;
use pdnode_engine::engine::{StagedReady, StagingAlloc};
use pdnode_proto::v1;
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
    remotes: Vec<RemoteTarget>,
    staging_offset: u64,
    blocks: usize,
    layers: u32,
    layer_block: u64,
    sent: usize,
    /// The puts issued, and the span they read (kept until they are done).
    hold: SourceHold,
    /// Blocks sent before `PrefillDone` (the overlapped part).
    pub sent_early: usize,
    /// Puts of layer groups gathered inside the prompt's last step.
    pub layer_puts: usize,
    /// The record to send when this push is abandoned (the target asked for fence records),
    /// and whether the push ended as planned (its own record sent, or another push took over).
    abandon_record: Option<FenceRecord>,
    settled: bool,
}

impl Drop for OverlapPush {
    /// An abandoned push (failed, or its call dropped: the client went away) tells the decode
    /// node, once every put it issued is over and flushed, that it wrote its last byte: an
    /// "abandoned" fence record of the span's generation, which ends the span's quarantine
    /// there at once instead of at its fence deadline (and is never scattered).
    fn drop(&mut self) {
        let Some(rec) = self.abandon_record.take().filter(|_| !self.settled) else {
            return;
        };
        let Some(at) = self.staging_offset.checked_add(self.per_rank as u64) else {
            return;
        };
        let t = self.t.clone();
        let remotes = std::mem::take(&mut self.remotes);
        self.hold.on_abandon(Box::new(move || {
            let deadline = Instant::now() + std::time::Duration::from_secs(5);
            // Every put issued before a flush is visible at the peer when the flush completes.
            for r in &remotes {
                if t.flush(r).and_then(|f| f.wait(deadline)).is_err() {
                    return;
                }
            }
            let Ok(reg) = t.allocate_registered(RECORD_LEN) else {
                return;
            };
            if fence::write_record(&reg, 0, &rec).is_err() {
                return;
            }
            let span = Span {
                local_offset: 0,
                remote_offset: at,
                len: RECORD_LEN as u64,
            };
            let puts: Vec<_> = remotes
                .iter()
                .filter_map(|r| t.put(&reg, r, &[span]).ok())
                .collect();
            for p in &puts {
                let _ = p.wait(deadline);
            }
            for r in &remotes {
                let _ = t.flush(r).and_then(|f| f.wait(deadline));
            }
            tracing::debug!(
                generation = rec.generation,
                "abandoned KV push: fence record sent"
            );
        }));
    }
}

impl OverlapPush {
    /// Connects to every rank region of `target`, for `blocks` blocks per layer; the span of
    /// `arena` comes later ([`OverlapPush::alloc`]). `Ok(None)`: the KV can never fit the arena
    /// (the caller pushes after prefill, through the host).
    pub fn start(
        t: &Arc<UcxTransport>,
        arena: &Arc<StagingArena>,
        target: &v1::KvTarget,
        layout: &KvLayout,
        blocks: usize,
        hold_until: Instant,
        counters: &Arc<FenceCounters>,
    ) -> Result<Option<Self>, String> {
        let layer_block = layout.block_layer_bytes() as u64;
        let per_rank = (layout.num_layers as u64)
            .checked_mul(blocks as u64)
            .and_then(|n| n.checked_mul(layer_block))
            .ok_or("KV size overflows")?;
        let record = if target.fence_record {
            RECORD_LEN as u64
        } else {
            0
        };
        let span_len = per_rank.saturating_add(record);
        if per_rank == 0 || span_len > arena.len() as u64 {
            return Ok(None);
        }
        let mut remotes = Vec::with_capacity(target.ranks.len());
        for (r, rank) in target.ranks.iter().enumerate() {
            remotes.push(super::kv::connect_rank(t, target, r, rank, span_len)?);
        }
        let slice: SliceCell = Arc::new(Mutex::new(None));
        let abandon_record = target.fence_record.then_some(FenceRecord {
            generation: target.staging_generation,
            request: target.request_id,
            len: per_rank,
            crc: None,
            aborted: true,
        });
        Ok(Some(Self {
            t: t.clone(),
            arena: arena.clone(),
            per_rank: per_rank as usize,
            span_len: span_len as usize,
            hold: SourceHold::new(Box::new(slice.clone()), hold_until, counters.clone()),
            slice,
            remotes,
            staging_offset: target.staging_offset,
            blocks,
            layers: layout.num_layers,
            layer_block,
            sent: 0,
            abandon_record,
            settled: false,
            sent_early: 0,
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

    /// Whether the engine took a span (if not by the end of prefill, the caller pushes after
    /// prefill instead, waiting for room).
    pub fn has_slice(&self) -> bool {
        self.cell().is_some()
    }

    fn offset(&self) -> Result<usize, String> {
        self.cell()
            .as_ref()
            .map(|s| s.offset())
            .ok_or_else(|| "the engine reported staged blocks without an arena span".to_string())
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn bytes(&self) -> u64 {
        self.remotes.len() as u64 * self.layers as u64 * self.blocks as u64 * self.layer_block
    }

    /// What the engine reports about the span: leading blocks after a step, or a layer group
    /// being gathered inside the prompt's last step (put once its gate opens, until `deadline`).
    pub fn on_ready(&mut self, r: StagedReady, deadline: Instant) -> Result<(), String> {
        match r {
            StagedReady::Blocks(upto) => self.ready(upto),
            StagedReady::Layers {
                blocks,
                layers,
                gate,
            } => self.ready_layers(blocks, layers, gate, deadline),
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
    ) -> Result<(), String> {
        if self.remotes.len() != 1 {
            return Err(format!(
                "in-step staging for {} ranks (one is supported)",
                self.remotes.len()
            ));
        }
        if blocks.start != self.sent || blocks.end > self.blocks || layers.end > self.layers {
            return Err(format!(
                "layers {layers:?} of blocks {blocks:?} do not follow the {} blocks sent of {} \
                 ({} layers)",
                self.sent, self.blocks, self.layers
            ));
        }
        let spans = self.spans(blocks.clone(), layers.clone())?;
        let reg = self
            .arena
            .registration(0)
            .ok_or_else(|| "no staging arena for rank 0".to_string())?;
        let put = self
            .t
            .put_when(reg, &self.remotes[0], &spans, gate, deadline)
            .map_err(|e| format!("gated put: {e}"))?;
        self.hold.push(put);
        self.layer_puts += 1;
        if layers.end == self.layers {
            if blocks.end == self.blocks {
                self.sent_early = self.sent;
            }
            self.sent = blocks.end;
        }
        Ok(())
    }

    /// The spans (same offsets on both sides of the `[layer][block]` span) of `blocks` in
    /// `layers`: one per layer, coalesced where the layers are adjacent (all of a request's
    /// blocks at once: one put instead of one per layer).
    fn spans(&self, blocks: Range<usize>, layers: Range<u32>) -> Result<Vec<Span>, String> {
        let (n, lb) = (self.blocks as u64, self.layer_block);
        let (from, len) = (blocks.start as u64, (blocks.end - blocks.start) as u64 * lb);
        let base = self.offset()? as u64;
        let spans: Vec<Span> = layers
            .map(|l| {
                let at = (l as u64 * n + from) * lb;
                Span {
                    local_offset: base + at,
                    remote_offset: self.staging_offset + at,
                    len,
                }
            })
            .collect();
        Ok(coalesce_spans(&spans))
    }

    /// The engine reports leading blocks `0..upto` in the span: put the new ones, every rank.
    pub fn ready(&mut self, upto: usize) -> Result<(), String> {
        let upto = upto.min(self.blocks);
        if upto <= self.sent {
            return Ok(());
        }
        if upto == self.blocks {
            self.sent_early = self.sent;
        }
        let spans = self.spans(self.sent..upto, 0..self.layers)?;
        let arena = self.arena.clone();
        for (r, remote) in self.remotes.iter().enumerate() {
            let reg = arena
                .registration(r)
                .ok_or_else(|| format!("no staging arena for rank {r}"))?;
            let put = self
                .t
                .put(reg, remote, &spans)
                .map_err(|e| format!("put rank {r}: {e}"))?;
            self.hold.push(put);
        }
        self.sent = upto;
        Ok(())
    }

    /// Another push takes over the hand-off (the engine never got a span): nothing to tell the
    /// decode node when this one is dropped.
    pub fn hand_over(&mut self) {
        self.settled = true;
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
        target: &v1::KvTarget,
        deadline: Instant,
    ) -> Result<u64, String> {
        if self.sent < self.blocks {
            // Wait for the puts reading the span before the gather rewrites it.
            for p in self.hold.puts() {
                p.wait_async(deadline)
                    .await
                    .map_err(|e| format!("put: {e}"))?;
            }
            let offset = self.offset()?;
            engine
                .gather_kv(id, 0..self.layers, offset)
                .await
                .map_err(|e| format!("gathering the KV of {id}: {e}"))?;
            self.sent = 0;
            self.ready(self.blocks)?;
        }
        // Flushed right behind the last puts (a flush completes after every put issued before it
        // on the endpoint), then everything waited for.
        let mut flushes = Vec::with_capacity(self.remotes.len());
        for (r, remote) in self.remotes.iter().enumerate() {
            flushes.push(
                self.t
                    .flush(remote)
                    .map_err(|e| format!("flush rank {r}: {e}"))?,
            );
        }
        for p in self.hold.puts() {
            p.wait_async(deadline)
                .await
                .map_err(|e| format!("put: {e}"))?;
        }
        for (r, f) in flushes.into_iter().enumerate() {
            f.wait_async(deadline)
                .await
                .map_err(|e| format!("flush rank {r}: {e}"))?;
        }
        if target.fence_record {
            let offset = self.offset()?;
            let arena = self.arena.clone();
            let mut sources = Vec::with_capacity(self.remotes.len());
            for r in 0..self.remotes.len() {
                let reg = arena
                    .registration(r)
                    .ok_or_else(|| format!("no staging arena for rank {r}"))?;
                sources.push((reg, offset, self.per_rank));
            }
            super::kv::put_records(
                &self.t,
                id,
                target,
                &sources,
                &self.remotes,
                deadline,
                &mut self.hold,
            )
            .await?;
        }
        self.settled = true;
        Ok(self.bytes())
    }
}
