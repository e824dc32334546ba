//! Launch wrappers, one per kernel. Each checks that every buffer is large enough for the shape it
//! is given before the unsafe launch, so a wrong shape is a typed error, not an out-of-bounds write.
//! bf16 buffers hold raw bf16 bits; "rows" are row-major.

use super::CudaError;
use super::device::{DevBuf, Gpu};
use cudarc::driver::{LaunchConfig, PushKernelArg};

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
    let mut b = gpu.stream.launch_builder(f);
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
    let mut b = gpu.stream.launch_builder(f);
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
    let mut b = gpu.stream.launch_builder(f);
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
    let mut b = gpu.stream.launch_builder(f);
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
    let mut b = gpu.stream.launch_builder(f);
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
    let mut b = gpu.stream.launch_builder(f);
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
    let mut b = gpu.stream.launch_builder(f);
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

/// Split-K workspace of [`paged_attention`]: `part_ml` f32 `[rows, nsplit, 2]`,
/// `part_acc` f32 `[rows, nsplit, hd]` with `rows = tokens * nh`.
pub struct AttnWorkspace<'a> {
    pub part_ml: &'a DevBuf,
    pub part_acc: &'a DevBuf,
}

/// Which paged-attention kernel to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnVariant {
    /// v3 when the head_dim allows it, else v2, else v1 ([`auto_variant`]; the environment
    /// variable `PDNODE_ATTN_KERNEL` overrides it).
    Auto,
    /// attention.cu: a warp per key, any even head_dim <= 256, up to 8 heads per block.
    V1,
    /// attention_v2.cu: lane groups per key, 16-byte loads, up to 4 heads per block; 16 dims
    /// per lane from head_dim 128 up (fewer shuffles, more registers).
    V2,
    /// attention_v2.cu with 8 dims per lane at every head_dim (fewer registers, more shuffles).
    V2Narrow,
    /// attention_v3.cu: K/V tiles staged in shared memory by cp.async, every query head of a
    /// GQA group (up to 8) per block, one online-softmax update per tile; head_dim 64 or 128.
    /// Kernels `paged_attention_v3_d{64,128}_g{4,8}` ([`v3_heads_per_block`]).
    V3,
}

impl AttnVariant {
    /// Parses `auto`, `v1`, `v2`, `v2narrow`, `v3` (the names of the `PDNODE_ATTN_KERNEL`
    /// override and of the benchmarks).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "v1" => Self::V1,
            "v2" => Self::V2,
            "v2narrow" => Self::V2Narrow,
            "v3" => Self::V3,
            _ => return None,
        })
    }
}

/// What [`AttnVariant::Auto`] runs: the `PDNODE_ATTN_KERNEL` environment variable (`v1`, `v2`,
/// `v2narrow`, `v3`; read once per process) when set, so a faulty kernel can be switched off on a
/// GPU host without a rebuild; else v3 for head_dim 64 / 128, v2 where it runs, v1 otherwise.
pub fn auto_variant(hd: usize) -> AttnVariant {
    static FORCED: std::sync::OnceLock<Option<AttnVariant>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| {
        std::env::var("PDNODE_ATTN_KERNEL")
            .ok()
            .and_then(|v| AttnVariant::parse(&v))
            .filter(|v| *v != AttnVariant::Auto)
    });
    let runs = |v: AttnVariant| match v {
        AttnVariant::V3 => v3_supports(hd),
        AttnVariant::V2 => v2_dims_per_lane(hd).is_some(),
        AttnVariant::V2Narrow => hd >= 8 && hd.is_multiple_of(8) && 32 % (hd / 8) == 0,
        AttnVariant::V1 => true,
        AttnVariant::Auto => false,
    };
    match forced {
        Some(v) if runs(v) => v,
        _ if v3_supports(hd) => AttnVariant::V3,
        _ if v2_dims_per_lane(hd).is_some() => AttnVariant::V2,
        _ => AttnVariant::V1,
    }
}

/// Asks once per loaded function for the largest shared-memory carveout: a v3 block holds about
/// 40 KB of static shared memory and 5 blocks per SM need about 205 KB, more than the driver's
/// default split with L1 may leave.
fn prefer_shared_memory(f: &cudarc::driver::CudaFunction) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    use std::sync::{Mutex, OnceLock};
    static DONE: OnceLock<Mutex<std::collections::HashSet<usize>>> = OnceLock::new();
    let key = f.cu_function() as usize;
    let mut done = DONE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if done.insert(key) {
        f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
            .map_err(super::drv("cuFuncSetAttribute"))?;
    }
    Ok(())
}

/// Head dims the v3 kernel is compiled for.
pub fn v3_supports(hd: usize) -> bool {
    hd == 64 || hd == 128
}

/// Query heads one v3 block serves for a GQA group of `g` heads: the `_g4` kernels for groups up
/// to 4, the `_g8` ones otherwise (groups above 8 take `ceil(g / 8)` blocks per KV head).
pub fn v3_heads_per_block(g: usize) -> usize {
    if g <= 4 { 4 } else { 8 }
}
/// Block-table entries of one partition the v3 kernel stages in shared memory (`ATT3_BT`).
pub const V3_BT_ENTRIES: usize = 512;

/// Partitions of the v3 kernel for `work` (token, head group) blocks and contexts up to
/// `max_ctx`: about 16 blocks per SM (4 resident, several waves so uneven contexts balance), at
/// least 128 keys per partition, each partition's block-table slice within [`V3_BT_ENTRIES`],
/// and no more partials than the workspace holds (`ws_rows_splits / partial_rows`). Returns
/// `(nsplit, split_len)` with `nsplit * split_len >= max_ctx > (nsplit - 1) * split_len`.
pub fn attention_splits_v3(
    sm_count: usize,
    work: usize,
    max_ctx: usize,
    block_size: usize,
    partial_rows: usize,
    ws_rows_splits: usize,
) -> (usize, usize) {
    let max_ctx = max_ctx.max(1);
    let want = (sm_count * 16).div_ceil(work.max(1));
    let nsplit = want.min(max_ctx.div_ceil(128)).max(1);
    // Partitions start at multiples of split_len: with split_len a multiple of the block size
    // they are block-aligned and span split_len / block_size blocks, else one more.
    let bs = block_size.max(1);
    let (align, max_len) = if bs.is_multiple_of(16) {
        (bs, V3_BT_ENTRIES * bs)
    } else {
        (16, (V3_BT_ENTRIES - 1) * bs / 16 * 16)
    };
    let mut split_len = max_ctx
        .div_ceil(nsplit)
        .next_multiple_of(align)
        .min(max_len);
    let cap = (ws_rows_splits / partial_rows.max(1)).max(1);
    if max_ctx.div_ceil(split_len) > cap {
        split_len = max_ctx.div_ceil(cap);
    }
    (max_ctx.div_ceil(split_len), split_len)
}

/// Dims per lane of the v2 kernel for `hd`, if it can run it.
pub fn v2_dims_per_lane(hd: usize) -> Option<usize> {
    let dpl = if hd >= 128 { 16 } else { 8 };
    let lpk = hd / dpl;
    (hd.is_multiple_of(dpl) && lpk >= 1 && 32 % lpk == 0).then_some(dpl)
}

/// Splits for `work` (token, head group) blocks: enough blocks to fill the device, at least 64
/// keys per split, no more partials than the workspace holds. Returns `(nsplit, split_len)`.
pub fn attention_splits(
    sm_count: usize,
    work: usize,
    max_ctx: usize,
    partial_rows: usize,
    ws_rows_splits: usize,
) -> (usize, usize) {
    let target = sm_count * 4;
    let mut nsplit = if work >= target {
        1
    } else {
        target.div_ceil(work.max(1))
    };
    nsplit = nsplit.min(max_ctx.div_ceil(64)).max(1);
    let cap = ws_rows_splits / partial_rows.max(1);
    nsplit = nsplit.min(cap.max(1));
    let split_len = max_ctx.div_ceil(nsplit);
    (max_ctx.div_ceil(split_len), split_len)
}

/// Attention of `tokens` query rows `q` `[tokens, nh, hd]` over layer `layer` of `pool`. Token
/// `t` belongs to sequence `tok_seq[t]` (device i32) at position `tok_pos[t]` (device i32) and
/// attends to keys `0..=tok_pos[t]` through `block_tables` (device i32 `[S, max_blocks]`).
/// `max_ctx` bounds `tok_pos[t] + 1`. Writes `out` `[tokens, nh, hd]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    gpu: &Gpu,
    d: &AttnDims,
    q: &DevBuf,
    pool: &DevBuf,
    layer: usize,
    tok_seq: u64,
    tok_pos: u64,
    block_tables: u64,
    max_blocks: usize,
    tokens: usize,
    max_ctx: usize,
    out: &DevBuf,
    ws: &AttnWorkspace<'_>,
) -> Result<(), CudaError> {
    let meta = AttnMeta {
        tok_seq,
        tok_pos,
        block_tables,
        max_blocks,
        max_ctx,
    };
    paged_attention_ex(
        gpu,
        d,
        q,
        pool,
        layer,
        &meta,
        tokens,
        None,
        out,
        ws,
        AttnVariant::Auto,
    )
}

/// Per-token metadata of a step (device pointers) for [`paged_attention_ex`].
#[derive(Debug, Clone, Copy)]
pub struct AttnMeta {
    pub tok_seq: u64,
    pub tok_pos: u64,
    pub block_tables: u64,
    pub max_blocks: usize,
    pub max_ctx: usize,
}

/// [`paged_attention`] over all `total_tokens` tokens, or only those in `list` (device i32 token
/// indices, `list.1` of them), with a chosen kernel.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_ex(
    gpu: &Gpu,
    d: &AttnDims,
    q: &DevBuf,
    pool: &DevBuf,
    layer: usize,
    meta: &AttnMeta,
    total_tokens: usize,
    list: Option<(u64, usize)>,
    out: &DevBuf,
    ws: &AttnWorkspace<'_>,
    variant: AttnVariant,
) -> Result<(), CudaError> {
    const OP: &str = "paged_attention";
    d.check(OP)?;
    let (nh, hd) = (d.num_heads, d.head_dim);
    need(OP, "q", q, total_tokens * nh * hd * BF16)?;
    need(OP, "out", out, total_tokens * nh * hd * BF16)?;
    need(OP, "pool", pool, (layer + 1) * d.layer_elems() * BF16)?;
    let (max_ctx, max_blocks) = (meta.max_ctx, meta.max_blocks);
    shape(
        OP,
        max_ctx > 0 && max_ctx <= max_blocks * d.block_size,
        || {
            format!(
                "max_ctx {max_ctx} beyond {max_blocks} blocks of {}",
                d.block_size
            )
        },
    )?;
    let grid_tokens = list.map_or(total_tokens, |l| l.1);
    if grid_tokens == 0 {
        return Ok(());
    }
    let variant = match variant {
        AttnVariant::Auto => auto_variant(hd),
        v => v,
    };
    let narrow = (hd.is_multiple_of(8) && 32 % (hd / 8).max(1) == 0 && hd >= 8).then_some(8);
    let dpl = match variant {
        AttnVariant::V2Narrow => narrow,
        _ => v2_dims_per_lane(hd),
    };
    match variant {
        AttnVariant::V2 | AttnVariant::V2Narrow => shape(OP, dpl.is_some(), || {
            format!("{variant:?} cannot run head_dim {hd}")
        })?,
        AttnVariant::V3 => shape(OP, v3_supports(hd), || {
            format!("V3 cannot run head_dim {hd} (64 or 128)")
        })?,
        _ => {}
    }
    let maxg = match variant {
        AttnVariant::V3 => v3_heads_per_block(nh / d.num_kv_heads),
        AttnVariant::V2 | AttnVariant::V2Narrow => 4,
        _ => 8,
    };
    let groups = d.num_kv_heads * (nh / d.num_kv_heads).div_ceil(maxg);
    let ws_rows_splits = (ws.part_acc.bytes() / (hd * F32)).min(ws.part_ml.bytes() / (2 * F32));
    let (nsplit, split_len) = if variant == AttnVariant::V3 {
        attention_splits_v3(
            gpu.sm_count as usize,
            grid_tokens * groups,
            max_ctx,
            d.block_size,
            total_tokens * nh,
            ws_rows_splits,
        )
    } else {
        attention_splits(
            gpu.sm_count as usize,
            grid_tokens * groups,
            max_ctx,
            total_tokens * nh,
            ws_rows_splits,
        )
    };
    if nsplit > 1 {
        need(
            OP,
            "part_acc",
            ws.part_acc,
            total_tokens * nh * nsplit * hd * F32,
        )?;
        need(
            OP,
            "part_ml",
            ws.part_ml,
            total_tokens * nh * nsplit * 2 * F32,
        )?;
    }
    let name = match variant {
        AttnVariant::V3 => match (hd, maxg) {
            (64, 4) => "paged_attention_v3_d64_g4",
            (64, _) => "paged_attention_v3_d64_g8",
            (_, 4) => "paged_attention_v3_d128_g4",
            _ => "paged_attention_v3_d128_g8",
        },
        AttnVariant::V2 if dpl == Some(16) => "paged_attention_v2_d16",
        AttnVariant::V2 | AttnVariant::V2Narrow => "paged_attention_v2_d8",
        AttnVariant::V1 | AttnVariant::Auto => "paged_attention",
    };
    let f = gpu.kernel(name)?;
    if variant == AttnVariant::V3 {
        prefer_shared_memory(f)?;
    }
    let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
    let scale = 1.0f32 / (hd as f32).sqrt();
    let (mb, nh_i, nkv_i, hd_i, bs_i, sl_i) = (
        max_blocks as i32,
        nh as i32,
        d.num_kv_heads as i32,
        hd as i32,
        d.block_size as i32,
        split_len as i32,
    );
    let list_ptr = list.map_or(0u64, |l| l.0);
    let mut b = gpu.stream.launch_builder(f);
    b.arg(q.ptr_ref())
        .arg(&layer_ptr)
        .arg(&meta.tok_seq)
        .arg(&meta.tok_pos)
        .arg(&meta.block_tables)
        .arg(&mb)
        .arg(&nh_i)
        .arg(&nkv_i)
        .arg(&hd_i)
        .arg(&bs_i)
        .arg(&scale)
        .arg(&sl_i)
        .arg(out.ptr_ref())
        .arg(ws.part_ml.ptr_ref())
        .arg(ws.part_acc.ptr_ref())
        .arg(&list_ptr);
    // SAFETY: sizes checked above; metadata arrays are the caller's (positions < max_ctx,
    // block ids < num_blocks, listed tokens < total_tokens).
    unsafe {
        b.launch(cfg(
            (u32_of(OP, grid_tokens)?, groups as u32, nsplit as u32),
            128,
        ))
    }
    .map_err(launched(OP))?;
    if nsplit > 1 {
        let f = gpu.kernel("attention_combine")?;
        let ns = nsplit as i32;
        let mut b = gpu.stream.launch_builder(f);
        b.arg(ws.part_ml.ptr_ref())
            .arg(ws.part_acc.ptr_ref())
            .arg(out.ptr_ref())
            .arg(&hd_i)
            .arg(&ns)
            .arg(&list_ptr)
            .arg(&nh_i);
        // SAFETY: workspace sizes checked above.
        unsafe { b.launch(cfg((u32_of(OP, grid_tokens * nh)?, 1, 1), 128)) }
            .map_err(launched("attention_combine"))?;
    }
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
    let mut b = gpu.stream.launch_builder(f);
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

/// Which implementation [`linear`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearImpl {
    /// cuBLAS (measured on H200 at Llama-3.1-8B shapes: cuBLAS 5.87 ms vs gemv 6.05 ms per
    /// batch-1 decode step; gemv loses more at 8 rows).
    Auto,
    Cublas,
    Gemv,
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
    ty: super::blas::OutType,
    accumulate: bool,
    how: LinearImpl,
) -> Result<(), CudaError> {
    use super::blas::OutType;
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
    let gemv_ok = tokens <= 8 && inp.is_multiple_of(8);
    let use_gemv = match how {
        LinearImpl::Auto => false,
        LinearImpl::Cublas => false,
        LinearImpl::Gemv => {
            shape(OP, gemv_ok, || {
                "gemv needs tokens <= 8, inp % 8 == 0".to_string()
            })?;
            true
        }
    };
    if !use_gemv {
        // SAFETY: sizes checked above; the Blas handle belongs to this GPU's context.
        return unsafe {
            super::blas::gemm(
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
    }
    let name = match tokens {
        1 => "gemv_t1",
        2 => "gemv_t2",
        3 | 4 => "gemv_t4",
        _ => "gemv_t8",
    };
    let f = gpu.kernel(name)?;
    let (t_i, o_i, i_i, yf, acc) = (
        tokens as i32,
        u32_of(OP, out)? as i32,
        u32_of(OP, inp)? as i32,
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
    let blocks = out.div_ceil(8).min(gpu.sm_count as usize * 8) as u32;
    // SAFETY: sizes checked above.
    unsafe { b.launch(cfg((blocks, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_context_and_respect_the_workspace() {
        for &(sms, work, ctx, rows, cap) in &[
            (132, 8, 512, 32, 1 << 17),
            (132, 512, 8192, 2048, 1 << 17),
            (132, 65536, 8192, 262144, 1 << 17),
            (132, 1, 100_000, 32, 64),
            (4, 3, 1, 3, 10),
        ] {
            let (n, len) = attention_splits(sms, work, ctx, rows, cap);
            assert!(n >= 1 && len >= 1);
            assert!(n * len >= ctx, "splits cover every key");
            assert!((n - 1) * len < ctx, "no empty trailing split");
            assert!(n == 1 || n * rows <= cap, "partials fit the workspace");
            assert!(n == 1 || len >= 64 || ctx < 128);
        }
        // small work spreads over the device; large work does not split
        assert!(attention_splits(132, 8, 8192, 32, 1 << 17).0 > 1);
        assert_eq!(attention_splits(132, 65536, 8192, 262144, 1 << 17).0, 1);
    }

    #[test]
    fn v3_partitions_cover_the_context_fit_smem_and_workspace() {
        let bs_list = [1usize, 16, 32, 24];
        for &(sms, work, ctx, rows, cap) in &[
            (132, 8, 512, 32, 1 << 17),    // batch 1, Llama shapes
            (132, 64, 2048, 256, 1 << 17), // batch 8
            (132, 256, 8192, 1024, 1 << 17),
            (132, 512, 8192, 2048, 1 << 17),
            (132, 512, 131072, 2048, 1 << 17), // long context: smem block table bound
            (132, 1, 100_000, 32, 64),         // tiny workspace
            (132, 8, 1, 32, 1 << 17),          // context 1
            (132, 100_000, 8192, 400_000, 1 << 17),
        ] {
            for bs in bs_list {
                let (n, len) = attention_splits_v3(sms, work, ctx, bs, rows, cap);
                let tag = format!("sms={sms} work={work} ctx={ctx} bs={bs} cap={cap}: {n} x {len}");
                assert!(n >= 1 && len >= 1, "{tag}");
                assert!(n * len >= ctx, "every key in a partition: {tag}");
                assert!(
                    (n - 1) * len < ctx,
                    "no partition starts past max_ctx: {tag}"
                );
                assert!(
                    n == 1 || n * rows <= cap,
                    "partials fit the workspace: {tag}"
                );
                if cap / rows >= ctx.div_ceil((V3_BT_ENTRIES - 1) * bs) {
                    // a partition of len keys spans len / bs blocks when aligned to blocks,
                    // at most (len - 1) / bs + 2 otherwise
                    let span = if bs % 16 == 0 {
                        assert!(len % bs == 0, "block-aligned partitions: {tag}");
                        len.div_ceil(bs)
                    } else {
                        (len - 1) / bs + 2
                    };
                    assert!(span <= V3_BT_ENTRIES, "block table in smem: {tag}");
                }
            }
        }
        // small batches spread over the device; long contexts are split even at large batch
        let (n, len) = attention_splits_v3(132, 8, 8192, 16, 32, 1 << 17);
        assert!(n >= 32 && len >= 128, "{n} x {len}");
        assert_eq!(
            attention_splits_v3(132, 1 << 20, 8192, 16, 1 << 22, 1 << 30).0,
            1
        );
        assert!(attention_splits_v3(132, 1 << 20, 131072, 16, 1 << 22, 1 << 30).0 >= 16);
    }

    #[test]
    fn variant_names_parse_and_v3_head_dims() {
        for (s, v) in [
            ("auto", AttnVariant::Auto),
            ("v1", AttnVariant::V1),
            ("V2", AttnVariant::V2),
            (" v2narrow ", AttnVariant::V2Narrow),
            ("v3", AttnVariant::V3),
        ] {
            assert_eq!(AttnVariant::parse(s), Some(v));
        }
        assert_eq!(AttnVariant::parse("v4"), None);
        assert!(v3_supports(64) && v3_supports(128));
        assert!(!v3_supports(96) && !v3_supports(256) && !v3_supports(16));
        if std::env::var_os("PDNODE_ATTN_KERNEL").is_none() {
            assert_eq!(auto_variant(128), AttnVariant::V3);
            assert_eq!(auto_variant(64), AttnVariant::V3);
            assert_eq!(auto_variant(256), AttnVariant::V2);
            assert_eq!(auto_variant(96), AttnVariant::V1);
        }
    }

    #[test]
    fn v2_runs_the_usual_head_dims() {
        assert_eq!(v2_dims_per_lane(128), Some(16));
        assert_eq!(v2_dims_per_lane(256), Some(16));
        assert_eq!(v2_dims_per_lane(64), Some(8));
        assert_eq!(v2_dims_per_lane(16), Some(8));
        assert_eq!(v2_dims_per_lane(96), None);
        assert_eq!(v2_dims_per_lane(80), None);
    }
}
