//! Sampled rows on the device (`kernels/sample.cu` `sample_rows`, `LogitsWant::Sample`) against
//! the canonical reference `sampling::device`: the kernel alone on crafted rows of a 128k and of
//! small vocabularies, a grid of uniforms on one row (token shares vs weights), whole decode steps
//! through `forward_select` eagerly and replayed from CUDA graphs (TP=1 and TP=2), and a
//! micro-benchmark of a batch-64 Llama-3.1-8B decode step: full rows to the host + host sampling
//! vs device sampling. Tokens must equal the reference's except where the reference's decision
//! lies within 1e-5 (relative) of a boundary, which is counted and printed.

use super::*;
use pdnode_engine::backend::{LogitsWant, RowOut, StepLogits};
use pdnode_engine::sampling::device::{RowDraw, sample_row_detail};
use pdnode_engine::sampling::{SequenceSampler, argmax};

/// A decision closer than this (relative) to its threshold may go either way under rounding.
const NEAR: f64 = 1e-5;

/// Exact, near-boundary and wrong tokens.
#[derive(Default, Debug)]
struct Tally {
    exact: usize,
    near: usize,
    wrong: Vec<String>,
}

impl Tally {
    fn check(&mut self, row: &[f32], d: &RowDraw, got: Option<u32>, what: &str) {
        let want = sample_row_detail(row, d);
        match want {
            _ if want.map(|p| p.token) == got => self.exact += 1,
            Some(p) if p.margin < NEAR => self.near += 1,
            _ => self
                .wrong
                .push(format!("{what}: device {got:?}, reference {want:?}, {d:?}")),
        }
    }
}

fn draws(rng: &mut rand_chacha::ChaCha8Rng, vocab: usize) -> RowDraw {
    let ts = [1.0, 1.0, 0.7, 1.3, 0.25, 2.0];
    let ks = [0, 0, 0, 1, 2, 5, 50, 1000, vocab as u32 - 1];
    let ps = [1.0, 1.0, 0.95, 0.9, 0.5, 1e-4, 0.999];
    let ms = [0.0, 0.0, 0.0, 0.05, 0.3];
    let mut d = RowDraw {
        temperature: ts[rng.random_range(0..ts.len())],
        top_k: ks[rng.random_range(0..ks.len())],
        top_p: ps[rng.random_range(0..ps.len())],
        min_p: ms[rng.random_range(0..ms.len())],
        u: rng.random(),
    };
    if d.top_k as usize >= vocab {
        d.top_k = 0;
    }
    match rng.random_range(0..12) {
        0 => d.u = 0.0,
        1 => d.u = 1.0 - f64::EPSILON,
        _ => {}
    }
    d
}

/// Row `r` of a crafted set: normal logits, exact ties (halves, bf16, four levels), specials
/// (-inf, NaN, +inf), wide scales, nothing finite, one finite value.
fn crafted_row(rng: &mut rand_chacha::ChaCha8Rng, vocab: usize, r: usize) -> Vec<f32> {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let scale = if r % 6 == 5 { 8.0 } else { 2.5 };
    let mut row: Vec<f32> = (0..vocab)
        .map(|_| {
            let v: f32 = (rng.random::<f32>() + rng.random::<f32>() + rng.random::<f32>() - 1.5)
                * 2.0
                * scale;
            match r % 6 {
                1 => (v * 2.0).round() / 2.0,
                2 => rng.random_range(0..4) as f32,
                3 if rng.random_range(0..50) == 0 => [-inf, nan, inf, -nan][rng.random_range(0..4)],
                4 => half::bf16::from_f32(v).to_f32(),
                _ => v,
            }
        })
        .collect();
    if r % 23 == 22 {
        row = (0..vocab)
            .map(|i| if i % 3 == 0 { nan } else { -inf })
            .collect();
    }
    if r % 29 == 28 {
        row = vec![-inf; vocab];
        row[vocab / 2] = 1.5;
    }
    row
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn sample_rows_match_the_reference_on_crafted_rows() {
    let mut failed = Vec::new();
    for (vocab, rows) in [
        (128_256usize, 256usize),
        (32_000, 128),
        (1000, 512),
        (5, 256),
    ] {
        let mut rng = rng(&format!("sample_rows {vocab}"));
        let spec = ModelSpec {
            vocab_size: vocab,
            ..tiny_spec(false, false)
        };
        let w = tiny_weights(&spec, &mut rng);
        let mut be = CudaBackend::new(&spec, &w, &opts(1, false), "test".into()).unwrap();
        assert!(be.samples_on_device(), "engine.cuda.gpu_sampling is on");
        let mut t = Tally::default();
        for chunk in 0..rows.div_ceil(64) {
            let n = 64.min(rows - chunk * 64);
            let rs: Vec<Vec<f32>> = (0..n)
                .map(|i| crafted_row(&mut rng, vocab, chunk * 64 + i))
                .collect();
            let ds: Vec<RowDraw> = (0..n).map(|_| draws(&mut rng, vocab)).collect();
            let flat: Vec<f32> = rs.iter().flatten().copied().collect();
            let got = be.device_sample(&flat, &ds).unwrap();
            assert_eq!(got.len(), n);
            for i in 0..n {
                t.check(
                    &rs[i],
                    &ds[i],
                    got[i],
                    &format!("vocab {vocab} row {}", chunk * 64 + i),
                );
            }
        }
        let ok = t.wrong.is_empty();
        println!(
            "SAMPLE kernel vocab {vocab}: {} {rows} rows, {} exact, {} near-boundary (margin < {NEAR:e}), {} wrong (worst cases first: {:?})",
            if ok { "PASS" } else { "FAIL" },
            t.exact,
            t.near,
            t.wrong.len(),
            t.wrong.iter().take(3).collect::<Vec<_>>()
        );
        if !ok {
            failed.push(vocab);
        }
    }
    assert!(
        failed.is_empty(),
        "sample_rows wrong at vocabularies {failed:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn sample_rows_u_grid_gives_each_token_its_weight() {
    const G: usize = 4096;
    let mut rng = rng("sample_rows grid");
    let vocab = 1000;
    let spec = ModelSpec {
        vocab_size: vocab,
        ..tiny_spec(false, false)
    };
    let w = tiny_weights(&spec, &mut rng);
    let mut be = CudaBackend::new(&spec, &w, &opts(1, false), "test".into()).unwrap();
    let row: Vec<f32> = (0..vocab).map(|_| rng.random_range(-4.0..4.0)).collect();
    for base in [
        RowDraw {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            u: 0.0,
        },
        RowDraw {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            u: 0.0,
        },
    ] {
        let kept = pdnode_engine::sampling::device::kept_set(&row, &base).unwrap();
        let mut count = vec![0usize; vocab];
        for c in 0..G / 64 {
            let ds: Vec<RowDraw> = (0..64)
                .map(|i| RowDraw {
                    u: ((c * 64 + i) as f64 + 0.5) / G as f64,
                    ..base
                })
                .collect();
            let flat: Vec<f32> = (0..64).flat_map(|_| row.iter().copied()).collect();
            for t in be.device_sample(&flat, &ds).unwrap() {
                count[t.expect("a finite row") as usize] += 1;
            }
        }
        let mut worst = 0f64;
        for (id, &wt) in kept.ids.iter().zip(&kept.weights) {
            let share = count[*id as usize] as f64 / G as f64;
            worst = worst.max((share - f64::from(wt) / kept.mass).abs());
        }
        let outside: usize = (0..vocab)
            .filter(|i| !kept.ids.contains(&(*i as u32)))
            .map(|i| count[i])
            .sum();
        // one grid step per token, one more where rounding moves a grid point across a boundary
        let ok = worst <= 2.0 / G as f64 && outside == 0;
        println!(
            "SAMPLE u grid {base:?}: {} {} kept tokens, worst share error {worst:.2e} (grid step {:.2e}), {outside} draws outside the kept set",
            if ok { "PASS" } else { "FAIL" },
            kept.ids.len(),
            1.0 / G as f64
        );
        assert!(ok);
    }
}

/// Decode steps through `forward_select`: all rows `Full` first (the logits the step makes),
/// then the same step with every third row sampled on the device (the rest arg-max and full):
/// the step is deterministic (graph replays included), so the sampled tokens must be the
/// reference's on the first step's rows, the arg-max rows exact, the full rows bit-equal.
fn sampled_select_matches_reference(be: &mut dyn Backend, spec: &ModelSpec, name: &str) {
    let mut rng = rng(name);
    let mut free: Vec<u32> = (0..NUM_BLOCKS).collect();
    let (mut full_out, mut out) = (StepLogits::default(), StepLogits::default());
    let mut t = Tally::default();
    for n in [1usize, 3, 33, 64] {
        let s = seqs(&mut rng, &mut free, n);
        for step in 0..STEPS {
            let toks: Vec<[u32; 1]> = (0..n)
                .map(|_| [rng.random_range(0..spec.vocab_size as u32)])
                .collect();
            let b = batch(&s, &toks, step);
            be.forward_select(&b, &vec![LogitsWant::Full; n], &mut full_out)
                .unwrap();
            let rows: Vec<Vec<f32>> = (0..n)
                .map(|i| full_out.full_row(i).unwrap().to_vec())
                .collect();
            let want: Vec<LogitsWant> = (0..n)
                .map(|i| match (i + step) % 3 {
                    0 => LogitsWant::Full,
                    1 => LogitsWant::Argmax,
                    _ => LogitsWant::Sample(draws(&mut rng, spec.vocab_size)),
                })
                .collect();
            be.forward_select(&b, &want, &mut out).unwrap();
            for (i, r) in out.rows().iter().enumerate() {
                assert!(r.answers(&want[i]), "{name} row {i}: {r:?}");
                match (*r, want[i]) {
                    (RowOut::Full(k), _) => {
                        let (a, b) = (out.full_row(k).unwrap(), &rows[i]);
                        assert!(
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{name} batch {n} step {step} row {i}: the step is not deterministic"
                        );
                    }
                    (RowOut::Argmax(tok), _) => {
                        assert_eq!(tok, argmax(&rows[i]).ok(), "{name} row {i}")
                    }
                    (RowOut::Sampled(tok), LogitsWant::Sample(d)) => t.check(
                        &rows[i],
                        &d,
                        tok,
                        &format!("{name} batch {n} step {step} row {i}"),
                    ),
                    other => panic!("{name} row {i}: {other:?}"),
                }
            }
        }
    }
    let ok = t.wrong.is_empty();
    println!(
        "SAMPLE {name}: {} {} sampled rows exact, {} near-boundary, {} wrong {:?}",
        if ok { "PASS" } else { "FAIL" },
        t.exact,
        t.near,
        t.wrong.len(),
        t.wrong.iter().take(3).collect::<Vec<_>>()
    );
    assert!(ok);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn sampled_rows_in_decode_steps_graphs_on_and_off() {
    let spec = ModelSpec {
        vocab_size: 32_000,
        ..tiny_spec(false, false)
    };
    for graphs in [false, true] {
        let mut rng = rng("sampled_rows");
        let w = tiny_weights(&spec, &mut rng);
        let mut be = CudaBackend::new(&spec, &w, &opts(1, graphs), "test".into()).unwrap();
        be.fill_kv_random(rng.random()).unwrap();
        sampled_select_matches_reference(&mut be, &spec, &format!("tp1 graphs={graphs}"));
        let st = be.graph_stats();
        assert_eq!(st.replays > 0, graphs, "{st:?}");
    }
}

#[test]
#[ignore = "needs two CUDA GPUs: run scripts/gpu/run-all.sh tp on the x2 host"]
fn tp2_sampled_rows_in_decode_steps() {
    let gpus = pdnode_cuda::probe().map(|p| p.device_count).unwrap_or(0);
    if gpus < 2 {
        println!("SAMPLE tp2: SKIP ({gpus} GPU)");
        return;
    }
    let spec = ModelSpec {
        vocab_size: 32_000,
        ..tiny_spec(false, false)
    };
    for graphs in [false, true] {
        let mut rng = rng("tp2_sampled_rows");
        let w = tiny_weights(&spec, &mut rng);
        let mut be = CudaTpBackend::new(&spec, &w, &opts(2, graphs), "test".into()).unwrap();
        be.fill_kv_random(rng.random()).unwrap();
        sampled_select_matches_reference(&mut be, &spec, &format!("tp2 graphs={graphs}"));
    }
}

/// Batch-64 decode step of Llama-3.1-8B shapes (dummy weights, context 512, CUDA graphs on) as
/// the engine runs it: every row full to the host and sampled there, against the rows sampled on
/// the device (one id per row), for three parameter sets; greedy (arg-max) and the bare step
/// (no logits copied) for scale.
#[test]
#[ignore = "needs a CUDA GPU (about 20 GB free): run scripts/gpu/run-all.sh on the GPU host"]
fn bench_decode_64_sampled_rows() {
    use pdnode_core::SamplingParams;
    use std::time::Instant;
    const BATCH: usize = 64;
    const CTX: usize = 512;
    const ITERS: usize = 10;
    let spec = pdnode_engine::loader::dummy::llama31_8b();
    let bs = 16usize;
    let nbps = CTX.div_ceil(bs);
    let o = CudaOptions {
        num_kv_blocks: (BATCH * nbps + 8) as u32,
        block_size: bs as u32,
        max_seqs: BATCH,
        max_batch_tokens: 256,
        mem_fraction: 0.95,
        cuda_graphs: true,
        gpu_sampling: true,
        pdl: false,
        fusion: pdnode_cuda::ops::Fusion::default(),
        ..opts(1, true)
    };
    let mut be = CudaBackend::new_dummy(&spec, 1234, &o, "bench".into()).unwrap();
    be.fill_kv_random(99).unwrap();
    let tables: Vec<Vec<BlockId>> = (0..BATCH)
        .map(|i| (0..nbps).map(|j| BlockId((i * nbps + j) as u32)).collect())
        .collect();
    let toks: Vec<[u32; 1]> = (0..BATCH).map(|i| [(i * 7919 % 128_000) as u32]).collect();
    let fb = ForwardBatch {
        seqs: (0..BATCH)
            .map(|i| SeqStep {
                tokens: &toks[i],
                start_pos: CTX - 1,
                block_table: &tables[i],
                want_logits: true,
            })
            .collect(),
    };
    let mut out = StepLogits::default();
    let time = |be: &mut CudaBackend, f: &mut dyn FnMut(&mut CudaBackend)| {
        f(be); // warm-up (graph capture, buffers)
        let t0 = Instant::now();
        for _ in 0..ITERS {
            f(be);
        }
        t0.elapsed().as_secs_f64() / ITERS as f64 * 1e3
    };
    let bare = time(&mut be, &mut |be| {
        be.forward_device(&fb).unwrap();
        be.synchronize().unwrap();
    });
    let greedy = time(&mut be, &mut |be| {
        be.forward_select(&fb, &[LogitsWant::Argmax; BATCH], &mut out)
            .unwrap();
    });
    println!(
        "SAMPLE bench batch {BATCH} ctx {CTX}: step without logits {bare:.2} ms, greedy (device arg-max) {greedy:.2} ms"
    );
    let vocab = spec.vocab_size;
    for (what, p) in [
        ("T=1", SamplingParams::default()),
        (
            "T=0.7 top_p=0.9",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                ..SamplingParams::default()
            },
        ),
        (
            "T=0.8 top_k=50 top_p=0.95 min_p=0.05",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.95,
                min_p: 0.05,
                ..SamplingParams::default()
            },
        ),
    ] {
        let mut samplers: Vec<SequenceSampler> = (0..BATCH)
            .map(|i| SequenceSampler::with_seed(&p, vocab, &[], i as u64).unwrap())
            .collect();
        let host = time(&mut be, &mut |be| {
            be.forward_select(&fb, &[LogitsWant::Full; BATCH], &mut out)
                .unwrap();
            for (i, s) in samplers.iter_mut().enumerate() {
                s.sample(out.full_row(i).unwrap()).unwrap();
            }
        });
        let device = time(&mut be, &mut |be| {
            let want: Vec<LogitsWant> = samplers
                .iter_mut()
                .map(|s| LogitsWant::Sample(s.device_draw().unwrap()))
                .collect();
            be.forward_select(&fb, &want, &mut out).unwrap();
            for (i, s) in samplers.iter_mut().enumerate() {
                let RowOut::Sampled(t) = out.rows()[i] else {
                    panic!("row {i}: {:?}", out.rows()[i]);
                };
                s.accept_sampled(t).unwrap();
            }
        });
        println!(
            "SAMPLE bench batch {BATCH} ctx {CTX} {what}: full rows to host + host sampling {host:.2} ms, device sampling {device:.2} ms (sampling kernel ~{:.2} ms over the greedy step)",
            device - greedy
        );
    }
}
