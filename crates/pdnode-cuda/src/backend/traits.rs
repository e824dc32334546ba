//! The [`Backend`] and [`KvMemory`] implementations of [`CudaBackend`], and the pool <-> host
//! KV copies behind `read_kv` / `write_kv` (through a device staging buffer and `kv_copy`).

use super::{CudaBackend, logits};
use crate::device::DevBuf;
use crate::ops;
use pdnode_core::{BlockId, KvLayout};
use pdnode_engine::backend::{
    Backend, BackendError, ForwardBatch, KvMemory, KvRegion, Logits, LogitsWant, MemKind,
    StepLogits, check_kv_io, check_logits_wants,
};
use std::ops::Range;

impl CudaBackend {
    /// Gathers layers `layers` of `blocks` into a fresh staging buffer (synchronized).
    fn gather(
        &self,
        layers: &Range<u32>,
        blocks: &[BlockId],
        len: usize,
    ) -> Result<(DevBuf, usize), BackendError> {
        self.gpu.bind()?;
        let per_rank = check_kv_io(&self.layout, self.num_blocks, layers, blocks, len, 1)?;
        let staging = self.gpu.alloc(per_rank)?;
        if per_rank == 0 {
            return Ok((staging, 0));
        }
        self.pool_copy(true, &staging, layers, blocks)?;
        Ok((staging, per_rank))
    }

    /// One `kv_copy` of layers `layers` of `blocks` between the pool and `staging`
    /// (`to_staging`: gather, else scatter), then a synchronize.
    fn pool_copy(
        &self,
        to_staging: bool,
        staging: &DevBuf,
        layers: &Range<u32>,
        blocks: &[BlockId],
    ) -> Result<(), BackendError> {
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        let idbuf = self.gpu.alloc(ids.len() * 4)?;
        self.gpu.upload(&idbuf, 0, &ids)?;
        ops::kv_copy(
            &self.gpu,
            to_staging,
            &self.pool,
            staging,
            idbuf.ptr(),
            blocks.len(),
            layers.start as usize,
            (layers.end - layers.start) as usize,
            self.num_blocks,
            self.layout.block_layer_bytes(),
        )?;
        // `idbuf` (and the caller's `staging`, on a scatter) is freed after the return: wait
        // for the copy first.
        self.gpu.sync()?;
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn kv_staging(&mut self) -> Option<&mut dyn pdnode_engine::backend::KvStaging> {
        if self.staging.is_some() {
            Some(self)
        } else {
            None
        }
    }

    fn name(&self) -> String {
        format!("cuda:{}", self.gpu.ordinal)
    }

    /// [`CudaOptions::warm_up_plan`]: kernels loaded and decode graphs captured before the
    /// first request.
    fn warm_up(&mut self) -> Result<usize, BackendError> {
        let plan = self.opts.warm_up_plan();
        let steps = pdnode_engine::backend::run_warm_up(self, &plan)?;
        let g = self.graphs.stats();
        tracing::debug!(
            steps,
            captures = g.captures,
            failures = g.capture_failures,
            "decode graphs after the warm-up"
        );
        Ok(steps)
    }

    /// `sample_rows` on the device, unless `engine.cuda.gpu_sampling` turns it off.
    fn samples_on_device(&self) -> bool {
        self.opts.gpu_sampling
    }

    fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError> {
        let rows = self.forward_device(batch)?;
        let vocab = self.spec.vocab_size;
        let src = self
            .gpu
            .download_pinned(&mut self.logits_host, &self.ws.logits, rows * vocab)?;
        let mut data = vec![0f32; rows * vocab];
        logits::copy_logits(src, &mut data);
        Ok(Logits { vocab, data })
    }

    fn forward_select(
        &mut self,
        batch: &ForwardBatch<'_>,
        want: &[LogitsWant],
        out: &mut StepLogits,
    ) -> Result<(), BackendError> {
        check_logits_wants(want, batch.logits_rows())?;
        let rows = self.forward_device(batch)?;
        self.land_logits(rows, want, out)
    }

    fn read_kv(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        let (staging, n) = self.gather(&layers, blocks, out.len())?;
        self.gpu.download(&mut out[..n], &staging, 0)?;
        Ok(())
    }

    fn write_kv(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        data: &[u8],
    ) -> Result<(), BackendError> {
        self.gpu.bind()?;
        let per_rank = check_kv_io(
            &self.layout,
            self.num_blocks,
            &layers,
            blocks,
            data.len(),
            1,
        )?;
        if per_rank == 0 {
            return Ok(());
        }
        let staging = self.gpu.alloc(per_rank)?;
        self.gpu.upload(&staging, 0, data)?;
        self.pool_copy(false, &staging, &layers, blocks)
    }
}

impl KvMemory for CudaBackend {
    fn kv_regions(&self) -> Vec<KvRegion> {
        vec![KvRegion {
            ptr: self.pool.ptr(),
            len: self.pool.bytes(),
            mem: MemKind::Cuda(self.gpu.ordinal),
        }]
    }
}
