//! The stream-K wgmma decode GEMM (`gemm_skinny_n16/_n32/_n64`, kernels/gemm_skinny.cu) against a
//! host reference: token counts 1-64 (partial column tiles), rows not a multiple of 128, inputs
//! not a multiple of 64, whole and split tiles, every output mode, stage counts down to 1, 1, 2
//! and 4 input boxes a stage;
//! bitwise deterministic; tickets left at 0 (back-to-back calls stay right); shapes it cannot take
//! are typed errors. Part of the `cuda_kernels` test binary; prints one PASS/FAIL line a case.

use super::cuda_support::*;
use super::{gpu, poisoned};
use pdnode_cuda::blas::OutType;
use pdnode_cuda::ops;

#[test]
#[ignore = "needs a CUDA GPU (sm_90): run scripts/gpu/run-all.sh on the GPU host"]
fn gemm_skinny_matches_reference() {
    let g = gpu();
    if !ops::skinny_available(&g) {
        println!("SKIP gemm_skinny: needs compute capability 9.0");
        return;
    }
    let scratch = ops::SkinnyScratch::new(&g).unwrap();
    let mut r = rng("skinny");
    // (out, tokens, inp, stages, 64-input boxes a stage): 0 stages is the most that fit
    let cases: [(usize, usize, usize, usize, usize); 14] = [
        (200, 9, 64, 0, 1),
        (77, 16, 2056, 0, 2),
        (300, 17, 200, 2, 1),
        (130, 33, 64, 0, 4),
        (1000, 64, 136, 1, 1),
        (129, 1, 8, 0, 1),
        (4250, 48, 264, 3, 2),
        (6144, 32, 4096, 0, 1),
        (4096, 64, 14336, 0, 2),
        (4096, 16, 4096, 0, 4),
        (28672, 24, 4096, 0, 1),
        (513, 40, 1032, 5, 1),
        (6144, 64, 4096, 0, 4),
        (300, 20, 456, 2, 2),
    ];
    for (out, t, inp, stages, kboxes) in cases {
        let tune = ops::SkinnyTune {
            stages,
            kboxes,
            l2_256: kboxes == 2,
        };
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
        let worst = |got: &[f32], want: &[f32]| {
            got.iter()
                .zip(want)
                .map(|(a, b)| {
                    if a.is_finite() {
                        (a - b).abs()
                    } else {
                        f32::INFINITY
                    }
                })
                .fold(0f32, f32::max)
        };
        let plan = ops::skinny_plan(g.sm_count as usize, out, t, inp, tune).unwrap();
        // bf16 y (one token row past t poisoned: never written)
        let yb = poisoned(&g, (t + 1) * out * 2);
        ops::gemm_skinny(
            &g,
            &scratch,
            out,
            t,
            inp,
            &dw,
            &dx,
            &yb,
            OutType::Bf16,
            false,
            tune,
        )
        .unwrap();
        let all = g.download_bf16(&yb, (t + 1) * out).unwrap();
        let (got, past) = all.split_at(t * out);
        let (e, m) = (rel_err(got, &dot), worst(got, &dot));
        let untouched = past.iter().all(|v| v.is_nan());
        let ok = e < 1e-2 && m <= 1e-2 * scale + 1e-3 && untouched;
        println!(
            "{} gemm_skinny bf16 out={out} t={t} in={inp} {plan:?}: rel {e:.1e} max abs {m:.2e} (scale {scale:.1}), row past t untouched {untouched}",
            if ok { "PASS" } else { "FAIL" }
        );
        assert!(
            ok,
            "bf16 {out}x{t}x{inp}: rel {e}, max abs {m}, untouched {untouched}"
        );
        // f32 y += (twice in a row: the second must add once more, tickets back at 0), then the
        // same into a fresh y for the bits
        let yf = g.upload_f32(&y0).unwrap();
        for rep in 1..=2 {
            ops::gemm_skinny(
                &g,
                &scratch,
                out,
                t,
                inp,
                &dw,
                &dx,
                &yf,
                OutType::F32,
                true,
                tune,
            )
            .unwrap();
            let got = g.download_f32(&yf, t * out).unwrap();
            let want: Vec<f32> = dot
                .iter()
                .zip(&y0)
                .map(|(d, y)| y + rep as f32 * d)
                .collect();
            let (e, m) = (rel_err(&got, &want), worst(&got, &want));
            let ok = e < 1e-4 && m <= 1e-4 * scale * rep as f32 + 1e-3;
            println!(
                "{} gemm_skinny f32+= #{rep} out={out} t={t} in={inp}: rel {e:.1e} max abs {m:.2e}",
                if ok { "PASS" } else { "FAIL" }
            );
            assert!(ok, "f32 += #{rep} {out}x{t}x{inp}: rel {e}, max abs {m}");
        }
        let (ya, yb2) = (poisoned(&g, t * out * 4), poisoned(&g, t * out * 4));
        for y in [&ya, &yb2] {
            ops::gemm_skinny(
                &g,
                &scratch,
                out,
                t,
                inp,
                &dw,
                &dx,
                y,
                OutType::F32,
                false,
                tune,
            )
            .unwrap();
        }
        let (a, b) = (
            g.download_f32(&ya, t * out).unwrap(),
            g.download_f32(&yb2, t * out).unwrap(),
        );
        let e = rel_err(&a, &dot);
        assert!(e < 1e-4, "f32 {out}x{t}x{inp}: rel {e}");
        assert!(
            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
            "gemm_skinny not deterministic at {out}x{t}x{inp}"
        );
    }
    // what the kernel cannot take is a typed error, never a launch
    let (w, x, y) = (
        g.alloc(1 << 20).unwrap(),
        g.alloc(1 << 20).unwrap(),
        g.alloc(1 << 20).unwrap(),
    );
    for (out, t, inp) in [(64, 65, 64), (64, 4, 60)] {
        let res = ops::gemm_skinny(
            &g,
            &scratch,
            out,
            t,
            inp,
            &w,
            &x,
            &y,
            OutType::F32,
            false,
            ops::SkinnyTune::default(),
        );
        assert!(res.is_err(), "gemm_skinny accepted {out}x{t}x{inp}");
    }
    let short = g.alloc(16).unwrap();
    let res = ops::gemm_skinny(
        &g,
        &scratch,
        64,
        4,
        64,
        &w,
        &x,
        &short,
        OutType::F32,
        false,
        ops::SkinnyTune::default(),
    );
    assert!(res.is_err(), "gemm_skinny wrote past a short y");
    println!("PASS gemm_skinny rejects 65 tokens, inp % 8 != 0, a short y");
}
