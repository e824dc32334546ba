//! The KV staging arena of the CUDA backends ([`KvStaging`]): one `cuMemAlloc` region per TP
//! rank (exportable through CUDA IPC, so UCX's cuda_ipc transport maps it in the peer process),
//! allocated once by [`CudaBackend::enable_kv_staging`] / [`CudaTpBackend::enable_kv_staging`]
//! and registered once by the node. Gather and scatter are the `kv_gather` / `kv_scatter`
//! kernels between the pool and the arena at the caller's offset, device to device, synchronized
//! before they return. (A child module of `backend.rs`, for the backend's private fields.)

use super::super::CudaError;
use super::super::device::DevBuf;
use super::super::tp::CudaTpBackend;
use super::CudaBackend;
use cudarc::driver::LaunchConfig;
use pdnode_core::BlockId;
use pdnode_engine::backend::{
    BackendError, KvRegion, KvStaging, LayerGate, MemKind, StepStaging, check_staging_io,
    check_staging_span, check_staging_strided,
};
use std::ops::Range;
use std::sync::Arc;

impl CudaBackend {
    /// Allocates this GPU's staging arena of `bytes` (0: none). Once: a second call is refused.
    pub fn enable_kv_staging(&mut self, bytes: usize) -> Result<Option<KvRegion>, CudaError> {
        if self.staging.is_some() {
            return Err(CudaError::Unsupported {
                reason: "the KV staging arena is allocated already".into(),
            });
        }
        if bytes == 0 {
            return Ok(None);
        }
        self.gpu.bind()?;
        let arena = self.gpu.alloc(bytes)?;
        self.staging_sum = Some(self.gpu.alloc(8)?);
        self.span_slots = Some(self.gpu.alloc(crate::span_sums::SLOTS * 8)?);
        let region = KvRegion {
            ptr: arena.ptr(),
            len: arena.bytes(),
            mem: MemKind::Cuda(self.gpu.ordinal),
        };
        tracing::info!(
            gpu = self.gpu.ordinal,
            mib = bytes >> 20,
            "KV staging arena allocated"
        );
        self.staging = Some(arena);
        Ok(Some(region))
    }

    /// How many KVH64s of a span were the sum its gathers added up (no second read of it).
    pub fn fused_seals(&self) -> u64 {
        self.fused_seals.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// CRC32C of bytes `offset .. offset + len` of the staging arena, on the GPU
    /// ([`super::super::ops::crc32c::crc32c`]): the value `pdnode_transfer::checksum::crc32c`
    /// gives for the same bytes on the host, so a device-to-device hand-off can be verified like
    /// a host-staged one. Waits for the stream (the gathers before it included).
    pub fn staging_crc32c(&self, offset: usize, len: usize) -> Result<u32, CudaError> {
        let arena = self
            .staging
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported {
                reason: "no KV staging arena to checksum".into(),
            })?;
        self.gpu.bind()?;
        super::super::ops::crc32c::crc32c(&self.gpu, arena, offset, len)
    }

    /// `out.len()` bytes of the arena at `offset` (waits for the stream: every copy before).
    fn arena_read(&self, offset: usize, out: &mut [u8]) -> Result<(), BackendError> {
        let arena = self.arena()?;
        check_staging_span(0, 1, offset, out.len(), arena.bytes())?;
        self.gpu.bind()?;
        self.gpu.download(out, arena, offset)?;
        Ok(())
    }

    /// Writes `data` into the arena at `offset`, complete (synchronized) on return: a peer's
    /// transport reads it next, outside this stream.
    fn arena_write(&self, offset: usize, data: &[u8]) -> Result<(), BackendError> {
        let arena = self.arena()?;
        check_staging_span(0, 1, offset, data.len(), arena.bytes())?;
        // Not a hashed copy: a span it lands in is hashed anew at its seal.
        self.sums().touch(offset, data.len());
        self.gpu.bind()?;
        self.gpu.upload(arena, offset, data)?;
        self.gpu.sync()?;
        Ok(())
    }

    fn sums(&self) -> std::sync::MutexGuard<'_, crate::span_sums::SpanSums> {
        self.span_sums.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `offset .. offset + len` of the arena as a span the gathers into it hash
    /// (`span_sums.rs`): its sum word is zeroed on the stream, before those gathers.
    fn hash_span_begin(&self, offset: usize, len: usize) -> Result<(), BackendError> {
        let arena = self.arena()?;
        let slots = self.span_slots.as_ref().ok_or(BackendError::NoStaging)?;
        check_staging_span(0, 1, offset, len, arena.bytes())?;
        let slot = self.sums().begin(offset, len);
        self.gpu.bind()?;
        self.gpu.upload(slots, slot * 8, &[0u64])?;
        Ok(())
    }

    /// KVH64 of `len` bytes of the arena at `offset`: the sum the gathers that filled the span
    /// added up when they covered it once in full ([`Self::hash_span_begin`]), else one read of
    /// the span on the GPU (`kvh64_words`); either ordered after the copies before it on the
    /// stream.
    fn arena_kvh64(&self, offset: usize, len: usize) -> Result<u64, BackendError> {
        use super::super::ops::kvh64::{add_words, read_sum};
        let arena = self.arena()?;
        let sum = self.staging_sum.as_ref().ok_or(BackendError::NoStaging)?;
        check_staging_span(0, 1, offset, len, arena.bytes())?;
        self.gpu.bind()?;
        let fused = self.sums().finish(offset, len);
        tracing::debug!(
            offset,
            len,
            fused = fused.is_some(),
            "KVH64 of a staged span (fused: its gathers' sum, else a pass)"
        );
        if let (Some(slot), Some(slots)) = (fused, self.span_slots.as_ref()) {
            let h = read_sum(&self.gpu, slots, slot * 8, len as u64)?;
            self.fused_seals
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(h);
        }
        self.gpu.memset(sum, 0)?;
        add_words(&self.gpu, arena, offset, len, 0, sum.ptr())?;
        Ok(read_sum(&self.gpu, sum, 0, len as u64)?)
    }

    /// `kv_scatter_h64`: the scatter of `layers` of `blocks` from the arena at `offset`, which
    /// adds the KVH64 terms of the bytes it moves (the span's words from 0) to the arena's sum
    /// word; the finished hash of the span once the stream is done.
    fn scatter_h64(
        &self,
        layers: &Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<u64, BackendError> {
        use super::super::ops::kvh64::{kv_copy_h64, read_sum};
        let arena = self.arena()?;
        let sum = self.staging_sum.as_ref().ok_or(BackendError::NoStaging)?;
        let n = check_staging_io(
            &self.layout,
            self.num_blocks,
            layers,
            blocks,
            offset,
            arena.bytes(),
        )?;
        self.gpu.bind()?;
        let idp = self.block_ids(blocks)?;
        self.gpu.memset(sum, 0)?;
        kv_copy_h64(
            &self.gpu,
            false,
            &self.pool,
            arena,
            offset,
            idp,
            blocks.len(),
            layers.start as usize,
            (layers.end - layers.start) as usize,
            self.num_blocks,
            self.layout.block_layer_bytes(),
            0,
            sum.ptr(),
        )?;
        // Waits for the copy.
        Ok(read_sum(&self.gpu, sum, 0, n as u64)?)
    }

    /// `blocks` as device i32 ids for the copy kernels: the device address of a buffer kept
    /// for these copies (no allocation per copy). The upload is ordered on the stream, after
    /// the copies that read the previous ids and before those that read these; a buffer
    /// outgrown is dropped only after the stream drained.
    fn block_ids(&self, blocks: &[BlockId]) -> Result<u64, BackendError> {
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        let need = (ids.len() * 4).max(16);
        let mut buf = self.copy_ids.lock().unwrap_or_else(|p| p.into_inner());
        if buf.as_ref().is_none_or(|b| b.bytes() < need) {
            let grown = self.gpu.alloc(need.next_power_of_two())?;
            if let Some(old) = buf.replace(grown) {
                self.gpu.sync()?;
                drop(old);
            }
        }
        let b = buf.as_ref().ok_or(BackendError::NoStaging)?;
        self.gpu.upload(b, 0, &ids)?;
        Ok(b.ptr())
    }

    /// The staging arena, or [`BackendError::NoStaging`].
    fn arena(&self) -> Result<&DevBuf, BackendError> {
        self.staging.as_ref().ok_or(BackendError::NoStaging)
    }

    fn staging_region(&self) -> Option<KvRegion> {
        self.staging.as_ref().map(|a| KvRegion {
            ptr: a.ptr(),
            len: a.bytes(),
            mem: MemKind::Cuda(self.gpu.ordinal),
        })
    }

    /// One `kv_gather` (`gather`) or `kv_scatter` launch between the pool and the arena at
    /// `offset`, then a stream synchronize.
    fn staging_copy(
        &self,
        gather: bool,
        layers: &Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        let arena = self.arena()?;
        let n = check_staging_io(
            &self.layout,
            self.num_blocks,
            layers,
            blocks,
            offset,
            arena.bytes(),
        )?;
        if n == 0 {
            return Ok(());
        }
        let stride = blocks.len() * self.layout.block_layer_bytes();
        self.staging_launch(gather, &[(layers.clone(), offset, stride)], blocks)
    }

    /// `kv_gather` of each layer of `layers` into `offset + i * layer_stride` (one launch),
    /// then one synchronize.
    fn staging_gather_strided(
        &self,
        layers: &Range<u32>,
        blocks: &[BlockId],
        offset: usize,
        layer_stride: usize,
    ) -> Result<(), BackendError> {
        let arena = self.arena()?;
        let per_layer = check_staging_strided(
            &self.layout,
            self.num_blocks,
            layers,
            blocks,
            offset,
            layer_stride,
            arena.bytes(),
        )?;
        if per_layer == 0 {
            return Ok(());
        }
        self.staging_launch(true, &[(layers.clone(), offset, layer_stride)], blocks)
    }

    /// For each `(layers, offset, layer stride)` of `parts` (checked by the caller against the
    /// arena), one launch between the pool and the arena, layer `layers.start + i` at
    /// `offset + i * stride`; then a stream synchronize.
    fn staging_launch(
        &self,
        gather: bool,
        parts: &[(Range<u32>, usize, usize)],
        blocks: &[BlockId],
    ) -> Result<(), BackendError> {
        self.gpu.bind()?;
        let idp = self.block_ids(blocks)?;
        self.launch_copies(gather, parts, idp, blocks.len())?;
        self.gpu.sync()?;
        Ok(())
    }

    /// The copy launches of [`Self::staging_launch`], enqueued only: block ids at device
    /// address `idp` (`nblocks` i32, alive until the copies ran), parts checked by the caller.
    fn launch_copies(
        &self,
        gather: bool,
        parts: &[(Range<u32>, usize, usize)],
        idp: u64,
        nblocks: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_staging_copy";
        let arena = self.arena()?;
        let lb = self.layout.block_layer_bytes();
        let misaligned = parts.iter().any(|(l, o, s)| {
            !o.is_multiple_of(16) || !s.is_multiple_of(16) || (l.len() > 1 && *s < nblocks * lb)
        });
        if !lb.is_multiple_of(16) || misaligned {
            return Err(BackendError::InvalidBatch {
                reason: format!(
                    "layer-block of {lb} bytes, a staging offset or a layer stride is not a multiple of 16, or layers overlap"
                ),
            });
        }
        let f = self
            .gpu
            .kernel(if gather { "kv_gather" } else { "kv_scatter" })?;
        let fh = self.gpu.kernel("kv_gather_h64")?;
        let slots = self.span_slots.as_ref().map_or(0, DevBuf::ptr);
        let (nb, numb, lbv) = (nblocks as i32, self.num_blocks as i32, (lb / 16) as i64);
        for (layers, offset, stride) in parts {
            let nlayers = (layers.end - layers.start) as usize;
            let grid =
                u32::try_from(nlayers * nblocks).map_err(|_| BackendError::InvalidBatch {
                    reason: format!("{nlayers} x {nblocks} layer-blocks exceed a grid"),
                })?;
            if grid == 0 {
                continue;
            }
            let (dst, l0) = (arena.at(*offset), layers.start as i32);
            // A gather into a span being hashed adds the terms of what it writes to the span's
            // sum word (`kv_gather_h64`); the bookkeeping says where, or sends the seal to a pass.
            let hashed = if gather && slots != 0 {
                self.sums()
                    .copy_strided(*offset, nblocks * lb, *stride, nlayers)
            } else {
                None
            };
            let stridev = (*stride / 16) as i64;
            let (word0, sum) = hashed.map_or((0i64, 0u64), |h| {
                (h.word0 as i64, slots + 8 * h.slot as u64)
            });
            let mut b = self
                .gpu
                .launch_builder(if hashed.is_some() { fh } else { f });
            b.arg(self.pool.ptr_ref())
                .arg(&dst)
                .arg(&idp)
                .arg(&nb)
                .arg(&l0)
                .arg(&numb)
                .arg(&lbv)
                .arg(&stridev);
            if hashed.is_some() {
                b.arg(&word0).arg(&sum);
            }
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the pool holds `num_blocks` blocks of every layer and each id is below
            // `num_blocks`; the arena span of this part is inside the allocation and 16-byte
            // aligned (checked by the callers, check_staging_io / check_staging_strided, and
            // above); `idp` holds `nblocks` ids and outlives the copies (the callers' contract);
            // a hashed gather adds to one u64 inside `span_slots` (slot < SLOTS).
            unsafe { b.launch(cfg) }.map_err(super::super::drv(OP))?;
        }
        Ok(())
    }

    /// Checks an in-step staging plan against the pool and the arena and puts every
    /// sequence's block ids on the device (`stage_ids`, reused).
    pub(super) fn prepare_stage_run(
        &mut self,
        plan: StepStaging,
    ) -> Result<StageRun, BackendError> {
        let arena_len = self.arena()?.bytes();
        let all = 0..self.layout.num_layers;
        let mut ids: Vec<i32> = Vec::new();
        let mut id_off = Vec::with_capacity(plan.seqs.len());
        for sq in &plan.seqs {
            check_staging_strided(
                &self.layout,
                self.num_blocks,
                &all,
                &sq.blocks,
                sq.offset,
                sq.layer_stride,
                arena_len,
            )?;
            id_off.push(ids.len());
            ids.extend(sq.blocks.iter().map(|b| b.0 as i32));
        }
        let need = (ids.len() * 4).max(16);
        if self.stage_ids.as_ref().is_none_or(|b| b.bytes() < need) {
            self.stage_ids = Some(self.gpu.alloc(need.next_power_of_two())?);
        }
        if let Some(buf) = &self.stage_ids {
            self.gpu.upload(buf, 0, &ids)?;
        }
        Ok(StageRun {
            plan,
            id_off,
            group_start: 0,
            prev: None,
        })
    }

    /// After layer `li`'s KV is written: at the end of a layer group (or the last layer), the
    /// gather of the group's layers of every planned sequence into its span (enqueued on the
    /// step's stream), one event behind them, and a notification per sequence whose gate is
    /// that event.
    pub(super) fn stage_after_layer(&self, run: &mut StageRun, li: usize) -> Result<(), CudaError> {
        let done = li as u32 + 1;
        let last = done == self.layout.num_layers;
        if !(done.is_multiple_of(run.plan.group.max(1)) || last) {
            return Ok(());
        }
        let layers = run.group_start..done;
        run.group_start = done;
        let idbase = self.stage_ids.as_ref().map_or(0, DevBuf::ptr);
        for (i, sq) in run.plan.seqs.iter().enumerate() {
            let parts = [(
                layers.clone(),
                sq.offset + layers.start as usize * sq.layer_stride,
                sq.layer_stride,
            )];
            let idp = idbase + 4 * run.id_off[i] as u64;
            self.launch_copies(true, &parts, idp, sq.blocks.len())
                .map_err(|e| CudaError::Unsupported {
                    reason: format!("in-step KV staging: {e}"),
                })?;
        }
        let ev = Arc::new(
            self.gpu
                .ctx
                .new_event(None)
                .map_err(super::super::drv("cuEventCreate"))?,
        );
        ev.record(&self.gpu.stream)
            .map_err(super::super::drv("cuEventRecord"))?;
        // Keep the host at most one group ahead of the GPU: a whole prefill step enqueued at
        // once fills the context's command queue, and the hand-off's copies (UCX's cuda_ipc
        // puts, in this context) then block in their enqueue until the step has nearly
        // drained (seen on the H200: every put after the first left at the end of the step).
        if let Some(prev) = run.prev.replace(ev.clone()) {
            prev.synchronize()
                .map_err(super::super::drv("cuEventSynchronize"))?;
        }
        for i in 0..run.plan.seqs.len() {
            let ev = ev.clone();
            let gate: LayerGate = Box::new(move || {
                let device = |op| move |e| BackendError::from(super::super::drv(op)(e));
                ev.context()
                    .bind_to_thread()
                    .map_err(device("cuCtxSetCurrent"))?;
                ev.try_is_complete().map_err(device("cuEventQuery"))
            });
            (run.plan.notify)(i, layers.clone(), gate);
        }
        Ok(())
    }
}

/// One step's in-step staging (see [`CudaBackend::stage_after_layer`]).
pub(super) struct StageRun {
    plan: StepStaging,
    /// Where each sequence's ids start in `stage_ids` (in ids).
    id_off: Vec<usize>,
    group_start: u32,
    /// The previous group's event (the host waits for it before running further ahead).
    prev: Option<Arc<cudarc::driver::CudaEvent>>,
}

impl KvStaging for CudaBackend {
    fn staging_regions(&self) -> Vec<KvRegion> {
        self.staging_region().into_iter().collect()
    }

    fn gather_kv_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        self.staging_copy(true, &layers, blocks, offset)
    }

    fn gather_kv_layers_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
        layer_stride: usize,
    ) -> Result<(), BackendError> {
        self.staging_gather_strided(&layers, blocks, offset, layer_stride)
    }

    fn scatter_kv_from_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        self.staging_copy(false, &layers, blocks, offset)
    }

    fn staging_read(
        &mut self,
        rank: usize,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        check_staging_span(rank, 1, 0, 0, 0)?;
        self.arena_read(offset, out)
    }

    fn staging_write(
        &mut self,
        rank: usize,
        offset: usize,
        data: &[u8],
    ) -> Result<(), BackendError> {
        check_staging_span(rank, 1, 0, 0, 0)?;
        self.arena_write(offset, data)
    }

    fn staging_kvh64(&mut self, offset: usize, len: usize) -> Result<Vec<u64>, BackendError> {
        Ok(vec![self.arena_kvh64(offset, len)?])
    }

    fn staging_hash_begin(&mut self, offset: usize, len: usize) -> Result<bool, BackendError> {
        self.hash_span_begin(offset, len).map(|()| true)
    }

    fn scatter_kv_from_staging_h64(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<Vec<u64>, BackendError> {
        Ok(vec![self.scatter_h64(&layers, blocks, offset)?])
    }

    /// One GPU only: a tensor-parallel rank's staging is driven by [`CudaTpBackend`], which
    /// gathers after the step.
    fn supports_step_staging(&self) -> bool {
        self.staging.is_some() && self.comm.is_none()
    }

    fn stage_next_step(&mut self, plan: StepStaging) -> Result<(), BackendError> {
        if !self.supports_step_staging() {
            return Err(BackendError::NoStaging);
        }
        self.step_staging = Some(plan);
        Ok(())
    }
}

impl CudaTpBackend {
    /// Allocates every rank's staging arena of `bytes` (0: none), each on its rank's GPU.
    pub fn enable_kv_staging(&mut self, bytes: usize) -> Result<Vec<KvRegion>, BackendError> {
        let regions = self.on_each_rank(move |be: &mut CudaBackend| {
            be.enable_kv_staging(bytes).map_err(BackendError::from)
        })?;
        self.staging = regions.into_iter().flatten().collect();
        Ok(self.staging.clone())
    }

    /// The device CRC32C of bytes `offset .. offset + len` of every rank's arena, in rank order
    /// ([`CudaBackend::staging_crc32c`] on each rank's GPU).
    pub fn staging_crc32c(&mut self, offset: usize, len: usize) -> Result<Vec<u32>, BackendError> {
        if self.staging.is_empty() {
            return Err(BackendError::NoStaging);
        }
        self.on_each_rank(move |be: &mut CudaBackend| {
            be.staging_crc32c(offset, len).map_err(BackendError::from)
        })
    }

    /// Runs `copy` with `blocks` on every rank (each between its own pool and arena).
    fn staging_fan_out<F>(&mut self, blocks: &[BlockId], copy: F) -> Result<(), BackendError>
    where
        F: Fn(&mut CudaBackend, &[BlockId]) -> Result<(), BackendError> + Send + Sync + 'static,
    {
        if self.staging.is_empty() {
            return Err(BackendError::NoStaging);
        }
        let blocks = Arc::new(blocks.to_vec());
        self.on_each_rank(move |be: &mut CudaBackend| copy(be, &blocks))
            .map(|_| ())
    }
}

impl KvStaging for CudaTpBackend {
    fn staging_regions(&self) -> Vec<KvRegion> {
        self.staging.clone()
    }

    fn gather_kv_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        self.staging_fan_out(blocks, move |be, b| {
            be.staging_copy(true, &layers, b, offset)
        })
    }

    fn gather_kv_layers_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
        layer_stride: usize,
    ) -> Result<(), BackendError> {
        self.staging_fan_out(blocks, move |be, b| {
            be.staging_gather_strided(&layers, b, offset, layer_stride)
        })
    }

    fn scatter_kv_from_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        self.staging_fan_out(blocks, move |be, b| {
            be.staging_copy(false, &layers, b, offset)
        })
    }

    fn staging_read(
        &mut self,
        rank: usize,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        check_staging_span(rank, self.staging.len(), 0, 0, 0)?;
        let len = out.len();
        let mut got = self.on_each_rank_at(move |r, be: &mut CudaBackend| {
            if r != rank {
                return Ok(None);
            }
            let mut b = vec![0u8; len];
            be.arena_read(offset, &mut b).map(|()| Some(b))
        })?;
        let b = got
            .get_mut(rank)
            .and_then(Option::take)
            .ok_or(BackendError::StagingRank {
                rank,
                ranks: self.staging.len(),
            })?;
        out.copy_from_slice(&b);
        Ok(())
    }

    fn staging_write(
        &mut self,
        rank: usize,
        offset: usize,
        data: &[u8],
    ) -> Result<(), BackendError> {
        check_staging_span(rank, self.staging.len(), 0, 0, 0)?;
        let data = Arc::new(data.to_vec());
        self.on_each_rank_at(move |r, be: &mut CudaBackend| {
            if r == rank {
                be.arena_write(offset, &data)
            } else {
                Ok(())
            }
        })
        .map(|_| ())
    }

    fn staging_kvh64(&mut self, offset: usize, len: usize) -> Result<Vec<u64>, BackendError> {
        if self.staging.is_empty() {
            return Err(BackendError::NoStaging);
        }
        self.on_each_rank(move |be: &mut CudaBackend| be.arena_kvh64(offset, len))
    }

    fn staging_hash_begin(&mut self, offset: usize, len: usize) -> Result<bool, BackendError> {
        if self.staging.is_empty() {
            return Err(BackendError::NoStaging);
        }
        self.on_each_rank(move |be: &mut CudaBackend| be.hash_span_begin(offset, len))
            .map(|_| true)
    }

    fn scatter_kv_from_staging_h64(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<Vec<u64>, BackendError> {
        if self.staging.is_empty() {
            return Err(BackendError::NoStaging);
        }
        let blocks = Arc::new(blocks.to_vec());
        self.on_each_rank(move |be: &mut CudaBackend| be.scatter_h64(&layers, &blocks, offset))
    }
}
