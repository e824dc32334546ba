//! SequenceSampler: greedy, temperature, top-k, top-p, min-p, seeds, penalties, logprobs.

use pdnode_core::SamplingParams;
use pdnode_engine::sampling::{SamplingError, SequenceSampler, argmax};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_logits(seed: u64, n: usize) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.random_range(-8.0f32..8.0)).collect()
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        max_tokens: 100,
        ..Default::default()
    };
    f(&mut p);
    p
}

fn softmax(l: &[f32], t: f32) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = l
        .iter()
        .map(|&x| (f64::from(x - m) / f64::from(t)).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// Draws `n` tokens from the same logits (no penalties) and returns frequencies.
fn frequencies(p: &SamplingParams, logits: &[f32], n: usize, seed: u64) -> Vec<f64> {
    let mut s = SequenceSampler::with_seed(p, logits.len(), &[], seed).unwrap();
    let mut c = vec![0usize; logits.len()];
    for _ in 0..n {
        c[s.sample(logits).unwrap().token as usize] += 1;
    }
    c.into_iter().map(|x| x as f64 / n as f64).collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "token {i}: got {g:.4}, want {w:.4} (all {got:?} vs {want:?})"
        );
    }
}

#[test]
fn greedy_is_argmax_and_ignores_the_seed() {
    for seed in 0..20 {
        let l = random_logits(seed, 1000);
        let want = l
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        let mut s =
            SequenceSampler::with_seed(&SamplingParams::greedy(8), 1000, &[], seed).unwrap();
        assert_eq!(s.sample(&l).unwrap().token, want);
        assert_eq!(argmax(&l).unwrap(), want);
    }
    // Ties go to the lowest id; NaN and -inf are never picked.
    assert_eq!(argmax(&[1.0, 3.0, 3.0]).unwrap(), 1);
    assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, -5.0]).unwrap(), 2);
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    for seed in 0..20 {
        let l = random_logits(100 + seed, 49_152);
        let greedy = argmax(&l).unwrap();
        let k1 = params(|p| {
            p.temperature = 1.5;
            p.top_k = 1;
        });
        let tiny_p = params(|p| {
            p.temperature = 1.5;
            p.top_p = 1e-6;
        });
        for p in [k1, tiny_p] {
            let mut s = SequenceSampler::with_seed(&p, l.len(), &[], seed).unwrap();
            for _ in 0..5 {
                assert_eq!(s.sample(&l).unwrap().token, greedy, "{p:?}");
            }
        }
    }
}

#[test]
fn same_seed_same_tokens_and_different_seeds_differ() {
    let l = vec![0.0f32; 64]; // flat: every draw is pure randomness
    let p = params(|p| p.seed = Some(7));
    let run = |p: &SamplingParams| {
        let mut s = SequenceSampler::new(p, 64, &[1, 2, 3]).unwrap();
        (0..50)
            .map(|_| s.sample(&l).unwrap().token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(&p), run(&p));
    assert_ne!(run(&p), run(&params(|p| p.seed = Some(8))));
    // A request without a seed draws a random one.
    let a = SequenceSampler::new(&params(|_| {}), 64, &[]).unwrap();
    let b = SequenceSampler::new(&params(|_| {}), 64, &[]).unwrap();
    assert_ne!(a.seed(), b.seed());
    // The seed given is the seed used.
    assert_eq!(SequenceSampler::new(&p, 64, &[]).unwrap().seed(), 7);
}

#[test]
fn restoring_the_state_continues_the_same_stream() {
    let p = params(|p| {
        p.seed = Some(42);
        p.frequency_penalty = 0.5;
    });
    let logits: Vec<Vec<f32>> = (0..20).map(|i| random_logits(i, 300)).collect();
    let mut a = SequenceSampler::new(&p, 300, &[5, 6]).unwrap();
    let mut out = Vec::new();
    for l in &logits[..10] {
        out.push(a.sample(l).unwrap().token);
    }
    let mut b = SequenceSampler::restore(&p, 300, &[5, 6], &out, a.state()).unwrap();
    for l in &logits[10..] {
        assert_eq!(a.sample(l).unwrap(), b.sample(l).unwrap());
    }
}

#[test]
fn temperature_sampling_follows_the_softmax() {
    let l = [2.0f32, 1.0, 0.0, -1.0];
    for t in [0.5f32, 1.0, 2.0] {
        let p = params(|p| p.temperature = t);
        assert_close(&frequencies(&p, &l, 40_000, 1), &softmax(&l, t), 0.01);
    }
}

#[test]
fn top_k_top_p_and_min_p_renormalize_what_they_keep() {
    let l = [2.0f32, 1.0, 0.0, -1.0];
    let sm = softmax(&l, 1.0); // ~[0.644, 0.237, 0.087, 0.032]
    // top_k = 2: the two most likely, renormalized.
    let p = params(|p| p.top_k = 2);
    let z = sm[0] + sm[1];
    assert_close(
        &frequencies(&p, &l, 40_000, 2),
        &[sm[0] / z, sm[1] / z, 0.0, 0.0],
        0.01,
    );
    // top_p = 0.85: 0.644 < 0.85 <= 0.881, so the first two.
    let p = params(|p| p.top_p = 0.85);
    assert_close(
        &frequencies(&p, &l, 40_000, 3),
        &[sm[0] / z, sm[1] / z, 0.0, 0.0],
        0.01,
    );
    // min_p = 0.1: keeps tokens with p >= 0.0644: the first three.
    let p = params(|p| p.min_p = 0.1);
    let z3 = sm[0] + sm[1] + sm[2];
    assert_close(
        &frequencies(&p, &l, 40_000, 4),
        &[sm[0] / z3, sm[1] / z3, sm[2] / z3, 0.0],
        0.01,
    );
}

#[test]
fn top_p_over_a_large_flat_vocabulary_grows_past_the_first_head() {
    // 2000 equally likely tokens: top_p = 0.5 must keep ~1000 of them, more than one head of 256.
    let l = vec![0.0f32; 2000];
    let p = params(|p| p.top_p = 0.5);
    let mut s = SequenceSampler::with_seed(&p, l.len(), &[], 9).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..5000 {
        let t = s.sample(&l).unwrap().token;
        assert!(t < 1000, "token {t} outside the top-p set");
        seen.insert(t);
    }
    assert!(seen.len() > 900, "only {} distinct tokens", seen.len());
}

#[test]
fn repetition_penalty_moves_greedy_away_from_seen_tokens() {
    let l = [3.0f32, 2.0, -1.0, -1.2];
    // Token 0 is in the prompt: 3.0 / 2 = 1.5 < 2.0.
    let p = params(|p| {
        p.temperature = 0.0;
        p.repetition_penalty = 2.0;
    });
    let mut s = SequenceSampler::with_seed(&p, 4, &[0], 0).unwrap();
    assert_eq!(s.sample(&l).unwrap().token, 1);
    // Then token 1 was generated: 2.0 / 2 = 1.0 < 1.5, back to 0.
    assert_eq!(s.sample(&l).unwrap().token, 0);
    // A negative logit is multiplied: -1.0 * 2 = -2.0 < -1.2.
    let l = [-1.0f32, -1.2];
    let mut s = SequenceSampler::with_seed(&p, 2, &[0], 0).unwrap();
    assert_eq!(s.sample(&l).unwrap().token, 1);
}

#[test]
fn presence_and_frequency_penalties_subtract_as_documented() {
    // Greedy over [1.0, 0.6, 0.0]: frequency 0.25 per occurrence on the output only.
    let l = [1.0f32, 0.6, 0.0];
    let p = params(|p| {
        p.temperature = 0.0;
        p.frequency_penalty = 0.25;
    });
    let mut s = SequenceSampler::with_seed(&p, 3, &[0, 0, 0], 0).unwrap();
    let toks: Vec<u32> = (0..4).map(|_| s.sample(&l).unwrap().token).collect();
    // 0 (1.0) ; 0 at 0.75 > 0.6 ; then 0.5 < 0.6 -> 1 ; then 0.5 vs 0.35 -> 0.
    assert_eq!(toks, vec![0, 0, 1, 0]);
    // Presence 0.5 applies once: after one 0, 0.5 < 0.6 -> 1; after one 1, 0.5 vs 0.1 -> 0 forever.
    let p = params(|p| {
        p.temperature = 0.0;
        p.presence_penalty = 0.5;
    });
    let mut s = SequenceSampler::with_seed(&p, 3, &[], 0).unwrap();
    let toks: Vec<u32> = (0..5).map(|_| s.sample(&l).unwrap().token).collect();
    assert_eq!(toks, vec![0, 1, 0, 0, 0]);
    // A negative presence penalty rewards repeats.
    let p = params(|p| {
        p.temperature = 0.0;
        p.presence_penalty = -1.5;
    });
    let mut s = SequenceSampler::with_seed(&p, 3, &[], 0).unwrap();
    s.accept(2).unwrap();
    assert_eq!(s.sample(&l).unwrap().token, 2);
}

#[test]
fn logprobs_are_raw_model_logprobs_with_top_alternatives() {
    let l = random_logits(5, 16);
    let p = params(|p| {
        p.temperature = 0.7;
        p.top_k = 3;
        p.repetition_penalty = 1.8;
        p.logprobs = Some(16);
    });
    let mut s = SequenceSampler::with_seed(&p, 16, &[0, 1, 2, 3], 3).unwrap();
    let out = s.sample(&l).unwrap();
    let lp = out.logprob.unwrap();
    assert_eq!(lp.token_id, out.token);
    assert_eq!(lp.top.len(), 16);
    let total: f64 = lp.top.iter().map(|(_, x)| f64::from(*x).exp()).sum();
    assert!((total - 1.0).abs() < 1e-4, "{total}");
    assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    // Raw: the log-softmax of the unpenalized, untempered logits.
    let raw = softmax(&l, 1.0);
    assert!((f64::from(lp.logprob) - raw[out.token as usize].ln()).abs() < 1e-4);
    // Without logprobs, none are computed.
    let mut s = SequenceSampler::with_seed(&params(|_| {}), 16, &[], 3).unwrap();
    assert!(s.sample(&l).unwrap().logprob.is_none());
    // logprobs = 0: the sampled token only.
    let mut s = SequenceSampler::with_seed(&params(|p| p.logprobs = Some(0)), 16, &[], 3).unwrap();
    assert!(s.sample(&l).unwrap().logprob.unwrap().top.is_empty());
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let p = params(|_| {});
    let mut s = SequenceSampler::with_seed(&p, 8, &[], 0).unwrap();
    assert!(matches!(
        s.sample(&[0.0; 7]),
        Err(SamplingError::LogitsSize {
            got: 7,
            vocab_size: 8
        })
    ));
    assert!(matches!(
        s.sample(&[f32::NAN; 8]),
        Err(SamplingError::NoFiniteLogits)
    ));
    assert!(matches!(
        SequenceSampler::with_seed(&p, 8, &[8], 0),
        Err(SamplingError::TokenOutOfRange {
            id: 8,
            vocab_size: 8
        })
    ));
    let bad = params(|p| p.temperature = -1.0);
    assert!(matches!(
        SequenceSampler::new(&bad, 8, &[]),
        Err(SamplingError::InvalidParam(e)) if e.param == "temperature"
    ));
    // NaN logits are skipped by sampling too.
    let mut l = vec![f32::NAN; 8];
    l[3] = 0.0;
    for p in [
        params(|_| {}),
        params(|p| p.top_k = 4),
        params(|p| p.top_p = 0.5),
    ] {
        let mut s = SequenceSampler::with_seed(&p, 8, &[], 0).unwrap();
        assert_eq!(s.sample(&l).unwrap().token, 3);
    }
}

#[test]
fn sampling_a_49k_vocabulary_is_cheap() {
    let v = 49_152;
    let rows: Vec<Vec<f32>> = (0..8).map(|i| random_logits(1000 + i, v)).collect();
    let cases = [
        ("greedy", params(|p| p.temperature = 0.0)),
        ("temperature", params(|p| p.temperature = 0.8)),
        ("top_k=50", params(|p| p.top_k = 50)),
        ("top_p=0.9", params(|p| p.top_p = 0.9)),
        (
            "top_k+top_p+min_p",
            params(|p| {
                p.top_k = 40;
                p.top_p = 0.95;
                p.min_p = 0.05;
            }),
        ),
        (
            "penalties+logprobs",
            params(|p| {
                p.repetition_penalty = 1.1;
                p.frequency_penalty = 0.3;
                p.logprobs = Some(5);
            }),
        ),
    ];
    for (name, p) in cases {
        let mut s = SequenceSampler::with_seed(&p, v, &[1, 2, 3], 0).unwrap();
        let steps = 64;
        let t0 = std::time::Instant::now();
        for i in 0..steps {
            s.sample(&rows[i % rows.len()]).unwrap();
        }
        let per = t0.elapsed() / steps as u32;
        println!("{name}: {per:?} per sample over {v} logits");
        // A decode step of even a 135M model takes tens of milliseconds here.
        assert!(per.as_millis() < 20, "{name}: {per:?} per sample");
    }
}
