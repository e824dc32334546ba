//! Decode steps replayed from CUDA graphs against the same steps launched eagerly: logits and KV
//! writes within bf16 bounds for batch sizes that need padding rows (3 -> 4, 33 -> 48), mixed
//! context lengths over several context buckets, several steps; KV blocks outside the batch's
//! sequences untouched. Sampled rows on the device: `cuda_graphs_sample`; programmatic dependent
//! launch and the streaming decode GEMVs against plain launches: `cuda_graphs_pdl`. GPU only:
//! `#[ignore]`d, run by scripts/gpu/run-all.sh (`graphs`; the TP=2 tests also from `tp`, and
//! skip on a single GPU).

mod cuda_graphs_pdl;
mod cuda_graphs_sample;
mod cuda_support;

use cuda_support::*;
use pdnode_core::BlockId;
use pdnode_cuda::ops::{AttnVariant, LinearImpl};
use pdnode_cuda::{CudaBackend, CudaOptions, CudaTpBackend};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::spec::ModelSpec;
use rand::Rng;
use rand::seq::SliceRandom;

const BLOCK: usize = 16;
const NUM_BLOCKS: u32 = 4096;
const STEPS: usize = 4;

fn opts(tp: u32, graphs: bool) -> CudaOptions {
    CudaOptions {
        gpus: (0..tp).collect(),
        tensor_parallel: tp,
        mem_fraction: 0.9,
        num_kv_blocks: NUM_BLOCKS,
        block_size: BLOCK as u32,
        max_batch_tokens: 512,
        max_seqs: 64,
        prefill_gemm_min_tokens: 64,
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

/// An 8-head model on 2 KV heads at head_dim 128 (the v2 attention kernel with 16 dims per lane;
/// the tiny spec's 32 takes 8 per lane), Qwen-like (q / k norms and bias) or Llama-like.
fn hd128_spec(qwen_like: bool) -> ModelSpec {
    ModelSpec {
        hidden_size: 128,
        intermediate_size: 192,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
        ..tiny_spec(qwen_like, qwen_like)
    }
}

fn qwen_like_spec() -> ModelSpec {
    hd128_spec(true)
}

fn wide_spec() -> ModelSpec {
    hd128_spec(false)
}

/// Sequences of a decode batch: context lengths (before the first step) and block tables with
/// room for `STEPS` more tokens, drawn without replacement from the pool.
struct Seqs {
    ctx: Vec<usize>,
    tables: Vec<Vec<BlockId>>,
}

fn seqs(rng: &mut rand_chacha::ChaCha8Rng, free: &mut Vec<u32>, n: usize) -> Seqs {
    // spread over the 256 / 512 / 1024 context buckets, with one very short sequence (the
    // padding rows repeat the shortest one)
    let ctx: Vec<usize> = (0..n)
        .map(|i| {
            if i == n / 2 {
                rng.random_range(1..4)
            } else {
                rng.random_range(1..900)
            }
        })
        .collect();
    free.shuffle(rng);
    let tables = ctx
        .iter()
        .map(|&c| {
            let nb = (c + STEPS).div_ceil(BLOCK);
            free.drain(..nb).map(BlockId).collect()
        })
        .collect();
    Seqs { ctx, tables }
}

fn batch<'a>(s: &'a Seqs, toks: &'a [[u32; 1]], step: usize) -> ForwardBatch<'a> {
    ForwardBatch {
        seqs: (0..s.ctx.len())
            .map(|i| SeqStep {
                tokens: &toks[i],
                start_pos: s.ctx[i] + step,
                block_table: &s.tables[i],
                want_logits: true,
            })
            .collect(),
    }
}

fn read_all(be: &dyn Backend, layers: u32, blocks: &[BlockId]) -> Vec<u8> {
    let mut out = vec![0u8; layers as usize * blocks.len() * be.kv_layout().block_layer_bytes()];
    be.read_kv(0..layers, blocks, &mut out).unwrap();
    out
}

fn bf16_vals(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

/// One backend, each step run eagerly then from a graph (the graph rewrites the same KV slots
/// with the same values, so the second run sees the state the first one saw).
fn graph_matches_eager(spec: &ModelSpec, name: &str) {
    let mut rng = rng(name);
    let w = tiny_weights(spec, &mut rng);
    let mut be = CudaBackend::new(spec, &w, &opts(1, true), "test".into()).unwrap();
    be.fill_kv_random(rng.random()).unwrap();
    let layers = spec.num_layers as u32;
    let all: Vec<BlockId> = (0..NUM_BLOCKS).map(BlockId).collect();
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    let sizes = [1usize, 3, 8, 33];
    let groups: Vec<Seqs> = sizes
        .iter()
        .map(|&n| seqs(&mut rng, &mut free, n))
        .collect();
    let before = read_all(&be, layers, &all);
    let mut replays = 0;
    for (g, s) in groups.iter().enumerate() {
        let n = sizes[g];
        let used: Vec<BlockId> = s.tables.iter().flatten().copied().collect();
        let (mut worst_logits, mut worst_kv) = (0f32, 0f32);
        for step in 0..STEPS {
            let toks: Vec<[u32; 1]> = (0..n)
                .map(|_| [rng.random_range(0..spec.vocab_size as u32)])
                .collect();
            let b = batch(s, &toks, step);
            be.set_cuda_graphs(false);
            let eager = be.forward(&b).unwrap();
            let kv_eager = bf16_vals(&read_all(&be, layers, &used));
            be.set_cuda_graphs(true);
            let graph = be.forward(&b).unwrap();
            let kv_graph = bf16_vals(&read_all(&be, layers, &used));
            replays += 1;
            let stats = be.graph_stats();
            assert_eq!(stats.capture_failures, 0, "{stats:?}");
            assert_eq!(
                stats.replays, replays,
                "the step ran from a graph: {stats:?}"
            );
            assert_eq!(graph.rows(), n);
            for r in 0..n {
                let e = rel_err(graph.row(r), eager.row(r));
                worst_logits = worst_logits.max(e);
                assert!(
                    e < 1e-2,
                    "{name} batch {n} step {step} row {r}: logits rel err {e} graph vs eager"
                );
            }
            let e = rel_err(&kv_graph, &kv_eager);
            worst_kv = worst_kv.max(e);
            assert!(e < 1e-2, "{name} batch {n} step {step}: KV rel err {e}");
        }
        let ctx_min = s.ctx.iter().min().unwrap();
        let ctx_max = s.ctx.iter().max().unwrap();
        println!(
            "GRAPH {name} batch {n} (bucket {}) ctx {ctx_min}..{ctx_max}: {STEPS} steps, worst logits rel err {worst_logits:.2e}, KV rel err {worst_kv:.2e}",
            pdnode_cuda::backend::decode_bucket(n, 64).unwrap_or(0)
        );
    }
    // blocks no sequence owns: byte-identical to before the steps
    let after = read_all(&be, layers, &all);
    let owned: std::collections::HashSet<u32> = groups
        .iter()
        .flat_map(|s| s.tables.iter().flatten().map(|b| b.0))
        .collect();
    let lb = be.kv_layout().block_layer_bytes();
    let mut checked = 0;
    for l in 0..layers as usize {
        for b in 0..NUM_BLOCKS as usize {
            if owned.contains(&(b as u32)) {
                continue;
            }
            let o = (l * NUM_BLOCKS as usize + b) * lb;
            assert!(
                after[o..o + lb] == before[o..o + lb],
                "{name}: block {b} of layer {l} (no sequence's) changed"
            );
            checked += 1;
        }
    }
    let stats = be.graph_stats();
    println!("GRAPH {name}: PASS, {checked} foreign layer-blocks untouched, stats {stats:?}");
    assert!(
        stats.captures >= 4,
        "one graph per bucket at least: {stats:?}"
    );
    assert!(
        stats.captures < stats.replays,
        "graphs are replayed with fresh metadata, not captured per step: {stats:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn graph_replay_matches_eager_tiny_llama() {
    graph_matches_eager(&tiny_spec(false, false), "tiny-llama");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn graph_replay_matches_eager_qwen_like_head_dim_128() {
    graph_matches_eager(&qwen_like_spec(), "qwen-like-hd128");
    graph_matches_eager(&wide_spec(), "llama-hd128");
}

/// Sliding windows (50 positions on layers 0 and 2, contexts up to 900: most sequences past
/// the window) replay from graphs as they run eagerly: on v4 (head_dim 128) and v2 (32). The
/// window is a per-layer constant of the captured launches, so one graph per bucket serves every
/// step.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn graph_replay_matches_eager_sliding_window() {
    let window = Some(pdnode_engine::spec::SlidingWindow {
        size: 50,
        layers: vec![true, false, true],
    });
    let wide = ModelSpec {
        sliding_window: window.clone(),
        ..wide_spec()
    };
    graph_matches_eager(&wide, "window-hd128");
    let tiny = ModelSpec {
        sliding_window: window,
        ..tiny_spec(false, false)
    };
    graph_matches_eager(&tiny, "window-hd32");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn graphs_off_runs_eager_and_counts_nothing() {
    let mut rng = rng("graphs_off");
    let spec = tiny_spec(false, false);
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(1, false), "test".into()).unwrap();
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    let s = seqs(&mut rng, &mut free, 5);
    let toks = vec![[1u32]; 5];
    let l = be.forward(&batch(&s, &toks, 0)).unwrap();
    assert_eq!(l.rows(), 5);
    assert_eq!(be.graph_stats().replays + be.graph_stats().captures, 0);
    // a prefill step never takes a graph, even with graphs on
    be.set_cuda_graphs(true);
    let prompt = [3u32, 4, 5];
    let t = [BlockId(free[0])];
    let b = ForwardBatch {
        seqs: vec![SeqStep {
            tokens: &prompt,
            start_pos: 0,
            block_table: &t,
            want_logits: true,
        }],
    };
    assert_eq!(be.forward(&b).unwrap().rows(), 1);
    assert_eq!(be.graph_stats().replays, 0);
    println!("GRAPH off/prefill: PASS");
}

/// TP=2: each rank captures and replays its own graph, NCCL all-reduces included; against the
/// same weights and KV run eagerly on a second TP=2 group.
#[test]
#[ignore = "needs two CUDA GPUs: run scripts/gpu/run-all.sh tp on the x2 host"]
fn tp2_graph_replay_matches_eager() {
    let gpus = pdnode_cuda::probe().map(|p| p.device_count).unwrap_or(0);
    if gpus < 2 {
        println!("GRAPH tp2: SKIP ({gpus} GPU)");
        return;
    }
    let mut rng = rng("tp2_graphs");
    let spec = tiny_spec(false, false);
    let w = tiny_weights(&spec, &mut rng);
    let mut eager = CudaTpBackend::new(&spec, &w, &opts(2, false), "test".into()).unwrap();
    let mut graph = CudaTpBackend::new(&spec, &w, &opts(2, true), "test".into()).unwrap();
    let seed: u64 = rng.random();
    eager.fill_kv_random(seed).unwrap();
    graph.fill_kv_random(seed).unwrap();
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    for n in [1usize, 3, 33] {
        let s = seqs(&mut rng, &mut free, n);
        let mut worst = 0f32;
        for step in 0..STEPS {
            let toks: Vec<[u32; 1]> = (0..n)
                .map(|_| [rng.random_range(0..spec.vocab_size as u32)])
                .collect();
            let b = batch(&s, &toks, step);
            let le = eager.forward(&b).unwrap();
            let lg = graph.forward(&b).unwrap();
            for r in 0..n {
                let e = rel_err(lg.row(r), le.row(r));
                worst = worst.max(e);
                assert!(e < 1e-2, "tp2 batch {n} step {step} row {r}: rel err {e}");
            }
        }
        println!("GRAPH tp2 batch {n}: {STEPS} steps, worst logits rel err {worst:.2e}");
    }
    let stats = graph.graph_stats().unwrap();
    println!("GRAPH tp2 per-rank stats {stats:?}");
    assert!(
        stats
            .iter()
            .all(|s| s.capture_failures == 0 && s.replays == 3 * STEPS as u64),
        "every rank replayed every step from its graph: {stats:?}"
    );
    assert!(eager.graph_stats().unwrap().iter().all(|s| s.replays == 0));
    println!("GRAPH tp2: PASS");
}

// ---- greedy rows reduced to their arg-max on the device (Backend::forward_select) -------------

/// The `argmax_rows` kernel against `sampling::argmax` on crafted rows of a 128k vocabulary:
/// bf16-rounded values (many ties at the top), the maximum first or last, NaN and -inf
/// sprinkled, rows of only NaN / -inf, +inf twice, all equal, -0 against +0. Exact ids.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn device_argmax_matches_host_argmax_on_crafted_rows() {
    let mut rng = rng("device_argmax");
    let spec = ModelSpec {
        vocab_size: 128_256,
        ..tiny_spec(false, false)
    };
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(1, false), "test".into()).unwrap();
    let v = spec.vocab_size;
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for k in 0..40 {
        // coarse values: bf16 of [-8, 8) has few distinct values near the top
        let mut r: Vec<f32> = (0..v)
            .map(|_| half::bf16::from_f32(rng.random_range(-8.0..8.0)).to_f32())
            .collect();
        match k % 8 {
            1 => r[v - 1] = 100.0,
            2 => r[0] = 100.0,
            3 => r.iter_mut().step_by(7).for_each(|x| *x = nan),
            4 => r.iter_mut().step_by(5).for_each(|x| *x = -inf),
            5 => {
                r[1000] = inf;
                r[77] = inf;
            }
            6 => {
                let m = rng.random_range(0..v);
                r[m] = 9.0;
                r[v - 2] = 9.0;
            }
            _ => {}
        }
        rows.push(r);
    }
    rows.push(
        (0..v)
            .map(|i| if i % 2 == 0 { nan } else { -inf })
            .collect(),
    );
    rows.push(vec![nan; v]);
    rows.push(vec![1.25; v]);
    let mut r = vec![-1.0; v];
    r[500] = -0.0;
    r[300] = 0.0;
    rows.push(r);
    let mut r = vec![-inf; v];
    r[v - 1] = -3.0e38;
    rows.push(r);
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    let got = be.device_argmax(&flat).unwrap();
    assert_eq!(got.len(), rows.len());
    let mut ties = 0;
    for (i, r) in rows.iter().enumerate() {
        let want = pdnode_engine::sampling::argmax(r).ok();
        if let Some(t) = want {
            ties += usize::from(r.iter().filter(|&&x| x == r[t as usize]).count() > 1);
        }
        assert_eq!(
            got[i], want,
            "ARGMAX row {i}: device {:?} host {want:?}",
            got[i]
        );
    }
    println!(
        "ARGMAX kernel: PASS, {} rows of {v}, {ties} with ties at the top, all ids exact",
        rows.len()
    );
}

/// `forward_select` of a decode batch (every other kind of row) against `forward` of the same
/// step on the same backend (the step rewrites the same KV slots with the same values): arg-max
/// rows equal the host arg-max of the full rows (a flip only at a top-2 gap under 1e-3), full
/// rows equal. Then a prefill step (no graph) with a row that wants no logits.
fn select_matches_forward(be: &mut dyn Backend, spec: &ModelSpec, name: &str) {
    use pdnode_engine::backend::{LogitsWant, RowOut, StepLogits};
    let mut rng = rng(name);
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    let mut out = StepLogits::default();
    let (mut exact, mut flips, mut worst) = (0usize, 0usize, 0f32);
    for n in [1usize, 3, 33] {
        let s = seqs(&mut rng, &mut free, n);
        for step in 0..STEPS {
            let toks: Vec<[u32; 1]> = (0..n)
                .map(|_| [rng.random_range(0..spec.vocab_size as u32)])
                .collect();
            let b = batch(&s, &toks, step);
            let full = be.forward(&b).unwrap();
            let want: Vec<LogitsWant> = (0..n)
                .map(|i| {
                    if (i + step) % 3 == 1 {
                        LogitsWant::Full
                    } else {
                        LogitsWant::Argmax
                    }
                })
                .collect();
            be.forward_select(&b, &want, &mut out).unwrap();
            assert_eq!(out.rows().len(), n);
            assert_eq!(out.vocab(), spec.vocab_size);
            for (i, r) in out.rows().iter().enumerate() {
                let host = full.row(i);
                match (*r, want[i]) {
                    (RowOut::Full(k), LogitsWant::Full) => {
                        let e = rel_err(out.full_row(k).unwrap(), host);
                        worst = worst.max(e);
                        assert!(
                            e < 1e-3,
                            "{name} batch {n} step {step} row {i}: full rel err {e}"
                        );
                    }
                    (RowOut::Argmax(t), LogitsWant::Argmax) => {
                        let h = pdnode_engine::sampling::argmax(host).unwrap();
                        let t = t.expect("a finite row has an arg-max");
                        if t == h {
                            exact += 1;
                        } else {
                            let (a, b) = (host[t as usize], host[h as usize]);
                            assert!(
                                (b - a).abs() <= 1e-3 * b.abs().max(1.0),
                                "{name} batch {n} step {step} row {i}: device {t} ({a}) host {h} ({b})"
                            );
                            flips += 1;
                        }
                    }
                    other => panic!("{name} row {i}: {other:?}"),
                }
            }
        }
    }
    // a prefill step: two prompts, the first a non-final chunk (no row)
    let p1: Vec<u32> = (0..20).map(|i| (i * 13 % spec.vocab_size) as u32).collect();
    let p2: Vec<u32> = (0..9).map(|i| (i * 7 % spec.vocab_size) as u32).collect();
    let t1: Vec<BlockId> = free.drain(..2).map(BlockId).collect();
    let t2: Vec<BlockId> = free.drain(..1).map(BlockId).collect();
    let b = ForwardBatch {
        seqs: vec![
            SeqStep {
                tokens: &p1,
                start_pos: 0,
                block_table: &t1,
                want_logits: false,
            },
            SeqStep {
                tokens: &p2,
                start_pos: 0,
                block_table: &t2,
                want_logits: true,
            },
        ],
    };
    let full = be.forward(&b).unwrap();
    be.forward_select(&b, &[LogitsWant::Argmax], &mut out)
        .unwrap();
    let h = pdnode_engine::sampling::argmax(full.row(0)).unwrap();
    assert_eq!(out.rows().len(), 1);
    match out.rows()[0] {
        RowOut::Argmax(Some(t)) if t == h => exact += 1,
        RowOut::Argmax(Some(t)) => {
            let (a, b) = (full.row(0)[t as usize], full.row(0)[h as usize]);
            assert!(
                (b - a).abs() <= 1e-3 * b.abs().max(1.0),
                "{name} prefill: {t} vs {h}"
            );
            flips += 1;
        }
        other => panic!("{name} prefill: {other:?}"),
    }
    // a wish list of the wrong length is refused
    assert!(be.forward_select(&b, &[], &mut out).is_err());
    println!(
        "ARGMAX {name}: PASS, {exact} arg-max rows exact, {flips} near-tie flips, full rows worst rel err {worst:.2e}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn argmax_rows_match_host_argmax_graphs_on_and_off() {
    let spec = tiny_spec(false, false);
    for graphs in [false, true] {
        let mut rng = rng("argmax_rows");
        let w = tiny_weights(&spec, &mut rng);
        let mut be = CudaBackend::new(&spec, &w, &opts(1, graphs), "test".into()).unwrap();
        be.fill_kv_random(rng.random()).unwrap();
        select_matches_forward(&mut be, &spec, &format!("tp1 graphs={graphs}"));
        let st = be.graph_stats();
        if graphs {
            assert!(st.replays >= 2 * 3 * STEPS as u64, "steps replayed: {st:?}");
        } else {
            assert_eq!(st.replays, 0, "{st:?}");
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs: run scripts/gpu/run-all.sh tp on the x2 host"]
fn tp2_argmax_rows_match_host_argmax() {
    let gpus = pdnode_cuda::probe().map(|p| p.device_count).unwrap_or(0);
    if gpus < 2 {
        println!("ARGMAX tp2: SKIP ({gpus} GPU)");
        return;
    }
    let spec = tiny_spec(false, false);
    for graphs in [false, true] {
        let mut rng = rng("tp2_argmax");
        let w = tiny_weights(&spec, &mut rng);
        let mut be = CudaTpBackend::new(&spec, &w, &opts(2, graphs), "test".into()).unwrap();
        be.fill_kv_random(rng.random()).unwrap();
        select_matches_forward(&mut be, &spec, &format!("tp2 graphs={graphs}"));
        let st = be.graph_stats().unwrap();
        assert!(
            st.iter()
                .all(|s| s.capture_failures == 0 && (s.replays > 0) == graphs),
            "{st:?}"
        );
    }
}
