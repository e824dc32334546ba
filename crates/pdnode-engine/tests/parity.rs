//! CPU backend vs Hugging Face transformers on tiny random models (fixtures built by
//! `scripts/fixtures/make_fixtures.py`): logits within 1e-4 relative after the prompt and after
//! each of 32 greedy steps, and the same greedy tokens. Also run with the prompt split into
//! chunks, and with several sequences in one batch, which must not change any number.

use pdnode_core::BlockId;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::loader::load_path;
use std::path::PathBuf;

const MODELS: [&str; 12] = [
    "llama_gqa",
    "llama3_rope",
    "llama_linear_rope",
    "qwen2_bias",
    "qwen3_qknorm",
    "llama_tied",
    "mistral",
    // Sliding-window attention (8 positions; Qwen2's second layer only), crossed by the
    // 12-token prompt and the 32 generated tokens.
    "mistral_window",
    "qwen2_window",
    // DeepSeek: latent attention (the pool caches one latent per token), a dense layer then
    // MoE layers; V2 with a plain q and softmax group-limited routing, V3 with a low-rank q,
    // sigmoid routing with its bias, YaRN scaling cos/sin too.
    "deepseek_v2",
    "deepseek_v3",
    // DeepSeek-V3's block FP8 (float8_e4m3fn, one scale per 16 x 16 block here), dequantized
    // at load; the reference ran on the dequantized weights.
    "deepseek_v3_fp8",
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
    for name in [
        "llama_gqa",
        "qwen3_qknorm",
        "qwen2_bias",
        "mistral_window",
        "deepseek_v2",
        "deepseek_v3",
    ] {
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

/// A PD hand-off on the CPU: prefill on one backend, copy the prompt's KV blocks out with
/// `read_kv` and into other block ids of a second backend with `write_kv`, then decode there:
/// the logits match the reference exactly as if the prompt had been run locally.
#[test]
fn kv_copied_between_backends_continues_the_sequence() {
    // K and V planes, and DeepSeek's latents (one plane).
    for name in ["qwen3_qknorm", "deepseek_v3"] {
        kv_copy(name);
    }
}

fn kv_copy(name: &str) {
    use pdnode_engine::backend::KvMemory;
    let r = reference(name);
    let mut p = backend(name, 4);
    let mut d = backend(name, 4);
    assert_eq!(p.kv_layout(), d.kv_layout());
    let want_kind = if name.starts_with("deepseek") {
        pdnode_core::KvKind::Latent
    } else {
        pdnode_core::KvKind::KeyValue
    };
    assert_eq!(p.kv_layout().kind, want_kind);
    let n = r.prompt.len();
    let nblocks = n.div_ceil(4);
    let src: Vec<BlockId> = (0..nblocks as u32).map(|i| BlockId(40 + i)).collect();
    let dst: Vec<BlockId> = (0..16u32).map(|i| BlockId(63 - i)).collect();
    let out = p
        .forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &r.prompt,
                start_pos: 0,
                block_table: &src,
                want_logits: true,
            }],
        })
        .unwrap();
    assert_close(name, 0, out.row(0), &r.logits[0]);
    let layers = p.kv_layout().num_layers;
    let mut buf = vec![0u8; layers as usize * nblocks * p.kv_layout().block_layer_bytes()];
    p.read_kv(0..layers, &src, &mut buf).unwrap();
    // Copy layer by layer, as a transfer that overlaps with prefill would.
    let per_layer = buf.len() / layers as usize;
    for l in 0..layers {
        let chunk = &buf[l as usize * per_layer..(l as usize + 1) * per_layer];
        d.write_kv(l..l + 1, &dst[..nblocks], chunk).unwrap();
    }
    let out = d
        .forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &r.greedy[..1],
                start_pos: n,
                block_table: &dst,
                want_logits: true,
            }],
        })
        .unwrap();
    assert_close(name, 1, out.row(0), &r.logits[1]);
    // Wrong sizes and blocks are errors, not panics.
    assert!(d.write_kv(0..layers, &dst[..nblocks], &buf[1..]).is_err());
    assert!(p.read_kv(0..layers + 1, &src, &mut buf).is_err());
    assert!(
        p.read_kv(0..1, &[BlockId(64)], &mut buf[..per_layer / nblocks])
            .is_err()
    );
    let regions = d.kv_regions();
    assert_eq!(regions.len(), 1);
    assert_eq!(
        regions[0].len,
        64 * layers as usize * d.kv_layout().block_layer_bytes()
    );
}

#[test]
fn invalid_batches_are_errors() {
    let mut b = backend("llama_gqa", 4);
    let table = [BlockId(0), BlockId(1)];
    fn bad<'a>(tokens: &'a [u32], start_pos: usize, table: &'a [BlockId]) -> Vec<SeqStep<'a>> {
        vec![SeqStep {
            tokens,
            start_pos,
            block_table: table,
            want_logits: true,
        }]
    }
    for seqs in [
        bad(&[], 0, &table),           // no tokens
        bad(&[1, 2, 3], 6, &table),    // positions past the table
        bad(&[1000], 0, &table),       // token outside the vocabulary
        bad(&[1], 0, &[BlockId(64)]),  // block outside the pool
        bad(&[1], usize::MAX, &table), // position overflow
    ] {
        assert!(b.forward(&ForwardBatch { seqs }).is_err());
    }
    // Two sequences writing the same KV slot in one step.
    let out = b.forward(&ForwardBatch {
        seqs: vec![
            SeqStep {
                tokens: &[1, 2],
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            },
            SeqStep {
                tokens: &[3],
                start_pos: 1,
                block_table: &table,
                want_logits: true,
            },
        ],
    });
    assert!(out.is_err());
}
