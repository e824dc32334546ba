//! Launch wrappers, one per kernel. Each checks that every buffer is large enough for the shape it
//! is given before the unsafe launch, so a wrong shape is a typed error, not an out-of-bounds write.
//! bf16 buffers hold raw bf16 bits; "rows" are row-major.

use super::CudaError;
use super::device::{DevBuf, Gpu};
use cudarc::driver::LaunchConfig;

mod linear;
pub use linear::*;

mod attention;
pub use attention::*;

mod mla;
pub use mla::*;
mod moe;
pub use moe::*;

pub mod crc32c;
pub mod kvh64;

const BF16: usize = 2;
const F32: usize = 4;

fn need(op: &'static str, what: &str, buf: &DevBuf, bytes: usize) -> Result<(), CudaError> {
    if buf.bytes() < bytes {
        return Err(CudaError::Shape {
            op,
            reason: format!("{what}: {} bytes, needs {bytes}", buf.bytes()),
        });
    }
    Ok(())
}

fn shape(op: &'static str, ok: bool, reason: impl FnOnce() -> String) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape {
            op,
            reason: reason(),
        })
    }
}

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn u32_of(op: &'static str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        reason: format!("{v} exceeds u32"),
    })
}

fn launched(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    super::drv(op)
}

/// Grid size for grid-stride loops.
fn stride_grid(gpu: &Gpu, n: usize, block: usize) -> u32 {
    (n.div_ceil(block)).clamp(1, gpu.sm_count as usize * 16) as u32
}

/// `resid[t] = f32(table[ids[t]])`; `ids`: u32 `[tokens]` (checked `< vocab` by the caller).
pub fn embed_gather(
    gpu: &Gpu,
    table: &DevBuf,
    vocab: usize,
    ids: u64,
    tokens: usize,
    resid: &DevBuf,
    hidden: usize,
) -> Result<(), CudaError> {
    const OP: &str = "embed_gather";
    need(OP, "table", table, vocab * hidden * BF16)?;
    need(OP, "resid", resid, tokens * hidden * F32)?;
    if tokens == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let h = hidden as i32;
    let mut b = gpu.launch_builder(f);
    b.arg(table.ptr_ref())
        .arg(&ids)
        .arg(resid.ptr_ref())
        .arg(&h);
    // SAFETY: sizes checked above; `ids` holds `tokens` ids below `vocab` (caller contract).
    unsafe { b.launch(cfg((u32_of(OP, tokens)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// Which kernel [`add_rmsnorm_with`] and [`swiglu_with`] run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EwKernel {
    /// 16-byte loads and stores (`swiglu_v8`; `add_rmsnorm_v4`, one pass with the row held in
    /// registers): taken wherever the shape and the pointers' alignment allow it.
    Vector,
    /// The first kernels (`swiglu`, `add_rmsnorm`): any shape, any alignment.
    Scalar,
}

/// float4 words of a row each `add_rmsnorm_v4` thread holds (`RMS_V4_MAX` in elementwise.cu).
const RMS_V4_MAX: usize = 8;
/// Threads per block of `swiglu_v8`.
const SWIGLU_V8_BLOCK: u32 = 128;
/// 16-byte words of gate (and of up) per `swiglu_v8` thread and row (`SWIGLU_V8_UNROLL`).
const SWIGLU_V8_UNROLL: usize = 2;
/// The most rows `swiglu_v8` puts on grid y (the hardware limit); more rows loop.
const GRID_Y_MAX: usize = 65535;

/// Most threads of an `add_rmsnorm_v4` block (see [`rmsnorm_vector_block`]).
const RMS_V4_MAX_BLOCK: usize = 512;

/// Threads per block of `add_rmsnorm_v4` for rows of `hidden` f32, or `None` where it cannot run:
/// `hidden` not a multiple of 4, a row longer than `4 * RMS_V4_MAX * 512` floats (16384), an f32
/// pointer (resid, delta, w) not 16-byte aligned, or `out` not 8-byte aligned. The block is the
/// fewest warps that cover the row with `RMS_V4_MAX` float4 words a thread (128 threads at 4096).
pub fn rmsnorm_vector_block(hidden: usize, f32_ptrs: &[u64], out: u64) -> Option<u32> {
    if hidden == 0
        || !hidden.is_multiple_of(4)
        || f32_ptrs.iter().any(|p| !p.is_multiple_of(16))
        || !out.is_multiple_of(8)
    {
        return None;
    }
    let block = (hidden / 4).div_ceil(RMS_V4_MAX).div_ceil(32) * 32;
    // At most 512 threads: the kernel keeps the row in registers (70 a thread on sm_90), and a
    // 1024-thread block of it asks for more than the 64K registers of a block
    // (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES at hidden 32768 on the H200). Rows up to 16384.
    (block <= RMS_V4_MAX_BLOCK).then_some(block as u32)
}

/// Grid `(blocks per row, rows on y)` of `swiglu_v8`, or `None` where it cannot run: `inter` not
/// a multiple of 8, `gu` or `out` not 16-byte aligned (or nothing to do).
pub fn swiglu_vector_grid(tokens: usize, inter: usize, gu: u64, out: u64) -> Option<(u32, u32)> {
    if tokens == 0
        || inter == 0
        || !inter.is_multiple_of(8)
        || !gu.is_multiple_of(16)
        || !out.is_multiple_of(16)
    {
        return None;
    }
    let per_block = SWIGLU_V8_BLOCK as usize * SWIGLU_V8_UNROLL;
    let x = u32::try_from((inter / 8).div_ceil(per_block)).ok()?;
    Some((x, tokens.min(GRID_Y_MAX) as u32))
}

/// `v` as a kernel's `int` argument.
fn i32_of(op: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        reason: format!("{v} exceeds i32"),
    })
}

/// Optional `resid[s] += delta[s]`, then `out[r] = rmsnorm(resid[s]) * w` for `r < rows_n`, with
/// `s = rows[r]` when `rows` (a device i32 array of `rows_n` indices `< resid_rows`) is given.
/// Runs the vectorized one-pass kernel where it can ([`add_rmsnorm_with`]).
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm(
    gpu: &Gpu,
    resid: &DevBuf,
    resid_rows: usize,
    delta: Option<&DevBuf>,
    w: &DevBuf,
    out: &DevBuf,
    rows: Option<u64>,
    rows_n: usize,
    hidden: usize,
    eps: f32,
) -> Result<(), CudaError> {
    add_rmsnorm_with(
        gpu, resid, resid_rows, delta, w, out, rows, rows_n, hidden, eps, None,
    )
    .map(|_| ())
}

/// [`add_rmsnorm`] with the kernel chosen: `None` takes [`EwKernel::Vector`] where
/// [`rmsnorm_vector_block`] allows it, else [`EwKernel::Scalar`]; `Some(k)` runs `k` (a shape
/// error when `Vector` cannot run). Returns the kernel that ran (also for `rows_n == 0`, where
/// nothing is launched).
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_with(
    gpu: &Gpu,
    resid: &DevBuf,
    resid_rows: usize,
    delta: Option<&DevBuf>,
    w: &DevBuf,
    out: &DevBuf,
    rows: Option<u64>,
    rows_n: usize,
    hidden: usize,
    eps: f32,
    kernel: Option<EwKernel>,
) -> Result<EwKernel, CudaError> {
    const OP: &str = "add_rmsnorm";
    need(OP, "resid", resid, resid_rows * hidden * F32)?;
    if let Some(d) = delta {
        need(OP, "delta", d, resid_rows * hidden * F32)?;
    }
    need(OP, "w", w, hidden * F32)?;
    need(OP, "out", out, rows_n * hidden * BF16)?;
    shape(OP, rows.is_some() || rows_n <= resid_rows, || {
        format!("{rows_n} rows of {resid_rows}")
    })?;
    let dp = delta.map_or(0u64, |d| d.ptr());
    let f32_ptrs = [resid.ptr(), dp, w.ptr()];
    let vector = rmsnorm_vector_block(hidden, &f32_ptrs, out.ptr());
    let (k, block) = match (kernel, vector) {
        (None | Some(EwKernel::Vector), Some(b)) => (EwKernel::Vector, b),
        (Some(EwKernel::Vector), None) => {
            return Err(CudaError::Shape {
                op: OP,
                reason: format!(
                    "add_rmsnorm_v4 needs hidden % 4 == 0 and <= {}, 16-byte aligned f32 \
                     and 8-byte aligned bf16 pointers (hidden {hidden})",
                    4 * RMS_V4_MAX * 1024
                ),
            });
        }
        (None | Some(EwKernel::Scalar), _) => (EwKernel::Scalar, 256),
    };
    if rows_n == 0 {
        return Ok(k);
    }
    let f = gpu.kernel(match k {
        EwKernel::Vector => "add_rmsnorm_v4",
        EwKernel::Scalar => "add_rmsnorm",
    })?;
    let (rp, h) = (rows.unwrap_or(0), i32_of(OP, hidden)?);
    let mut b = gpu.launch_builder(f);
    b.arg(resid.ptr_ref())
        .arg(&dp)
        .arg(w.ptr_ref())
        .arg(out.ptr_ref())
        .arg(&rp)
        .arg(&h)
        .arg(&eps);
    // SAFETY: sizes checked above (and, for the vector kernel, the alignment and that a block of
    // `block` threads covers the row); row indices are the caller's (< resid_rows).
    unsafe { b.launch(cfg((u32_of(OP, rows_n)?, 1, 1), block)) }.map_err(launched(OP))?;
    Ok(k)
}

/// `out[t, i] = silu(gu[t, i]) * gu[t, inter + i]`. Runs the vectorized kernel where it can
/// ([`swiglu_with`]); both kernels give bit-identical outputs.
pub fn swiglu(
    gpu: &Gpu,
    gu: &DevBuf,
    out: &DevBuf,
    tokens: usize,
    inter: usize,
) -> Result<(), CudaError> {
    swiglu_with(gpu, gu, out, tokens, inter, None).map(|_| ())
}

/// [`swiglu`] with the kernel chosen: `None` takes [`EwKernel::Vector`] where
/// [`swiglu_vector_grid`] allows it, else [`EwKernel::Scalar`]; `Some(k)` runs `k` (a shape
/// error when `Vector` cannot run). Returns the kernel that ran (nothing is launched for an
/// empty shape: then `Scalar` unless `Vector` was asked for).
pub fn swiglu_with(
    gpu: &Gpu,
    gu: &DevBuf,
    out: &DevBuf,
    tokens: usize,
    inter: usize,
    kernel: Option<EwKernel>,
) -> Result<EwKernel, CudaError> {
    const OP: &str = "swiglu";
    need(OP, "gu", gu, tokens * 2 * inter * BF16)?;
    need(OP, "out", out, tokens * inter * BF16)?;
    let (t, i) = (i32_of(OP, tokens)?, i32_of(OP, inter)?);
    if tokens * inter == 0 {
        return Ok(kernel.unwrap_or(EwKernel::Scalar));
    }
    let vector = swiglu_vector_grid(tokens, inter, gu.ptr(), out.ptr());
    let (k, grid, block) = match (kernel, vector) {
        (None | Some(EwKernel::Vector), Some((x, y))) => {
            (EwKernel::Vector, (x, y, 1), SWIGLU_V8_BLOCK)
        }
        (Some(EwKernel::Vector), None) => {
            return Err(CudaError::Shape {
                op: OP,
                reason: format!(
                    "swiglu_v8 needs inter % 8 == 0 and 16-byte aligned gu and out (inter {inter})"
                ),
            });
        }
        (None | Some(EwKernel::Scalar), _) => (
            EwKernel::Scalar,
            (stride_grid(gpu, tokens * inter, 256), 1, 1),
            256,
        ),
    };
    let f = gpu.kernel(match k {
        EwKernel::Vector => "swiglu_v8",
        EwKernel::Scalar => "swiglu",
    })?;
    let mut b = gpu.launch_builder(f);
    b.arg(gu.ptr_ref()).arg(out.ptr_ref()).arg(&t).arg(&i);
    // SAFETY: sizes checked above (and, for the vector kernel, inter % 8 and the alignment).
    unsafe { b.launch(cfg(grid, block)) }.map_err(launched(OP))?;
    Ok(k)
}

/// Fills `n` bf16 elements of `p` with uniform(-scale, scale) values hashed from `(seed, index)`.
pub fn fill_uniform_bf16(
    gpu: &Gpu,
    p: &DevBuf,
    n: usize,
    seed: u64,
    scale: f32,
) -> Result<(), CudaError> {
    const OP: &str = "fill_uniform_bf16";
    need(OP, "p", p, n * BF16)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let nn = n as i64;
    let mut b = gpu.launch_builder(f);
    b.arg(p.ptr_ref()).arg(&nn).arg(&seed).arg(&scale);
    // SAFETY: size checked above.
    unsafe { b.launch(cfg((stride_grid(gpu, n, 256), 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// Writes a `rows x cols` block of the random matrix [`fill_uniform_bf16`] would generate with
/// `seed`: element `(r, c)` of `p` (at byte offset `off`) gets the value of global element
/// `src_off + r * src_ld + c`. Tensor-parallel shards of dummy weights use it.
#[allow(clippy::too_many_arguments)]
pub fn fill_uniform_bf16_2d(
    gpu: &Gpu,
    p: &DevBuf,
    off: usize,
    rows: usize,
    cols: usize,
    src_ld: usize,
    src_off: usize,
    seed: u64,
    scale: f32,
) -> Result<(), CudaError> {
    const OP: &str = "fill_uniform_bf16_2d";
    let n = rows * cols;
    need(OP, "p", p, off + n * BF16)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let ptr = p.at(off);
    let (r, c, ld, so) = (rows as i64, cols as i64, src_ld as i64, src_off as i64);
    let mut b = gpu.launch_builder(f);
    b.arg(&ptr)
        .arg(&r)
        .arg(&c)
        .arg(&ld)
        .arg(&so)
        .arg(&seed)
        .arg(&scale);
    // SAFETY: `off + rows * cols` bf16 elements checked above.
    unsafe { b.launch(cfg((stride_grid(gpu, n, 256), 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// Fills `n` f32 elements of `p` with `v`.
pub fn fill_f32(gpu: &Gpu, p: &DevBuf, n: usize, v: f32) -> Result<(), CudaError> {
    const OP: &str = "fill_f32";
    need(OP, "p", p, n * F32)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let nn = n as i64;
    let mut b = gpu.launch_builder(f);
    b.arg(p.ptr_ref()).arg(&nn).arg(&v);
    // SAFETY: size checked above.
    unsafe { b.launch(cfg((stride_grid(gpu, n, 256), 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// Attention geometry shared by the RoPE and attention kernels.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Blocks in the pool (per layer).
    pub num_blocks: usize,
}

impl AttnDims {
    fn check(&self, op: &'static str) -> Result<(), CudaError> {
        let d = *self;
        shape(
            op,
            d.num_kv_heads > 0
                && d.num_heads.is_multiple_of(d.num_kv_heads)
                && d.head_dim.is_multiple_of(2)
                && d.head_dim > 0
                && d.head_dim <= 256
                && d.block_size > 0,
            || format!("{d:?}: need nh % nkv == 0, even head_dim <= 256"),
        )
    }
    /// Elements (bf16) of one layer of the pool.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * 2 * self.block_size * self.num_kv_heads * self.head_dim
    }
}

/// Which kernel [`rope_qkv_ex`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKernel {
    /// `Vector` where it applies and the step has at least [`ROPE_V4_MIN_TOKENS`] tokens (prefill
    /// steps; decode steps keep the kernel they were measured with), else `Scalar`.
    Auto,
    /// `rope_qkv`: a block of hd / 2 threads per (token, head), any bias / q-k norm.
    Scalar,
    /// `rope_qkv_v4`: a block per token, 8-byte vectors, cos / sin once per token; no bias, no
    /// q/k norm, `hd % 8 == 0` and `(nh + nkv) hd / 8 <= 1024` (else it is a shape error).
    Vector,
}

/// Fewest tokens of a step that [`RopeKernel::Auto`] gives the vectorized kernel. On the H200 at
/// 8192 tokens the scalar kernel took 0.40 ms a layer (327680 blocks of 64 threads) for ~200 MB.
pub const ROPE_V4_MIN_TOKENS: usize = 128;

/// Bias, q/k norm and RoPE on `qkv` `[tokens, (nh + 2 nkv) hd]`; q to `q_out` `[tokens, nh, hd]`,
/// k/v to layer `layer` of `pool` at `slots[t]` (device i64, `block * block_size + slot`).
/// `pos`: device i32 `[tokens]`; `inv_freq`: f32 `[hd / 2]`. The kernel: [`RopeKernel::Auto`].
#[allow(clippy::too_many_arguments)]
pub fn rope_qkv(
    gpu: &Gpu,
    d: &AttnDims,
    qkv: &DevBuf,
    bias: Option<&DevBuf>,
    q_norm: Option<&DevBuf>,
    k_norm: Option<&DevBuf>,
    inv_freq: &DevBuf,
    pos: u64,
    slots: u64,
    tokens: usize,
    q_out: &DevBuf,
    pool: &DevBuf,
    layer: usize,
    eps: f32,
) -> Result<(), CudaError> {
    rope_qkv_ex(
        gpu,
        d,
        qkv,
        bias,
        q_norm,
        k_norm,
        inv_freq,
        pos,
        slots,
        tokens,
        q_out,
        pool,
        layer,
        eps,
        RopeKernel::Auto,
    )
}

/// [`rope_qkv`] with the kernel chosen by `kernel`.
#[allow(clippy::too_many_arguments)]
pub fn rope_qkv_ex(
    gpu: &Gpu,
    d: &AttnDims,
    qkv: &DevBuf,
    bias: Option<&DevBuf>,
    q_norm: Option<&DevBuf>,
    k_norm: Option<&DevBuf>,
    inv_freq: &DevBuf,
    pos: u64,
    slots: u64,
    tokens: usize,
    q_out: &DevBuf,
    pool: &DevBuf,
    layer: usize,
    eps: f32,
    kernel: RopeKernel,
) -> Result<(), CudaError> {
    const OP: &str = "rope_qkv";
    d.check(OP)?;
    let (nh, nkv, hd) = (d.num_heads, d.num_kv_heads, d.head_dim);
    need(OP, "qkv", qkv, tokens * (nh + 2 * nkv) * hd * BF16)?;
    if let Some(b) = bias {
        need(OP, "bias", b, (nh + 2 * nkv) * hd * F32)?;
    }
    for (n, x) in [("q_norm", q_norm), ("k_norm", k_norm)] {
        if let Some(x) = x {
            need(OP, n, x, hd * F32)?;
        }
    }
    need(OP, "inv_freq", inv_freq, hd / 2 * F32)?;
    need(OP, "q_out", q_out, tokens * nh * hd * BF16)?;
    need(OP, "pool", pool, (layer + 1) * d.layer_elems() * BF16)?;
    if tokens == 0 {
        return Ok(());
    }
    let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
    let plain = bias.is_none() && q_norm.is_none() && k_norm.is_none();
    let vec_threads = (nh + nkv) * hd / 8;
    let aligned = [qkv.ptr(), q_out.ptr(), layer_ptr]
        .iter()
        .all(|p| p.is_multiple_of(8));
    let vec_ok = plain && aligned && hd.is_multiple_of(8) && vec_threads <= 1024;
    let vector = match kernel {
        RopeKernel::Auto => vec_ok && tokens >= ROPE_V4_MIN_TOKENS,
        RopeKernel::Scalar => false,
        RopeKernel::Vector => {
            shape(OP, vec_ok, || {
                format!(
                    "rope_qkv_v4 needs no bias / q-k norm, hd % 8 == 0 and (nh + nkv) hd / 8 <= 1024 \
                     (nh {nh}, nkv {nkv}, hd {hd})"
                )
            })?;
            true
        }
    };
    if vector {
        let f = gpu.kernel("rope_qkv_v4")?;
        let (nh_i, nkv_i, hd_i, bs_i) = (nh as i32, nkv as i32, hd as i32, d.block_size as i32);
        let mut b = gpu.launch_builder(f);
        b.arg(qkv.ptr_ref())
            .arg(inv_freq.ptr_ref())
            .arg(&pos)
            .arg(&slots)
            .arg(q_out.ptr_ref())
            .arg(&layer_ptr)
            .arg(&nh_i)
            .arg(&nkv_i)
            .arg(&hd_i)
            .arg(&bs_i);
        let lc = LaunchConfig {
            grid_dim: (u32_of(OP, tokens)?, 1, 1),
            block_dim: (vec_threads as u32, 1, 1),
            shared_mem_bytes: (hd * F32) as u32,
        };
        // SAFETY: sizes checked above (every buffer's extent; 8-byte vectors: hd % 8 == 0 and
        // 8-byte aligned bases, checked); slots are the caller's (block < num_blocks).
        unsafe { b.launch(lc) }.map_err(launched(OP))?;
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (bp, qn, kn) = (
        bias.map_or(0u64, |x| x.ptr()),
        q_norm.map_or(0u64, |x| x.ptr()),
        k_norm.map_or(0u64, |x| x.ptr()),
    );
    let (nh_i, nkv_i, hd_i, bs_i) = (nh as i32, nkv as i32, hd as i32, d.block_size as i32);
    let mut b = gpu.launch_builder(f);
    b.arg(qkv.ptr_ref())
        .arg(&bp)
        .arg(&qn)
        .arg(&kn)
        .arg(inv_freq.ptr_ref())
        .arg(&pos)
        .arg(&slots)
        .arg(q_out.ptr_ref())
        .arg(&layer_ptr)
        .arg(&nh_i)
        .arg(&nkv_i)
        .arg(&hd_i)
        .arg(&bs_i)
        .arg(&eps);
    let block = (hd / 2).div_ceil(32) * 32;
    // SAFETY: sizes checked above; slots are the caller's (block < num_blocks).
    unsafe {
        b.launch(cfg(
            (u32_of(OP, tokens)?, (nh + nkv) as u32, 1),
            block as u32,
        ))
    }
    .map_err(launched(OP))?;
    Ok(())
}

/// Copies layers `layer0..layer0 + nlayers` of `nblocks` blocks (device i32 ids) between `pool`
/// (`[layers][num_blocks][layer-block]`) and `staging` (`[nlayers][nblocks][layer-block]`).
/// `gather = true`: pool -> staging.
#[allow(clippy::too_many_arguments)]
pub fn kv_copy(
    gpu: &Gpu,
    gather: bool,
    pool: &DevBuf,
    staging: &DevBuf,
    blocks: u64,
    nblocks: usize,
    layer0: usize,
    nlayers: usize,
    num_blocks: usize,
    layer_block_bytes: usize,
) -> Result<(), CudaError> {
    const OP: &str = "kv_copy";
    shape(OP, layer_block_bytes.is_multiple_of(16), || {
        format!("layer-block of {layer_block_bytes} bytes is not a multiple of 16")
    })?;
    need(
        OP,
        "pool",
        pool,
        (layer0 + nlayers) * num_blocks * layer_block_bytes,
    )?;
    need(
        OP,
        "staging",
        staging,
        nlayers * nblocks * layer_block_bytes,
    )?;
    if nblocks * nlayers == 0 {
        return Ok(());
    }
    let f = gpu.kernel(if gather { "kv_gather" } else { "kv_scatter" })?;
    let (nb, l0, numb, lbv) = (
        nblocks as i32,
        layer0 as i32,
        num_blocks as i32,
        (layer_block_bytes / 16) as i64,
    );
    let stride = lbv * nblocks as i64;
    let mut b = gpu.launch_builder(f);
    b.arg(pool.ptr_ref())
        .arg(staging.ptr_ref())
        .arg(&blocks)
        .arg(&nb)
        .arg(&l0)
        .arg(&numb)
        .arg(&lbv)
        .arg(&stride);
    // SAFETY: sizes checked above; block ids are the caller's (< num_blocks).
    unsafe { b.launch(cfg((u32_of(OP, nblocks * nlayers)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_vector_block_covers_the_row() {
        // the fewest warps holding RMS_V4_MAX float4 words a thread
        assert_eq!(rmsnorm_vector_block(4096, &[0, 0, 256], 512), Some(128));
        assert_eq!(rmsnorm_vector_block(8192, &[16, 0, 32], 8), Some(256));
        assert_eq!(rmsnorm_vector_block(576, &[0], 0), Some(32));
        assert_eq!(rmsnorm_vector_block(4, &[0], 0), Some(32));
        assert_eq!(rmsnorm_vector_block(4136, &[0], 0), Some(160));
        assert_eq!(rmsnorm_vector_block(16384, &[0], 0), Some(512));
        assert_eq!(
            rmsnorm_vector_block(32768, &[0], 0),
            None,
            "registers: scalar kernel"
        );
        for h in [64usize, 576, 896, 2048, 4096, 4136, 5120, 8192, 16384] {
            let b = rmsnorm_vector_block(h, &[0], 0).unwrap() as usize;
            assert!(b.is_multiple_of(32) && b <= 1024, "{h}: {b}");
            assert!(
                b * RMS_V4_MAX * 4 >= h,
                "{h}: {b} threads do not cover the row"
            );
            assert!(
                (b - 32) * RMS_V4_MAX * 4 < h,
                "{h}: {b} threads, a warp too many"
            );
        }
    }

    #[test]
    fn rmsnorm_vector_refuses_what_it_cannot_run() {
        assert_eq!(rmsnorm_vector_block(4097, &[0], 0), None, "hidden % 4");
        assert_eq!(rmsnorm_vector_block(4098, &[0], 0), None, "hidden % 4");
        assert_eq!(rmsnorm_vector_block(0, &[0], 0), None);
        assert_eq!(
            rmsnorm_vector_block(32772, &[0], 0),
            None,
            "row past 1024 threads"
        );
        assert_eq!(
            rmsnorm_vector_block(4096, &[0, 8, 0], 0),
            None,
            "delta at 8 bytes"
        );
        assert_eq!(
            rmsnorm_vector_block(4096, &[4], 0),
            None,
            "resid at 4 bytes"
        );
        assert_eq!(rmsnorm_vector_block(4096, &[0], 4), None, "out at 4 bytes");
        assert_eq!(
            rmsnorm_vector_block(4096, &[0], 8),
            Some(128),
            "out at 8 bytes is enough"
        );
    }

    #[test]
    fn swiglu_vector_grid_covers_every_word() {
        // Llama-3.1-8B: 1792 words a row, 256 a block
        assert_eq!(swiglu_vector_grid(8192, 14336, 0, 256), Some((7, 8192)));
        assert_eq!(swiglu_vector_grid(1, 8, 16, 32), Some((1, 1)));
        assert_eq!(swiglu_vector_grid(100_000, 1536, 0, 0), Some((1, 65535)));
        for inter in [8usize, 256, 1000, 1536, 2048, 2056, 7168, 14336] {
            let (x, _) = swiglu_vector_grid(3, inter, 0, 0).unwrap();
            let per = (SWIGLU_V8_BLOCK as usize) * SWIGLU_V8_UNROLL;
            assert!(x as usize * per * 8 >= inter, "{inter}: {x} blocks short");
            assert!(
                (x as usize - 1) * per * 8 < inter,
                "{inter}: {x} blocks, one too many"
            );
        }
    }

    #[test]
    fn swiglu_vector_refuses_what_it_cannot_run() {
        assert_eq!(swiglu_vector_grid(4, 1004, 0, 0), None, "inter % 8");
        assert_eq!(swiglu_vector_grid(4, 1024, 8, 0), None, "gu at 8 bytes");
        assert_eq!(swiglu_vector_grid(4, 1024, 0, 2), None, "out at 2 bytes");
        assert_eq!(swiglu_vector_grid(0, 1024, 0, 0), None);
        assert_eq!(swiglu_vector_grid(4, 0, 0, 0), None);
    }
}
