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

/// Every step of one configuration: how far its logits are from transformers' and the CPU
/// backend's, and the steps whose arg-max differs from transformers' greedy token where that
/// token was not a near tie (its margin >= 5 % of the row's largest logit).
struct StepErrs {
    hf: Vec<f32>,
    cpu: Vec<f32>,
    bad_flips: Vec<usize>,
    flips: usize,
}

fn step_errs(got: &[Vec<f32>], r: &Reference, cpu_rows: &[Vec<f32>]) -> StepErrs {
    let mut e = StepErrs {
        hf: Vec::new(),
        cpu: Vec::new(),
        bad_flips: Vec::new(),
        flips: 0,
    };
    for (step, row) in got.iter().enumerate() {
        e.hf.push(rel_err(row, &r.logits[step]));
        e.cpu.push(rel_err(row, &cpu_rows[step]));
        if step < r.greedy.len() && argmax(row) != r.greedy[step] {
            e.flips += 1;
            let big = r.logits[step].iter().fold(0f32, |a, b| a.max(b.abs()));
            if margin(&r.logits[step]) >= 0.05 * big {
                e.bad_flips.push(step);
            }
        }
    }
    e
}

/// Per-step errors as `1.2e-3 4.0e-2 ...`.
struct Errs<'a>(&'a [f32]);

impl std::fmt::LowerExp for Errs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, x) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, " ")?;
            }
            write!(f, "{x:.1e}")?;
        }
        Ok(())
    }
}

fn median(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(f32::total_cmp);
    s[s.len() / 2]
}

/// bf16 weights and activations against f32 references. A mixture of experts amplifies bf16
/// rounding where two experts' router scores nearly tie: a token routed differently in one
/// layer moves that step's logits by 10-30 % (on the H200: deepseek_v2 step 6 at 0.16 and
/// deepseek_v3_fp8 steps 2 and 21 at 0.28, the same on the decode kernel, with graphs and one
/// token a step, smaller through the GEMM path's different rounding; every other step within
/// 2.6e-2), so a step may stray past the dense models' 3e-2 bound; a wrong kernel moves every
/// step. Bounds: the median step within 3e-2 of both references, at least 90 % of the steps
/// within 5e-2, every step within 0.5, no greedy token differing from transformers' outside
/// near ties.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn deepseek_fixtures_match_transformers_and_the_cpu_backend() {
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for name in MODELS {
        let r = reference(name);
        let model = load(name);
        // the decode kernel for every chunk of 5 (without, then with graphs), one token a step,
        // then the GEMM path for every chunk of the prompt
        for (graphs, gemm_min, chunk) in
            [(false, 64, 5), (true, 64, 5), (false, 64, 1), (false, 1, 5)]
        {
            let cpu_rows = rows(&mut cpu(&model, 64), &r, chunk);
            let o = opts_gemm(graphs, 512, 64, gemm_min);
            let mut cuda = CudaBackend::from_loaded(&model, &o).unwrap();
            let m = model.spec.mla.as_ref().unwrap();
            let layout = cuda.kv_layout().clone();
            assert_eq!(layout.kind, KvKind::Latent);
            assert_eq!(
                (layout.kv_heads_per_rank, layout.head_dim as usize),
                (1, m.latent_dim())
            );
            let e = step_errs(&rows(&mut cuda, &r, chunk), &r, &cpu_rows);
            let tag = format!("{name:16} graphs={graphs:5} gemm_min={gemm_min:2} chunk={chunk}");
            let within =
                |v: &[f32], b: f32| v.iter().filter(|&&x| x < b).count() as f32 / v.len() as f32;
            let worst = |v: &[f32]| v.iter().fold(0f32, |a, &b| a.max(b));
            for (what, v) in [("HF", &e.hf), ("CPU", &e.cpu)] {
                if median(v) >= 3e-2 || within(v, 5e-2) < 0.9 || worst(v) >= 0.5 {
                    failures.push(format!("{tag}: vs {what} {v:.1e}", v = Errs(v)));
                }
            }
            if !e.bad_flips.is_empty() {
                failures.push(format!(
                    "{tag}: greedy differs from HF at steps {:?}",
                    e.bad_flips
                ));
            }
            if graphs && cuda.graph_stats().replays == 0 {
                failures.push(format!("{tag}: no decode step replayed"));
            }
            report.push(format!(
                "{tag}: rel err vs HF median {:.1e} worst {:.1e}, vs CPU median {:.1e} worst \
                 {:.1e} (steps past 3e-2: {:?}), greedy flips {}/{}",
                median(&e.hf),
                worst(&e.hf),
                median(&e.cpu),
                worst(&e.cpu),
                e.cpu
                    .iter()
                    .enumerate()
                    .filter(|x| *x.1 >= 3e-2)
                    .map(|x| x.0)
                    .collect::<Vec<_>>(),
                e.flips,
                r.greedy.len()
            ));
        }
    }
    for l in report {
        eprintln!("PARITY {l}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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
            // bf16 against f32 through a mixture of experts (see the parity test's bounds)
            assert!(e_cpu < 5e-2, "{name} seq {i}: grouped vs CPU {e_cpu}");
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

/// A DeepSeek model's dummy weights of each tensor-parallel rank, generated on the device, are
/// exactly that rank's slice (`mla_weights::shard_layer`'s split: heads' rows of q / q_b and
/// kv_b, o_proj's columns, every MLP's intermediate rows of gate/up and columns of down; the
/// rest whole) of what one GPU generates with the same seed. One GPU: ranks 0..2 and 0..4 built
/// on it in turn (what a TP run builds on each of its GPUs).
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn dummy_weights_of_every_rank_are_its_slice_of_the_whole() {
    use pdnode_cuda::device::{DevBuf, Gpu};
    use pdnode_cuda::mla_weights::{DevFfn, DevMla, DevMlaQuery};
    use pdnode_cuda::weights::Shard;
    let gpu = Gpu::new(0).unwrap();
    let bits = |b: &DevBuf| {
        let mut v = vec![0u16; b.bytes() / 2];
        gpu.download(&mut v, b, 0).unwrap();
        v
    };
    // rows `r` of every one of `stack` `[rows][cols]` blocks; columns `c` of `[rows][cols]`
    let rows = |v: &[u16], stack: usize, n: usize, cols: usize, r: std::ops::Range<usize>| {
        (0..stack)
            .flat_map(|s| v[(s * n + r.start) * cols..(s * n + r.end) * cols].to_vec())
            .collect::<Vec<u16>>()
    };
    let cols = |v: &[u16], cols: usize, c: std::ops::Range<usize>| {
        v.chunks_exact(cols)
            .flat_map(|row| row[c.clone()].to_vec())
            .collect::<Vec<u16>>()
    };
    for name in ["deepseek_v2", "deepseek_v3"] {
        let spec = load(name).spec;
        let m = spec.mla.as_ref().unwrap();
        let (h, nh, r) = (spec.hidden_size, spec.num_heads, m.kv_lora_rank);
        let (qk, vd, ph) = (
            m.qk_head_dim(),
            m.v_head_dim,
            m.qk_nope_head_dim + m.v_head_dim,
        );
        let (whole, _) = DevMla::dummy(&gpu, &spec, 9, None, Shard::WHOLE).unwrap();
        for size in [2, 4] {
            for rank in 0..size {
                let sh = Shard { rank, size };
                let (part, _) = DevMla::dummy(&gpu, &spec, 9, None, sh).unwrap();
                let tag = format!("{name} rank {rank} of {size}");
                for (li, (w, p)) in whole.layers.iter().zip(&part.layers).enumerate() {
                    let tag = format!("{tag} layer {li}");
                    let q_rows = sh.part(nh * qk);
                    match (&w.q, &p.q) {
                        (DevMlaQuery::Direct { wq: a }, DevMlaQuery::Direct { wq: b }) => {
                            assert_eq!(bits(b), rows(&bits(a), 1, nh * qk, h, q_rows), "{tag} q");
                        }
                        (
                            DevMlaQuery::LowRank {
                                wq_a: a1,
                                wq_b: a2,
                                rank: qr,
                                ..
                            },
                            DevMlaQuery::LowRank {
                                wq_a: b1, wq_b: b2, ..
                            },
                        ) => {
                            assert_eq!(bits(b1), bits(a1), "{tag} q_a whole");
                            let want = rows(&bits(a2), 1, nh * qk, *qr, q_rows);
                            assert_eq!(bits(b2), want, "{tag} q_b");
                        }
                        _ => panic!("{tag}: query kinds differ"),
                    }
                    assert_eq!(bits(&p.wkv_a), bits(&w.wkv_a), "{tag} kv_a whole");
                    let want = rows(&bits(&w.wkv_b), 1, nh * ph, r, sh.part(nh * ph));
                    assert_eq!(bits(&p.wkv_b), want, "{tag} kv_b");
                    let want = cols(&bits(&w.wo), nh * vd, sh.part(nh * vd));
                    assert_eq!(bits(&p.wo), want, "{tag} o_proj");
                    // an MLP stack: gate/up `[stack][2 inter][h]`, down `[stack][h][inter]`
                    let mlp = |a: (&DevBuf, &DevBuf), b: (&DevBuf, &DevBuf), stack, inter| {
                        let ir = sh.part(inter);
                        let gu = bits(a.0);
                        let want: Vec<u16> = (0..stack)
                            .flat_map(|s| {
                                let e = &gu[s * 2 * inter * h..(s + 1) * 2 * inter * h];
                                let mut x = rows(e, 1, inter, h, ir.clone());
                                x.extend(rows(&e[inter * h..], 1, inter, h, ir.clone()));
                                x
                            })
                            .collect();
                        assert_eq!(bits(b.0), want, "{tag} gate/up");
                        assert_eq!(bits(b.1), cols(&bits(a.1), inter, ir), "{tag} down");
                    };
                    match (&w.ffn, &p.ffn) {
                        (DevFfn::Dense(a), DevFfn::Dense(b)) => {
                            assert_eq!(b.inter * size, a.inter);
                            mlp((&a.gate_up, &a.down), (&b.gate_up, &b.down), 1, a.inter);
                        }
                        (DevFfn::Moe(a), DevFfn::Moe(b)) => {
                            let e = spec.moe.as_ref().unwrap();
                            assert_eq!(bits(&b.router), bits(&a.router), "{tag} router whole");
                            let (ne, ei) = (e.num_experts, e.expert_intermediate);
                            mlp((&a.gate_up, &a.down), (&b.gate_up, &b.down), ne, ei);
                            let (sa, sb) = (a.shared.as_ref().unwrap(), b.shared.as_ref().unwrap());
                            assert_eq!(sb.inter * size, sa.inter);
                            mlp(
                                (&sa.gate_up, &sa.down),
                                (&sb.gate_up, &sb.down),
                                1,
                                sa.inter,
                            );
                        }
                        _ => panic!("{tag}: MLP kinds differ"),
                    }
                }
            }
        }
    }
    println!("PASS dummy_weights_of_every_rank_are_its_slice_of_the_whole");
}
