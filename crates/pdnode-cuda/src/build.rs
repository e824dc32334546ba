//! The one place a backend is picked and built from the config: the node (`pdnode start`, every
//! engine role) and `pdnode generate` both call [`build_backend`] after [`crate::select_backend`]
//! resolved `engine.backend` (`auto` probes for a driver and a device).

use crate::{BackendChoice, CudaBackend, CudaError, CudaOptions, CudaTpBackend, select_backend};
use pdnode_core::KvLayout;
use pdnode_core::config::EngineConfig;
use pdnode_core::error::Classify;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig, HostArena};
use pdnode_engine::backend::{Backend, BackendError, KvMemory, KvRegion, STAGING_ALIGN};
use pdnode_engine::loader::LoadedModel;

/// Host memory the CPU backend's KV pool may take when `engine.num_kv_blocks = 0`.
pub const CPU_KV_POOL_BUDGET_BYTES: usize = 1 << 30;

/// Lends the CPU backend host memory for its KV staging arena: called with the arena's length,
/// answers the memory (e.g. a UCX-allocated registered region) or `None` (no arena).
pub type HostArenaSource<'a> = &'a dyn Fn(usize) -> Option<HostArena>;

/// What [`build_backend`] needs beyond the engine config and the model.
#[derive(Clone, Copy)]
pub struct BuildOptions<'a> {
    /// Longest sequence (prompt + output) the engine serves, tokens: sizes the CPU pool when
    /// neither `kv_blocks` nor `engine.num_kv_blocks` says.
    pub context: usize,
    /// KV blocks of the pool; `None`: `engine.num_kv_blocks`, and when that is 0, sized by the
    /// backend (CUDA: from free memory and `engine.mem_fraction`; CPU: `max_running_requests`
    /// full contexts within [`CPU_KV_POOL_BUDGET_BYTES`]).
    pub kv_blocks: Option<u32>,
    /// A KV staging arena per TP rank (a prefill or decode node over UCX), of
    /// [`staging_bytes`]: the CUDA backend allocates its own device arena; the CPU backend takes
    /// the host memory this lends. `None`: no arena. An arena that cannot be had is logged and
    /// left out (the hand-off then copies through host staging); it never fails the build.
    pub staging: Option<HostArenaSource<'a>>,
    /// Bytes added per block of `engine.kv_staging_tokens` to a host (CPU backend) staging
    /// arena: the KV hand-off's room for the fence record behind each span (`pd::fence` in
    /// pdnode-node); 0 for a caller without hand-offs.
    pub host_slot_bytes: usize,
}

/// A built backend and the memory regions of its KV pool (for transport registration).
pub struct BuiltBackend {
    pub backend: Box<dyn Backend>,
    pub kv_regions: Vec<KvRegion>,
}

/// Why no backend could be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("engine.backend = \"mock\" runs no model: build `MockBackend` from the engine config")]
    MockHasNoModel,
    #[error("cpu backend: {0}")]
    Cpu(#[source] BackendError),
    #[error("cuda backend: {0}")]
    Cuda(#[from] CudaError),
}

impl Classify for BuildError {
    fn kind(&self) -> pdnode_core::ErrorKind {
        match self {
            BuildError::MockHasNoModel => pdnode_core::ErrorKind::InvalidRequest,
            BuildError::Cpu(e) => e.kind(),
            BuildError::Cuda(e) => e.kind(),
        }
    }
}

/// Bytes of one TP rank's KV staging arena for `layout` (`engine.kv_staging_tokens` in whole
/// blocks, aligned to [`STAGING_ALIGN`]); 0: none.
pub fn staging_bytes(engine: &EngineConfig, layout: &KvLayout) -> usize {
    let tokens = engine.kv_staging_tokens as usize;
    let blocks = tokens.div_ceil(layout.block_size.max(1) as usize);
    (blocks * layout.num_layers as usize * layout.block_layer_bytes())
        .next_multiple_of(STAGING_ALIGN)
}

/// Bytes of a host staging arena: [`staging_bytes`] plus `slot_bytes` per block of
/// `engine.kv_staging_tokens` (as many as there can be spans); 0: none.
pub fn host_staging_bytes(engine: &EngineConfig, layout: &KvLayout, slot_bytes: usize) -> usize {
    let bytes = staging_bytes(engine, layout);
    if bytes == 0 {
        return 0;
    }
    let blocks = (engine.kv_staging_tokens as usize).div_ceil(layout.block_size.max(1) as usize);
    bytes + blocks * slot_bytes
}

/// KV blocks of a CPU pool for `model` under `engine` and `opts`.
fn cpu_kv_blocks(engine: &EngineConfig, model: &LoadedModel, opts: &BuildOptions<'_>) -> u32 {
    if let Some(n) = opts.kv_blocks {
        return n.max(1);
    }
    if engine.num_kv_blocks > 0 {
        return engine.num_kv_blocks;
    }
    let spec = &model.spec;
    let block_size = engine.block_size.max(1) as usize;
    let layer_block = 2 * block_size * spec.num_kv_heads * spec.head_dim * 4;
    let block_bytes = layer_block * spec.num_layers;
    let want = engine.max_running_requests as usize * opts.context.div_ceil(block_size);
    let cap = (CPU_KV_POOL_BUDGET_BYTES / block_bytes.max(1)).max(1);
    want.min(cap).max(1) as u32
}

/// Builds the backend `engine.backend` resolves to on this host (`cpu`, or `cuda` with one GPU
/// or a tensor-parallel group) over `model`. Blocking (uploads weights).
pub fn build_backend(
    engine: &EngineConfig,
    model: LoadedModel,
    opts: BuildOptions<'_>,
) -> Result<BuiltBackend, BuildError> {
    match select_backend(engine.backend, &engine.gpus)? {
        BackendChoice::Mock => Err(BuildError::MockHasNoModel),
        BackendChoice::Cpu => {
            let num_blocks = cpu_kv_blocks(engine, &model, &opts);
            let mut backend = CpuBackend::from_loaded(
                model,
                CpuBackendConfig {
                    block_size: engine.block_size,
                    num_blocks,
                    threads: engine.cpu_threads,
                },
            )
            .map_err(BuildError::Cpu)?;
            let bytes = host_staging_bytes(engine, backend.kv_layout(), opts.host_slot_bytes);
            if let Some(lend) = opts.staging.filter(|_| bytes > 0)
                && let Some(arena) = lend(bytes)
            {
                tracing::info!(bytes, "KV staging arena (host) attached");
                backend.attach_staging(arena);
            }
            Ok(with_regions(backend))
        }
        BackendChoice::Cuda => {
            let mut cuda = CudaOptions::from_config(engine);
            if let Some(n) = opts.kv_blocks {
                cuda.num_kv_blocks = n.max(1);
            }
            let arena =
                |layout: &KvLayout| opts.staging.map_or(0, |_| staging_bytes(engine, layout));
            let no_arena = |e: &dyn std::fmt::Display| {
                tracing::warn!(error = %e, "no KV staging arena: the hand-off copies through host staging");
            };
            if cuda.tensor_parallel > 1 {
                let mut backend = CudaTpBackend::from_loaded(&model, &cuda)?;
                let bytes = arena(backend.kv_layout());
                if bytes > 0
                    && let Err(e) = backend.enable_kv_staging(bytes)
                {
                    no_arena(&e);
                }
                Ok(with_regions(backend))
            } else {
                let mut backend = CudaBackend::from_loaded(&model, &cuda)?;
                let bytes = arena(backend.kv_layout());
                if bytes > 0
                    && let Err(e) = backend.enable_kv_staging(bytes)
                {
                    no_arena(&e);
                }
                Ok(with_regions(backend))
            }
        }
    }
}

fn with_regions<B: Backend + KvMemory + 'static>(backend: B) -> BuiltBackend {
    BuiltBackend {
        kv_regions: backend.kv_regions(),
        backend: Box::new(backend),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cuda_switches_of_the_config_reach_the_backend_options() {
        let mut e = EngineConfig::default();
        let o = CudaOptions::from_config(&e);
        assert!(o.gpu_sampling && !o.pdl);
        assert_eq!(o.fusion, crate::ops::Fusion::default());
        e.cuda.gpu_sampling = false;
        e.cuda.pdl = true;
        e.cuda.fuse_swiglu_max_tokens = 0;
        e.cuda.fuse_norm_max_tokens = 4;
        let o = CudaOptions::from_config(&e);
        assert!(!o.gpu_sampling && o.pdl);
        assert_eq!(
            (o.fusion.swiglu_max_tokens, o.fusion.norm_max_tokens),
            (0, 4)
        );
    }

    #[test]
    fn the_kernel_choices_of_the_config_reach_the_backend_options() {
        use crate::ops::{AttnVariant, LinearImpl, V4_MAX_PART, V4_WAVES};
        use crate::prefill::PrefillAttn;
        use pdnode_core::config::{AttentionKernel, LinearKernel, PrefillAttention};
        let mut e = EngineConfig::default();
        let o = CudaOptions::from_config(&e);
        assert_eq!(o.attention.variant, AttnVariant::Auto);
        assert_eq!(
            (o.attention.v4_waves, o.attention.v4_max_part),
            (V4_WAVES, V4_MAX_PART),
            "the config's defaults are the measured ones"
        );
        assert_eq!(o.linear, LinearImpl::Auto);
        assert_eq!(o.prefill_attention, PrefillAttn::Wgmma);
        for (k, v) in [
            (AttentionKernel::V1, AttnVariant::V1),
            (AttentionKernel::V2, AttnVariant::V2),
            (AttentionKernel::V2narrow, AttnVariant::V2Narrow),
            (AttentionKernel::V4, AttnVariant::V4),
        ] {
            e.cuda.attention = k;
            assert_eq!(CudaOptions::from_config(&e).attention.variant, v);
        }
        for (k, v) in [
            (LinearKernel::Mma, LinearImpl::GemvMma),
            (LinearKernel::Gemv, LinearImpl::Gemv),
            (LinearKernel::Cublas, LinearImpl::Cublas),
        ] {
            e.cuda.linear = k;
            assert_eq!(CudaOptions::from_config(&e).linear, v);
        }
        for (k, v) in [
            (PrefillAttention::Flash8, PrefillAttn::Flash8),
            (PrefillAttention::Flashv3, PrefillAttn::FlashV3),
            (PrefillAttention::Gemm, PrefillAttn::Gemm),
        ] {
            e.cuda.prefill_attention = k;
            assert_eq!(CudaOptions::from_config(&e).prefill_attention, v);
        }
        e.cuda.attention_v4_waves = 3;
        e.cuda.attention_v4_max_part = 512;
        let o = CudaOptions::from_config(&e);
        assert_eq!((o.attention.v4_waves, o.attention.v4_max_part), (3, 512));
    }
}
