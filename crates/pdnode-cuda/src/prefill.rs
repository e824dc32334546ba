//! Prefill attention for sequences with many new tokens, in one of two implementations
//! ([`PrefillAttn`]):
//! - cuBLAS: per query chunk, two strided-batched GEMMs per head of a GQA group (`S = Q K^T` in
//!   f32, `O = P V`) around a causal softmax kernel. The sequence's cached and new K/V are gathered
//!   from the paged pool into contiguous `[nkv, len, hd]` buffers first, so chunked prefill (a
//!   cached prefix) works the same.
//! - flash (kernels/prefill_flash.cu, prefill_flash_v3.cu, prefill_flash_wg.cu): one fused causal
//!   flash-attention kernel on bf16 tensor cores reading K/V straight from the paged pool
//!   (head_dim 64 and 128; other head dims fall back to cuBLAS). No scratch memory, no score
//!   matrix. Three kernels: wgmma (the default on compute capability 9.0: Hopper's warpgroup MMA,
//!   head_dim 128, power-of-two block sizes; elsewhere v3 runs), v3 (4-stage K/V ring, scores of
//!   the next tile overlapping the softmax; power-of-two block sizes) and w8 (8 warps of 16 query
//!   rows, any block size: v3's fallback). The variants that lost their benchmarks (4 warps, 32
//!   rows per warp, v2; the wgmma variants of docs/benchmarks.md session 18) were retired.

use super::CudaError;
use super::blas::{Operand, OutType, gemm_strided_batched};
use super::device::{DevBuf, Gpu};
use super::ops::AttnDims;
use cudarc::driver::LaunchConfig;

const BF16: usize = 2;

/// Which implementation runs prefill attention for the long sequences of a step
/// (`engine.cuda.prefill_attention`). Head dims other than 64 and 128 always take the cuBLAS
/// path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillAttn {
    /// Fused flash attention v3 (kernels/prefill_flash_v3.cu): 128 query rows (8 warps) per CTA,
    /// K/V tiles through a 4-stage cp.async ring with one barrier per tile, shift/mask paged
    /// addressing with the block table read a tile ahead, the scores of tile j + 1 computed in
    /// the same block as the softmax and P V of tile j, heaviest query tiles of every head first.
    /// Needs a power-of-two block size (otherwise runs [`PrefillAttn::Flash8`]); what
    /// [`PrefillAttn::Wgmma`] runs off Hopper. On the H200: 8k prefill step 0.68 of the GEMM
    /// floor vs 0.59 with Flash8 and 0.34 with cuBLAS.
    FlashV3,
    /// Fused flash attention on Hopper's warpgroup MMA (kernels/prefill_flash_wg.cu): 128 query
    /// rows as two warpgroups of 64, 128-key tiles of K and V in 128-byte-swizzled shared memory,
    /// `S = Q K^T` and `O = P V` as wgmma (P from registers); at block size 8 or more the
    /// warp-specialized kernel (a producer warpgroup loading K and V by TMA, the two computing
    /// warpgroups overlapping softmax and wgmma), at 4 the plain one. Needs a compute
    /// capability 9.0 device (sm_90a), head_dim 128 and a power-of-two block size; elsewhere runs
    /// [`PrefillAttn::FlashV3`]. The default: on the H200, 8k prefill step 0.77 of the GEMM
    /// floor, 2k 0.77-0.78 (flashv3 0.67-0.68, 0.69-0.70; docs/benchmarks.md, session 22).
    #[default]
    Wgmma,
    /// Fused flash attention, 128 query rows (8 warps) per CTA, any block size.
    Flash8,
    /// cuBLAS GEMMs around a causal softmax kernel (materialized f32 scores).
    Gemm,
}

impl PrefillAttn {
    /// `flashv3`, `wgmma`, `flash8` or `gemm` (case-insensitive; `cublas` for `gemm`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "gemm" | "cublas" => Some(Self::Gemm),
            "flash8" => Some(Self::Flash8),
            "flashv3" | "flash_v3" => Some(Self::FlashV3),
            "wgmma" => Some(Self::Wgmma),
            _ => None,
        }
    }

    /// Every implementation (benchmarks compare them).
    pub const ALL: [PrefillAttn; 4] = [Self::Gemm, Self::Flash8, Self::FlashV3, Self::Wgmma];
}

/// Scores (f32) plus probabilities (bf16) of one query chunk stay under this many bytes.
pub(crate) const SCORE_BUDGET: usize = 1 << 30;

/// One sequence taking the GEMM path: its new tokens are rows `row0..row0 + n` of the step,
/// at positions `start..start + n`; `seq` indexes the step's block tables.
#[derive(Debug, Clone, Copy)]
pub struct LongSeq {
    pub row0: usize,
    pub n: usize,
    pub start: usize,
    pub seq: usize,
}

/// Scratch buffers, grown on demand (after a device sync).
#[derive(Default)]
pub struct PrefillScratch {
    /// Byte budget of one query chunk's scores + probabilities; 0 = `SCORE_BUDGET` (1 GiB).
    pub score_budget: usize,
    /// Implementation (`engine.cuda.prefill_attention`).
    pub attn: PrefillAttn,
    /// `Wgmma` runs the plain kernel (`flash_prefill_hd128_wg`: two warpgroups loading by
    /// cp.async and computing in step) even where the warp-specialized one
    /// (`flash_prefill_hd128_ws`: a producer warpgroup issuing TMA copies and two consumers
    /// taking turns, FlashAttention-3's schedule) fits: the benchmark's and the tests' knob.
    pub wg_plain: bool,
    kc: Option<DevBuf>,
    vc: Option<DevBuf>,
    qh: Option<DevBuf>,
    oh: Option<DevBuf>,
    s: Option<DevBuf>,
    p: Option<DevBuf>,
}

pub(crate) fn ensure<'a>(
    gpu: &Gpu,
    b: &'a mut Option<DevBuf>,
    bytes: usize,
) -> Result<&'a DevBuf, CudaError> {
    if b.as_ref().is_none_or(|x| x.bytes() < bytes) {
        gpu.sync()?;
        *b = None;
        *b = Some(gpu.alloc(bytes.next_power_of_two())?);
    }
    b.as_ref().ok_or_else(|| CudaError::Shape {
        op: "prefill scratch",
        reason: "allocation vanished".into(),
    })
}

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl PrefillScratch {
    /// Empty scratch using implementation `attn`.
    pub fn new(attn: PrefillAttn) -> Self {
        Self {
            attn,
            ..Self::default()
        }
    }

    /// Whether [`PrefillScratch::run`] takes the wgmma kernel for attention of `d` on `gpu`: the
    /// implementation is [`PrefillAttn::Wgmma`] and the kernel can run there (else it runs
    /// flashv3).
    pub fn wgmma_runs(&self, gpu: &Gpu, d: &AttnDims) -> bool {
        self.attn == PrefillAttn::Wgmma && wgmma_fits(gpu, d)
    }

    /// Whether that wgmma kernel is the warp-specialized one (unless [`PrefillScratch::wg_plain`],
    /// where its program loaded and the block size is at least 8: its TMA boxes are whole pool
    /// blocks, which then start on the 8-row (1024-byte) period of the 128-byte swizzle, and a
    /// 128-key tile spans at most 16 of them).
    pub fn wg_specialized_runs(&self, gpu: &Gpu, d: &AttnDims) -> bool {
        !self.wg_plain
            && self.wgmma_runs(gpu, d)
            && d.block_size >= 8
            && gpu.has_kernel(WGMMA_WS_KERNEL)
    }

    /// Attention of the new tokens of `seqs` (layer `layer`), reading q rows from `q`
    /// `[T, nh, hd]` and writing `out` `[T, nh, hd]` rows. `tables`: device i32 `[S, max_blocks]`.
    /// `window` (`ModelSpec::attention_window`, 0 for none): position `p` attends to keys
    /// `max(0, p + 1 - window) ..= p` only; both paths skip the keys before a query chunk's
    /// window (the GEMMs start at the chunk's first window key, the flash kernels at its tile).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        gpu: &Gpu,
        d: &AttnDims,
        pool: &DevBuf,
        layer: usize,
        q: &DevBuf,
        out: &DevBuf,
        total_tokens: usize,
        tables: u64,
        max_blocks: usize,
        seqs: &[LongSeq],
        window: usize,
    ) -> Result<(), CudaError> {
        let (nh, nkv, hd, bs) = (d.num_heads, d.num_kv_heads, d.head_dim, d.block_size);
        let op = "prefill_attention";
        // a window as long as the longest context is no window (and keeps the i32 in range)
        let longest = seqs.iter().map(|s| s.start + s.n).max().unwrap_or(0);
        let window = if window >= longest { 0 } else { window };
        let shape_err = |reason: String| CudaError::Shape { op, reason };
        if nkv == 0 || !nh.is_multiple_of(nkv) || hd == 0 || bs == 0 {
            return Err(shape_err(format!("{d:?}: need nh % nkv == 0, hd > 0")));
        }
        let g_per = nh / nkv;
        if q.bytes() < total_tokens * nh * hd * BF16 || out.bytes() < total_tokens * nh * hd * BF16
        {
            return Err(shape_err(format!("q/out smaller than {total_tokens} rows")));
        }
        if pool.bytes() < (layer + 1) * d.layer_elems() * BF16 {
            return Err(shape_err(format!("pool has no layer {layer}")));
        }
        let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
        for s in seqs {
            let e = s.start + s.n;
            if s.row0 + s.n > total_tokens
                || e > max_blocks * bs
                || s.n == 0
                || e > i32::MAX as usize
                || s.row0 > i32::MAX as usize
            {
                return Err(shape_err(format!("{s:?} outside the step")));
            }
        }
        let attn = self.attn;
        if attn != PrefillAttn::Gemm && (hd == 64 || hd == 128) {
            let attn = if attn == PrefillAttn::Wgmma && !self.wgmma_runs(gpu, d) {
                PrefillAttn::FlashV3
            } else {
                attn
            };
            let ws = self.wg_specialized_runs(gpu, d);
            return run_flash(
                gpu, d, layer_ptr, q, out, tables, max_blocks, seqs, attn, ws, window,
            );
        }
        let (hd_i, nkv_i, bs_i) = (hd as i32, nkv as i32, bs as i32);
        for s in seqs {
            let e = s.start + s.n;
            if s.row0 + s.n > total_tokens || e > max_blocks * bs || s.n == 0 {
                return Err(shape_err(format!("{s:?} outside the step")));
            }
            let kc = ensure(gpu, &mut self.kc, nkv * e * hd * BF16)?.ptr();
            let vc = ensure(gpu, &mut self.vc, nkv * e * hd * BF16)?.ptr();
            let qh = ensure(gpu, &mut self.qh, nh * s.n * hd * BF16)?.ptr();
            let oh = ensure(gpu, &mut self.oh, nh * s.n * hd * BF16)?.ptr();
            let budget = if self.score_budget > 0 {
                self.score_budget
            } else {
                SCORE_BUDGET
            };
            let tq = s.n.min((budget / (nh * e * 6)).max(1));
            let sp = ensure(gpu, &mut self.s, nh * tq * e * 4)?.ptr();
            let pp = ensure(gpu, &mut self.p, nh * tq * e * BF16)?.ptr();
            // q rows -> head-major
            // SAFETY: q holds total_tokens >= row0 + n rows; qh holds nh * n rows (ensured).
            unsafe { transpose_heads(gpu, q.ptr(), qh, s.row0, s.n, nh, hd, true) }?;
            // K/V of positions 0..e
            let f = gpu.kernel("kv_gather_seq")?;
            let table = tables + (s.seq * max_blocks * 4) as u64;
            let e_i = e as i32;
            let mut b = gpu.launch_builder(f);
            b.arg(&layer_ptr)
                .arg(&table)
                .arg(&nkv_i)
                .arg(&hd_i)
                .arg(&bs_i)
                .arg(&e_i)
                .arg(&kc)
                .arg(&vc);
            // SAFETY: the table covers e positions (checked by the step plan); kc/vc hold
            // nkv * e rows (ensured).
            unsafe { b.launch(cfg((e as u32, nkv as u32, 1), 64)) }
                .map_err(super::drv("kv_gather_seq"))?;
            let scale = 1.0f32 / (hd as f32).sqrt();
            let mut c0 = 0;
            while c0 < s.n {
                let tqc = tq.min(s.n - c0);
                // keys koff .. koff + tk: from the chunk's first query's window start (0 without
                // a window) to its last query
                let q0 = s.start + c0;
                let koff = if window > 0 {
                    (q0 + 1).saturating_sub(window)
                } else {
                    0
                };
                let tk = q0 + tqc - koff;
                let (kc_c, vc_c) = (
                    kc + (koff * hd * BF16) as u64,
                    vc + (koff * hd * BF16) as u64,
                );
                for g in 0..g_per {
                    // SAFETY: every batch's operands lie inside kc (nkv * e rows), qh (nh * n
                    // rows) and the score buffer (nh * tq * e f32), all ensured above.
                    unsafe {
                        gemm_strided_batched(
                            &gpu.blas,
                            tk,
                            tqc,
                            hd,
                            Operand {
                                ptr: kc_c,
                                ld: hd,
                                stride: e * hd,
                                trans: true,
                            },
                            Operand {
                                ptr: qh + ((g * s.n + c0) * hd * BF16) as u64,
                                ld: hd,
                                stride: g_per * s.n * hd,
                                trans: false,
                            },
                            Operand {
                                ptr: sp + (g * tqc * tk * 4) as u64,
                                ld: tk,
                                stride: g_per * tqc * tk,
                                trans: false,
                            },
                            OutType::F32,
                            nkv,
                        )?;
                    }
                }
                // q0 relative to the first key column, as the kernel counts keys
                // SAFETY: s and p hold nh * tqc rows of tk (ensured: tqc <= tq, tk <= e).
                unsafe { causal_softmax(gpu, sp, pp, nh, tqc, tk, q0 - koff, scale, window) }?;
                for g in 0..g_per {
                    // SAFETY: as above, with vc, p and oh.
                    unsafe {
                        gemm_strided_batched(
                            &gpu.blas,
                            hd,
                            tqc,
                            tk,
                            Operand {
                                ptr: vc_c,
                                ld: hd,
                                stride: e * hd,
                                trans: false,
                            },
                            Operand {
                                ptr: pp + (g * tqc * tk * BF16) as u64,
                                ld: tk,
                                stride: g_per * tqc * tk,
                                trans: false,
                            },
                            Operand {
                                ptr: oh + ((g * s.n + c0) * hd * BF16) as u64,
                                ld: hd,
                                stride: g_per * s.n * hd,
                                trans: false,
                            },
                            OutType::Bf16,
                            nkv,
                        )?;
                    }
                }
                c0 += tqc;
            }
            // head-major -> out rows
            // SAFETY: as for the first transpose.
            unsafe { transpose_heads(gpu, out.ptr(), oh, s.row0, s.n, nh, hd, false) }?;
        }
        Ok(())
    }
}

/// `transpose_heads`: rows `row0..row0 + n` of `x` (`[T, nh, hd]` bf16) to head-major `y`
/// (`[nh, n, hd]`) when `to_head_major`, else `y` back into those rows of `x`.
///
/// # Safety
/// `x` must hold `row0 + n` rows of `nh * hd` and `y` `nh * n` rows of `hd` (bf16).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn transpose_heads(
    gpu: &Gpu,
    x: u64,
    y: u64,
    row0: usize,
    n: usize,
    nh: usize,
    hd: usize,
    to_head_major: bool,
) -> Result<(), CudaError> {
    let f = gpu.kernel("transpose_heads")?;
    let (row0, n_i, nh_i, hd_i) = (row0 as i32, n as i32, nh as i32, hd as i32);
    let dir = i32::from(to_head_major);
    let mut b = gpu.launch_builder(f);
    b.arg(&x)
        .arg(&y)
        .arg(&row0)
        .arg(&n_i)
        .arg(&nh_i)
        .arg(&hd_i)
        .arg(&dir);
    // SAFETY: the caller's sizes.
    unsafe { b.launch(cfg((n as u32, nh as u32, 1), 64)) }.map_err(super::drv("transpose_heads"))
}

/// `causal_softmax` over `nh * tq` rows of `tk` scores (`s` f32 -> `p` bf16): row `(h, t)` keeps
/// keys `lo..=q0 + t` (`lo` from `window`, 0 without one), scaled by `scale`.
///
/// # Safety
/// `s` and `p` must hold `nh * tq` rows of `tk`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn causal_softmax(
    gpu: &Gpu,
    s: u64,
    p: u64,
    nh: usize,
    tq: usize,
    tk: usize,
    q0: usize,
    scale: f32,
    window: usize,
) -> Result<(), CudaError> {
    let f = gpu.kernel("causal_softmax")?;
    let (tq_i, tk_i, q0_i, w_i) = (tq as i32, tk as i32, q0 as i32, window as i32);
    let mut b = gpu.launch_builder(f);
    b.arg(&s)
        .arg(&p)
        .arg(&tq_i)
        .arg(&tk_i)
        .arg(&q0_i)
        .arg(&scale)
        .arg(&w_i);
    // SAFETY: the caller's sizes.
    unsafe { b.launch(cfg(((nh * tq) as u32, 1, 1), 256)) }.map_err(super::drv("causal_softmax"))
}

/// Stages of the v3 kernels' ring (FP3_STAGES in kernels/prefill_flash_v3.cu) and their dynamic
/// shared memory (139264 bytes at hd 128).
const FLASH_V3_STAGES: usize = 4;
const V3_SMEM_HD64: usize = FLASH_V3_STAGES * 2 * 64 * (64 + 8) * BF16;
const V3_SMEM_HD128: usize = FLASH_V3_STAGES * 2 * 64 * (128 + 8) * BF16;

/// Dynamic shared memory of the wgmma kernel: 1024 bytes of alignment slack, Q (128 rows x 128
/// dims bf16) and two stages of a 128-key tile of K and of V.
pub const WGMMA_SMEM: usize = 1024 + 128 * 128 * BF16 + 2 * 2 * 128 * 128 * BF16;

/// The wgmma kernel's entry points: two warpgroups loading and computing alike, and the
/// warp-specialized one (a producer warpgroup and two consumers, same shared memory).
const WGMMA_KERNEL: &str = "flash_prefill_hd128_wg";
const WGMMA_WS_KERNEL: &str = "flash_prefill_hd128_ws";

/// Whether the wgmma kernel can run `d` on `gpu` (not where the GPU is not sm_90 or its program
/// did not load, head_dim is not 128, the block size not a power of two, or a pool layer too
/// large for its i32 block strides).
fn wgmma_fits(gpu: &Gpu, d: &AttnDims) -> bool {
    let fits = d.head_dim == 128
        && d.block_size.is_power_of_two()
        && 2 * d.block_size * d.num_kv_heads * d.head_dim <= i32::MAX as usize;
    fits && gpu.has_kernel(WGMMA_KERNEL)
}

/// A CUtensorMap as a kernel argument: `flash_prefill_hd128_ws` takes it by value
/// (`__grid_constant__`), 128 bytes the driver copies into the launch's parameters.
#[repr(transparent)]
struct TensorMapArg(cudarc::driver::sys::CUtensorMap);

// SAFETY: a plain-old-data 128-byte struct the kernel reads as its parameter of the same size
// and alignment (WsTmap in prefill_flash_wg.cu).
unsafe impl cudarc::driver::DeviceRepr for TensorMapArg {}

/// Layer `layer_ptr` of the pool as `flash_prefill_hd128_ws`'s TMA tensor map: bf16, dims
/// innermost first (head_dim 128, kv heads, block_size, K|V, blocks), box (64 dims, 1 head,
/// min(block_size, 128) rows, 1, 1), 128-byte swizzle (the layout its wgmma descriptors read),
/// elements outside the tensor read as zero.
fn kv_tensor_map(layer_ptr: u64, d: &AttnDims) -> Result<TensorMapArg, CudaError> {
    use cudarc::driver::sys;
    let (nkv, hd, bs) = (
        d.num_kv_heads as u64,
        d.head_dim as u64,
        d.block_size as u64,
    );
    let dims: [u64; 5] = [hd, nkv, bs, 2, d.num_blocks as u64];
    // bytes between consecutive indices of dims 1..4 (dim 0 is contiguous)
    let strides: [u64; 4] = [
        hd * 2,
        nkv * hd * 2,
        bs * nkv * hd * 2,
        2 * bs * nkv * hd * 2,
    ];
    let boxes: [u32; 5] = [64, 1, bs.min(128) as u32, 1, 1];
    let elem_strides: [u32; 5] = [1; 5];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array holds the rank's entries; the driver only writes `map`.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            5,
            layer_ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(super::drv("cuTensorMapEncodeTiled"))?;
    Ok(TensorMapArg(map))
}

/// The fused kernel `attn` (a flash variant; `Wgmma` only where [`PrefillScratch::wgmma_runs`],
/// its warp-specialized kernel where `ws`) for each sequence of `seqs` (already checked against
/// the step by the caller): grid (query tiles, nh), or (nh, query tiles) for v3 and wgmma.
#[allow(clippy::too_many_arguments)]
fn run_flash(
    gpu: &Gpu,
    d: &AttnDims,
    layer_ptr: u64,
    q: &DevBuf,
    out: &DevBuf,
    tables: u64,
    max_blocks: usize,
    seqs: &[LongSeq],
    attn: PrefillAttn,
    ws: bool,
    window: usize,
) -> Result<(), CudaError> {
    let (nh, nkv, hd, bs) = (d.num_heads, d.num_kv_heads, d.head_dim, d.block_size);
    // v3 addresses the pool with shifts and i32 block strides: other shapes take the w8 kernel
    let attn = if attn == PrefillAttn::FlashV3
        && (!bs.is_power_of_two() || 2 * bs * nkv * hd > i32::MAX as usize)
    {
        PrefillAttn::Flash8
    } else {
        attn
    };
    // v3's and wgmma's grid is (heads, query tiles), w8's (query tiles, heads)
    let heads_x = matches!(attn, PrefillAttn::FlashV3 | PrefillAttn::Wgmma);
    // (kernel, warps, query rows per CTA, dynamic shared bytes)
    let (name, warps, rows_per_cta, dyn_smem) = match (hd, attn) {
        // FLASH_V3_STAGES stages of K + V: 2 * 64 rows of hd + 8 bf16 each
        (64, PrefillAttn::FlashV3) => ("flash_prefill_hd64_v3", 8usize, 128usize, V3_SMEM_HD64),
        (128, PrefillAttn::FlashV3) => ("flash_prefill_hd128_v3", 8, 128, V3_SMEM_HD128),
        // only where `wgmma_runs` (the caller)
        (128, PrefillAttn::Wgmma) if ws => (WGMMA_WS_KERNEL, 12, 128, WGMMA_SMEM),
        (128, PrefillAttn::Wgmma) => (WGMMA_KERNEL, 8, 128, WGMMA_SMEM),
        (64, _) => ("flash_prefill_hd64_w8", 8, 128, 0),
        (128, _) => ("flash_prefill_hd128_w8", 8, 128, 0),
        _ => {
            return Err(CudaError::Unsupported {
                reason: format!("flash prefill attention with head_dim {hd} (64 or 128 only)"),
            });
        }
    };
    if !heads_x && nh > 65535 {
        return Err(CudaError::Shape {
            op: "flash_prefill",
            reason: format!("{nh} heads exceed the grid's y limit"),
        });
    }
    let f = gpu.kernel(name)?;
    if dyn_smem > 0 {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        f.set_attribute(
            A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            dyn_smem as i32,
        )
        .map_err(super::drv("cuFuncSetAttribute"))?;
    }
    let (nh_i, nkv_i, bs_i) = (nh as i32, nkv as i32, bs as i32);
    let kv_map = if name == WGMMA_WS_KERNEL {
        Some(kv_tensor_map(layer_ptr, d)?)
    } else {
        None
    };
    let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    let window_i = window as i32; // < the longest context (`run`), so in range
    for s in seqs {
        let table = tables + (s.seq * max_blocks * 4) as u64;
        let (row0, n, start) = (s.row0 as i32, s.n as i32, s.start as i32);
        let mut b = gpu.launch_builder(f);
        b.arg(q.ptr_ref())
            .arg(out.ptr_ref())
            .arg(&layer_ptr)
            .arg(&table)
            .arg(&row0)
            .arg(&n)
            .arg(&start)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&bs_i)
            .arg(&scale_log2)
            .arg(&window_i);
        if let Some(m) = &kv_map {
            b.arg(m);
        }
        let tiles = s.n.div_ceil(rows_per_cta);
        if heads_x && tiles > 65535 {
            return Err(CudaError::Shape {
                op: "flash_prefill",
                reason: format!("{} query rows exceed the grid's y limit", s.n),
            });
        }
        let grid = if heads_x {
            (nh as u32, tiles as u32, 1)
        } else {
            (tiles as u32, nh as u32, 1)
        };
        let lc = LaunchConfig {
            grid_dim: grid,
            block_dim: ((32 * warps) as u32, 1, 1),
            shared_mem_bytes: dyn_smem as u32,
        };
        // SAFETY: q/out hold rows row0 .. row0 + n of [T, nh, hd] (checked by `run`); the block
        // table row covers positions 0 .. start + n (checked: start + n <= max_blocks * bs) and
        // the step plan wrote those K/V into layer `layer` of the pool; the dynamic shared memory
        // is what the kernel indexes, and its limit was raised above.
        unsafe { b.launch(lc) }.map_err(super::drv(name))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::PrefillAttn;

    #[test]
    fn prefill_attn_parses_the_kept_names_only() {
        assert_eq!(PrefillAttn::parse(" Flash8 "), Some(PrefillAttn::Flash8));
        assert_eq!(PrefillAttn::parse("cublas"), Some(PrefillAttn::Gemm));
        assert_eq!(PrefillAttn::parse("gemm"), Some(PrefillAttn::Gemm));
        assert_eq!(PrefillAttn::parse("FlashV3"), Some(PrefillAttn::FlashV3));
        // retired variants and unknown names
        for gone in ["flash", "flash4", "flash32", "flashv2", "auto", "fast"] {
            assert_eq!(PrefillAttn::parse(gone), None, "{gone}");
        }
        assert_eq!(PrefillAttn::default(), PrefillAttn::Wgmma);
        assert_eq!(PrefillAttn::ALL.len(), 4);
        assert_eq!(PrefillAttn::parse("WGMMA"), Some(PrefillAttn::Wgmma));
    }
}
