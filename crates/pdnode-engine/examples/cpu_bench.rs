//! Prefill and decode throughput of the CPU backend.
//!
//! `cargo run --release -p pdnode-engine --no-default-features --example cpu_bench -- \
//!     MODEL [--batch 1,16] [--prompt 128] [--decode 32] [--threads 0]`
//!
//! MODEL is an HF directory, a `.gguf` file, or `dummy:<preset>`. Each batch size runs `batch`
//! sequences of `prompt` random tokens through one prefill step each (one batch of all of them),
//! then `decode` steps of one token per sequence.

use pdnode_core::BlockId;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::loader::{DummySpec, dummy, load_dummy, load_path};
use std::path::Path;
use std::time::Instant;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .ok_or("usage: cpu_bench MODEL [--batch 1,16] [--prompt N] [--decode N] [--threads N]")?;
    let batches: Vec<usize> = arg(&args, "--batch", "1,16".to_string())
        .split(',')
        .filter_map(|x| x.parse().ok())
        .collect();
    let prompt: usize = arg(&args, "--prompt", 128);
    let decode: usize = arg(&args, "--decode", 32);
    let threads: u32 = arg(&args, "--threads", 0);
    let block_size = 16usize;
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let per_seq = (prompt + decode).div_ceil(block_size);
    let t0 = Instant::now();
    let loaded = match model.strip_prefix("dummy:") {
        Some(p) => load_dummy(
            p,
            DummySpec {
                seed: 0,
                std: dummy::DEFAULT_STD,
            },
            None,
        )?,
        None => load_path(Path::new(model))?,
    };
    let vocab = loaded.spec.vocab_size as u32;
    let mut b = CpuBackend::from_loaded(
        loaded,
        CpuBackendConfig {
            block_size: block_size as u32,
            num_blocks: (per_seq * max_batch) as u32,
            threads,
        },
    )?;
    println!("loaded {model} in {:.2}s", t0.elapsed().as_secs_f64());
    for &bs in &batches {
        let tables: Vec<Vec<BlockId>> = (0..bs)
            .map(|s| {
                (0..per_seq)
                    .map(|i| BlockId((s * per_seq + i) as u32))
                    .collect()
            })
            .collect();
        let prompts: Vec<Vec<u32>> = (0..bs)
            .map(|s| {
                (0..prompt)
                    .map(|i| ((s * 7919 + i * 104_729) as u32) % vocab)
                    .collect()
            })
            .collect();
        let t = Instant::now();
        let out = b.forward(&ForwardBatch {
            seqs: (0..bs)
                .map(|s| SeqStep {
                    tokens: &prompts[s],
                    start_pos: 0,
                    block_table: &tables[s],
                    want_logits: true,
                })
                .collect(),
        })?;
        let prefill = t.elapsed().as_secs_f64();
        let mut next: Vec<u32> = (0..bs).map(|s| argmax(out.row(s))).collect();
        let t = Instant::now();
        for step in 0..decode {
            let toks: Vec<[u32; 1]> = next.iter().map(|&x| [x]).collect();
            let out = b.forward(&ForwardBatch {
                seqs: (0..bs)
                    .map(|s| SeqStep {
                        tokens: &toks[s],
                        start_pos: prompt + step,
                        block_table: &tables[s],
                        want_logits: true,
                    })
                    .collect(),
            })?;
            next = (0..bs).map(|s| argmax(out.row(s))).collect();
        }
        let dec = t.elapsed().as_secs_f64();
        println!(
            "batch {bs:>3}: prefill {} tokens in {:.3}s = {:.1} tok/s; decode {} steps in {:.3}s = {:.1} tok/s ({:.1} ms/step)",
            bs * prompt,
            prefill,
            (bs * prompt) as f64 / prefill,
            decode,
            dec,
            (bs * decode) as f64 / dec,
            dec * 1e3 / decode as f64
        );
    }
    Ok(())
}

fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}
