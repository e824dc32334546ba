//! Prefill side: the KV hand-off overlapped with the prompt's forward pass, chunk by chunk.
//!
//! The prefill engine gathers each prefill chunk's finished blocks into the request's span of
//! the node's staging arena as soon as the chunk's step ends
//! ([`EngineHandle::add_request_staged`]) and reports how many leading blocks are there; for
//! each report this issues, per TP rank, one UCX put with one span per layer (the span is
//! `[layer][block]`, so the new blocks of a layer are contiguous in it), which the copy engines
//! carry while later chunks compute. After `PrefillDone` the last blocks follow, then one flush
//! per rank. Only the part after `PrefillDone` adds to the time to first token.

use super::arena::{ArenaSlice, StagingArena};
use pdnode_core::{KvLayout, RequestId};
use pdnode_engine::engine::EngineHandle;
use pdnode_proto::v1;
use pdnode_transfer::{Completion, KvTransport, RemoteRegion, RemoteTarget, Span, UcxTransport};
use std::sync::Arc;
use std::time::Instant;

/// One request's overlapped push: its arena span, the decode node's rank regions, the puts in
/// flight.
pub(super) struct OverlapPush {
    t: Arc<UcxTransport>,
    slice: ArenaSlice,
    remotes: Vec<RemoteTarget>,
    staging_offset: u64,
    blocks: usize,
    layers: u32,
    layer_block: u64,
    sent: usize,
    puts: Vec<Completion>,
    /// Blocks sent before `PrefillDone` (the overlapped part).
    pub sent_early: usize,
}

impl OverlapPush {
    /// Connects to every rank region of `target` and takes a span of `arena` for `blocks`
    /// blocks per layer. `Ok(None)`: no room in the arena (the caller takes another path).
    pub fn start(
        t: &Arc<UcxTransport>,
        arena: &Arc<StagingArena>,
        target: &v1::KvTarget,
        layout: &KvLayout,
        blocks: usize,
    ) -> Result<Option<Self>, String> {
        let layer_block = layout.block_layer_bytes() as u64;
        let per_rank = layout.num_layers as u64 * blocks as u64 * layer_block;
        let Some(slice) = arena.reserve(per_rank as usize) else {
            return Ok(None);
        };
        let mut remotes = Vec::with_capacity(target.ranks.len());
        for (r, rank) in target.ranks.iter().enumerate() {
            if target.staging_offset.saturating_add(per_rank) > rank.region_len {
                return Err(format!(
                    "KV of {per_rank} bytes does not fit rank {r}'s region of {} bytes at offset {}",
                    rank.region_len, target.staging_offset
                ));
            }
            let worker = if rank.ucx_worker_address.is_empty() {
                &target.ucx_worker_address
            } else {
                &rank.ucx_worker_address
            };
            let remote = t
                .connect(
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
                })?;
            remotes.push(remote);
        }
        Ok(Some(Self {
            t: t.clone(),
            slice,
            remotes,
            staging_offset: target.staging_offset,
            blocks,
            layers: layout.num_layers,
            layer_block,
            sent: 0,
            puts: Vec::new(),
            sent_early: 0,
        }))
    }

    pub fn offset(&self) -> usize {
        self.slice.offset()
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn bytes(&self) -> u64 {
        self.remotes.len() as u64 * self.layers as u64 * self.blocks as u64 * self.layer_block
    }

    /// The engine reports leading blocks `0..upto` in the span: put the new ones, every rank.
    pub fn ready(&mut self, upto: usize) -> Result<(), String> {
        let upto = upto.min(self.blocks);
        if upto <= self.sent {
            return Ok(());
        }
        let (n, lb) = (self.blocks as u64, self.layer_block);
        if upto == self.blocks {
            self.sent_early = self.sent;
        }
        let (from, len) = (self.sent as u64, (upto - self.sent) as u64 * lb);
        let spans: Vec<Span> = (0..self.layers as u64)
            .map(|l| Span {
                local_offset: self.slice.offset() as u64 + (l * n + from) * lb,
                remote_offset: self.staging_offset + (l * n + from) * lb,
                len,
            })
            .collect();
        let arena = self.slice.arena().clone();
        for (r, remote) in self.remotes.iter().enumerate() {
            let reg = arena
                .registration(r)
                .ok_or_else(|| format!("no staging arena for rank {r}"))?;
            let put = self
                .t
                .put(reg, remote, &spans)
                .map_err(|e| format!("put rank {r}: {e}"))?;
            self.puts.push(put);
        }
        self.sent = upto;
        Ok(())
    }

    /// After `PrefillDone`: the rest of the span (gathered here if the engine's staged gather
    /// stopped short), every put waited for, then every rank flushed. Returns the bytes.
    pub async fn finish(
        mut self,
        engine: &EngineHandle,
        id: RequestId,
        deadline: Instant,
    ) -> Result<u64, String> {
        if self.sent < self.blocks {
            // Wait for the puts reading the span before the gather rewrites it.
            for p in std::mem::take(&mut self.puts) {
                p.wait_async(deadline)
                    .await
                    .map_err(|e| format!("put: {e}"))?;
            }
            engine
                .gather_kv(id, 0..self.layers, self.slice.offset())
                .await
                .map_err(|e| format!("gathering the KV of {id}: {e}"))?;
            self.sent = 0;
            self.ready(self.blocks)?;
        }
        for p in std::mem::take(&mut self.puts) {
            p.wait_async(deadline)
                .await
                .map_err(|e| format!("put: {e}"))?;
        }
        let mut flushes = Vec::with_capacity(self.remotes.len());
        for (r, remote) in self.remotes.iter().enumerate() {
            flushes.push(
                self.t
                    .flush(remote)
                    .map_err(|e| format!("flush rank {r}: {e}"))?,
            );
        }
        for (r, f) in flushes.into_iter().enumerate() {
            f.wait_async(deadline)
                .await
                .map_err(|e| format!("flush rank {r}: {e}"))?;
        }
        Ok(self.bytes())
    }
}
