//! Launch variants that must not change a bit: decode steps (and a prefill step) on backends
//! built alike, one launching our kernels with programmatic dependent launch (every step, or
//! small steps only) or through the streaming decode GEMVs, against plain backends; logits and
//! the KV written bit-identical, eagerly and replayed from CUDA graphs.

use super::*;

// ---- programmatic dependent launch (engine.cuda.pdl) ----------------------------------------------

/// Elements whose bits differ, and the largest absolute difference among them.
fn bit_diff(a: &[f32], b: &[f32]) -> (usize, f32) {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .fold((0, 0f32), |(n, m), (x, y)| (n + 1, m.max((x - y).abs())))
}

/// `fb` on each backend of `[plain, variant, control]`: the logits and the KV of `fb`'s blocks
/// must be bit-identical to the plain backend's, for the variant (`label`: PDL, L2 prefetch) and
/// for the control (a second plain backend: a difference there is nondeterminism, not the
/// variant); returns how many logits were compared per backend.
fn same_out(
    name: &str,
    label: &str,
    what: &str,
    bes: &mut [CudaBackend; 3],
    fb: &ForwardBatch,
) -> usize {
    let used: Vec<BlockId> = fb
        .seqs
        .iter()
        .flat_map(|s| s.block_table.iter().copied())
        .collect();
    let layers = bes[0].kv_layout().num_layers;
    let mut outs = Vec::new();
    for be in bes.iter_mut() {
        let l = be.forward(fb).unwrap();
        outs.push((l.data, read_all(be, layers, &used)));
    }
    let with = format!("with {label}");
    for (i, who) in [
        (
            2,
            "between two plain backends (nondeterminism, not the variant)",
        ),
        (1, with.as_str()),
    ] {
        let (n, worst) = bit_diff(&outs[i].0, &outs[0].0);
        assert!(
            n == 0,
            "{name} {what}: {n} of {} logits differ {who} (max |diff| {worst:e})",
            outs[0].0.len()
        );
        assert!(
            outs[i].1 == outs[0].1,
            "{name} {what}: KV bytes differ {who}"
        );
    }
    outs[0].0.len()
}

/// The same steps on three backends built alike (weights, KV contents), one launching our
/// kernels with programmatic dependent launch and two without: a prefill step (a long prompt on
/// the prefill attention path, a short one on the paged kernel), then decode steps eagerly and
/// from CUDA graphs (captured with PDL launches in them) at batch sizes with padding rows. Logits
/// and the KV written must be bit-identical: PDL changes when a kernel is scheduled, never what
/// it computes, as long as every kernel waits (`griddepcontrol.wait`) before touching memory.
fn pdl_matches_plain_launches(spec: &ModelSpec, name: &str) {
    let mut rng = rng(name);
    let w = tiny_weights(spec, &mut rng);
    let mut bes: [CudaBackend; 3] =
        std::array::from_fn(|_| CudaBackend::new(spec, &w, &opts(1, true), "test".into()).unwrap());
    // no small-step PDL (Fusion::pdl_max_tokens) on any of them: the plain ones stay plain
    for be in bes.iter_mut() {
        let f = be.fusion();
        be.set_fusion(pdnode_cuda::ops::Fusion {
            pdl_max_tokens: 0,
            ..f
        });
    }
    assert!(!bes[0].set_pdl(false) && !bes[2].set_pdl(false));
    if !bes[1].set_pdl(true) {
        println!("GRAPH pdl {name}: SKIP (this GPU or driver takes no programmatic launches)");
        return;
    }
    variant_matches_plain(spec, name, "PDL", &mut rng, &mut bes);
    assert!(bes[1].pdl() && !bes[0].pdl() && !bes[2].pdl());
}

/// The steps of [`pdl_matches_plain_launches`] on `[plain, variant, control]` backends built
/// alike (same weights): KV filled alike, a prefill step, then decode steps of 1, 3, 8 and 33
/// rows eagerly and replayed from graphs.
fn variant_matches_plain(
    spec: &ModelSpec,
    name: &str,
    label: &str,
    rng: &mut rand_chacha::ChaCha8Rng,
    bes: &mut [CudaBackend; 3],
) {
    let seed: u64 = rng.random();
    for be in bes.iter_mut() {
        be.fill_kv_random(seed).unwrap();
    }
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    free.shuffle(rng);
    // prefill: 100 tokens (>= prefill_gemm_min_tokens) and 9
    let p1: Vec<u32> = (0..100)
        .map(|_| rng.random_range(0..spec.vocab_size as u32))
        .collect();
    let p2: Vec<u32> = (0..9)
        .map(|_| rng.random_range(0..spec.vocab_size as u32))
        .collect();
    let t1: Vec<BlockId> = free
        .drain(..100usize.div_ceil(BLOCK))
        .map(BlockId)
        .collect();
    let t2: Vec<BlockId> = free.drain(..1).map(BlockId).collect();
    let prefill = ForwardBatch {
        seqs: vec![
            SeqStep {
                tokens: &p1,
                start_pos: 0,
                block_table: &t1,
                want_logits: true,
            },
            SeqStep {
                tokens: &p2,
                start_pos: 0,
                block_table: &t2,
                want_logits: true,
            },
        ],
    };
    let mut compared = same_out(name, label, "prefill", bes, &prefill);
    let sizes = [1usize, 3, 8, 33];
    for &n in &sizes {
        let s = seqs(rng, &mut free, n);
        for step in 0..STEPS {
            let toks: Vec<[u32; 1]> = (0..n)
                .map(|_| [rng.random_range(0..spec.vocab_size as u32)])
                .collect();
            let b = batch(&s, &toks, step);
            for graphs in [false, true] {
                for be in bes.iter_mut() {
                    be.set_cuda_graphs(graphs);
                }
                let what = format!("batch {n} step {step} graphs={graphs}");
                compared += same_out(name, label, &what, bes, &b);
            }
        }
    }
    let steps = (sizes.len() * STEPS) as u64;
    for be in bes.iter() {
        let st = be.graph_stats();
        assert_eq!(st.capture_failures, 0, "{name}: {st:?}");
        assert_eq!(
            st.replays, steps,
            "{name}: every decode step replayed: {st:?}"
        );
    }
    println!(
        "GRAPH {label} {name}: PASS, prefill + {steps} decode steps eager and replayed, {compared} logits and the KV bit-identical with and without {label} (and between the two plain backends); {label} graphs {:?}",
        bes[1].graph_stats()
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn pdl_decode_steps_match_plain_launches() {
    pdl_matches_plain_launches(&tiny_spec(false, false), "tiny-llama");
    pdl_matches_plain_launches(&qwen_like_spec(), "qwen-like-hd128");
    pdl_matches_plain_launches(&wide_spec(), "llama-hd128");
}

// ---- PDL for small decode steps only (Fusion::pdl_max_tokens) -------------------------------------

/// A backend with the default small-step PDL (decode steps of 1-2 rows; with the norm not
/// fused into o/down, where it applies) against two backends with no PDL at all: logits and KV
/// bit-identical over the same prefill and decode steps (1, 3, 8 and 33 rows, eager and
/// replayed), and the every-step switch off afterwards.
fn small_step_pdl_matches_plain(spec: &ModelSpec, name: &str) {
    let mut rng = rng(name);
    let w = tiny_weights(spec, &mut rng);
    let mut bes: [CudaBackend; 3] =
        std::array::from_fn(|_| CudaBackend::new(spec, &w, &opts(1, true), "test".into()).unwrap());
    // small-step PDL applies where the norm is not fused into o/down
    let on = pdnode_cuda::ops::Fusion {
        norm_max_tokens: 0,
        ..Default::default()
    };
    assert!(
        on.pdl_max_tokens >= 1,
        "the default takes PDL for 1-row steps"
    );
    bes[1].set_fusion(on);
    if !bes[1].set_pdl(true) {
        println!(
            "GRAPH small-step-pdl {name}: SKIP (this GPU or driver takes no programmatic launches)"
        );
        return;
    }
    bes[1].set_pdl(false);
    let off = pdnode_cuda::ops::Fusion {
        pdl_max_tokens: 0,
        ..on
    };
    bes[0].set_fusion(off);
    bes[2].set_fusion(off);
    variant_matches_plain(spec, name, "small-step PDL", &mut rng, &mut bes);
    assert!(!bes[0].pdl() && !bes[1].pdl() && !bes[2].pdl());
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn small_decode_steps_with_pdl_match_plain_launches() {
    small_step_pdl_matches_plain(&tiny_spec(false, false), "tiny-llama");
    small_step_pdl_matches_plain(&wide_spec(), "llama-hd128");
}

// ---- streaming GEMVs for small decode steps (Fusion::stream_max_tokens) ---------------------------

/// Decode steps of 1-4 rows through `gemv_stream` (its first weight copies issued before the
/// grid-dependency wait): a backend with small-step PDL against two without, all streaming,
/// bit-identical eager and replayed (the early copies read only weights, so PDL changes
/// nothing); steps of 8 and 33 rows do not stream. Then a streaming backend against one that
/// does not: the same tokens' logits within bf16 rounding (the sums run in another order).
fn streaming_steps_match(spec: &ModelSpec, name: &str) {
    use pdnode_cuda::ops::{Fusion, STREAM_MAX_TOKENS};
    let mut rng = rng(name);
    let w = tiny_weights(spec, &mut rng);
    let mut bes: [CudaBackend; 3] =
        std::array::from_fn(|_| CudaBackend::new(spec, &w, &opts(1, true), "test".into()).unwrap());
    let on = Fusion {
        stream_max_tokens: STREAM_MAX_TOKENS,
        pdl_max_tokens: 0,
        ..Default::default()
    };
    for be in bes.iter_mut() {
        be.set_fusion(on);
    }
    if !bes[0].streams_step(1) {
        println!("GRAPH streaming {name}: SKIP (no gemv_stream on this GPU)");
        return;
    }
    assert!(bes[0].streams_step(STREAM_MAX_TOKENS) && !bes[0].streams_step(STREAM_MAX_TOKENS + 1));
    // with PDL and half the shared memory (two blocks an SM: the next GEMV's copies start while
    // one streams); a row's sum does not depend on the stages, so the logits stay the same bits
    bes[1].set_fusion(Fusion {
        pdl_max_tokens: STREAM_MAX_TOKENS,
        stream_smem_kib: 113,
        ..on
    });
    variant_matches_plain(
        spec,
        name,
        "streaming GEMVs + small-step PDL + half the shared memory",
        &mut rng,
        &mut bes,
    );

    // against the unstreamed step: same weights, same KV, decode steps of 1 and 3 rows
    let mut plain = CudaBackend::new(spec, &w, &opts(1, true), "test".into()).unwrap();
    plain.set_fusion(Fusion {
        stream_max_tokens: 0,
        ..on
    });
    assert!(!plain.streams_step(1));
    let seed: u64 = rng.random();
    plain.fill_kv_random(seed).unwrap();
    bes[0].fill_kv_random(seed).unwrap();
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    free.shuffle(&mut rng);
    let mut worst = 0f32;
    for n in [1usize, 3] {
        let s = seqs(&mut rng, &mut free, n);
        let toks: Vec<[u32; 1]> = (0..n)
            .map(|_| [rng.random_range(0..spec.vocab_size as u32)])
            .collect();
        let b = batch(&s, &toks, 0);
        let (a, p) = (
            bes[0].forward(&b).unwrap().data,
            plain.forward(&b).unwrap().data,
        );
        let scale = p.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&p)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(a.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
        worst = worst.max(diff / scale.max(1e-6));
    }
    assert!(
        worst < 2e-2,
        "{name}: streamed logits off by {worst:e} of the largest"
    );
    println!(
        "GRAPH streaming {name}: PASS, against the unstreamed step max |diff| {worst:.1e} of the largest logit"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn streaming_decode_steps_match() {
    streaming_steps_match(&tiny_spec(false, false), "tiny-llama");
    streaming_steps_match(&wide_spec(), "llama-hd128");
}
