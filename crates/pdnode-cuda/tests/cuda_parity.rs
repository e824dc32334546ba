//! The CUDA backend against Hugging Face transformers (the reference logits and greedy tokens of
//! the tiny fixture models in tests/fixtures) and against the CPU backend, on the same tokens:
//! chunked prefill then greedy decode, once through the cuBLAS prefill-attention path and once
//! through the paged-attention kernel only. Sliding windows: the two window fixtures (prompts and
//! decodes past an 8-position window) and random head_dim 64 / 128 models whose windows cross
//! blocks and flash tiles, greedy tokens against the CPU backend's on every attention kernel.
//! GPU only: `#[ignore]`d, run by scripts/gpu/run-all.sh.

mod cuda_fixtures;
mod cuda_support;

use cuda_fixtures::*;
use cuda_support::{rel_err, rng, tiny_spec, tiny_weights};
use pdnode_cuda::ops::{AttnVariant, LinearImpl};
use pdnode_cuda::prefill::PrefillAttn;
use pdnode_cuda::{CudaBackend, CudaOptions};
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::loader::load_path;

const MODELS: [&str; 9] = [
    "llama_gqa",
    "llama3_rope",
    "llama_linear_rope",
    "qwen2_bias",
    "qwen3_qknorm",
    "llama_tied",
    "mistral",
    "mistral_window",
    "qwen2_window",
];

fn opts(gemm_min: usize, attention: AttnVariant, prefill: PrefillAttn) -> CudaOptions {
    CudaOptions {
        gpus: vec![0],
        tensor_parallel: 1,
        mem_fraction: 0.9,
        num_kv_blocks: 64,
        block_size: 16,
        max_batch_tokens: 512,
        max_seqs: 4,
        prefill_gemm_min_tokens: gemm_min,
        linear: LinearImpl::Auto,
        attention: attention.into(),
        prefill_attention: prefill,
        cuda_graphs: true,
        gpu_sampling: true,
        pdl: false,
        fusion: pdnode_cuda::ops::Fusion::default(),
        warm_up_context: 0,
    }
}

fn cpu_config() -> CpuBackendConfig {
    CpuBackendConfig {
        block_size: 16,
        num_blocks: 64,
        threads: 2,
    }
}

/// Greedy tokens of `got` against the CPU backend's rows `cpu`, step by step: equal wherever the
/// CPU's top two logits are apart by more than 1% of its largest magnitude (bf16 against f32 may
/// order a near tie either way; those steps are counted, not failed); logits within 3e-2.
/// Returns the number of near-tie steps.
fn greedy_equals_cpu(got: &[Vec<f32>], cpu: &[Vec<f32>], what: &str) -> usize {
    assert_eq!(got.len(), cpu.len(), "{what}");
    let mut ties = 0;
    for (step, (g, c)) in got.iter().zip(cpu).enumerate() {
        let e = rel_err(g, c);
        assert!(e < 3e-2, "{what} step {step}: logits rel err vs CPU {e}");
        if argmax(g) != argmax(c) {
            let m = margin(c);
            let scale = c.iter().fold(0f32, |a, b| a.max(b.abs()));
            assert!(
                m < 0.01 * scale,
                "{what} step {step}: greedy {} vs CPU {} (CPU margin {m})",
                argmax(g),
                argmax(c)
            );
            ties += 1;
        }
    }
    ties
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
            let opts = opts(gemm_min, AttnVariant::Auto, PrefillAttn::default());
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

/// The window fixtures (an 8-position window; Mistral's on every layer, Qwen2's on layer 1 only)
/// on every decode kernel their head_dim 16 runs (v1, v2, v2 narrow) and both prefill paths
/// (cuBLAS GEMMs at gemm_min 1, paged attention only at 1000), prompt chunks of 5 and of the
/// whole 12-token prompt, then 32 decode steps (graph replays) far past the window: the greedy
/// tokens are the CPU backend's.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn window_fixtures_greedy_equals_the_cpu_backend() {
    for name in ["mistral_window", "qwen2_window"] {
        let r = reference(name);
        let model = load_path(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(model.spec.sliding_window.is_some(), "{name} has a window");
        assert!(r.prompt.len() > 8, "{name}: the prompt crosses the window");
        for chunk in [5usize, 12] {
            let mut cpu = CpuBackend::from_loaded(model.clone(), cpu_config()).unwrap();
            let cpu_rows = rows(&mut cpu, &r, chunk);
            for attention in [AttnVariant::Auto, AttnVariant::V1, AttnVariant::V2Narrow] {
                for gemm_min in [1usize, 1000] {
                    let o = opts(gemm_min, attention, PrefillAttn::default());
                    let mut cuda = CudaBackend::from_loaded(&model, &o).unwrap();
                    let got = rows(&mut cuda, &r, chunk);
                    let what = format!("{name} chunk {chunk} {attention:?} gemm_min={gemm_min}");
                    let ties = greedy_equals_cpu(&got, &cpu_rows, &what);
                    eprintln!("PARITY {what}: greedy equals the CPU's ({ties} near ties)");
                }
            }
        }
    }
}

/// Random head_dim 64 and 128 models (3 layers, a 100-position window on layers 0 and 2: not a
/// multiple of the block or of a flash tile) against the CPU backend: a 300-token prompt in one
/// chunk (flash v3, w8 or the cuBLAS path) or in chunks of 37 (paged attention over a cached
/// prefix), then 40 decode steps on v4 (Auto), v1 and v2; logits and greedy tokens the CPU's.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn windowed_models_greedy_equals_the_cpu_backend_on_every_kernel() {
    use pdnode_engine::spec::{ModelSpec, SlidingWindow};
    for hd in [64usize, 128] {
        let spec = ModelSpec {
            hidden_size: 128,
            intermediate_size: 192,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: hd,
            sliding_window: Some(SlidingWindow {
                size: 100,
                layers: vec![true, false, true],
            }),
            ..tiny_spec(false, false)
        };
        let mut g = rng(&format!("window_hd{hd}"));
        let w = tiny_weights(&spec, &mut g);
        use rand::Rng;
        let tok = |g: &mut rand_chacha::ChaCha8Rng| g.random_range(0..spec.vocab_size as u32);
        let r = Reference {
            prompt: (0..300).map(|_| tok(&mut g)).collect(),
            greedy: (0..40).map(|_| tok(&mut g)).collect(),
            logits: vec![],
        };
        for (chunk, attention, prefill) in [
            (300usize, AttnVariant::Auto, PrefillAttn::FlashV3),
            (300, AttnVariant::Auto, PrefillAttn::Flash8),
            (300, AttnVariant::V1, PrefillAttn::Gemm),
            (37, AttnVariant::Auto, PrefillAttn::FlashV3),
            (37, AttnVariant::V2, PrefillAttn::FlashV3),
        ] {
            let mut cpu =
                CpuBackend::new(spec.clone(), w.clone(), "t".into(), cpu_config()).unwrap();
            let cpu_rows = rows(&mut cpu, &r, chunk);
            let mut cuda =
                CudaBackend::new(&spec, &w, &opts(64, attention, prefill), "t".into()).unwrap();
            let got = rows(&mut cuda, &r, chunk);
            let what = format!("hd {hd} chunk {chunk} {attention:?} {prefill:?}");
            let ties = greedy_equals_cpu(&got, &cpu_rows, &what);
            eprintln!("PARITY {what}: greedy equals the CPU's ({ties} near ties)");
        }
    }
}
