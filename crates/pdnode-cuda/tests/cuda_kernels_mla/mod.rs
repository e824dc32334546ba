//! The DeepSeek kernels (kernels/mla.cu, kernels/moe.cu): MLA latent write + RoPE, the absorbed
//! latent attention (one split and several), MoE routing for the three scorings, the expert GEMVs,
//! the combine and the row gather, each against a host reference on fresh random inputs with the
//! outputs poisoned (0xFF) first. Part of the `cuda_kernels` test binary; prints PASS lines.

use super::cuda_support::*;
use super::{gpu, poisoned, up_i32};
use pdnode_cuda::CudaError;
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, AttnMeta, MlaDims};
use pdnode_engine::spec::{MoeScoring, MoeSpec};
use rand::Rng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

fn bits(g: &Gpu, b: &DevBuf, n: usize) -> Vec<u16> {
    let mut v = vec![0u16; n];
    g.download(&mut v, b, 0).unwrap();
    v
}

fn from_bits(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

fn to_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// max |got - want| / max |want|; a non-finite value in `got` fails (infinity).
fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let md = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max);
    let mw = want.iter().map(|w| w.abs()).fold(1e-12, f64::max);
    md / mw
}

fn report(ok: bool, what: &str) {
    println!("{} {what}", if ok { "PASS" } else { "FAIL" });
    assert!(ok, "{what}");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn mla_rope_latent_matches_host() {
    let g = gpu();
    let mut r = rng("mla_rope_latent");
    // (tokens, heads, nope, rope, rank, interleave, rope_factor)
    for (t, heads, nope, rope, rank, il, factor) in [
        (3, 2, 16, 64, 32, false, 1.0f32),
        (4, 16, 128, 64, 512, true, 1.3),
        (2, 16, 128, 64, 512, false, 0.7),
        (5, 3, 8, 16, 40, true, 1.1),
    ] {
        let d = MlaDims {
            heads,
            nope,
            rope,
            rank,
            block_size: 4,
            num_blocks: t + 2,
        };
        let (latent, qk, half) = (d.latent(), d.qk(), rope / 2);
        let kva = randv(&mut r, t * latent, 2.0);
        let norm: Vec<f32> = (0..rank).map(|_| r.random_range(0.5..1.5)).collect();
        let invf: Vec<f32> = (0..half)
            .map(|i| 10000f32.powf(-2.0 * i as f32 / rope as f32))
            .collect();
        let q0 = randv(&mut r, t * heads * qk, 2.0);
        let pos: Vec<i32> = (0..t).map(|_| r.random_range(0..5000)).collect();
        let mut perm: Vec<i64> = (0..(d.num_blocks * d.block_size) as i64).collect();
        perm.shuffle(&mut r);
        let slots: Vec<i64> = perm[..t].to_vec();
        let layer = 1;
        let pool = poisoned(&g, 2 * d.layer_elems() * 2);
        let (dkva, dnorm, dinv) = (
            g.upload_f32(&kva).unwrap(),
            g.upload_f32(&norm).unwrap(),
            g.upload_f32(&invf).unwrap(),
        );
        let dq = g.upload_bf16(&q0).unwrap();
        let dpos = up_i32(&g, &pos);
        let dslots = g.alloc(t * 8).unwrap();
        g.upload(&dslots, 0, &slots).unwrap();
        let eps = 1e-6;
        ops::mla_rope_latent(
            &g,
            &d,
            &dkva,
            &dnorm,
            eps,
            &dq,
            &dinv,
            factor,
            il,
            dpos.ptr(),
            dslots.ptr(),
            t,
            &pool,
            layer,
        )
        .unwrap();
        let q = g.download_bf16(&dq, t * heads * qk).unwrap();
        let pb = bits(&g, &pool, 2 * d.layer_elems());
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let rot = |x1: f64, x2: f64, tt: usize, i: usize| {
            let a = (pos[tt] as f32 * invf[i]) as f64;
            let (c, s) = (a.cos() * factor as f64, a.sin() * factor as f64);
            (x1 * c - x2 * s, x2 * c + x1 * s)
        };
        let pair = |i: usize| {
            if il {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            }
        };
        for tt in 0..t {
            for h in 0..heads {
                let o = (tt * heads + h) * qk;
                for k in 0..nope {
                    got.push(q[o + k]);
                    want.push(q0[o + k] as f64);
                }
                for i in 0..half {
                    let (a, b) = pair(i);
                    let (o1, o2) = rot(q0[o + nope + a] as f64, q0[o + nope + b] as f64, tt, i);
                    got.extend([q[o + nope + a], q[o + nope + b]]);
                    want.extend([o1, o2]);
                }
            }
            let row = &kva[tt * latent..(tt + 1) * latent];
            let ss: f64 = row[..rank].iter().map(|&v| v as f64 * v as f64).sum();
            let inv = 1.0 / (ss / rank as f64 + eps as f64).sqrt();
            let dst = d.layer_elems() * layer + slots[tt] as usize * latent;
            for i in 0..rank {
                got.push(from_bits(pb[dst + i]));
                want.push(norm[i] as f64 * row[i] as f64 * inv);
            }
            for i in 0..half {
                let (a, b) = pair(i);
                let (o1, o2) = rot(row[rank + a] as f64, row[rank + b] as f64, tt, i);
                got.extend([from_bits(pb[dst + rank + a]), from_bits(pb[dst + rank + b])]);
                want.extend([o1, o2]);
            }
        }
        let e = max_rel(&got, &want);
        // every other element of the pool (layer 0, the unused slots of layer 1) still poisoned
        let mut written = vec![false; 2 * d.layer_elems()];
        for &s in &slots {
            let o = d.layer_elems() * layer + s as usize * latent;
            written[o..o + latent].fill(true);
        }
        let stray = pb
            .iter()
            .zip(&written)
            .filter(|&(&v, &w)| !w && v != 0xFFFF)
            .count();
        report(
            e < 8e-3 && stray == 0,
            &format!(
                "mla_rope_latent t={t} heads={heads} nope={nope} rope={rope} rank={rank} \
                 interleave={il} factor={factor}: max rel err {e:.1e}, {stray} stray writes"
            ),
        );
    }
}

/// One attention case: `seqs[s]` the positions of sequence s's tokens (its context is its
/// largest position + 1).
fn attn_case(
    g: &Gpu,
    r: &mut ChaCha8Rng,
    heads: usize,
    rank: usize,
    rope: usize,
    bs: usize,
    seqs: &[Vec<usize>],
) {
    // every split kernel the shape takes (the tensor-core one: rank and rope multiples of 16)
    let mut kernels = vec![ops::MlaKernel::CudaCores];
    if rank.is_multiple_of(16) && rope.is_multiple_of(16) {
        kernels.push(ops::MlaKernel::TensorCores);
    }
    for kernel in kernels {
        attn_case_with(g, r, heads, rank, rope, bs, seqs, kernel);
    }
}

#[allow(clippy::too_many_arguments)]
fn attn_case_with(
    g: &Gpu,
    r: &mut ChaCha8Rng,
    heads: usize,
    rank: usize,
    rope: usize,
    bs: usize,
    seqs: &[Vec<usize>],
    kernel: ops::MlaKernel,
) {
    let ctx: Vec<usize> = seqs.iter().map(|p| p.iter().max().unwrap() + 1).collect();
    let max_ctx = *ctx.iter().max().unwrap();
    let max_blocks = max_ctx.div_ceil(bs);
    let used: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
    let d = MlaDims {
        heads,
        nope: 16,
        rope,
        rank,
        block_size: bs,
        num_blocks: used + 2,
    };
    let (latent, qk, nb) = (d.latent(), d.qk(), d.num_blocks);
    let mut perm: Vec<i32> = (0..nb as i32).collect();
    perm.shuffle(r);
    let mut tables = vec![perm[nb - 1]; seqs.len() * max_blocks];
    let mut next = 0;
    for (s, &c) in ctx.iter().enumerate() {
        for j in 0..c.div_ceil(bs) {
            tables[s * max_blocks + j] = perm[next];
            next += 1;
        }
    }
    let row_of = |s: usize, p: usize| tables[s * max_blocks + p / bs] as usize * bs + p % bs;
    // layer 1 of two; NaN wherever no context reaches, so a key read past one poisons the output
    let layer = 1;
    let mut pool = vec![0x7fc0u16; 2 * d.layer_elems()];
    let base = d.layer_elems() * layer;
    for (s, &c) in ctx.iter().enumerate() {
        for p in 0..c {
            let o = base + row_of(s, p) * latent;
            for v in &mut pool[o..o + latent] {
                *v = to_bits(r.random_range(-1.0..1.0));
            }
        }
    }
    let (mut tok_seq, mut tok_pos) = (Vec::new(), Vec::new());
    for (s, ps) in seqs.iter().enumerate() {
        for &p in ps {
            tok_seq.push(s as i32);
            tok_pos.push(p as i32);
        }
    }
    let t = tok_seq.len();
    let q_lat = randv(r, t * heads * rank, 1.0);
    let q = randv(r, t * heads * qk, 2.0);
    let scale = 0.15f32;
    let dpool = g.alloc(pool.len() * 2).unwrap();
    g.upload(&dpool, 0, &pool).unwrap();
    let (dql, dq) = (g.upload_f32(&q_lat).unwrap(), g.upload_bf16(&q).unwrap());
    let (dseq, dpos, dbt) = (up_i32(g, &tok_seq), up_i32(g, &tok_pos), up_i32(g, &tables));
    let sm = g.sm_count as usize;
    let nsplit = ops::mla_splits(sm, t, heads);
    let (mlb, accb) = ops::mla_scratch_bytes(sm, t, heads, rank);
    let (part_ml, part_acc) = (poisoned(g, mlb.max(4)), poisoned(g, accb.max(16)));
    let out = poisoned(g, t * heads * rank * 2);
    let meta = AttnMeta {
        tok_seq: dseq.ptr(),
        tok_pos: dpos.ptr(),
        block_tables: dbt.ptr(),
        max_blocks,
        max_ctx,
        window: 0,
    };
    ops::mla_attention(
        g, &d, &dql, &dq, &dpool, layer, &meta, t, scale, &part_ml, &part_acc, &out, kernel,
    )
    .unwrap();
    let got = g.download_bf16(&out, t * heads * rank).unwrap();
    let mut want = Vec::with_capacity(got.len());
    for tt in 0..t {
        let (s, n) = (tok_seq[tt] as usize, tok_pos[tt] as usize + 1);
        for h in 0..heads {
            let ql = &q_lat[(tt * heads + h) * rank..][..rank];
            let qp = &q[(tt * heads + h) * qk + d.nope..][..rope];
            let lat = |p: usize, i: usize| from_bits(pool[base + row_of(s, p) * latent + i]) as f64;
            let sc: Vec<f64> = (0..n)
                .map(|p| {
                    let a: f64 = (0..rank).map(|i| ql[i] as f64 * lat(p, i)).sum();
                    let b: f64 = (0..rope).map(|i| qp[i] as f64 * lat(p, rank + i)).sum();
                    (a + b) * scale as f64
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            for i in 0..rank {
                want.push((0..n).map(|p| e[p] * lat(p, i)).sum::<f64>() / sum);
            }
        }
    }
    let err = max_rel(&got, &want);
    report(
        err < 1e-2,
        &format!(
            "mla_attention {kernel:?} heads={heads} rank={rank} rope={rope} bs={bs} tokens={t} \
             max_ctx={max_ctx} splits={nsplit}: max rel err {err:.1e}"
        ),
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn mla_attention_matches_host() {
    let g = gpu();
    let mut r = rng("mla_attention");
    // several tokens of 2-3 sequences of different lengths, contexts crossing blocks; block sizes
    // 1 and 16; heads 2, 16 and 20 (two head groups); rank 32 and 512; many splits (few tokens).
    // Each case through both split kernels where rank and rope are multiples of 16, else (rope
    // 18, a shape no DeepSeek uses; the fixtures' rope 8) the CUDA-core one only
    attn_case(&g, &mut r, 2, 32, 64, 1, &[vec![0, 1, 2], vec![40]]);
    attn_case(&g, &mut r, 3, 32, 18, 4, &[vec![140], vec![9]]);
    attn_case(
        &g,
        &mut r,
        5,
        48,
        16,
        8,
        &[vec![37], vec![2, 3], vec![16, 17]],
    );
    attn_case(
        &g,
        &mut r,
        16,
        512,
        64,
        16,
        &[vec![69], vec![0], vec![130, 131]],
    );
    attn_case(
        &g,
        &mut r,
        2,
        32,
        64,
        16,
        &[vec![5], vec![150, 151], vec![63, 64]],
    );
    attn_case(&g, &mut r, 16, 512, 64, 1, &[vec![300, 301], vec![17]]);
    attn_case(&g, &mut r, 20, 512, 64, 16, &[vec![1000], vec![33]]);
    // decode at a long context: splits of the one token's context
    attn_case(&g, &mut r, 16, 512, 64, 16, &[vec![4100]]);
    // many tokens: one split, the output written directly
    let long: Vec<usize> = (0..160).collect();
    attn_case(&g, &mut r, 16, 512, 64, 16, &[long, vec![90]]);
}

fn moe_spec(
    experts: usize,
    top_k: usize,
    groups: usize,
    topk_groups: usize,
    scoring: MoeScoring,
    norm: bool,
) -> MoeSpec {
    MoeSpec {
        num_experts: experts,
        top_k,
        num_shared: 0,
        expert_intermediate: 8,
        first_dense_layers: 0,
        num_groups: groups,
        topk_groups,
        scoring,
        norm_topk_prob: norm,
        routed_scaling_factor: 2.5,
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn moe_route_matches_host_for_every_scoring() {
    let g = gpu();
    let mut r = rng("moe_route");
    let greedy = MoeScoring::Softmax {
        group_limited: false,
    };
    let limited = MoeScoring::Softmax {
        group_limited: true,
    };
    let sig = MoeScoring::SigmoidBiased;
    // (spec, bias): V2 greedy / group-limited, V3 with and without the bias, top 1, the largest
    // shapes, fewer kept experts than top_k
    let cases = [
        (moe_spec(8, 2, 1, 1, greedy, false), false),
        (moe_spec(64, 6, 1, 1, greedy, true), false),
        (moe_spec(160, 6, 8, 3, limited, false), false),
        (moe_spec(256, 8, 8, 4, sig, true), true),
        (moe_spec(256, 8, 8, 4, sig, true), false),
        (moe_spec(16, 1, 4, 2, sig, true), true),
        (moe_spec(1024, 16, 16, 8, sig, false), true),
        (moe_spec(12, 8, 4, 1, limited, false), false),
        (moe_spec(12, 8, 4, 1, sig, true), true),
    ];
    for ties in [false, true] {
        for (spec, with_bias) in &cases {
            let (t, n, k) = (7, spec.num_experts, spec.top_k);
            // ties: a few distinct values, so equal scores and the lowest-index rule matter
            let logits: Vec<f32> = (0..t * n)
                .map(|_| {
                    if ties {
                        (r.random_range(0..7) - 3) as f32 * 0.5
                    } else {
                        r.random_range(-4.0..4.0)
                    }
                })
                .collect();
            let bias: Vec<f32> = (0..n)
                .map(|_| {
                    if ties {
                        (r.random_range(0..3) - 1) as f32 * 0.25
                    } else {
                        r.random_range(-0.3..0.3)
                    }
                })
                .collect();
            let (dl, db) = (g.upload_f32(&logits).unwrap(), g.upload_f32(&bias).unwrap());
            let (ids, w) = (poisoned(&g, t * k * 4), poisoned(&g, t * k * 4));
            ops::moe_route(&g, spec, &dl, with_bias.then_some(&db), t, &ids, &w).unwrap();
            let mut got_ids = vec![0i32; t * k];
            g.download(&mut got_ids, &ids, 0).unwrap();
            let got_w = g.download_f32(&w, t * k).unwrap();
            // Row by row against the host; where two groups' scores are equal in exact
            // arithmetic (the ties cases: sigmoid(x) + sigmoid(-x) = 1, quarter biases) they may
            // round apart differently here and there, so a row that differs passes if it is the
            // host's route for another keep set that is as good within rounding.
            let b = with_bias.then_some(bias.as_slice());
            let (mut differ, mut near_tied, mut werr) = (0, 0, 0f32);
            for tt in 0..t {
                let row = &logits[tt * n..(tt + 1) * n];
                let got: Vec<(i32, f32)> = got_ids[tt * k..(tt + 1) * k]
                    .iter()
                    .copied()
                    .zip(got_w[tt * k..(tt + 1) * k].iter().copied())
                    .collect();
                let want = pdnode_engine::backend::cpu::route_experts(row, b, spec);
                let err = |want: &[(usize, f32)]| -> Option<f32> {
                    let same = want.iter().zip(&got).all(|(w, g)| w.0 as i32 == g.0);
                    same.then(|| {
                        want.iter().zip(&got).fold(0f32, |m, (w, g)| {
                            let d = (w.1 - g.1).abs();
                            if d.is_nan() { f32::INFINITY } else { m.max(d) }
                        })
                    })
                };
                if let Some(e) = err(&want) {
                    werr = werr.max(e);
                    continue;
                }
                let alt = near_tied_keep_sets(row, b, spec)
                    .into_iter()
                    .filter_map(|keep| {
                        err(&pdnode_engine::backend::cpu::route_in_groups(
                            row,
                            b,
                            spec,
                            Some(&keep),
                        ))
                    })
                    .reduce(f32::min);
                match alt {
                    Some(e) => {
                        near_tied += 1;
                        werr = werr.max(e);
                    }
                    None => differ += 1,
                }
            }
            report(
                differ == 0 && werr <= 1e-5,
                &format!(
                    "moe_route experts={n} top_k={k} groups={}/{} {:?} norm={} bias={with_bias} \
                     ties={ties}: ids of {differ} rows DIFFER, {near_tied} rows another keep set \
                     of near-tied groups, max weight err {werr:.1e}",
                    spec.topk_groups, spec.num_groups, spec.scoring, spec.norm_topk_prob,
                ),
            );
        }
    }
}

/// The keep sets other than the host's whose groups all score within rounding (1e-5) of the
/// boundary or above it: every set of `topk_groups` groups that holds each group clearly above
/// the boundary and fills the rest from the groups at it. Empty where the row keeps every group.
fn near_tied_keep_sets(row: &[f32], bias: Option<&[f32]>, spec: &MoeSpec) -> Vec<Vec<usize>> {
    let Some(g) = pdnode_engine::backend::cpu::moe_group_scores(row, bias, spec) else {
        return Vec::new();
    };
    let mut sorted = g.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let cut = sorted[spec.topk_groups - 1];
    let sure: Vec<usize> = (0..g.len()).filter(|&i| g[i] > cut + 1e-5).collect();
    let at: Vec<usize> = (0..g.len())
        .filter(|&i| (g[i] - cut).abs() <= 1e-5)
        .collect();
    let need = spec.topk_groups - sure.len();
    if at.len() > 16 {
        return Vec::new();
    }
    // Subsets of `at` of size `need` (a bit mask walk over at most 16 groups).
    (0u32..1 << at.len())
        .filter(|m| m.count_ones() as usize == need)
        .map(|m| {
            let mut keep = sure.clone();
            keep.extend((0..at.len()).filter(|j| m >> j & 1 == 1).map(|j| at[j]));
            keep
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn moe_experts_and_combine_match_host() {
    let g = gpu();
    let mut r = rng("moe_experts");
    // (experts, tokens, top_k, inter, hidden, crowd: most pairs on one expert)
    for (ne, t, k, inter, hidden, crowd) in [
        (8, 3, 2, 40, 64, false),
        (64, 1, 6, 176, 2048, false),
        (4, 9, 2, 72, 520, true),
        (160, 80, 6, 96, 256, false),
    ] {
        let p = t * k;
        let wgu = randv(&mut r, ne * 2 * inter * hidden, 1.0);
        let wd = randv(&mut r, ne * hidden * inter, 1.0);
        let x = randv(&mut r, t * hidden, 1.0);
        let ids: Vec<i32> = (0..p)
            .map(|i| {
                if crowd && i % 5 != 0 {
                    3
                } else {
                    r.random_range(0..ne as i32)
                }
            })
            .collect();
        let (dwgu, dwd, dx, dids) = (
            g.upload_bf16(&wgu).unwrap(),
            g.upload_bf16(&wd).unwrap(),
            g.upload_bf16(&x).unwrap(),
            up_i32(&g, &ids),
        );
        let act = poisoned(&g, p * inter * 2);
        ops::moe_gate_up_swiglu(&g, ne, inter, hidden, k, &dwgu, &dx, &dids, t, &act).unwrap();
        let got_act = g.download_bf16(&act, p * inter).unwrap();
        let mut want = Vec::new();
        for (pi, &id) in ids.iter().enumerate() {
            let (e, tt) = (id as usize, pi / k);
            let xr = &x[tt * hidden..(tt + 1) * hidden];
            for n in 0..inter {
                let dot = |row: usize| -> f64 {
                    let w = &wgu[(e * 2 * inter + row) * hidden..][..hidden];
                    w.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum()
                };
                let (gg, u) = (dot(n), dot(inter + n));
                want.push(gg / (1.0 + (-gg).exp()) * u);
            }
        }
        let e1 = max_rel(&got_act, &want);
        let tag = format!("experts={ne} tokens={t} top_k={k} inter={inter} hidden={hidden}");
        report(
            e1 < 8e-3,
            &format!("moe_gate_up_swiglu {tag}: max rel err {e1:.1e}"),
        );

        let y = poisoned(&g, p * hidden * 4);
        ops::moe_down(&g, ne, hidden, inter, k, &dwd, &act, &dids, t, &y).unwrap();
        let got_y = g.download_f32(&y, p * hidden).unwrap();
        let mut want_y = Vec::new();
        for pi in 0..p {
            let e = ids[pi] as usize;
            let a = &got_act[pi * inter..(pi + 1) * inter];
            for n in 0..hidden {
                let w = &wd[(e * hidden + n) * inter..][..inter];
                want_y.push(
                    w.iter()
                        .zip(a)
                        .map(|(u, v)| *u as f64 * *v as f64)
                        .sum::<f64>(),
                );
            }
        }
        let e2 = max_rel(&got_y, &want_y);
        report(e2 < 1e-5, &format!("moe_down {tag}: max rel err {e2:.1e}"));

        let wts: Vec<f32> = (0..p).map(|_| r.random_range(-1.0..1.0)).collect();
        let dw = g.upload_f32(&wts).unwrap();
        for with_map in [false, true] {
            let mut map: Vec<i32> = (0..p as i32).collect();
            if with_map {
                map.shuffle(&mut r);
            }
            let dmap = up_i32(&g, &map);
            let resid0 = randv(&mut r, t * hidden, 1.0);
            let resid = g.upload_f32(&resid0).unwrap();
            ops::moe_combine(
                &g,
                hidden,
                k,
                &y,
                with_map.then_some(dmap.ptr()),
                &dw,
                t,
                &resid,
            )
            .unwrap();
            let got = g.download_f32(&resid, t * hidden).unwrap();
            let want: Vec<f64> = (0..t * hidden)
                .map(|i| {
                    let (tt, n) = (i / hidden, i % hidden);
                    let s: f64 = (0..k)
                        .map(|j| {
                            let pi = tt * k + j;
                            wts[pi] as f64 * got_y[map[pi] as usize * hidden + n] as f64
                        })
                        .sum();
                    resid0[i] as f64 + s
                })
                .collect();
            let e3 = max_rel(&got, &want);
            report(
                e3 < 1e-5,
                &format!("moe_combine {tag} map={with_map}: max rel err {e3:.1e}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn moe_out_of_range_expert_ids_read_nothing_and_give_zero_rows() {
    let g = gpu();
    let mut r = rng("moe_bad_ids");
    let (ne, t, k, inter, hidden) = (8, 2, 2, 64, 128);
    let wgu = g
        .upload_bf16(&randv(&mut r, ne * 2 * inter * hidden, 1.0))
        .unwrap();
    let wd = g
        .upload_bf16(&randv(&mut r, ne * hidden * inter, 1.0))
        .unwrap();
    let x = g.upload_bf16(&randv(&mut r, t * hidden, 1.0)).unwrap();
    // a bad router: ids past the experts and negative (the kernels neither read those experts'
    // weights nor leave the rows poisoned: those pairs get zeros)
    let ids = up_i32(&g, &[1, ne as i32 + 5, -3, 1_000_000]);
    let act = poisoned(&g, t * k * inter * 2);
    ops::moe_gate_up_swiglu(&g, ne, inter, hidden, k, &wgu, &x, &ids, t, &act).unwrap();
    let y = poisoned(&g, t * k * hidden * 4);
    ops::moe_down(&g, ne, hidden, inter, k, &wd, &act, &ids, t, &y).unwrap();
    g.sync().expect("no fault from out-of-range expert ids");
    let a = g.download_bf16(&act, t * k * inter).unwrap();
    let yv = g.download_f32(&y, t * k * hidden).unwrap();
    let zero_rows = (1..4).all(|p| {
        a[p * inter..(p + 1) * inter].iter().all(|&v| v == 0.0)
            && yv[p * hidden..(p + 1) * hidden].iter().all(|&v| v == 0.0)
    });
    let first_ok =
        a[..inter].iter().all(|v| v.is_finite()) && yv[..hidden].iter().all(|v| v.is_finite());
    report(
        zero_rows && first_ok,
        "moe GEMVs: ids experts + 5, -3, 1e6 read nothing out of bounds and give zero rows",
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gather_rows_bf16_copies_rows_and_zeroes_bad_indices() {
    let g = gpu();
    let mut r = rng("gather_rows_bf16");
    for (rows, n, cols) in [(10, 7, 64), (10, 7, 13), (300, 33, 1032)] {
        let src = randv(&mut r, rows * cols, 1.0);
        let mut idx: Vec<i32> = (0..n).map(|_| r.random_range(0..rows as i32)).collect();
        idx[n / 2] = rows as i32 + 1;
        let (ds, di) = (g.upload_bf16(&src).unwrap(), up_i32(&g, &idx));
        let dst = poisoned(&g, n * cols * 2);
        ops::gather_rows_bf16(&g, &ds, rows, di.ptr(), n, cols, &dst).unwrap();
        let got = g.download_bf16(&dst, n * cols).unwrap();
        let want: Vec<f32> = (0..n * cols)
            .map(|i| {
                let (row, c) = (idx[i / cols], i % cols);
                if (row as usize) < rows {
                    src[row as usize * cols + c]
                } else {
                    0.0
                }
            })
            .collect();
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        report(
            same,
            &format!("gather_rows_bf16 rows={rows} n={n} cols={cols}: exact"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn deepseek_wrappers_refuse_shapes_the_kernels_cannot_run() {
    let g = gpu();
    let b = g.alloc(1 << 20).unwrap();
    let shape = |r: Result<(), CudaError>| matches!(r, Err(CudaError::Shape { .. }));
    // more pairs than the GEMVs take, more experts than the routing holds, odd reductions
    let pairs = ops::MOE_GEMV_MAX_PAIRS + 1;
    assert!(shape(ops::moe_gate_up_swiglu(
        &g, 8, 8, 8, 1, &b, &b, &b, pairs, &b
    )));
    assert!(shape(ops::moe_down(&g, 8, 8, 12, 1, &b, &b, &b, 1, &b)));
    let spec = moe_spec(2048, 8, 8, 4, MoeScoring::SigmoidBiased, true);
    assert!(shape(ops::moe_route(&g, &spec, &b, None, 1, &b, &b)));
    let spec = moe_spec(16, 17, 1, 1, MoeScoring::SigmoidBiased, true);
    assert!(shape(ops::moe_route(&g, &spec, &b, None, 1, &b, &b)));
    // rank past the kernel's registers, odd rope
    let d = MlaDims {
        heads: 16,
        nope: 128,
        rope: 64,
        rank: 520,
        block_size: 16,
        num_blocks: 2,
    };
    let meta = AttnMeta {
        tok_seq: 0,
        tok_pos: 0,
        block_tables: 0,
        max_blocks: 1,
        max_ctx: 16,
        window: 0,
    };
    let attn = |d: &MlaDims| {
        let k = ops::MlaKernel::Auto;
        ops::mla_attention(&g, d, &b, &b, &b, 0, &meta, 1, 1.0, &b, &b, &b, k)
    };
    assert!(shape(attn(&d)));
    assert!(shape(attn(&MlaDims {
        rank: 512,
        rope: 63,
        ..d
    })));
    g.sync().unwrap();
    println!("PASS deepseek wrappers: shape errors, nothing launched");
}
