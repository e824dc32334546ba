//! `y = x W^T` for the decode and prefill linear layers: cuBLAS, the CUDA-core GEMV kernels
//! (`gemv_t*`) or the tensor-core GEMV kernels (`gemv_mma_m*`, kernels/gemv.cu), chosen per call
//! by [`LinearImpl`]. Every path is capture-safe (no allocation, no host sync): decode steps
//! replay from CUDA graphs.

use super::super::CudaError;
use super::super::blas::OutType;
use super::super::device::{DevBuf, Gpu};
use super::{cfg, launched, need, shape, u32_of};
use cudarc::driver::PushKernelArg;

const BF16: usize = 2;
const F32: usize = 4;

/// Which implementation [`linear`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearImpl {
    /// [`LinearImpl::GemvMma`] where it applies (tokens <= 8, `inp % 8 == 0`, 16-byte aligned
    /// operands), cuBLAS otherwise; `PDNODE_LINEAR=cublas|gemv|mma` changes the preference
    /// ([`auto_choice`]).
    Auto,
    /// cuBLAS `cublasGemmEx` (H200, Llama-3.1-8B shapes: 5.87 ms per batch-1 decode step).
    Cublas,
    /// CUDA-core GEMV, one warp per output row (the first kernel: 6.05 ms per batch-1 step).
    Gemv,
    /// Tensor-core GEMV: mma.sync m16n8k16 over 16 or 32 weight rows per block, split-K over the
    /// block's warps with a fixed-order reduction (tokens <= 8).
    GemvMma,
}

impl LinearImpl {
    /// `auto`, `cublas`, `gemv`, `mma` (benchmark and test selectors).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "auto" => Self::Auto,
            "cublas" => Self::Cublas,
            "gemv" => Self::Gemv,
            "mma" | "gemv_mma" => Self::GemvMma,
            _ => return None,
        })
    }

    /// Every implementation other than `Auto`.
    pub const ALL: [LinearImpl; 3] = [Self::GemvMma, Self::Gemv, Self::Cublas];
}

/// What `Auto` prefers for the calls a GEMV kernel can take: `PDNODE_LINEAR` (`mma`, `gemv`,
/// `cublas`; read once per process) so prebuilt binaries can switch a kernel off, else the
/// tensor-core GEMV.
pub fn auto_choice() -> LinearImpl {
    static CHOICE: std::sync::OnceLock<LinearImpl> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        std::env::var("PDNODE_LINEAR")
            .ok()
            .and_then(|v| LinearImpl::parse(&v))
            .unwrap_or(LinearImpl::GemvMma)
    })
}

/// Most token rows the GEMV kernels take.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Launch shape of a `gemv_mma` call: kernel, blocks, warps per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaLaunch {
    /// 16-row tiles per block (1: `gemv_mma_m1`, 2: `gemv_mma_m2`).
    pub tiles: usize,
    pub blocks: usize,
    pub warps: usize,
    /// Weight loads with a 256-byte L2 prefetch hint (`gemv_mma_m*_pf`).
    pub l2_prefetch: bool,
}

/// Chunks of 32 inputs each warp keeps in flight per iteration (the kernels' `U`).
const fn mma_unroll(tiles: usize) -> usize {
    if tiles == 1 { 4 } else { 2 }
}

/// Warps per SM the kernels can keep resident (80 registers per thread, as ptxas reports for
/// sm_90 with `__launch_bounds__(512, 1)`: 65536 / (80 * 32) = 25, in blocks of `warps`).
const RESIDENT_WARPS: usize = 24;

/// Picks the tile height and the split-K width: 32-row blocks (half the x re-reads) when there
/// are more than 2 tokens and enough of them to cover every SM, else 16-row blocks; then see
/// [`mma_launch_tiles`].
pub fn mma_launch(sm_count: usize, out: usize, tokens: usize, inp: usize) -> MmaLaunch {
    let tiles = if tokens > 2 && out.div_ceil(32) >= sm_count.max(1) {
        2
    } else {
        1
    };
    mma_launch_tiles(sm_count, out, inp, tiles)
}

/// The launch for a given tile height (1 or 2 tiles of 16 rows; anything else is taken as 2):
/// the widest block (16, 12, 8, 6 or 4 warps) whose grid fits in one resident wave, so every SM
/// has about 24 warps of loads in flight; never more warps than chunk batches along `inp`.
pub fn mma_launch_tiles(sm_count: usize, out: usize, inp: usize, tiles: usize) -> MmaLaunch {
    let sms = sm_count.max(1);
    let tiles = if tiles == 1 { 1 } else { 2 };
    let blocks = out.div_ceil(16 * tiles).max(1);
    let mut warps = 4;
    for w in [16usize, 12, 8, 6] {
        if blocks <= (RESIDENT_WARPS / w) * sms {
            warps = w;
            break;
        }
    }
    let batches = inp.div_ceil(32).div_ceil(mma_unroll(tiles)).max(1);
    MmaLaunch {
        tiles,
        blocks,
        warps: warps.min(batches),
        l2_prefetch: false,
    }
}

/// `y[t, o] = (accumulate ? y[t, o] : 0) + sum_i x[t, i] * w[o, i]`: w bf16 `[out, inp]`,
/// x bf16 `[tokens, inp]`, y `[tokens, out]` of `ty` (accumulation only for f32).
#[allow(clippy::too_many_arguments)]
pub fn linear(
    gpu: &Gpu,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
    how: LinearImpl,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    let ysz = if ty == OutType::F32 { F32 } else { BF16 };
    need(OP, "w", w, out * inp * BF16)?;
    need(OP, "x", x, tokens * inp * BF16)?;
    need(OP, "y", y, tokens * out * ysz)?;
    shape(OP, !(accumulate && ty == OutType::Bf16), || {
        "accumulation needs an f32 output".into()
    })?;
    if out * tokens * inp == 0 {
        return Ok(());
    }
    let gemv_ok = tokens <= GEMV_MAX_TOKENS
        && inp.is_multiple_of(8)
        && w.ptr().is_multiple_of(16)
        && x.ptr().is_multiple_of(16);
    let need_gemv = |what: &str| {
        shape(OP, gemv_ok, || {
            format!("{what} needs tokens <= 8, inp % 8 == 0, 16-byte aligned w and x")
        })
    };
    let kernel = match how {
        LinearImpl::Cublas => None,
        LinearImpl::Auto => match auto_choice() {
            LinearImpl::Cublas => None,
            LinearImpl::Gemv => gemv_ok.then_some(LinearImpl::Gemv),
            _ => gemv_ok.then_some(LinearImpl::GemvMma),
        },
        LinearImpl::Gemv => {
            need_gemv("gemv")?;
            Some(LinearImpl::Gemv)
        }
        LinearImpl::GemvMma => {
            need_gemv("gemv_mma")?;
            Some(LinearImpl::GemvMma)
        }
    };
    let Some(kernel) = kernel else {
        // SAFETY: sizes checked above; the Blas handle belongs to this GPU's context.
        return unsafe {
            super::super::blas::gemm(
                &gpu.blas,
                out,
                tokens,
                inp,
                w.ptr(),
                x.ptr(),
                y.ptr(),
                ty,
                if accumulate { 1.0 } else { 0.0 },
            )
        };
    };
    if kernel == LinearImpl::GemvMma {
        let l = mma_launch(gpu.sm_count as usize, out, tokens, inp);
        return gemv_mma(gpu, l, out, tokens, inp, w, x, y, ty, accumulate);
    }
    let name = match tokens {
        1 => "gemv_t1",
        2 => "gemv_t2",
        3 | 4 => "gemv_t4",
        _ => "gemv_t8",
    };
    let blocks = out.div_ceil(8).min(gpu.sm_count as usize * 8) as u32;
    launch_gemv(
        gpu, name, blocks, 256, out, tokens, inp, w, x, y, ty, accumulate,
    )
}

/// [`linear`] through the tensor-core GEMV with an explicit launch shape (benchmarks compare
/// shapes with it). Checks what [`linear`] checks plus the launch: 1 or 2 tiles, 1..=16 warps,
/// enough blocks for every row.
#[allow(clippy::too_many_arguments)]
pub fn gemv_mma(
    gpu: &Gpu,
    l: MmaLaunch,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
) -> Result<(), CudaError> {
    const OP: &str = "gemv_mma";
    let ysz = if ty == OutType::F32 { F32 } else { BF16 };
    need(OP, "w", w, out * inp * BF16)?;
    need(OP, "x", x, tokens * inp * BF16)?;
    need(OP, "y", y, tokens * out * ysz)?;
    shape(OP, !(accumulate && ty == OutType::Bf16), || {
        "accumulation needs an f32 output".into()
    })?;
    shape(
        OP,
        tokens <= GEMV_MAX_TOKENS
            && inp.is_multiple_of(8)
            && w.ptr().is_multiple_of(16)
            && x.ptr().is_multiple_of(16),
        || "gemv_mma needs tokens <= 8, inp % 8 == 0, 16-byte aligned w and x".into(),
    )?;
    shape(
        OP,
        (1..=2).contains(&l.tiles) && (1..=16).contains(&l.warps) && l.blocks * 16 * l.tiles >= out,
        || format!("bad launch {l:?} for {out} rows"),
    )?;
    if out * tokens * inp == 0 {
        return Ok(());
    }
    let name = match (l.tiles, l.l2_prefetch) {
        (1, false) => "gemv_mma_m1",
        (1, true) => "gemv_mma_m1_pf",
        (_, false) => "gemv_mma_m2",
        (_, true) => "gemv_mma_m2_pf",
    };
    let grid = u32_of(OP, l.blocks)?;
    launch_gemv(
        gpu,
        name,
        grid,
        32 * l.warps as u32,
        out,
        tokens,
        inp,
        w,
        x,
        y,
        ty,
        accumulate,
    )
}

/// Launches one of the GEMV kernels (all share one signature); the caller checked the shapes.
#[allow(clippy::too_many_arguments)]
fn launch_gemv(
    gpu: &Gpu,
    name: &'static str,
    grid: u32,
    block: u32,
    out: usize,
    tokens: usize,
    inp: usize,
    w: &DevBuf,
    x: &DevBuf,
    y: &DevBuf,
    ty: OutType,
    accumulate: bool,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    let f = gpu.kernel(name)?;
    let (t_i, o_i, i_i, yf, acc) = (
        tokens as i32,
        i32::try_from(out).map_err(|_| CudaError::Shape {
            op: OP,
            reason: format!("out {out} exceeds i32"),
        })?,
        i32::try_from(inp).map_err(|_| CudaError::Shape {
            op: OP,
            reason: format!("inp {inp} exceeds i32"),
        })?,
        (ty == OutType::F32) as i32,
        accumulate as i32,
    );
    let mut b = gpu.stream.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(x.ptr_ref())
        .arg(y.ptr_ref())
        .arg(&t_i)
        .arg(&o_i)
        .arg(&i_i)
        .arg(&yf)
        .arg(&acc);
    // SAFETY: sizes and alignment checked above; tokens <= 8 as both kernels assume.
    unsafe { b.launch(cfg((grid, 1, 1), block)) }.map_err(launched(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mma_launch_covers_rows_and_fits_one_wave_when_it_can() {
        let llama = [
            (6144, 4096),
            (4096, 4096),
            (28672, 4096),
            (4096, 14336),
            (128256, 4096),
        ];
        for &(out, inp) in &llama {
            for t in 1..=8 {
                let l = mma_launch(132, out, t, inp);
                assert!(l.blocks * 16 * l.tiles >= out, "{out} rows covered");
                assert!((l.blocks - 1) * 16 * l.tiles < out, "no empty block");
                assert!((1..=16).contains(&l.warps));
                let per_sm = RESIDENT_WARPS / l.warps.max(4);
                if out <= 6144 {
                    assert!(
                        l.blocks <= per_sm * 132,
                        "{out}x{inp} t{t}: {l:?} in one wave"
                    );
                    assert!(l.warps >= 8, "{out}x{inp} t{t}: {l:?} splits K");
                }
            }
        }
        // x re-reads halved at 8 tokens where the grid still covers the SMs
        assert_eq!(mma_launch(132, 6144, 8, 4096).tiles, 2);
        assert_eq!(mma_launch(132, 4096, 8, 4096).tiles, 1);
        assert_eq!(mma_launch(132, 6144, 1, 4096).tiles, 1);
        // tiny shapes: one warp per chunk batch at most, never zero
        let l = mma_launch(132, 3, 1, 8);
        assert_eq!((l.blocks, l.warps, l.tiles), (1, 1, 1));
        assert_eq!(mma_launch(0, 0, 0, 0).warps, 1);
    }

    #[test]
    fn impls_parse() {
        for (s, i) in [
            ("auto", LinearImpl::Auto),
            ("cublas", LinearImpl::Cublas),
            ("gemv", LinearImpl::Gemv),
            ("mma", LinearImpl::GemvMma),
        ] {
            assert_eq!(LinearImpl::parse(s), Some(i));
        }
        assert_eq!(LinearImpl::parse("x"), None);
    }
}
