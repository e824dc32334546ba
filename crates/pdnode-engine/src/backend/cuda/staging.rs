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
use crate::backend::{
    BackendError, KvRegion, KvStaging, MemKind, check_staging_io, check_staging_strided,
};
use cudarc::driver::LaunchConfig;
use pdnode_core::BlockId;
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
        self.staging_launch(gather, &[(layers.clone(), offset)], blocks)
    }

    /// `kv_gather` of each layer of `layers` into `offset + i * layer_stride`, then one
    /// synchronize.
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
        let parts: Vec<(Range<u32>, usize)> = layers
            .clone()
            .enumerate()
            .map(|(i, l)| (l..l + 1, offset + i * layer_stride))
            .collect();
        self.staging_launch(true, &parts, blocks)
    }

    /// For each `(layers, offset)` of `parts` (checked by the caller against the arena), one
    /// launch between the pool and the arena at `offset`; then a stream synchronize.
    fn staging_launch(
        &self,
        gather: bool,
        parts: &[(Range<u32>, usize)],
        blocks: &[BlockId],
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_staging_copy";
        let arena = self.arena()?;
        let lb = self.layout.block_layer_bytes();
        if !lb.is_multiple_of(16) || parts.iter().any(|(_, o)| !o.is_multiple_of(16)) {
            return Err(BackendError::InvalidBatch {
                reason: format!(
                    "layer-block of {lb} bytes or a staging offset is not a multiple of 16"
                ),
            });
        }
        self.gpu.bind()?;
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        let idbuf = self.gpu.alloc(ids.len() * 4)?;
        self.gpu.upload(&idbuf, 0, &ids)?;
        let f = self
            .gpu
            .kernel(if gather { "kv_gather" } else { "kv_scatter" })?;
        let idp = idbuf.ptr();
        let (nb, numb, lbv) = (
            blocks.len() as i32,
            self.num_blocks as i32,
            (lb / 16) as i64,
        );
        for (layers, offset) in parts {
            let nlayers = (layers.end - layers.start) as usize;
            let grid =
                u32::try_from(nlayers * blocks.len()).map_err(|_| BackendError::InvalidBatch {
                    reason: format!("{nlayers} x {} layer-blocks exceed a grid", blocks.len()),
                })?;
            if grid == 0 {
                continue;
            }
            let (dst, l0) = (arena.at(*offset), layers.start as i32);
            let mut b = self.gpu.launch_builder(f);
            b.arg(self.pool.ptr_ref())
                .arg(&dst)
                .arg(&idp)
                .arg(&nb)
                .arg(&l0)
                .arg(&numb)
                .arg(&lbv);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the pool holds `num_blocks` blocks of every layer and each id is below
            // `num_blocks`; the arena span of this part is inside the allocation and 16-byte
            // aligned (checked by the callers, check_staging_io / check_staging_strided, and
            // above); `idbuf` holds `blocks.len()` ids and lives until the synchronize below.
            unsafe { b.launch(cfg) }.map_err(super::super::drv(OP))?;
        }
        self.gpu.sync()?;
        Ok(())
    }
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
}
