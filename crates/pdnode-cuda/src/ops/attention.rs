//! Paged attention for decode and short chunks: the kernel variants (v1 .. v4), how the split
//! count / partition length is chosen, and the launch wrapper [`paged_attention_ex`] with its
//! workspace. Re-exported from [`super`] (`ops::paged_attention_ex` etc.).

use super::super::CudaError;
use super::super::device::{DevBuf, Gpu};
use super::{AttnDims, BF16, F32, cfg, launched, need, shape, u32_of};

/// Split-K workspace of [`paged_attention`]: `part_ml` f32 `[rows, nsplit, 2]`,
/// `part_acc` f32 `[rows, nsplit, hd]` with `rows = tokens * nh`.
pub struct AttnWorkspace<'a> {
    pub part_ml: &'a DevBuf,
    pub part_acc: &'a DevBuf,
}

/// Which paged-attention kernel to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnVariant {
    /// v4 when the head_dim allows it, else v2, else v1 ([`auto_variant`]).
    Auto,
    /// attention.cu: a warp per key, any even head_dim <= 256, up to 8 heads per block.
    V1,
    /// attention_v2.cu: lane groups per key, 16-byte loads, up to 4 heads per block; 16 dims
    /// per lane from head_dim 128 up (fewer shuffles, more registers).
    V2,
    /// attention_v2.cu with 8 dims per lane at every head_dim (fewer registers, more shuffles).
    V2Narrow,
    /// attention_v4.cu: flash-decoding partitions with QK^T and PV on tensor cores (mma.sync
    /// m16n8k16, the GQA group's heads as the 16 rows), a cp.async pipeline per warp and the 4
    /// warps' results merged at the end; head_dim 64 or 128, dynamic shared memory
    /// ([`v4_smem_bytes`]). Kernels `paged_attention_v4_d{64,128}_g{8,16}`, and
    /// `paged_attention_v4_d128_g8_w2` (2 warps a block) where [`v4_two_warps`] says. (v3, the same
    /// partitions on CUDA cores, was retired: 0.36-0.60 of the copy ceiling where v4 reads at
    /// 0.58-1.03, docs/benchmarks.md.)
    V4,
}

impl AttnVariant {
    /// Parses `auto`, `v1`, `v2`, `v2narrow`, `v4` (the names of `engine.cuda.attention` and of
    /// the benchmarks).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "v1" => Self::V1,
            "v2" => Self::V2,
            "v2narrow" => Self::V2Narrow,
            "v4" => Self::V4,
            _ => return None,
        })
    }

    /// Whether this kernel runs head_dim `hd` (`Auto` always does).
    pub fn runs(self, hd: usize) -> bool {
        match self {
            AttnVariant::V4 => v4_supports(hd),
            AttnVariant::V2 => v2_dims_per_lane(hd).is_some(),
            AttnVariant::V2Narrow => hd >= 8 && hd.is_multiple_of(8) && 32 % (hd / 8) == 0,
            AttnVariant::V1 | AttnVariant::Auto => true,
        }
    }

    /// The kernel this choice runs at head_dim `hd`: itself where it runs, else [`auto_variant`]
    /// (never `Auto`).
    pub fn resolve(self, hd: usize) -> AttnVariant {
        match self {
            AttnVariant::Auto => auto_variant(hd),
            v if v.runs(hd) => v,
            _ => auto_variant(hd),
        }
    }
}

/// What [`AttnVariant::Auto`] runs at head_dim `hd`: v4 for 64 / 128, v2 where it runs, v1
/// otherwise.
pub fn auto_variant(hd: usize) -> AttnVariant {
    // v4 (tensor cores) measured 0.90-0.93 of the copy ceiling at 32-64 x 8k on the H200 (the
    // retired v3 0.50-0.55).
    if v4_supports(hd) {
        AttnVariant::V4
    } else if v2_dims_per_lane(hd).is_some() {
        AttnVariant::V2
    } else {
        AttnVariant::V1
    }
}

/// A paged-attention kernel and the v4 partition tuning (`engine.cuda.attention`,
/// `attention_v4_waves`, `attention_v4_max_part`): passed to every call, no process-wide state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnChoice {
    pub variant: AttnVariant,
    /// Waves of resident v4 blocks [`attention_splits_v4`] aims for (1 to 64).
    pub v4_waves: usize,
    /// Longest v4 partition, keys (128 to 1M).
    pub v4_max_part: usize,
}

impl Default for AttnChoice {
    fn default() -> Self {
        AttnVariant::Auto.into()
    }
}

impl From<AttnVariant> for AttnChoice {
    /// `variant` with the default v4 tuning ([`V4_WAVES`], [`V4_MAX_PART`]).
    fn from(variant: AttnVariant) -> Self {
        Self {
            variant,
            v4_waves: V4_WAVES,
            v4_max_part: V4_MAX_PART,
        }
    }
}

/// Asks for the largest shared-memory carveout and allows `dynamic` bytes of dynamic shared
/// memory for `f` (the v4 kernels; set before every launch: a launch above 48 KB without it
/// fails, and a CUfunction handle of an unloaded module can come back for a new one, so no cache
/// keyed by it).
pub fn prefer_shared_memory(
    f: &cudarc::driver::CudaFunction,
    dynamic: usize,
) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        .map_err(super::super::drv("cuFuncSetAttribute"))?;
    let bytes = i32::try_from(dynamic).map_err(|_| CudaError::Unsupported {
        reason: format!("{dynamic} bytes of dynamic shared memory"),
    })?;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
        .map_err(super::super::drv("cuFuncSetAttribute"))
}

/// Head dims the v4 kernel is compiled for.
pub fn v4_supports(hd: usize) -> bool {
    hd == 64 || hd == 128
}

/// Block-table entries of one partition the v4 kernel stages in shared memory (`ATT4_BT`).
pub const BT_ENTRIES: usize = 512;

/// Query heads one v4 block serves for a GQA group of `g` heads: the `_g8` kernels for groups up
/// to 8, the `_g16` ones otherwise (groups above 16 take `ceil(g / 16)` blocks per KV head).
pub fn v4_heads_per_block(g: usize) -> usize {
    if g <= 8 { 8 } else { 16 }
}

/// Dynamic shared memory of a v4 block (`ATT4_SMEM(HD)`: 4 warps x 3 stages x K and V x 16 rows
/// of `hd + 8` bf16): 104 KB at head_dim 128 (2 blocks per SM), 55 KB at 64 (3 per SM).
pub const fn v4_smem_bytes(hd: usize) -> usize {
    v4_smem_bytes_warps(hd, 4)
}

/// [`v4_smem_bytes`] of a block of `warps` warps (`ATT4_SMEM_NW`): 52 KB for the two-warp
/// kernel at head_dim 128.
pub const fn v4_smem_bytes_warps(hd: usize, warps: usize) -> usize {
    warps * 3 * 2 * 16 * (hd + 8) * 2
}

/// Whether a v4 launch of `work` (token, head group) blocks in `nsplit` partitions each runs the
/// two-warp kernel (`paged_attention_v4_d128_g8_w2`, 4 resident blocks an SM, the same copies in
/// flight per SM): only head_dim 128, groups up to 8, one partition, and more blocks than the
/// four-warp kernel holds resident (2 an SM), which it would run in two or more waves, each with
/// its dependent prologue (block table, first copies) and merge.
pub fn v4_two_warps(
    sm_count: usize,
    hd: usize,
    heads_per_block: usize,
    work: usize,
    nsplit: usize,
) -> bool {
    hd == 128 && heads_per_block == 8 && nsplit == 1 && work > sm_count * v4_blocks_per_sm(hd)
}

/// Resident v4 blocks per SM at `hd` (shared memory bound, 228 KB per SM on sm_90).
pub fn v4_blocks_per_sm(hd: usize) -> usize {
    (228 * 1024 / (v4_smem_bytes(hd) + 4 * 1024)).max(1)
}

/// Default of [`AttnChoice::v4_waves`]. On the H200 (Llama-3.1-8B shapes, uniform contexts, whole waves) one
/// wave was best: 0.55 / 0.86 / 0.95 of the copy ceiling at 8 x 2k / 32 x 2k / 32 x 8k against
/// 0.45 / 0.76 / 0.92 for two and 0.37 / 0.68 / 0.89 for four.
pub const V4_WAVES: usize = 1;

/// Longest v4 partition [`attention_splits_v4`] makes by default ([`AttnChoice::v4_max_part`]): with one
/// wave a lone long context among short ones would otherwise be one block's serial work.
pub const V4_MAX_PART: usize = 4096;

/// Partitions of the v4 kernel for `work` (token, head group) blocks and contexts up to
/// `max_ctx`: at most `waves` whole waves of resident blocks ([`v4_blocks_per_sm`] per SM; at
/// least one partition per work item), at least 128 keys (2 tiles per warp) and at most about
/// `max_part` keys per partition, each partition's block-table slice within [`BT_ENTRIES`], and
/// no more partials than the workspace holds (`ws_rows_splits / partial_rows`). Returns
/// `(nsplit, split_len)` with `nsplit * split_len >= max_ctx > (nsplit - 1) * split_len`.
#[allow(clippy::too_many_arguments)]
pub fn attention_splits_v4(
    sm_count: usize,
    hd: usize,
    waves: usize,
    max_part: usize,
    work: usize,
    max_ctx: usize,
    block_size: usize,
    partial_rows: usize,
    ws_rows_splits: usize,
) -> (usize, usize) {
    // whole waves: floor, so a last, mostly idle round of short-lived blocks is not added
    let slots = sm_count * v4_blocks_per_sm(hd) * waves.max(1);
    let want = (slots / work.max(1)).max(max_ctx.div_ceil(max_part.max(128)));
    splits_tiled(
        want.max(1),
        max_ctx,
        block_size,
        partial_rows,
        ws_rows_splits,
    )
}

/// About `want` partitions (at most one per 128 keys), block-aligned where the block size
/// allows, each partition's block table within [`BT_ENTRIES`], and no more partials than the
/// workspace holds.
fn splits_tiled(
    want: usize,
    max_ctx: usize,
    block_size: usize,
    partial_rows: usize,
    ws_rows_splits: usize,
) -> (usize, usize) {
    let max_ctx = max_ctx.max(1);
    let nsplit = want.min(max_ctx.div_ceil(128)).max(1);
    // Partitions start at multiples of split_len: with split_len a multiple of the block size
    // they are block-aligned and span split_len / block_size blocks, else one more.
    let bs = block_size.max(1);
    let (align, max_len) = if bs.is_multiple_of(16) {
        (bs, BT_ENTRIES * bs)
    } else {
        (16, (BT_ENTRIES - 1) * bs / 16 * 16)
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
        window: 0,
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
    /// Sliding window of the layer (`ModelSpec::attention_window`): token `t` attends to keys
    /// `max(0, tok_pos[t] + 1 - window) ..= tok_pos[t]`; 0 for the whole context.
    pub window: usize,
}

/// Keys one token's partitions must cover when contexts reach `max_ctx`: the whole context
/// without a window; with one, the window plus, for v4 (`tile_aligned`), the up to 15 keys
/// between the window's start and the 16-key tile boundary below it, where the kernel starts
/// its partitions. Never more than `max_ctx`.
pub fn attention_span(max_ctx: usize, window: usize, tile_aligned: bool) -> usize {
    match window {
        0 => max_ctx,
        w if tile_aligned => max_ctx.min(w + 15),
        w => max_ctx.min(w),
    }
}

/// [`paged_attention`] over all `total_tokens` tokens, or only those in `list` (device i32 token
/// indices, `list.1` of them), with a chosen kernel, within `meta.window` when not 0. The split
/// count follows the window, not the context: partitions start at each token's window (v4: its
/// 16-key tile), so keys before it cost nothing.
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
    choice: impl Into<AttnChoice>,
) -> Result<(), CudaError> {
    const OP: &str = "paged_attention";
    let choice: AttnChoice = choice.into();
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
    // an explicit kernel the head_dim rules out is a shape error, not a silent substitute
    let variant = match choice.variant {
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
        AttnVariant::V4 => shape(OP, v4_supports(hd), || {
            format!("{variant:?} cannot run head_dim {hd} (64 or 128)")
        })?,
        _ => {}
    }
    let maxg = match variant {
        AttnVariant::V4 => v4_heads_per_block(nh / d.num_kv_heads),
        AttnVariant::V2 | AttnVariant::V2Narrow => 4,
        _ => 8,
    };
    let groups = d.num_kv_heads * (nh / d.num_kv_heads).div_ceil(maxg);
    let ws_rows_splits = (ws.part_acc.bytes() / (hd * F32)).min(ws.part_ml.bytes() / (2 * F32));
    let span = attention_span(max_ctx, meta.window, variant == AttnVariant::V4);
    let (nsplit, split_len) = if variant == AttnVariant::V4 {
        attention_splits_v4(
            gpu.sm_count as usize,
            hd,
            choice.v4_waves,
            choice.v4_max_part,
            grid_tokens * groups,
            span,
            d.block_size,
            total_tokens * nh,
            ws_rows_splits,
        )
    } else {
        attention_splits(
            gpu.sm_count as usize,
            grid_tokens * groups,
            span,
            total_tokens * nh,
            ws_rows_splits,
        )
    };
    if nsplit > 1 {
        // attention_combine: COMB_DPT (4) dims a thread of its 128; (max, sum) pairs read as
        // 8-byte words
        shape(OP, hd <= 512, || {
            format!("head_dim {hd} past the combine's 512")
        })?;
        shape(OP, ws.part_ml.ptr().is_multiple_of(8), || {
            "part_ml not 8-byte aligned".into()
        })?;
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
    let two_warps = variant == AttnVariant::V4
        && v4_two_warps(
            gpu.sm_count as usize,
            hd,
            maxg,
            grid_tokens * groups,
            nsplit,
        );
    let name = match variant {
        AttnVariant::V4 if two_warps => "paged_attention_v4_d128_g8_w2",
        AttnVariant::V4 => match (hd, maxg) {
            (64, 8) => "paged_attention_v4_d64_g8",
            (64, _) => "paged_attention_v4_d64_g16",
            (_, 8) => "paged_attention_v4_d128_g8",
            _ => "paged_attention_v4_d128_g16",
        },
        AttnVariant::V2 if dpl == Some(16) => "paged_attention_v2_d16",
        AttnVariant::V2 | AttnVariant::V2Narrow => "paged_attention_v2_d8",
        AttnVariant::V1 | AttnVariant::Auto => "paged_attention",
    };
    let f = gpu.kernel(name)?;
    let warps = if two_warps { 2 } else { 4 };
    let dyn_smem = if variant == AttnVariant::V4 {
        v4_smem_bytes_warps(hd, warps)
    } else {
        0
    };
    if variant == AttnVariant::V4 {
        prefer_shared_memory(f, dyn_smem)?;
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
    // a window at least the context is no window (and keeps the i32 in range)
    let window_i = if meta.window >= max_ctx {
        0
    } else {
        meta.window as i32
    };
    let list_ptr = list.map_or(0u64, |l| l.0);
    let mut b = gpu.launch_builder(f);
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
        .arg(&list_ptr)
        .arg(&window_i);
    let mut lc = cfg(
        (u32_of(OP, grid_tokens)?, groups as u32, nsplit as u32),
        32 * warps as u32,
    );
    lc.shared_mem_bytes = dyn_smem as u32;
    // SAFETY: sizes checked above; metadata arrays are the caller's (positions < max_ctx,
    // block ids < num_blocks, listed tokens < total_tokens); the v4 kernels were allowed
    // dyn_smem bytes of dynamic shared memory (prefer_shared_memory).
    unsafe { b.launch(lc) }.map_err(launched(OP))?;
    if nsplit > 1 {
        let f = gpu.kernel("attention_combine")?;
        let ns = nsplit as i32;
        let mut b = gpu.launch_builder(f);
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
    fn v4_partitions_cover_the_context_fit_smem_and_workspace() {
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
            for (bs, waves) in bs_list.into_iter().flat_map(|b| [(b, V4_WAVES), (b, 4)]) {
                let (n, len) =
                    attention_splits_v4(sms, 128, waves, V4_MAX_PART, work, ctx, bs, rows, cap);
                let tag = format!(
                    "waves={waves} sms={sms} work={work} ctx={ctx} bs={bs} cap={cap}: {n} x {len}"
                );
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
                if cap / rows >= ctx.div_ceil((BT_ENTRIES - 1) * bs) {
                    // a partition of len keys spans len / bs blocks when aligned to blocks,
                    // at most (len - 1) / bs + 2 otherwise
                    let span = if bs % 16 == 0 {
                        assert!(len % bs == 0, "block-aligned partitions: {tag}");
                        len.div_ceil(bs)
                    } else {
                        (len - 1) / bs + 2
                    };
                    assert!(span <= BT_ENTRIES, "block table in smem: {tag}");
                }
            }
        }
        // small batches spread over the device; long contexts are split even at large batch
        let (n, len) = attention_splits_v4(132, 128, 1, V4_MAX_PART, 8, 8192, 16, 32, 1 << 17);
        assert!(n >= 32 && len >= 128, "{n} x {len}");
        assert_eq!(
            attention_splits_v4(132, 128, 1, 1 << 20, 1 << 20, 8192, 16, 1 << 22, 1 << 30).0,
            1
        );
        assert!(
            attention_splits_v4(
                132,
                128,
                1,
                V4_MAX_PART,
                1 << 20,
                131072,
                16,
                1 << 22,
                1 << 30
            )
            .0 >= 16
        );
        // v4: 2 resident blocks per SM at head_dim 128 (3 at 64), whole waves: batch 8 x 2k
        // (64 blocks of work) takes 4 partitions of 512 keys for one wave, 8 of 256 for two, 16 of
        // 128 for four; 64 x 8k (512) one partition for one or two waves, 2 of 4096 for four
        assert_eq!((v4_blocks_per_sm(128), v4_blocks_per_sm(64)), (2, 3));
        // the two-warp kernel: half the shared memory (4 blocks an SM), taken by one-partition
        // grids of more blocks than two an SM at head_dim 128, groups up to 8 (H200: 132 SMs)
        assert_eq!(v4_smem_bytes_warps(128, 2) * 2, v4_smem_bytes(128));
        assert!(4 * (v4_smem_bytes_warps(128, 2) + 4 * 1024) <= 228 * 1024);
        assert!(v4_two_warps(132, 128, 8, 64 * 8, 1));
        assert!(v4_two_warps(132, 128, 8, 265, 1));
        assert!(!v4_two_warps(132, 128, 8, 264, 1), "one wave already");
        assert!(!v4_two_warps(132, 128, 8, 64 * 8, 2), "partitioned");
        assert!(!v4_two_warps(132, 128, 16, 64 * 8, 1), "no _g16 kernel");
        assert!(
            !v4_two_warps(132, 64, 8, 64 * 8, 1),
            "no head_dim 64 kernel"
        );
        for (waves, work, ctx, want) in [
            (1, 64, 2048, (4, 512)),
            (2, 64, 2048, (8, 256)),
            (4, 64, 2048, (16, 128)),
            (1, 512, 8192, (1, 8192)),
            (2, 512, 8192, (1, 8192)),
            (4, 512, 8192, (2, 4096)),
        ] {
            let got =
                attention_splits_v4(132, 128, waves, 1 << 20, work, ctx, 16, work * 4, 1 << 17);
            assert_eq!(got, want, "waves {waves} work {work} ctx {ctx}");
        }
        // the partition cap splits long contexts even when the batch fills the device
        assert_eq!(
            attention_splits_v4(132, 128, 1, 4096, 512, 8192, 16, 2048, 1 << 17),
            (2, 4096)
        );
        assert_eq!(
            attention_splits_v4(132, 128, 1, 4096, 4096, 131072, 16, 16384, 1 << 30).0,
            32
        );
    }

    /// With a window the partitions cover the window, not the context: every token's keys lie in
    /// `[start, ctx)` with `start = lo` (v1, v2) or `lo` rounded down to a 16-key tile (v4), and
    /// the span bounds `ctx - start` for every context up to `max_ctx`; without a window (0) it
    /// is the context.
    #[test]
    fn attention_span_covers_each_tokens_window() {
        assert_eq!(attention_span(8192, 0, true), 8192);
        assert_eq!(attention_span(8192, 0, false), 8192);
        assert_eq!(attention_span(8192, 4096, false), 4096);
        assert_eq!(attention_span(8192, 4096, true), 4111);
        assert_eq!(attention_span(100, 4096, true), 100);
        for max_ctx in [1usize, 15, 16, 17, 100, 1000] {
            for window in [1usize, 5, 16, 37, 100, 5000] {
                for v4 in [false, true] {
                    let span = attention_span(max_ctx, window, v4);
                    for ctx in 1..=max_ctx {
                        let lo = (ctx + 1).saturating_sub(window + 1);
                        let start = if v4 { lo / 16 * 16 } else { lo };
                        assert!(
                            ctx - start <= span,
                            "max_ctx {max_ctx} window {window} v4 {v4} ctx {ctx}"
                        );
                    }
                    // and the partitions built for that span cover it
                    let (n, len) = attention_splits_v4(132, 128, 1, 4096, 8, span, 16, 32, 1 << 17);
                    assert!(n * len >= span && (n - 1) * len < span);
                    assert!(span <= max_ctx && span <= window + 15);
                }
            }
        }
    }

    #[test]
    fn variant_names_parse_and_resolve_per_head_dim() {
        for (s, v) in [
            ("auto", AttnVariant::Auto),
            ("v1", AttnVariant::V1),
            ("V2", AttnVariant::V2),
            (" v2narrow ", AttnVariant::V2Narrow),
            ("v4", AttnVariant::V4),
        ] {
            assert_eq!(AttnVariant::parse(s), Some(v));
        }
        // v3 is retired
        assert_eq!(AttnVariant::parse("v3"), None);
        assert_eq!(AttnVariant::parse("v5"), None);
        assert!(v4_supports(64) && v4_supports(128));
        assert!(!v4_supports(96) && !v4_supports(256) && !v4_supports(16));
        // auto: no environment, the same answer every time
        assert_eq!(auto_variant(128), AttnVariant::V4);
        assert_eq!(auto_variant(64), AttnVariant::V4);
        assert_eq!(auto_variant(256), AttnVariant::V2);
        assert_eq!(auto_variant(96), AttnVariant::V1);
        // an explicit choice runs where it can, else auto's kernel for that head_dim
        assert_eq!(AttnVariant::V1.resolve(128), AttnVariant::V1);
        assert_eq!(AttnVariant::V2Narrow.resolve(128), AttnVariant::V2Narrow);
        assert_eq!(AttnVariant::V4.resolve(256), AttnVariant::V2);
        assert_eq!(AttnVariant::V2.resolve(96), AttnVariant::V1);
        assert_eq!(AttnVariant::Auto.resolve(64), AttnVariant::V4);
        assert!(!AttnVariant::V4.runs(96) && AttnVariant::V1.runs(96));
        let c: AttnChoice = AttnVariant::V2.into();
        assert_eq!(
            (c.variant, c.v4_waves, c.v4_max_part),
            (AttnVariant::V2, V4_WAVES, V4_MAX_PART)
        );
        assert_eq!(AttnChoice::default().variant, AttnVariant::Auto);
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
