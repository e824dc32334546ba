//! DeepSeek-V2-Lite shapes (latent attention, 64 routed experts, top-6, two shared) on one GPU
//! with dummy weights: decode steps against the bytes a step must read, prefill against the
//! FLOPs it must do, both at ceilings measured in the same run.
//!
//! Decode bytes: every attention projection, dense MLP, router and shared expert; of the routed
//! experts only those the step's rows picked (counted per layer from the step's own picks); the
//! embedding rows of the batch, the final norm, the lm_head; the latents of `batch * ctx`
//! positions over every layer. Prefill FLOPs: `2 * active parameters * tokens` (the top-k
//! routed experts, the shared ones and the routers per token, the lm_head for the last row
//! only) plus causal
//! attention in the expanded form (`q . k` over `qk_head_dim`, `p . v` over `v_head_dim`, half
//! the square), and expanding each latent into its heads' keys and values.

use super::{BenchRow, Ceilings, measure_ceilings, timed_steps};
use pdnode_core::BlockId;
use pdnode_cuda::CudaError;
use pdnode_cuda::backend::CudaBackend;
use pdnode_cuda::mla_weights::DevMla;
use pdnode_engine::backend::{ForwardBatch, SeqStep};
use pdnode_engine::spec::ModelSpec;

/// Decode and prefill rows at `spec`'s shapes (a latent-attention preset).
pub fn run_mla(
    spec: &ModelSpec,
    decode: &[(usize, usize)],
    prefill: &[usize],
    iters: usize,
    mut report: impl FnMut(&BenchRow),
) -> Result<(Ceilings, Vec<BenchRow>), CudaError> {
    let m = spec.mla.as_ref().ok_or_else(|| CudaError::Unsupported {
        reason: "run_mla needs a latent-attention spec".into(),
    })?;
    let bs = 16usize;
    let max_prefill = prefill.iter().copied().max().unwrap_or(1);
    let num_blocks = super::decode_blocks(decode, bs).max(max_prefill.div_ceil(bs)) + 8;
    let opts = super::bench_options(1, num_blocks, bs, max_prefill.max(64), decode, true);
    let mut be = CudaBackend::new_dummy(spec, 1234, &opts, "bench".into())?;
    be.fill_kv_random(99)?;
    let ceil = measure_ceilings(be.gpu())?;
    let (h, v) = (spec.hidden_size, spec.vocab_size);
    let latent_bytes = (spec.num_layers * m.latent_dim() * 2) as f64;
    let mut rows = Vec::new();
    for &(batch, ctx) in decode {
        let nb = ctx.div_ceil(bs);
        let tables: Vec<Vec<BlockId>> = (0..batch)
            .map(|i| (0..nb).map(|j| BlockId((i * nb + j) as u32)).collect())
            .collect();
        let toks: Vec<[u32; 1]> = (0..batch).map(|i| [((i * 7919 + 11) % v) as u32]).collect();
        let fb = ForwardBatch {
            seqs: (0..batch)
                .map(|i| SeqStep {
                    tokens: &toks[i],
                    start_pos: ctx - 1,
                    block_table: &tables[i],
                    want_logits: true,
                })
                .collect(),
        };
        let mut add = |what: &str, ms: f64, touched: &[usize]| -> Result<(), CudaError> {
            let layers = DevMla::step_bytes(spec, touched)? as f64;
            let lm_head = (v * h * 2) as f64;
            let bytes = layers
                + lm_head
                + (batch * h * 2 + h * 4) as f64
                + latent_bytes * (batch * ctx) as f64;
            let mean = touched.iter().sum::<usize>() as f64 / touched.len().max(1) as f64;
            let row = BenchRow {
                what: format!("{what} (experts touched/layer {mean:.1})"),
                batch,
                ctx,
                ms,
                floor_ms: bytes / ceil.hbm_traffic_bps * 1e3,
            };
            report(&row);
            rows.push(row);
            Ok(())
        };
        be.set_cuda_graphs(false);
        let eager = timed_steps(&mut be, iters, &fb)?;
        let touched = be.experts_touched(batch)?;
        add("deepseek decode eager", eager * 1e3, &touched)?;
        be.set_cuda_graphs(true);
        let replays0 = be.graph_stats().replays;
        let graph = timed_steps(&mut be, iters, &fb)?;
        let ran = be.graph_stats().replays >= replays0 + iters as u64;
        let touched = be.experts_touched(batch)?;
        let what = if ran {
            "deepseek decode graph"
        } else {
            "deepseek decode graph (FELL BACK TO EAGER)"
        };
        add(what, graph * 1e3, &touched)?;
    }
    for &len in prefill {
        let tbl: Vec<BlockId> = (0..len.div_ceil(bs)).map(|j| BlockId(j as u32)).collect();
        let toks: Vec<u32> = (0..len).map(|i| ((i * 31 + 7) % v) as u32).collect();
        let fb = super::prompt_batch(&toks, &tbl);
        let t = timed_steps(&mut be, iters.min(3), &fb)?;
        // Parameters a token runs through: bf16 bytes of a one-row step / 2.
        let per_token = DevMla::step_bytes(spec, &[])? as f64 / 2.0;
        let nh = spec.num_heads;
        let attn = 2.0
            * (len as f64).powi(2)
            * 0.5
            * (nh * (m.qk_head_dim() + m.v_head_dim) * spec.num_layers) as f64;
        let expand = 2.0
            * len as f64
            * (m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) * spec.num_layers) as f64;
        let flops = 2.0 * per_token * len as f64 + attn + expand + 2.0 * (v * h) as f64;
        let row = BenchRow {
            what: "deepseek prefill".into(),
            batch: 1,
            ctx: len,
            ms: t * 1e3,
            floor_ms: flops / ceil.gemm_flops * 1e3,
        };
        report(&row);
        rows.push(row);
    }
    Ok((ceil, rows))
}
