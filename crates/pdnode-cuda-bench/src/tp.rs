//! Decode step time of [`CudaTpBackend`] at Llama-3.1-8B shapes (dummy weights) for a given
//! tensor-parallel degree, against each GPU's HBM roofline (its weight slice plus its KV heads'
//! bytes over the measured copy bandwidth). TP = 1 runs through the same wrapper (one rank
//! thread) so the figures compare like with like.

use crate::{
    BenchRow, Ceilings, DecodeStep, bench_options, decode_blocks, llama31_8b, measure_ceilings,
};
use pdnode_cuda::CudaError;
use pdnode_cuda::backend::CudaOptions;
use pdnode_cuda::device::Gpu;
use pdnode_cuda::tp::CudaTpBackend;
use pdnode_engine::backend::{Backend, BackendError};
use std::time::Instant;

fn err(e: BackendError) -> CudaError {
    CudaError::Step(e)
}

/// What [`run_decode`] measured.
#[derive(Debug, Clone)]
pub struct TpDecode {
    pub ceilings: Ceilings,
    pub rows: Vec<BenchRow>,
    /// Per decode batch: ms per step spent in the residual all-reduces alone (2 per layer of
    /// `batch x hidden` f32, timed back to back; empty at TP = 1).
    pub all_reduce_ms: Vec<(usize, f64)>,
}

/// Decode steps at each `(batch, ctx)` with `tp` GPUs (`0 .. tp`). Rows: `decode tp=N` (device
/// time of back-to-back steps) and `decode+logits D2H tp=N` (what `Backend::forward` costs).
pub fn run_decode(
    tp: usize,
    decode: &[(usize, usize)],
    iters: usize,
    report: impl FnMut(&BenchRow),
) -> Result<TpDecode, CudaError> {
    let gpus: Vec<u32> = (0..tp.max(1) as u32).collect();
    run_decode_on(&gpus, decode, iters, report)
}

/// [`run_decode`] on the listed GPUs (rank `r` on `gpus[r]`, TP = `gpus.len()`); the ceilings
/// are measured on rank 0's GPU.
pub fn run_decode_on(
    gpus: &[u32],
    decode: &[(usize, usize)],
    iters: usize,
    mut report: impl FnMut(&BenchRow),
) -> Result<TpDecode, CudaError> {
    let tp = gpus.len();
    pdnode_cuda::tp::check_gpu_list(gpus, tp as u32)?;
    let spec = llama31_8b();
    let ceil = {
        let gpu = Gpu::new(gpus[0])?;
        measure_ceilings(&gpu)?
    };
    let bs = 16usize;
    let num_blocks = decode_blocks(decode, bs) + 8;
    let opts = CudaOptions {
        gpus: gpus.to_vec(),
        ..bench_options(tp as u32, num_blocks, bs, 64, decode, true)
    };
    let mut be = CudaTpBackend::new_dummy(&spec, 1234, None, &opts, "bench".into())?;
    be.fill_kv_random(99).map_err(err)?;
    let wbytes = be.weight_bytes_per_rank() as f64;
    let kv_per_tok = (spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2) as f64;
    let mut rows = Vec::new();
    let mut all_reduce_ms = Vec::new();
    for &(batch, ctx) in decode {
        let step = DecodeStep::new(batch, ctx, bs);
        let fb = step.batch();
        // Pipelined device time (steps enqueued back to back), eager then from the decode
        // CUDA graphs (captured in the warm-up step).
        let pipelined = |be: &mut CudaTpBackend| -> Result<f64, CudaError> {
            be.forward_device(&fb).map_err(err)?;
            be.synchronize().map_err(err)?;
            let t0 = Instant::now();
            for _ in 0..iters {
                be.forward_device(&fb).map_err(err)?;
            }
            be.synchronize().map_err(err)?;
            Ok(t0.elapsed().as_secs_f64() / iters as f64)
        };
        be.set_cuda_graphs(false).map_err(err)?;
        let eager_t = pipelined(&mut be)?;
        be.set_cuda_graphs(true).map_err(err)?;
        let replays0 = be.graph_stats().map_err(err)?;
        let dev_t = pipelined(&mut be)?;
        let replays1 = be.graph_stats().map_err(err)?;
        let graph_ran = replays0
            .iter()
            .zip(&replays1)
            .all(|(a, b)| b.replays >= a.replays + iters as u64);
        let n_host = iters.clamp(1, 5);
        // Each step waited for (what the engine loop sees), without then with the logits copy:
        // the difference is the copy of `batch x vocab` f32 to a host Vec on rank 0.
        let t0 = Instant::now();
        for _ in 0..n_host {
            be.forward_device(&fb).map_err(err)?;
            be.synchronize().map_err(err)?;
        }
        let serial_t = t0.elapsed().as_secs_f64() / n_host as f64;
        let t0 = Instant::now();
        for _ in 0..n_host {
            be.forward(&fb).map_err(err)?;
        }
        let host_t = t0.elapsed().as_secs_f64() / n_host as f64;
        // Per GPU: its weight slice (the embedding table is replicated: only `batch` rows of it
        // are read) and its share of the KV heads.
        let bytes = crate::decode_step_bytes(&spec, wbytes, batch, 0)
            + kv_per_tok * (batch * ctx) as f64 / tp as f64;
        let floor_ms = bytes / ceil.hbm_traffic_bps * 1e3;
        let graph = if graph_ran {
            "decode graph"
        } else {
            "decode graph (FELL BACK TO EAGER)"
        };
        for (what, t) in [
            ("decode eager", eager_t),
            (graph, dev_t),
            ("decode graph, each step waited", serial_t),
            ("decode graph+logits D2H", host_t),
        ] {
            let row = BenchRow {
                what: format!("{what} tp={tp}"),
                batch,
                ctx,
                ms: t * 1e3,
                floor_ms,
            };
            report(&row);
            rows.push(row);
        }
        if tp > 1 {
            let t = be
                .time_all_reduce(batch * spec.hidden_size, 200)
                .map_err(err)?;
            all_reduce_ms.push((batch, t * 2.0 * spec.num_layers as f64 * 1e3));
        }
    }
    Ok(TpDecode {
        ceilings: ceil,
        rows,
        all_reduce_ms,
    })
}
