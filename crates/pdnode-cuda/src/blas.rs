//! cuBLAS GEMMs: bf16 operands, f32 accumulation, bf16 or f32 output.
//!
//! Weights are stored as HF `[out, in]` row-major, which cuBLAS (column-major) sees as an
//! `in x out` matrix: `Y[T, out] = X[T, in] * W^T` is the column-major
//! `Y^T (out x T) = op_T(W) (out x in) * X^T (in x T)`, i.e. `transa = T, transb = N`.

use super::CudaError;
use super::blaslt::BlasLt;
use cudarc::cublas::{result, sys};
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::Arc;

/// Bytes of the fixed cuBLAS workspace (NVIDIA's recommendation for Hopper): cuBLAS then never
/// allocates one itself, which a CUDA graph capture of the decode step could not contain.
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

pub struct Blas {
    handle: sys::cublasHandle_t,
    /// `cuMemAlloc` workspace handed to cuBLAS (freed after the handle).
    workspace: u64,
    ctx: Arc<CudaContext>,
    /// cuBLASLt on the same stream, for the shapes where a chosen algorithm beats
    /// `cublasGemmEx`'s default (`ops::linear`); `None` where libcublasLt did not load.
    lt: Option<BlasLt>,
}

impl Blas {
    pub(crate) fn new(stream: &CudaStream) -> Result<Self, CudaError> {
        let err = |op| {
            move |e: result::CublasError| CudaError::Blas {
                op,
                msg: format!("{e:?}"),
            }
        };
        // SAFETY: is_culib_present only tries to dlopen libcublas.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Blas {
                op: "load",
                msg: "libcublas not found".into(),
            });
        }
        let handle = result::create_handle().map_err(err("cublasCreate"))?;
        // SAFETY: `handle` was just created in the current context; the stream is alive as long
        // as the owning Gpu, which also owns this handle.
        let set = unsafe { result::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
            .map_err(err("cublasSetStream"));
        // The value owns the handle from here on: its drop destroys it on any error below.
        let mut blas = Self {
            handle,
            workspace: 0,
            ctx: stream.context().clone(),
            lt: None,
        };
        set?;
        // SAFETY: the stream's context is current (the caller created the stream on this thread);
        // the size is non-zero.
        blas.workspace = unsafe { cudarc::driver::result::malloc_sync(BLAS_WORKSPACE_BYTES) }
            .map_err(super::drv("cuMemAlloc (cuBLAS workspace)"))?;
        // SAFETY: `workspace` is a live allocation of BLAS_WORKSPACE_BYTES in the handle's
        // context, kept until after the handle is destroyed (Drop).
        unsafe {
            sys::cublasSetWorkspace_v2(
                blas.handle,
                blas.workspace as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
        }
        .result()
        .map_err(err("cublasSetWorkspace"))?;
        blas.lt = BlasLt::new(stream)
            .inspect_err(|e| tracing::warn!(error = %e, "no cuBLASLt: cublasGemmEx only"))
            .ok();
        Ok(blas)
    }

    /// The cuBLASLt handle on the same stream, where libcublasLt loaded.
    pub fn lt(&self) -> Option<&BlasLt> {
        self.lt.as_ref()
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
        if self.workspace != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated with cuMemAlloc in `new` in this context, freed once, after
            // the handle that used it; the owning Gpu synchronizes its stream before dropping.
            let _ = unsafe { cudarc::driver::result::free_sync(self.workspace) };
        }
    }
}

/// Output element type of a GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutType {
    Bf16,
    F32,
}

/// `y[t, o] = beta * y[t, o] + sum_i x[t, i] * w[o, i]` for `t < tokens`, `o < out`, `i < inp`.
/// `w`: bf16 `[out, inp]`; `x`: bf16 `[tokens, inp]`; `y`: `[tokens, out]` of `ty`.
///
/// # Safety
/// The pointers must be live device allocations of the current context with at least the sizes
/// above, and the Blas handle must belong to that context.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    blas: &Blas,
    out: usize,
    tokens: usize,
    inp: usize,
    w: u64,
    x: u64,
    y: u64,
    ty: OutType,
    beta: f32,
) -> Result<(), CudaError> {
    if out == 0 || tokens == 0 || inp == 0 {
        return Ok(());
    }
    let to_i32 = |v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Shape {
            op: "gemm",
            reason: format!("dimension {v} exceeds i32"),
        })
    };
    let (m, n, k) = (to_i32(out)?, to_i32(tokens)?, to_i32(inp)?);
    let alpha = 1.0f32;
    let cty = match ty {
        OutType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        OutType::F32 => sys::cudaDataType_t::CUDA_R_32F,
    };
    // SAFETY: per the function contract; alpha/beta are host f32 scalars matching COMPUTE_32F.
    unsafe {
        sys::cublasGemmEx(
            blas.handle,
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            (&alpha) as *const f32 as *const _,
            w as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            k,
            x as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            k,
            (&beta) as *const f32 as *const _,
            y as *mut _,
            cty,
            m,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .result()
    .map_err(|e| CudaError::Blas {
        op: "cublasGemmEx",
        msg: format!("{e:?} (m={m} n={n} k={k})"),
    })
}

/// One operand of a strided-batched GEMM: device pointer, leading dimension, batch stride
/// (elements), and whether cuBLAS should transpose it.
#[derive(Debug, Clone, Copy)]
pub struct Operand {
    pub ptr: u64,
    pub ld: usize,
    pub stride: usize,
    pub trans: bool,
}

/// Column-major `C_b (m x n) = op(A_b) (m x k) * op(B_b) (k x n)` for `b < batch`; A and B bf16,
/// C of `ty`, f32 accumulation, beta 0.
///
/// # Safety
/// Every batch's operands must lie inside live device allocations of the current context.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_strided_batched(
    blas: &Blas,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Operand,
    ty: OutType,
    batch: usize,
) -> Result<(), CudaError> {
    if m == 0 || n == 0 || k == 0 || batch == 0 {
        return Ok(());
    }
    let i = |v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Shape {
            op: "gemm_strided_batched",
            reason: format!("{v} exceeds i32"),
        })
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let cty = match ty {
        OutType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        OutType::F32 => sys::cudaDataType_t::CUDA_R_32F,
    };
    // SAFETY: per the function contract; host f32 scalars match COMPUTE_32F.
    unsafe {
        sys::cublasGemmStridedBatchedEx(
            blas.handle,
            op(a.trans),
            op(b.trans),
            i(m)?,
            i(n)?,
            i(k)?,
            (&alpha) as *const f32 as *const _,
            a.ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            i(a.ld)?,
            a.stride as i64,
            b.ptr as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            i(b.ld)?,
            b.stride as i64,
            (&beta) as *const f32 as *const _,
            c.ptr as *mut _,
            cty,
            i(c.ld)?,
            c.stride as i64,
            i(batch)?,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .result()
    .map_err(|e| CudaError::Blas {
        op: "cublasGemmStridedBatchedEx",
        msg: format!("{e:?} (m={m} n={n} k={k} batch={batch})"),
    })
}
