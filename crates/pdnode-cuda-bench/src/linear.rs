//! The linear layers alone: a per-op breakdown of the decode step's weight reads (each
//! Llama-3.1-8B linear through each implementation against cuBLAS and the copy ceiling).

use super::*;

/// The linear layers of one Llama-3.1-8B decode step: (name, out, in, times per step).
pub const LLAMA31_8B_LINEARS: [(&str, usize, usize, usize); 5] = [
    ("qkv", 6144, 4096, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
];

/// One linear-layer measurement: `tokens` rows through an `out x inp` bf16 weight.
#[derive(Debug, Clone)]
pub struct LinearRow {
    pub name: &'static str,
    pub out: usize,
    pub inp: usize,
    pub tokens: usize,
    pub how: ops::LinearImpl,
    /// The tensor-core GEMV's launch shape (`None` for the others).
    pub launch: Option<ops::MmaLaunch>,
    /// A launch shape other than the one `linear` picks (compared, not part of the step sums).
    pub forced: bool,
    pub us: f64,
    /// Weight bytes read per second.
    pub gbps: f64,
    /// `gbps` over the copy ceiling (bytes read + written per second of a device copy).
    pub frac_of_copy: f64,
    /// ||y - y_cublas|| / ||y_cublas|| on the same inputs (f32 output).
    pub rel_to_cublas: f64,
}

/// Copies of a bf16 `[out, inp]` weight (uniform in +-0.05, seeds from `seed`), enough of them
/// (>= 256 MB in all, at most 8) that a benchmark rotating over them never reads one from the
/// 50 MB L2.
fn rotated_weights(
    gpu: &Gpu,
    out: usize,
    inp: usize,
    seed: u64,
) -> Result<Vec<pdnode_cuda::device::DevBuf>, CudaError> {
    let wbytes = out * inp * 2;
    let copies = (256usize << 20).div_ceil(wbytes.max(1)).clamp(1, 8);
    (0..copies)
        .map(|c| {
            let b = gpu.alloc(wbytes)?;
            ops::fill_uniform_bf16(gpu, &b, out * inp, seed + c as u64, 0.05)?;
            Ok(b)
        })
        .collect()
}

/// ||got - want|| / ||want|| (infinite when `got` has a non-finite value).
fn rel_diff(got: &[f32], want: &[f32]) -> f64 {
    if !got.iter().all(|v| v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        num += ((a - b) as f64).powi(2);
        den += (*b as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Summary of one decode step's linear layers at `tokens` rows for one implementation: the sum
/// of each layer's time times its count per step, against the weight bytes at the copy ceiling.
#[derive(Debug, Clone)]
pub struct LinearStep {
    /// The implementation, or `None` for the best measured one per layer.
    pub how: Option<ops::LinearImpl>,
    pub tokens: usize,
    pub ms: f64,
    pub floor_ms: f64,
}

/// Each layer of [`LLAMA31_8B_LINEARS`] at each token count through each implementation
/// (GEMV kernels only up to [`ops::GEMV_MAX_TOKENS`] rows). Weights are rotated over enough
/// copies (>= 256 MB in all) that no layer is served from the 50 MB L2. Returns the copy ceiling
/// (bytes/s, read + write), the rows and the per-step sums.
pub fn run_linear(
    tokens: &[usize],
    impls: &[ops::LinearImpl],
    iters: usize,
    mut report: impl FnMut(&LinearRow),
) -> Result<(f64, Vec<LinearRow>, Vec<LinearStep>), CudaError> {
    let gpu = Gpu::new(0)?;
    let copy = measure_ceilings(&gpu)?.hbm_traffic_bps;
    let iters = iters.max(1);
    let max_t = tokens.iter().copied().max().unwrap_or(1).max(1);
    let mut rows = Vec::new();
    for (si, &(name, out, inp, _)) in LLAMA31_8B_LINEARS.iter().enumerate() {
        let wbytes = out * inp * 2;
        let ws = rotated_weights(&gpu, out, inp, 100 + si as u64 * 8)?;
        let copies = ws.len();
        let x = gpu.alloc(max_t * inp * 2)?;
        ops::fill_uniform_bf16(&gpu, &x, max_t * inp, 7, 1.0)?;
        let (y, y_ref) = (gpu.alloc(max_t * out * 4)?, gpu.alloc(max_t * out * 4)?);
        for &t in tokens {
            let run = |how, y: &pdnode_cuda::device::DevBuf, w: &pdnode_cuda::device::DevBuf| {
                ops::linear(&gpu, out, t, inp, w, &x, y, OutType::F32, false, how)
            };
            run(ops::LinearImpl::Cublas, &y_ref, &ws[0])?;
            let want = gpu.download_f32(&y_ref, t * out)?;
            let sms = gpu.sm_count as usize;
            let auto_launch = ops::mma_launch(sms, out, t, inp);
            let mut cases: Vec<(ops::LinearImpl, Option<ops::MmaLaunch>)> = Vec::new();
            for &how in impls {
                let gemv = !matches!(how, ops::LinearImpl::Cublas | ops::LinearImpl::Auto);
                if t == 0 || (gemv && t > ops::GEMV_MAX_TOKENS) {
                    continue;
                }
                if how != ops::LinearImpl::GemvMma {
                    cases.push((how, None));
                    continue;
                }
                cases.push((how, Some(auto_launch)));
                // the other tile height, the auto one at half the warps, and with the L2 hint
                let other = ops::mma_launch_tiles(sms, out, inp, 3 - auto_launch.tiles);
                let half = ops::MmaLaunch {
                    warps: (auto_launch.warps / 2).max(1),
                    ..auto_launch
                };
                let pf = ops::MmaLaunch {
                    l2_prefetch: true,
                    ..auto_launch
                };
                for l in [other, half, pf] {
                    if !cases.contains(&(how, Some(l))) {
                        cases.push((how, Some(l)));
                    }
                }
            }
            for (how, launch) in cases {
                let run = |how,
                           y: &pdnode_cuda::device::DevBuf,
                           w: &pdnode_cuda::device::DevBuf| match launch {
                    Some(l) => ops::gemv_mma(&gpu, l, out, t, inp, w, &x, y, OutType::F32, false),
                    None => run(how, y, w),
                };
                gpu.memset(&y, 0xFF)?;
                run(how, &y, &ws[0])?;
                let got = gpu.download_f32(&y, t * out)?;
                let rel = rel_diff(&got, &want);
                let mut k = 0usize;
                let s = timed(&gpu, iters, || {
                    k += 1;
                    run(how, &y, &ws[k % copies])
                })?;
                let gbps = wbytes as f64 / s;
                let row = LinearRow {
                    name,
                    out,
                    inp,
                    tokens: t,
                    how,
                    launch,
                    forced: launch.is_some_and(|l| l != auto_launch),
                    us: s * 1e6,
                    gbps: gbps / 1e9,
                    frac_of_copy: gbps / copy,
                    rel_to_cublas: rel,
                };
                report(&row);
                rows.push(row);
            }
        }
    }
    let mut steps = Vec::new();
    for &t in tokens {
        let floor_ms: f64 = LLAMA31_8B_LINEARS
            .iter()
            .map(|&(_, o, i, n)| (o * i * 2 * n) as f64)
            .sum::<f64>()
            / copy
            * 1e3;
        let layer_us = |name: &str, how: Option<ops::LinearImpl>| {
            rows.iter()
                .filter(|r| r.tokens == t && r.name == name)
                .filter(|r| how.is_none_or(|h| r.how == h && !r.forced))
                .map(|r| r.us)
                .reduce(f64::min)
        };
        let step = |how: Option<ops::LinearImpl>| {
            LLAMA31_8B_LINEARS
                .iter()
                .map(|&(name, _, _, n)| layer_us(name, how).map(|us| us * n as f64 / 1e3))
                .sum::<Option<f64>>()
        };
        for how in impls.iter().copied().map(Some).chain([None]) {
            if let Some(ms) = step(how) {
                steps.push(LinearStep {
                    how,
                    tokens: t,
                    ms,
                    floor_ms,
                });
            }
        }
    }
    Ok((copy, rows, steps))
}

/// The decode step's linear layers as the step calls them for [`run_linear_lt`]: (name, out,
/// in, output type, accumulate into the output): qkv and gate_up write bf16, o and down add
/// into the f32 residual.
pub const LT_LINEARS: [(&str, usize, usize, OutType, bool); 4] = [
    ("qkv", 6144, 4096, OutType::Bf16, false),
    ("o", 4096, 4096, OutType::F32, true),
    ("gate_up", 28672, 4096, OutType::Bf16, false),
    ("down", 4096, 14336, OutType::F32, true),
];

/// One GEMM measurement of [`run_linear_lt`]: `cublasGemmEx`'s default (`algo: None`) or
/// cuBLASLt heuristic candidate `algo` (0: the heuristic's first choice).
#[derive(Debug, Clone)]
pub struct LtRow {
    pub name: &'static str,
    pub out: usize,
    pub inp: usize,
    pub tokens: usize,
    pub algo: Option<usize>,
    pub config: Option<pdnode_cuda::blaslt::AlgoConfig>,
    /// The heuristic's wave estimate (0 for GemmEx).
    pub waves: f32,
    pub us: f64,
    /// Bytes moved (weights + x + y, y twice when accumulated) over the copy ceiling's rate.
    pub frac_of_copy: f64,
    pub tflops: f64,
    /// ||y - y_gemmex|| / ||y_gemmex|| on the same inputs.
    pub rel_to_gemmex: f64,
}

/// Each of [`LT_LINEARS`] at each token count through `cublasGemmEx` and through each of up to
/// `max_algos` cuBLASLt heuristic candidates, weights rotated past L2 as in [`run_linear`]; every
/// case timed in `rounds` interleaved rounds of `iters` calls (the fastest round kept). Returns
/// the copy ceiling (bytes/s, read + write) and the rows.
pub fn run_linear_lt(
    tokens: &[usize],
    max_algos: usize,
    iters: usize,
    rounds: usize,
    mut report: impl FnMut(&LtRow),
) -> Result<(f64, Vec<LtRow>), CudaError> {
    use pdnode_cuda::blaslt::{BlasLt, LtPlan};
    let gpu = Gpu::new(0)?;
    let copy = measure_ceilings(&gpu)?.hbm_traffic_bps;
    gpu.bind()?;
    let lt = BlasLt::new(&gpu.stream)?;
    let max_t = tokens.iter().copied().max().unwrap_or(1).max(1);
    let mut rows = Vec::new();
    for (si, &(name, out, inp, ty, acc)) in LT_LINEARS.iter().enumerate() {
        let wbytes = out * inp * 2;
        let ws = rotated_weights(&gpu, out, inp, 300 + si as u64 * 8)?;
        let copies = ws.len();
        let x = gpu.alloc(max_t * inp * 2)?;
        ops::fill_uniform_bf16(&gpu, &x, max_t * inp, 9, 1.0)?;
        let y = gpu.alloc(max_t * out * 4)?;
        let beta = if acc { 1.0 } else { 0.0 };
        let ysz = if ty == OutType::F32 { 4 } else { 2 };
        for &t in tokens {
            let plan = LtPlan::new(out, t, inp, ty)?;
            let algos = lt.heuristics(&plan, max_algos)?;
            // None: GemmEx; Some(i): algos[i]
            let call = |which: Option<usize>, w: &pdnode_cuda::device::DevBuf| match which {
                // SAFETY: w, x and y hold the shapes passed (x and y sized for max_t rows).
                None => unsafe {
                    gemm(&gpu.blas, out, t, inp, w.ptr(), x.ptr(), y.ptr(), ty, beta)
                },
                // SAFETY: as above; the algo came from this plan's heuristic.
                Some(i) => unsafe { lt.matmul(&plan, &algos[i], w.ptr(), x.ptr(), y.ptr(), beta) },
            };
            let output = |which: Option<usize>| -> Result<Vec<f32>, CudaError> {
                gpu.memset(&y, 0)?;
                call(which, &ws[0])?;
                match ty {
                    OutType::F32 => gpu.download_f32(&y, t * out),
                    OutType::Bf16 => gpu.download_bf16(&y, t * out),
                }
            };
            let want = output(None)?;
            let cases: Vec<Option<usize>> = [None]
                .into_iter()
                .chain((0..algos.len()).map(Some))
                .collect();
            let mut best = vec![f64::INFINITY; cases.len()];
            let n = if t > 256 { (iters / 5).max(5) } else { iters };
            for _ in 0..rounds.max(1) {
                for (ci, &which) in cases.iter().enumerate() {
                    let mut k = 0usize;
                    let s = timed(&gpu, n, || {
                        k += 1;
                        call(which, &ws[k % copies])
                    })?;
                    best[ci] = best[ci].min(s);
                }
            }
            let bytes = (wbytes + t * inp * 2 + t * out * ysz * if acc { 2 } else { 1 }) as f64;
            for (ci, &which) in cases.iter().enumerate() {
                let got = output(which)?;
                let rel = rel_diff(&got, &want);
                let s = best[ci];
                let row = LtRow {
                    name,
                    out,
                    inp,
                    tokens: t,
                    algo: which,
                    config: which.map(|i| algos[i].config()).transpose()?,
                    waves: which.map_or(0.0, |i| algos[i].waves),
                    us: s * 1e6,
                    frac_of_copy: bytes / s / copy,
                    tflops: 2.0 * (out * t * inp) as f64 / s / 1e12,
                    rel_to_gemmex: rel,
                };
                report(&row);
                rows.push(row);
            }
        }
    }
    Ok((copy, rows))
}

/// One layer of the decode step through the decode step's current path and through
/// [`ops::gemv_stream`], launched back to back on rotated weights (no PDL).
#[derive(Debug, Clone)]
pub struct StreamRow {
    pub name: &'static str,
    pub out: usize,
    pub inp: usize,
    pub tokens: usize,
    /// The step's path without streaming: `linear` under `Auto` (qkv, o, down; f32 y, o and down
    /// accumulating) or the fused gate_up + SwiGLU launch, us a call.
    pub auto_us: f64,
    /// `gemv_stream` with the same output (gate_up: `Glu`), us a call.
    pub stream_us: f64,
    /// Weight bytes over each time, as a fraction of the copy ceiling.
    pub auto_frac: f64,
    pub stream_frac: f64,
    /// ||stream - auto|| / ||auto|| on the same inputs.
    pub rel: f64,
}

/// [`StreamRow`]s for the four decode linears of [`LLAMA31_8B_LINEARS`] at each of `tokens`
/// (at most [`ops::STREAM_MAX_TOKENS`]); the copy ceiling (bytes/s) first.
pub fn run_linear_stream(
    tokens: &[usize],
    iters: usize,
    mut report: impl FnMut(&StreamRow),
) -> Result<(f64, Vec<StreamRow>), CudaError> {
    let gpu = Gpu::new(0)?;
    let copy = measure_ceilings(&gpu)?.hbm_traffic_bps;
    if !ops::stream_available(&gpu) {
        return Err(CudaError::Unsupported {
            reason: "gemv_stream needs compute capability 9.0".into(),
        });
    }
    let iters = iters.max(1);
    let max_t = ops::STREAM_MAX_TOKENS;
    let sms = gpu.sm_count as usize;
    let mut rows = Vec::new();
    for (si, &(name, out, inp, _)) in LLAMA31_8B_LINEARS[..4].iter().enumerate() {
        let wbytes = out * inp * 2;
        let ws = rotated_weights(&gpu, out, inp, 500 + si as u64 * 8)?;
        let copies = ws.len();
        let x = gpu.alloc(max_t * inp * 2)?;
        ops::fill_uniform_bf16(&gpu, &x, max_t * inp, 11, 1.0)?;
        let (ya, yb) = (gpu.alloc(max_t * out * 4)?, gpu.alloc(max_t * out * 4)?);
        let glu = name == "gate_up";
        let acc = name == "o" || name == "down";
        let (units, sout) = match (glu, acc) {
            (true, _) => (out / 2, ops::StreamOut::Glu),
            (_, true) => (out, ops::StreamOut::F32Acc),
            _ => (out, ops::StreamOut::F32),
        };
        for &t in tokens.iter().filter(|t| (1..=max_t).contains(*t)) {
            if ops::stream_plan(sms, units, t, inp, sout, 0).is_none() {
                continue; // x does not fit shared memory beside two stages
            }
            let auto = |w: &pdnode_cuda::device::DevBuf| {
                if glu {
                    let l =
                        ops::glu_launch_warps(sms, units, inp, ops::Fusion::default().glu_warps);
                    ops::gemv_mma_swiglu(&gpu, l, units, t, inp, w, &x, &ya)
                } else {
                    let how = ops::LinearImpl::Auto;
                    ops::linear(&gpu, out, t, inp, w, &x, &ya, OutType::F32, acc, how)
                }
            };
            let stream = |w: &pdnode_cuda::device::DevBuf| {
                ops::gemv_stream(
                    &gpu,
                    units,
                    t,
                    inp,
                    w,
                    ops::StreamX::Bf16(&x),
                    &yb,
                    sout,
                    Default::default(),
                )
            };
            let n = t * units;
            for y in [&ya, &yb] {
                gpu.memset(y, 0)?;
            }
            auto(&ws[0])?;
            stream(&ws[0])?;
            let (a, b) = if glu {
                (gpu.download_bf16(&ya, n)?, gpu.download_bf16(&yb, n)?)
            } else {
                (gpu.download_f32(&ya, n)?, gpu.download_f32(&yb, n)?)
            };
            let rel = rel_diff(&b, &a);
            let mut k = 0usize;
            let auto_s = timed(&gpu, iters, || {
                k += 1;
                auto(&ws[k % copies])
            })?;
            let stream_s = timed(&gpu, iters, || {
                k += 1;
                stream(&ws[k % copies])
            })?;
            let row = StreamRow {
                name,
                out,
                inp,
                tokens: t,
                auto_us: auto_s * 1e6,
                stream_us: stream_s * 1e6,
                auto_frac: wbytes as f64 / auto_s / copy,
                stream_frac: wbytes as f64 / stream_s / copy,
                rel,
            };
            report(&row);
            rows.push(row);
        }
    }
    Ok((copy, rows))
}
