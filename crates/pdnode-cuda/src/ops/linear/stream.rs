//! The decode GEMV that streams its weights through shared memory (`gemv_stream_t*`,
//! kernels/gemv_stream.cu, in the Hopper-only program): one block an SM over a contiguous range
//! of weight rows, bulk copies into a ring of stages issued before the kernel waits on the
//! previous one (under programmatic dependent launch the weights stream while that kernel
//! drains), and optionally the RMSNorm of its input computed in the block (add_rmsnorm_v4's
//! arithmetic), so the decode step needs no norm launch before qkv and gate_up; its qkv can
//! apply RoPE and write k / v into the paged pool ([`StreamOut::Rope`]) and its o projection can
//! combine the attention's split-K partials itself ([`StreamX::Combine`]), so a one-row decode
//! layer needs neither the RoPE nor the combine launch.

use super::super::super::CudaError;
use super::super::super::device::{DevBuf, Gpu};
use super::super::{AttnDims, cfg, launched, need, rmsnorm_vector_block, shape, u32_of};
use super::{BF16, F32, i32_of};
use cudarc::driver::DeviceRepr;

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
    /// RoPE on the fused qkv output (no bias, no q/k norm; `rope_qkv`'s arithmetic on the bf16
    /// qkv values, so bit for bit the unfused qkv + `rope_qkv`): w the `[(nh + 2 nkv) hd, inp]`
    /// qkv weight, `units` = its rows / 2 (a unit: rows `j hd + i` and `j hd + i + hd / 2` of
    /// head j), y = q `[tokens, nh, hd]` bf16, k and v into the pool at the tokens' slots.
    Rope(StreamRope),
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
            StreamOut::Rope(_) => 4,
        }
    }

    fn y_bytes(self) -> usize {
        match self {
            StreamOut::Bf16 | StreamOut::Glu | StreamOut::Rope(_) => BF16,
            StreamOut::F32 | StreamOut::F32Acc => F32,
        }
    }

    /// Whether a unit is two weight rows.
    fn pair(self) -> bool {
        matches!(self, StreamOut::Glu | StreamOut::Rope(_))
    }
}

/// The targets of [`StreamOut::Rope`] (built by [`StreamRope::new`], which checks them as
/// `rope_qkv` does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRope {
    inv_freq: u64,
    pos: u64,
    slots: u64,
    layer_kv: u64,
    dims: AttnDims,
}

impl StreamRope {
    /// RoPE with `inv_freq` (f32 `[hd / 2]`) at positions `pos` (device i32 `[tokens]`), k / v
    /// into layer `layer` of `pool` at `slots` (device i64 `[tokens]`, `block * block_size +
    /// slot`, each below `num_blocks * block_size`: the caller's metadata, as for `rope_qkv`).
    pub fn new(
        d: &AttnDims,
        inv_freq: &DevBuf,
        pos: u64,
        slots: u64,
        pool: &DevBuf,
        layer: usize,
    ) -> Result<StreamRope, CudaError> {
        const OP: &str = "gemv_stream (rope)";
        d.check(OP)?;
        shape(OP, d.head_dim.is_multiple_of(2), || {
            format!("head_dim {} is odd", d.head_dim)
        })?;
        need(OP, "inv_freq", inv_freq, d.head_dim / 2 * F32)?;
        need(OP, "pool", pool, (layer + 1) * d.layer_elems() * BF16)?;
        Ok(StreamRope {
            inv_freq: inv_freq.ptr(),
            pos,
            slots,
            layer_kv: pool.at(layer * d.layer_elems() * BF16),
            dims: *d,
        })
    }

    /// Units of the qkv GEMV: (nh + 2 nkv) hd / 2 row pairs.
    pub fn units(&self) -> usize {
        let d = &self.dims;
        (d.num_heads + 2 * d.num_kv_heads) * d.head_dim / 2
    }
}

/// The kernel's `GsAux` (gemv_stream.cu): the operands of the RoPE output and the combined x,
/// zero where unused; passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GsAux {
    inv_freq: u64,
    pos: u64,
    slots: u64,
    layer_kv: u64,
    part_ml: u64,
    part_acc: u64,
    nh: i32,
    nkv: i32,
    hd: i32,
    block_size: i32,
    nsplit: i32,
    pad: i32,
}

// SAFETY: plain old data with the C layout of the kernel's struct (six pointers, six ints).
unsafe impl DeviceRepr for GsAux {}

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
    /// The attention's output from its `nsplit` split-K partials (`paged_attention_parts`),
    /// combined in every block exactly as `attention_combine` does: `part_ml` f32 `[tokens
    /// heads nsplit][2]`, `part_acc` f32 `[tokens heads nsplit][hd]` (16-byte aligned), `inp =
    /// heads * hd`, `hd % 4 == 0`.
    Combine {
        part_ml: &'a DevBuf,
        part_acc: &'a DevBuf,
        nsplit: usize,
        heads: usize,
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
    /// Stages of the ring: from 8 on a multiple of 8, 7 or 6 (the consumer warps, each owning
    /// whole stages).
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
    let unit = inp * BF16 * if out.pair() { 2 } else { 1 };
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
    // from 8 stages on, a multiple of 8, 7 or 6 (the kernel's consumer warps: the largest count
    // up to 8 dividing the stages, so each stage keeps one consumer)
    while stages > CONSUMERS && ![8, 7, 6].iter().any(|c| stages.is_multiple_of(*c)) {
        stages -= 1;
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
    let rows = if out.pair() { 2 * units } else { units };
    need(OP, "w", w, rows * inp * BF16)?;
    let mut aux = GsAux::default();
    if let StreamOut::Rope(r) = out {
        let d = &r.dims;
        shape(OP, units == r.units(), || {
            format!(
                "RoPE output: {units} units, the qkv of {} + 2 x {} heads of {} has {}",
                d.num_heads,
                d.num_kv_heads,
                d.head_dim,
                r.units()
            )
        })?;
        shape(OP, !matches!(x, StreamX::Combine { .. }), || {
            "RoPE output with a combined x".into()
        })?;
        need(OP, "q", y, tokens * d.num_heads * d.head_dim * BF16)?;
        aux = GsAux {
            inv_freq: r.inv_freq,
            pos: r.pos,
            slots: r.slots,
            layer_kv: r.layer_kv,
            nh: i32_of(OP, d.num_heads)?,
            nkv: i32_of(OP, d.num_kv_heads)?,
            hd: i32_of(OP, d.head_dim)?,
            block_size: i32_of(OP, d.block_size)?,
            ..aux
        };
    } else {
        need(OP, "y", y, tokens * units * out.y_bytes())?;
    }
    let (xp, resid, nw, eps, norm_threads) = match x {
        StreamX::Combine {
            part_ml,
            part_acc,
            nsplit,
            heads,
        } => {
            let hd = inp.checked_div(heads).unwrap_or(0);
            shape(
                OP,
                nsplit >= 1 && hd * heads == inp && hd.is_multiple_of(4) && hd > 0,
                || format!("combined x: {heads} heads, {nsplit} splits, width {inp}"),
            )?;
            let parts = tokens * heads * nsplit;
            need(OP, "part_ml", part_ml, parts * 2 * F32)?;
            need(OP, "part_acc", part_acc, parts * hd * F32)?;
            shape(OP, part_acc.ptr().is_multiple_of(16), || {
                "part_acc not 16-byte aligned".into()
            })?;
            aux = GsAux {
                part_ml: part_ml.ptr(),
                part_acc: part_acc.ptr(),
                nh: i32_of(OP, heads)?,
                hd: i32_of(OP, hd)?,
                nsplit: i32_of(OP, nsplit)?,
                ..aux
            };
            (0u64, 0u64, 0u64, 0f32, 0u32)
        }
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
        .arg(&ahead)
        .arg(&aux);
    let mut c = cfg((u32_of(OP, plan.blocks)?, 1, 1), THREADS);
    c.shared_mem_bytes = plan.smem as u32;

    // SAFETY: sizes and alignment checked above; the plan keeps the launch within the kernel's
    // contract (tokens <= its MT, stages fitting the shared memory asked for, blocks <= units);
    // RoPE's positions and slots are the caller's metadata (slots < num_blocks * block_size).
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
        // row pairs of 16 KiB: 13 fit, 12 stages for 6 consumer warps
        let gu = stream_plan(132, 14336, 1, 4096, StreamOut::Glu, 0).unwrap();
        assert_eq!((gu.blocks, gu.stages), (132, 12));
        let rope = StreamOut::Rope(StreamRope {
            inv_freq: 0,
            pos: 0,
            slots: 0,
            layer_kv: 0,
            dims: AttnDims {
                num_heads: 32,
                num_kv_heads: 8,
                head_dim: 128,
                block_size: 16,
                num_blocks: 1,
            },
        });
        let StreamOut::Rope(r) = rope else {
            unreachable!()
        };
        assert_eq!(r.units(), 3072);
        let qkv_rope = stream_plan(132, 3072, 1, 4096, rope, 0).unwrap();
        assert_eq!((qkv_rope.blocks, qkv_rope.stages), (132, 12));
        assert!(qkv_rope.smem <= STREAM_SMEM_MAX, "{qkv_rope:?}");
        let down = stream_plan(132, 4096, 1, 14336, StreamOut::F32Acc, 0).unwrap();
        assert_eq!(down.stages, 7);
        let down = stream_plan(132, 4096, 4, 14336, StreamOut::F32Acc, 0).unwrap();
        assert_eq!((down.kernel, down.stages), ("gemv_stream_t4", 4));
        // half the shared memory: two blocks an SM
        let qkv = stream_plan(132, 6144, 1, 4096, StreamOut::Bf16, 113 << 10).unwrap();
        assert_eq!(qkv.stages, 12);
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
                // from 8 stages on, 6-8 consumer warps each owning whole stages
                assert!(
                    p.stages < CONSUMERS || [8, 7, 6].iter().any(|c| p.stages.is_multiple_of(*c)),
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
