//! The decode GEMM for 9-64 token rows (`gemm_skinny_n16`, `_n32`, `_n64`, kernels/gemm_skinny.cu,
//! in the Hopper-only program): weights and x by TMA into a ring of shared-memory stages, wgmma
//! m64nNk16 products, the (row tile, k-chunk) iterations split evenly over one CTA an SM
//! (stream-K), split tiles added up in CTA order by the last of their CTAs (deterministic). Where
//! cuBLAS streams the small decode linears at 0.53-0.68 of the copy rate at 16-64 rows and the
//! register-fed tensor-core GEMV re-reads x from L2 once a block (issue 20, session 26).

use super::super::super::CudaError;
use super::super::super::blas::OutType;
use super::super::super::device::{DevBuf, Gpu};
use super::super::super::prefill::bf16_tensor_map;
use super::super::{cfg, launched, shape};
use super::{BF16, F32, STREAM_SMEM_MAX, check_operands, i32_of};

/// Most token rows [`gemm_skinny`] takes (`gemm_skinny_n64`).
pub const SKINNY_MAX_TOKENS: usize = 64;

/// The kernel's fixed parts (gemm_skinny.cu): weight rows a tile, inputs a k-chunk, threads (two
/// consumer warpgroups and a producer warp), most stages, the head of its shared memory, and the
/// 1024 bytes `wg_smem_aligned` may skip.
const BM: usize = 128;
const BK: usize = 64;
const THREADS: u32 = 288;
const CONSUMER_THREADS: usize = 256;
const MAX_STAGES: usize = 16;
const HEAD: usize = 1024;
const ALIGN_PAD: usize = 1024;

/// Most row tiles (128 rows each) a [`SkinnyScratch`] has tickets for: outputs up to 524288 rows.
const MAX_TILES: usize = 4096;

/// What one [`gemm_skinny`] call needs besides its operands: the split tiles' partial sums (f32
/// `[2 CTAs][8][256][4]` at most) and a ticket a row tile (u32, 0 between calls: each call leaves them so).
/// One call at a time may use it (its CTAs write it only while they run): calls on one stream.
pub struct SkinnyScratch {
    part: DevBuf,
    tickets: DevBuf,
    ctas: usize,
}

impl SkinnyScratch {
    /// Room for launches of up to `sm_count` CTAs (one an SM) and [`MAX_TILES`] row tiles, the
    /// tickets zeroed (ordered on the GPU's stream before any launch that uses them).
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let ctas = (gpu.sm_count as usize).max(1);
        let part = gpu.alloc(2 * ctas * CONSUMER_THREADS * (SKINNY_MAX_TOKENS / 2) * F32)?;
        let tickets = gpu.alloc(MAX_TILES * 4)?;
        gpu.memset(&tickets, 0)?;
        Ok(Self {
            part,
            tickets,
            ctas,
        })
    }
}

/// Launch knobs of [`gemm_skinny`] (benchmarks compare them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyTune {
    /// Most stages of the ring (0: as many as fit in [`STREAM_SMEM_MAX`]).
    pub stages: usize,
    /// 64-input boxes a stage (1, 2 or 4): each weight row read 128 `kboxes` bytes at a time.
    pub kboxes: usize,
    /// Weight tiles fetched into L2 256 bytes at a time (else 128).
    pub l2_256: bool,
}

impl Default for SkinnyTune {
    fn default() -> Self {
        Self {
            stages: 0,
            kboxes: 1,
            l2_256: false,
        }
    }
}

/// Launch shape of one [`gemm_skinny`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyPlan {
    /// `gemm_skinny_n16`, `_n32` or `_n64` (token columns of the wgmma: 16, 32, 64).
    pub kernel: &'static str,
    /// Token columns the kernel multiplies (rows past `tokens` are zeros).
    pub cols: usize,
    /// CTAs: one an SM, at most one an iteration.
    pub ctas: usize,
    /// Stages of the ring.
    pub stages: usize,
    /// 64-input boxes a stage.
    pub kboxes: usize,
    /// Dynamic shared memory, bytes.
    pub smem: usize,
}

/// The launch for `out` rows of `inp` inputs at `tokens` rows on `sm_count` SMs under `tune`,
/// or `None` where the kernel cannot take it (0 or more than [`SKINNY_MAX_TOKENS`] tokens, `inp %
/// 8 != 0`, no rows, more than [`MAX_TILES`] row tiles, `kboxes` not 1, 2 or 4, no stage fits).
pub fn skinny_plan(
    sm_count: usize,
    out: usize,
    tokens: usize,
    inp: usize,
    tune: SkinnyTune,
) -> Option<SkinnyPlan> {
    let kb = tune.kboxes;
    if out == 0
        || inp == 0
        || !inp.is_multiple_of(8)
        || !(1..=SKINNY_MAX_TOKENS).contains(&tokens)
        || out.div_ceil(BM) > MAX_TILES
        || ![1, 2, 4].contains(&kb)
    {
        return None;
    }
    let (kernel, cols) = match tokens {
        0..=16 => ("gemm_skinny_n16", 16),
        17..=32 => ("gemm_skinny_n32", 32),
        _ => ("gemm_skinny_n64", 64),
    };
    let stage = kb * (BM * BK * BF16 + cols * BK * BF16);
    let fit = ((STREAM_SMEM_MAX - ALIGN_PAD - HEAD) / stage).min(MAX_STAGES);
    let stages = if tune.stages == 0 {
        fit
    } else {
        tune.stages.min(fit)
    };
    let iters = out.div_ceil(BM) * inp.div_ceil(BK * kb);
    (stages >= 1).then_some(SkinnyPlan {
        kernel,
        cols,
        ctas: sm_count.max(1).min(iters),
        stages,
        kboxes: kb,
        smem: ALIGN_PAD + HEAD + stages * stage,
    })
}

/// Whether this GPU has [`gemm_skinny`] (the Hopper-only program loaded).
pub fn skinny_available(gpu: &Gpu) -> bool {
    gpu.has_kernel("gemm_skinny_n16")
}

/// `y[t, o] = (accumulate ? y[t, o] : 0) + sum_i x[t, i] * w[o, i]` through `gemm_skinny_n*`: w
/// bf16 `[out, inp]`, x bf16 `[tokens, inp]` (both 16-byte aligned, `inp % 8 == 0`), y `[tokens,
/// out]` of `ty` (accumulation only into f32); the launch of [`skinny_plan`] under `tune`.
/// Deterministic: the same inputs and launch give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn gemm_skinny(
    gpu: &Gpu,
    scratch: &SkinnyScratch,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
    tune: SkinnyTune,
) -> Result<(), CudaError> {
    const OP: &str = "gemm_skinny";
    check_operands(OP, out, tokens, inp, w, x, y, ty, accumulate)?;
    shape(
        OP,
        inp.is_multiple_of(8) && w.ptr().is_multiple_of(16) && x.ptr().is_multiple_of(16),
        || "gemm_skinny needs inp % 8 == 0 and 16-byte aligned w and x".into(),
    )?;
    if out * tokens * inp == 0 {
        return Ok(());
    }
    let plan = skinny_plan(gpu.sm_count as usize, out, tokens, inp, tune);
    let Some(plan) = plan.filter(|p| p.ctas <= scratch.ctas) else {
        return Err(CudaError::Shape {
            op: OP,
            reason: format!(
                "no launch for {out} rows of {inp} inputs at {tokens} tokens under {tune:?} \
                 (1..={SKINNY_MAX_TOKENS} tokens, at most {} rows, 1, 2 or 4 boxes a stage)",
                MAX_TILES * BM
            ),
        });
    };
    if !skinny_available(gpu) {
        return Err(CudaError::Unsupported {
            reason: "gemm_skinny needs the sm_90 program (compute capability 9.0)".into(),
        });
    }
    let (inp64, rows, t64) = (inp as u64, out as u64, tokens as u64);
    let wmap = bf16_tensor_map(
        w.ptr(),
        [inp64, rows, 1, 1, 1],
        [
            inp64 * 2,
            inp64 * 2 * rows,
            inp64 * 2 * rows,
            inp64 * 2 * rows,
        ],
        [BK as u32, BM as u32, 1, 1, 1],
        tune.l2_256,
    )?;
    let xmap = bf16_tensor_map(
        x.ptr(),
        [inp64, t64, 1, 1, 1],
        [inp64 * 2, inp64 * 2 * t64, inp64 * 2 * t64, inp64 * 2 * t64],
        [BK as u32, plan.cols as u32, 1, 1, 1],
        false,
    )?;
    let mode: i32 = match (ty, accumulate) {
        (OutType::Bf16, _) => 0,
        (OutType::F32, false) => 1,
        (OutType::F32, true) => 2,
    };
    // its shared-memory limit (STREAM_SMEM_MAX >= plan.smem) was set when it was loaded
    let f = gpu.kernel(plan.kernel)?;
    let (t_i, o_i, i_i, st, kb) = (
        tokens as i32,
        i32_of(OP, out)?,
        i32_of(OP, inp)?,
        plan.stages as i32,
        plan.kboxes as i32,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(&wmap)
        .arg(&xmap)
        .arg(y.ptr_ref())
        .arg(scratch.part.ptr_ref())
        .arg(scratch.tickets.ptr_ref())
        .arg(&t_i)
        .arg(&o_i)
        .arg(&i_i)
        .arg(&mode)
        .arg(&st)
        .arg(&kb);
    let mut c = cfg((plan.ctas as u32, 1, 1), THREADS);
    c.shared_mem_bytes = plan.smem as u32;
    // SAFETY: operands checked above (sizes, alignment, inp % 8 for the tensor maps' strides);
    // the plan keeps the launch within the kernel's contract (tokens <= its columns, CTAs <=
    // iterations and <= the scratch's, stages fitting the shared memory asked for, tiles <= the
    // tickets).
    unsafe { b.launch(c) }.map_err(launched(OP))?;
    Ok(())
}
