//! DeepSeek-family models on the CUDA backend (latent attention over the latent pool, experts
//! routed on the device) against transformers' references of the tiny fixtures and the CPU
//! backend; the host-grouped expert path of large steps against the expert-major kernels of
//! small ones; decode graphs against eager steps; latent KV read from one backend and written
//! into another (what a hand-off does) against colocated decoding. GPU only: `#[ignore]`d, run by
//! scripts/gpu/run-all.sh (`deepseek`).

mod cuda_fixtures;
mod cuda_support;

use cuda_fixtures::*;
use cuda_support::rel_err;
use pdnode_core::{BlockId, KvKind};
use pdnode_cuda::ops::{AttnVariant, LinearImpl};
use pdnode_cuda::{CudaBackend, CudaOptions};
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::loader::{LoadedModel, load_path};

const MODELS: [&str; 3] = ["deepseek_v2", "deepseek_v3", "deepseek_v3_fp8"];
const BLOCK: u32 = 16;

fn opts(graphs: bool, max_batch_tokens: usize, blocks: u32) -> CudaOptions {
    opts_gemm(graphs, max_batch_tokens, blocks, 64)
}

/// `gemm_min`: sequences of at least this many new tokens take the GEMM prefill path.
fn opts_gemm(graphs: bool, max_batch_tokens: usize, blocks: u32, gemm_min: usize) -> CudaOptions {
    CudaOptions {
        gpus: vec![0],
        tensor_parallel: 1,
        mem_fraction: 0.9,
        num_kv_blocks: blocks,
        block_size: BLOCK,
        max_batch_tokens,
        max_seqs: 8,
        prefill_gemm_min_tokens: gemm_min,
        linear: LinearImpl::Auto,
        attention: AttnVariant::Auto.into(),
        prefill_attention: Default::default(),
        cuda_graphs: graphs,
        gpu_sampling: true,
        pdl: false,
        fusion: pdnode_cuda::ops::Fusion::default(),
        warm_up_context: 0,
    }
}

fn load(name: &str) -> LoadedModel {
    load_path(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn cpu(model: &LoadedModel, blocks: u32) -> CpuBackend {
    CpuBackend::from_loaded(
        model.clone(),
        CpuBackendConfig {
            block_size: BLOCK,
            num_blocks: blocks,
            threads: 2,
        },
    )
    .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn deepseek_fixtures_match_transformers_and_the_cpu_backend() {
    let mut report = Vec::new();
    for name in MODELS {
        let r = reference(name);
        let model = load(name);
        let cpu_rows = rows(&mut cpu(&model, 64), &r, 5);
        // the decode kernel for every chunk (without, then with graphs), then the GEMM path for
        // every chunk of the prompt
        for (graphs, gemm_min) in [(false, 64), (true, 64), (false, 1)] {
            let o = opts_gemm(graphs, 512, 64, gemm_min);
            let mut cuda = CudaBackend::from_loaded(&model, &o).unwrap();
            let m = model.spec.mla.as_ref().unwrap();
            let layout = cuda.kv_layout().clone();
            assert_eq!(layout.kind, KvKind::Latent);
            assert_eq!(
                (layout.kv_heads_per_rank, layout.head_dim as usize),
                (1, m.latent_dim())
            );
            let got = rows(&mut cuda, &r, 5);
            let (mut worst_hf, mut worst_cpu, mut flips) = (0f32, 0f32, 0);
            for (step, row) in got.iter().enumerate() {
                let (e_hf, e_cpu) = (rel_err(row, &r.logits[step]), rel_err(row, &cpu_rows[step]));
                worst_hf = worst_hf.max(e_hf);
                worst_cpu = worst_cpu.max(e_cpu);
                assert!(
                    e_hf < 3e-2 && e_cpu < 3e-2,
                    "{name} graphs={graphs} gemm_min={gemm_min} step {step}: rel err vs HF \
                     {e_hf}, vs CPU {e_cpu}"
                );
                if step < r.greedy.len() && argmax(row) != r.greedy[step] {
                    flips += 1;
                    let mg = margin(&r.logits[step]);
                    assert!(
                        mg < 0.05 * r.logits[step].iter().fold(0f32, |a, b| a.max(b.abs())),
                        "{name} graphs={graphs} step {step}: greedy {} vs HF {} (margin {mg})",
                        argmax(row),
                        r.greedy[step]
                    );
                }
            }
            if graphs {
                assert!(
                    cuda.graph_stats().replays > 0,
                    "{name}: no decode step replayed"
                );
            }
            report.push(format!(
                "{name:16} graphs={graphs:5} gemm_min={gemm_min:2}: worst rel err vs HF {worst_hf:.2e}, vs CPU \
                 {worst_cpu:.2e}, greedy flips {flips}/{}",
                r.greedy.len()
            ));
        }
    }
    for l in report {
        eprintln!("PARITY {l}");
    }
}

/// Four sequences of `len` random tokens in one step, each wanting its last row's logits.
fn big_step(b: &mut dyn Backend, seqs: &[Vec<u32>], tables: &[Vec<BlockId>]) -> Vec<Vec<f32>> {
    let l = b
        .forward(&ForwardBatch {
            seqs: seqs
                .iter()
                .zip(tables)
                .map(|(s, t)| SeqStep {
                    tokens: s,
                    start_pos: 0,
                    block_table: t,
                    want_logits: true,
                })
                .collect(),
        })
        .unwrap();
    (0..seqs.len()).map(|i| l.row(i).to_vec()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn a_large_step_groups_the_experts_on_the_host_as_small_steps_run_them_on_the_device() {
    for name in ["deepseek_v2", "deepseek_v3"] {
        let model = load(name);
        let e = model.spec.moe.as_ref().unwrap();
        // Past the expert-major kernels' limit in one step, far below it per chunk; three
        // prompts take the GEMM attention path (>= 64 new tokens), the third sequence's 10
        // tokens the decode kernel through its token list, in the same step.
        let n = 4;
        let len = pdnode_cuda::ops::MOE_GEMV_MAX_PAIRS / (e.top_k * 3) + 9;
        let lens = [len, len, 10, len];
        let vocab = model.spec.vocab_size as u32;
        let seqs: Vec<Vec<u32>> = (0..n as u32)
            .map(|s| {
                (0..lens[s as usize] as u32)
                    .map(|i| (i * 31 + s * 17 + 5) % vocab)
                    .collect()
            })
            .collect();
        let per = len.div_ceil(BLOCK as usize) as u32;
        let tables: Vec<Vec<BlockId>> = (0..n as u32)
            .map(|s| (0..per).map(|b| BlockId(s * per + b)).collect())
            .collect();
        let blocks = n as u32 * per;
        let want = big_step(&mut cpu(&model, blocks), &seqs, &tables);
        let pairs: usize = lens.iter().sum::<usize>() * e.top_k;
        assert!(pairs > pdnode_cuda::ops::MOE_GEMV_MAX_PAIRS);
        let mut big = CudaBackend::from_loaded(&model, &opts(false, n * len, blocks)).unwrap();
        let got = big_step(&mut big, &seqs, &tables);
        // The same sequences in chunks of 8 tokens (8 k pairs a step: the device kernels).
        let mut small = CudaBackend::from_loaded(&model, &opts(false, n * len, blocks)).unwrap();
        for (i, (s, t)) in seqs.iter().zip(&tables).enumerate() {
            let mut last = Vec::new();
            for (c, chunk) in s.chunks(8).enumerate() {
                let l = small
                    .forward(&ForwardBatch {
                        seqs: vec![SeqStep {
                            tokens: chunk,
                            start_pos: c * 8,
                            block_table: t,
                            want_logits: (c + 1) * 8 >= s.len(),
                        }],
                    })
                    .unwrap();
                if (c + 1) * 8 >= s.len() {
                    last = l.row(0).to_vec();
                }
            }
            let (e_cpu, e_small) = (rel_err(&got[i], &want[i]), rel_err(&got[i], &last));
            eprintln!(
                "{name} seq {i}: grouped vs CPU {e_cpu:.2e}, vs device kernels {e_small:.2e}"
            );
            assert!(e_cpu < 3e-2, "{name} seq {i}: grouped vs CPU {e_cpu}");
            assert!(
                e_small < 2e-2,
                "{name} seq {i}: grouped vs chunked {e_small}"
            );
        }
    }
}

/// Greedy decoding of `steps` tokens for each prompt, all sequences in one batch per step.
fn greedy(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    tables: &[Vec<BlockId>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut next: Vec<u32> = prompts
        .iter()
        .zip(tables)
        .map(|(p, t)| {
            let l = b
                .forward(&ForwardBatch {
                    seqs: vec![SeqStep {
                        tokens: p,
                        start_pos: 0,
                        block_table: t,
                        want_logits: true,
                    }],
                })
                .unwrap();
            argmax(l.row(0))
        })
        .collect();
    let mut out: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let mut last_rows = Vec::new();
    for step in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let l = b
            .forward(&ForwardBatch {
                seqs: toks
                    .iter()
                    .zip(prompts)
                    .zip(tables)
                    .map(|((t, p), tb)| SeqStep {
                        tokens: t,
                        start_pos: p.len() + step,
                        block_table: tb,
                        want_logits: true,
                    })
                    .collect(),
            })
            .unwrap();
        last_rows = (0..prompts.len()).map(|i| l.row(i).to_vec()).collect();
        next = last_rows.iter().map(|r| argmax(r)).collect();
        for (o, &t) in out.iter_mut().zip(&next) {
            o.push(t);
        }
    }
    (out, last_rows)
}

fn prompts_and_tables(vocab: u32) -> (Vec<Vec<u32>>, Vec<Vec<BlockId>>) {
    let prompts: Vec<Vec<u32>> = [7u32, 20, 33]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 13 + n) % vocab).collect())
        .collect();
    // 4 blocks each (64 positions), interleaved over the pool.
    let tables = (0..3u32)
        .map(|s| (0..4).map(|b| BlockId(b * 3 + s + 1)).collect())
        .collect();
    (prompts, tables)
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn decode_graphs_replay_what_eager_steps_compute() {
    let model = load("deepseek_v3");
    let (prompts, tables) = prompts_and_tables(model.spec.vocab_size as u32);
    let mut eager = CudaBackend::from_loaded(&model, &opts(false, 512, 64)).unwrap();
    let mut graphs = CudaBackend::from_loaded(&model, &opts(true, 512, 64)).unwrap();
    let (want, want_rows) = greedy(&mut eager, &prompts, &tables, 12);
    let (got, got_rows) = greedy(&mut graphs, &prompts, &tables, 12);
    assert_eq!(got, want);
    for (g, w) in got_rows.iter().zip(&want_rows) {
        assert!(rel_err(g, w) < 1e-3, "graph vs eager: {}", rel_err(g, w));
    }
    let st = graphs.graph_stats();
    assert!(st.replays >= 10 && st.captures >= 1, "{st:?}");
    assert_eq!(eager.graph_stats().replays, 0);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn latent_kv_read_from_one_backend_and_written_to_another_decodes_as_colocated() {
    for name in ["deepseek_v2", "deepseek_v3"] {
        let model = load(name);
        let vocab = model.spec.vocab_size as u32;
        let prompt: Vec<u32> = (0..37u32).map(|i| (i * 11 + 3) % vocab).collect();
        let steps = 16;
        let (colo, colo_rows) = greedy(
            &mut CudaBackend::from_loaded(&model, &opts(true, 512, 64)).unwrap(),
            std::slice::from_ref(&prompt),
            &[(0..4).map(BlockId).collect()],
            steps,
        );
        // Prefill on one backend; its latents of the prompt's blocks into other blocks of a
        // second backend, which decodes.
        let mut prefill = CudaBackend::from_loaded(&model, &opts(false, 512, 64)).unwrap();
        let ptable: Vec<BlockId> = (10..14).map(BlockId).collect();
        let first = prefill
            .forward(&ForwardBatch {
                seqs: vec![SeqStep {
                    tokens: &prompt,
                    start_pos: 0,
                    block_table: &ptable,
                    want_logits: true,
                }],
            })
            .unwrap();
        let first = argmax(first.row(0));
        let layout = prefill.kv_layout().clone();
        let used = prompt.len().div_ceil(BLOCK as usize);
        let bytes = layout.block_bytes() * used;
        assert_eq!(
            bytes,
            used * layout.num_layers as usize
                * BLOCK as usize
                * model.spec.mla.as_ref().unwrap().latent_dim()
                * 2,
            "the hand-off moves the latents, nothing else"
        );
        let mut kv = vec![0u8; bytes];
        prefill
            .read_kv(0..layout.num_layers, &ptable[..used], &mut kv)
            .unwrap();
        let mut decode = CudaBackend::from_loaded(&model, &opts(true, 512, 64)).unwrap();
        let dtable: Vec<BlockId> = (40..44).map(BlockId).collect();
        decode
            .write_kv(0..layout.num_layers, &dtable[..used], &kv)
            .unwrap();
        let mut got = vec![first];
        let mut next = first;
        let mut rows = Vec::new();
        for step in 0..steps {
            let l = decode
                .forward(&ForwardBatch {
                    seqs: vec![SeqStep {
                        tokens: &[next],
                        start_pos: prompt.len() + step,
                        block_table: &dtable,
                        want_logits: true,
                    }],
                })
                .unwrap();
            rows = vec![l.row(0).to_vec()];
            next = argmax(l.row(0));
            got.push(next);
        }
        assert_eq!(got, colo[0], "{name}: handed-off decode vs colocated");
        assert!(rel_err(&rows[0], &colo_rows[0]) < 1e-3, "{name}");
    }
}
