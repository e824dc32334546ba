//! `y = x W^T` for the decode and prefill linear layers: cuBLAS, the CUDA-core GEMV kernels
//! (`gemv_t*`) or the tensor-core GEMV kernels (`gemv_mma_m*`, kernels/gemv.cu), chosen per call
//! by [`LinearImpl`]. Every path is capture-safe (no allocation, no host sync): decode steps
//! replay from CUDA graphs.

use super::super::CudaError;
use super::super::blas::OutType;
use super::super::device::{DevBuf, Gpu};
use super::{cfg, launched, need, shape, u32_of};

mod lt;
pub use lt::lt_pick;
mod stream;
pub use stream::*;

const BF16: usize = 2;
const F32: usize = 4;

/// Which implementation [`linear`] uses. The backend's choice is `engine.cuda.linear`
/// ([`crate::CudaOptions::linear`]: `table` is `Auto`, `mma` `GemvMma`, `gemv` `Gemv`,
/// `cublas` `Cublas`), applied per call through [`LinearImpl::for_call`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearImpl {
    /// Per (tokens, shape) what the H200 measurements say is fastest ([`table_launch`]: the
    /// L2-prefetch tensor-core GEMV or cuBLAS) where a GEMV applies (tokens <= 8, `inp % 8 ==
    /// 0`, 16-byte aligned operands), cuBLAS otherwise: a chosen cuBLASLt algorithm where
    /// [`lt_pick`] names one, else `cublasGemmEx`. Only `Auto` fuses ([`gate_up_swiglu`],
    /// [`linear_rmsnorm`]).
    Auto,
    /// cuBLAS `cublasGemmEx` (H200, Llama-3.1-8B shapes: 5.87 ms per batch-1 decode step).
    Cublas,
    /// CUDA-core GEMV, one warp per output row (the first kernel: 6.05 ms per batch-1 step).
    /// A call it cannot take is a shape error.
    Gemv,
    /// Tensor-core GEMV: mma.sync m16n8k16 over 16 or 32 weight rows per block, split-K over the
    /// block's warps with a fixed-order reduction (tokens <= 8), no L2 prefetch. A call it
    /// cannot take is a shape error.
    GemvMma,
}

impl LinearImpl {
    /// `auto` (or `table`), `cublas`, `gemv`, `mma` (the names of `engine.cuda.linear` and of
    /// the benchmarks).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "auto" | "table" => Self::Auto,
            "cublas" => Self::Cublas,
            "gemv" => Self::Gemv,
            "mma" | "gemv_mma" => Self::GemvMma,
            _ => return None,
        })
    }

    /// Every implementation other than `Auto`.
    pub const ALL: [LinearImpl; 3] = [Self::GemvMma, Self::Gemv, Self::Cublas];

    /// The implementation a backend whose choice is `self` runs for `tokens` rows of `x`
    /// through `w` (`inp` inputs): a GEMV choice where that GEMV can take the call, cuBLAS
    /// where it cannot (prefill steps, odd shapes); `Auto` and `Cublas` as they are.
    pub fn for_call(self, tokens: usize, inp: usize, w: &DevBuf, x: &DevBuf) -> LinearImpl {
        self.for_operands(tokens, inp, w.ptr(), x.ptr())
    }

    /// [`LinearImpl::for_call`] on device addresses.
    fn for_operands(self, tokens: usize, inp: usize, w: u64, x: u64) -> LinearImpl {
        match self {
            LinearImpl::Gemv | LinearImpl::GemvMma
                if !(tokens <= GEMV_MAX_TOKENS && aligned_operands(inp, w, x)) =>
            {
                LinearImpl::Cublas
            }
            how => how,
        }
    }
}

/// `Auto`'s measured choice for `tokens` rows through an `out x inp` weight: the tensor-core
/// GEMV launch to use, or `None` for cuBLAS. From the H200 linear-layer table (GPU run 3,
/// Llama-3.1-8B, us per call, weights streamed from HBM):
///
/// | layer (out x in) | t | mma | mma + L2 prefetch (pf) | cuBLAS |
/// |---|---|---|---|---|
/// | qkv 6144x4096 | 1, 2 | 16.9, 17.1 | **16.3, 16.5** | 19.0, 18.9 |
/// | qkv | 4, 8 | m2 18.2, 18.4; m1 **17.2, 17.4** | m2 17.4, 17.5 | 18.8, 18.5 |
/// | o 4096x4096 | 1..8 | 12.5 .. 12.9 | **12.1 .. 12.6** | 15.3 |
/// | gate_up 28672x4096 | 1, 2 | 62.4, 62.6 | 58.0, 58.1 | **57.0, 57.0** |
/// | gate_up | 4, 8 | 63.1 / 69.5, 64.3 / 70.8 | m2 64.1, 64.6 | **57.2, 57.7** |
/// | down 4096x14336 | 1..8 | 32.8 .. 34.2 | **31.2 .. 31.8** | 32.8 .. 33.3 |
/// | lm_head 128256x4096 | 1, 2 | 261.4, 264.0 | **237.9, 237.6** | 238.6, 239.8 |
/// | lm_head | 4, 8 | 271.8, 277.4 | m2 **239.6, 238.5** | 241.6, 244.1 |
///
/// So: the prefetching launch always; 16-row blocks (m1) except for vocabulary-sized outputs
/// (`out >= 12 inp`) past 2 tokens (m2); cuBLAS for the MLP up-projection class
/// (`3 inp <= out < 12 inp`, which also holds for its tensor-parallel shards), where no GEMV
/// launch reached it. At t <= 2 the decode step fuses gate_up with SwiGLU instead
/// ([`gate_up_swiglu`]), which saves more than the 1 us cuBLAS is ahead.
pub fn table_launch(sm_count: usize, out: usize, tokens: usize, inp: usize) -> Option<MmaLaunch> {
    if tokens == 0 || tokens > GEMV_MAX_TOKENS || (out >= 3 * inp && out < 12 * inp) {
        return None;
    }
    let tiles = if tokens > 2 && out >= 12 * inp { 2 } else { 1 };
    Some(MmaLaunch {
        l2_prefetch: true,
        ..mma_launch_tiles(sm_count, out, inp, tiles)
    })
}

/// Most token rows the GEMV kernels take.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Launch shape of a `gemv_mma` call: kernel, blocks, warps per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaLaunch {
    /// 16-row tiles per block (1: `gemv_mma_m1`, 2: `gemv_mma_m2`).
    pub tiles: usize,
    pub blocks: usize,
    pub warps: usize,
    /// Weight loads with a 256-byte L2 prefetch hint (`gemv_mma_m*_pf`).
    pub l2_prefetch: bool,
}

/// Chunks of 32 inputs each warp keeps in flight per iteration (the kernels' `U`).
const fn mma_unroll(tiles: usize) -> usize {
    if tiles == 1 { 4 } else { 2 }
}

/// Warps per SM the kernels can keep resident (80 registers per thread, as ptxas reports for
/// sm_90 with `__launch_bounds__(512, 1)`: 65536 / (80 * 32) = 25, in blocks of `warps`).
const RESIDENT_WARPS: usize = 24;

/// Picks the tile height and the split-K width: 32-row blocks (half the x re-reads) when there
/// are more than 2 tokens and enough of them to cover every SM, else 16-row blocks; then see
/// [`mma_launch_tiles`].
pub fn mma_launch(sm_count: usize, out: usize, tokens: usize, inp: usize) -> MmaLaunch {
    let tiles = if tokens > 2 && out.div_ceil(32) >= sm_count.max(1) {
        2
    } else {
        1
    };
    mma_launch_tiles(sm_count, out, inp, tiles)
}

/// The launch for a given tile height (1 or 2 tiles of 16 rows; anything else is taken as 2):
/// the widest block (16, 12, 8, 6 or 4 warps) whose grid fits in one resident wave, so every SM
/// has about 24 warps of loads in flight; never more warps than chunk batches along `inp`.
pub fn mma_launch_tiles(sm_count: usize, out: usize, inp: usize, tiles: usize) -> MmaLaunch {
    let sms = sm_count.max(1);
    let tiles = if tiles == 1 { 1 } else { 2 };
    let blocks = out.div_ceil(16 * tiles).max(1);
    let mut warps = 4;
    for w in [16usize, 12, 8, 6] {
        if blocks <= (RESIDENT_WARPS / w) * sms {
            warps = w;
            break;
        }
    }
    let batches = inp.div_ceil(32).div_ceil(mma_unroll(tiles)).max(1);
    MmaLaunch {
        tiles,
        blocks,
        warps: warps.min(batches),
        l2_prefetch: false,
    }
}

/// `y[t, o] = (accumulate ? y[t, o] : 0) + sum_i x[t, i] * w[o, i]`: w bf16 `[out, inp]`,
/// x bf16 `[tokens, inp]`, y `[tokens, out]` of `ty` (accumulation only for f32).
#[allow(clippy::too_many_arguments)]
pub fn linear(
    gpu: &Gpu,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
    how: LinearImpl,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    check_operands(OP, out, tokens, inp, w, x, y, ty, accumulate)?;
    if out * tokens * inp == 0 {
        return Ok(());
    }
    let gemv_ok = tokens <= GEMV_MAX_TOKENS && gemv_aligned(inp, w, x);
    let need_gemv = |what: &str| {
        shape(OP, gemv_ok, || {
            format!("{what} needs tokens <= 8, inp % 8 == 0, 16-byte aligned w and x")
        })
    };
    let sms = gpu.sm_count as usize;
    let kernel = match how {
        LinearImpl::Cublas => None,
        LinearImpl::Auto => match table_launch(sms, out, tokens, inp) {
            Some(l) if gemv_ok => {
                return gemv_mma(gpu, l, out, tokens, inp, w, x, y, ty, accumulate);
            }
            _ => None,
        },
        LinearImpl::Gemv => {
            need_gemv("gemv")?;
            Some(LinearImpl::Gemv)
        }
        LinearImpl::GemvMma => {
            need_gemv("gemv_mma")?;
            Some(LinearImpl::GemvMma)
        }
    };
    let Some(kernel) = kernel else {
        let beta = if accumulate { 1.0 } else { 0.0 };
        if how == LinearImpl::Auto
            && let Some(want) = lt_pick(out, tokens, inp, ty)
            && let Some(lt) = gpu.blas.lt()
        {
            let (w, x, y) = (w.ptr(), x.ptr(), y.ptr());
            let p = crate::blaslt::Problem {
                out,
                tokens,
                inp,
                ty,
            };
            // SAFETY: sizes checked above; the handle belongs to this GPU's context.
            if unsafe { lt.matmul_config(p, &want, w, x, y, beta) }? {
                return Ok(());
            }
        }
        // SAFETY: sizes checked above; the Blas handle belongs to this GPU's context.
        return unsafe {
            super::super::blas::gemm(
                &gpu.blas,
                out,
                tokens,
                inp,
                w.ptr(),
                x.ptr(),
                y.ptr(),
                ty,
                beta,
            )
        };
    };
    if kernel == LinearImpl::GemvMma {
        let l = mma_launch(sms, out, tokens, inp);
        return gemv_mma(gpu, l, out, tokens, inp, w, x, y, ty, accumulate);
    }
    let name = match tokens {
        1 => "gemv_t1",
        2 => "gemv_t2",
        3 | 4 => "gemv_t4",
        _ => "gemv_t8",
    };
    let blocks = out.div_ceil(8).min(gpu.sm_count as usize * 8) as u32;
    launch_gemv(
        gpu, name, blocks, 256, out, tokens, inp, w, x, y, ty, accumulate,
    )
}

/// [`linear`] through the tensor-core GEMV with an explicit launch shape (benchmarks compare
/// shapes with it). Checks what [`linear`] checks plus the launch: 1 or 2 tiles, 1..=16 warps,
/// enough blocks for every row.
#[allow(clippy::too_many_arguments)]
pub fn gemv_mma(
    gpu: &Gpu,
    l: MmaLaunch,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
) -> Result<(), CudaError> {
    const OP: &str = "gemv_mma";
    check_operands(OP, out, tokens, inp, w, x, y, ty, accumulate)?;
    shape(
        OP,
        tokens <= GEMV_MAX_TOKENS && gemv_aligned(inp, w, x),
        || "gemv_mma needs tokens <= 8, inp % 8 == 0, 16-byte aligned w and x".into(),
    )?;
    shape(
        OP,
        (1..=2).contains(&l.tiles) && (1..=16).contains(&l.warps) && l.blocks * 16 * l.tiles >= out,
        || format!("bad launch {l:?} for {out} rows"),
    )?;
    if out * tokens * inp == 0 {
        return Ok(());
    }
    let name = match (l.tiles, l.l2_prefetch) {
        (1, false) => "gemv_mma_m1",
        (1, true) => "gemv_mma_m1_pf",
        (_, false) => "gemv_mma_m2",
        (_, true) => "gemv_mma_m2_pf",
    };
    let grid = u32_of(OP, l.blocks)?;
    launch_gemv(
        gpu,
        name,
        grid,
        32 * l.warps as u32,
        out,
        tokens,
        inp,
        w,
        x,
        y,
        ty,
        accumulate,
    )
}

/// Most tokens at which the decode step fuses work into the tensor-core GEMV (under `Auto` and
/// the measured table): `engine.cuda.fuse_swiglu_max_tokens` / `fuse_norm_max_tokens`, each at
/// most [`GEMV_MAX_TOKENS`], 0 off. Passed to every call: no process-wide setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fusion {
    /// [`gate_up_swiglu`] fuses SwiGLU into the gate_up GEMV up to this many tokens. Default 8
    /// (`engine.cuda.fuse_swiglu_max_tokens`): at 1-2 tokens the fused launch streams gate_up
    /// as fast as cuBLAS (58.0 vs 57.0 us) and saves the swiglu launch; from 4 tokens cuBLAS
    /// alone is 6-7 us ahead of the GEMV on this shape, but in whole graph steps the fused
    /// launch still wins there (issue 20's sweep, H200: 4.528 vs 4.619 ms at 4 x 512, 4.631 vs
    /// 4.734 at 8 x 512, norm unfused): 8 is the faster config default.
    pub swiglu_max_tokens: usize,
    /// [`linear_rmsnorm`] fuses the next RMSNorm into the o/down GEMV up to this many tokens.
    /// Default 0 (off): with the norm unfused, decode steps of 1-2 rows take programmatic
    /// dependent launch, which is faster in whole graph steps (session 15, H200: 4.42 vs 4.73 ms
    /// at 1 x 512). The fused norm runs in one block after the GEMV (tokens one after the other),
    /// the separate kernel in a block a token, so alone it pays off at one token only: on the H200
    /// (session 3, `bench_decode_fusions`) o+norm 18.4 vs 19.5 us and down+norm 38.1 vs 38.9 us
    /// at 1 token, but 4 us slower at 2 tokens and 37 us slower at 8. (Session 2 shipped it off
    /// after its GPU test failed on 1-warp launches: the sum of squares strided by 256 threads
    /// on smaller blocks; fixed, and `linear_rmsnorm_fused_matches_unfused` passes on the H200
    /// since.)
    pub norm_max_tokens: usize,
    /// Warps per block of the fused gate_up + SwiGLU launch ([`glu_launch_warps`]); 0: the
    /// widest block whose grid fits one resident wave, as every 16-row launch (4 warps at
    /// Llama-3.1-8B's 1792 blocks: 2.26 waves, the last a quarter full). Default 8 (4.5 waves):
    /// issue 20's `bench_decode_step_variants` (H200, 2026-12-03, graph steps with the norm
    /// unfused) 4.499 / 4.603 / 4.947 ms at batch 1 ctx 512 / 2048 / 8192 and 4.508 at 2 x 512
    /// against 4.514 / 4.626 / 4.970 / 4.529 with 4 warps (rounds within 0.004 ms); 12 warps
    /// 4.508 / 4.616 / 4.959 / 4.525, 16 warps 0.09 ms slower. Not a config key (a launch
    /// shape): benchmarks compare values through `CudaBackend::set_fusion`.
    pub glu_warps: usize,
    /// Decode steps of at most this many rows launch our kernels with programmatic dependent
    /// launch where the GPU takes it (sm_90, driver 12.3+), also with `engine.cuda.pdl` off (on,
    /// every step does); one GPU only, and only steps of more than [`Fusion::norm_max_tokens`]
    /// rows (PDL with the norm fused into the o/down GEMV measured 5.688 ms at 1 x 2048 against
    /// 4.849 without PDL). Default 4: the same sweep with the norm unfused gave 4.428 / 4.561 /
    /// 4.938 ms at batch 1 ctx 512 / 2048 / 8192 and 4.446 at 2 x 512 with PDL against 4.514 /
    /// 4.626 / 4.970 / 4.529 without, but 4.917 vs 4.738 at 8 x 512; at 4 x 512 PDL was even
    /// (4.625 vs 4.622) with SwiGLU unfused there and wins since it is fused (`s8`: 4.487 vs
    /// 4.527 ms, two processes, rounds within 0.003 ms; 8 x 512 still loses, 4.96 vs 4.635).
    /// Not a config key (a launch choice by step size).
    pub pdl_max_tokens: usize,
    /// Decode steps of at most this many rows (at most [`STREAM_MAX_TOKENS`]) run their four
    /// linear layers through [`gemv_stream`] where the GPU has it (sm_90), one GPU only and
    /// under `Auto`: qkv and gate_up (with SwiGLU) compute their RMSNorm in the kernel (no norm
    /// launch, and [`Fusion::norm_max_tokens`] does not apply to those steps), o and down add
    /// into the residual. Default 1: issue 20's `bench_decode_step_variants` (H200, session 23,
    /// graph steps with small-step PDL) 4.345 / 4.496 / 4.862 ms at batch 1 ctx 512 / 2048 /
    /// 8192 against 4.418 / 4.541 / 4.916 without (rounds within 0.01 ms); at 2 rows it loses
    /// (5.60 against 4.44 ms: one warp a weight row is issue-bound past one token). Not a config
    /// key (a kernel choice by step size).
    pub stream_max_tokens: usize,
    /// Shared memory a [`gemv_stream`] block of the decode step may take, KiB (0: the most,
    /// [`STREAM_SMEM_MAX`]). Default 0: the more stages a block has in flight when it starts (its
    /// copies before the grid-dependency wait), the faster the step (session 23, 1 x 512: 4.345
    /// ms at the most, 4.403 at 150 KiB, 5.471 at 113 KiB, where two blocks could share an SM).
    /// Not a config key (a launch shape; benchmarks compare values through
    /// `CudaBackend::set_fusion`).
    pub stream_smem_kib: usize,
    /// Rows a [`gemv_stream`] producer of the decode step prefetches into L2 ahead of their
    /// copy, beyond its shared-memory ring (0: none). Not a config key (a launch knob).
    pub stream_l2_ahead: usize,
}

impl Fusion {
    /// The [`StreamTune`] of the decode step's streaming GEMVs.
    pub fn stream_tune(&self) -> StreamTune {
        StreamTune {
            smem_cap: self.stream_smem_kib << 10,
            l2_ahead: self.stream_l2_ahead,
        }
    }
}

impl Default for Fusion {
    fn default() -> Self {
        Self {
            swiglu_max_tokens: 8,
            norm_max_tokens: 0,
            glu_warps: 8,
            pdl_max_tokens: 4,
            stream_max_tokens: 1,
            stream_smem_kib: 0,
            stream_l2_ahead: 0,
        }
    }
}

impl Fusion {
    /// No fusion (the unfused step, for comparisons).
    pub const OFF: Fusion = Fusion {
        swiglu_max_tokens: 0,
        norm_max_tokens: 0,
        glu_warps: 0,
        pdl_max_tokens: 0,
        stream_max_tokens: 0,
        stream_smem_kib: 0,
        stream_l2_ahead: 0,
    };
}

/// Whether [`gate_up_swiglu`] takes the fused kernel for `tokens` rows with `how` (only `Auto`,
/// the measured table: `engine.cuda.linear = "mma"` is the previous step exactly).
pub fn swiglu_fused(how: LinearImpl, tokens: usize, fuse: Fusion) -> bool {
    how == LinearImpl::Auto && tokens >= 1 && tokens <= fuse.swiglu_max_tokens.min(GEMV_MAX_TOKENS)
}

/// The MLP input half: `act[t, i] = silu(g) * u` with `[g | u] = x[t] W_gate_up^T` (w bf16
/// `[2 inter, inp]`, gate rows first; x bf16 `[tokens, inp]`; act bf16 `[tokens, inter]`).
/// Fused into one tensor-core GEMV launch ([`gemv_mma_swiglu`]) where [`swiglu_fused`] says so
/// and the operands allow it, else [`linear`] into `gu` (bf16 `[tokens, 2 inter]`) and the
/// swiglu kernel, as before.
#[allow(clippy::too_many_arguments)]
pub fn gate_up_swiglu(
    gpu: &Gpu,
    inter: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    gu: &DevBuf,
    act: &DevBuf,
    how: LinearImpl,
    fuse: Fusion,
) -> Result<(), CudaError> {
    let aligned = gemv_aligned(inp, w, x);
    if swiglu_fused(how, tokens, fuse) && aligned {
        let l = glu_launch_warps(gpu.sm_count as usize, inter, inp, fuse.glu_warps);
        return gemv_mma_swiglu(gpu, l, inter, tokens, inp, w, x, act);
    }
    linear(
        gpu,
        2 * inter,
        tokens,
        inp,
        w,
        x,
        gu,
        OutType::Bf16,
        false,
        how,
    )?;
    super::swiglu(gpu, gu, act, tokens, inter)
}

/// The fused gate_up + SwiGLU launch: the 16-row (m1) launch the unfused GEMV would use on the
/// `2 inter x inp` weight (same blocks and warps, so the same sums), with the L2 prefetch.
pub fn glu_launch(sm_count: usize, inter: usize, inp: usize) -> MmaLaunch {
    MmaLaunch {
        l2_prefetch: true,
        ..mma_launch_tiles(sm_count, 2 * inter, inp, 1)
    }
}

/// [`glu_launch`] with `warps` warps a block (1..=16, at most one per chunk batch along `inp`);
/// 0 (or out of range) keeps [`glu_launch`]'s.
pub fn glu_launch_warps(sm_count: usize, inter: usize, inp: usize, warps: usize) -> MmaLaunch {
    let l = glu_launch(sm_count, inter, inp);
    let batches = inp.div_ceil(32).div_ceil(mma_unroll(1)).max(1);
    if (1..=16).contains(&warps) {
        MmaLaunch {
            warps: warps.min(batches),
            ..l
        }
    } else {
        l
    }
}

/// `act = silu(x W_gate^T) * (x W_up^T)` in one launch of `gemv_mma_glu_m1[_pf]` (see
/// [`gate_up_swiglu`] for the layouts); `l` must be a 16-row launch with a block per 8 outputs.
#[allow(clippy::too_many_arguments)]
pub fn gemv_mma_swiglu(
    gpu: &Gpu,
    l: MmaLaunch,
    inter: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    act: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "gemv_mma_swiglu";
    need(OP, "w", w, 2 * inter * inp * BF16)?;
    need(OP, "x", x, tokens * inp * BF16)?;
    need(OP, "act", act, tokens * inter * BF16)?;
    shape(
        OP,
        tokens <= GEMV_MAX_TOKENS && gemv_aligned(inp, w, x),
        || "gemv_mma_swiglu needs tokens <= 8, inp % 8 == 0, 16-byte aligned w and x".into(),
    )?;
    shape(
        OP,
        l.tiles == 1 && (1..=16).contains(&l.warps) && l.blocks * 8 >= inter,
        || format!("bad launch {l:?} for {inter} outputs (16-row blocks of 8 outputs)"),
    )?;
    if inter * tokens * inp == 0 {
        return Ok(());
    }
    let name = if l.l2_prefetch {
        "gemv_mma_glu_m1_pf"
    } else {
        "gemv_mma_glu_m1"
    };
    let f = gpu.kernel(name)?;
    let (t_i, o_i, i_i) = (tokens as i32, i32_of(OP, inter)?, i32_of(OP, inp)?);
    let mut b = gpu.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(x.ptr_ref())
        .arg(act.ptr_ref())
        .arg(&t_i)
        .arg(&o_i)
        .arg(&i_i);
    let (grid, block) = (u32_of(OP, l.blocks)?, 32 * l.warps as u32);
    // SAFETY: sizes and alignment checked above (w holds 2 inter rows); tokens <= 8.
    unsafe { b.launch(cfg((grid, 1, 1), block)) }.map_err(launched(OP))?;
    Ok(())
}

/// Where [`linear_rmsnorm`] puts the RMSNorm of the residual it just updated.
#[derive(Debug, Clone, Copy)]
pub struct NormFuse<'a> {
    /// f32 `[out]` norm weight.
    pub w: &'a DevBuf,
    /// bf16 `[tokens, out]`.
    pub out: &'a DevBuf,
    /// A device u32 that is 0 (the kernel leaves it 0): the blocks' finishing counter.
    pub ticket: &'a DevBuf,
    pub eps: f32,
}

/// The launch [`linear_rmsnorm`] fuses with (`None`: it does not): Auto under the measured
/// table, a 16-row tensor-core launch (at most 12 warps, the norm kernels' bound), `1..=`
/// [`Fusion::norm_max_tokens`] tokens, aligned operands.
#[allow(clippy::too_many_arguments)]
pub fn norm_fuse_launch(
    sm_count: usize,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    how: LinearImpl,
    fuse: Fusion,
) -> Option<MmaLaunch> {
    let ok = how == LinearImpl::Auto
        && tokens >= 1
        && tokens <= fuse.norm_max_tokens.min(GEMV_MAX_TOKENS)
        && out > 0
        && inp > 0
        && gemv_aligned(inp, w, x);
    let l = table_launch(sm_count, out, tokens, inp).filter(|l| ok && l.tiles == 1)?;
    Some(MmaLaunch {
        warps: l.warps.min(NORM_MAX_WARPS),
        ..l
    })
}

/// Most warps a block of the `gemv_mma_m1*_norm` kernels (`__launch_bounds__(384, 2)`).
pub const NORM_MAX_WARPS: usize = 12;

/// [`linear`] into the f32 residual `y` (`[tokens, out]`, `accumulate` as there) and, where
/// [`norm_fuse_launch`] allows and `norm` is given, `norm.out[t] = rmsnorm(y[t]) * norm.w` in
/// the same launch ([`gemv_mma_norm`]). Returns whether `norm.out` was written (else the caller
/// runs `add_rmsnorm` as before).
#[allow(clippy::too_many_arguments)]
pub fn linear_rmsnorm(
    gpu: &Gpu,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    accumulate: bool,
    how: LinearImpl,
    fuse: Fusion,
    norm: Option<&NormFuse<'_>>,
) -> Result<bool, CudaError> {
    let sms = gpu.sm_count as usize;
    if let Some(n) = norm
        && let Some(l) = norm_fuse_launch(sms, out, tokens, inp, w, x, how, fuse)
    {
        gemv_mma_norm(gpu, l, out, tokens, inp, w, x, y, accumulate, n)?;
        return Ok(true);
    }
    linear(
        gpu,
        out,
        tokens,
        inp,
        w,
        x,
        y,
        OutType::F32,
        accumulate,
        how,
    )?;
    Ok(false)
}

/// `y (+)= x W^T` (f32 y) then `norm.out = rmsnorm(y) * norm.w` in one launch of
/// `gemv_mma_m1[_pf]_norm`: the last block to finish normalizes every token row (as
/// `add_rmsnorm` does, same sums) and resets the ticket. `l`: 16-row, 1..=12 warps.
#[allow(clippy::too_many_arguments)]
pub fn gemv_mma_norm(
    gpu: &Gpu,
    l: MmaLaunch,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    accumulate: bool,
    norm: &NormFuse<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "gemv_mma_norm";
    need(OP, "w", w, out * inp * BF16)?;
    need(OP, "x", x, tokens * inp * BF16)?;
    need(OP, "y", y, tokens * out * F32)?;
    need(OP, "norm.w", norm.w, out * F32)?;
    need(OP, "norm.out", norm.out, tokens * out * BF16)?;
    need(OP, "ticket", norm.ticket, 4)?;
    shape(
        OP,
        (1..=GEMV_MAX_TOKENS).contains(&tokens)
            && out > 0
            && inp > 0
            && gemv_aligned(inp, w, x)
            && norm.ticket.ptr().is_multiple_of(4),
        || "gemv_mma_norm needs 1..=8 tokens, inp % 8 == 0 (> 0), 16-byte aligned w and x".into(),
    )?;
    shape(
        OP,
        l.tiles == 1 && (1..=NORM_MAX_WARPS).contains(&l.warps) && l.blocks * 16 >= out,
        || format!("bad launch {l:?} for {out} rows (16-row blocks, <= 12 warps)"),
    )?;
    let name = if l.l2_prefetch {
        "gemv_mma_m1_pf_norm"
    } else {
        "gemv_mma_m1_norm"
    };
    let f = gpu.kernel(name)?;
    let (t_i, o_i, i_i, acc) = (
        tokens as i32,
        i32_of(OP, out)?,
        i32_of(OP, inp)?,
        accumulate as i32,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(x.ptr_ref())
        .arg(y.ptr_ref())
        .arg(&t_i)
        .arg(&o_i)
        .arg(&i_i)
        .arg(&acc)
        .arg(norm.w.ptr_ref())
        .arg(norm.out.ptr_ref())
        .arg(norm.ticket.ptr_ref())
        .arg(&norm.eps);
    let (grid, block) = (u32_of(OP, l.blocks)?, 32 * l.warps as u32);
    // SAFETY: sizes and alignment checked above; the ticket is a zeroed u32 that only these
    // kernels touch (stream-ordered, so one launch at a time), left zeroed by the last block.
    unsafe { b.launch(cfg((grid, 1, 1), block)) }.map_err(launched(OP))?;
    Ok(())
}

/// What every GEMV kernel needs of its operands: `inp` a multiple of 8, 16-byte aligned w and x.
fn gemv_aligned(inp: usize, w: &DevBuf, x: &DevBuf) -> bool {
    aligned_operands(inp, w.ptr(), x.ptr())
}

fn aligned_operands(inp: usize, w: u64, x: u64) -> bool {
    inp.is_multiple_of(8) && w.is_multiple_of(16) && x.is_multiple_of(16)
}

/// The operand checks of [`linear`] and [`gemv_mma`]: w bf16 `[out, inp]`, x bf16
/// `[tokens, inp]`, y `[tokens, out]` of `ty`; accumulation only into f32.
#[allow(clippy::too_many_arguments)]
fn check_operands(
    op: &'static str,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
) -> Result<(), CudaError> {
    let ysz = if ty == OutType::F32 { F32 } else { BF16 };
    need(op, "w", w, out * inp * BF16)?;
    need(op, "x", x, tokens * inp * BF16)?;
    need(op, "y", y, tokens * out * ysz)?;
    shape(op, !(accumulate && ty == OutType::Bf16), || {
        "accumulation needs an f32 output".into()
    })
}

fn i32_of(op: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        reason: format!("{v} exceeds i32"),
    })
}

/// Launches one of the GEMV kernels (all share one signature); the caller checked the shapes.
#[allow(clippy::too_many_arguments)]
fn launch_gemv(
    gpu: &Gpu,
    name: &'static str,
    grid: u32,
    block: u32,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    let f = gpu.kernel(name)?;
    let (t_i, o_i, i_i, yf, acc) = (
        tokens as i32,
        i32::try_from(out).map_err(|_| CudaError::Shape {
            op: OP,
            reason: format!("out {out} exceeds i32"),
        })?,
        i32::try_from(inp).map_err(|_| CudaError::Shape {
            op: OP,
            reason: format!("inp {inp} exceeds i32"),
        })?,
        (ty == OutType::F32) as i32,
        accumulate as i32,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(x.ptr_ref())
        .arg(y.ptr_ref())
        .arg(&t_i)
        .arg(&o_i)
        .arg(&i_i)
        .arg(&yf)
        .arg(&acc);
    // SAFETY: sizes and alignment checked above; tokens <= 8 as both kernels assume.
    unsafe { b.launch(cfg((grid, 1, 1), block)) }.map_err(launched(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests;
