//! The CUDA backend against Hugging Face transformers (the reference logits and greedy tokens of
//! the tiny fixture models in tests/fixtures) and against the CPU backend, on the same tokens:
//! chunked prefill then greedy decode, once through the cuBLAS prefill-attention path and once
//! through the paged-attention kernel only. GPU only: `#[ignore]`d, run by scripts/gpu/run-all.sh.

mod cuda_support;

use cuda_support::rel_err;
use pdnode_core::BlockId;
use pdnode_cuda::ops::{AttnVariant, LinearImpl};
use pdnode_cuda::{CudaBackend, CudaOptions};
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::loader::load_path;
use std::path::PathBuf;

const MODELS: [&str; 7] = [
    "llama_gqa",
    "llama3_rope",
    "llama_linear_rope",
    "qwen2_bias",
    "qwen3_qknorm",
    "llama_tied",
    "mistral",
];

/// `PDNODE_FIXTURES` (set by scripts/gpu/run-all.sh: the binary runs from another checkout),
/// else this crate's tests/fixtures.
fn fixture(name: &str) -> PathBuf {
    std::env::var_os("PDNODE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../pdnode-engine/tests/fixtures")
        })
        .join(name)
}

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Reference {
        prompt: ids("prompt_ids"),
        greedy: ids("greedy_ids"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn margin(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| b.partial_cmp(a).unwrap());
    s[0] - s[1]
}

/// Runs the prompt (chunks of `chunk`) then the reference's greedy tokens; returns logits rows.
fn rows(b: &mut dyn Backend, r: &Reference, chunk: usize) -> Vec<Vec<f32>> {
    let table: Vec<BlockId> = (0..64u32).map(|i| BlockId((i * 7 + 3) % 64)).collect();
    let mut pos = 0;
    let mut out = Vec::new();
    for c in r.prompt.chunks(chunk) {
        let last = pos + c.len() == r.prompt.len();
        let l = b
            .forward(&ForwardBatch {
                seqs: vec![SeqStep {
                    tokens: c,
                    start_pos: pos,
                    block_table: &table,
                    want_logits: last,
                }],
            })
            .unwrap();
        if last {
            out.push(l.row(0).to_vec());
        }
        pos += c.len();
    }
    for &tok in &r.greedy {
        let l = b
            .forward(&ForwardBatch {
                seqs: vec![SeqStep {
                    tokens: &[tok],
                    start_pos: pos,
                    block_table: &table,
                    want_logits: true,
                }],
            })
            .unwrap();
        out.push(l.row(0).to_vec());
        pos += 1;
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn every_fixture_matches_transformers_and_the_cpu_backend() {
    let mut report = Vec::new();
    for name in MODELS {
        let r = reference(name);
        let model = load_path(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut cpu = CpuBackend::from_loaded(
            model.clone(),
            CpuBackendConfig {
                block_size: 16,
                num_blocks: 64,
                threads: 2,
            },
        )
        .unwrap();
        let cpu_rows = rows(&mut cpu, &r, 5);
        for gemm_min in [1usize, 1000] {
            let opts = CudaOptions {
                gpus: vec![0],
                tensor_parallel: 1,
                mem_fraction: 0.9,
                num_kv_blocks: 64,
                block_size: 16,
                max_batch_tokens: 512,
                max_seqs: 4,
                prefill_gemm_min_tokens: gemm_min,
                linear: LinearImpl::Auto,
                attention: AttnVariant::Auto.into(),
                prefill_attention: Default::default(),
                cuda_graphs: true,
                gpu_sampling: true,
                pdl: false,
                fusion: pdnode_cuda::ops::Fusion::default(),
                warm_up_context: 0,
            };
            let mut cuda = CudaBackend::from_loaded(&model, &opts).unwrap();
            let got = rows(&mut cuda, &r, 5);
            let (mut worst_hf, mut worst_cpu, mut flips) = (0f32, 0f32, 0);
            for (step, row) in got.iter().enumerate() {
                let (e_hf, e_cpu) = (rel_err(row, &r.logits[step]), rel_err(row, &cpu_rows[step]));
                worst_hf = worst_hf.max(e_hf);
                worst_cpu = worst_cpu.max(e_cpu);
                assert!(
                    e_hf < 3e-2 && e_cpu < 3e-2,
                    "{name} gemm_min={gemm_min} step {step}: rel err vs HF {e_hf}, vs CPU {e_cpu}"
                );
                if step < r.greedy.len() && argmax(row) != r.greedy[step] {
                    flips += 1;
                    let m = margin(&r.logits[step]);
                    assert!(
                        m < 0.05 * r.logits[step].iter().fold(0f32, |a, b| a.max(b.abs())),
                        "{name} gemm_min={gemm_min} step {step}: greedy {} vs HF {} (margin {m})",
                        argmax(row),
                        r.greedy[step]
                    );
                }
            }
            report.push(format!(
                "{name:18} gemm_min={gemm_min:4}: worst rel err vs HF {worst_hf:.2e}, vs CPU {worst_cpu:.2e}, greedy flips {flips}/{}",
                r.greedy.len()
            ));
        }
    }
    for l in report {
        eprintln!("PARITY {l}");
    }
}
