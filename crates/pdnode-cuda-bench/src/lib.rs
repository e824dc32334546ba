//! pdnode-cuda-bench: GPU benchmarks of the CUDA backend at real model shapes (dummy weights): decode step time
//! against the HBM roofline, prefill against the cuBLAS bf16 peak. Ceilings are measured in the
//! same process (device-to-device copy; an 8192^3 bf16 GEMM) so every ratio has its own ceiling.
//! Beside production code, never inside it: `pdnode bench-engine` (built with the binary's
//! `bench-engine` feature) and `tests/cuda_bench.rs` run these; [`attn`] times the decode
//! attention kernels, [`tp`] the tensor-parallel backend.

use pdnode_cuda::CudaError;
use pdnode_cuda::backend::{CudaBackend, CudaOptions};
use pdnode_cuda::blas::{OutType, gemm};
use pdnode_cuda::device::Gpu;
use pdnode_cuda::ops;
use pdnode_cuda::prefill::{LongSeq, PrefillAttn, PrefillScratch};
use pdnode_engine::backend::{
    Backend, BackendError, ForwardBatch, LogitsWant, SeqStep, StepLogits,
};

use pdnode_core::BlockId;
use pdnode_engine::spec::ModelSpec;
use std::time::Instant;

pub mod attn;
mod decode_ops;
mod fusion_sweep;
mod linear;
mod mla;
mod step_trace;
pub mod tp;
pub use decode_ops::*;
pub use fusion_sweep::*;
pub use linear::*;
pub use mla::run_mla;
pub use step_trace::*;

pub use pdnode_engine::loader::dummy::llama31_8b;

/// Measured ceilings of this device.
#[derive(Debug, Clone, Copy)]
pub struct Ceilings {
    /// Device-to-device copy, bytes read + written per second.
    pub hbm_traffic_bps: f64,
    /// bf16 GEMM 8192^3 (f32 accumulate), FLOP/s.
    pub gemm_flops: f64,
}

fn timed(
    gpu: &Gpu,
    iters: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?;
    gpu.sync()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    gpu.sync()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// Copy bandwidth (1 GiB device-to-device) and the bf16 GEMM rate at 8192^3.
pub fn measure_ceilings(gpu: &Gpu) -> Result<Ceilings, CudaError> {
    gpu.bind()?;
    let n = 1usize << 30;
    let (a, b) = (gpu.alloc(n)?, gpu.alloc(n)?);
    ops::fill_uniform_bf16(gpu, &a, n / 2, 1, 1.0)?;
    let copy = timed(gpu, 20, || {
        // SAFETY: both buffers are live n-byte allocations of this context.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(b.ptr(), a.ptr(), n, gpu.stream.cu_stream())
        }
        .map_err(pdnode_cuda::drv("cuMemcpyDtoDAsync"))
    })?;
    drop((a, b));
    let g = PeakGemm::new(gpu)?;
    let t = timed(gpu, 20, || g.run(gpu))?;
    Ok(Ceilings {
        hbm_traffic_bps: 2.0 * n as f64 / copy,
        gemm_flops: g.flops() / t,
    })
}

/// The bf16 GEMM rate at 8192^3 when it runs for `warm_s` seconds and then is timed for the next
/// `timed_s`: what the GPU sustains at its power limit, where [`measure_ceilings`]' 20 calls
/// (~30 ms) see the boost clock. Prefill steps of thousands of tokens run for a few hundred ms
/// of mostly GEMM, so they see this rate; benchmarks print it beside the burst ceiling.
pub fn sustained_gemm_flops(gpu: &Gpu, warm_s: f64, timed_s: f64) -> Result<f64, CudaError> {
    gpu.bind()?;
    let g = PeakGemm::new(gpu)?;
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < warm_s {
        for _ in 0..10 {
            g.run(gpu)?;
        }
        gpu.sync()?;
    }
    let (t1, mut calls) = (Instant::now(), 0usize);
    while t1.elapsed().as_secs_f64() < timed_s {
        for _ in 0..10 {
            g.run(gpu)?;
        }
        calls += 10;
        gpu.sync()?;
    }
    Ok(g.flops() * calls as f64 / t1.elapsed().as_secs_f64())
}

/// The ceiling GEMM: y = x w^T, all bf16 8192 x 8192, through cuBLAS.
struct PeakGemm {
    x: pdnode_cuda::device::DevBuf,
    w: pdnode_cuda::device::DevBuf,
    y: pdnode_cuda::device::DevBuf,
}

impl PeakGemm {
    const M: usize = 8192;

    fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let m = Self::M;
        let g = PeakGemm {
            x: gpu.alloc(m * m * 2)?,
            w: gpu.alloc(m * m * 2)?,
            y: gpu.alloc(m * m * 2)?,
        };
        ops::fill_uniform_bf16(gpu, &g.x, m * m, 2, 1.0)?;
        ops::fill_uniform_bf16(gpu, &g.w, m * m, 3, 1.0)?;
        Ok(g)
    }

    fn flops(&self) -> f64 {
        2.0 * (Self::M as f64).powi(3)
    }

    fn run(&self, gpu: &Gpu) -> Result<(), CudaError> {
        let m = Self::M;
        // SAFETY: the three buffers hold m * m bf16 each.
        unsafe {
            gemm(
                &gpu.blas,
                m,
                m,
                m,
                self.w.ptr(),
                self.x.ptr(),
                self.y.ptr(),
                OutType::Bf16,
                0.0,
            )
        }
    }
}

/// One benchmark result row.
#[derive(Debug, Clone)]
pub struct BenchRow {
    pub what: String,
    pub batch: usize,
    pub ctx: usize,
    pub ms: f64,
    /// Ceiling time (roofline bytes / bandwidth, or FLOP / GEMM peak), ms.
    pub floor_ms: f64,
}

impl BenchRow {
    pub fn ratio(&self) -> f64 {
        self.floor_ms / self.ms
    }
}

/// Bytes one decode step of `batch` sequences at `ctx` tokens each must read from HBM, for the
/// decode rows' ceiling: every weight except the embedding table, of which a step reads only its
/// `batch` rows (unless the table is tied to the output projection, which reads all of it), plus
/// the KV of `batch * ctx` tokens. `weight_bytes` is what the backend holds (bf16, the table
/// included). Not counted: activations (a few MB) and the logits written.
pub fn decode_step_bytes(spec: &ModelSpec, weight_bytes: f64, batch: usize, ctx: usize) -> f64 {
    let bf16 = 2.0;
    let table = (spec.vocab_size * spec.hidden_size) as f64 * bf16;
    let rows = (batch * spec.hidden_size) as f64 * bf16;
    let embedding = if spec.tie_word_embeddings {
        0.0
    } else {
        table - rows
    };
    let kv_per_tok = (spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim) as f64 * bf16;
    weight_bytes - embedding + kv_per_tok * (batch * ctx) as f64
}

/// The step table of a [`run_variants`] sweep as printed by `pdnode bench-engine` and the GPU
/// bench test: the ceilings line, then one markdown row per result.
pub fn step_table(ceil: &Ceilings, rows: &[BenchRow]) -> String {
    let mut out = format!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write), bf16 GEMM 8192^3 {:.0} TFLOP/s\n\
         decode ceiling: the bytes a step must read (weights less the embedding table, B rows of \
         it, the KV of B x ctx tokens) at the copy rate; prefill: its FLOP at the GEMM peak\n\
         | what | batch | ctx | ms/step | ceiling ms | ratio |\n|---|---|---|---|---|---|\n",
        ceil.hbm_traffic_bps / 1e9,
        ceil.gemm_flops / 1e12
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.2} |\n",
            r.what,
            r.batch,
            r.ctx,
            r.ms,
            r.floor_ms,
            r.ratio()
        ));
    }
    out
}

/// KV blocks of `bs` tokens the largest step of the `(batch, ctx)` sweep `decode` holds.
pub(crate) fn decode_blocks(decode: &[(usize, usize)], bs: usize) -> usize {
    decode
        .iter()
        .map(|&(b, c)| b * c.div_ceil(bs))
        .max()
        .unwrap_or(0)
}

/// The benches' backend: GPU 0 (`tp` of them from there), 0.95 of its memory, `num_blocks`
/// blocks of `bs`, room for the largest batch of `decode`, `Auto` kernels.
pub(crate) fn bench_options(
    tp: u32,
    num_blocks: usize,
    bs: usize,
    max_batch_tokens: usize,
    decode: &[(usize, usize)],
    cuda_graphs: bool,
) -> CudaOptions {
    CudaOptions {
        gpus: (0..tp).collect(),
        tensor_parallel: tp,
        mem_fraction: 0.95,
        num_kv_blocks: num_blocks as u32,
        block_size: bs as u32,
        max_batch_tokens,
        max_seqs: decode.iter().map(|d| d.0).max().unwrap_or(1).max(1),
        prefill_gemm_min_tokens: 64,
        linear: ops::LinearImpl::Auto,
        attention: ops::AttnVariant::Auto.into(),
        prefill_attention: Default::default(),
        cuda_graphs,
        gpu_sampling: true,
        pdl: false,
        fusion: bench_fusion(),
        warm_up_context: 0,
    }
}

/// The fusion limits the benches' backends start with: `Fusion::default()`, or the setting
/// `PDNODE_BENCH_FUSION` names (`s<N>n<M>` as [`StepVariant::parse`] reads it: e.g. `s2n0`
/// for `engine.cuda.fuse_norm_max_tokens = 0`).
pub fn bench_fusion() -> pdnode_cuda::ops::Fusion {
    std::env::var("PDNODE_BENCH_FUSION")
        .ok()
        .and_then(|v| StepVariant::parse(&v))
        .map_or_else(pdnode_cuda::ops::Fusion::default, |v| v.fusion)
}

/// The inputs of a synthetic decode step: `batch` sequences at context `ctx`, each with its own
/// blocks (`ctx / bs` of them, rounded up) and one token. [`DecodeStep::batch`] borrows them as
/// the step.
pub(crate) struct DecodeStep {
    ctx: usize,
    tables: Vec<Vec<BlockId>>,
    toks: Vec<[u32; 1]>,
}

impl DecodeStep {
    pub(crate) fn new(batch: usize, ctx: usize, bs: usize) -> Self {
        let nbps = ctx.div_ceil(bs);
        let tables: Vec<Vec<BlockId>> = (0..batch)
            .map(|i| (0..nbps).map(|j| BlockId((i * nbps + j) as u32)).collect())
            .collect();
        // below every preset's vocabulary (DeepSeek-V2-Lite's is 102400)
        let toks: Vec<[u32; 1]> = (0..batch).map(|i| [(i * 7919 % 100_000) as u32]).collect();
        Self { ctx, tables, toks }
    }

    pub(crate) fn batch(&self) -> ForwardBatch<'_> {
        ForwardBatch {
            seqs: (0..self.toks.len())
                .map(|i| SeqStep {
                    tokens: &self.toks[i],
                    start_pos: self.ctx - 1,
                    block_table: &self.tables[i],
                    want_logits: true,
                })
                .collect(),
        }
    }
}

fn err(e: BackendError) -> CudaError {
    CudaError::Step(e)
}

/// Mean time of `iters` back-to-back steps (after one warm-up), device work included.
fn timed_steps(
    be: &mut CudaBackend,
    iters: usize,
    fb: &ForwardBatch<'_>,
) -> Result<f64, CudaError> {
    be.forward_device(fb).map_err(err)?;
    be.synchronize().map_err(err)?;
    let t0 = Instant::now();
    for _ in 0..iters {
        be.forward_device(fb).map_err(err)?;
    }
    be.synchronize().map_err(err)?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// Decode steps at each `(batch, ctx)` and prefills of each length, Llama-3.1-8B shapes.
pub fn run(
    decode: &[(usize, usize)],
    prefill: &[usize],
    iters: usize,
    report: impl FnMut(&BenchRow),
) -> Result<(Ceilings, Vec<BenchRow>), CudaError> {
    run_variants(
        decode,
        prefill,
        iters,
        &[(ops::AttnVariant::Auto, ops::LinearImpl::Auto)],
        report,
    )
}

/// [`run`] with the decode sweep repeated for each `(attention, linear)` kernel choice (the
/// first one also runs the prefills).
pub fn run_variants(
    decode: &[(usize, usize)],
    prefill: &[usize],
    iters: usize,
    variants: &[(ops::AttnVariant, ops::LinearImpl)],
    mut report: impl FnMut(&BenchRow),
) -> Result<(Ceilings, Vec<BenchRow>), CudaError> {
    if variants.is_empty() {
        return Err(CudaError::Unsupported {
            reason: "no kernel variant to benchmark".into(),
        });
    }
    let spec = llama31_8b();
    let bs = 16usize;
    let max_decode_blocks = decode_blocks(decode, bs);
    let max_prefill = prefill.iter().copied().max().unwrap_or(1);
    let num_blocks = max_decode_blocks.max(max_prefill.div_ceil(bs)) + 8;
    let opts = bench_options(1, num_blocks, bs, max_prefill.max(64), decode, true);
    let mut be = CudaBackend::new_dummy(&spec, 1234, &opts, "bench".into())?;
    be.fill_kv_random(99)?;
    let ceil = measure_ceilings(be.gpu())?;
    let wbytes = be.weight_bytes() as f64;
    let mut rows = Vec::new();
    for (vi, &(attn, lin)) in variants.iter().enumerate() {
        be.set_kernels(attn, lin);
        let tag = if vi == 0 && variants.len() == 1 {
            String::new()
        } else {
            format!(" [{attn:?}/{lin:?}]")
        };
        for &(batch, ctx) in decode {
            let step = DecodeStep::new(batch, ctx, bs);
            let fb = step.batch();
            // eager launches, then the decode CUDA graph of this (batch, ctx) bucket (captured
            // in the warm-up step); the logits-copy row runs the graph (the shipped default)
            be.set_cuda_graphs(false);
            let eager_t = timed_steps(&mut be, iters, &fb)?;
            be.set_cuda_graphs(true);
            let replays0 = be.graph_stats().replays;
            let gpu_t = timed_steps(&mut be, iters, &fb)?;
            let graph_ran = be.graph_stats().replays >= replays0 + iters as u64;
            let bytes = decode_step_bytes(&spec, wbytes, batch, ctx);
            // every row of this (batch, ctx): reported, then kept
            let mut add = |what: String, ms: f64| {
                let row = BenchRow {
                    what,
                    batch,
                    ctx,
                    ms,
                    floor_ms: bytes / ceil.hbm_traffic_bps * 1e3,
                };
                report(&row);
                rows.push(row);
            };
            add(format!("decode eager{tag}"), eager_t * 1e3);
            let what = if graph_ran {
                "decode graph"
            } else {
                "decode graph (FELL BACK TO EAGER)"
            };
            add(format!("{what}{tag}"), gpu_t * 1e3);
            // each step waited for, without then with the logits copy to the host (what
            // Backend::forward costs): the difference is the copy alone
            let t0 = Instant::now();
            for _ in 0..iters.min(5) {
                be.forward_device(&fb).map_err(err)?;
                be.synchronize().map_err(err)?;
            }
            add(
                format!("decode graph, each step waited{tag}"),
                t0.elapsed().as_secs_f64() / iters.min(5) as f64 * 1e3,
            );
            let t0 = Instant::now();
            for _ in 0..iters.min(5) {
                be.forward(&fb).map_err(err)?;
            }
            let host_t = t0.elapsed().as_secs_f64() / iters.min(5) as f64;
            add(format!("decode+logits D2H{tag}"), host_t * 1e3);
            // what the engine's step does (Backend::forward_select): the full rows into a
            // buffer reused across steps, then the greedy case (arg-max on the device, one id
            // per row copied)
            for (want, what) in [
                (LogitsWant::Full, "decode+logits D2H reused"),
                (LogitsWant::Argmax, "decode+argmax D2H"),
            ] {
                let wants = vec![want; batch];
                let mut out = StepLogits::default();
                be.forward_select(&fb, &wants, &mut out).map_err(err)?;
                let t0 = Instant::now();
                for _ in 0..iters.min(5) {
                    be.forward_select(&fb, &wants, &mut out).map_err(err)?;
                }
                add(
                    format!("{what}{tag}"),
                    t0.elapsed().as_secs_f64() / iters.min(5) as f64 * 1e3,
                );
            }
        }
    }
    be.set_kernels(variants[0].0, variants[0].1);
    for &len in prefill {
        let (tbl, toks) = prefill_inputs(len, bs);
        let fb = prompt_batch(&toks, &tbl);
        let dense =
            2.0 * (spec.num_params() - spec.vocab_size * spec.hidden_size * 2) as f64 * len as f64;
        let attn =
            2.0 * (len as f64).powi(2) * (spec.head_dim * spec.num_heads * spec.num_layers) as f64;
        // the whole step with each prefill-attention implementation (the backend's choice
        // switched for the step; the configured one restored after)
        let configured = be.kernels().2;
        let result = prefill_variants().try_for_each(|(pa, plain)| {
            be.set_prefill_attn(pa);
            be.set_wg_plain(plain);
            let t = timed_steps(&mut be, iters.min(5), &fb)?;
            let row = BenchRow {
                what: format!("prefill [{pa:?}{}]", if plain { ", plain" } else { "" }),
                batch: 1,
                ctx: len,
                ms: t * 1e3,
                floor_ms: (dense + attn) / ceil.gemm_flops * 1e3,
            };
            report(&row);
            rows.push(row);
            Ok::<(), CudaError>(())
        });
        be.set_prefill_attn(configured);
        be.set_wg_plain(false);
        result?;
        for bs in attn_block_sizes() {
            for row in prefill_attention_rows(be.gpu(), &spec, len, bs, iters, &ceil)? {
                report(&row);
                rows.push(row);
            }
        }
        for row in prefill_op_rows(be.gpu(), &spec, len, iters, &ceil)? {
            report(&row);
            rows.push(row);
        }
    }
    Ok((ceil, rows))
}

/// Every prefill-attention implementation (`Wgmma` with its warp-specialized kernel where it
/// fits), then `Wgmma` with its plain kernel (`PrefillScratch::wg_plain`).
fn prefill_variants() -> impl Iterator<Item = (PrefillAttn, bool)> {
    let each = PrefillAttn::ALL.into_iter().map(|a| (a, false));
    each.chain([(PrefillAttn::Wgmma, true)])
}

/// One prompt from position 0 as a step: `toks` over the blocks of `tbl`, logits wanted.
pub(crate) fn prompt_batch<'a>(toks: &'a [u32], tbl: &'a [BlockId]) -> ForwardBatch<'a> {
    ForwardBatch {
        seqs: vec![SeqStep {
            tokens: toks,
            start_pos: 0,
            block_table: tbl,
            want_logits: true,
        }],
    }
}

/// A prefill benchmark's one sequence of `len` tokens from position 0: its block table (blocks 0,
/// 1, ... of `bs` tokens) and token ids.
pub(crate) fn prefill_inputs(len: usize, bs: usize) -> (Vec<BlockId>, Vec<u32>) {
    let tbl = (0..len.div_ceil(bs)).map(|j| BlockId(j as u32)).collect();
    let toks = (0..len).map(|i| (i * 31 % 128000) as u32).collect();
    (tbl, toks)
}

/// Pool block sizes the attention-alone rows run at: `PDNODE_BENCH_ATTN_BLOCKS` (comma-separated
/// powers of two, e.g. `16,64,128`), else 16 (the engine's default block size).
fn attn_block_sizes() -> Vec<usize> {
    let v: Vec<usize> = std::env::var("PDNODE_BENCH_ATTN_BLOCKS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .filter(|b: &usize| b.is_power_of_two())
        .collect();
    if v.is_empty() { vec![16] } else { v }
}

/// Prefill attention alone, one layer of `spec`'s heads, one sequence of `len` new tokens from
/// position 0 (K/V already in a one-layer pool of random values, blocks of `bs` tokens), per
/// implementation. Ceiling: the causal half of `4 len^2 hd nh` FLOP (QK^T and PV) at the bf16
/// GEMM peak.
fn prefill_attention_rows(
    gpu: &Gpu,
    spec: &ModelSpec,
    len: usize,
    bs: usize,
    iters: usize,
    ceil: &Ceilings,
) -> Result<Vec<BenchRow>, CudaError> {
    let blocks = len.div_ceil(bs);
    let d = ops::AttnDims {
        num_heads: spec.num_heads,
        num_kv_heads: spec.num_kv_heads,
        head_dim: spec.head_dim,
        block_size: bs,
        num_blocks: blocks,
    };
    let q_elems = len * spec.num_heads * spec.head_dim;
    let (pool, q, out) = (
        gpu.alloc(d.layer_elems() * 2)?,
        gpu.alloc(q_elems * 2)?,
        gpu.alloc(q_elems * 2)?,
    );
    ops::fill_uniform_bf16(gpu, &pool, d.layer_elems(), 11, 1.0)?;
    ops::fill_uniform_bf16(gpu, &q, q_elems, 12, 1.0)?;
    let table: Vec<i32> = (0..blocks as i32).rev().collect();
    let tab = gpu.alloc(blocks * 4)?;
    gpu.upload(&tab, 0, &table)?;
    let seqs = [LongSeq {
        row0: 0,
        n: len,
        start: 0,
        seq: 0,
    }];
    let flops = 2.0 * (len as f64).powi(2) * (spec.head_dim * spec.num_heads) as f64;
    let mut rows = Vec::new();
    for (pa, plain) in prefill_variants() {
        let mut scratch = PrefillScratch::new(pa);
        scratch.wg_plain = plain;
        let t = timed(gpu, iters, || {
            scratch.run(
                gpu,
                &d,
                &pool,
                0,
                &q,
                &out,
                len,
                tab.ptr(),
                blocks,
                &seqs,
                0,
            )
        })?;
        rows.push(BenchRow {
            what: format!(
                "prefill attention, 1 layer{} [{pa:?}{}{}]",
                if bs == 16 {
                    String::new()
                } else {
                    format!(" (blocks of {bs})")
                },
                if plain { ", plain" } else { "" },
                if pa == PrefillAttn::Wgmma && !scratch.wgmma_runs(gpu, &d) {
                    ": fell back to flashv3"
                } else if pa == PrefillAttn::Wgmma
                    && !plain
                    && !scratch.wg_specialized_runs(gpu, &d)
                {
                    ": the plain wgmma kernel (block size under 8)"
                } else {
                    ""
                }
            ),
            batch: 1,
            ctx: len,
            ms: t * 1e3,
            floor_ms: flops / ceil.gemm_flops * 1e3,
        });
    }
    gpu.sync()?;
    Ok(rows)
}

/// The non-attention ops of a prefill step of `len` tokens, each alone and scaled to the whole
/// step (x layers; every op at `spec`'s real shape, random inputs): the four projections through
/// cuBLAS as the step calls them (o and down accumulate into the f32 residual) against the bf16
/// GEMM peak; add_rmsnorm (twice a layer) and swiglu against the copy ceiling (bytes read +
/// written). rope_qkv is left out (it needs the step's metadata; it moves about the q/k/v rows
/// once more).
fn prefill_op_rows(
    gpu: &Gpu,
    spec: &ModelSpec,
    len: usize,
    iters: usize,
    ceil: &Ceilings,
) -> Result<Vec<BenchRow>, CudaError> {
    let (h, qd, kvd, inter) = (
        spec.hidden_size,
        spec.q_dim(),
        spec.kv_dim(),
        spec.intermediate_size,
    );
    // (name, out, in, output type, accumulate)
    let linears = [
        ("qkv", qd + 2 * kvd, h, OutType::Bf16, false),
        ("o (+= f32 resid)", h, qd, OutType::F32, true),
        ("gate_up", 2 * inter, h, OutType::Bf16, false),
        ("down (+= f32 resid)", h, inter, OutType::F32, true),
    ];
    let w_elems = linears.iter().map(|l| l.1 * l.2).max().unwrap_or(0);
    let x_elems = len * linears.iter().map(|l| l.2).max().unwrap_or(0);
    let y_bytes = linears
        .iter()
        .map(|l| len * l.1 * if l.3 == OutType::F32 { 4 } else { 2 })
        .max()
        .unwrap_or(0);
    let (w, x, y) = (
        gpu.alloc(w_elems * 2)?,
        gpu.alloc(x_elems * 2)?,
        gpu.alloc(y_bytes)?,
    );
    let (resid, norm_w) = (gpu.alloc(len * h * 4)?, gpu.alloc(h * 4)?);
    ops::fill_uniform_bf16(gpu, &w, w_elems, 21, 0.02)?;
    ops::fill_uniform_bf16(gpu, &x, x_elems, 22, 1.0)?;
    ops::fill_f32(gpu, &resid, len * h, 0.5)?;
    ops::fill_f32(gpu, &norm_w, h, 1.0)?;
    let layers = spec.num_layers as f64;
    let mut rows = Vec::new();
    let mut row = |what: String, t: f64, floor_s: f64| {
        rows.push(BenchRow {
            what: format!("prefill op x{} layers: {what}", spec.num_layers),
            batch: 1,
            ctx: len,
            ms: t * layers * 1e3,
            floor_ms: floor_s * layers * 1e3,
        });
    };
    for (name, out, inp, ty, acc) in linears {
        let t = timed(gpu, iters, || {
            ops::linear(
                gpu,
                out,
                len,
                inp,
                &w,
                &x,
                &y,
                ty,
                acc,
                ops::LinearImpl::Cublas,
            )
        })?;
        let flops = 2.0 * (out * inp * len) as f64;
        row(
            format!("linear {name} {out}x{inp}"),
            t,
            flops / ceil.gemm_flops,
        );
    }
    let t = timed(gpu, iters, || {
        ops::add_rmsnorm(
            gpu,
            &resid,
            len,
            None,
            &norm_w,
            &x,
            None,
            len,
            h,
            spec.rms_norm_eps,
        )
    })?;
    // f32 residual row read, bf16 row written; twice a layer
    let bytes = (len * h * 6) as f64;
    row(
        "add_rmsnorm x2".into(),
        2.0 * t,
        2.0 * bytes / ceil.hbm_traffic_bps,
    );
    // gate/up [len, 2 inter] bf16 (y, written by the gate_up GEMM above) -> [len, inter] (x)
    let t = timed(gpu, iters, || ops::swiglu(gpu, &y, &x, len, inter))?;
    let bytes = (len * inter * 6) as f64;
    row("swiglu".into(), t, bytes / ceil.hbm_traffic_bps);
    gpu.sync()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_step_reads_the_weights_but_only_its_rows_of_the_embedding_table() {
        let spec = llama31_8b();
        // Llama-3.1-8B in bf16: 16.06 GB of weights, 1.05 GB of them the (untied) table.
        let w = spec.num_params() as f64 * 2.0;
        let table = (128_256 * 4096) as f64 * 2.0;
        let one = decode_step_bytes(&spec, w, 1, 0);
        assert_eq!(one, w - table + 4096.0 * 2.0);
        // Each token of context adds its K and V in every layer: 32 x 2 x 8 x 128 x 2 B.
        assert_eq!(decode_step_bytes(&spec, w, 1, 512) - one, 512.0 * 131_072.0);
        assert_eq!(
            decode_step_bytes(&spec, w, 64, 0) - one,
            63.0 * 4096.0 * 2.0,
            "one embedding row per sequence"
        );
        let tied = ModelSpec {
            tie_word_embeddings: true,
            ..spec
        };
        assert_eq!(
            decode_step_bytes(&tied, w, 1, 0),
            w,
            "a tied table is read whole"
        );
    }

    #[test]
    fn step_table_has_the_ceilings_and_one_row_per_result() {
        let ceil = Ceilings {
            hbm_traffic_bps: 4.2e12,
            gemm_flops: 7.9e14,
        };
        let rows = [BenchRow {
            what: "decode graph".into(),
            batch: 8,
            ctx: 512,
            ms: 5.0,
            floor_ms: 4.0,
        }];
        let t = step_table(&ceil, &rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "ceilings: HBM copy traffic 4200 GB/s (read+write), bf16 GEMM 8192^3 790 TFLOP/s"
        );
        assert!(lines[1].starts_with("decode ceiling: the bytes a step must read"));
        assert_eq!(
            lines[2],
            "| what | batch | ctx | ms/step | ceiling ms | ratio |"
        );
        assert_eq!(
            lines[4],
            "| decode graph | 8 | 512 | 5.000 | 4.000 | 0.80 |"
        );
        assert_eq!(lines.len(), 5);
    }
}
