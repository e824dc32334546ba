//! The streaming decode GEMV's two fusions against the launches they replace, bit for bit:
//! the RoPE output (`StreamOut::Rope`: q and the paged pool) against `gemv_stream(Bf16)` +
//! `rope_qkv`, and the combined x (`StreamX::Combine`) against `attention_combine` +
//! `gemv_stream(Bf16 x)`; and the shapes each refuses. Part of the `cuda_kernels` test binary;
//! prints one PASS/FAIL line a case.

use super::cuda_support::*;
use super::{gpu, poisoned, up_i32};
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, AttnDims, AttnWorkspace, StreamOut, StreamRope, StreamTune, StreamX};
use rand::Rng;
use rand::seq::SliceRandom;

fn bytes_of(g: &Gpu, b: &DevBuf, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    g.download(&mut v, b, 0).unwrap();
    v
}

/// Elements of `elem` bytes that differ between `a` and `b`.
fn differing(a: &[u8], b: &[u8], elem: usize) -> usize {
    a.chunks(elem)
        .zip(b.chunks(elem))
        .filter(|(x, y)| x != y)
        .count()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gemv_stream_rope_matches_gemv_then_rope_qkv() {
    let g = gpu();
    if !ops::stream_available(&g) {
        println!("SKIP gemv_stream rope: no sm_90 program on this GPU");
        return;
    }
    let mut r = rng("gemv_stream_rope");
    // (nh, nkv, hd, inp, block size, blocks): Llama-3.1-8B, and odd ones
    let shapes = [
        (32, 8, 128, 4096, 16, 64),
        (4, 2, 64, 264, 8, 8),
        (6, 2, 128, 1000, 16, 4),
    ];
    let tune = StreamTune::default();
    for t in 1..=ops::STREAM_MAX_TOKENS {
        for &(nh, nkv, hd, inp, bs, nb) in &shapes {
            let d = AttnDims {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: bs,
                num_blocks: nb,
            };
            let rows = (nh + 2 * nkv) * hd;
            let w = randv(&mut r, rows * inp, 0.1);
            let x = randv(&mut r, t * inp, 1.0);
            let inv: Vec<f32> = (0..hd / 2)
                .map(|i| 1.0 / 500000f32.powf(2.0 * i as f32 / hd as f32))
                .collect();
            let pos: Vec<i32> = (0..t).map(|_| r.random_range(0..131072)).collect();
            let mut all: Vec<i64> = (0..(nb * bs) as i64).collect();
            all.shuffle(&mut r);
            let slots = &all[..t];
            let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
            let (dinv, dpos) = (g.upload_f32(&inv).unwrap(), up_i32(&g, &pos));
            let dslots = g.alloc(t * 8).unwrap();
            g.upload(&dslots, 0, slots).unwrap();
            // two layers, the second written: the layer offset is the wrapper's
            let pool_bytes = 2 * d.layer_elems() * 2;
            let (pool_a, pool_b) = (poisoned(&g, pool_bytes), poisoned(&g, pool_bytes));
            let q_bytes = t * nh * hd * 2;
            let (q_a, q_b) = (poisoned(&g, q_bytes), poisoned(&g, q_bytes));
            // unfused: the qkv GEMV, then rope_qkv (the scalar kernel decode steps take)
            let qkv = poisoned(&g, t * rows * 2);
            let x_in = StreamX::Bf16(&dx);
            ops::gemv_stream(&g, rows, t, inp, &dw, x_in, &qkv, StreamOut::Bf16, tune).unwrap();
            ops::rope_qkv_ex(
                &g,
                &d,
                &qkv,
                None,
                None,
                None,
                &dinv,
                dpos.ptr(),
                dslots.ptr(),
                t,
                &q_a,
                &pool_a,
                1,
                1e-6,
                ops::RopeKernel::Scalar,
            )
            .unwrap();
            // fused
            let rope = StreamRope::new(&d, &dinv, dpos.ptr(), dslots.ptr(), &pool_b, 1).unwrap();
            let out = StreamOut::Rope(rope);
            ops::gemv_stream(&g, rope.units(), t, inp, &dw, x_in, &q_b, out, tune).unwrap();
            let dq = differing(
                &bytes_of(&g, &q_a, q_bytes),
                &bytes_of(&g, &q_b, q_bytes),
                2,
            );
            let dp = differing(
                &bytes_of(&g, &pool_a, pool_bytes),
                &bytes_of(&g, &pool_b, pool_bytes),
                2,
            );
            // and written: no NaN left in q (the poison is NaN bits)
            let q = g.download_bf16(&q_b, t * nh * hd).unwrap();
            let nan = q.iter().filter(|v| v.is_nan()).count();
            let ok = dq == 0 && dp == 0 && nan == 0;
            println!(
                "{} gemv_stream rope nh={nh} nkv={nkv} hd={hd} inp={inp} t={t}: {dq} q and {dp} pool \
                 elements differ from gemv_stream + rope_qkv, {nan} q unwritten",
                if ok { "PASS" } else { "FAIL" }
            );
            assert!(
                ok,
                "rope nh={nh} hd={hd} t={t}: {dq} q, {dp} pool, {nan} NaN"
            );
        }
    }
    // refused: units that are not the qkv's row pairs, a combined x
    let d = AttnDims {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 8,
        num_blocks: 8,
    };
    let (inv, pos, slots) = (poisoned(&g, 128), poisoned(&g, 4), poisoned(&g, 8));
    let pool = poisoned(&g, d.layer_elems() * 2);
    let rope = StreamRope::new(&d, &inv, pos.ptr(), slots.ptr(), &pool, 0).unwrap();
    assert!(matches!(
        StreamRope::new(&d, &inv, pos.ptr(), slots.ptr(), &pool, 1),
        Err(pdnode_cuda::CudaError::Shape { .. })
    ));
    let (w, x, q) = (
        poisoned(&g, 512 * 64 * 2),
        poisoned(&g, 64 * 2),
        poisoned(&g, 4 * 64 * 2),
    );
    let (ml, acc) = (poisoned(&g, 4 * 2 * 2 * 4), poisoned(&g, 4 * 2 * 16 * 4));
    let combined = StreamX::Combine {
        part_ml: &ml,
        part_acc: &acc,
        nsplit: 2,
        heads: 4,
    };
    let out = StreamOut::Rope(rope);
    for (units, x, what) in [
        (rope.units() - 1, StreamX::Bf16(&x), "units"),
        (rope.units(), combined, "a combined x"),
    ] {
        let e = ops::gemv_stream(&g, units, 1, 64, &w, x, &q, out, tune);
        assert!(
            matches!(e, Err(pdnode_cuda::CudaError::Shape { .. })),
            "{what}: {e:?}"
        );
    }
    println!("PASS gemv_stream rope refuses a layer past the pool, wrong units, a combined x");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gemv_stream_combine_matches_attention_combine() {
    let g = gpu();
    if !ops::stream_available(&g) {
        println!("SKIP gemv_stream combine: no sm_90 program on this GPU");
        return;
    }
    let mut r = rng("gemv_stream_combine");
    let tune = StreamTune::default();
    // (heads, hd, units): Llama-3.1-8B's o projection, and an odd one
    for &(nh, hd, units) in &[(32, 128, 4096), (8, 64, 300)] {
        let inp = nh * hd;
        for t in 1..=ops::STREAM_MAX_TOKENS {
            for ns in [2, 4, 17, 33] {
                let parts = t * nh * ns;
                // every third partition empty (m = -inf, l = 0, acc 0), as past a context
                let mut ml = Vec::with_capacity(parts * 2);
                let mut acc = randv(&mut r, parts * hd, 2.0);
                for p in 0..parts {
                    if p % 3 == 1 {
                        ml.extend([f32::NEG_INFINITY, 0.0]);
                        acc[p * hd..(p + 1) * hd].fill(0.0);
                    } else {
                        ml.extend([r.random_range(-4.0..4.0f32), r.random_range(0.5..3.0f32)]);
                    }
                }
                let (dml, dacc) = (g.upload_f32(&ml).unwrap(), g.upload_f32(&acc).unwrap());
                let w = randv(&mut r, units * inp, 0.1);
                let y0 = randv(&mut r, t * units, 1.0);
                let dw = g.upload_bf16(&w).unwrap();
                let (y_a, y_b) = (g.upload_f32(&y0).unwrap(), g.upload_f32(&y0).unwrap());
                let ws = AttnWorkspace {
                    part_ml: &dml,
                    part_acc: &dacc,
                };
                let attn = poisoned(&g, t * inp * 2);
                ops::attention_combine(&g, nh, hd, ns, None, t, &ws, &attn).unwrap();
                let acc_out = StreamOut::F32Acc;
                let x = StreamX::Bf16(&attn);
                ops::gemv_stream(&g, units, t, inp, &dw, x, &y_a, acc_out, tune).unwrap();
                let x = StreamX::Combine {
                    part_ml: &dml,
                    part_acc: &dacc,
                    nsplit: ns,
                    heads: nh,
                };
                ops::gemv_stream(&g, units, t, inp, &dw, x, &y_b, acc_out, tune).unwrap();
                let n = t * units * 4;
                let (a, b) = (bytes_of(&g, &y_a, n), bytes_of(&g, &y_b, n));
                let differ = differing(&a, &b, 4);
                // and the product ran: y moved off y0
                let got = g.download_f32(&y_b, t * units).unwrap();
                let moved = got.iter().zip(&y0).filter(|(a, b)| a != b).count();
                let ok = differ == 0 && moved > t * units / 2;
                println!(
                    "{} gemv_stream combine nh={nh} hd={hd} units={units} t={t} splits={ns}: {differ} \
                     of {} outputs differ from attention_combine + gemv_stream ({moved} moved)",
                    if ok { "PASS" } else { "FAIL" },
                    t * units
                );
                assert!(
                    ok,
                    "combine nh={nh} t={t} ns={ns}: {differ} differ, {moved} moved"
                );
            }
        }
    }
    // refused: a width that is not heads x hd (multiple of 4), short partials
    let (w, y) = (poisoned(&g, 64 * 256 * 2), poisoned(&g, 64 * 4));
    let (ml, acc) = (poisoned(&g, 4 * 2 * 4), poisoned(&g, 4 * 64 * 4));
    for (heads, nsplit, inp, what) in [
        (3, 1, 256, "256 over 3 heads"),
        (64, 1, 128, "hd 2"),
        (4, 2, 256, "short partials"),
        (4, 0, 256, "0 splits"),
    ] {
        let x = StreamX::Combine {
            part_ml: &ml,
            part_acc: &acc,
            nsplit,
            heads,
        };
        let e = ops::gemv_stream(&g, 64, 1, inp, &w, x, &y, StreamOut::F32Acc, tune);
        assert!(
            matches!(e, Err(pdnode_cuda::CudaError::Shape { .. })),
            "{what}: {e:?}"
        );
    }
    println!("PASS gemv_stream combine refuses widths off heads x hd, short partials, 0 splits");
}
