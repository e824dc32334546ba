//! pdnode-cuda: the CUDA backend of the engine: bf16 weights and activations, f32 accumulation and residual stream, cuBLAS
//! GEMMs, NVRTC-compiled kernels (`pdnode-kernels`), a paged KV pool in
//! `cuMemAlloc` memory (exportable over CUDA IPC / UCX cuda_ipc).
//!
//! - [`mod@probe`]: is there a driver and a device? (`backend = "auto"` / `"cuda"` selection).
//! - [`device`]: one GPU: context, stream, cuBLAS handle, compiled kernels, raw device buffers.
//! - [`launch`]: the one launch path of our kernels ([`launch::Launch`]), with programmatic
//!   dependent launch behind `engine.cuda.pdl`.
//! - [`ops`]: shape-checked launch wrappers, one per kernel (also what the kernel tests call).
//! - [`prefill`]: prefill attention: fused flash attention on tensor cores (`mma.sync`, K/V read
//!   straight from the paged pool, chunked-prefill aware; `engine.cuda.prefill_attention` picks one),
//!   or cuBLAS S/P GEMMs around a causal softmax for head dims the flash kernels do not cover.
//! - [`build_backend`]: the one place a backend (cpu, cuda, cuda TP) is built from the config.
//! - [`CudaBackend`]: the [`pdnode_engine::backend::Backend`] implementation.
//!
//! # One step
//! Embedding gather into an f32 residual; per layer: RMSNorm -> fused QKV projection (bf16) ->
//! `rope_qkv` (bias, q/k norm, RoPE; k/v written into the pool) -> attention (paged decode kernel
//! v4 on tensor cores, split-K over partitions, for decode and short chunks; flash prefill for long
//! ones) -> o-proj accumulated into the f32 residual -> RMSNorm -> fused gate/up -> SwiGLU -> down
//! accumulated into the residual; then the final norm on the rows that want logits and the lm_head
//! (f32 logits). Projections of 1-8 tokens run on the tensor-core GEMV (`ops::linear`, with
//! SwiGLU and the residual RMSNorm fused in at 1-2 tokens), larger ones on cuBLAS. Decode steps are
//! captured once per (batch bucket, context bucket) into CUDA graphs and replayed
//! (`engine.cuda_graphs`); rows the engine samples greedily get their arg-max on the GPU
//! (`Backend::forward_select`), temperature / top-k / top-p / min-p rows without penalties or
//! logprobs are drawn on the GPU (`sample_rows`, with the request's own uniform), and only the
//! other rows land in a reused page-locked buffer.

//! # Tensor parallelism ([`tp`])
//! [`CudaTpBackend`] runs `tp` [`CudaBackend`] ranks, one OS thread and GPU each (rank `r` on
//! `CudaOptions::gpus[r]`, the listed ordinals in their order: [`tp::device_label`] names them).
//! Rank `r` holds query heads `r * nh / tp ..`, KV heads `r * nkv / tp ..` (q/k/v rows of those
//! heads; o-proj the matching columns), intermediate rows `r * I / tp ..` of gate/up and the
//! matching columns of down; embeddings, norms and lm_head are replicated. After the o-proj and
//! down GEMMs one NCCL f32 all-reduce (sum) of the residual stream: rank 0 adds its partial to the
//! residual, the others write theirs in place of it. Rank 0's logits are returned.
//!
//! # KV pool layout
//! Exactly the engine-wide layout (`pdnode_engine::backend` docs) on each rank: bf16,
//! `[num_layers][num_blocks][2][block_size][kv_heads_per_rank][head_dim]`, one `cuMemAlloc`
//! region per rank ([`pdnode_engine::backend::KvMemory`]). With tensor parallelism rank `r` of `tp` holds
//! KV heads `r * nkv / tp .. (r + 1) * nkv / tp` in that same layout, `kv_heads_per_rank =
//! nkv / tp`; all ranks have the same block count; `read_kv`/`write_kv` move all ranks' bytes
//! back to back, rank-major.

pub mod backend;
pub mod blas;
pub mod blaslt;
pub mod build;
pub mod device;
pub mod launch;
pub mod mla_weights;
pub mod ops;
pub mod prefill;
pub mod probe;
mod span_sums;
pub mod tp;
pub mod trace;
pub mod weights;

pub use backend::{CudaBackend, CudaOptions};
pub use build::{BuildOptions, BuiltBackend, build_backend};
use pdnode_core::error::Classify;
pub use probe::{BackendChoice, CudaProbe, probe, select_backend};
pub use tp::CudaTpBackend;

/// Errors of the CUDA backend. Converted into [`pdnode_engine::backend::BackendError::DeviceFailure`]
/// at the trait boundary, keeping their class ([`Classify::kind`]): out of memory and invalid
/// shapes or arguments are not Retryable.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda) found on this host")]
    NoDriver,
    #[error("CUDA device {ordinal} requested, {count} present")]
    NoDevice { ordinal: u32, count: u32 },
    #[error("CUDA driver call {op} failed: {msg}")]
    Driver {
        op: &'static str,
        msg: String,
        class: DriverClass,
    },
    #[error(transparent)]
    Kernels(#[from] pdnode_kernels::KernelError),
    #[error("kernel {name} is not in the compiled program")]
    NoKernel { name: &'static str },
    #[error("cuBLAS call {op} failed: {msg}")]
    Blas { op: &'static str, msg: String },
    #[error("not enough device memory: {what} needs {need} bytes, {have} available")]
    OutOfMemory {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("bad shape for {op}: {reason}")]
    Shape { op: &'static str, reason: String },
    #[error("unsupported configuration: {reason}")]
    Unsupported { reason: String },
    #[error("NCCL call {op} failed: {msg}")]
    Nccl { op: &'static str, msg: String },
    #[error("tensor-parallel rank {rank}: {msg}")]
    Rank { rank: usize, msg: String },
    /// A step through the [`pdnode_engine::backend::Backend`] trait failed (benchmarks driving
    /// a backend report its error in this type; its class is kept).
    #[error("forward step: {0}")]
    Step(#[source] pdnode_engine::backend::BackendError),
}

impl Classify for CudaError {
    fn kind(&self) -> pdnode_core::ErrorKind {
        match self {
            CudaError::NoDriver | CudaError::NoDevice { .. } | CudaError::OutOfMemory { .. } => {
                pdnode_core::ErrorKind::Unavailable
            }
            CudaError::Driver { class, .. } => class.kind(),
            CudaError::Blas { .. } | CudaError::Nccl { .. } => pdnode_core::ErrorKind::Retryable,
            CudaError::Rank { .. } => pdnode_core::ErrorKind::Unavailable,
            CudaError::Step(e) => e.kind(),
            CudaError::Kernels(_)
            | CudaError::NoKernel { .. }
            | CudaError::Shape { .. }
            | CudaError::Unsupported { .. } => pdnode_core::ErrorKind::Internal,
        }
    }
}

impl From<CudaError> for pdnode_engine::backend::BackendError {
    fn from(e: CudaError) -> Self {
        pdnode_engine::backend::BackendError::DeviceFailure {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

/// What a failed driver call says about the request and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverClass {
    /// `CUDA_ERROR_OUT_OF_MEMORY`: the device is short of memory; a retry here fails the same way.
    OutOfMemory,
    /// An argument, handle, shape or launch configuration the driver refused: a bug, not retried.
    InvalidArgument,
    /// The context is unusable (illegal address, sticky launch failure, ECC): not retried here.
    Fatal,
    /// Anything else (e.g. a launch timeout, a busy device): may be retried.
    Transient,
}

impl DriverClass {
    /// The class of driver result `r`.
    pub fn of(r: cudarc::driver::sys::CUresult) -> Self {
        use cudarc::driver::sys::CUresult as R;
        match r {
            R::CUDA_ERROR_OUT_OF_MEMORY => Self::OutOfMemory,
            R::CUDA_ERROR_INVALID_VALUE
            | R::CUDA_ERROR_INVALID_HANDLE
            | R::CUDA_ERROR_INVALID_CONTEXT
            | R::CUDA_ERROR_INVALID_DEVICE
            | R::CUDA_ERROR_INVALID_IMAGE
            | R::CUDA_ERROR_INVALID_PTX
            | R::CUDA_ERROR_NOT_FOUND
            | R::CUDA_ERROR_NOT_SUPPORTED
            | R::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
            | R::CUDA_ERROR_ILLEGAL_STATE => Self::InvalidArgument,
            R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_CONTEXT_IS_DESTROYED => Self::Fatal,
            _ => Self::Transient,
        }
    }

    fn kind(self) -> pdnode_core::ErrorKind {
        match self {
            Self::OutOfMemory => pdnode_core::ErrorKind::Unavailable,
            Self::InvalidArgument | Self::Fatal => pdnode_core::ErrorKind::Internal,
            Self::Transient => pdnode_core::ErrorKind::Retryable,
        }
    }
}

/// Wraps a driver error with the name of the call that failed, keeping its class.
pub fn drv(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        msg: format!("{e:?}"),
        class: DriverClass::of(e.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Shard;
    use cudarc::driver::sys::CUresult;
    use pdnode_core::ErrorKind;
    use pdnode_engine::backend::BackendError;

    /// What [`drv`] makes of result `r` (its message needs libcuda; the class does not).
    fn through_backend(r: CUresult) -> BackendError {
        BackendError::from(CudaError::Driver {
            op: "cuTest",
            msg: format!("{r:?}"),
            class: DriverClass::of(r),
        })
    }

    /// A DeepSeek model splits over tensor-parallel ranks that divide its query heads and every
    /// intermediate size; an uneven split is refused with a clear error before any device is
    /// touched (this runs without a GPU).
    #[test]
    fn latent_attention_models_split_over_ranks_that_divide_their_heads_and_experts() {
        for preset in ["deepseek-v2-lite", "deepseek-v3"] {
            let model = pdnode_engine::loader::load_dummy(
                preset,
                pdnode_engine::loader::DummySpec { seed: 0, std: 0.02 },
                None,
            )
            .unwrap();
            let spec = &model.spec;
            for size in [1, 2, 4, 8] {
                for rank in 0..size {
                    Shard { rank, size }
                        .check(spec)
                        .unwrap_or_else(|e| panic!("{preset} at TP = {size}: {e}"));
                }
                let r = Shard { rank: 0, size }.rank_spec(spec);
                let (e, whole) = (r.moe.as_ref().unwrap(), spec.moe.as_ref().unwrap());
                assert_eq!(r.num_heads * size, spec.num_heads, "{preset}");
                assert_eq!(r.intermediate_size * size, spec.intermediate_size);
                assert_eq!(e.expert_intermediate * size, whole.expert_intermediate);
                // the latent (the pool's one "head") and the routing stay whole
                assert_eq!(r.kv_cache_shape(), spec.kv_cache_shape(), "{preset}");
                assert_eq!(r.num_kv_heads, spec.num_kv_heads);
                assert_eq!(
                    (e.num_experts, e.top_k, e.num_shared),
                    (whole.num_experts, whole.top_k, whole.num_shared)
                );
            }
            // 3 divides neither 16 nor 128 heads: refused by the backend before a device
            let mut opts = CudaOptions::from_config(&pdnode_core::config::EngineConfig::default());
            opts.tensor_parallel = 3;
            opts.gpus = vec![0, 1, 2];
            match CudaTpBackend::from_loaded(&model, &opts) {
                Err(CudaError::Unsupported { reason }) => assert!(
                    reason.contains("tensor_parallel = 3 does not divide num_heads"),
                    "{preset}: {reason}"
                ),
                Err(e) => panic!("{preset}: {e}"),
                Ok(_) => panic!("{preset}: the CUDA backend split 3 ways"),
            }
        }
    }

    /// Each dimension a latent-attention split divides is named when it does not divide: the
    /// query heads, the dense layers' intermediate size (only with dense layers) and the experts'
    /// (which the shared experts' MLP is a multiple of).
    #[test]
    fn an_uneven_latent_attention_split_names_the_dimension() {
        let model = pdnode_engine::loader::load_dummy(
            "deepseek-v2-lite",
            pdnode_engine::loader::DummySpec { seed: 0, std: 0.02 },
            None,
        )
        .unwrap();
        let refused = |spec: &pdnode_engine::spec::ModelSpec, size| match (Shard { rank: 0, size })
            .check(spec)
        {
            Err(CudaError::Unsupported { reason }) => reason,
            other => panic!("TP = {size}: {other:?}"),
        };
        let mut s = model.spec.clone();
        s.num_heads = 6;
        assert!(refused(&s, 4).contains("num_heads = 6"));
        let mut s = model.spec.clone();
        s.intermediate_size = 10946;
        assert!(refused(&s, 4).contains("intermediate_size = 10946"));
        // without dense layers the dense size is not used, not checked
        s.moe.as_mut().unwrap().first_dense_layers = 0;
        Shard { rank: 3, size: 4 }.check(&s).unwrap();
        let mut s = model.spec.clone();
        s.moe.as_mut().unwrap().expert_intermediate = 1404;
        assert!(refused(&s, 8).contains("moe_intermediate_size = 1404"));
        // a rank outside the group
        assert!(Shard { rank: 2, size: 2 }.check(&model.spec).is_err());
    }

    #[test]
    fn device_errors_keep_their_class_through_the_backend_trait() {
        let oom = through_backend(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(oom.kind(), ErrorKind::Unavailable);
        let bad = through_backend(CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(bad.kind(), ErrorKind::Internal);
        let fatal = through_backend(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(fatal.kind(), ErrorKind::Internal);
        let transient = through_backend(CUresult::CUDA_ERROR_LAUNCH_TIMEOUT);
        assert_eq!(transient.kind(), ErrorKind::Retryable);
        let shape = BackendError::from(CudaError::Shape {
            op: "linear",
            reason: "k mismatch".into(),
        });
        assert!(matches!(
            shape,
            BackendError::DeviceFailure {
                kind: ErrorKind::Internal,
                ..
            }
        ));
        let oom = BackendError::from(CudaError::OutOfMemory {
            what: "KV pool",
            need: 2,
            have: 1,
        });
        assert_ne!(oom.kind(), ErrorKind::Retryable);
        // a step error reported back as a CudaError (benchmarks) keeps the step's class
        let step = CudaError::Step(BackendError::from(CudaError::OutOfMemory {
            what: "workspace",
            need: 2,
            have: 1,
        }));
        assert_eq!(step.kind(), ErrorKind::Unavailable);
        let step = CudaError::Step(BackendError::InvalidBatch {
            reason: "empty".into(),
        });
        assert_eq!(step.kind(), ErrorKind::Internal);
    }
}
