//! The reference against the host sampler's own selection (`SequenceSampler::keep`), and its
//! pick against the kept weights over a fine grid of `u`.

use super::*;
use crate::sampling::SequenceSampler;
use pdnode_core::SamplingParams;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

fn draw(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> RowDraw {
    RowDraw {
        temperature,
        top_k,
        top_p,
        min_p,
        u: 0.5,
    }
}

/// The ids (ascending, weight > 0) and weights the host `draw` picks from.
fn host_kept(row: &[f32], d: &RowDraw) -> Option<(Vec<u32>, Vec<f32>)> {
    let p = SamplingParams {
        temperature: d.temperature,
        top_k: d.top_k,
        top_p: d.top_p,
        min_p: d.min_p,
        max_tokens: 1,
        ..Default::default()
    };
    let mut s = SequenceSampler::with_seed(&p, row.len(), &[], 1).unwrap();
    let max = super::super::finite_max(row)?;
    let (kept, _) = s.keep(row, max);
    let mut ids: Vec<u32> = match kept {
        None => (0..row.len() as u32).collect(),
        Some(n) => s.idx[..n].to_vec(),
    };
    ids.retain(|&i| s.weights[i as usize] > 0.0);
    ids.sort_unstable();
    let w = ids.iter().map(|&i| s.weights[i as usize]).collect();
    Some((ids, w))
}

/// Logits on a coarse grid (many exact ties, distinct logits never share a weight), with some
/// -inf, NaN and +inf.
fn grid_row(rng: &mut ChaCha20Rng, n: usize, specials: bool) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let r = rng.random_range(0..100);
            if specials && r < 4 {
                [f32::NEG_INFINITY, f32::NAN, f32::INFINITY, -f32::NAN][r]
            } else {
                rng.random_range(-16..=16) as f32 * 0.25
            }
        })
        .collect()
}

#[test]
fn kept_set_is_what_the_host_draw_keeps() {
    let mut rng = ChaCha20Rng::seed_from_u64(7);
    let mut checked = 0;
    for case in 0..3000 {
        let n = [1, 2, 3, 7, 40, 300][case % 6];
        let row = grid_row(&mut rng, n, case % 3 == 0);
        let d = draw(
            [0.3, 0.7, 1.0, 2.0][rng.random_range(0..4)],
            [0, 0, 1, 2, 5, 17, n as u32 - 1, n as u32 + 3][rng.random_range(0..8)],
            [1.0, 1.0, 0.95, 0.7, 0.5, 0.1, 1e-4][rng.random_range(0..7)],
            [0.0, 0.0, 0.02, 0.3, 1.0][rng.random_range(0..5)],
        );
        let got = kept_set(&row, &d);
        let want = host_kept(&row, &d);
        match (got, want) {
            (None, None) => {}
            (Some(g), Some((ids, w))) => {
                assert_eq!(g.ids, ids, "case {case}: {d:?} row {row:?}");
                let (gb, wb): (Vec<u32>, Vec<u32>) = (
                    g.weights.iter().map(|x| x.to_bits()).collect(),
                    w.iter().map(|x| x.to_bits()).collect(),
                );
                assert_eq!(gb, wb, "case {case}: weights");
                checked += 1;
            }
            (g, w) => panic!("case {case}: {g:?} vs host {w:?} ({d:?}, row {row:?})"),
        }
    }
    assert!(checked > 2500, "{checked}");
}

/// Every kept token's share of a fine grid of `u` is its normalized weight.
#[test]
fn a_grid_of_u_gives_each_kept_token_its_weight() {
    const N: usize = 200_000;
    let mut rng = ChaCha20Rng::seed_from_u64(11);
    for case in 0..12 {
        let n = [5, 64, 1000][case % 3];
        let row: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let d = draw(
            [0.8, 1.0, 1.5][case % 3],
            [0, 0, 10, 3][case % 4],
            [1.0, 0.9, 0.6][case % 3],
            [0.0, 0.05][case % 2],
        );
        let kept = kept_set(&row, &d).unwrap();
        let mut count = vec![0usize; n];
        for i in 0..N {
            let t = pick_kept(&kept, (i as f64 + 0.5) / N as f64).unwrap().token;
            count[t as usize] += 1;
        }
        let step = 1.0 / N as f64;
        for (id, &w) in kept.ids.iter().zip(&kept.weights) {
            let share = count[*id as usize] as f64 / N as f64;
            let p = f64::from(w) / kept.mass;
            assert!(
                (share - p).abs() <= step + 1e-6 * step,
                "case {case}: token {id} share {share} weight {p}"
            );
        }
        let outside: usize = (0..n)
            .filter(|i| !kept.ids.contains(&(*i as u32)))
            .map(|i| count[i])
            .sum();
        assert_eq!(
            outside, 0,
            "case {case}: a token outside the kept set was picked"
        );
    }
}

#[test]
fn special_rows() {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let d = draw(1.0, 0, 1.0, 0.0);
    // nothing finite
    assert_eq!(sample_row(&[nan, -inf, inf, nan], &d), None);
    assert!(kept_set(&[-inf; 3], &d).is_none());
    // a single finite value, whatever u; +inf is never picked
    for u in [0.0, 0.3, 0.999_999] {
        let d = RowDraw { u, ..d };
        assert_eq!(sample_row(&[nan, inf, -2.0, -inf], &d), Some(2));
    }
    // all equal: uniform over the grid of u, exactly
    let row = [0.5f32; 8];
    let kept = kept_set(&row, &d).unwrap();
    assert_eq!(kept.ids, (0..8).collect::<Vec<u32>>());
    for i in 0..8 {
        let u = (i as f64 + 0.5) / 8.0;
        assert_eq!(pick_kept(&kept, u).unwrap().token, i);
    }
    // top-k = 1 and a tiny top-p: the lowest id among the largest
    let row = [1.0, 3.0, -1.0, 3.0, 2.0];
    for d in [draw(1.0, 1, 1.0, 0.0), draw(0.5, 0, 1e-6, 0.0)] {
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample_row(&row, &RowDraw { u, ..d }), Some(1), "{d:?}");
        }
    }
    // top-k ties toward lower ids: k = 2 keeps ids 1 and 3 (both 3.0), then k = 3 adds id 4
    assert_eq!(kept_set(&row, &draw(1.0, 2, 1.0, 0.0)).unwrap().ids, [1, 3]);
    assert_eq!(
        kept_set(&row, &draw(1.0, 3, 1.0, 0.0)).unwrap().ids,
        [1, 3, 4]
    );
    // top-p ties at the boundary: four equal tokens, p = 0.5 keeps the two lowest ids
    let row = [0.0f32, 1.0, 1.0, 1.0, 1.0];
    let k = kept_set(&row, &draw(1.0, 0, 0.5, 0.0)).unwrap();
    let top = 4.0 * 1f64.exp();
    let need = 0.5 * (top + 1.0);
    let nt = ((need / 1f64.exp()).ceil()) as usize;
    assert_eq!(k.ids, (1..=nt as u32).collect::<Vec<_>>());
    // min-p drops what is below min_p x the top weight
    let row = [0.0f32, -1.0, -3.0];
    let k = kept_set(&row, &draw(1.0, 0, 1.0, 0.2)).unwrap();
    assert_eq!(k.ids, [0, 1], "e^-1 = 0.37 stays, e^-3 = 0.05 goes");
    // past the end by rounding: the last kept token
    let k = kept_set(&[0.0f32, 0.0], &d).unwrap();
    assert_eq!(pick_kept(&k, 1.0).unwrap().token, 1);
}

#[test]
fn device_draw_takes_the_hosts_draw_from_the_stream() {
    let p = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        max_tokens: 10,
        ..Default::default()
    };
    let row: Vec<f32> = (0..50).map(|i| (i % 7) as f32).collect();
    let mut host = SequenceSampler::with_seed(&p, 50, &[], 42).unwrap();
    let mut dev = SequenceSampler::with_seed(&p, 50, &[], 42).unwrap();
    let mut check = ChaCha20Rng::seed_from_u64(42);
    for _ in 0..5 {
        host.sample(&row).unwrap();
        let d = dev.device_draw().unwrap();
        assert_eq!(
            d.u,
            check.random::<f64>(),
            "the same uniform as the host draw"
        );
        assert_eq!(
            (d.temperature, d.top_p, d.top_k, d.min_p),
            (0.8, 0.9, 0, 0.0)
        );
        let t = sample_row(&row, &d);
        assert_eq!(dev.accept_sampled(t).unwrap().token, t.unwrap());
        assert_eq!(host.state(), dev.state(), "same stream position");
    }
    assert!(matches!(
        dev.accept_sampled(None),
        Err(crate::sampling::SamplingError::NoFiniteLogits)
    ));
    assert!(matches!(
        dev.accept_sampled(Some(50)),
        Err(crate::sampling::SamplingError::TokenOutOfRange { .. })
    ));
    // greedy, logprobs, penalties: the row is needed; nothing is drawn
    for q in [
        SamplingParams {
            temperature: 0.0,
            ..p.clone()
        },
        SamplingParams {
            logprobs: Some(2),
            ..p.clone()
        },
        SamplingParams {
            presence_penalty: 0.5,
            ..p.clone()
        },
        SamplingParams {
            repetition_penalty: 1.2,
            ..p.clone()
        },
    ] {
        let mut s = SequenceSampler::with_seed(&q, 50, &[3], 42).unwrap();
        let before = s.state();
        assert!(s.device_draw().is_none(), "{q:?}");
        assert_eq!(s.state(), before);
        assert!(s.accept_sampled(Some(1)).is_err());
    }
    // top_k at or past the vocabulary is off, as on the host
    let q = SamplingParams {
        top_k: 50,
        ..p.clone()
    };
    let mut s = SequenceSampler::with_seed(&q, 50, &[], 1).unwrap();
    assert_eq!(s.device_draw().unwrap().top_k, 0);
}
