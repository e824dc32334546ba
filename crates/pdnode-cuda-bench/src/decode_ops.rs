//! Decode-step benchmarks of issue 4's second round: the per-op breakdown of a step (CUDA events
//! after each op of eager steps, and the same step from a graph) and the fusions alone.

use super::{DecodeStep, bench_options, decode_blocks, err, timed, timed_steps};
use pdnode_cuda::CudaError;
use pdnode_cuda::backend::CudaBackend;
use pdnode_cuda::blas::OutType;
use pdnode_cuda::device::Gpu;
use pdnode_cuda::ops;

// ---- per-op breakdown of one decode step (eager, CUDA events) --------------------------------

/// `iters` steps of `step` with op timing on: per op label (first-seen order), the calls per step
/// and the summed microseconds over the steps.
fn op_sums(
    be: &mut CudaBackend,
    iters: usize,
    mut step: impl FnMut(&mut CudaBackend) -> Result<(), pdnode_engine::backend::BackendError>,
) -> Result<Vec<(&'static str, usize, f64)>, CudaError> {
    let mut sums: Vec<(&'static str, usize, f64)> = Vec::new();
    for it in 0..iters {
        step(be).map_err(err)?;
        for (op, us) in be.take_op_times()? {
            match sums.iter_mut().find(|s| s.0 == op) {
                Some(s) => {
                    s.1 += usize::from(it == 0);
                    s.2 += us;
                }
                None => sums.push((op, 1, us)),
            }
        }
    }
    Ok(sums)
}

/// One op of a decode step: its summed device time over the step.
#[derive(Debug, Clone)]
pub struct OpRow {
    /// `fused` (the fusion limits in force) or `unfused` (both set to 0 for the run).
    pub variant: &'static str,
    pub batch: usize,
    pub ctx: usize,
    /// The op's label in the backend's step (`qkv`, `attention`, ... or `TOTAL`).
    pub op: &'static str,
    /// Times it runs per step (layers).
    pub calls: usize,
    /// Device microseconds per step, all calls (mean over the timed steps).
    pub us_per_step: f64,
    /// Share of the step's summed device time.
    pub share: f64,
}

/// Eager decode steps at `spec`'s shapes (Llama-3.1-8B in the bench test, or a preset) at each `(batch, ctx)` with an event after every
/// op (`CudaBackend::set_op_timing`), so the lead sees where the time outside the linear layers
/// goes. Event gaps include the idle time between launches an eager step has (the graph step
/// has less); the `TOTAL` row is the sum, `GRAPH STEP (wall)` the same step from a CUDA graph. Linear: `Auto` (the measured table + the fused
/// gate_up/SwiGLU and GEMV/RMSNorm fusions at 1-2 tokens); where a fusion applies at the
/// batch, the step runs a second time with both fusions off (`unfused` rows).
pub fn run_op_breakdown(
    spec: &pdnode_engine::spec::ModelSpec,
    decode: &[(usize, usize)],
    iters: usize,
    mut report: impl FnMut(&OpRow),
) -> Result<Vec<OpRow>, CudaError> {
    let bs = 16usize;
    let num_blocks = decode_blocks(decode, bs) + 8;
    let opts = bench_options(1, num_blocks, bs, 64, decode, false);
    let mut be = CudaBackend::new_dummy(spec, 1234, &opts, "bench".into())?;
    be.fill_kv_random(99)?;
    be.set_op_timing(true);
    let iters = iters.max(1);
    let mut rows = Vec::new();
    let fused = be.fusion();
    let runs = decode.iter().flat_map(|&(b, c)| {
        let both = b <= fused.swiglu_max_tokens.max(fused.norm_max_tokens);
        [("fused", b, c), ("unfused", b, c)]
            .into_iter()
            .take(if both { 2 } else { 1 })
    });
    for (variant, batch, ctx) in runs {
        be.set_fusion(if variant == "unfused" {
            ops::Fusion::OFF
        } else {
            fused
        });
        let step = DecodeStep::new(batch, ctx, bs);
        let fb = step.batch();
        be.forward_device(&fb).map_err(err)?;
        be.take_op_times()?; // warm-up
        let sums = op_sums(&mut be, iters, |be| be.forward_device(&fb).map(|_| ()))?;
        let total: f64 = sums.iter().map(|s| s.2).sum::<f64>() / iters as f64;
        let calls: usize = sums.iter().map(|s| s.1).sum();
        // the same step replayed from a CUDA graph (wall time of back-to-back steps);
        // set_fusion dropped graphs captured under the other fusion limits
        be.set_op_timing(false);
        be.set_cuda_graphs(true);
        let graph_us = timed_steps(&mut be, iters, &fb)? * 1e6;
        be.set_op_timing(true);
        for (op, calls, us) in sums.into_iter().chain([
            ("TOTAL", calls, total * iters as f64),
            ("GRAPH STEP (wall)", 1, graph_us * iters as f64),
        ]) {
            let us_per_step = us / iters as f64;
            let row = OpRow {
                variant,
                batch,
                ctx,
                op,
                calls,
                us_per_step,
                share: us_per_step / total.max(1e-9),
            };
            report(&row);
            rows.push(row);
        }
    }
    be.set_op_timing(false);
    be.set_fusion(fused);
    Ok(rows)
}

/// A prefill step of each length in `lens` (one sequence from position 0, logits of its last
/// token) with an event after every op, per op summed over the step (`batch` 1, `ctx` the
/// length, `variant` the prefill attention's name): where a prefill step's time goes beyond the
/// linears and the attention that `bench_llama31_8b_shapes`'s op rows time alone.
pub fn run_prefill_op_breakdown(
    spec: &pdnode_engine::spec::ModelSpec,
    lens: &[usize],
    iters: usize,
    attn: pdnode_cuda::prefill::PrefillAttn,
    mut report: impl FnMut(&OpRow),
) -> Result<Vec<OpRow>, CudaError> {
    use pdnode_engine::backend::Backend;
    let bs = 16usize;
    let longest = lens.iter().copied().max().unwrap_or(1);
    let opts = bench_options(1, longest.div_ceil(bs) + 8, bs, longest.max(64), &[], false);
    let mut be = CudaBackend::new_dummy(spec, 1234, &opts, "bench".into())?;
    be.set_prefill_attn(attn);
    be.set_op_timing(true);
    let variant: &'static str = match attn {
        pdnode_cuda::prefill::PrefillAttn::Wgmma => "wgmma",
        pdnode_cuda::prefill::PrefillAttn::FlashV3 => "flashv3",
        pdnode_cuda::prefill::PrefillAttn::Flash8 => "flash8",
        pdnode_cuda::prefill::PrefillAttn::Gemm => "gemm",
    };
    let mut rows = Vec::new();
    for &len in lens {
        let (tbl, toks) = super::prefill_inputs(len, bs);
        let fb = super::prompt_batch(&toks, &tbl);
        be.forward(&fb).map_err(err)?;
        be.take_op_times()?; // warm-up
        let sums = op_sums(&mut be, iters.max(1), |be| be.forward(&fb).map(|_| ()))?;
        let n = iters.max(1) as f64;
        let total: f64 = sums.iter().map(|s| s.2).sum::<f64>() / n;
        let calls: usize = sums.iter().map(|s| s.1).sum();
        for (op, calls, us) in sums.into_iter().chain([("TOTAL", calls, total * n)]) {
            let row = OpRow {
                variant,
                batch: 1,
                ctx: len,
                op,
                calls,
                us_per_step: us / n,
                share: us / n / total.max(1e-9),
            };
            report(&row);
            rows.push(row);
        }
    }
    be.set_op_timing(false);
    Ok(rows)
}

// ---- the decode-step fusions alone: fused launch vs the launches it replaces -----------------

/// One fusion at one token count: the fused launch against what it replaces.
#[derive(Debug, Clone)]
pub struct FuseRow {
    /// `gate_up+swiglu`, `o+norm` or `down+norm`.
    pub what: &'static str,
    pub tokens: usize,
    /// The fused launch, us.
    pub fused_us: f64,
    /// The unfused pair at the same GEMV launch (tensor-core GEMV, then swiglu / add_rmsnorm).
    pub unfused_us: f64,
    /// What `Auto` runs without the fusion (gate_up: cuBLAS + swiglu; o/down: the table's
    /// launch + add_rmsnorm).
    pub auto_unfused_us: f64,
}

/// Times each fusion of the decode step at Llama-3.1-8B shapes for each token count (1..=8),
/// weights rotated over copies (>= 256 MB) so none is served from L2: the numbers behind
/// `engine.cuda.fuse_swiglu_max_tokens` (default 8) / `engine.cuda.fuse_norm_max_tokens` (default 0).
pub fn run_fusions(
    tokens: &[usize],
    iters: usize,
    mut report: impl FnMut(&FuseRow),
) -> Result<Vec<FuseRow>, CudaError> {
    let gpu = Gpu::new(0)?;
    let sms = gpu.sm_count as usize;
    let iters = iters.max(1);
    let (h, inter, eps) = (4096usize, 14336usize, 1e-5f32);
    let max_t = tokens
        .iter()
        .copied()
        .filter(|&t| t <= ops::GEMV_MAX_TOKENS)
        .max()
        .unwrap_or(1);
    let weights = |out: usize, inp: usize, seed: u64| {
        let bytes = out * inp * 2;
        (0..(256usize << 20).div_ceil(bytes).clamp(1, 8))
            .map(|c| {
                let b = gpu.alloc(bytes)?;
                ops::fill_uniform_bf16(&gpu, &b, out * inp, seed + c as u64, 0.05)?;
                Ok(b)
            })
            .collect::<Result<Vec<_>, CudaError>>()
    };
    let x = gpu.alloc(max_t * inter * 2)?;
    ops::fill_uniform_bf16(&gpu, &x, max_t * inter, 5, 1.0)?;
    let (gu, act) = (
        gpu.alloc(max_t * 2 * inter * 2)?,
        gpu.alloc(max_t * inter * 2)?,
    );
    let (resid, normed) = (gpu.alloc(max_t * h * 4)?, gpu.alloc(max_t * h * 2)?);
    ops::fill_f32(&gpu, &resid, max_t * h, 0.5)?;
    let nw = gpu.alloc(h * 4)?;
    ops::fill_f32(&gpu, &nw, h, 1.0)?;
    let ticket = gpu.alloc(256)?;
    gpu.memset(&ticket, 0)?;
    let nf = ops::NormFuse {
        w: &nw,
        out: &normed,
        ticket: &ticket,
        eps,
    };
    let mut rows = Vec::new();
    let w_gu = weights(2 * inter, h, 300)?;
    for &t in tokens
        .iter()
        .filter(|&&t| (1..=ops::GEMV_MAX_TOKENS).contains(&t))
    {
        // the launch the decode step takes (Fusion::glu_warps)
        let l = ops::glu_launch_warps(sms, inter, h, ops::Fusion::default().glu_warps);
        let n = w_gu.len();
        let mut k = 0usize;
        let fused = timed(&gpu, iters, || {
            k += 1;
            ops::gemv_mma_swiglu(&gpu, l, inter, t, h, &w_gu[k % n], &x, &act)
        })?;
        let unfused = timed(&gpu, iters, || {
            k += 1;
            let w = &w_gu[k % n];
            ops::gemv_mma(&gpu, l, 2 * inter, t, h, w, &x, &gu, OutType::Bf16, false)?;
            ops::swiglu(&gpu, &gu, &act, t, inter)
        })?;
        let auto = timed(&gpu, iters, || {
            k += 1;
            let w = &w_gu[k % n];
            let how = ops::LinearImpl::Cublas;
            ops::linear(&gpu, 2 * inter, t, h, w, &x, &gu, OutType::Bf16, false, how)?;
            ops::swiglu(&gpu, &gu, &act, t, inter)
        })?;
        let row = FuseRow {
            what: "gate_up+swiglu",
            tokens: t,
            fused_us: fused * 1e6,
            unfused_us: unfused * 1e6,
            auto_unfused_us: auto * 1e6,
        };
        report(&row);
        rows.push(row);
    }
    drop(w_gu);
    for (what, inp, seed) in [("o+norm", h, 400u64), ("down+norm", inter, 500)] {
        let ws = weights(h, inp, seed)?;
        let n = ws.len();
        for &t in tokens
            .iter()
            .filter(|&&t| (1..=ops::GEMV_MAX_TOKENS).contains(&t))
        {
            let table = ops::table_launch(sms, h, t, inp).filter(|l| l.tiles == 1);
            let Some(table) = table else { continue };
            let l = ops::MmaLaunch {
                warps: table.warps.min(ops::NORM_MAX_WARPS),
                ..table
            };
            let mut k = 0usize;
            let fused = timed(&gpu, iters, || {
                k += 1;
                ops::gemv_mma_norm(&gpu, l, h, t, inp, &ws[k % n], &x, &resid, true, &nf)
            })?;
            let pair = |l: ops::MmaLaunch, k: usize| {
                let w = &ws[k % n];
                ops::gemv_mma(&gpu, l, h, t, inp, w, &x, &resid, OutType::F32, true)?;
                ops::add_rmsnorm(&gpu, &resid, t, None, &nw, &normed, None, t, h, eps)
            };
            let unfused = timed(&gpu, iters, || {
                k += 1;
                pair(l, k)
            })?;
            let auto = timed(&gpu, iters, || {
                k += 1;
                pair(table, k)
            })?;
            let row = FuseRow {
                what,
                tokens: t,
                fused_us: fused * 1e6,
                unfused_us: unfused * 1e6,
                auto_unfused_us: auto * 1e6,
            };
            report(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}
