//! cuBLASLt GEMMs with an explicit algorithm: the same product as [`super::blas::gemm`]
//! (bf16 weight and input, f32 accumulation, bf16 or f32 output, optional `beta = 1`
//! accumulation, the TN convention `Y^T (out x T) = op_T(W) (out x in) * X^T`), but the caller
//! picks one of the heuristic's candidates ([`BlasLt::heuristics`]) instead of cuBLAS's default.
//!
//! A [`LtPlan`] holds the descriptors of one problem (host objects only); [`BlasLt::matmul`]
//! launches on the handle's stream with the fixed workspace allocated in [`BlasLt::new`], so a
//! call allocates nothing on the device and can be captured into a CUDA graph.

use super::CudaError;
use super::blas::OutType;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaContext, CudaStream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Bytes of the fixed cuBLASLt workspace (as [`super::blas::BLAS_WORKSPACE_BYTES`]): split-K
/// candidates that need more are not offered by the heuristic.
pub const LT_WORKSPACE_BYTES: usize = 32 << 20;

fn lt_err(op: &'static str) -> impl Fn(result::CublasError) -> CudaError {
    move |e| CudaError::Blas {
        op,
        msg: format!("{e:?}"),
    }
}

/// A problem of [`BlasLt::matmul_config`]: `tokens` rows of x through an `out x inp` weight
/// into an output of `ty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Problem {
    pub out: usize,
    pub tokens: usize,
    pub inp: usize,
    pub ty: OutType,
}

/// A cuBLASLt handle bound to one stream, with its workspace.
pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    stream: sys::cudaStream_t,
    /// `cuMemAlloc` workspace of [`LT_WORKSPACE_BYTES`] (freed after the handle).
    workspace: u64,
    ctx: Arc<CudaContext>,
    /// [`BlasLt::matmul_config`]'s choices: the plan and the candidate with the asked
    /// configuration, or `None` where the heuristic offered none.
    picked: Mutex<HashMap<Problem, Option<(LtPlan, LtAlgo)>>>,
}

// SAFETY: as `Gpu` (which owns the plain cuBLAS handle): the handle is used only by the thread
// holding a reference to its owner, after binding the context.
unsafe impl Send for BlasLt {}

impl BlasLt {
    /// A handle for `stream` (whose context must be current) and its workspace; an error when
    /// libcublasLt cannot be loaded.
    pub fn new(stream: &CudaStream) -> Result<Self, CudaError> {
        // SAFETY: is_culib_present only tries to dlopen libcublasLt.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Blas {
                op: "load",
                msg: "libcublasLt not found".into(),
            });
        }
        let handle = result::create_handle().map_err(lt_err("cublasLtCreate"))?;
        // The value owns the handle from here on: its drop destroys it on any error below.
        let mut lt = Self {
            handle,
            stream: stream.cu_stream() as sys::cudaStream_t,
            workspace: 0,
            ctx: stream.context().clone(),
            picked: Mutex::new(HashMap::new()),
        };
        // SAFETY: the stream's context is current (the caller's contract); the size is non-zero.
        lt.workspace = unsafe { cudarc::driver::result::malloc_sync(LT_WORKSPACE_BYTES) }
            .map_err(super::drv("cuMemAlloc (cuBLASLt workspace)"))?;
        Ok(lt)
    }

    /// Up to `max` candidate algorithms for `plan`, the heuristic's order (its first is what it
    /// thinks fastest), each within the workspace. Host-only work (no launch): safe to call
    /// while a graph is being captured, and deterministic for a given problem and library.
    pub fn heuristics(&self, plan: &LtPlan, max: usize) -> Result<Vec<LtAlgo>, CudaError> {
        let pref = Pref::new()?;
        let ws = LT_WORKSPACE_BYTES as u64;
        // SAFETY: `pref.0` is live; the attribute is a u64 byte count.
        unsafe {
            result::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws) as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
        }
        .map_err(lt_err("cublasLtMatmulPreferenceSetAttribute"))?;
        let max = max.clamp(1, 64);
        let mut found = vec![
            sys::cublasLtMatmulHeuristicResult_t {
                algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
                workspaceSize: 0,
                state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
                wavesCount: 0.0,
                reserved: [0; 4],
            };
            max
        ];
        let mut n = 0i32;
        // SAFETY: every descriptor is live (owned by `plan` and `pref`); `found` has room for
        // `max` results and `n` receives how many were written.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref.0,
                max as i32,
                found.as_mut_ptr(),
                &mut n,
            )
        }
        .result()
        .map_err(|e| CudaError::Blas {
            op: "cublasLtMatmulAlgoGetHeuristic",
            msg: format!("{e:?} ({})", plan.dims()),
        })?;
        found.truncate(n.clamp(0, max as i32) as usize);
        Ok(found
            .into_iter()
            .filter(|r| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= LT_WORKSPACE_BYTES
            })
            .map(|r| LtAlgo {
                algo: r.algo,
                workspace: r.workspaceSize,
                waves: r.wavesCount,
            })
            .collect())
    }

    /// `y = beta * y + x W^T` for `plan`'s problem through `algo` (one of
    /// [`BlasLt::heuristics`]'s for this plan).
    ///
    /// # Safety
    /// `w`, `x` and `y` must be live device allocations of the handle's context with at least
    /// the sizes of [`super::blas::gemm`] for the plan's shape and output type.
    pub unsafe fn matmul(
        &self,
        plan: &LtPlan,
        algo: &LtAlgo,
        w: u64,
        x: u64,
        y: u64,
        beta: f32,
    ) -> Result<(), CudaError> {
        if plan.empty {
            return Ok(());
        }
        let alpha = 1.0f32;
        // SAFETY: per the function contract; the descriptors are live (owned by `plan`), alpha
        // and beta are host f32 scalars matching the f32 scale type, the workspace is ours and
        // `algo` asked for no more of it than LT_WORKSPACE_BYTES (filtered in `heuristics`).
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                w as *const c_void,
                plan.a,
                x as *const c_void,
                plan.b,
                y as *const c_void,
                plan.c,
                y as *mut c_void,
                plan.c,
                &algo.algo,
                self.workspace as *mut c_void,
                LT_WORKSPACE_BYTES,
                self.stream,
            )
        }
        .map_err(|e| CudaError::Blas {
            op: "cublasLtMatmul",
            msg: format!("{e:?} ({})", plan.dims()),
        })
    }
}

impl BlasLt {
    /// `y = beta * y + x W^T` (shapes and types as [`super::blas::gemm`]) through the heuristic
    /// candidate whose configuration is `want`. The candidate is looked up at the first call
    /// for the problem (the decode step's warm-up, before its graph is captured) and kept;
    /// host work only. Returns false, launching nothing, where the heuristic offers no such
    /// candidate (the caller runs `cublasGemmEx` instead).
    ///
    /// # Safety
    /// As [`BlasLt::matmul`].
    pub unsafe fn matmul_config(
        &self,
        p: Problem,
        want: &AlgoConfig,
        w: u64,
        x: u64,
        y: u64,
        beta: f32,
    ) -> Result<bool, CudaError> {
        let mut picked = self.picked.lock().unwrap_or_else(|e| e.into_inner());
        let chosen = picked.entry(p).or_insert_with(|| {
            let found = self.find(p, want);
            if let Err(e) = &found {
                tracing::warn!(problem = ?p, error = %e, "cuBLASLt lookup failed: cublasGemmEx instead");
            }
            found.ok().flatten()
        });
        let Some((plan, algo)) = chosen else {
            return Ok(false);
        };
        // SAFETY: per the function contract; `algo` is a candidate of this plan.
        unsafe { self.matmul(plan, algo, w, x, y, beta) }?;
        Ok(true)
    }

    /// Whether [`BlasLt::matmul_config`] found its candidate for a problem: `None` before its
    /// first call for it.
    pub fn found(&self, p: Problem) -> Option<bool> {
        let picked = self.picked.lock().unwrap_or_else(|e| e.into_inner());
        picked.get(&p).map(Option::is_some)
    }

    /// The plan of a problem and its heuristic candidate configured as `want`, if any.
    fn find(&self, p: Problem, want: &AlgoConfig) -> Result<Option<(LtPlan, LtAlgo)>, CudaError> {
        let plan = LtPlan::new(p.out, p.tokens, p.inp, p.ty)?;
        for algo in self.heuristics(&plan, HEURISTIC_CANDIDATES)? {
            if algo.config()? == *want {
                return Ok(Some((plan, algo)));
            }
        }
        Ok(None)
    }
}

/// Candidates [`BlasLt::matmul_config`] asks the heuristic for (it offered 8 at most for the
/// Llama-3.1-8B shapes on the H200).
pub const HEURISTIC_CANDIDATES: usize = 16;

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
        if self.workspace != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated with cuMemAlloc in `new` in this context, freed once, after the
            // handle that used it; the owning Gpu synchronizes its stream before dropping.
            let _ = unsafe { cudarc::driver::result::free_sync(self.workspace) };
        }
    }
}

/// One candidate algorithm of the heuristic.
#[derive(Debug, Clone, Copy)]
pub struct LtAlgo {
    pub algo: sys::cublasLtMatmulAlgo_t,
    /// Workspace bytes it uses.
    pub workspace: usize,
    /// The heuristic's estimate of how many waves of SMs its grid takes.
    pub waves: f32,
}

/// What an [`LtAlgo`] is (`cublasLtMatmulAlgoConfigGetAttribute`): the kernel family id, tile
/// shape id (`cublasLtMatmulTile_t`), split-K count (1: none), reduction scheme, CTA swizzle,
/// stages id, custom option, cluster shape id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AlgoConfig {
    pub id: u64,
    pub tile: u64,
    pub split_k: u64,
    pub reduction: u64,
    pub swizzle: u64,
    pub stages: u64,
    pub custom: u64,
    pub cluster: u64,
}

impl LtAlgo {
    /// The algorithm's configuration attributes.
    pub fn config(&self) -> Result<AlgoConfig, CudaError> {
        use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
        let get = |attr: A| -> Result<u64, CudaError> {
            let err = |e: result::CublasError| CudaError::Blas {
                op: "cublasLtMatmulAlgoConfigGetAttribute",
                msg: format!("{e:?} ({attr:?})"),
            };
            // `buf` empty: a size query, the library writes the attribute's byte size
            let query = |buf: &mut [u8], size: &mut usize| {
                let ptr = if buf.is_empty() {
                    std::ptr::null_mut()
                } else {
                    buf.as_mut_ptr() as *mut c_void
                };
                // SAFETY: `ptr` is null with a zero size, or has room for `buf.len()` bytes.
                unsafe {
                    sys::cublasLtMatmulAlgoConfigGetAttribute(
                        &self.algo,
                        attr,
                        ptr,
                        buf.len(),
                        size,
                    )
                }
                .result()
                .map_err(err)
            };
            let mut size = 0usize;
            query(&mut [], &mut size)?;
            let mut buf = [0u8; 8];
            if size == 0 || size > buf.len() {
                return Err(CudaError::Blas {
                    op: "cublasLtMatmulAlgoConfigGetAttribute",
                    msg: format!("{attr:?} is {size} bytes"),
                });
            }
            query(&mut buf[..size], &mut size)?;
            // little-endian integers of 2 or 4 bytes, all non-negative
            Ok(u64::from_le_bytes(buf))
        };
        Ok(AlgoConfig {
            id: get(A::CUBLASLT_ALGO_CONFIG_ID)?,
            tile: get(A::CUBLASLT_ALGO_CONFIG_TILE_ID)?,
            split_k: get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)?,
            reduction: get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)?,
            swizzle: get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)?,
            stages: get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID)?,
            custom: get(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)?,
            cluster: get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)?,
        })
    }
}

/// The descriptors of one problem: `tokens` rows of bf16 `x [tokens, inp]` through bf16
/// `w [out, inp]` into `y [tokens, out]` of `ty` (cuBLAS column-major: A = W as `inp x out`
/// transposed, B = X as `inp x tokens`, C = D = Y as `out x tokens`), f32 compute and scale.
pub struct LtPlan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    pub out: usize,
    pub tokens: usize,
    pub inp: usize,
    pub ty: OutType,
    /// A zero dimension: [`BlasLt::matmul`] does nothing.
    empty: bool,
}

// SAFETY: host-side descriptors, used by one thread at a time (the owner of the `&`).
unsafe impl Send for LtPlan {}

impl LtPlan {
    pub fn new(out: usize, tokens: usize, inp: usize, ty: OutType) -> Result<Self, CudaError> {
        let mut plan = Self {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            out,
            tokens,
            inp,
            ty,
            empty: out == 0 || tokens == 0 || inp == 0,
        };
        let (m, n, k) = (out.max(1) as u64, tokens.max(1) as u64, inp.max(1) as u64);
        let to_i64 = |v: u64| {
            i64::try_from(v).map_err(|_| CudaError::Shape {
                op: "cublasLt plan",
                reason: format!("dimension {v} exceeds i64"),
            })
        };
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let cty = match ty {
            OutType::Bf16 => bf16,
            OutType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        };
        // Each descriptor goes into `plan` as soon as it exists: its drop frees what was made.
        plan.desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(lt_err("cublasLtMatmulDescCreate"))?;
        plan.a = result::create_matrix_layout(bf16, k, m, to_i64(k)?)
            .map_err(lt_err("cublasLtMatrixLayoutCreate"))?;
        plan.b = result::create_matrix_layout(bf16, k, n, to_i64(k)?)
            .map_err(lt_err("cublasLtMatrixLayoutCreate"))?;
        plan.c = result::create_matrix_layout(cty, m, n, to_i64(m)?)
            .map_err(lt_err("cublasLtMatrixLayoutCreate"))?;
        let trans = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32;
        // SAFETY: `plan.desc` is live; TRANSA is a cublasOperation_t (i32).
        unsafe {
            result::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans) as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
        Ok(plan)
    }

    fn dims(&self) -> String {
        format!(
            "m={} n={} k={} {:?}",
            self.out, self.tokens, self.inp, self.ty
        )
    }
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created in `new` and is destroyed once.
        unsafe {
            for l in [self.a, self.b, self.c] {
                if !l.is_null() {
                    let _ = result::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = result::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A heuristic preference descriptor, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new() -> Result<Self, CudaError> {
        result::create_matmul_pref()
            .map(Self)
            .map_err(lt_err("cublasLtMatmulPreferenceCreate"))
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}
