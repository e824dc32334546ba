//! The vectorized elementwise kernels of prefill (`swiglu_v8`, `add_rmsnorm_v4`, kernels/
//! elementwise.cu) and their scalar fallbacks (`swiglu`, `add_rmsnorm`): each against a host
//! reference on fresh random inputs, outputs poisoned with NaN first, with the kernel the wrapper
//! picked checked (vector where the shape allows it, scalar where it does not); the vector swiglu
//! bit-identical to the scalar one. Part of the `cuda_kernels` test binary; prints PASS lines.

use super::cuda_support::*;
use super::{gpu, poisoned, up_i32};
use pdnode_cuda::CudaError;
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, EwKernel};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const EPS: f32 = 1e-5;

fn download_bits(g: &Gpu, b: &DevBuf, n: usize) -> Vec<u16> {
    let mut v = vec![0u16; n];
    g.download(&mut v, b, 0).unwrap();
    v
}

fn swiglu_ref(gu: &[f32], t: usize, inter: usize) -> Vec<f32> {
    (0..t * inter)
        .map(|k| {
            let (tt, ii) = (k / inter, k % inter);
            let (a, b) = (gu[tt * 2 * inter + ii], gu[tt * 2 * inter + inter + ii]);
            a / (1.0 + (-a).exp()) * b
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn swiglu_vector_and_fallback_match_reference() {
    let g = gpu();
    let mut r = rng("swiglu_v8");
    // (tokens, inter, kernel the wrapper must pick): exact blocks, a partial last block, inter
    // % 8 != 0, one word a row, more rows than grid y holds (the row loop)
    let cases = [
        (7, 1000, EwKernel::Vector),
        (3, 14336, EwKernel::Vector),
        (33, 2056, EwKernel::Vector),
        (1, 8, EwKernel::Vector),
        (70_001, 16, EwKernel::Vector),
        (5, 1004, EwKernel::Scalar),
        (4, 13, EwKernel::Scalar),
    ];
    for (t, inter, want_k) in cases {
        let gu = randv(&mut r, t * 2 * inter, 4.0);
        let dgu = g.upload_bf16(&gu).unwrap();
        let out = poisoned(&g, t * inter * 2);
        let k = ops::swiglu_with(&g, &dgu, &out, t, inter, None).unwrap();
        assert_eq!(k, want_k, "t={t} inter={inter}: kernel picked");
        let got = g.download_bf16(&out, t * inter).unwrap();
        let e = rel_err(&got, &swiglu_ref(&gu, t, inter));
        let ok = e < 5e-3;
        println!(
            "{} swiglu {k:?} t={t} inter={inter}: rel err vs host {e:.1e}",
            if ok { "PASS" } else { "FAIL" }
        );
        assert!(ok, "swiglu {k:?} t={t} inter={inter}: rel err {e}");
    }
    // the vector kernel asked for where it cannot run is a shape error, nothing launched
    let (dgu, out) = (
        g.alloc(5 * 2 * 1004 * 2).unwrap(),
        g.alloc(5 * 1004 * 2).unwrap(),
    );
    let e = ops::swiglu_with(&g, &dgu, &out, 5, 1004, Some(EwKernel::Vector));
    assert!(
        matches!(e, Err(CudaError::Shape { op: "swiglu", .. })),
        "{e:?}"
    );
    // forced scalar runs the scalar kernel where the vector one could
    let k = ops::swiglu_with(&g, &dgu, &out, 5, 1000, Some(EwKernel::Scalar)).unwrap();
    assert_eq!(k, EwKernel::Scalar);
    g.sync().unwrap();
    println!("PASS swiglu: Vector forced on inter 1004 is a shape error");
}

/// Random bf16 bit patterns: every second row any 16 bits (NaN, infinities, subnormals, huge
/// values whose exp overflows), the others ordinary values in [-12, 12).
fn random_bits(r: &mut ChaCha8Rng, t: usize, row: usize) -> Vec<u16> {
    (0..t * row)
        .map(|k| {
            if (k / row).is_multiple_of(2) {
                r.random::<u16>()
            } else {
                half::bf16::from_f32(r.random_range(-12.0f32..12.0)).to_bits()
            }
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn swiglu_vector_bit_identical_to_scalar() {
    let g = gpu();
    let mut r = rng("swiglu_bits");
    for (t, inter) in [(64, 14336), (9, 7168), (17, 2056), (70_001, 8)] {
        let bits = random_bits(&mut r, t, 2 * inter);
        let dgu = g.alloc(bits.len() * 2).unwrap();
        g.upload(&dgu, 0, &bits).unwrap();
        // the scalar output poisoned with 0xFFFF, the vector one twice, with 0xFFFF and 0x5A5A:
        // an element the vector kernel skips cannot match the scalar one in both runs (NaN
        // payloads may be legitimate outputs here, so the poison alone proves nothing)
        let (a, b) = (poisoned(&g, t * inter * 2), poisoned(&g, t * inter * 2));
        let c = g.alloc(t * inter * 2).unwrap();
        g.memset(&c, 0x5A).unwrap();
        let ka = ops::swiglu_with(&g, &dgu, &a, t, inter, Some(EwKernel::Scalar)).unwrap();
        let kb = ops::swiglu_with(&g, &dgu, &b, t, inter, Some(EwKernel::Vector)).unwrap();
        let kc = ops::swiglu_with(&g, &dgu, &c, t, inter, Some(EwKernel::Vector)).unwrap();
        assert_eq!(
            (ka, kb, kc),
            (EwKernel::Scalar, EwKernel::Vector, EwKernel::Vector)
        );
        let n = t * inter;
        let (sa, sb, sc) = (
            download_bits(&g, &a, n),
            download_bits(&g, &b, n),
            download_bits(&g, &c, n),
        );
        let same = (0..n).filter(|&i| sa[i] == sb[i] && sa[i] == sc[i]).count();
        let first_diff = (0..n).find(|&i| sa[i] != sb[i] || sa[i] != sc[i]);
        let nan = sa
            .iter()
            .filter(|&&x| x & 0x7F80 == 0x7F80 && x & 0x7F != 0)
            .count();
        let ok = same == n;
        println!(
            "{} swiglu_v8 vs swiglu t={t} inter={inter}: {same}/{n} bit-identical ({nan} NaN \
             outputs among them){}",
            if ok { "PASS" } else { "FAIL" },
            first_diff.map_or(String::new(), |i| format!(
                ", first diff at {i}: {:#06x} vs {:#06x} / {:#06x}",
                sa[i], sb[i], sc[i]
            ))
        );
        assert!(ok, "t={t} inter={inter}: {same}/{n} bit-identical");
    }
}

/// rmsnorm of `x` (already summed with delta) rows, rounded as the host reference does.
fn norm_rows(x: &[f32], rows: &[usize], h: usize, w: &[f32]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&i| rmsnorm(&x[i * h..(i + 1) * h], w, EPS))
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn add_rmsnorm_vector_and_fallback_match_reference() {
    let g = gpu();
    let mut r = rng("rmsnorm_v4");
    // (hidden, kernel the wrapper must pick): the 8B model, a partial last word group (160
    // threads), tiny, the longest row a block holds, hidden % 4 != 0, a row too long to hold
    let cases = [
        (4096, EwKernel::Vector),
        (4136, EwKernel::Vector),
        (576, EwKernel::Vector),
        (4, EwKernel::Vector),
        (16384, EwKernel::Vector),
        (32768, EwKernel::Scalar),
        (4098, EwKernel::Scalar),
        (4097, EwKernel::Scalar),
        (32772, EwKernel::Scalar),
    ];
    let t = 6;
    for (h, want_k) in cases {
        let x = randv(&mut r, t * h, 3.0);
        let delta = randv(&mut r, t * h, 1.0);
        let w = randv(&mut r, h, 1.0);
        let dw = g.upload_f32(&w).unwrap();
        let all: Vec<usize> = (0..t).collect();
        // delta on, every row: resid rows become x + delta exactly, out their norm
        let (dx, dd) = (g.upload_f32(&x).unwrap(), g.upload_f32(&delta).unwrap());
        let out = poisoned(&g, t * h * 2);
        let k =
            ops::add_rmsnorm_with(&g, &dx, t, Some(&dd), &dw, &out, None, t, h, EPS, None).unwrap();
        assert_eq!(k, want_k, "hidden {h}: kernel picked");
        let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
        let e1 = rel_err(
            &g.download_bf16(&out, t * h).unwrap(),
            &norm_rows(&sum, &all, h, &w),
        );
        let resid = g.download_f32(&dx, t * h).unwrap();
        let resid_exact = resid == sum;
        // delta off, rows 4, 1, 4 (a row twice): resid untouched, out rows in that order
        let sel = [4usize, 1, 4];
        let rows = up_i32(&g, &[4, 1, 4]);
        let out2 = poisoned(&g, sel.len() * h * 2);
        let k2 = ops::add_rmsnorm_with(
            &g,
            &dx,
            t,
            None,
            &dw,
            &out2,
            Some(rows.ptr()),
            sel.len(),
            h,
            EPS,
            None,
        )
        .unwrap();
        let e2 = rel_err(
            &g.download_bf16(&out2, sel.len() * h).unwrap(),
            &norm_rows(&sum, &sel, h, &w),
        );
        let untouched = g.download_f32(&dx, t * h).unwrap() == sum;
        // delta on with rows 3, 0: only those resid rows change
        let (dx3, dd3) = (g.upload_f32(&x).unwrap(), g.upload_f32(&delta).unwrap());
        let rows3 = up_i32(&g, &[3, 0]);
        let out3 = poisoned(&g, 2 * h * 2);
        ops::add_rmsnorm_with(
            &g,
            &dx3,
            t,
            Some(&dd3),
            &dw,
            &out3,
            Some(rows3.ptr()),
            2,
            h,
            EPS,
            None,
        )
        .unwrap();
        let e3 = rel_err(
            &g.download_bf16(&out3, 2 * h).unwrap(),
            &norm_rows(&sum, &[3, 0], h, &w),
        );
        let r3 = g.download_f32(&dx3, t * h).unwrap();
        let rows_ok = (0..t).all(|i| {
            let want = if i == 3 || i == 0 { &sum } else { &x };
            r3[i * h..(i + 1) * h] == want[i * h..(i + 1) * h]
        });
        let ok = k2 == want_k
            && e1 < 5e-3
            && e2 < 5e-3
            && e3 < 5e-3
            && resid_exact
            && untouched
            && rows_ok;
        println!(
            "{} add_rmsnorm {k:?} hidden={h}: rel err delta {e1:.1e}, rows w/o delta {e2:.1e}, \
             rows with delta {e3:.1e}; resid += delta exact {resid_exact}, untouched w/o delta \
             {untouched}, only selected rows updated {rows_ok}",
            if ok { "PASS" } else { "FAIL" }
        );
        assert!(ok, "add_rmsnorm hidden {h} ({k:?})");
    }
    // the vector kernel asked for where it cannot run is a shape error
    let (dx, dw, out) = (
        g.alloc(2 * 4098 * 4).unwrap(),
        g.alloc(4098 * 4).unwrap(),
        g.alloc(2 * 4098 * 2).unwrap(),
    );
    let e = ops::add_rmsnorm_with(
        &g,
        &dx,
        2,
        None,
        &dw,
        &out,
        None,
        2,
        4098,
        EPS,
        Some(EwKernel::Vector),
    );
    assert!(
        matches!(
            e,
            Err(CudaError::Shape {
                op: "add_rmsnorm",
                ..
            })
        ),
        "{e:?}"
    );
    println!("PASS add_rmsnorm: Vector forced on hidden 4098 is a shape error");
}

/// bf16 bits (sign and magnitude) as an integer whose differences count ulps across zero.
fn ordered(x: u16) -> i32 {
    let m = (x & 0x7fff) as i32;
    if x & 0x8000 != 0 { -m } else { m }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn add_rmsnorm_vector_agrees_with_scalar() {
    let g = gpu();
    let mut r = rng("rmsnorm_v4_vs_scalar");
    let (t, h) = (64, 4096);
    let x = randv(&mut r, t * h, 3.0);
    let w = randv(&mut r, h, 1.0);
    let (dx, dw) = (g.upload_f32(&x).unwrap(), g.upload_f32(&w).unwrap());
    let (a, b) = (poisoned(&g, t * h * 2), poisoned(&g, t * h * 2));
    for (k, o) in [(EwKernel::Scalar, &a), (EwKernel::Vector, &b)] {
        let got = ops::add_rmsnorm_with(&g, &dx, t, None, &dw, o, None, t, h, EPS, Some(k));
        assert_eq!(got.unwrap(), k);
    }
    let (sa, sb) = (download_bits(&g, &a, t * h), download_bits(&g, &b, t * h));
    let same = sa.iter().zip(&sb).filter(|(x, y)| x == y).count();
    // only the sum order differs: at most one bf16 ulp apart
    let max_ulp = sa
        .iter()
        .zip(&sb)
        .map(|(&x, &y)| (ordered(x) - ordered(y)).unsigned_abs())
        .max()
        .unwrap_or(0);
    let e = rel_err(
        &g.download_bf16(&b, t * h).unwrap(),
        &g.download_bf16(&a, t * h).unwrap(),
    );
    let ok = max_ulp <= 1 && e < 1e-2;
    println!(
        "{} add_rmsnorm_v4 vs add_rmsnorm t={t} hidden={h}: {same}/{} bit-identical, max {max_ulp} \
         ulp apart, rel diff {e:.1e}",
        if ok { "PASS" } else { "FAIL" },
        t * h
    );
    assert!(ok, "max {max_ulp} ulp, rel {e}");
}
