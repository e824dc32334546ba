//! CUDA backend benchmarks on the GPU host (Llama-3.1-8B shapes, dummy weights): decode step time
//! vs the HBM roofline, prefill vs the bf16 GEMM peak, both ceilings measured in the same run.
//! `PDNODE_BENCH_DECODE="1x512,8x2048"`, `PDNODE_BENCH_PREFILL="2048,8192"`, `PDNODE_BENCH_ITERS`.

use pdnode_cuda::CudaError;
use pdnode_cuda::device::Gpu;
use pdnode_cuda::ops::{self, AttnVariant, EwKernel, LinearImpl};
use pdnode_cuda_bench::{self as bench, attn as attn_bench};

mod cuda_bench_trace;

fn env_list(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// `"BxC,BxC,..."` from `var` (else `default`): the (batch, context) points of a bench; entries
/// that do not parse are skipped.
fn batch_ctx_list(var: &str, default: &str) -> Vec<(usize, usize)> {
    env_list(var, default)
        .split(',')
        .filter_map(|s| {
            let (b, c) = s.split_once('x')?;
            Some((b.trim().parse().ok()?, c.trim().parse().ok()?))
        })
        .collect()
}

/// A step row as it is measured (stderr), before the table.
fn report_row(r: &bench::BenchRow) {
    eprintln!(
        "BENCH {} batch={} ctx={} ms={:.3} floor_ms={:.3} ratio={:.3}",
        r.what,
        r.batch,
        r.ctx,
        r.ms,
        r.floor_ms,
        r.ratio()
    )
}

/// The benchmarks share the GPU: one at a time, or each disturbs the other's timings.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
#[ignore = "needs a CUDA GPU (about 90 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_llama31_8b_shapes() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The step benchmarks build their backends with engine.cuda.pdl off (plain launches);
    // cuda_graphs' pdl tests compare both.
    println!("BENCH engine.cuda.pdl: programmatic dependent launch off");
    println!(
        "BENCH fusion (PDNODE_BENCH_FUSION, else the defaults): {:?}",
        bench::bench_fusion()
    );
    let decode: Vec<(usize, usize)> = batch_ctx_list(
        "PDNODE_BENCH_DECODE",
        "1x512,1x2048,1x8192,8x512,8x2048,8x8192,32x512,32x2048,32x8192,64x512,64x2048,64x8192",
    );
    let prefill: Vec<usize> = env_list("PDNODE_BENCH_PREFILL", "2048,8192")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "20").parse().unwrap_or(20);
    // e.g. "auto/table,v2narrow/table,v1/table,auto/cublas,auto/mma" (attention/linear, the
    // names of engine.cuda.attention and engine.cuda.linear); every prefill length runs with
    // each engine.cuda.prefill_attention choice
    let variants: Vec<(AttnVariant, LinearImpl)> = env_list("PDNODE_BENCH_VARIANTS", "auto/auto")
        .split(',')
        .filter_map(|v| {
            let (a, l) = v.trim().split_once('/')?;
            // the names of engine.cuda.attention / engine.cuda.linear
            let a = AttnVariant::parse(a)?;
            let l = LinearImpl::parse(l)?;
            Some((a, l))
        })
        .collect();
    let (ceil, rows) =
        bench::run_variants(&decode, &prefill, iters, &variants, report_row).expect("benchmark");
    print!("{}", bench::step_table(&ceil, &rows));
    if !prefill.is_empty() {
        // the prefill steps against the GEMM rate the GPU sustains for as long as they run
        let gpu = Gpu::new(0).expect("open GPU 0");
        let sustained = bench::sustained_gemm_flops(&gpu, 0.5, 0.5).expect("sustained GEMM");
        println!(
            "BENCH ceiling: bf16 GEMM 8192^3 sustained (0.5 s warm, 0.5 s timed) {:.0} TFLOP/s, \
             burst (20 calls) {:.0}",
            sustained / 1e12,
            ceil.gemm_flops / 1e12
        );
        for r in rows.iter().filter(|r| r.what.starts_with("prefill [")) {
            let floor = r.floor_ms * ceil.gemm_flops / sustained;
            println!(
                "BENCH {} ctx={} ms={:.3} sustained_floor_ms={floor:.3} ratio_sustained={:.3}",
                r.what,
                r.ctx,
                r.ms,
                floor / r.ms
            );
        }
    }
}

/// The decode attention kernel alone at Llama-3.1-8B attention shapes (one layer): K/V bytes read
/// per second and their fraction of the measured copy ceiling, per kernel variant; each variant's
/// output checked against the first's. `PDNODE_BENCH_ATTN="1x512,8x2048,32x8192,64x8192"`,
/// `PDNODE_BENCH_ATTN_VARIANTS="v4,v2,v2narrow"`, `PDNODE_BENCH_ITERS`.
#[test]
#[ignore = "needs a CUDA GPU (about 3 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_decode_attention_kernel() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cases: Vec<(usize, usize)> = env_list("PDNODE_BENCH_ATTN", "1x512,8x2048,32x8192,64x8192")
        .split(',')
        .filter_map(|s| {
            let (b, c) = s.split_once('x')?;
            Some((b.trim().parse().ok()?, c.trim().parse().ok()?))
        })
        .collect();
    let variants: Vec<AttnVariant> = env_list("PDNODE_BENCH_ATTN_VARIANTS", "v4,v2,v2narrow")
        .split(',')
        .filter_map(AttnVariant::parse)
        .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "20").parse().unwrap_or(20);
    let res = attn_bench::run_attention(&cases, &variants, iters, |r| {
        eprintln!(
            "ATTN {:?} batch={} ctx={} us={:.1} GB/s={:.0} frac_of_copy={:.3} rel_to_first={:.1e}",
            r.variant, r.batch, r.ctx, r.us, r.gbps, r.frac_of_copy, r.rel_to_first
        )
    })
    .expect("attention benchmark");
    let (copy, rows) = (res.copy_bps, res.rows);
    for (k, n) in &res.occupancy {
        println!("OCCUPANCY {k}: {n} blocks per SM");
    }
    println!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write); decode attention alone, 32 q / 8 kv heads, hd 128",
        copy / 1e9
    );
    println!(
        "| attention kernel | batch | ctx | us/layer | K/V GB/s | of copy ceiling | rel. diff vs first |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut bad = Vec::new();
    for r in &rows {
        println!(
            "| {:?} | {} | {} | {:.1} | {:.0} | {:.2} | {:.1e} |",
            r.variant, r.batch, r.ctx, r.us, r.gbps, r.frac_of_copy, r.rel_to_first
        );
        if r.rel_to_first.is_nan() || r.rel_to_first > 1e-2 {
            bad.push(format!("{:?} {}x{}", r.variant, r.batch, r.ctx));
        }
    }
    assert!(
        bad.is_empty(),
        "outputs differ from the first variant: {bad:?}"
    );
}

/// " m1 w12 b256" (tiles, warps, blocks; " pf": L2 prefetch hint) for tensor-core GEMV rows, "*" when not the default.
fn launch_tag(r: &bench::LinearRow) -> String {
    r.launch.map_or(String::new(), |l| {
        format!(
            " m{} w{} b{}{}{}",
            l.tiles,
            l.warps,
            l.blocks,
            if l.l2_prefetch { " pf" } else { "" },
            if r.forced { "*" } else { "" }
        )
    })
}

/// The linear layers of a Llama-3.1-8B decode step alone, per implementation and token count:
/// weight bytes read per second against the copy ceiling, each output checked against cuBLAS,
/// then the step's linear time (32 layers + lm_head) per implementation and for the best one
/// per layer. `PDNODE_BENCH_LINEAR_TOKENS="1,2,4,8,16,32,64"`,
/// `PDNODE_BENCH_LINEAR_IMPLS="mma,gemv,cublas,auto"`, `PDNODE_BENCH_ITERS`.
#[test]
#[ignore = "needs a CUDA GPU (about 4 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_linear_layers() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tokens: Vec<usize> = env_list("PDNODE_BENCH_LINEAR_TOKENS", "1,2,4,8,16,32,64")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let impls: Vec<LinearImpl> = env_list("PDNODE_BENCH_LINEAR_IMPLS", "mma,gemv,cublas,auto")
        .split(',')
        .filter_map(LinearImpl::parse)
        .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "20").parse().unwrap_or(20);
    let (copy, rows, steps) = bench::run_linear(&tokens, &impls, iters.max(50), |r| {
        eprintln!(
            "LINEAR {} {:?}{} t={} us={:.1} GB/s={:.0} frac_of_copy={:.3} rel_to_cublas={:.1e}",
            r.name,
            r.how,
            launch_tag(r),
            r.tokens,
            r.us,
            r.gbps,
            r.frac_of_copy,
            r.rel_to_cublas
        )
    })
    .expect("linear benchmark");
    println!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write); Llama-3.1-8B linear layers alone",
        copy / 1e9
    );
    println!(
        "| layer | out x in | tokens | impl | us | weight GB/s | of copy ceiling | rel. diff vs cuBLAS |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut bad = Vec::new();
    for r in &rows {
        println!(
            "| {} | {}x{} | {} | {:?}{} | {:.1} | {:.0} | {:.2} | {:.1e} |",
            r.name,
            r.out,
            r.inp,
            r.tokens,
            r.how,
            launch_tag(r),
            r.us,
            r.gbps,
            r.frac_of_copy,
            r.rel_to_cublas
        );
        if r.rel_to_cublas.is_nan() || r.rel_to_cublas > 1e-2 {
            bad.push(format!("{} {:?} t={}", r.name, r.how, r.tokens));
        }
    }
    println!(
        "| decode step linears (32 layers + lm_head) | tokens | impl | ms | floor ms | ratio |"
    );
    println!("|---|---|---|---|---|---|");
    for s in &steps {
        let how = s
            .how
            .map_or("best per layer".to_string(), |h| format!("{h:?}"));
        println!(
            "| step linears | {} | {how} | {:.3} | {:.3} | {:.2} |",
            s.tokens,
            s.ms,
            s.floor_ms,
            s.floor_ms / s.ms
        );
    }
    assert!(bad.is_empty(), "outputs differ from cuBLAS: {bad:?}");
}

/// The four decode linears at 1, 2 and 4 tokens through the step's current path and through the
/// streaming GEMV (`ops::gemv_stream`), one call after another on weights rotated past L2 (no
/// PDL: what a launch costs alone). `PDNODE_BENCH_LINEAR_TOKENS` picks the token counts.
#[test]
#[ignore = "benchmark: needs a CUDA GPU (sm_90)"]
fn bench_linear_stream() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tokens: Vec<usize> = env_list("PDNODE_BENCH_LINEAR_TOKENS", "1,2,4")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "100").parse().unwrap_or(100);
    let (copy, rows) = bench::run_linear_stream(&tokens, iters, |r| {
        eprintln!(
            "STREAM {} t={} auto_us={:.1} stream_us={:.1} rel={:.1e}",
            r.name, r.tokens, r.auto_us, r.stream_us, r.rel
        )
    })
    .expect("stream benchmark");
    println!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write)",
        copy / 1e9
    );
    println!(
        "| layer | out x in | tokens | step path us (of copy) | gemv_stream us (of copy) | rel. diff |"
    );
    println!("|---|---|---|---|---|---|");
    let mut bad = Vec::new();
    for r in &rows {
        println!(
            "| {} | {}x{} | {} | {:.1} ({:.2}) | {:.1} ({:.2}) | {:.1e} |",
            r.name,
            r.out,
            r.inp,
            r.tokens,
            r.auto_us,
            r.auto_frac,
            r.stream_us,
            r.stream_frac,
            r.rel
        );
        if r.rel.is_nan() || r.rel > 1e-2 {
            bad.push(format!("{} t={}", r.name, r.tokens));
        }
    }
    assert!(
        bad.is_empty(),
        "gemv_stream differs from the step path: {bad:?}"
    );
}

/// "tile 18 splitK 1 red 0 swz 0 st 20 cl 0 id 66" for a cuBLASLt row, "GemmEx" for the default.
fn lt_tag(r: &bench::LtRow) -> String {
    match (r.algo, r.config) {
        (Some(i), Some(c)) => format!(
            "Lt#{i} id {} tile {} splitK {} red {} swz {} st {} cl {} cust {}",
            c.id, c.tile, c.split_k, c.reduction, c.swizzle, c.stages, c.cluster, c.custom
        ),
        (Some(i), None) => format!("Lt#{i}"),
        (None, _) => "GemmEx".to_string(),
    }
}

/// The decode step's linears at 8-128 tokens (and a 2048-token prefill row) through
/// `cublasGemmEx`'s default algorithm against each cuBLASLt heuristic candidate (issue 20: the
/// GEMMs at 16-64 tokens run below their copy rate). Per shape the fastest candidate's config
/// and its fraction of the copy rate (bytes = weights + x + y). `PDNODE_BENCH_LT_TOKENS`,
/// `PDNODE_BENCH_LT_ALGOS` (16), `PDNODE_BENCH_ITERS` (100), `PDNODE_BENCH_LT_ROUNDS` (3).
#[test]
#[ignore = "needs a CUDA GPU (about 3 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_linear_cublaslt_algos() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tokens: Vec<usize> = env_list("PDNODE_BENCH_LT_TOKENS", "8,16,32,48,64,128,2048")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let num = |var: &str, d: usize| env_list(var, &d.to_string()).parse().unwrap_or(d);
    let (algos, iters, rounds) = (
        num("PDNODE_BENCH_LT_ALGOS", 16),
        num("PDNODE_BENCH_ITERS", 100),
        num("PDNODE_BENCH_LT_ROUNDS", 3),
    );
    let (copy, rows) = bench::run_linear_lt(&tokens, algos, iters, rounds, |r| {
        eprintln!(
            "LT {} t={} {} waves={:.2} us={:.1} frac_of_copy={:.3} TFLOP/s={:.0} rel={:.1e}",
            r.name,
            r.tokens,
            lt_tag(r),
            r.waves,
            r.us,
            r.frac_of_copy,
            r.tflops,
            r.rel_to_gemmex
        )
    })
    .expect("cuBLASLt benchmark");
    println!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write); bytes = weights + x + y (y twice when accumulated)",
        copy / 1e9
    );
    println!(
        "| layer | out x in | tokens | GemmEx us (of copy) | Lt heuristic #0 us | best Lt us (of copy) | gain vs GemmEx | best Lt config |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut bad = Vec::new();
    let mut keys: Vec<(&str, usize)> = rows.iter().map(|r| (r.name, r.tokens)).collect();
    keys.dedup();
    for (name, t) in keys {
        let of: Vec<&bench::LtRow> = rows
            .iter()
            .filter(|r| r.name == name && r.tokens == t)
            .collect();
        bad.extend(
            of.iter()
                .filter(|r| r.rel_to_gemmex.is_nan() || r.rel_to_gemmex > 1e-2)
                .map(|r| format!("{name} t={t} {}", lt_tag(r))),
        );
        let Some(ex) = of.iter().find(|r| r.algo.is_none()) else {
            continue;
        };
        let first = of.iter().find(|r| r.algo == Some(0));
        let best = of
            .iter()
            .filter(|r| r.algo.is_some())
            .min_by(|a, b| a.us.total_cmp(&b.us));
        let (first_us, best_cell, gain, cfg) = match (first, best) {
            (Some(f), Some(b)) => (
                format!("{:.1}", f.us),
                format!("{:.1} ({:.2})", b.us, b.frac_of_copy),
                format!("{:+.1} %", (ex.us / b.us - 1.0) * 100.0),
                lt_tag(b),
            ),
            _ => ("-".into(), "-".into(), "-".into(), "no Lt algo".into()),
        };
        println!(
            "| {name} | {}x{} | {t} | {:.1} ({:.2}) | {first_us} | {best_cell} | {gain} | {cfg} |",
            ex.out, ex.inp, ex.us, ex.frac_of_copy
        );
    }
    assert!(bad.is_empty(), "outputs differ from GemmEx: {bad:?}");
}

/// Where a decode step's time goes, op by op (eager steps, a CUDA event after each op):
/// `PDNODE_BENCH_OPS="1x512,8x512,64x512"` (batch x ctx), `PDNODE_BENCH_ITERS`.
#[test]
#[ignore = "needs a CUDA GPU (about 20 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_decode_op_breakdown() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let decode: Vec<(usize, usize)> = env_list("PDNODE_BENCH_OPS", "1x512,8x512,64x512")
        .split(',')
        .filter_map(|s| {
            let (b, c) = s.split_once('x')?;
            Some((b.trim().parse().ok()?, c.trim().parse().ok()?))
        })
        .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "20").parse().unwrap_or(20);
    // PDNODE_BENCH_OPS_MODEL: a preset (default llama-3.1-8b; e.g. deepseek-v2-lite)
    let model = env_list("PDNODE_BENCH_OPS_MODEL", "llama-3.1-8b");
    let spec = pdnode_engine::loader::dummy::preset(&model).expect("a known preset");
    println!("BENCH op breakdown of {model}");
    let rows = bench::run_op_breakdown(&spec, &decode, iters, |r| {
        eprintln!(
            "OPS {} batch={} ctx={} op={} calls={} us_per_step={:.1} us_per_call={:.2} share={:.3}",
            r.variant,
            r.batch,
            r.ctx,
            r.op,
            r.calls,
            r.us_per_step,
            r.us_per_step / r.calls.max(1) as f64,
            r.share
        )
    })
    .expect("op breakdown");
    println!(
        "| decode op (eager, events) | run | batch | ctx | calls/step | us/step | us/call | share |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.3} |",
            r.op,
            r.variant,
            r.batch,
            r.ctx,
            r.calls,
            r.us_per_step,
            r.us_per_step / r.calls.max(1) as f64,
            r.share
        );
    }
    assert!(
        rows.iter().any(|r| r.op == "TOTAL" && r.us_per_step > 0.0),
        "no op was timed"
    );
}

/// A prefill step's ops (eager, an event after each) at Llama-3.1-8B shapes, per prefill length
/// (`PDNODE_BENCH_OPS_PREFILL`, default "2048,8192") with the prefill attention
/// `PDNODE_BENCH_OPS_PREFILL_ATTN` (the names of `engine.cuda.prefill_attention`, default
/// `wgmma`).
#[test]
#[ignore = "needs a CUDA GPU (about 30 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_prefill_op_breakdown() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let lens: Vec<usize> = env_list("PDNODE_BENCH_OPS_PREFILL", "2048,8192")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let attn = pdnode_cuda::prefill::PrefillAttn::parse(&env_list(
        "PDNODE_BENCH_OPS_PREFILL_ATTN",
        "wgmma",
    ))
    .expect("an engine.cuda.prefill_attention name");
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "5").parse().unwrap_or(5);
    let spec = pdnode_engine::loader::dummy::preset("llama-3.1-8b").expect("the preset");
    let rows = bench::run_prefill_op_breakdown(&spec, &lens, iters, attn, |r| {
        eprintln!(
            "PREFILL OPS {} len={} op={} calls={} us_per_step={:.1} share={:.3}",
            r.variant, r.ctx, r.op, r.calls, r.us_per_step, r.share
        )
    })
    .expect("prefill op breakdown");
    println!("| prefill op (eager, events) | attention | tokens | calls/step | ms/step | share |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.3} |",
            r.op,
            r.variant,
            r.ctx,
            r.calls,
            r.us_per_step / 1e3,
            r.share
        );
    }
    assert!(
        rows.iter().any(|r| r.op == "TOTAL" && r.us_per_step > 0.0),
        "no op was timed"
    );
}

/// The decode-step fusions alone (fused launch vs the launches it replaces) at 1..=8 tokens:
/// what `engine.cuda.fuse_swiglu_max_tokens` / `fuse_norm_max_tokens` should be.
#[test]
#[ignore = "needs a CUDA GPU (about 2 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_decode_fusions() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "20").parse().unwrap_or(20);
    let rows = bench::run_fusions(&[1, 2, 3, 4, 8], iters.max(50), |r| {
        eprintln!(
            "FUSE {} t={} fused_us={:.1} unfused_same_launch_us={:.1} auto_unfused_us={:.1} saved_vs_auto_us={:.1}",
            r.what,
            r.tokens,
            r.fused_us,
            r.unfused_us,
            r.auto_unfused_us,
            r.auto_unfused_us - r.fused_us
        )
    })
    .expect("fusion benchmark");
    println!("| fusion | tokens | fused us | unfused (same GEMV) us | Auto unfused us |");
    println!("|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} |",
            r.what, r.tokens, r.fused_us, r.unfused_us, r.auto_unfused_us
        );
    }
    assert!(!rows.is_empty(), "no fusion was timed");
}

/// Decode-step settings side by side (issue 20): graph-replayed Llama-3.1-8B steps per
/// setting, interleaved rounds, the median round against the step's ceiling (the bytes a step
/// must read at the copy rate, `decode_step_bytes`). `PDNODE_BENCH_STEPS="1x512,8x512"`,
/// `PDNODE_BENCH_STEP_VARIANTS="default,s2n0,s0n0,default+pdl"` (`StepVariant::parse`),
/// `PDNODE_BENCH_ITERS` (steps a round, default 40), `PDNODE_BENCH_ROUNDS` (default 3).
#[test]
#[ignore = "needs a CUDA GPU (about 30 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_decode_step_variants() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let decode: Vec<(usize, usize)> = batch_ctx_list(
        "PDNODE_BENCH_STEPS",
        "1x512,1x2048,1x8192,2x512,4x512,8x512,8x2048",
    );
    let variants: Vec<bench::StepVariant> =
        env_list("PDNODE_BENCH_STEP_VARIANTS", "default,s2n0,s0n0,s1n0,s0n1")
            .split(',')
            .filter_map(bench::StepVariant::parse)
            .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "40").parse().unwrap_or(40);
    let rounds: usize = env_list("PDNODE_BENCH_ROUNDS", "3").parse().unwrap_or(3);
    let (copy, rows) = bench::run_step_variants(&decode, &variants, iters, rounds, |r| {
        eprintln!(
            "STEP {} batch={} ctx={} ms={:.3} min={:.3} max={:.3} ceiling_ms={:.3} ratio={:.3}",
            r.variant,
            r.batch,
            r.ctx,
            r.ms,
            r.min_ms,
            r.max_ms,
            r.ceiling_ms,
            r.ceiling_ms / r.ms
        )
    })
    .expect("step variants benchmark");
    println!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write); decode ceiling: weights less the embedding table, B rows of it, the KV of B x ctx tokens, at the copy rate",
        copy / 1e9
    );
    println!(
        "| step setting | batch | ctx | graph ms (median of rounds) | min..max | ceiling ms | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.3} | {:.3}..{:.3} | {:.3} | {:.2} |",
            r.variant,
            r.batch,
            r.ctx,
            r.ms,
            r.min_ms,
            r.max_ms,
            r.ceiling_ms,
            r.ceiling_ms / r.ms
        );
    }
    assert!(!rows.is_empty(), "nothing was timed");
}

/// Seconds per call of `f` (after one warm-up call), `iters` calls back to back, one sync.
fn time_calls(
    gpu: &Gpu,
    iters: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?;
    gpu.sync()?;
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        f()?;
    }
    gpu.sync()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// One op of [`bench_prefill_elementwise_old_vs_new`]: (op, tokens, [old, new] seconds a call,
/// bytes moved a call, calls a layer, whether the outputs agree).
type EwRow = (&'static str, usize, [f64; 2], f64, f64, String);

/// The prefill elementwise kernels alone, old (scalar) against new (vectorized) at Llama-3.1-8B
/// shapes (hidden 4096, inter 14336): swiglu, add_rmsnorm without delta (the model's call, twice
/// a layer) and with delta (the TP residual add). Bytes moved per second against the copy
/// ceiling, the time scaled to the 32 layers of a prefill step as `bench_llama31_8b_shapes`
/// reports it ("prefill op x32 layers"), and the two kernels' outputs compared (swiglu
/// bit-identical). `PDNODE_BENCH_PREFILL="2048,8192"`, `PDNODE_BENCH_ITERS`.
#[test]
#[ignore = "needs a CUDA GPU (about 4 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_prefill_elementwise_old_vs_new() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tokens: Vec<usize> = env_list("PDNODE_BENCH_PREFILL", "2048,8192")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let iters = env_list("PDNODE_BENCH_ITERS", "20")
        .parse::<usize>()
        .unwrap_or(20)
        .max(50);
    let gpu = Gpu::new(0).expect("open GPU 0");
    let copy = bench::measure_ceilings(&gpu)
        .expect("ceilings")
        .hbm_traffic_bps;
    let (h, inter, layers, eps) = (4096usize, 14336usize, 32.0, 1e-5f32);
    let tmax = tokens.iter().copied().max().unwrap_or(0);
    let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
    let (gu, act) = (alloc(tmax * 2 * inter * 2), alloc(tmax * inter * 2));
    let (resid, delta, w, normed) = (
        alloc(tmax * h * 4),
        alloc(tmax * h * 4),
        alloc(h * 4),
        alloc(tmax * h * 2),
    );
    ops::fill_uniform_bf16(&gpu, &gu, tmax * 2 * inter, 5, 4.0).expect("fill");
    let host: Vec<f32> = (0..tmax * h)
        .map(|i| ((i as u64 * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    gpu.upload(&resid, 0, &host).expect("upload");
    ops::fill_f32(&gpu, &delta, tmax * h, 0.0).expect("fill");
    ops::fill_f32(&gpu, &w, h, 1.0).expect("fill");
    let mut rows: Vec<EwRow> = Vec::new();
    let mut bad = Vec::new();
    let kinds = [EwKernel::Scalar, EwKernel::Vector];
    for &t in &tokens {
        // swiglu: [t, 2 inter] bf16 read, [t, inter] bf16 written
        let mut s = [0.0; 2];
        let mut outs = Vec::new();
        for (i, k) in kinds.into_iter().enumerate() {
            s[i] = time_calls(&gpu, iters, || {
                ops::swiglu_with(&gpu, &gu, &act, t, inter, Some(k)).map(|_| ())
            })
            .expect("swiglu");
            let n = (t * inter).min(1 << 22);
            let mut v = vec![0u16; n];
            gpu.download(&mut v, &act, 0).expect("download");
            outs.push(v);
        }
        let same = outs[0] == outs[1];
        if !same {
            bad.push(format!("swiglu t={t}: outputs differ"));
        }
        let agree = format!("bit-identical {same}");
        rows.push(("swiglu", t, s, (t * inter * 6) as f64, 1.0, agree));
        // add_rmsnorm: f32 row read, bf16 row written (with delta: delta read, resid written)
        for with_delta in [false, true] {
            let mut s = [0.0; 2];
            let mut outs = Vec::new();
            for (i, k) in kinds.into_iter().enumerate() {
                s[i] = time_calls(&gpu, iters, || {
                    let d = with_delta.then_some(&delta);
                    ops::add_rmsnorm_with(&gpu, &resid, t, d, &w, &normed, None, t, h, eps, Some(k))
                        .map(|_| ())
                })
                .expect("add_rmsnorm");
                outs.push(
                    gpu.download_bf16(&normed, (t * h).min(1 << 22))
                        .expect("dl"),
                );
            }
            let num: f64 = outs[0]
                .iter()
                .zip(&outs[1])
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let den: f64 = outs[0].iter().map(|a| (*a as f64).powi(2)).sum();
            let rel = (num / den.max(1e-30)).sqrt();
            if rel.is_nan() || rel > 1e-2 {
                bad.push(format!("add_rmsnorm t={t} delta={with_delta}: rel {rel}"));
            }
            let (op, bytes, calls) = if with_delta {
                ("add_rmsnorm +delta", t * h * 14, 1.0)
            } else {
                ("add_rmsnorm x2", t * h * 6, 2.0)
            };
            rows.push((op, t, s, bytes as f64, calls, format!("rel diff {rel:.1e}")));
        }
    }
    println!(
        "ceilings: HBM copy traffic {:.0} GB/s (read+write); prefill elementwise kernels alone, \
         hidden {h}, inter {inter}, x{layers} layers",
        copy / 1e9
    );
    println!(
        "| elementwise op | tokens | old us | new us | speedup | old GB/s | new GB/s | new of copy ceiling | x32 layers old ms | new ms | floor ms | outputs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (op, t, s, bytes, calls, agree) in &rows {
        let scale = layers * calls * 1e3;
        eprintln!(
            "EW {op} tokens={t} old_us={:.1} new_us={:.1} speedup={:.2} old_GB/s={:.0} new_GB/s={:.0} new_frac_of_copy={:.3}",
            s[0] * 1e6,
            s[1] * 1e6,
            s[0] / s[1],
            bytes / s[0] / 1e9,
            bytes / s[1] / 1e9,
            bytes / s[1] / copy
        );
        println!(
            "| {op} | {t} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {agree} |",
            s[0] * 1e6,
            s[1] * 1e6,
            s[0] / s[1],
            bytes / s[0] / 1e9,
            bytes / s[1] / 1e9,
            bytes / s[1] / copy,
            s[0] * scale,
            s[1] * scale,
            bytes / copy * scale
        );
    }
    assert!(bad.is_empty(), "old and new kernels disagree: {bad:?}");
}

/// DeepSeek-V2-Lite shapes (latent attention, 64 routed experts, top-6, dummy weights, one GPU):
/// decode steps against the bytes a step must read (the experts its rows picked, counted per
/// layer), prefill against the FLOPs it must do. `PDNODE_BENCH_MLA_DECODE="1x512,8x2048"`,
/// `PDNODE_BENCH_MLA_PREFILL="512,2048"`, `PDNODE_BENCH_ITERS`.
#[test]
#[ignore = "needs a CUDA GPU (about 40 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_deepseek_v2_lite_shapes() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let spec = pdnode_engine::loader::dummy::preset("deepseek-v2-lite").expect("preset");
    let decode = batch_ctx_list(
        "PDNODE_BENCH_MLA_DECODE",
        "1x512,1x2048,1x8192,8x512,8x2048,32x512,64x512",
    );
    let prefill: Vec<usize> = env_list("PDNODE_BENCH_MLA_PREFILL", "512,2048")
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let iters: usize = env_list("PDNODE_BENCH_ITERS", "20").parse().unwrap_or(20);
    let (ceil, rows) =
        bench::run_mla(&spec, &decode, &prefill, iters, report_row).expect("benchmark");
    print!("{}", bench::step_table(&ceil, &rows));
}
