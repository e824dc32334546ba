//! The whole CUDA model against an f32 reference with the CPU backend's semantics: chunked
//! prefill, decode, mixed batches, KV read/write round trips. GPU only: `#[ignore]`d, run by
//! scripts/gpu/run-all.sh.

mod cuda_support;

use cuda_support::*;
use pdnode_core::BlockId;
use pdnode_cuda::ops::{AttnVariant, LinearImpl};
use pdnode_cuda::{CudaBackend, CudaOptions};
use pdnode_engine::backend::{Backend, BackendError, ForwardBatch, KvMemory, MemKind, SeqStep};
use rand::Rng;
use rand::seq::SliceRandom;

fn opts(block_size: u32) -> CudaOptions {
    opts_gemm(block_size, 8)
}

/// `gemm_min`: sequences with at least this many new tokens take the cuBLAS prefill path.
fn opts_gemm(block_size: u32, gemm_min: usize) -> CudaOptions {
    CudaOptions {
        gpus: vec![0],
        tensor_parallel: 1,
        mem_fraction: 0.9,
        num_kv_blocks: 96,
        block_size,
        max_batch_tokens: 256,
        max_seqs: 8,
        prefill_gemm_min_tokens: gemm_min,
        linear: LinearImpl::Auto,
        attention: AttnVariant::Auto.into(),
        prefill_attention: Default::default(),
        cuda_graphs: true,
        gpu_sampling: true,
        pdl: false,
        fusion: pdnode_cuda::ops::Fusion::default(),
        warm_up_context: 0,
    }
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// Top-1 minus top-2 logit.
fn margin(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| b.partial_cmp(a).unwrap());
    s[0] - s[1]
}

fn table(rng: &mut rand_chacha::ChaCha8Rng, free: &mut Vec<u32>, n: usize) -> Vec<BlockId> {
    free.shuffle(rng);
    free.drain(..n).map(BlockId).collect()
}

/// Chunked prefill then greedy decode; logits and greedy tokens against the reference.
fn prefill_decode_parity(qwen_like: bool, tied: bool, block_size: u32, gemm_min: usize) {
    let spec = tiny_spec(qwen_like, tied);
    prefill_decode_parity_with(&spec, opts_gemm(block_size, gemm_min), "");
}

/// [`prefill_decode_parity`] of `spec` with backend options `o`.
fn prefill_decode_parity_with(spec: &pdnode_engine::spec::ModelSpec, o: CudaOptions, tag: &str) {
    let mut rng = rng("prefill_decode_parity");
    let spec = spec.clone();
    let (qwen_like, tied) = (spec.qk_norm, spec.tie_word_embeddings);
    let (block_size, gemm_min) = (o.block_size, o.prefill_gemm_min_tokens);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &o, "test".into()).unwrap();
    let mut reference = RefModel::new(&spec, &w);
    let prompt: Vec<u32> = (0..23)
        .map(|_| rng.random_range(0..spec.vocab_size as u32))
        .collect();
    let steps = 12;
    let bs = block_size as usize;
    let mut free: Vec<u32> = (0..96).collect();
    let tbl = table(&mut rng, &mut free, (prompt.len() + steps).div_ceil(bs));
    // reference prefill
    let mut ref_logits = Vec::new();
    for &t in &prompt {
        ref_logits = reference.step(t);
    }
    // device: chunk 1 (no logits), chunk 2 (logits)
    let c1 = ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &prompt[..10],
            start_pos: 0,
            block_table: &tbl,
            want_logits: false,
        }],
    };
    assert_eq!(be.forward(&c1).unwrap().rows(), 0);
    let c2 = ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &prompt[10..],
            start_pos: 10,
            block_table: &tbl,
            want_logits: true,
        }],
    };
    let mut logits = be.forward(&c2).unwrap();
    let mut worst = 0f32;
    for (pos, step) in (prompt.len()..).zip(0..=steps) {
        assert_eq!(logits.rows(), 1);
        let e = rel_err(logits.row(0), &ref_logits);
        worst = worst.max(e);
        assert!(e < 3e-2, "step {step}: logits rel err {e}");
        let (gt, rt) = (argmax(logits.row(0)), argmax(&ref_logits));
        if gt != rt {
            assert!(
                margin(&ref_logits) < 0.15,
                "step {step}: greedy {gt} vs reference {rt} with margin {}",
                margin(&ref_logits)
            );
        }
        if step == steps {
            break;
        }
        let tok = [rt as u32];
        ref_logits = reference.step(rt as u32);
        logits = be
            .forward(&ForwardBatch {
                seqs: vec![SeqStep {
                    tokens: &tok,
                    start_pos: pos,
                    block_table: &tbl,
                    want_logits: true,
                }],
            })
            .unwrap();
    }
    eprintln!(
        "{tag} qwen_like={qwen_like} tied={tied} bs={block_size} gemm_min={gemm_min}: worst logits rel err {worst}"
    );
}

/// Every `engine.cuda.*` kernel choice, taken from the config as `pdnode start` takes it, runs
/// chunked prefill (10 + 13 tokens through the prefill path) and greedy decode within the
/// reference's tolerance, at head_dim 64 (where v4 and the flash prefill kernels run).
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn every_engine_cuda_kernel_choice_matches_reference() {
    use pdnode_core::config::{
        AttentionKernel as A, EngineConfig, LinearKernel as L, PrefillAttention as P,
    };
    let mut spec = tiny_spec(false, false);
    (
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
    ) = (256, 4, 2, 64);
    for (attention, linear, prefill, waves, max_part) in [
        (A::Auto, L::Table, P::Flashv3, 1, 4096),
        (A::V4, L::Mma, P::Flash8, 4, 128),
        (A::V1, L::Gemv, P::Gemm, 1, 4096),
        (A::V2, L::Cublas, P::Flashv3, 1, 4096),
        (A::V2narrow, L::Table, P::Flash8, 64, 1 << 20),
        (A::Auto, L::Table, P::Wgmma, 1, 4096),
    ] {
        let mut e = EngineConfig::default();
        e.cuda.attention = attention;
        e.cuda.linear = linear;
        e.cuda.prefill_attention = prefill;
        e.cuda.attention_v4_waves = waves;
        e.cuda.attention_v4_max_part = max_part;
        let c = CudaOptions::from_config(&e);
        let o = CudaOptions {
            attention: c.attention,
            linear: c.linear,
            prefill_attention: c.prefill_attention,
            ..opts_gemm(16, 8)
        };
        let tag = format!("{attention:?}/{linear:?}/{prefill:?} waves={waves} max_part={max_part}");
        prefill_decode_parity_with(&spec, o, &tag);
        println!("PASS engine.cuda {tag}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn llama_like_prefill_decode_matches_reference() {
    // prompt chunks of 10 and 13 tokens take the cuBLAS prefill path
    prefill_decode_parity(false, false, 16, 8);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn qwen_like_tied_small_blocks_matches_reference() {
    // everything through the paged-attention kernel
    prefill_decode_parity(true, true, 4, 1000);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn mixed_batch_matches_per_sequence_reference() {
    let mut rng = rng("mixed_batch");
    let spec = tiny_spec(true, false);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(8), "test".into()).unwrap();
    let lens = [5usize, 19, 1];
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| rng.random_range(0..spec.vocab_size as u32))
                .collect()
        })
        .collect();
    let mut free: Vec<u32> = (0..96).collect();
    let tables: Vec<Vec<BlockId>> = lens
        .iter()
        .map(|&n| table(&mut rng, &mut free, (n + 2).div_ceil(8)))
        .collect();
    // step 1: all three prompts in one batch (sequence 1 without logits)
    let b = ForwardBatch {
        seqs: (0..3)
            .map(|i| SeqStep {
                tokens: &prompts[i],
                start_pos: 0,
                block_table: &tables[i],
                want_logits: i != 1,
            })
            .collect(),
    };
    let l1 = be.forward(&b).unwrap();
    assert_eq!(l1.rows(), 2);
    let mut refs: Vec<RefModel> = (0..3).map(|_| RefModel::new(&spec, &w)).collect();
    let mut last = vec![Vec::new(); 3];
    for i in 0..3 {
        for &t in &prompts[i] {
            last[i] = refs[i].step(t);
        }
    }
    assert!(rel_err(l1.row(0), &last[0]) < 3e-2);
    assert!(rel_err(l1.row(1), &last[2]) < 3e-2);
    // step 2: one decode token each, in reverse order
    let next: Vec<[u32; 1]> = (0..3).map(|i| [argmax(&last[i]) as u32]).collect();
    let b = ForwardBatch {
        seqs: (0..3)
            .rev()
            .map(|i| SeqStep {
                tokens: &next[i],
                start_pos: lens[i],
                block_table: &tables[i],
                want_logits: true,
            })
            .collect(),
    };
    let l2 = be.forward(&b).unwrap();
    for (row, i) in (0..3).rev().enumerate() {
        let want = refs[i].step(next[i][0]);
        let e = rel_err(l2.row(row), &want);
        assert!(e < 3e-2, "sequence {i}: rel err {e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn kv_read_write_moves_a_sequence_to_other_blocks() {
    let mut rng = rng("kv_round_trip");
    let spec = tiny_spec(false, true);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(4), "test".into()).unwrap();
    let prompt: Vec<u32> = (0..14)
        .map(|_| rng.random_range(0..spec.vocab_size as u32))
        .collect();
    let mut free: Vec<u32> = (0..96).collect();
    let src = table(&mut rng, &mut free, 4);
    let dst = table(&mut rng, &mut free, 4);
    let run = |be: &mut CudaBackend, tokens: &[u32], start: usize, tbl: &[BlockId]| {
        be.forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens,
                start_pos: start,
                block_table: tbl,
                want_logits: true,
            }],
        })
        .unwrap()
    };
    run(&mut be, &prompt, 0, &src);
    let layout = be.kv_layout().clone();
    let n = layout.num_layers as usize * src.len() * layout.block_layer_bytes();
    let mut buf = vec![0u8; n];
    be.read_kv(0..layout.num_layers, &src, &mut buf).unwrap();
    // written in two halves (layers 0..1 and 1..L) to exercise layer ranges
    let split = layout.block_layer_bytes() * src.len();
    be.write_kv(0..1, &dst, &buf[..split]).unwrap();
    be.write_kv(1..layout.num_layers, &dst, &buf[split..])
        .unwrap();
    let tok = [3u32];
    let a = run(&mut be, &tok, 14, &src);
    let b = run(&mut be, &tok, 14, &dst);
    assert_eq!(a, b, "decode over the copied blocks gives identical logits");
    let mut back = vec![0u8; n];
    be.read_kv(0..layout.num_layers, &dst, &mut back).unwrap();
    // the decode step wrote position 14 (block 3, slot 2) in both: compare the rest
    assert_eq!(buf.len(), back.len());
    let regions = be.kv_regions();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].mem, MemKind::Cuda(0));
    assert_eq!(regions[0].len, 96 * layout.block_bytes());
    // typed errors
    assert!(matches!(
        be.read_kv(
            0..1,
            &[BlockId(96)],
            &mut vec![0u8; layout.block_layer_bytes()]
        ),
        Err(BackendError::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        be.read_kv(0..1, &src, &mut [0u8; 3]),
        Err(BackendError::KvBufferSize { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn invalid_batches_are_typed_errors() {
    let mut rng = rng("invalid");
    let spec = tiny_spec(false, false);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(16), "test".into()).unwrap();
    let tbl = [BlockId(0)];
    let bad_tok = [spec.vocab_size as u32];
    let r = be.forward(&ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &bad_tok,
            start_pos: 0,
            block_table: &tbl,
            want_logits: true,
        }],
    });
    assert!(matches!(r, Err(BackendError::InvalidBatch { .. })));
    let r = be.forward(&ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &[1, 2],
            start_pos: 15,
            block_table: &tbl,
            want_logits: true,
        }],
    });
    assert!(
        matches!(r, Err(BackendError::InvalidBatch { .. })),
        "table too short"
    );
    let r = be.forward(&ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &[1],
            start_pos: 0,
            block_table: &[BlockId(1000)],
            want_logits: true,
        }],
    });
    assert!(matches!(r, Err(BackendError::BlockOutOfRange { .. })));
    // two sequences sharing a block and writing the same slot
    let r = be.forward(&ForwardBatch {
        seqs: vec![
            SeqStep {
                tokens: &[1],
                start_pos: 3,
                block_table: &[BlockId(2)],
                want_logits: true,
            },
            SeqStep {
                tokens: &[2],
                start_pos: 3,
                block_table: &[BlockId(2)],
                want_logits: true,
            },
        ],
    });
    assert!(
        matches!(r, Err(BackendError::InvalidBatch { .. })),
        "duplicate slot"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn dummy_weights_give_finite_logits_and_pool_from_mem_fraction() {
    let spec = tiny_spec(false, false);
    let mut o = opts(16);
    o.num_kv_blocks = 0;
    o.mem_fraction = 0.05;
    let mut be = CudaBackend::new_dummy(&spec, 42, &o, "dummy".into()).unwrap();
    assert!(be.num_kv_blocks() > 1000, "{} blocks", be.num_kv_blocks());
    let l = be
        .forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &[1, 2, 3],
                start_pos: 0,
                block_table: &[BlockId(5)],
                want_logits: true,
            }],
        })
        .unwrap();
    assert!(l.data.iter().all(|x| x.is_finite()));
    assert!(l.data.iter().any(|&x| x != 0.0));
}

/// The KV staging arena (`KvStaging`): the prompt's blocks gathered into the arena at an offset
/// and scattered into other blocks read back byte for byte; out-of-range and misaligned offsets
/// are typed errors; a 4k-token Llama-3.1-8B-shaped gather/scatter is timed.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn kv_staging_arena_round_trip() {
    let mut rng = rng("staging");
    let spec = tiny_spec(false, false);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(4), "test".into()).unwrap();
    assert!(
        be.kv_staging().is_none(),
        "no arena before enable_kv_staging"
    );
    let src = [BlockId(5), BlockId(9), BlockId(2), BlockId(40)];
    let dst = [BlockId(60), BlockId(61), BlockId(7), BlockId(80)];
    let prompt: Vec<u32> = (0..14u32).map(|i| (i * 3 + 1) % 251).collect();
    be.forward(&ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &prompt,
            start_pos: 0,
            block_table: &src,
            want_logits: true,
        }],
    })
    .unwrap();
    let layout = be.kv_layout().clone();
    let l = layout.num_layers;
    let per = l as usize * src.len() * layout.block_layer_bytes();
    let region = be.enable_kv_staging(per + 4096).unwrap().expect("an arena");
    assert_eq!(region.mem, MemKind::Cuda(0));
    assert_eq!(region.len, per + 4096);
    assert!(be.enable_kv_staging(1).is_err(), "allocated once");
    let s = be.kv_staging().expect("arena enabled");
    assert_eq!(s.staging_regions().len(), 1);
    s.gather_kv_to_staging(0..l, &src, 256).unwrap();
    s.scatter_kv_from_staging(0..l, &dst, 256).unwrap();
    assert!(matches!(
        s.gather_kv_to_staging(0..l, &src, 4096 + 256),
        Err(BackendError::StagingRange { .. })
    ));
    assert!(matches!(
        s.gather_kv_to_staging(0..l, &src, 16),
        Err(BackendError::StagingRange { .. })
    ));
    assert!(matches!(
        s.scatter_kv_from_staging(0..l, &[BlockId(96)], 0),
        Err(BackendError::BlockOutOfRange { .. })
    ));
    let (mut a, mut b) = (vec![0u8; per], vec![0u8; per]);
    be.read_kv(0..l, &src, &mut a).unwrap();
    be.read_kv(0..l, &dst, &mut b).unwrap();
    assert!(a.iter().any(|x| *x != 0), "the prompt wrote KV");
    let same = a == b;
    println!(
        "{} kv_staging_arena_round_trip: {per} bytes gathered at offset 256 and scattered back",
        if same { "PASS" } else { "FAIL" }
    );
    assert!(same, "gather + scatter through the arena changed the KV");
    // the arena's sum on the GPU is the host CRC32C of the gathered bytes (one byte fewer sums
    // differently); a span past the arena is a typed error
    let sum = be.staging_crc32c(256, per).unwrap();
    assert_eq!(sum, pdnode_transfer::checksum::crc32c(&a));
    assert_ne!(sum, be.staging_crc32c(256, per - 1).unwrap());
    assert!(be.staging_crc32c(4096, per + 1).is_err());
    println!("PASS kv_staging_arena_crc32c: {per} bytes, {sum:#010x}");

    // What a device hand-off's fence uses: KVH64 of the span on the GPU equals the host
    // definition over the same bytes; a 64-byte record written behind the span reads back, and
    // changes neither the span's sum nor the KV; a span or rank outside is a typed error.
    let s = be.kv_staging().expect("arena enabled");
    let h = s.staging_kvh64(256, per).unwrap();
    assert_eq!(h, vec![pdnode_core::kvh64::kvh64(&a).unwrap()]);
    let record: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    s.staging_write(0, 256 + per, &record).unwrap();
    let mut back = vec![0u8; 64];
    s.staging_read(0, 256 + per, &mut back).unwrap();
    assert_eq!(back, record);
    assert_eq!(s.staging_kvh64(256, per).unwrap(), h);
    let mut flipped = record.clone();
    flipped[0] ^= 1;
    s.staging_write(0, 256, &flipped[..16]).unwrap();
    assert_ne!(
        s.staging_kvh64(256, per).unwrap(),
        h,
        "a changed word changes the sum"
    );
    assert!(matches!(
        s.staging_write(0, 4096 + per, &record),
        Err(BackendError::StagingRange { .. })
    ));
    assert!(matches!(
        s.staging_read(1, 0, &mut back),
        Err(BackendError::StagingRank { rank: 1, ranks: 1 })
    ));
    println!(
        "PASS kv_staging_arena_records: KVH64 {:#018x}, record round trip",
        h[0]
    );
    // The decode side's hashed scatter: the bytes it moves, and their KVH64 from the copy.
    s.gather_kv_to_staging(0..l, &src, 256).unwrap();
    let hs = s.scatter_kv_from_staging_h64(0..l, &dst, 256).unwrap();
    assert_eq!(hs, h, "kv_scatter_h64 sums what kvh64_words sums");
    be.read_kv(0..l, &dst, &mut b).unwrap();
    assert_eq!(a, b, "the hashed scatter moved the span");
    println!("PASS kv_staging_scatter_h64: {:#018x}", hs[0]);

    // Hashed inside the gathers that fill it (`staging_hash_begin`): a span filled chunk by
    // chunk, out of order and strided as a prefill's chunks land, seals to the KVH64 of its
    // bytes without a pass; one gathered twice, or not in full, is read again and still right.
    let lb = layout.block_layer_bytes();
    let stride = src.len() * lb;
    let sealed = |be: &mut CudaBackend| -> (Vec<u64>, u64) {
        let before = be.fused_seals();
        let h = be.kv_staging().unwrap().staging_kvh64(256, per).unwrap();
        (h, be.fused_seals() - before)
    };
    let s = be.kv_staging().unwrap();
    assert!(s.staging_hash_begin(256, per).unwrap());
    s.gather_kv_layers_to_staging(0..l, &src[2..], 256 + 2 * lb, stride)
        .unwrap();
    s.gather_kv_layers_to_staging(0..l, &src[..2], 256, stride)
        .unwrap();
    assert_eq!(sealed(&mut be), (h.clone(), 1), "fused: no pass, same hash");
    assert_eq!(sealed(&mut be), (h.clone(), 0), "sealed once; then a pass");
    let s = be.kv_staging().unwrap();
    assert!(s.staging_hash_begin(256, per).unwrap());
    s.gather_kv_to_staging(0..l, &src, 256).unwrap();
    s.gather_kv_layers_to_staging(0..l, &src[..1], 256, stride)
        .unwrap();
    assert_eq!(sealed(&mut be), (h.clone(), 0), "gathered twice: a pass");
    let s = be.kv_staging().unwrap();
    assert!(s.staging_hash_begin(256, per).unwrap());
    s.gather_kv_layers_to_staging(0..l, &src[1..], 256 + lb, stride)
        .unwrap();
    assert_eq!(
        sealed(&mut be),
        (h.clone(), 0),
        "block 0 not gathered: a pass"
    );
    let s = be.kv_staging().unwrap();
    assert!(s.staging_hash_begin(256, per).unwrap());
    s.gather_kv_to_staging(0..l, &src, 256).unwrap();
    s.staging_write(0, 256 + lb, &[7u8; 16]).unwrap();
    let (poked, fused) = sealed(&mut be);
    assert_eq!(fused, 0, "a write that does not hash: a pass");
    assert_ne!(poked, h, "the pass sees the poked word");
    println!("PASS kv_staging_fused_kvh64: gathers hash their span, fallbacks are passes");

    // Llama-3.1-8B shapes (32 layers, 8 KV heads, head dim 128, block 16): 4096 tokens.
    let spec8 = pdnode_engine::loader::dummy::llama31_8b();
    let mut o = opts(16);
    o.num_kv_blocks = 512;
    o.max_batch_tokens = 64;
    let mut be8 = CudaBackend::new_dummy(&spec8, 3, &o, "8b".into()).unwrap();
    let lay = be8.kv_layout().clone();
    let blocks: Vec<BlockId> = (0..256u32).map(|i| BlockId((i * 7) % 512)).collect();
    let bytes = lay.num_layers as usize * blocks.len() * lay.block_layer_bytes();
    be8.enable_kv_staging(bytes).unwrap();
    let s8 = be8.kv_staging().unwrap();
    s8.gather_kv_to_staging(0..lay.num_layers, &blocks, 0)
        .unwrap();
    let t = std::time::Instant::now();
    for _ in 0..5 {
        s8.gather_kv_to_staging(0..lay.num_layers, &blocks, 0)
            .unwrap();
    }
    let g = t.elapsed().as_secs_f64() / 5.0;
    let t = std::time::Instant::now();
    for _ in 0..5 {
        s8.scatter_kv_from_staging(0..lay.num_layers, &blocks, 0)
            .unwrap();
    }
    let sc = t.elapsed().as_secs_f64() / 5.0;
    println!(
        "PASS kv_staging 4k tokens llama-3.1-8b ({} MiB): gather {:.3} ms ({:.0} GB/s), scatter {:.3} ms ({:.0} GB/s)",
        bytes >> 20,
        g * 1e3,
        bytes as f64 / g / 1e9,
        sc * 1e3,
        bytes as f64 / sc / 1e9
    );
    // What a verified device hand-off adds per side (issue 15): P's seal is one KVH64 pass
    // (`staging_kvh64`) and a 64-byte record write per rank; D's scatter hashes what it moves
    // (`scatter_kv_from_staging_h64`) and reads each record back.
    let time = |f: &mut dyn FnMut()| {
        f();
        let t = std::time::Instant::now();
        for _ in 0..5 {
            f();
        }
        t.elapsed().as_secs_f64() / 5.0
    };
    let s8 = be8.kv_staging().unwrap();
    let kvh = time(&mut || {
        s8.staging_kvh64(0, bytes).unwrap();
    });
    let sch = time(&mut || {
        s8.scatter_kv_from_staging_h64(0..lay.num_layers, &blocks, 0)
            .unwrap();
    });
    // P's seal hashed inside its gathers: the prompt's chunks gathered into a registered
    // span (16 chunks of 16 blocks, strided), then the seal reads the sum.
    let lb8 = lay.block_layer_bytes();
    let chunked = |s8: &mut dyn pdnode_engine::backend::KvStaging, hashed: bool| {
        if hashed {
            assert!(s8.staging_hash_begin(0, bytes).unwrap());
        }
        for (i, part) in blocks.chunks(16).enumerate() {
            s8.gather_kv_layers_to_staging(
                0..lay.num_layers,
                part,
                i * 16 * lb8,
                blocks.len() * lb8,
            )
            .unwrap();
        }
    };
    let plain_g = time(&mut || chunked(&mut *s8, false));
    let fused_g = time(&mut || chunked(&mut *s8, true));
    let mut seal = 0.0;
    for _ in 0..5 {
        chunked(&mut *s8, true);
        let t = std::time::Instant::now();
        s8.staging_kvh64(0, bytes).unwrap();
        seal += t.elapsed().as_secs_f64() / 5.0;
    }
    let rec = [0u8; 64];
    let wr = time(&mut || s8.staging_write(0, bytes - 64, &rec).unwrap());
    let mut back = [0u8; 64];
    let rd = time(&mut || s8.staging_read(0, bytes - 64, &mut back).unwrap());
    println!(
        "BENCH verify {} MiB: kvh64 pass {:.3} ms ({:.0} GB/s), scatter {:.3} ms, scatter_h64 {:.3} ms (+{:.3}), record write {:.1} us, record read {:.1} us",
        bytes >> 20,
        kvh * 1e3,
        bytes as f64 / kvh / 1e9,
        sc * 1e3,
        sch * 1e3,
        (sch - sc) * 1e3,
        wr * 1e6,
        rd * 1e6
    );
    assert_eq!(
        be8.fused_seals(),
        5,
        "each timed seal read its gathers' sum"
    );
    println!(
        "BENCH verify fused {} MiB: 16 chunk gathers {:.3} ms plain, {:.3} ms hashed (+{:.3}); seal from the sum {:.1} us (pass {:.3} ms)",
        bytes >> 20,
        plain_g * 1e3,
        fused_g * 1e3,
        (fused_g - plain_g) * 1e3,
        seal * 1e6,
        kvh * 1e3
    );
}

/// In-step staging (`KvStaging::stage_next_step`): during a prefill step the backend gathers the
/// prompt's KV into the arena layer group by layer group as it is written and notifies each group
/// with a gate (a CUDA event); every group is announced once, in order, covering all layers, each
/// gate opens, and what landed in the arena is the step's final KV (scattered into other blocks,
/// it reads back equal to the source blocks). The plan is consumed by its step.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn in_step_staging_gathers_each_layer_group_behind_its_gate() {
    use pdnode_engine::backend::{LayerGate, StageSeq, StepStaging};
    use std::sync::{Arc, Mutex};
    let mut rng = rng("in-step staging");
    let spec = tiny_spec(false, false);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(4), "test".into()).unwrap();
    let layout = be.kv_layout().clone();
    let (l, lb) = (layout.num_layers, layout.block_layer_bytes());
    let src = [BlockId(5), BlockId(9), BlockId(2), BlockId(40)];
    let dst = [BlockId(60), BlockId(61), BlockId(7), BlockId(80)];
    let per = l as usize * src.len() * lb;
    be.enable_kv_staging(per + 4096).unwrap().expect("an arena");
    for group in [1u32, 2, l + 3] {
        type Announced = Vec<(usize, std::ops::Range<u32>, LayerGate)>;
        let seen: Arc<Mutex<Announced>> = Arc::default();
        let sink = seen.clone();
        let plan = StepStaging {
            seqs: vec![StageSeq {
                blocks: src.to_vec(),
                offset: 256,
                layer_stride: src.len() * lb,
            }],
            group,
            notify: Box::new(move |i, layers, gate| sink.lock().unwrap().push((i, layers, gate))),
        };
        let s = be.kv_staging().expect("arena enabled");
        assert!(
            s.supports_step_staging(),
            "one GPU with an arena stages in a step"
        );
        s.stage_next_step(plan).unwrap();
        let prompt: Vec<u32> = (0..14u32).map(|i| (i * 3 + group) % 251).collect();
        be.forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &prompt,
                start_pos: 0,
                block_table: &src,
                want_logits: true,
            }],
        })
        .unwrap();
        let mut got = std::mem::take(&mut *seen.lock().unwrap());
        let ranges: Vec<_> = got.iter().map(|(_, r, _)| r.clone()).collect();
        let mut want = Vec::new();
        let mut a = 0;
        while a < l {
            let b = (a + group).min(l);
            want.push(a..b);
            a = b;
        }
        assert_eq!(ranges, want, "groups of {group}: announced layer groups");
        assert!(got.iter().all(|(i, _, _)| *i == 0));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for (_, r, gate) in &mut got {
            loop {
                match gate() {
                    Ok(true) => break,
                    Ok(false) => assert!(
                        std::time::Instant::now() < deadline,
                        "gate of layers {r:?} never opened"
                    ),
                    Err(e) => panic!("gate of layers {r:?} failed: {e}"),
                }
            }
        }
        let s = be.kv_staging().unwrap();
        s.scatter_kv_from_staging(0..l, &dst, 256).unwrap();
        let (mut x, mut y) = (vec![0u8; per], vec![0u8; per]);
        be.read_kv(0..l, &src, &mut x).unwrap();
        be.read_kv(0..l, &dst, &mut y).unwrap();
        assert!(x.iter().any(|v| *v != 0), "the prompt wrote KV");
        let same = x == y;
        println!(
            "{} in_step_staging groups of {group}: {} groups announced, gates open, {per} bytes equal",
            if same { "PASS" } else { "FAIL" },
            ranges.len()
        );
        assert!(
            same,
            "groups of {group}: the arena does not hold the step's KV"
        );
        // Consumed: the next step announces nothing.
        be.forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &prompt[..1],
                start_pos: 14,
                block_table: &src,
                want_logits: true,
            }],
        })
        .unwrap();
        assert!(seen.lock().unwrap().is_empty(), "a plan outlived its step");
    }
}
