//! SmolLM2-135M-Instruct (Q4_1 GGUF) on the CPU backend against an independent reference:
//! transformers' GGUF loader + PyTorch f32 (`scripts/fixtures/smollm2_reference.py`). Runs when
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf` exists; otherwise prints that it skipped.

use pdnode_core::BlockId;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::loader::load_path;
use std::path::PathBuf;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn smollm2_q4_1_matches_transformers_gguf_reference() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model_path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model_path.is_file() {
        eprintln!("SKIPPED: {} not present", model_path.display());
        return;
    }
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/smollm2_q4_1_reference.json"),
    )
    .unwrap();
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompt = ids(&r["prompt_ids"]);
    let greedy = ids(&r["greedy_ids"]);

    let model = load_path(&model_path).unwrap();
    let mut b = CpuBackend::from_loaded(
        model,
        CpuBackendConfig {
            block_size: 16,
            num_blocks: 8,
            threads: 0,
        },
    )
    .unwrap();
    let table: Vec<BlockId> = (0..8).map(BlockId).collect();
    let step = |b: &mut CpuBackend, tokens: &[u32], pos: usize| -> Vec<f32> {
        b.forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens,
                start_pos: pos,
                block_table: &table,
                want_logits: true,
            }],
        })
        .unwrap()
        .row(0)
        .to_vec()
    };
    let first = step(&mut b, &prompt, 0);
    // Logits are O(10); allow 5e-4 relative (measured: under 1e-4 absolute) (f32 summation order over 30 layers differs from
    // PyTorch's) and report the worst difference.
    let mut worst = 0f32;
    for (key_ids, key_vals) in [
        ("first_top_ids", "first_top_values"),
        ("first_sample_ids", "first_sample_values"),
    ] {
        for (i, want) in ids(&r[key_ids]).into_iter().zip(floats(&r[key_vals])) {
            let got = first[i as usize];
            worst = worst.max((got - want).abs());
            assert!(
                (got - want).abs() <= 5e-4 * want.abs().max(1.0),
                "token {i}: {got} vs reference {want}"
            );
        }
    }
    eprintln!("worst first-step logit difference: {worst:e}");

    let mut logits = first;
    for (i, &want) in greedy.iter().enumerate() {
        let tok = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(t, _)| t as u32)
            .unwrap();
        assert_eq!(tok, want, "greedy token {i}");
        logits = step(&mut b, &[tok], prompt.len() + i);
    }
}
