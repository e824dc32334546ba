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

/// Optional `resid[s] += delta[s]`, then `out[r] = rmsnorm(resid[s]) * w` for `r < rows_n`, with
/// `s = rows[r]` when `rows` (a device i32 array of `rows_n` indices `< resid_rows`) is given.
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
    if rows_n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (dp, rp, h) = (
        delta.map_or(0u64, |d| d.ptr()),
        rows.unwrap_or(0),
        hidden as i32,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(resid.ptr_ref())
        .arg(&dp)
        .arg(w.ptr_ref())
        .arg(out.ptr_ref())
        .arg(&rp)
        .arg(&h)
        .arg(&eps);
    // SAFETY: sizes checked above; row indices are the caller's (< resid_rows).
    unsafe { b.launch(cfg((u32_of(OP, rows_n)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// `out[t, i] = silu(gu[t, i]) * gu[t, inter + i]`.
pub fn swiglu(
    gpu: &Gpu,
    gu: &DevBuf,
    out: &DevBuf,
    tokens: usize,
    inter: usize,
) -> Result<(), CudaError> {
    const OP: &str = "swiglu";
    need(OP, "gu", gu, tokens * 2 * inter * BF16)?;
    need(OP, "out", out, tokens * inter * BF16)?;
    if tokens * inter == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (t, i) = (tokens as i32, inter as i32);
    let mut b = gpu.launch_builder(f);
    b.arg(gu.ptr_ref()).arg(out.ptr_ref()).arg(&t).arg(&i);
    // SAFETY: sizes checked above.
    unsafe { b.launch(cfg((stride_grid(gpu, tokens * inter, 256), 1, 1), 256)) }
        .map_err(launched(OP))?;
    Ok(())
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

/// Bias, q/k norm and RoPE on `qkv` `[tokens, (nh + 2 nkv) hd]`; q to `q_out` `[tokens, nh, hd]`,
/// k/v to layer `layer` of `pool` at `slots[t]` (device i64, `block * block_size + slot`).
/// `pos`: device i32 `[tokens]`; `inv_freq`: f32 `[hd / 2]`.
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
    let f = gpu.kernel(OP)?;
    let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
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
    let mut b = gpu.launch_builder(f);
    b.arg(pool.ptr_ref())
        .arg(staging.ptr_ref())
        .arg(&blocks)
        .arg(&nb)
        .arg(&l0)
        .arg(&numb)
        .arg(&lbv);
    // SAFETY: sizes checked above; block ids are the caller's (< num_blocks).
    unsafe { b.launch(cfg((u32_of(OP, nblocks * nlayers)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}
