//! Fused flash prefill attention (kernels/prefill_flash*.cu: v3, its fallback w8 with 8 warps of
//! 16 query rows, and the wgmma kernel; plus the wgmma descriptor probe) against an f32 host
//! reference: head_dim 64 and 128, GQA 1 / 4 / 8, 1 to 1000 new tokens, with and without a
//! cached prefix (chunked prefill), block sizes 16, 32, 64 and 24, two sequences in one call; and
//! against the cuBLAS path at Llama-3.1-8B shapes; sliding windows on every implementation
//! (cuBLAS, w8, v3, wgmma). Part of the `cuda_kernels` test binary (scripts/gpu/run-all.sh
//! kernels);
//! prints one PASS/FAIL line a case.

use super::cuda_support::*;
use super::{gpu, poisoned, pool_dims, pool_idx, up_i32};
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::AttnDims;
use pdnode_cuda::prefill::{LongSeq, PrefillAttn, PrefillScratch};
use rand::seq::SliceRandom;

/// f32 reference of causal attention for the new tokens of one sequence: rows `row0 .. row0 + n`
/// of `q` `[T, nh, hd]` at positions `start ..`, K/V from layer `layer` of `pool_h` through the
/// block table `tab`; position `p` sees keys `max(0, p + 1 - window) ..= p` (window 0: from 0).
/// Returns `[n, nh, hd]`.
#[allow(clippy::too_many_arguments)]
fn ref_prefill(
    d: &AttnDims,
    pool_h: &[f32],
    layer: usize,
    tab: &[i32],
    q: &[f32],
    row0: usize,
    n: usize,
    start: usize,
    window: usize,
) -> Vec<f32> {
    let (nh, nkv, hd, bs) = (d.num_heads, d.num_kv_heads, d.head_dim, d.block_size);
    let e = start + n;
    // contiguous K/V per kv head: [nkv][e][hd]
    let (mut k, mut v) = (vec![0f32; nkv * e * hd], vec![0f32; nkv * e * hd]);
    for kh in 0..nkv {
        for p in 0..e {
            let blk = tab[p / bs] as usize;
            let k0 = pool_idx(d, layer, blk, 0, p % bs, kh);
            let v0 = pool_idx(d, layer, blk, 1, p % bs, kh);
            let dst = (kh * e + p) * hd;
            k[dst..dst + hd].copy_from_slice(&pool_h[k0..k0 + hd]);
            v[dst..dst + hd].copy_from_slice(&pool_h[v0..v0 + hd]);
        }
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * nh * hd];
    let mut s = vec![0f32; e];
    for ti in 0..n {
        let len = start + ti + 1;
        let lo = if window > 0 {
            len.saturating_sub(window)
        } else {
            0
        };
        for h in 0..nh {
            let kh = h / (nh / nkv);
            let qq = &q[((row0 + ti) * nh + h) * hd..((row0 + ti) * nh + h + 1) * hd];
            let mut m = f32::NEG_INFINITY;
            for (p, sp) in s[..len].iter_mut().enumerate().skip(lo) {
                let kk = &k[(kh * e + p) * hd..(kh * e + p + 1) * hd];
                *sp = qq.iter().zip(kk).map(|(a, b)| a * b).sum::<f32>() * scale;
                m = m.max(*sp);
            }
            let mut l = 0f32;
            let o = &mut out[(ti * nh + h) * hd..(ti * nh + h + 1) * hd];
            for (p, sp) in s[..len].iter().enumerate().skip(lo) {
                let w = (sp - m).exp();
                l += w;
                let vv = &v[(kh * e + p) * hd..(kh * e + p + 1) * hd];
                for (od, vd) in o.iter_mut().zip(vv) {
                    *od += w * vd;
                }
            }
            o.iter_mut().for_each(|x| *x /= l);
        }
    }
    out
}

/// One prefill-attention call over `seqs` (`(start, n)` each, packed from row 2 on) with the
/// given implementation and sliding window (0: none); returns the whole output `[T, nh, hd]` (poisoned with NaN first).
#[allow(clippy::too_many_arguments)]
fn run_prefill_attn(
    g: &Gpu,
    d: &AttnDims,
    pool: &DevBuf,
    layer: usize,
    dq: &DevBuf,
    t: usize,
    dtab: &DevBuf,
    max_blocks: usize,
    seqs: &[LongSeq],
    (attn, plain): Variant,
    window: usize,
) -> Vec<f32> {
    let out = poisoned(g, t * d.num_heads * d.head_dim * 2);
    let scratch = &mut PrefillScratch::new(attn);
    scratch.wg_plain = plain;
    // on an sm_90 device a head_dim 128 / power-of-two block case must really take the wgmma
    // kernel asked for (a fallback to flashv3 would pass every comparison)
    let hopper_case =
        g.compute_capability == (9, 0) && d.head_dim == 128 && d.block_size.is_power_of_two();
    assert_eq!(
        scratch.wgmma_runs(g, d),
        attn == PrefillAttn::Wgmma && hopper_case,
        "{attn:?} on {d:?}"
    );
    assert_eq!(
        scratch.wg_specialized_runs(g, d),
        !plain && attn == PrefillAttn::Wgmma && hopper_case && d.block_size >= 8,
        "{attn:?} (plain kernel asked: {plain}) on {d:?}"
    );
    scratch
        .run(
            g,
            d,
            pool,
            layer,
            dq,
            &out,
            t,
            dtab.ptr(),
            max_blocks,
            seqs,
            window,
        )
        .unwrap();
    g.download_bf16(&out, t * d.num_heads * d.head_dim).unwrap()
}

/// NaN in the K and V rows of each sequence's last block past its context (`sq`: (start, new
/// tokens) per sequence, its blocks at row `i` of `tables`): what an earlier owner of the block
/// may have left there, which no kernel may let reach the output.
fn nan_past_context(
    pool_h: &mut [f32],
    d: &AttnDims,
    layer: usize,
    tables: &[i32],
    max_blocks: usize,
    sq: &[(usize, usize)],
) {
    let (bs, row) = (d.block_size, d.num_kv_heads * d.head_dim);
    for (i, &(start, n)) in sq.iter().enumerate() {
        let (ctx, last) = (start + n, (start + n - 1) / bs);
        let blk = tables[i * max_blocks + last] as usize;
        for kv in 0..2 {
            for slot in ctx - last * bs..bs {
                let at = pool_idx(d, layer, blk, kv, slot, 0);
                pool_h[at..at + row].fill(f32::NAN);
            }
        }
    }
}

/// An implementation and whether `Wgmma` is asked for its plain kernel where the
/// warp-specialized one fits (`PrefillScratch::wg_plain`).
type Variant = (PrefillAttn, bool);

/// Every implementation (`Wgmma` with the warp-specialized kernel where it fits), and `Wgmma`
/// once more with the plain kernel.
fn all_variants() -> impl Iterator<Item = Variant> {
    let each = PrefillAttn::ALL.into_iter().map(|a| (a, false));
    each.chain([(PrefillAttn::Wgmma, true)])
}

/// The flash implementations the tests compare; on a compute capability 9.0 device the wgmma
/// kernels must be loaded (else `Wgmma` would quietly test flashv3).
fn flash_variants(g: &Gpu) -> Vec<Variant> {
    if g.compute_capability == (9, 0) {
        for k in pdnode_kernels::WGMMA_KERNEL_NAMES {
            assert!(g.has_kernel(k), "{k} not loaded on an sm_90 device");
        }
    }
    all_variants()
        .filter(|(a, _)| *a != PrefillAttn::Gemm)
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn wgmma_descriptors_match_host_products() {
    let g = gpu();
    if g.compute_capability != (9, 0) {
        println!(
            "SKIP wgmma probe: compute capability {:?}",
            g.compute_capability
        );
        return;
    }
    let mut r = rng("wgmma_probe");
    let ints = |r: &mut _, n: usize| -> Vec<f32> {
        randv(r, n, 1.0).iter().map(|x| (x * 4.0).round()).collect()
    };
    let a = ints(&mut r, 64 * 128);
    let b = ints(&mut r, 128 * 128);
    let (da, db) = (g.upload_bf16(&a).unwrap(), g.upload_bf16(&b).unwrap());
    let mut want1 = vec![0f32; 64 * 128];
    let mut want2 = vec![0f32; 64 * 128];
    for i in 0..64 {
        for j in 0..128 {
            want1[i * 128 + j] = (0..128).map(|k| a[i * 128 + k] * b[j * 128 + k]).sum();
            want2[i * 128 + j] = (0..128).map(|k| a[i * 128 + k] * b[k * 128 + j]).sum();
        }
    }
    let f = g.kernel("wgmma_probe").unwrap();
    let smem = 1024 + 2 * 32768;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        .unwrap();
    let mut matched = Vec::new();
    let mut s_wrong = None;
    // (a K-major reading of the MN-major tile with the offsets swapped reads past shared memory
    // and faults the context: not tried)
    for (lbo, sbo, trans) in [
        (16384u32, 1024u32, 1i32),
        (1024, 16384, 1),
        (16384, 1024, 0),
    ] {
        let (c1, c2) = (poisoned(&g, 64 * 128 * 4), poisoned(&g, 64 * 128 * 4));
        let mut lb = g.launch_builder(f);
        lb.arg(da.ptr_ref())
            .arg(db.ptr_ref())
            .arg(c1.ptr_ref())
            .arg(c2.ptr_ref())
            .arg(&lbo)
            .arg(&sbo)
            .arg(&trans);
        let lc = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        unsafe { lb.launch(lc) }.unwrap();
        let got1 = g.download_f32(&c1, 64 * 128).unwrap();
        let got2 = g.download_f32(&c2, 64 * 128).unwrap();
        let ok1 = got1 == want1;
        let ok2 = got2 == want2;
        println!(
            "{} wgmma probe lbo={lbo} sbo={sbo} trans={trans}: S (K-major) {}, PV (MN-major) {}",
            if ok1 && ok2 { "MATCH" } else { "-----" },
            if ok1 { "exact" } else { "wrong" },
            if ok2 { "exact" } else { "wrong" },
        );
        if !ok1 {
            s_wrong = Some(format!(
                "first values {:?} want {:?}",
                &got1[..4],
                &want1[..4]
            ));
        }
        if ok2 {
            matched.push((lbo, sbo, trans));
        }
    }
    assert!(s_wrong.is_none(), "K-major a b^T wrong: {s_wrong:?}");
    assert_eq!(
        matched,
        [(16384, 1024, 1)],
        "exactly the kernel's MN-major descriptor must match (the others are the probe's controls)"
    );
    println!("PASS wgmma descriptors: {matched:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn prefill_flash_attention_matches_reference() {
    let g = gpu();
    let mut r = rng("prefill_flash");
    // (nh, nkv, hd, block size, per sequence (start, new tokens)); GQA nh / nkv = 1, 4, 8
    type Case = (usize, usize, usize, usize, Vec<(usize, usize)>);
    let cases: Vec<Case> = vec![
        (4, 4, 64, 16, vec![(0, 1)]),
        (2, 2, 128, 16, vec![(63, 1)]),
        (8, 2, 128, 32, vec![(0, 17)]),
        (8, 1, 64, 16, vec![(5, 64)]),
        (16, 2, 128, 32, vec![(0, 64)]),
        (8, 8, 128, 16, vec![(0, 129)]),
        (8, 2, 128, 32, vec![(300, 129), (0, 64)]),
        (8, 2, 64, 16, vec![(1000, 17), (3, 1)]),
        (8, 1, 128, 16, vec![(0, 1000)]),
        (4, 1, 64, 32, vec![(77, 1000)]),
        // a 64-key block per tile; a block size that is no power of two (v2 falls back to w8)
        (8, 2, 128, 64, vec![(100, 300)]),
        (4, 1, 128, 24, vec![(10, 100)]),
        // 32 blocks a 128-key tile (the warp-specialized kernel's most), 16, and a block
        // longer than a tile
        (8, 2, 128, 4, vec![(3, 200)]),
        (4, 2, 128, 8, vec![(0, 130)]),
        (4, 1, 128, 256, vec![(100, 300)]),
    ];
    let mut worst = 0f32;
    for (nh, nkv, hd, bs, sq) in cases {
        let max_blocks = sq.iter().map(|(s, n)| s + n).max().unwrap().div_ceil(bs);
        let nb = sq.len() * max_blocks + 5;
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let layer = 1;
        let mut pool_h = randv(&mut r, 2 * d.layer_elems(), 1.0);
        let mut ids: Vec<i32> = (0..nb as i32).collect();
        ids.shuffle(&mut r);
        let tables: Vec<i32> = ids[..sq.len() * max_blocks].to_vec();
        nan_past_context(&mut pool_h, &d, layer, &tables, max_blocks, &sq);
        let pool = g.upload_bf16(&pool_h).unwrap();
        let dtab = up_i32(&g, &tables);
        let mut seqs = Vec::new();
        let mut row = 2;
        for (i, &(start, n)) in sq.iter().enumerate() {
            seqs.push(LongSeq {
                row0: row,
                n,
                start,
                seq: i,
            });
            row += n;
        }
        let t = row + 1; // one unused row after the last sequence
        let q = randv(&mut r, t * nh * hd, 2.0);
        let dq = g.upload_bf16(&q).unwrap();
        let rowl = nh * hd;
        let wants: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| {
                let tab = &tables[s.seq * max_blocks..(s.seq + 1) * max_blocks];
                ref_prefill(&d, &pool_h, layer, tab, &q, s.row0, s.n, s.start, 0)
            })
            .collect();
        for attn in flash_variants(&g) {
            let got = run_prefill_attn(
                &g, &d, &pool, layer, &dq, t, &dtab, max_blocks, &seqs, attn, 0,
            );
            let untouched = got[..2 * rowl].iter().chain(&got[(t - 1) * rowl..]);
            assert!(
                untouched.into_iter().all(|x| x.is_nan()),
                "{attn:?}: rows outside the sequences written"
            );
            for (s, want) in seqs.iter().zip(&wants) {
                let have = &got[s.row0 * rowl..(s.row0 + s.n) * rowl];
                let e = rel_err(have, want);
                // the worst single (row, head), so one wrong row in a long sequence shows
                let mut e_row = 0f32;
                for (a, b) in have.chunks(hd).zip(want.chunks(hd)) {
                    e_row = e_row.max(rel_err(a, b));
                }
                let ok = e < 1e-2 && e_row < 3e-2;
                println!(
                    "{} flash prefill {attn:?} nh={nh} nkv={nkv} hd={hd} bs={bs} start={} n={}: \
                     rel err {e:.2e}, worst row {e_row:.2e}",
                    if ok { "PASS" } else { "FAIL" },
                    s.start,
                    s.n
                );
                assert!(ok, "{attn:?} {s:?}: rel err {e}, worst row {e_row}");
                worst = worst.max(e);
            }
        }
    }
    println!("PASS flash prefill vs f32 reference: worst rel err {worst:.2e}");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn prefill_flash_attention_matches_gemm_path_at_llama_shapes() {
    let g = gpu();
    let mut r = rng("prefill_flash_gemm");
    // Llama-3.1-8B attention shape; a whole 2k prompt, and an 600-token chunk after 1500 cached
    for &(start, n) in &[(0usize, 2048usize), (1500, 600)] {
        let (nh, nkv, hd, bs) = (32, 8, 128, 16);
        let max_blocks = (start + n).div_ceil(bs);
        let nb = max_blocks + 3;
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let pool_h = randv(&mut r, d.layer_elems(), 1.0);
        let pool = g.upload_bf16(&pool_h).unwrap();
        let mut ids: Vec<i32> = (0..nb as i32).collect();
        ids.shuffle(&mut r);
        let dtab = up_i32(&g, &ids[..max_blocks]);
        let t = n;
        let q = randv(&mut r, t * nh * hd, 2.0);
        let dq = g.upload_bf16(&q).unwrap();
        let seqs = [LongSeq {
            row0: 0,
            n,
            start,
            seq: 0,
        }];
        let run = |a| run_prefill_attn(&g, &d, &pool, 0, &dq, t, &dtab, max_blocks, &seqs, a, 0);
        let want = run((PrefillAttn::Gemm, false));
        for attn in flash_variants(&g) {
            let e = rel_err(&run(attn), &want);
            println!(
                "{} flash prefill {attn:?} vs cuBLAS path, nh=32 nkv=8 hd=128 start={start} \
                 n={n}: rel err {e:.2e}",
                if e < 1e-2 { "PASS" } else { "FAIL" }
            );
            assert!(e < 1e-2, "{attn:?} start={start} n={n}: rel err {e}");
        }
    }
}

/// Sliding windows on every prefill implementation (cuBLAS, w8, v3) against the f32 reference:
/// windows smaller than a block (1, 5), of a block (16), not a multiple of the block size or of
/// the 64-key tile (37, 100), spanning a few tiles (200), and longer than every context (5000);
/// with and without a cached prefix, a CTA of 128 queries whose windows start in different
/// tiles, block sizes 16, 32 and 24 (v3 falls back to w8), two sequences in one call.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn prefill_attention_windows_match_reference() {
    let g = gpu();
    let mut r = rng("prefill_window");
    // (nh, nkv, hd, block size, per sequence (start, new tokens))
    type Case = (usize, usize, usize, usize, Vec<(usize, usize)>);
    let cases: Vec<Case> = vec![
        (8, 2, 128, 16, vec![(0, 300)]),
        (4, 1, 64, 32, vec![(500, 129), (0, 70)]),
        (8, 8, 128, 16, vec![(1000, 17)]),
        (4, 2, 128, 24, vec![(10, 200)]),
        (6, 3, 64, 16, vec![(33, 40)]),
    ];
    let mut worst = 0f32;
    for (nh, nkv, hd, bs, sq) in cases {
        let max_blocks = sq.iter().map(|(s, n)| s + n).max().unwrap().div_ceil(bs);
        let nb = sq.len() * max_blocks + 5;
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let layer = 1;
        let mut pool_h = randv(&mut r, 2 * d.layer_elems(), 1.0);
        let mut ids: Vec<i32> = (0..nb as i32).collect();
        ids.shuffle(&mut r);
        let tables: Vec<i32> = ids[..sq.len() * max_blocks].to_vec();
        nan_past_context(&mut pool_h, &d, layer, &tables, max_blocks, &sq);
        let pool = g.upload_bf16(&pool_h).unwrap();
        let dtab = up_i32(&g, &tables);
        let mut seqs = Vec::new();
        let mut row = 2;
        for (i, &(start, n)) in sq.iter().enumerate() {
            seqs.push(LongSeq {
                row0: row,
                n,
                start,
                seq: i,
            });
            row += n;
        }
        let t = row + 1;
        let q = randv(&mut r, t * nh * hd, 2.0);
        let dq = g.upload_bf16(&q).unwrap();
        let rowl = nh * hd;
        for window in [1usize, 5, 16, 37, 100, 200, 5000] {
            let wants: Vec<Vec<f32>> = seqs
                .iter()
                .map(|s| {
                    let tab = &tables[s.seq * max_blocks..(s.seq + 1) * max_blocks];
                    ref_prefill(&d, &pool_h, layer, tab, &q, s.row0, s.n, s.start, window)
                })
                .collect();
            for attn in all_variants() {
                let got = run_prefill_attn(
                    &g, &d, &pool, layer, &dq, t, &dtab, max_blocks, &seqs, attn, window,
                );
                for (s, want) in seqs.iter().zip(&wants) {
                    let have = &got[s.row0 * rowl..(s.row0 + s.n) * rowl];
                    let e = rel_err(have, want);
                    let mut e_row = 0f32;
                    for (a, b) in have.chunks(hd).zip(want.chunks(hd)) {
                        e_row = e_row.max(rel_err(a, b));
                    }
                    let ok = e < 1e-2 && e_row < 3e-2;
                    println!(
                        "{} prefill {attn:?} window={window} nh={nh} nkv={nkv} hd={hd} bs={bs} \
                         start={} n={}: rel err {e:.2e}, worst row {e_row:.2e}",
                        if ok { "PASS" } else { "FAIL" },
                        s.start,
                        s.n
                    );
                    assert!(
                        ok,
                        "{attn:?} window={window} {s:?}: rel err {e}, worst row {e_row}"
                    );
                    worst = worst.max(e);
                }
            }
        }
    }
    println!("PASS windowed prefill vs f32 reference: worst rel err {worst:.2e}");
}
