//! The decode step's L2 prefetches (issue 20): graph-replayed Llama-3.1-8B decode steps with
//! each [`ops::Fusion`] prefetch setting on one backend, the settings interleaved round by round
//! so drift between them shows as spread, not as a difference.

use super::{
    DecodeStep, bench_options, decode_blocks, decode_step_bytes, llama31_8b, measure_ceilings,
    timed_steps,
};
use pdnode_cuda::CudaError;
use pdnode_cuda::backend::CudaBackend;
use pdnode_cuda::ops::Fusion;

/// One setting of the comparison: its name, the fusion limits, programmatic dependent launch.
#[derive(Debug, Clone)]
pub struct PrefetchVariant {
    pub name: String,
    pub fusion: Fusion,
    pub pdl: bool,
}

/// The settings [`run_prefetch`] compares by default: no prefetch (the step before issue 20's
/// change), the o-projection alone, + the gate_up head, + the qkv head (the default), the
/// default with 16 MiB heads, with the o-projection prefetched up to 64 MiB of KV a layer, and
/// the default with PDL.
pub fn prefetch_variants() -> Vec<PrefetchVariant> {
    let on = Fusion::default();
    let v = |name: &str, fusion: Fusion, pdl: bool| PrefetchVariant {
        name: name.into(),
        fusion,
        pdl,
    };
    vec![
        v("off", on.without_prefetch(), false),
        v(
            "o",
            Fusion {
                l2_gate_up_head_bytes: 0,
                l2_qkv_head_bytes: 0,
                ..on
            },
            false,
        ),
        v(
            "o+gu",
            Fusion {
                l2_qkv_head_bytes: 0,
                ..on
            },
            false,
        ),
        v("o+gu+qkv (default)", on, false),
        v(
            "o+gu16+qkv16",
            Fusion {
                l2_gate_up_head_bytes: 16 << 20,
                l2_qkv_head_bytes: 16 << 20,
                ..on
            },
            false,
        ),
        v(
            "default, kv limit 64M",
            Fusion {
                l2_kv_max_bytes: 64 << 20,
                ..on
            },
            false,
        ),
        v("default+pdl", on, true),
    ]
}

/// One timing: a variant at one point, the median over the rounds.
#[derive(Debug, Clone)]
pub struct PrefetchRow {
    pub variant: String,
    pub batch: usize,
    pub ctx: usize,
    /// Median of the rounds' mean graph-step times, ms.
    pub ms: f64,
    /// Smallest and largest round, ms.
    pub min_ms: f64,
    pub max_ms: f64,
    /// The step's ceiling ([`decode_step_bytes`] at the copy rate), ms.
    pub ceiling_ms: f64,
}

/// Graph-replayed decode steps at each `(batch, ctx)`: `rounds` rounds, each timing every
/// variant once (`iters` steps after a warm-up that captures the graph). Returns the measured
/// copy rate (bytes of traffic per second) and a row per variant and point.
pub fn run_prefetch(
    decode: &[(usize, usize)],
    variants: &[PrefetchVariant],
    iters: usize,
    rounds: usize,
    mut report: impl FnMut(&PrefetchRow),
) -> Result<(f64, Vec<PrefetchRow>), CudaError> {
    let spec = llama31_8b();
    let bs = 16usize;
    let num_blocks = decode_blocks(decode, bs) + 8;
    let opts = bench_options(1, num_blocks, bs, 64, decode, true);
    let mut be = CudaBackend::new_dummy(&spec, 1234, &opts, "bench".into())?;
    be.fill_kv_random(99)?;
    let copy = measure_ceilings(be.gpu())?.hbm_traffic_bps;
    let wbytes = be.weight_bytes() as f64;
    let mut rows = Vec::new();
    for &(batch, ctx) in decode {
        let step = DecodeStep::new(batch, ctx, bs);
        let fb = step.batch();
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for _ in 0..rounds.max(1) {
            for (vi, v) in variants.iter().enumerate() {
                be.set_fusion(v.fusion);
                let pdl = be.set_pdl(v.pdl);
                if pdl != v.pdl {
                    continue; // no PDL on this GPU: the variant is left out
                }
                times[vi].push(timed_steps(&mut be, iters, &fb)? * 1e3);
            }
        }
        let ceiling_ms = decode_step_bytes(&spec, wbytes, batch, ctx) / copy * 1e3;
        for (v, mut t) in variants.iter().zip(times) {
            if t.is_empty() {
                continue;
            }
            t.sort_by(f64::total_cmp);
            let row = PrefetchRow {
                variant: v.name.clone(),
                batch,
                ctx,
                ms: t[t.len() / 2],
                min_ms: t[0],
                max_ms: t[t.len() - 1],
                ceiling_ms,
            };
            report(&row);
            rows.push(row);
        }
    }
    be.set_pdl(false);
    Ok((copy, rows))
}
