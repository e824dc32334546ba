//! The decode GEMV that streams its weights through shared memory (`gemv_stream_t*`,
//! kernels/gemv_stream.cu, in the Hopper-only program): one block an SM over a contiguous range
//! of weight rows, bulk copies into a ring of stages issued before the kernel waits on the
//! previous one (under programmatic dependent launch the weights stream while that kernel
//! drains), and optionally the RMSNorm of its input computed in the block (add_rmsnorm_v4's
//! arithmetic), so the decode step needs no norm launch before qkv and gate_up.

use super::super::super::CudaError;
use super::super::super::device::{DevBuf, Gpu};
use super::super::{cfg, launched, need, rmsnorm_vector_block, shape, u32_of};
use super::{BF16, F32, i32_of};

/// Most token rows [`gemv_stream`] takes (the `gemv_stream_t4` kernel).
pub const STREAM_MAX_TOKENS: usize = 4;

/// Dynamic shared memory a block may ask for on sm_90 (227 KiB, the opt-in maximum).
pub const STREAM_SMEM_MAX: usize = 232_448;

/// The kernel's fixed parts (gemv_stream.cu): consumer warps, threads, most stages, the head of
/// its shared memory (barriers, norm partials), and the 1024 bytes `wg_smem_aligned` may skip.
const CONSUMERS: usize = 8;
const THREADS: u32 = 32 * CONSUMERS as u32 + 32;
const MAX_STAGES: usize = 32;
const HEAD: usize = 1024;
const ALIGN_PAD: usize = 1024;
/// Most threads of the in-kernel norm (the consumer warps): rows up to 8192 wide.
const NORM_MAX_THREADS: u32 = 256;

/// What [`gemv_stream`] writes: `y[t, u]` for the `units` rows of w.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOut {
    /// bf16 `y = x W^T` (qkv).
    Bf16,
    /// f32 `y = x W^T`.
    F32,
    /// f32 `y += x W^T` (o and down into the residual).
    F32Acc,
    /// bf16 `y = silu(g) * u` with `[g | u] = x W^T`, w `[2 units, inp]` gate rows first (the
    /// MLP's gate_up with SwiGLU; g and u rounded to bf16 first, as the unfused output is).
    Glu,
}

impl StreamOut {
    fn mode(self) -> i32 {
        match self {
            StreamOut::Bf16 => 0,
            StreamOut::F32 => 1,
            StreamOut::F32Acc => 2,
            StreamOut::Glu => 3,
        }
    }

    fn y_bytes(self) -> usize {
        match self {
            StreamOut::Bf16 | StreamOut::Glu => BF16,
            StreamOut::F32 | StreamOut::F32Acc => F32,
        }
    }
}

/// The input of [`gemv_stream`].
#[derive(Debug, Clone, Copy)]
pub enum StreamX<'a> {
    /// bf16 `[tokens, inp]`, 16-byte aligned.
    Bf16(&'a DevBuf),
    /// `x[t] = bf16(rmsnorm(resid[t]) * w)`: f32 residual `[tokens, inp]` and f32 norm weight
    /// `[inp]` (both 16-byte aligned), computed in every block exactly as `add_rmsnorm_v4` does.
    Norm {
        resid: &'a DevBuf,
        w: &'a DevBuf,
        eps: f32,
    },
}

/// Launch knobs of [`gemv_stream`] (benchmarks compare them; the decode step takes them from
/// [`super::Fusion`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamTune {
    /// Shared memory a block may take, bytes (0: [`STREAM_SMEM_MAX`]); see [`stream_plan`].
    pub smem_cap: usize,
    /// Units (rows; `Glu`: row pairs) the producer prefetches into L2 ahead of their copy, beyond
    /// the ring (0: none).
    pub l2_ahead: usize,
}

/// Launch shape of one [`gemv_stream`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPlan {
    /// `gemv_stream_t1`, `_t2` or `_t4`.
    pub kernel: &'static str,
    /// Blocks: one an SM, at most one a unit.
    pub blocks: usize,
    /// Stages of the ring: a multiple of 8 from 8 on (one consumer warp a stage).
    pub stages: usize,
    /// Dynamic shared memory, bytes.
    pub smem: usize,
}

/// The launch for `units` outputs (`Glu`: gate/up row pairs) of `inp` inputs at `tokens` rows on
/// `sm_count` SMs within `smem_cap` bytes of shared memory a block (0: [`STREAM_SMEM_MAX`]; a
/// smaller cap leaves room for the next kernel's block on the same SM, which under programmatic
/// dependent launch then starts its copies while this one streams), or `None` where the kernel
/// cannot take it (0 or more than [`STREAM_MAX_TOKENS`] tokens, `inp % 8 != 0`, fewer than 2
/// stages of a unit fit beside x where a block has more than one unit).
pub fn stream_plan(
    sm_count: usize,
    units: usize,
    tokens: usize,
    inp: usize,
    out: StreamOut,
    smem_cap: usize,
) -> Option<StreamPlan> {
    if units == 0
        || inp == 0
        || !inp.is_multiple_of(8)
        || !(1..=STREAM_MAX_TOKENS).contains(&tokens)
    {
        return None;
    }
    let kernel = match tokens {
        1 => "gemv_stream_t1",
        2 => "gemv_stream_t2",
        _ => "gemv_stream_t4",
    };
    let unit = inp * BF16 * if out == StreamOut::Glu { 2 } else { 1 };
    let blocks = sm_count.max(1).min(units);
    let per_block = units.div_ceil(blocks);
    // x (bf16); the accumulated y values of a block (F32Acc)
    let xbytes = (tokens * inp * BF16).next_multiple_of(128);
    let ybytes = if out == StreamOut::F32Acc {
        (tokens * per_block * F32).next_multiple_of(128)
    } else {
        0
    };
    let fixed = ALIGN_PAD + HEAD + xbytes + ybytes;
    let cap = if smem_cap == 0 {
        STREAM_SMEM_MAX
    } else {
        smem_cap.min(STREAM_SMEM_MAX)
    };
    let fit = cap.checked_sub(fixed)? / unit;
    let mut stages = fit.min(MAX_STAGES).min(per_block);
    if stages >= CONSUMERS {
        stages -= stages % CONSUMERS;
    }
    // a block of one unit needs one stage; else at least two, or nothing overlaps
    (stages >= 2 || (stages == 1 && per_block == 1)).then_some(StreamPlan {
        kernel,
        blocks,
        stages,
        smem: fixed + stages * unit,
    })
}

/// Whether this GPU has the streaming GEMV (the Hopper-only program loaded).
pub fn stream_available(gpu: &Gpu) -> bool {
    gpu.has_kernel("gemv_stream_t1")
}

/// `y (+)= f(x W^T)` through `gemv_stream_t*` (see [`StreamOut`], [`StreamX`]): w bf16
/// `[units, inp]` (`Glu`: `[2 units, inp]`), 16-byte aligned; y `[tokens, units]`; the launch
/// of [`stream_plan`] under `tune`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_stream(
    gpu: &Gpu,
    units: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: StreamX<'_>,
    y: &DevBuf,
    out: StreamOut,
    tune: StreamTune,
) -> Result<(), CudaError> {
    const OP: &str = "gemv_stream";
    let rows = if out == StreamOut::Glu {
        2 * units
    } else {
        units
    };
    need(OP, "w", w, rows * inp * BF16)?;
    need(OP, "y", y, tokens * units * out.y_bytes())?;
    let (xp, resid, nw, eps, norm_threads) = match x {
        StreamX::Bf16(x) => {
            need(OP, "x", x, tokens * inp * BF16)?;
            shape(OP, x.ptr().is_multiple_of(16), || {
                "x not 16-byte aligned".into()
            })?;
            (x.ptr(), 0u64, 0u64, 0f32, 0u32)
        }
        StreamX::Norm { resid, w: nw, eps } => {
            need(OP, "resid", resid, tokens * inp * F32)?;
            need(OP, "norm w", nw, inp * F32)?;
            // add_rmsnorm_v4's block for this width (its alignment rules: 16-byte f32 rows)
            let block = rmsnorm_vector_block(inp, &[resid.ptr(), nw.ptr()], 0)
                .filter(|b| *b <= NORM_MAX_THREADS);
            let Some(block) = block else {
                return Err(CudaError::Shape {
                    op: OP,
                    reason: format!(
                        "the in-kernel RMSNorm needs inp % 4 == 0 and <= 8192, 16-byte aligned \
                         f32 rows (inp {inp})"
                    ),
                });
            };
            (0, resid.ptr(), nw.ptr(), eps, block)
        }
    };
    shape(OP, w.ptr().is_multiple_of(16), || {
        "w not 16-byte aligned".into()
    })?;
    let plan = stream_plan(
        gpu.sm_count as usize,
        units,
        tokens,
        inp,
        out,
        tune.smem_cap,
    );
    let Some(plan) = plan else {
        return Err(CudaError::Shape {
            op: OP,
            reason: format!(
                "no launch for {units} units of {inp} inputs at {tokens} tokens \
                 (1..={STREAM_MAX_TOKENS} tokens, inp % 8 == 0, 2 stages in shared memory)"
            ),
        });
    };
    if !stream_available(gpu) {
        return Err(CudaError::Unsupported {
            reason: "gemv_stream needs the sm_90 program (compute capability 9.0)".into(),
        });
    }
    // its shared-memory limit (STREAM_SMEM_MAX >= plan.smem) was set when it was loaded
    let f = gpu.kernel(plan.kernel)?;
    let (t_i, u_i, i_i) = (tokens as i32, i32_of(OP, units)?, i32_of(OP, inp)?);
    let (mode, stages, nt) = (out.mode(), plan.stages as i32, norm_threads as i32);
    let ahead = i32_of(OP, tune.l2_ahead)?;
    let mut b = gpu.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(&xp)
        .arg(&resid)
        .arg(&nw)
        .arg(&eps)
        .arg(&nt)
        .arg(y.ptr_ref())
        .arg(&t_i)
        .arg(&u_i)
        .arg(&i_i)
        .arg(&mode)
        .arg(&stages)
        .arg(&ahead);
    let mut c = cfg((u32_of(OP, plan.blocks)?, 1, 1), THREADS);
    c.shared_mem_bytes = plan.smem as u32;
    // SAFETY: sizes and alignment checked above; the plan keeps the launch within the kernel's
    // contract (tokens <= its MT, stages fitting the shared memory asked for, blocks <= units).
    unsafe { b.launch(c) }.map_err(launched(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_fit_shared_memory_and_give_each_stage_one_consumer() {
        // Llama-3.1-8B's decode GEMVs on the H200's 132 SMs
        let qkv = stream_plan(132, 6144, 1, 4096, StreamOut::Bf16, 0).unwrap();
        assert_eq!(
            (qkv.kernel, qkv.blocks, qkv.stages),
            ("gemv_stream_t1", 132, 24)
        );
        let gu = stream_plan(132, 14336, 1, 4096, StreamOut::Glu, 0).unwrap();
        assert_eq!((gu.blocks, gu.stages), (132, 8));
        let down = stream_plan(132, 4096, 1, 14336, StreamOut::F32Acc, 0).unwrap();
        assert_eq!(down.stages, 7);
        let down = stream_plan(132, 4096, 4, 14336, StreamOut::F32Acc, 0).unwrap();
        assert_eq!((down.kernel, down.stages), ("gemv_stream_t4", 4));
        // half the shared memory: two blocks an SM
        let qkv = stream_plan(132, 6144, 1, 4096, StreamOut::Bf16, 113 << 10).unwrap();
        assert_eq!(qkv.stages, 8);
        assert!(2 * qkv.smem <= STREAM_SMEM_MAX, "{qkv:?}");
        let down = stream_plan(132, 4096, 1, 14336, StreamOut::F32Acc, 113 << 10).unwrap();
        assert!(
            down.stages == 2 && 2 * down.smem <= STREAM_SMEM_MAX,
            "{down:?}"
        );
        for t in 1..=STREAM_MAX_TOKENS {
            for (units, inp, out) in [
                (6144, 4096, StreamOut::Bf16),
                (4096, 4096, StreamOut::F32Acc),
                (14336, 4096, StreamOut::Glu),
                (4096, 14336, StreamOut::F32Acc),
                (7, 64, StreamOut::F32),
            ] {
                let p = stream_plan(132, units, t, inp, out, 0).unwrap();
                assert!(p.smem <= STREAM_SMEM_MAX, "{units}x{inp} t{t}: {p:?}");
                assert!(p.stages >= 2.min(units.div_ceil(p.blocks)), "{p:?}");
                assert!(p.stages <= MAX_STAGES, "{p:?}");
                assert!(
                    p.stages < CONSUMERS || p.stages.is_multiple_of(CONSUMERS),
                    "{p:?}"
                );
                assert!(p.blocks <= units && p.blocks <= 132, "{p:?}");
            }
        }
        assert_eq!(
            stream_plan(132, 4096, 5, 4096, StreamOut::Bf16, 0),
            None,
            "tokens"
        );
        assert_eq!(
            stream_plan(132, 4096, 1, 4100, StreamOut::Bf16, 0),
            None,
            "inp % 8"
        );
        assert_eq!(stream_plan(132, 0, 1, 4096, StreamOut::Bf16, 0), None);
        // rows too wide for two stages beside x
        assert_eq!(stream_plan(132, 64, 4, 40960, StreamOut::Glu, 0), None);
    }
}
