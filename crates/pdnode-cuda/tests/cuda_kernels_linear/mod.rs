//! The fused gate_up + SwiGLU GEMV (`gemv_mma_glu_m1[_pf]`, kernels/gemv.cu) against the unfused
//! path it replaces (the same tensor-core launch on the `2 inter x inp` weight, then the swiglu
//! kernel) and against a host reference; `linear`'s measured Auto table against cuBLAS; the
//! cuBLAS GEMM itself against a host reference.
//! Part of the `cuda_kernels` test binary; prints one PASS/FAIL line a case.

use super::cuda_support::*;
use super::{gpu, poisoned};
use pdnode_cuda::blas::{OutType, gemm};
use pdnode_cuda::blaslt::{BlasLt, LtPlan, Problem};
use pdnode_cuda::ops::{self, Fusion, LinearImpl};

/// bf16 bits of a value downloaded as f32 (exact: the f32 came from a bf16).
fn bits(v: f32) -> i32 {
    (v.to_bits() >> 16) as i32
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gate_up_swiglu_fused_matches_unfused() {
    let g = gpu();
    let mut r = rng("glu");
    let sms = g.sm_count as usize;
    let mut cases: Vec<(usize, usize, usize)> = Vec::new();
    for t in 1..=8 {
        for &(inter, inp) in &[(200, 64), (13, 2056), (1000, 264), (8 * sms + 3, 512)] {
            cases.push((inter, t, inp));
        }
    }
    cases.extend([(14336, 1, 4096), (14336, 2, 4096)]);
    for (inter, t, inp) in cases {
        let w = randv(&mut r, 2 * inter * inp, 0.1);
        let x = randv(&mut r, t * inp, 1.0);
        let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
        // the usual launch with and without the L2 hint, and 8- and 12-warp blocks
        // (Fusion::glu_warps; 8 the default)
        for (pf, warps) in [(true, 0), (false, 0), (true, 8), (true, 12)] {
            let l = ops::MmaLaunch {
                l2_prefetch: pf,
                ..ops::glu_launch_warps(sms, inter, inp, warps)
            };
            // unfused: the same launch on the whole gate|up weight, then swiglu
            let gu = poisoned(&g, t * 2 * inter * 2);
            ops::gemv_mma(
                &g,
                l,
                2 * inter,
                t,
                inp,
                &dw,
                &dx,
                &gu,
                OutType::Bf16,
                false,
            )
            .unwrap();
            let want = poisoned(&g, t * inter * 2);
            ops::swiglu(&g, &gu, &want, t, inter).unwrap();
            let want = g.download_bf16(&want, t * inter).unwrap();
            let gu_host = g.download_bf16(&gu, t * 2 * inter).unwrap();
            let act = poisoned(&g, t * inter * 2);
            ops::gemv_mma_swiglu(&g, l, inter, t, inp, &dw, &dx, &act).unwrap();
            let got = g.download_bf16(&act, t * inter).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            let max_ulp = got
                .iter()
                .zip(&want)
                .map(|(a, b)| {
                    if a.is_finite() {
                        (bits(*a) - bits(*b)).abs()
                    } else {
                        i32::MAX
                    }
                })
                .max()
                .unwrap_or(0);
            // host: silu(gate) * up from the unfused gate_up output (so only the fusion is tested)
            let host: Vec<f32> = (0..t * inter)
                .map(|k| {
                    let (tt, i) = (k / inter, k % inter);
                    let (a, b) = (
                        gu_host[tt * 2 * inter + i] as f64,
                        gu_host[tt * 2 * inter + inter + i] as f64,
                    );
                    (a / (1.0 + (-a).exp()) * b) as f32
                })
                .collect();
            let e = rel_err(&got, &host);
            let n = t * inter;
            let ok = max_ulp <= 1 && same * 100 >= n * 99 && e < 1e-2;
            println!(
                "{} gemv_mma_swiglu inter={inter} t={t} in={inp} pf={pf} {l:?}: {same}/{n} bit-equal to unfused, max {max_ulp} ulp, rel vs host {e:.1e}",
                if ok { "PASS" } else { "FAIL" }
            );
            assert!(
                ok,
                "fused swiglu {inter}x{t}x{inp} pf={pf}: {same}/{n} equal, {max_ulp} ulp, rel {e}"
            );
        }
        // the decode step's entry point: fused (Auto, t <= 2 by default) or not, both against
        // cuBLAS + swiglu
        let gu = poisoned(&g, t * 2 * inter * 2);
        let (a, b) = (poisoned(&g, t * inter * 2), poisoned(&g, t * inter * 2));
        for (how, out) in [(LinearImpl::Auto, &a), (LinearImpl::Cublas, &b)] {
            ops::gate_up_swiglu(
                &g,
                inter,
                t,
                inp,
                &dw,
                &dx,
                &gu,
                out,
                how,
                Fusion::default(),
            )
            .unwrap();
        }
        let (a, b) = (
            g.download_bf16(&a, t * inter).unwrap(),
            g.download_bf16(&b, t * inter).unwrap(),
        );
        let e = rel_err(&a, &b);
        let fused = ops::swiglu_fused(LinearImpl::Auto, t, Fusion::default());
        println!(
            "{} gate_up_swiglu Auto (fused {fused}) vs cuBLAS inter={inter} t={t} in={inp}: rel {e:.1e}",
            if e < 2e-2 { "PASS" } else { "FAIL" }
        );
        assert!(e < 2e-2, "gate_up_swiglu {inter}x{t}x{inp}: rel {e}");
    }
    // what the kernel cannot take is a typed error, never a launch
    let (w, x, y) = (
        g.alloc(1 << 16).unwrap(),
        g.alloc(1 << 16).unwrap(),
        g.alloc(1 << 16).unwrap(),
    );
    let l = ops::glu_launch(sms, 64, 64);
    assert!(ops::gemv_mma_swiglu(&g, l, 64, 9, 64, &w, &x, &y).is_err());
    assert!(ops::gemv_mma_swiglu(&g, l, 64, 1, 60, &w, &x, &y).is_err());
    let short = ops::MmaLaunch { blocks: 7, ..l };
    assert!(ops::gemv_mma_swiglu(&g, short, 64, 1, 64, &w, &x, &y).is_err());
    let tall = ops::MmaLaunch { tiles: 2, ..l };
    assert!(ops::gemv_mma_swiglu(&g, tall, 64, 1, 64, &w, &x, &y).is_err());
    assert!(ops::gemv_mma_swiglu(&g, l, 8192, 1, 64, &w, &x, &y).is_err());
    println!("PASS gemv_mma_swiglu rejects 9 tokens, inp % 8 != 0, short grids, m2, small buffers");
}

/// `linear` under Auto (the measured per-shape table: L2-prefetch GEMV, cuBLAS for the MLP
/// up-projection class) against cuBLAS at the Llama-3.1-8B shapes, f32 and accumulate.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn linear_auto_table_matches_cublas() {
    let g = gpu();
    let mut r = rng("linear_table");
    let sms = g.sm_count as usize;
    for &(out, inp) in &[
        (6144, 4096),
        (4096, 4096),
        (4096, 14336),
        (3584, 1024),
        (28672, 1024),
        (40000, 256),
    ] {
        let w = randv(&mut r, out * inp, 0.1);
        let dw = g.upload_bf16(&w).unwrap();
        for t in [1, 2, 3, 4, 8, 9] {
            let x = randv(&mut r, t * inp, 1.0);
            let dx = g.upload_bf16(&x).unwrap();
            let y0 = randv(&mut r, t * out, 1.0);
            let (ya, yb) = (g.upload_f32(&y0).unwrap(), g.upload_f32(&y0).unwrap());
            for (how, y) in [(LinearImpl::Auto, &ya), (LinearImpl::Cublas, &yb)] {
                ops::linear(&g, out, t, inp, &dw, &dx, y, OutType::F32, true, how).unwrap();
            }
            let (a, b) = (
                g.download_f32(&ya, t * out).unwrap(),
                g.download_f32(&yb, t * out).unwrap(),
            );
            let e = rel_err(&a, &b);
            let l = ops::table_launch(sms, out, t, inp);
            println!(
                "{} linear Auto {out}x{inp} t={t} ({}): rel vs cuBLAS {e:.1e}",
                if e < 1e-3 { "PASS" } else { "FAIL" },
                l.map_or("cuBLAS".to_string(), |l| format!("{l:?}"))
            );
            assert!(e < 1e-3, "Auto {out}x{inp} t={t}: rel {e}");
        }
    }
}

/// The tensor-core GEMV with the next RMSNorm in its launch (`gemv_mma_m1[_pf]_norm`) against the
/// same launch of the plain kernel followed by `add_rmsnorm`: the residual bit for bit, the
/// normed rows within 1 bf16 ulp (the same sums: expected equal), the ticket back at 0, twice
/// in a row (the second launch needs the reset).
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn linear_rmsnorm_fused_matches_unfused() {
    let g = gpu();
    let mut r = rng("linear_norm");
    let sms = g.sm_count as usize;
    let ticket = g.alloc(256).unwrap();
    g.memset(&ticket, 0).unwrap();
    let eps = 1e-5f32;
    let mut cases: Vec<(usize, usize, usize)> = Vec::new();
    for t in 1..=8 {
        for &(out, inp) in &[(200, 64), (4096, 1032), (77, 2056)] {
            cases.push((out, t, inp));
        }
    }
    cases.extend([(4096, 1, 4096), (4096, 2, 14336)]);
    for (out, t, inp) in cases {
        let w = randv(&mut r, out * inp, 0.05);
        let x = randv(&mut r, t * inp, 1.0);
        let y0 = randv(&mut r, t * out, 1.0);
        let nw: Vec<f32> = randv(&mut r, out, 1.0).iter().map(|v| v + 1.0).collect();
        let (dw, dx, dnw) = (
            g.upload_bf16(&w).unwrap(),
            g.upload_bf16(&x).unwrap(),
            g.upload_f32(&nw).unwrap(),
        );
        for (pf, acc) in [(true, true), (false, true), (true, false)] {
            let base = ops::table_launch(sms, out, t, inp)
                .filter(|l| l.tiles == 1)
                .unwrap_or_else(|| ops::mma_launch_tiles(sms, out, inp, 1));
            let l = ops::MmaLaunch {
                l2_prefetch: pf,
                warps: base.warps.min(ops::NORM_MAX_WARPS),
                ..base
            };
            // unfused: the plain kernel at the same launch, then add_rmsnorm
            let y_ref = g.upload_f32(&y0).unwrap();
            ops::gemv_mma(&g, l, out, t, inp, &dw, &dx, &y_ref, OutType::F32, acc).unwrap();
            let n_ref = poisoned(&g, t * out * 2);
            ops::add_rmsnorm(&g, &y_ref, t, None, &dnw, &n_ref, None, t, out, eps).unwrap();
            let (y_ref, n_ref) = (
                g.download_f32(&y_ref, t * out).unwrap(),
                g.download_bf16(&n_ref, t * out).unwrap(),
            );
            for round in 0..2 {
                let y = g.upload_f32(&y0).unwrap();
                let normed = poisoned(&g, t * out * 2);
                let nf = ops::NormFuse {
                    w: &dnw,
                    out: &normed,
                    ticket: &ticket,
                    eps,
                };
                ops::gemv_mma_norm(&g, l, out, t, inp, &dw, &dx, &y, acc, &nf).unwrap();
                let (yv, nv) = (
                    g.download_f32(&y, t * out).unwrap(),
                    g.download_bf16(&normed, t * out).unwrap(),
                );
                let tk = g.download_f32(&ticket, 1).unwrap()[0].to_bits();
                let y_same = yv
                    .iter()
                    .zip(&y_ref)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                let max_ulp = nv
                    .iter()
                    .zip(&n_ref)
                    .map(|(a, b)| {
                        if a.is_finite() {
                            (bits(*a) - bits(*b)).abs()
                        } else {
                            i32::MAX
                        }
                    })
                    .max()
                    .unwrap_or(0);
                let n_same = nv
                    .iter()
                    .zip(&n_ref)
                    .filter(|(a, b)| a.to_bits() == b.to_bits())
                    .count();
                let ok = y_same && max_ulp <= 1 && tk == 0;
                println!(
                    "{} gemv_mma_norm out={out} t={t} in={inp} pf={pf} acc={acc} round {round} {l:?}: residual bit-equal {y_same}, normed {n_same}/{} bit-equal (max {max_ulp} ulp), ticket {tk}",
                    if ok { "PASS" } else { "FAIL" },
                    t * out
                );
                assert!(
                    ok,
                    "fused norm {out}x{t}x{inp} pf={pf} acc={acc} round {round}"
                );
            }
        }
        // linear_rmsnorm (the decode step's call): fused under Auto at <= 2 tokens by default
        let y = g.upload_f32(&y0).unwrap();
        let normed = poisoned(&g, t * out * 2);
        let nf = ops::NormFuse {
            w: &dnw,
            out: &normed,
            ticket: &ticket,
            eps,
        };
        let fused = ops::linear_rmsnorm(
            &g,
            out,
            t,
            inp,
            &dw,
            &dx,
            &y,
            true,
            LinearImpl::Auto,
            Fusion::default(),
            Some(&nf),
        )
        .unwrap();
        let expect = ops::norm_fuse_launch(
            sms,
            out,
            t,
            inp,
            &dw,
            &dx,
            LinearImpl::Auto,
            Fusion::default(),
        )
        .is_some();
        if !fused {
            ops::add_rmsnorm(&g, &y, t, None, &dnw, &normed, None, t, out, eps).unwrap();
        }
        let got = g.download_bf16(&normed, t * out).unwrap();
        let yh = g.download_f32(&y, t * out).unwrap();
        let host: Vec<f32> = yh
            .chunks(out)
            .flat_map(|row| super::cuda_support::rmsnorm(row, &nw, eps))
            .collect();
        let e = rel_err(&got, &host);
        let ok = fused == expect && e < 1e-2;
        println!(
            "{} linear_rmsnorm Auto out={out} t={t} in={inp}: fused {fused}, rel vs host {e:.1e}",
            if ok { "PASS" } else { "FAIL" }
        );
        assert!(ok, "linear_rmsnorm {out}x{t}x{inp}: fused {fused}, rel {e}");
    }
    let (w, x, y) = (
        g.alloc(1 << 16).unwrap(),
        g.alloc(1 << 16).unwrap(),
        g.alloc(1 << 16).unwrap(),
    );
    let nf = ops::NormFuse {
        w: &y,
        out: &x,
        ticket: &ticket,
        eps,
    };
    let l = ops::mma_launch_tiles(sms, 64, 64, 1);
    let wide = ops::MmaLaunch { warps: 16, ..l };
    assert!(ops::gemv_mma_norm(&g, wide, 64, 1, 64, &w, &x, &y, false, &nf).is_err());
    assert!(ops::gemv_mma_norm(&g, l, 64, 9, 64, &w, &x, &y, false, &nf).is_err());
    assert!(ops::gemv_mma_norm(&g, l, 64, 0, 64, &w, &x, &y, false, &nf).is_err());
    println!("PASS gemv_mma_norm rejects 16 warps, 9 and 0 tokens");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn gemm_bf16_matches_reference_both_output_types() {
    let g = gpu();
    let mut r = rng("gemm");
    for &(out, t, inp) in &[(96, 1, 64), (333, 7, 200), (1024, 64, 512)] {
        let w = randv(&mut r, out * inp, 1.0);
        let x = randv(&mut r, t * inp, 1.0);
        let y0 = randv(&mut r, t * out, 1.0);
        let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
        let reference = |beta: f32| host_linear(&w, &x, &y0, beta, out, t, inp);
        // SAFETY (both calls): w, x and y sized for the shapes passed.
        let run = |y: u64, ty: OutType, beta: f32| unsafe {
            gemm(&g.blas, out, t, inp, dw.ptr(), dx.ptr(), y, ty, beta).unwrap()
        };
        // bf16 out, beta 0, poisoned output
        let yb = poisoned(&g, t * out * 2);
        run(yb.ptr(), OutType::Bf16, 0.0);
        let got = g.download_bf16(&yb, t * out).unwrap();
        let e = rel_err(&got, &reference(0.0));
        assert!(e < 1e-2, "bf16 gemm {out}x{t}x{inp}: rel err {e}");
        // f32 out accumulating into y (the fused residual add)
        let yf = g.upload_f32(&y0).unwrap();
        run(yf.ptr(), OutType::F32, 1.0);
        let got = g.download_f32(&yf, t * out).unwrap();
        let e = rel_err(&got, &reference(1.0));
        assert!(e < 1e-3, "f32 gemm {out}x{t}x{inp}: rel err {e}");
    }
}

/// `y[t, o] = beta * y0[t, o] + sum_i x[t, i] * w[o, i]` on the host (f32).
fn host_linear(
    w: &[f32],
    x: &[f32],
    y0: &[f32],
    beta: f32,
    out: usize,
    t: usize,
    inp: usize,
) -> Vec<f32> {
    (0..t * out)
        .map(|k| {
            let (ti, o) = (k / out, k % out);
            let s: f32 = (0..inp).map(|i| w[o * inp + i] * x[ti * inp + i]).sum();
            s + beta * y0[k]
        })
        .collect()
}

/// Every cuBLASLt heuristic candidate (up to 16) against the host reference: bf16 output with
/// beta 0 into a poisoned buffer, f32 output accumulating into y (the residual add), at decode
/// and prefill-like row counts.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn cublaslt_every_candidate_matches_reference() {
    let g = gpu();
    g.bind().unwrap();
    let lt = BlasLt::new(&g.stream).unwrap();
    let mut r = rng("cublaslt");
    for &(out, t, inp) in &[
        (96, 1, 64),
        (1024, 16, 512),
        (2048, 48, 1024),
        (768, 64, 2048),
        (512, 200, 256),
    ] {
        let w = randv(&mut r, out * inp, 1.0);
        let x = randv(&mut r, t * inp, 1.0);
        let y0 = randv(&mut r, t * out, 1.0);
        let (dw, dx) = (g.upload_bf16(&w).unwrap(), g.upload_bf16(&x).unwrap());
        for (ty, beta) in [(OutType::Bf16, 0.0f32), (OutType::F32, 1.0)] {
            let want = host_linear(&w, &x, &y0, beta, out, t, inp);
            let plan = LtPlan::new(out, t, inp, ty).unwrap();
            let algos = lt.heuristics(&plan, 16).unwrap();
            assert!(
                !algos.is_empty(),
                "no cuBLASLt algo for {out}x{t}x{inp} {ty:?}"
            );
            for (i, a) in algos.iter().enumerate() {
                let c = a.config().unwrap();
                let y = match ty {
                    OutType::Bf16 => poisoned(&g, t * out * 2),
                    OutType::F32 => g.upload_f32(&y0).unwrap(),
                };
                // SAFETY: w, x and y sized for the plan's shape and output type.
                unsafe { lt.matmul(&plan, a, dw.ptr(), dx.ptr(), y.ptr(), beta) }.unwrap();
                let got = match ty {
                    OutType::Bf16 => g.download_bf16(&y, t * out).unwrap(),
                    OutType::F32 => g.download_f32(&y, t * out).unwrap(),
                };
                let e = rel_err(&got, &want);
                let tol = if ty == OutType::Bf16 { 1e-2 } else { 1e-3 };
                println!(
                    "{} cublasLt {out}x{t}x{inp} {ty:?} beta={beta} #{i} {c:?}: rel vs host {e:.1e}",
                    if e < tol { "PASS" } else { "FAIL" }
                );
                assert!(
                    e < tol,
                    "cublasLt {out}x{t}x{inp} {ty:?} #{i} {c:?}: rel {e}"
                );
            }
        }
    }
}

/// `linear` under Auto where [`ops::lt_pick`] names a cuBLASLt candidate (the Llama-3.1-8B
/// shapes at 48, 64, 96 and 128 rows) against `cublasGemmEx` (LinearImpl::Cublas) on the same
/// inputs, f32 outputs accumulating into y as the decode step does; on an H200 (sm_90, 132
/// SMs) the candidate must be among the heuristic's, else the table is stale.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn linear_auto_cublaslt_picks_match_gemmex() {
    let g = gpu();
    let mut r = rng("linear_lt");
    let h200 = g.compute_capability == (9, 0) && g.sm_count == 132;
    let cases = [
        (6144, 4096, OutType::Bf16),
        (4096, 4096, OutType::F32),
        (28672, 4096, OutType::Bf16),
        (4096, 14336, OutType::F32),
    ];
    for &(out, inp, ty) in &cases {
        let w = randv(&mut r, out * inp, 0.05);
        let dw = g.upload_bf16(&w).unwrap();
        for t in [16, 32, 48, 64, 96, 128] {
            let x = randv(&mut r, t * inp, 1.0);
            let dx = g.upload_bf16(&x).unwrap();
            let acc = ty == OutType::F32;
            let y0 = randv(&mut r, t * out, 1.0);
            let mk = || match ty {
                OutType::F32 => g.upload_f32(&y0).unwrap(),
                OutType::Bf16 => poisoned(&g, t * out * 2),
            };
            let (ya, yb) = (mk(), mk());
            for (how, y) in [(LinearImpl::Auto, &ya), (LinearImpl::Cublas, &yb)] {
                ops::linear(&g, out, t, inp, &dw, &dx, y, ty, acc, how).unwrap();
            }
            let get = |y| match ty {
                OutType::F32 => g.download_f32(y, t * out).unwrap(),
                OutType::Bf16 => g.download_bf16(y, t * out).unwrap(),
            };
            let e = rel_err(&get(&ya), &get(&yb));
            let pick = ops::lt_pick(out, t, inp, ty);
            let p = Problem {
                out,
                tokens: t,
                inp,
                ty,
            };
            let found = g.blas.lt().and_then(|lt| lt.found(p));
            let ok = e < 1e-3 && (pick.is_none() || !h200 || found == Some(true));
            println!(
                "{} linear Auto {out}x{inp} t={t} {ty:?}: cuBLASLt pick {pick:?} found {found:?}, rel vs GemmEx {e:.1e}",
                if ok { "PASS" } else { "FAIL" }
            );
            assert!(
                ok,
                "Auto {out}x{inp} t={t}: pick {pick:?} found {found:?} rel {e}"
            );
        }
    }
}
