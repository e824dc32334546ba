//! CPU backend vs Hugging Face transformers on tiny random models (fixtures built by
//! `scripts/fixtures/make_fixtures.py`): logits within 1e-4 relative after the prompt and after
//! each of 32 greedy steps, and the same greedy tokens. Also run with the prompt split into
//! chunks, and with several sequences in one batch, which must not change any number.

use pdnode_core::BlockId;
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

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
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

fn backend(name: &str, block_size: u32) -> CpuBackend {
    let model = load_path(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    CpuBackend::from_loaded(
        model,
        CpuBackendConfig {
            block_size,
            num_blocks: 64,
            threads: 2,
        },
    )
    .unwrap()
}

fn assert_close(name: &str, step: usize, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name} step {step}: vocab");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        // 1e-4 relative; the reference JSON holds 6 decimals, hence the absolute floor.
        let tol = 1e-4 * b.abs().max(1.0);
        assert!(
            (a - b).abs() <= tol,
            "{name} step {step} token {i}: {a} vs reference {b}"
        );
    }
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill in chunks of `chunk` tokens, then greedy decode, checking every logits row.
fn run_and_check(name: &str, block_size: u32, chunk: usize) {
    let r = reference(name);
    let mut b = backend(name, block_size);
    // Blocks in a scrambled order, to check the table is honoured.
    let table: Vec<BlockId> = (0..64u32).map(|i| BlockId((i * 7 + 3) % 64)).collect();
    let mut pos = 0;
    let mut logits = Vec::new();
    for c in r.prompt.chunks(chunk) {
        let last = pos + c.len() == r.prompt.len();
        let out = b
            .forward(&ForwardBatch {
                seqs: vec![SeqStep {
                    tokens: c,
                    start_pos: pos,
                    block_table: &table,
                    want_logits: last,
                }],
            })
            .unwrap();
        assert_eq!(out.rows(), usize::from(last));
        if last {
            logits = out.row(0).to_vec();
        }
        pos += c.len();
    }
    for step in 0..r.greedy.len() {
        assert_close(name, step, &logits, &r.logits[step]);
        let tok = argmax(&logits);
        assert_eq!(tok, r.greedy[step], "{name}: greedy token {step}");
        let out = b
            .forward(&ForwardBatch {
                seqs: vec![SeqStep {
                    tokens: &[tok],
                    start_pos: pos,
                    block_table: &table,
                    want_logits: true,
                }],
            })
            .unwrap();
        logits = out.row(0).to_vec();
        pos += 1;
    }
    assert_close(name, r.greedy.len(), &logits, &r.logits[r.greedy.len()]);
}

#[test]
fn every_fixture_matches_transformers() {
    for name in MODELS {
        run_and_check(name, 16, usize::MAX);
    }
}

#[test]
fn chunked_prefill_and_small_blocks_give_the_same_numbers() {
    for name in ["llama_gqa", "qwen3_qknorm", "qwen2_bias"] {
        run_and_check(name, 4, 5);
        run_and_check(name, 1, 3);
    }
}

/// Two sequences at different stages in one batch (one prefilling, one decoding) each get exactly
/// the logits they get alone.
#[test]
fn batched_sequences_do_not_interfere() {
    let name = "llama3_rope";
    let r = reference(name);
    let mut b = backend(name, 4);
    let t1: Vec<BlockId> = (0..16).map(BlockId).collect();
    let t2: Vec<BlockId> = (16..32).map(BlockId).collect();
    // Sequence 1: prompt already in the cache, decoding greedy[0].
    b.forward(&ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &r.prompt,
            start_pos: 0,
            block_table: &t1,
            want_logits: false,
        }],
    })
    .unwrap();
    let n = r.prompt.len();
    let out = b
        .forward(&ForwardBatch {
            seqs: vec![
                SeqStep {
                    tokens: &r.greedy[..1],
                    start_pos: n,
                    block_table: &t1,
                    want_logits: true,
                },
                // Sequence 2: the first 7 prompt tokens, no logits wanted.
                SeqStep {
                    tokens: &r.prompt[..7],
                    start_pos: 0,
                    block_table: &t2,
                    want_logits: false,
                },
            ],
        })
        .unwrap();
    assert_eq!(out.rows(), 1);
    assert_close(name, 1, out.row(0), &r.logits[1]);
    // Sequence 2 finishes its prompt beside sequence 1's next decode step.
    let out = b
        .forward(&ForwardBatch {
            seqs: vec![
                SeqStep {
                    tokens: &r.prompt[7..],
                    start_pos: 7,
                    block_table: &t2,
                    want_logits: true,
                },
                SeqStep {
                    tokens: &r.greedy[1..2],
                    start_pos: n + 1,
                    block_table: &t1,
                    want_logits: true,
                },
            ],
        })
        .unwrap();
    assert_eq!(out.rows(), 2);
    assert_close(name, 0, out.row(0), &r.logits[0]);
    assert_close(name, 2, out.row(1), &r.logits[2]);
}
