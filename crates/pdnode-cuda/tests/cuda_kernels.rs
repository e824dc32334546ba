//! Each CUDA kernel against a host f32 reference on fresh random inputs, outputs poisoned with
//! NaN first so an unwritten element fails. GPU only: `#[ignore]`d, run by scripts/gpu/run-all.sh.

mod cuda_kernels_attn;
mod cuda_kernels_crc32c;
mod cuda_kernels_elementwise;
mod cuda_kernels_kvh64;
mod cuda_kernels_linear;
mod cuda_kernels_mla;
mod cuda_kernels_pdl;
mod cuda_kernels_prefill;
mod cuda_kernels_rope;
mod cuda_kernels_stream;
mod cuda_support;

use cuda_support::*;
use pdnode_cuda::blas::OutType;
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, AttnDims, AttnMeta, AttnVariant, AttnWorkspace, LinearImpl};
use pdnode_cuda::prefill::{LongSeq, PrefillAttn, PrefillScratch};
use rand::Rng;
use rand::seq::SliceRandom;

fn gpu() -> Gpu {
    Gpu::new(0).expect("open GPU 0")
}

fn poisoned(g: &Gpu, bytes: usize) -> DevBuf {
    let b = g.alloc(bytes).unwrap();
    g.memset(&b, 0xFF).unwrap();
    b
}

fn up_i32(g: &Gpu, v: &[i32]) -> DevBuf {
    let b = g.alloc(v.len().max(1) * 4).unwrap();
    g.upload(&b, 0, v).unwrap();
    b
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn linear_gemv_and_cublas_agree_with_reference() {
    let g = gpu();
    let mut r = rng("linear");
    for &(out, t, inp) in &[(200, 1, 64), (1000, 3, 520), (4096, 8, 4096), (77, 5, 2056)] {
        let w = randv(&mut r, out * inp, 1.0);
        let x = randv(&mut r, t * inp, 1.0);
        let y0 = randv(&mut r, t * out, 1.0);
        let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
        let reference = |acc: bool| -> Vec<f32> {
            (0..t * out)
                .map(|k| {
                    let (ti, o) = (k / out, k % out);
                    let s: f32 = (0..inp).map(|i| w[o * inp + i] * x[ti * inp + i]).sum();
                    s + if acc { y0[k] } else { 0.0 }
                })
                .collect()
        };
        for how in [LinearImpl::Gemv, LinearImpl::GemvMma, LinearImpl::Cublas] {
            let yb = poisoned(&g, t * out * 2);
            ops::linear(&g, out, t, inp, &dw, &dx, &yb, OutType::Bf16, false, how).unwrap();
            let e = rel_err(&g.download_bf16(&yb, t * out).unwrap(), &reference(false));
            assert!(e < 1e-2, "{how:?} bf16 {out}x{t}x{inp}: {e}");
            let yf = g.upload_f32(&y0).unwrap();
            ops::linear(&g, out, t, inp, &dw, &dx, &yf, OutType::F32, true, how).unwrap();
            let e = rel_err(&g.download_f32(&yf, t * out).unwrap(), &reference(true));
            assert!(e < 1e-3, "{how:?} f32 accumulate {out}x{t}x{inp}: {e}");
        }
    }
    let small = g.alloc(16).unwrap();
    assert!(
        ops::linear(
            &g,
            8,
            1,
            8,
            &small,
            &small,
            &small,
            OutType::F32,
            false,
            LinearImpl::Auto
        )
        .is_err()
    );
}

/// The tensor-core GEMV (and Auto, which picks it for <= 8 tokens) at every token count 1..=8 on
/// odd shapes (rows not a multiple of 16 or 32, inputs not a multiple of 32, a single chunk), both
/// kernel heights (32-row blocks need > 2 tokens and out / 32 >= SMs), bf16 and f32-accumulate
/// outputs, each element within bf16 bounds of the host reference; bitwise deterministic.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn linear_gemv_mma_every_token_count_and_odd_shapes() {
    let g = gpu();
    let mut r = rng("linear_mma");
    let sms = g.sm_count as usize;
    let tall = 32 * sms + 26; // 32-row blocks from 3 tokens on, a partial last block
    let mut cases: Vec<(usize, usize, usize)> = Vec::new();
    for t in 1..=8 {
        for &(out, inp) in &[(200, 64), (77, 2056), (33, 8), (513, 1032), (tall, 264)] {
            cases.push((out, t, inp));
        }
    }
    cases.extend([(4096, 1, 4096), (6144, 3, 4096), (4096, 8, 14336)]);
    for (out, t, inp) in cases {
        let w = randv(&mut r, out * inp, 1.0);
        let x = randv(&mut r, t * inp, 1.0);
        let y0 = randv(&mut r, t * out, 1.0);
        let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
        let dot: Vec<f32> = (0..t * out)
            .map(|k| {
                let (ti, o) = (k / out, k % out);
                let (wr, xr) = (&w[o * inp..(o + 1) * inp], &x[ti * inp..(ti + 1) * inp]);
                wr.iter()
                    .zip(xr)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>() as f32
            })
            .collect();
        let scale = dot.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        let launch = ops::mma_launch(sms, out, t, inp);
        for how in [LinearImpl::GemvMma, LinearImpl::Auto] {
            let yb = poisoned(&g, t * out * 2);
            ops::linear(&g, out, t, inp, &dw, &dx, &yb, OutType::Bf16, false, how).unwrap();
            let got = g.download_bf16(&yb, t * out).unwrap();
            let e = rel_err(&got, &dot);
            let worst = got
                .iter()
                .zip(&dot)
                .map(|(a, b)| {
                    if a.is_finite() {
                        (a - b).abs()
                    } else {
                        f32::INFINITY
                    }
                })
                .fold(0f32, f32::max);
            let ok = e < 1e-2 && worst <= 1e-2 * scale + 1e-3;
            println!(
                "{} gemv_mma {how:?} bf16 out={out} t={t} in={inp} {launch:?}: rel {e:.1e} max abs {worst:.2e} (scale {scale:.1})",
                if ok { "PASS" } else { "FAIL" }
            );
            assert!(ok, "{how:?} bf16 {out}x{t}x{inp}: rel {e}, max abs {worst}");
            let yf = g.upload_f32(&y0).unwrap();
            ops::linear(&g, out, t, inp, &dw, &dx, &yf, OutType::F32, true, how).unwrap();
            let got = g.download_f32(&yf, t * out).unwrap();
            let want: Vec<f32> = dot.iter().zip(&y0).map(|(d, y)| d + y).collect();
            let e = rel_err(&got, &want);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| {
                    if a.is_finite() {
                        (a - b).abs()
                    } else {
                        f32::INFINITY
                    }
                })
                .fold(0f32, f32::max);
            let ok = e < 1e-3 && worst <= 1e-3 * scale + 1e-3;
            println!(
                "{} gemv_mma {how:?} f32+= out={out} t={t} in={inp}: rel {e:.1e} max abs {worst:.2e}",
                if ok { "PASS" } else { "FAIL" }
            );
            assert!(
                ok,
                "{how:?} f32 accumulate {out}x{t}x{inp}: rel {e}, max abs {worst}"
            );
        }
        // every launch shape is correct, not only the one linear picks
        for l in [
            ops::mma_launch_tiles(sms, out, inp, 1),
            ops::mma_launch_tiles(sms, out, inp, 2),
            ops::MmaLaunch { warps: 1, ..launch },
            ops::MmaLaunch { warps: 3, ..launch },
            ops::MmaLaunch {
                warps: 16,
                ..launch
            },
            ops::MmaLaunch {
                l2_prefetch: true,
                ..launch
            },
            ops::MmaLaunch {
                l2_prefetch: true,
                ..ops::mma_launch_tiles(sms, out, inp, 2)
            },
        ] {
            let yf = poisoned(&g, t * out * 4);
            ops::gemv_mma(&g, l, out, t, inp, &dw, &dx, &yf, OutType::F32, false).unwrap();
            let e = rel_err(&g.download_f32(&yf, t * out).unwrap(), &dot);
            assert!(e < 1e-3, "gemv_mma {l:?} f32 {out}x{t}x{inp}: rel {e}");
        }
        // same inputs, same bits (fixed-order split-K reduction)
        let (ya, yb) = (poisoned(&g, t * out * 4), poisoned(&g, t * out * 4));
        for y in [&ya, &yb] {
            ops::linear(
                &g,
                out,
                t,
                inp,
                &dw,
                &dx,
                y,
                OutType::F32,
                false,
                LinearImpl::GemvMma,
            )
            .unwrap();
        }
        let (a, b) = (
            g.download_f32(&ya, t * out).unwrap(),
            g.download_f32(&yb, t * out).unwrap(),
        );
        assert!(
            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
            "gemv_mma not deterministic at {out}x{t}x{inp}"
        );
    }
    // shapes the kernel cannot take are typed errors, never launches
    let (w, x, y) = (
        g.alloc(1 << 16).unwrap(),
        g.alloc(1 << 16).unwrap(),
        g.alloc(1 << 16).unwrap(),
    );
    for (out, t, inp) in [(8, 9, 8), (8, 1, 12)] {
        let res = ops::linear(
            &g,
            out,
            t,
            inp,
            &w,
            &x,
            &y,
            OutType::F32,
            false,
            LinearImpl::GemvMma,
        );
        assert!(res.is_err(), "gemv_mma accepted {out}x{t}x{inp}");
    }
    println!("PASS gemv_mma rejects 9 tokens and inp % 8 != 0");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn embed_gather_copies_rows() {
    let g = gpu();
    let mut r = rng("embed");
    let (vocab, h, t) = (300, 72, 9);
    let table = randv(&mut r, vocab * h, 2.0);
    let ids: Vec<u32> = (0..t).map(|_| r.random_range(0..vocab as u32)).collect();
    let dt = g.upload_bf16(&table).unwrap();
    let di = g.alloc(t * 4).unwrap();
    g.upload(&di, 0, &ids).unwrap();
    let out = poisoned(&g, t * h * 4);
    ops::embed_gather(&g, &dt, vocab, di.ptr(), t, &out, h).unwrap();
    let got = g.download_f32(&out, t * h).unwrap();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| table[i as usize * h..(i as usize + 1) * h].to_vec())
        .collect();
    assert_eq!(got, want);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn add_rmsnorm_with_delta_and_row_selection() {
    let g = gpu();
    let mut r = rng("rmsnorm");
    let (h, t) = (4096 + 40, 5);
    let x = randv(&mut r, t * h, 3.0);
    let delta = randv(&mut r, t * h, 1.0);
    let w = randv(&mut r, h, 1.0);
    let (dx, dd, dw) = (
        g.upload_f32(&x).unwrap(),
        g.upload_f32(&delta).unwrap(),
        g.upload_f32(&w).unwrap(),
    );
    let out = poisoned(&g, t * h * 2);
    ops::add_rmsnorm(&g, &dx, t, Some(&dd), &dw, &out, None, t, h, 1e-6).unwrap();
    let got = g.download_bf16(&out, t * h).unwrap();
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
    let want: Vec<f32> = sum
        .chunks(h)
        .flat_map(|row| rmsnorm(row, &w, 1e-6))
        .collect();
    assert!(rel_err(&got, &want) < 5e-3, "{}", rel_err(&got, &want));
    let resid = g.download_f32(&dx, t * h).unwrap();
    assert!(rel_err(&resid, &sum) < 1e-6);
    // rows 4 and 1 only, no delta
    let rows = up_i32(&g, &[4, 1]);
    let out2 = poisoned(&g, 2 * h * 2);
    ops::add_rmsnorm(&g, &dx, t, None, &dw, &out2, Some(rows.ptr()), 2, h, 1e-6).unwrap();
    let got = g.download_bf16(&out2, 2 * h).unwrap();
    let want: Vec<f32> = [4usize, 1]
        .iter()
        .flat_map(|&i| rmsnorm(&sum[i * h..(i + 1) * h], &w, 1e-6))
        .collect();
    assert!(rel_err(&got, &want) < 5e-3);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn swiglu_matches_reference() {
    let g = gpu();
    let mut r = rng("swiglu");
    let (t, i) = (7, 1000);
    let gu = randv(&mut r, t * 2 * i, 4.0);
    let dgu = g.upload_bf16(&gu).unwrap();
    let out = poisoned(&g, t * i * 2);
    ops::swiglu(&g, &dgu, &out, t, i).unwrap();
    let got = g.download_bf16(&out, t * i).unwrap();
    let want: Vec<f32> = (0..t * i)
        .map(|k| {
            let (tt, ii) = (k / i, k % i);
            let (a, b) = (gu[tt * 2 * i + ii], gu[tt * 2 * i + i + ii]);
            a / (1.0 + (-a).exp()) * b
        })
        .collect();
    assert!(rel_err(&got, &want) < 5e-3);
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn fill_kernels_cover_every_element() {
    let g = gpu();
    let n = 1_000_003;
    let b = poisoned(&g, n * 2);
    ops::fill_uniform_bf16(&g, &b, n, 7, 0.5).unwrap();
    let v = g.download_bf16(&b, n).unwrap();
    assert!(v.iter().all(|x| x.is_finite() && x.abs() <= 0.5));
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let var = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n as f64;
    assert!(
        mean.abs() < 5e-3 && (var - 0.25 / 3.0).abs() < 5e-3,
        "{mean} {var}"
    );
    let f = poisoned(&g, n * 4);
    ops::fill_f32(&g, &f, n, 1.25).unwrap();
    assert!(g.download_f32(&f, n).unwrap().iter().all(|&x| x == 1.25));
}

fn pool_dims(nh: usize, nkv: usize, hd: usize, bs: usize, nb: usize) -> AttnDims {
    AttnDims {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        num_blocks: nb,
    }
}

/// Index (in bf16 elements) of K (`kv = 0`) or V of (layer, block, slot, head) in the pool.
fn pool_idx(d: &AttnDims, layer: usize, blk: usize, kv: usize, slot: usize, head: usize) -> usize {
    layer * d.layer_elems()
        + (((blk * 2 + kv) * d.block_size + slot) * d.num_kv_heads + head) * d.head_dim
}

/// Every paged-attention kernel (v1, v2, v2 narrow, v4 where the head_dim allows) against a
/// host reference, over prefill chunks and split decode, with the whole context and with
/// sliding windows: smaller than a block (1, 5), a block (16), not a multiple of the block size
/// (37, 999) and larger than every context (5000).
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn paged_attention_prefill_chunks_and_split_decode() {
    let g = gpu();
    let mut r = rng("attention");
    // (nh, nkv, hd, per-seq (start_pos, new tokens))
    type Case = (usize, usize, usize, Vec<(usize, usize)>);
    let cases: Vec<Case> = vec![
        (8, 2, 128, vec![(0, 37), (20, 13)]), // prefill + chunked prefill
        (32, 8, 128, vec![(3000, 1), (17, 1), (999, 1)]), // decode, long ctx: split-K
        (9, 3, 64, vec![(0, 5), (1500, 1)]),  // SmolLM2 shape, mixed
        (20, 2, 64, vec![(700, 2)]),          // G = 10 > 8: two head groups
        (4, 4, 16, vec![(0, 3), (40, 1)]),    // MHA, tiny head_dim
    ];
    for (nh, nkv, hd, seqs) in cases {
        let bs = 16;
        let max_ctx = seqs.iter().map(|(s, n)| s + n).max().unwrap();
        let max_blocks = max_ctx.div_ceil(bs);
        let nb = seqs.len() * max_blocks + 3;
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let layer = 1;
        let pool_h = randv(&mut r, 2 * d.layer_elems(), 1.0);
        let pool = g.upload_bf16(&pool_h).unwrap();
        let mut ids: Vec<i32> = (0..nb as i32).collect();
        ids.shuffle(&mut r);
        let mut tables = vec![0i32; seqs.len() * max_blocks];
        for (i, t) in tables.iter_mut().enumerate() {
            *t = ids[i];
        }
        let (mut tok_seq, mut tok_pos) = (vec![], vec![]);
        for (si, &(start, n)) in seqs.iter().enumerate() {
            for k in 0..n {
                tok_seq.push(si as i32);
                tok_pos.push((start + k) as i32);
            }
        }
        let t = tok_seq.len();
        let q = randv(&mut r, t * nh * hd, 2.0);
        let dq = g.upload_bf16(&q).unwrap();
        let (dseq, dpos, dtab) = (
            up_i32(&g, &tok_seq),
            up_i32(&g, &tok_pos),
            up_i32(&g, &tables),
        );
        for window in [0usize, 1, 5, 16, 37, 999, 5000] {
            let mut want = Vec::new();
            for ti in 0..t {
                let si = tok_seq[ti] as usize;
                let pos = tok_pos[ti] as usize;
                let lo = if window > 0 {
                    (pos + 1).saturating_sub(window)
                } else {
                    0
                };
                for h in 0..nh {
                    let kh = h / (nh / nkv);
                    let (mut keys, mut vals) = (vec![], vec![]);
                    for p in lo..=pos {
                        let blk = tables[si * max_blocks + p / bs] as usize;
                        let k0 = pool_idx(&d, layer, blk, 0, p % bs, kh);
                        let v0 = pool_idx(&d, layer, blk, 1, p % bs, kh);
                        keys.push(pool_h[k0..k0 + hd].to_vec());
                        vals.push(pool_h[v0..v0 + hd].to_vec());
                    }
                    let qq = &q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd];
                    want.extend(attend(qq, &keys, &vals));
                }
            }
            let meta = AttnMeta {
                tok_seq: dseq.ptr(),
                tok_pos: dpos.ptr(),
                block_tables: dtab.ptr(),
                max_blocks,
                max_ctx,
                window,
            };
            let mut variants = vec![AttnVariant::V1];
            if ops::v2_dims_per_lane(hd).is_some() {
                variants.push(AttnVariant::V2);
            }
            if hd % 8 == 0 && 32 % (hd / 8) == 0 {
                variants.push(AttnVariant::V2Narrow);
            }
            if ops::v4_supports(hd) {
                variants.push(AttnVariant::V4);
            }
            let (ml, acc) = (poisoned(&g, 1 << 20), poisoned(&g, 64 << 20));
            let ws = AttnWorkspace {
                part_ml: &ml,
                part_acc: &acc,
            };
            for v in variants {
                let out = poisoned(&g, t * nh * hd * 2);
                ops::paged_attention_ex(&g, &d, &dq, &pool, layer, &meta, t, None, &out, &ws, v)
                    .unwrap();
                let got = g.download_bf16(&out, t * nh * hd).unwrap();
                let e = rel_err(&got, &want);
                assert!(
                    e < 1e-2,
                    "{v:?} nh={nh} nkv={nkv} hd={hd} seqs={seqs:?} window={window}: rel err {e}"
                );
                // only the odd tokens, through a token list: the even rows stay poisoned
                let list: Vec<i32> = (0..t as i32).filter(|x| x % 2 == 1).collect();
                let dl = up_i32(&g, &list);
                let out = poisoned(&g, t * nh * hd * 2);
                ops::paged_attention_ex(
                    &g,
                    &d,
                    &dq,
                    &pool,
                    layer,
                    &meta,
                    t,
                    Some((dl.ptr(), list.len())),
                    &out,
                    &ws,
                    v,
                )
                .unwrap();
                let got = g.download_bf16(&out, t * nh * hd).unwrap();
                let row = nh * hd;
                for ti in 0..t {
                    let (a, b) = (
                        &got[ti * row..(ti + 1) * row],
                        &want[ti * row..(ti + 1) * row],
                    );
                    if ti % 2 == 1 {
                        assert!(
                            rel_err(a, b) < 1e-2,
                            "{v:?} window={window} listed token {ti}"
                        );
                    } else {
                        assert!(
                            a.iter().all(|x| x.is_nan()),
                            "{v:?} unlisted token {ti} written"
                        );
                    }
                }
            }
        }
    }
}

/// The cuBLAS prefill path against a host reference: query chunks, a cached prefix, and sliding
/// windows (each chunk's GEMMs start at its first query's window: 1, 5, a block, 37, and one
/// longer than every context).
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn prefill_gemm_attention_chunks_and_cached_prefix() {
    let g = gpu();
    let mut r = rng("prefill_gemm");
    // (nh, nkv, hd, start, n, score budget forcing several query chunks)
    for &(nh, nkv, hd, start, n, budget) in &[
        (8usize, 2usize, 128usize, 0usize, 70usize, 8 * 70 * 6 * 16),
        (6, 3, 64, 33, 40, 0),
        (4, 1, 32, 100, 17, 4 * 117 * 6 * 5),
    ] {
        let bs = 16;
        let e = start + n;
        let max_blocks = e.div_ceil(bs);
        let nb = 2 * max_blocks + 1;
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let layer = 0;
        let pool_h = randv(&mut r, d.layer_elems(), 1.0);
        let pool = g.upload_bf16(&pool_h).unwrap();
        let mut ids: Vec<i32> = (0..nb as i32).collect();
        ids.shuffle(&mut r);
        let tables: Vec<i32> = ids[..2 * max_blocks].to_vec(); // sequence 1 = second row
        let dtab = up_i32(&g, &tables);
        let row0 = 3;
        let t = row0 + n;
        let q = randv(&mut r, t * nh * hd, 2.0);
        let dq = g.upload_bf16(&q).unwrap();
        for window in [0usize, 1, 5, 16, 37, 1000] {
            let out = poisoned(&g, t * nh * hd * 2);
            let mut scratch = PrefillScratch::default();
            scratch.score_budget = budget;
            scratch.attn = PrefillAttn::Gemm;
            let seqs = [LongSeq {
                row0,
                n,
                start,
                seq: 1,
            }];
            scratch
                .run(
                    &g,
                    &d,
                    &pool,
                    layer,
                    &dq,
                    &out,
                    t,
                    dtab.ptr(),
                    max_blocks,
                    &seqs,
                    window,
                )
                .unwrap();
            let got = g.download_bf16(&out, t * nh * hd).unwrap();
            let row = nh * hd;
            assert!(
                got[..row0 * row].iter().all(|x| x.is_nan()),
                "rows before row0 untouched"
            );
            let mut want = Vec::new();
            for ti in 0..n {
                let pos = start + ti;
                let lo = if window > 0 {
                    (pos + 1).saturating_sub(window)
                } else {
                    0
                };
                for h in 0..nh {
                    let kh = h / (nh / nkv);
                    let (mut keys, mut vals) = (vec![], vec![]);
                    for p in lo..=pos {
                        let blk = tables[max_blocks + p / bs] as usize;
                        let k0 = pool_idx(&d, layer, blk, 0, p % bs, kh);
                        let v0 = pool_idx(&d, layer, blk, 1, p % bs, kh);
                        keys.push(pool_h[k0..k0 + hd].to_vec());
                        vals.push(pool_h[v0..v0 + hd].to_vec());
                    }
                    let qq = &q[((row0 + ti) * nh + h) * hd..((row0 + ti) * nh + h + 1) * hd];
                    want.extend(attend(qq, &keys, &vals));
                }
            }
            let e = rel_err(&got[row0 * row..], &want);
            assert!(
                e < 1e-2,
                "nh={nh} nkv={nkv} hd={hd} start={start} n={n} window={window}: rel err {e}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn kv_gather_scatter_round_trip() {
    let g = gpu();
    let mut r = rng("kv_copy");
    let (layers, nb, lb) = (4usize, 10usize, 2 * 16 * 2 * 64 * 2);
    let pool_h: Vec<u8> = (0..layers * nb * lb).map(|_| r.random()).collect();
    let pool = g.alloc(pool_h.len()).unwrap();
    g.upload(&pool, 0, &pool_h).unwrap();
    let blocks = [7i32, 2, 9];
    let dblocks = up_i32(&g, &blocks);
    let staging = poisoned(&g, 3 * blocks.len() * lb);
    ops::kv_copy(&g, true, &pool, &staging, dblocks.ptr(), 3, 1, 3, nb, lb).unwrap();
    let mut got = vec![0u8; 3 * blocks.len() * lb];
    g.download(&mut got, &staging, 0).unwrap();
    for l in 0..3 {
        for (bi, &b) in blocks.iter().enumerate() {
            let src = ((1 + l) * nb + b as usize) * lb;
            let dst = (l * blocks.len() + bi) * lb;
            assert_eq!(
                got[dst..dst + lb],
                pool_h[src..src + lb],
                "layer {l} block {b}"
            );
        }
    }
    // scatter into other blocks of a poisoned pool, read back
    let pool2 = poisoned(&g, pool_h.len());
    let other = up_i32(&g, &[0, 5, 3]);
    ops::kv_copy(&g, false, &pool2, &staging, other.ptr(), 3, 1, 3, nb, lb).unwrap();
    let mut p2 = vec![0u8; pool_h.len()];
    g.download(&mut p2, &pool2, 0).unwrap();
    for l in 0..3 {
        for (bi, &b) in [0usize, 5, 3].iter().enumerate() {
            let dst = ((1 + l) * nb + b) * lb;
            let src = (l * blocks.len() + bi) * lb;
            assert_eq!(p2[dst..dst + lb], got[src..src + lb]);
        }
    }
    assert!(
        p2[..nb * lb].iter().all(|&x| x == 0xFF),
        "layer 0 untouched"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn launch_wrappers_reject_undersized_buffers() {
    let g = gpu();
    let small = g.alloc(64).unwrap();
    let big = g.alloc(1 << 16).unwrap();
    assert!(ops::swiglu(&g, &small, &big, 4, 64).is_err());
    assert!(ops::fill_f32(&g, &small, 17, 0.0).is_err());
    assert!(ops::embed_gather(&g, &big, 1000, big.ptr(), 1, &small, 64).is_err());
}
