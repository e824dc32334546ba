//! `pdnode bench-engine` (hidden): the CUDA backend's step times at Llama-3.1-8B shapes with
//! dummy weights, against ceilings measured in the same run (HBM copy traffic, bf16 GEMM peak).
//! Owned by the CUDA backend work; the same code runs in `tests/cuda_bench.rs`.

use anyhow::Context;
use pdnode_cuda::probe;
use pdnode_cuda_bench::{self as bench, tp as tp_bench};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Decode points as BATCHxCONTEXT, comma-separated.
    #[arg(
        long,
        default_value = "1x512,1x2048,1x8192,8x512,8x2048,8x8192,32x512,32x2048,32x8192,64x512,64x2048,64x8192"
    )]
    pub decode: String,
    /// Prefill prompt lengths, comma-separated (empty: none).
    #[arg(long, default_value = "2048,8192")]
    pub prefill: String,
    /// Timed steps per point.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Tensor-parallel degree (GPUs 0..tp). Above 1: the decode points only, through the
    /// tensor-parallel backend, with the residual all-reduce cost per step.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
}

fn parse_list<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("bad {what} value {x:?}"))
        })
        .collect()
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init_default()?;
    let p = probe().context("bench-engine needs a CUDA device")?;
    let decode: Vec<(usize, usize)> = args
        .decode
        .split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            let (b, c) = x
                .split_once('x')
                .ok_or_else(|| anyhow::anyhow!("decode point {x:?} is not BATCHxCONTEXT"))?;
            Ok((b.trim().parse()?, c.trim().parse()?))
        })
        .collect::<anyhow::Result<_>>()?;
    let prefill: Vec<usize> = parse_list(&args.prefill, "prefill")?;
    let iters = args.iters.max(1);
    if args.tp > 1 {
        let tp = args.tp;
        let r = tokio::task::spawn_blocking(move || {
            tp_bench::run_decode(tp, &decode, iters, |r| {
                eprintln!(
                    "{} batch={} ctx={}: {:.3} ms (ceiling {:.3} ms, {:.2})",
                    r.what,
                    r.batch,
                    r.ctx,
                    r.ms,
                    r.floor_ms,
                    r.ratio()
                )
            })
        })
        .await??;
        println!(
            "ceilings (GPU 0): HBM copy traffic {:.0} GB/s (read+write); ceiling = per-GPU bytes",
            r.ceilings.hbm_traffic_bps / 1e9
        );
        println!("| what | batch | ctx | ms/step | ceiling ms | ratio | all-reduce ms/step |");
        println!("|---|---|---|---|---|---|---|");
        for row in r.rows {
            let ar = r.all_reduce_ms.iter().find(|x| x.0 == row.batch);
            println!(
                "| {} | {} | {} | {:.3} | {:.3} | {:.2} | {:.3} |",
                row.what,
                row.batch,
                row.ctx,
                row.ms,
                row.floor_ms,
                row.ratio(),
                ar.map_or(f64::NAN, |x| x.1)
            );
        }
        return Ok(());
    }
    let (ceil, rows) = tokio::task::spawn_blocking(move || {
        bench::run(&decode, &prefill, iters, |r| {
            eprintln!(
                "{} batch={} ctx={}: {:.3} ms (ceiling {:.3} ms, {:.2})",
                r.what,
                r.batch,
                r.ctx,
                r.ms,
                r.floor_ms,
                r.ratio()
            )
        })
    })
    .await??;
    println!("device: {:?}", p.devices.first());
    print!("{}", bench::step_table(&ceil, &rows));
    Ok(())
}
