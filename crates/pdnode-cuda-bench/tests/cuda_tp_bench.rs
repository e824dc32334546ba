//! Decode step time of the tensor-parallel CUDA backend at Llama-3.1-8B shapes, TP=1 against
//! TP=2, with the residual all-reduce cost per step (`pdnode_cuda_bench::tp`). Needs two GPUs:
//! `scripts/gpu/run-all.sh tp` runs it after the cuda_tp parity tests.

use pdnode_cuda_bench::tp as tp_bench;

#[test]
#[ignore = "needs two CUDA GPUs: run scripts/gpu/run-all.sh tp on the GPU host"]
fn tp_decode_scaling_llama31_8b() {
    let decode = [(1, 2048), (8, 2048), (32, 2048), (64, 2048)];
    let mut all = Vec::new();
    for tp in [1usize, 2] {
        let r = tp_bench::run_decode(tp, &decode, 20, |r| {
            eprintln!(
                "{:24} batch {:3} ctx {:5}: {:8.3} ms (floor {:.3} ms, {:.2} of roofline)",
                r.what,
                r.batch,
                r.ctx,
                r.ms,
                r.floor_ms,
                r.ratio()
            )
        })
        .unwrap();
        eprintln!(
            "ceilings tp={tp}: copy {:.0} GB/s, bf16 GEMM {:.0} TFLOP/s",
            r.ceilings.hbm_traffic_bps / 1e9,
            r.ceilings.gemm_flops / 1e12
        );
        for (batch, ms) in &r.all_reduce_ms {
            eprintln!(
                "TP all-reduce tp={tp} batch {batch:3}: {ms:.3} ms per step (64 x batch x 4096 f32)"
            );
        }
        all.push((r.rows, r.all_reduce_ms));
    }
    println!(
        "| what | batch | ctx | TP=1 ms | TP=2 ms | speed-up | TP=2 per-GPU roofline ms | TP=2 of roofline | TP=2 all-reduce ms/step |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let ar = &all[1].1;
    for (a, b) in all[0].0.iter().zip(&all[1].0) {
        let what = a.what.trim_end_matches(" tp=1");
        println!(
            "| {what} | {} | {} | {:.3} | {:.3} | {:.2}x | {:.3} | {:.2} | {:.3} |",
            a.batch,
            a.ctx,
            a.ms,
            b.ms,
            a.ms / b.ms,
            b.floor_ms,
            b.ratio(),
            ar.iter().find(|x| x.0 == a.batch).map_or(f64::NAN, |x| x.1)
        );
    }
}
