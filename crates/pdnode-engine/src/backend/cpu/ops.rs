//! f32 kernels of the CPU backend: GEMM against HF-orientation weights (via the `gemm` crate),
//! RMSNorm, RoPE (HF `rotate_half`), SwiGLU. Every function runs on the caller's rayon pool.

use gemm::Parallelism;
use rayon::prelude::*;

/// Below this many rows the GEMM is split by output columns across threads (one single-threaded
/// GEMM per column chunk): gemm's own threading does not split a GEMV.
const SPLIT_N_BELOW_M: usize = 16;

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` (+ `y` when `accumulate`): a linear layer with an HF
/// `[out_features, in_features]` weight.
pub fn matmul_wt(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert!(
        y.len() == m * n && x.len() == m * k && w.len() == n * k,
        "matmul shapes"
    );
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    if m < SPLIT_N_BELOW_M && threads > 1 && n >= 64 * threads {
        // Column chunks (multiples of 16 so every chunk but the last is SIMD-aligned in width).
        let chunk = n.div_ceil(threads * 4).div_ceil(16) * 16;
        let yp = SendPtr(y.as_mut_ptr());
        (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let j0 = c * chunk;
            let nc = chunk.min(n - j0);
            // SAFETY: chunk `c` writes only columns j0..j0+nc of each of the m rows of y (row
            // stride n), disjoint from every other chunk; the reads of x and of rows j0..j0+nc of
            // w are in bounds by the length assertion above; y outlives the parallel loop.
            unsafe {
                gemm::gemm(
                    m,
                    nc,
                    k,
                    yp.get().add(j0),
                    1,
                    n as isize,
                    accumulate,
                    x.as_ptr(),
                    1,
                    k as isize,
                    w.as_ptr().add(j0 * k),
                    k as isize,
                    1,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                )
            }
        });
        return;
    }
    let par = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: dst is m x n with row stride n, lhs m x k with row stride k, rhs k x n read from w
    // (n x k row-major) with column stride k and row stride 1; all in bounds by the assertion.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    /// By method, so closures capture the whole (Send) wrapper rather than the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: used only to hand disjoint column ranges of one buffer to rayon tasks (see matmul_wt).
unsafe impl Send for SendPtr {}
// SAFETY: as above; tasks never touch the same elements.
unsafe impl Sync for SendPtr {}

/// RMSNorm of each `dim`-long row of `x` into `out`: `w * x / sqrt(mean(x²) + eps)` (HF
/// `LlamaRMSNorm`, in f32).
pub fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], dim: usize, eps: f32) {
    out.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .for_each(|(o, r)| rms_norm_row(o, r, w, eps));
}

fn rms_norm_row(o: &mut [f32], r: &[f32], w: &[f32], eps: f32) {
    let ss: f32 = r.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / r.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in o.iter_mut().zip(r).zip(w) {
        *o = g * (v * inv);
    }
}

/// RMSNorm of each `dim`-long piece of `x`, in place (Qwen3's per-head q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], dim: usize, eps: f32) {
    x.par_chunks_mut(dim).for_each(|r| {
        let ss: f32 = r.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / dim as f32 + eps).sqrt();
        for (v, &g) in r.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    });
}

/// Adds `bias` to every `bias.len()`-long row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// cos/sin tables for each position: `[positions][head_dim/2]` each.
pub fn rope_tables(positions: &[usize], inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0f32; positions.len() * half];
    let mut sin = vec![0f32; positions.len() * half];
    for (t, &p) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            // The angle in f32 as HF computes it (position * inv_freq), its cos/sin in f64.
            let a = (p as f32 * f) as f64;
            cos[t * half + i] = a.cos() as f32;
            sin[t * half + i] = a.sin() as f32;
        }
    }
    (cos, sin)
}

/// Applies RoPE (HF `rotate_half` pairing `(i, i + head_dim/2)`) to `x`: `[tokens][heads][head_dim]`.
pub fn rope(x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    x.par_chunks_mut(heads * head_dim)
        .enumerate()
        .for_each(|(t, row)| {
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for h in row.chunks_mut(head_dim) {
                let (a, b) = h.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * c[i] - x2 * s[i];
                    b[i] = x2 * c[i] + x1 * s[i];
                }
            }
        });
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), in place in `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    gate.par_chunks_mut(4096)
        .zip(up.par_chunks(4096))
        .for_each(|(g, u)| {
            for (g, &u) in g.iter_mut().zip(u) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
            }
        }
        y
    }

    #[test]
    fn matmul_matches_naive_for_small_and_large_m() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for (m, n, k) in [(1, 300, 70), (3, 512, 64), (20, 130, 33), (1, 5, 3)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 7.0)
                .collect();
            let want = naive(&x, &w, m, n, k);
            let mut y = vec![1.0f32; m * n];
            pool.install(|| matmul_wt(&mut y, &x, &w, m, n, k, false));
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{m}x{n}x{k}: {a} vs {b}");
            }
            pool.install(|| matmul_wt(&mut y, &x, &w, m, n, k, true));
            for (a, b) in y.iter().zip(&want) {
                assert!((a - 2.0 * b).abs() < 2e-4, "accumulate {m}x{n}x{k}");
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_half_apart() {
        // One head of dim 4, position 1, inv_freq [1, 0]: pair (0,2) rotates by 1 rad, (1,3) not.
        let mut x = vec![1.0, 2.0, 0.0, 3.0];
        let (c, s) = rope_tables(&[1], &[1.0, 0.0]);
        rope(&mut x, 1, 4, &c, &s);
        let (c1, s1) = (1f32.cos(), 1f32.sin());
        let want = [c1, 2.0, s1, 3.0];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn rms_norm_normalizes() {
        let x = [3.0, 4.0];
        let mut o = [0.0; 2];
        rms_norm(&mut o, &x, &[1.0, 2.0], 2, 0.0);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6);
    }
}
