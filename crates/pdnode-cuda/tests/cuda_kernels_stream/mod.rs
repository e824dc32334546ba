//! The streaming decode GEMV (`gemv_stream_t*`, kernels/gemv_stream.cu): every output mode at
//! 1-4 tokens against a host f64 reference (Llama-3.1-8B's four decode shapes and odd ones), the
//! in-kernel RMSNorm bit for bit against `add_rmsnorm_v4` + the same GEMV, and the shapes it
//! refuses. Part of the `cuda_kernels` test binary; prints one PASS/FAIL line a case.

use super::cuda_support::*;
use super::{gpu, poisoned};
use pdnode_cuda::ops::{self, EwKernel, StreamOut, StreamTune, StreamX};

/// `f(x W^T)` in f64 per the mode (Glu: silu(bf16(g)) * bf16(u)), plus `y0` where accumulating.
fn host_stream(
    w: &[f32],
    x: &[f32],
    y0: &[f32],
    units: usize,
    t: usize,
    inp: usize,
    out: StreamOut,
) -> Vec<f32> {
    let dot = |row: usize, ti: usize| -> f64 {
        (0..inp)
            .map(|i| w[row * inp + i] as f64 * x[ti * inp + i] as f64)
            .sum()
    };
    (0..t * units)
        .map(|k| {
            let (ti, u) = (k / units, k % units);
            match out {
                StreamOut::Bf16 | StreamOut::F32 => dot(u, ti) as f32,
                StreamOut::F32Acc => (dot(u, ti) + y0[k] as f64) as f32,
                StreamOut::Glu => {
                    let (g, up) = (
                        bf16r(dot(u, ti) as f32) as f64,
                        bf16r(dot(u + units, ti) as f32) as f64,
                    );
                    (g / (1.0 + (-g).exp()) * up) as f32
                }
            }
        })
        .collect()
}

fn is_bf16(out: StreamOut) -> bool {
    matches!(out, StreamOut::Bf16 | StreamOut::Glu)
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gemv_stream_matches_reference() {
    let g = gpu();
    if !ops::stream_available(&g) {
        println!("SKIP gemv_stream: no sm_90 program on this GPU");
        return;
    }
    let mut r = rng("gemv_stream");
    let sms = g.sm_count as usize;
    let shapes = [
        (6144, 4096, StreamOut::Bf16),
        (4096, 4096, StreamOut::F32Acc),
        (14336, 4096, StreamOut::Glu),
        (4096, 14336, StreamOut::F32Acc),
        (37, 264, StreamOut::F32),
        (200, 64, StreamOut::Glu),
        (7, 2056, StreamOut::Bf16),
        (2 * sms + 5, 512, StreamOut::F32Acc),
    ];
    // the launch knobs: the most shared memory, half (two blocks an SM), L2 prefetch ahead
    let half = StreamTune {
        smem_cap: 113 << 10,
        l2_ahead: 0,
    };
    let ahead = StreamTune {
        smem_cap: 0,
        l2_ahead: 8,
    };
    let tunes = [StreamTune::default(), half, ahead];
    for t in 1..=ops::STREAM_MAX_TOKENS {
        for &(units, inp, out) in &shapes {
            let rows = if out == StreamOut::Glu {
                2 * units
            } else {
                units
            };
            let w = randv(&mut r, rows * inp, 0.1);
            let x = randv(&mut r, t * inp, 1.0);
            let y0 = randv(&mut r, t * units, 1.0);
            let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
            let want = host_stream(&w, &x, &y0, units, t, inp, out);
            for tune in tunes {
                let cap = tune.smem_cap;
                let plan = ops::stream_plan(sms, units, t, inp, out, cap);
                let Some(plan) = plan else {
                    // only 2-4 tokens of x at 14336 wide under the half cap leave no 2 stages
                    assert!(
                        inp == 14336 && t >= 2 && cap == 113 << 10,
                        "no plan: {units}x{inp} t={t} cap {cap}"
                    );
                    let y = poisoned(&g, t * units * 4);
                    let e =
                        ops::gemv_stream(&g, units, t, inp, &dw, StreamX::Bf16(&dx), &y, out, tune);
                    assert!(
                        matches!(e, Err(pdnode_cuda::CudaError::Shape { .. })),
                        "{e:?}"
                    );
                    println!(
                        "PASS gemv_stream {units}x{inp} t={t} cap {cap}: no plan, a shape error"
                    );
                    continue;
                };
                let y = if out == StreamOut::F32Acc {
                    g.upload_f32(&y0).unwrap()
                } else {
                    // NaN bits in both widths: an unwritten output fails
                    poisoned(&g, t * units * if is_bf16(out) { 2 } else { 4 })
                };
                ops::gemv_stream(&g, units, t, inp, &dw, StreamX::Bf16(&dx), &y, out, tune)
                    .unwrap();
                let got = if is_bf16(out) {
                    g.download_bf16(&y, t * units).unwrap()
                } else {
                    g.download_f32(&y, t * units).unwrap()
                };
                let e = rel_err(&got, &want);
                // f32 sums of bf16 products (f64 reference); bf16 outputs round once (Glu: 3 times)
                let tol = if is_bf16(out) { 1e-2 } else { 1e-5 };
                let ok = e < tol;
                println!(
                    "{} gemv_stream {units}x{inp} t={t} {out:?} {tune:?} {plan:?}: rel err {e:.1e}",
                    if ok { "PASS" } else { "FAIL" }
                );
                assert!(
                    ok,
                    "gemv_stream {units}x{inp} t={t} {out:?} cap {cap}: rel err {e}"
                );
            }
        }
    }
    // what it refuses: a shape error before any launch
    let (w, x, y) = (
        poisoned(&g, 64 * 64 * 2),
        poisoned(&g, 5 * 64 * 2),
        poisoned(&g, 5 * 64 * 4),
    );
    let cases: [(usize, usize, &str); 3] =
        [(5, 64, "5 tokens"), (1, 60, "inp % 8"), (0, 64, "0 tokens")];
    for (t, inp, what) in cases {
        let e = ops::gemv_stream(
            &g,
            64,
            t,
            inp,
            &w,
            StreamX::Bf16(&x),
            &y,
            StreamOut::F32,
            StreamTune::default(),
        );
        assert!(
            matches!(e, Err(pdnode_cuda::CudaError::Shape { .. })),
            "{what}: {e:?}"
        );
    }
    let small = poisoned(&g, 16);
    let e = ops::gemv_stream(
        &g,
        64,
        1,
        64,
        &w,
        StreamX::Bf16(&x),
        &small,
        StreamOut::F32,
        StreamTune::default(),
    );
    assert!(
        matches!(e, Err(pdnode_cuda::CudaError::Shape { .. })),
        "short y: {e:?}"
    );
    println!("PASS gemv_stream refuses 5 tokens, inp % 8 != 0, 0 tokens and a short y");
}

/// The norm computed in the kernel is add_rmsnorm_v4's: with the same residual and norm weight,
/// `gemv_stream(Norm)` equals `add_rmsnorm_v4` then `gemv_stream(Bf16)` bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gemv_stream_norm_matches_add_rmsnorm() {
    let g = gpu();
    if !ops::stream_available(&g) {
        println!("SKIP gemv_stream norm: no sm_90 program on this GPU");
        return;
    }
    let mut r = rng("gemv_stream_norm");
    let eps = 1e-5f32;
    for t in 1..=ops::STREAM_MAX_TOKENS {
        for &(units, inp, out) in &[
            (6144, 4096, StreamOut::Bf16),
            (14336, 4096, StreamOut::Glu),
            (300, 8192, StreamOut::F32),
            (90, 1000, StreamOut::Glu),
            (50, 264, StreamOut::Bf16),
        ] {
            let rows = if out == StreamOut::Glu {
                2 * units
            } else {
                units
            };
            let w = randv(&mut r, rows * inp, 0.1);
            let resid: Vec<f32> = randv(&mut r, t * inp, 3.0);
            let nw: Vec<f32> = randv(&mut r, inp, 1.0).iter().map(|v| 1.0 + v).collect();
            let dw = g.upload_bf16(&w).unwrap();
            let (dr, dn) = (g.upload_f32(&resid).unwrap(), g.upload_f32(&nw).unwrap());
            let normed = poisoned(&g, t * inp * 2);
            let k = ops::add_rmsnorm_with(
                &g,
                &dr,
                t,
                None,
                &dn,
                &normed,
                None,
                t,
                inp,
                eps,
                Some(EwKernel::Vector),
            )
            .unwrap();
            assert_eq!(k, EwKernel::Vector);
            let yb = if is_bf16(out) { 2 } else { 4 };
            let (want, got) = (poisoned(&g, t * units * yb), poisoned(&g, t * units * yb));
            ops::gemv_stream(
                &g,
                units,
                t,
                inp,
                &dw,
                StreamX::Bf16(&normed),
                &want,
                out,
                StreamTune::default(),
            )
            .unwrap();
            let x = StreamX::Norm {
                resid: &dr,
                w: &dn,
                eps,
            };
            ops::gemv_stream(&g, units, t, inp, &dw, x, &got, out, StreamTune::default()).unwrap();
            let n = t * units * yb;
            let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
            g.download(&mut a, &got, 0).unwrap();
            g.download(&mut b, &want, 0).unwrap();
            let differ = a
                .chunks(yb)
                .zip(b.chunks(yb))
                .filter(|(x, y)| x != y)
                .count();
            // and the result is right, not merely equal: against the host from the normed x
            let xh = g.download_bf16(&normed, t * inp).unwrap();
            let host = host_stream(&w, &xh, &[], units, t, inp, out);
            let gv = if is_bf16(out) {
                g.download_bf16(&got, t * units).unwrap()
            } else {
                g.download_f32(&got, t * units).unwrap()
            };
            let e = rel_err(&gv, &host);
            let ok = differ == 0 && e < 1e-2;
            println!(
                "{} gemv_stream norm {units}x{inp} t={t} {out:?}: {differ} of {} outputs differ from add_rmsnorm_v4 + gemv_stream, rel err vs host {e:.1e}",
                if ok { "PASS" } else { "FAIL" },
                t * units
            );
            assert!(
                ok,
                "norm {units}x{inp} t={t} {out:?}: {differ} differ, rel {e}"
            );
        }
    }
}
