//! The tiny fixture models of pdnode-engine's tests/fixtures and their transformers references
//! (prompt, greedy tokens, logits after the prompt and each greedy step), for the CUDA parity
//! tests.
#![allow(dead_code)]

use pdnode_core::BlockId;
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use std::path::PathBuf;

/// `PDNODE_FIXTURES` (set by scripts/gpu/run-all.sh: the binary runs from another checkout),
/// else pdnode-engine's tests/fixtures.
pub fn fixture(name: &str) -> PathBuf {
    std::env::var_os("PDNODE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../pdnode-engine/tests/fixtures")
        })
        .join(name)
}

pub struct Reference {
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

pub fn reference(name: &str) -> Reference {
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

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The gap between the two largest values.
pub fn margin(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| b.partial_cmp(a).unwrap());
    s[0] - s[1]
}

/// Runs the prompt (chunks of `chunk`) then the reference's greedy tokens (teacher forcing);
/// returns the logits rows (after the prompt, then after each greedy token).
pub fn rows(b: &mut dyn Backend, r: &Reference, chunk: usize) -> Vec<Vec<f32>> {
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
