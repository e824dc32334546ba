//! DeepSeek multi-head latent attention (kernels/mla.cu): the new tokens' latent rows and query
//! RoPE ([`mla_rope_latent`]), and the absorbed attention over the paged latent pool
//! ([`mla_attention`], split over the context and merged). The math of the CPU reference,
//! `pdnode-engine` `backend/cpu/mla.rs`. Re-exported from [`super`].

use super::super::CudaError;
use super::super::device::{DevBuf, Gpu};
use super::{AttnMeta, BF16, F32, cfg, i32_of, launched, need, shape, u32_of};

/// Geometry of the latent attention and of its pool (`[layer][num_blocks][block_size][rank +
/// rope]` bf16, one row per token slot).
#[derive(Debug, Clone, Copy)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub rank: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl MlaDims {
    /// Elements of one latent row (`rank + rope`).
    pub fn latent(&self) -> usize {
        self.rank + self.rope
    }
    /// Elements (bf16) of one layer of the pool.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_size * self.latent()
    }
    /// Elements of one query head (`nope + rope`).
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }

    fn check(&self, op: &'static str) -> Result<(), CudaError> {
        let d = *self;
        shape(
            op,
            d.heads > 0
                && d.rank > 0
                && d.rank.is_multiple_of(8)
                && d.rank <= MLA_MAX_RANK
                && d.rope > 0
                && d.rope.is_multiple_of(2)
                && d.rope <= MLA_MAX_ROPE
                && d.block_size > 0,
            || {
                format!(
                    "{d:?}: need heads > 0, rank % 8 == 0 and <= {MLA_MAX_RANK}, \
                     even rope <= {MLA_MAX_ROPE}, block_size > 0"
                )
            },
        )
    }
}

/// Longest latent rank the attention kernel holds (`MLA_LAT_MAX - 64` in mla.cu: 2 x 8 dims a
/// lane).
pub const MLA_MAX_RANK: usize = 512;
/// Longest RoPE part (2 dims a lane).
pub const MLA_MAX_ROPE: usize = 64;
/// Heads one `mla_attn_split` block serves (`MLA_HPB`).
const MLA_HEADS_PER_BLOCK: usize = 16;
/// Threads of an `mla_attn_split` block (`MLA_THREADS`).
const MLA_THREADS: u32 = 256;
/// Threads of an `mla_attn_split_tc` block (`MLA_TC_THREADS`: 4 warps on tensor cores).
const MLA_TC_THREADS: u32 = 128;
/// Fewest keys a split (of the step's longest context) takes for `mla_attn_split_tc`; shorter
/// splits take the CUDA-core kernel. H200, deepseek-v2-lite graph steps, one call, CUDA cores
/// against tensor cores by keys a split: 16 (1 x 512) 3.578 / 3.816 ms, 16 (1 x 2048) 3.810 /
/// 4.011, 31 (8 x 512) 8.700 / 8.681, 63 (1 x 8192) 4.595 / 4.518, 103 (32 x 512) 19.465 /
/// 17.586, 121 (8 x 2048) 11.930 / 9.869, 171 (64 x 512) 30.848 / 27.519.
pub const MLA_TC_MIN_KEYS: usize = 32;
/// Fewest keys a split of `mla_attn_split` / `_tc` takes (`MLA_MIN_CHUNK`).
const MLA_MIN_CHUNK: usize = 16;
/// Threads a block of `mla_attn_combine`, one output dim each (grid y: the row's dim chunks).
const COMBINE_THREADS: u32 = 128;

/// Most splits `mla_attn_combine` merges (`MLA_MAX_SPLITS`).
const MLA_MAX_SPLITS: usize = 256;

/// The new tokens' latent rows and the RoPE of their queries. For token `t`: the row
/// `[rmsnorm(kva[t][..rank]) * kv_norm (eps) | rope(kva[t][rank..])]` is written bf16 to layer
/// `layer` of `pool` at `slots[t]` (device i64, `block * block_size + slot`; a negative slot
/// writes nothing), and each head's last `rope` values of `q` (bf16 `[tokens][heads][nope +
/// rope]`) are rotated in place. RoPE: angle `pos[t] * inv_freq[i]` (`pos` device i32,
/// `inv_freq` f32 `[rope / 2]`), cos and sin both times `rope_factor`; pairs `(2i, 2i + 1)` when
/// `interleave`, else `(i, i + rope / 2)`. `kva`: f32 `[tokens][rank + rope]`; `kv_norm`: f32
/// `[rank]`.
#[allow(clippy::too_many_arguments)]
pub fn mla_rope_latent(
    gpu: &Gpu,
    d: &MlaDims,
    kva: &DevBuf,
    kv_norm: &DevBuf,
    eps: f32,
    q: &DevBuf,
    inv_freq: &DevBuf,
    rope_factor: f32,
    interleave: bool,
    pos: u64,
    slots: u64,
    tokens: usize,
    pool: &DevBuf,
    layer: usize,
) -> Result<(), CudaError> {
    const OP: &str = "mla_rope_latent";
    d.check(OP)?;
    need(OP, "kva", kva, tokens * d.latent() * F32)?;
    need(OP, "kv_norm", kv_norm, d.rank * F32)?;
    need(OP, "q", q, tokens * d.heads * d.qk() * BF16)?;
    need(OP, "inv_freq", inv_freq, d.rope / 2 * F32)?;
    need(OP, "pool", pool, (layer + 1) * d.layer_elems() * BF16)?;
    if tokens == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
    let il = i32::from(interleave);
    let (h, nope, rope, rank) = (
        i32_of(OP, d.heads)?,
        i32_of(OP, d.nope)?,
        i32_of(OP, d.rope)?,
        i32_of(OP, d.rank)?,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(kva.ptr_ref())
        .arg(kv_norm.ptr_ref())
        .arg(&eps)
        .arg(q.ptr_ref())
        .arg(inv_freq.ptr_ref())
        .arg(&rope_factor)
        .arg(&il)
        .arg(&pos)
        .arg(&slots)
        .arg(&layer_ptr)
        .arg(&h)
        .arg(&nope)
        .arg(&rope)
        .arg(&rank);
    // SAFETY: sizes checked above; `pos` and `slots` hold `tokens` entries, slots below
    // num_blocks * block_size (caller contract, as for rope_qkv).
    unsafe { b.launch(cfg((u32_of(OP, tokens)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// Splits of [`mla_attention`] for `tokens` x `heads`: enough (token, head group, split) blocks
/// for one wave on `sm_count` SMs, at most 256. Depends on nothing else, so a CUDA graph captured
/// at one context stays right at any other: the kernel gives each split `max(ceil(ctx / splits),
/// 16)` positions of the token's own context, and a split past the context writes a neutral
/// partial.
pub fn mla_splits(sm_count: usize, tokens: usize, heads: usize) -> usize {
    let work = tokens.max(1) * heads.div_ceil(MLA_HEADS_PER_BLOCK).max(1);
    sm_count.div_ceil(work).clamp(1, MLA_MAX_SPLITS)
}

/// Bytes of the split-K scratch of [`mla_attention`] for any token count up to `tokens`:
/// `part_ml` f32 `[tokens][heads][splits][2]` and `part_acc` f32 `[tokens][heads][splits][rank]`
/// at the splits [`mla_splits`] gives (the largest over `1..=tokens`; `(0, 0)` when no count up to
/// `tokens` splits: one split writes the output directly).
pub fn mla_scratch_bytes(
    sm_count: usize,
    tokens: usize,
    heads: usize,
    rank: usize,
) -> (usize, usize) {
    // splits > 1 only while tokens * groups < sm_count
    let rows_splits = (1..=tokens.min(sm_count.max(1)))
        .map(|t| (t, mla_splits(sm_count, t, heads)))
        .filter(|&(_, s)| s > 1)
        .map(|(t, s)| t * s)
        .max()
        .unwrap_or(0);
    (
        rows_splits * heads * 2 * F32,
        rows_splits * heads * rank * F32,
    )
}

/// Absorbed latent attention: for each token `t` and head `h`, `score_j = (q_lat[t][h] . c_j +
/// q_pe[t][h] . kpe_j) * scale` over the positions `j = 0..=tok_pos[t]` of its sequence (`c_j` the
/// pool row's first `rank` values, `kpe_j` its last `rope`), softmax, `o_lat[t][h] = sum_j p_j
/// c_j`. `q_lat`: f32 `[tokens][heads][rank]`; `q`: bf16 `[tokens][heads][nope + rope]` (`q_pe`
/// its last `rope` values); `o_lat`: bf16 `[tokens][heads][rank]`. Runs a split kernel (a block
/// per token, 16 heads and split, reading each latent once for its heads: `mla_attn_split` on CUDA
/// cores or `mla_attn_split_tc` on tensor cores, as `kernel` picks, [`MlaKernel`]; the backend's
/// steps use `Auto`) then, with more than one split ([`mla_splits`]), `mla_attn_combine` over
/// `part_ml` / `part_acc` ([`mla_scratch_bytes`]).
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    gpu: &Gpu,
    d: &MlaDims,
    q_lat: &DevBuf,
    q: &DevBuf,
    pool: &DevBuf,
    layer: usize,
    meta: &AttnMeta,
    tokens: usize,
    scale: f32,
    part_ml: &DevBuf,
    part_acc: &DevBuf,
    o_lat: &DevBuf,
    kernel: MlaKernel,
) -> Result<(), CudaError> {
    let s = MlaScratch { part_ml, part_acc };
    mla_attention_ex(
        gpu, d, q_lat, q, pool, layer, meta, tokens, None, scale, &s, o_lat, kernel,
    )
}

/// Which split kernel [`mla_attention_ex`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaKernel {
    /// Tensor cores where the shape allows it and a split has [`MLA_TC_MIN_KEYS`] keys or more
    /// (of the step's longest context), else CUDA cores.
    Auto,
    /// `mla_attn_split`, any shape the wrappers take.
    CudaCores,
    /// `mla_attn_split_tc`: rank and rope multiples of 16 (a shape error otherwise).
    TensorCores,
}

/// The split-K partials of [`mla_attention_ex`] (sizes: [`mla_scratch_bytes`]).
pub struct MlaScratch<'a> {
    pub part_ml: &'a DevBuf,
    pub part_acc: &'a DevBuf,
}

/// [`mla_attention`] for the step's `tokens` tokens, or only those in `list` (device i32 token
/// indices, `list.1` of them: the others' `o_lat` rows are left as they are).
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_ex(
    gpu: &Gpu,
    d: &MlaDims,
    q_lat: &DevBuf,
    q: &DevBuf,
    pool: &DevBuf,
    layer: usize,
    meta: &AttnMeta,
    tokens: usize,
    list: Option<(u64, usize)>,
    scale: f32,
    scratch: &MlaScratch<'_>,
    o_lat: &DevBuf,
    kernel: MlaKernel,
) -> Result<(), CudaError> {
    const OP: &str = "mla_attention";
    let (part_ml, part_acc) = (scratch.part_ml, scratch.part_acc);
    let attended = list.map_or(tokens, |l| l.1);
    shape(OP, attended <= tokens, || {
        format!("a list of {attended} of {tokens} tokens")
    })?;
    let list_ptr = list.map_or(0u64, |l| l.0);
    d.check(OP)?;
    let (heads, rank) = (d.heads, d.rank);
    need(OP, "q_lat", q_lat, tokens * heads * rank * F32)?;
    need(OP, "q", q, tokens * heads * d.qk() * BF16)?;
    need(OP, "o_lat", o_lat, tokens * heads * rank * BF16)?;
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
    // DeepSeek layers attend to the whole context; the latent kernels have no window
    shape(OP, meta.window == 0, || {
        format!("sliding window {} on latent attention", meta.window)
    })?;
    let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
    // 16-byte latent loads where a row is a whole number of 16-byte words
    shape(OP, layer_ptr.is_multiple_of(16), || {
        format!("pool layer {layer} at {layer_ptr:#x}: not 16-byte aligned")
    })?;
    if attended == 0 {
        return Ok(());
    }
    let nsplit = mla_splits(gpu.sm_count as usize, attended, heads);
    if nsplit > 1 {
        need(OP, "part_ml", part_ml, attended * heads * nsplit * 2 * F32)?;
        need(
            OP,
            "part_acc",
            part_acc,
            attended * heads * nsplit * rank * F32,
        )?;
        shape(OP, part_acc.ptr().is_multiple_of(16), || {
            "part_acc: not 16-byte aligned".to_string()
        })?;
        // the merge reads each split's (m, l) as one 8-byte word
        shape(OP, part_ml.ptr().is_multiple_of(8), || {
            "part_ml: not 8-byte aligned".to_string()
        })?;
    }
    // tensor cores where the latent tiles into 16-wide k-steps and dim tiles (DeepSeek: 512 + 64)
    // and a split has keys enough to pay for staging 16 query rows (MLA_TC_MIN_KEYS)
    let fits = d.rank.is_multiple_of(16) && d.rope.is_multiple_of(16);
    let tc = match kernel {
        MlaKernel::Auto => fits && max_ctx.div_ceil(nsplit).max(MLA_MIN_CHUNK) >= MLA_TC_MIN_KEYS,
        MlaKernel::CudaCores => false,
        MlaKernel::TensorCores => {
            shape(OP, fits, || {
                format!(
                    "the tensor-core kernel needs rank and rope multiples of 16, not {} and {}",
                    d.rank, d.rope
                )
            })?;
            true
        }
    };
    let f = gpu.kernel(if tc {
        "mla_attn_split_tc"
    } else {
        "mla_attn_split"
    })?;
    let (mb, h, nope, rope, rk, bs, ns) = (
        i32_of(OP, max_blocks)?,
        i32_of(OP, heads)?,
        i32_of(OP, d.nope)?,
        i32_of(OP, d.rope)?,
        i32_of(OP, rank)?,
        i32_of(OP, d.block_size)?,
        i32_of(OP, nsplit)?,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(q_lat.ptr_ref())
        .arg(q.ptr_ref())
        .arg(&layer_ptr)
        .arg(&meta.tok_seq)
        .arg(&meta.tok_pos)
        .arg(&meta.block_tables)
        .arg(&mb)
        .arg(&h)
        .arg(&nope)
        .arg(&rope)
        .arg(&rk)
        .arg(&bs)
        .arg(&scale)
        .arg(&ns)
        .arg(part_ml.ptr_ref())
        .arg(part_acc.ptr_ref())
        .arg(o_lat.ptr_ref())
        .arg(&list_ptr);
    let groups = heads.div_ceil(MLA_HEADS_PER_BLOCK);
    // SAFETY: sizes checked above (the scratch only where the kernel writes it: nsplit > 1);
    // metadata arrays are the caller's (positions < max_ctx, block ids < num_blocks).
    unsafe {
        b.launch(cfg(
            (u32_of(OP, attended)?, u32_of(OP, groups)?, nsplit as u32),
            if tc { MLA_TC_THREADS } else { MLA_THREADS },
        ))
    }
    .map_err(launched(OP))?;
    if nsplit > 1 {
        let f = gpu.kernel("mla_attn_combine")?;
        let mut b = gpu.launch_builder(f);
        b.arg(part_ml.ptr_ref())
            .arg(part_acc.ptr_ref())
            .arg(o_lat.ptr_ref())
            .arg(&rk)
            .arg(&ns)
            .arg(&list_ptr)
            .arg(&h);
        // SAFETY: scratch and output sizes checked above (rows indexed by token, < tokens).
        unsafe {
            b.launch(cfg(
                (
                    u32_of(OP, attended * heads)?,
                    u32_of(OP, rank.div_ceil(COMBINE_THREADS as usize))?,
                    1,
                ),
                COMBINE_THREADS,
            ))
        }
        .map_err(launched("mla_attn_combine"))?;
    }
    Ok(())
}

/// The latent rows of positions `0..len` of one sequence (device i32 block table `table`) from
/// layer `layer` of `pool` into `lc` (`[len][rank + rope]` bf16, contiguous).
pub fn mla_gather_seq(
    gpu: &Gpu,
    d: &MlaDims,
    pool: &DevBuf,
    layer: usize,
    table: u64,
    len: usize,
    lc: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "mla_gather_seq";
    d.check(OP)?;
    need(OP, "pool", pool, (layer + 1) * d.layer_elems() * BF16)?;
    need(OP, "lc", lc, len * d.latent() * BF16)?;
    if len == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let layer_ptr = pool.at(layer * d.layer_elems() * BF16);
    let (bs, row, n) = (
        i32_of(OP, d.block_size)?,
        i32_of(OP, d.latent())?,
        i32_of(OP, len)?,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(&layer_ptr)
        .arg(&table)
        .arg(&bs)
        .arg(&row)
        .arg(&n)
        .arg(lc.ptr_ref());
    // SAFETY: sizes checked above; the table covers `len` positions with blocks < num_blocks
    // (the caller's step plan checked them).
    unsafe { b.launch(cfg((u32_of(OP, len)?, 1, 1), 64)) }.map_err(launched(OP))?;
    Ok(())
}

/// Rows `row0..row0 + n` of the step's absorbed queries (`q_lat` f32 `[tokens][heads][rank]`,
/// the RoPE part of `q` bf16 `[tokens][heads][nope + rope]`) as head-major bf16 rows of the
/// latent's width: `qc[h][i] = [q_lat[row0 + i][h] | q_pe[row0 + i][h]]`.
#[allow(clippy::too_many_arguments)]
pub fn mla_q_head_major(
    gpu: &Gpu,
    d: &MlaDims,
    q_lat: &DevBuf,
    q: &DevBuf,
    tokens: usize,
    row0: usize,
    n: usize,
    qc: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "mla_q_head_major";
    d.check(OP)?;
    shape(OP, row0 + n <= tokens, || {
        format!("rows {row0}..{} of {tokens}", row0 + n)
    })?;
    need(OP, "q_lat", q_lat, tokens * d.heads * d.rank * F32)?;
    need(OP, "q", q, tokens * d.heads * d.qk() * BF16)?;
    need(OP, "qc", qc, d.heads * n * d.latent() * BF16)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (r0, nn, h, rk, nope, rope) = (
        i32_of(OP, row0)?,
        i32_of(OP, n)?,
        i32_of(OP, d.heads)?,
        i32_of(OP, d.rank)?,
        i32_of(OP, d.nope)?,
        i32_of(OP, d.rope)?,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(q_lat.ptr_ref())
        .arg(q.ptr_ref())
        .arg(&r0)
        .arg(&nn)
        .arg(&h)
        .arg(&rk)
        .arg(&nope)
        .arg(&rope)
        .arg(qc.ptr_ref());
    // SAFETY: sizes checked above.
    unsafe { b.launch(cfg((u32_of(OP, n)?, u32_of(OP, d.heads)?, 1), 64)) }
        .map_err(launched(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_one_wave_and_scratch_covers_every_count() {
        // decode, 16 heads: one block per SM
        assert_eq!(mla_splits(132, 1, 16), 132);
        assert_eq!(mla_splits(132, 8, 16), 17);
        assert_eq!(mla_splits(132, 1, 128), 17);
        assert_eq!(mla_splits(132, 200, 16), 1);
        assert_eq!(mla_splits(1000, 1, 2), MLA_MAX_SPLITS);
        assert_eq!(mla_splits(0, 0, 0), 1);
        for tokens in [1usize, 3, 64, 200] {
            let (ml, acc) = mla_scratch_bytes(132, tokens, 16, 512);
            for t in 1..=tokens {
                let s = mla_splits(132, t, 16);
                if s > 1 {
                    assert!(ml >= t * 16 * s * 2 * F32, "{tokens}: ml at {t}");
                    assert!(acc >= t * 16 * s * 512 * F32, "{tokens}: acc at {t}");
                }
            }
        }
        assert_eq!(mla_scratch_bytes(132, 4, 16, 512).0, 132 * 16 * 2 * F32);
        assert_eq!(mla_scratch_bytes(1, 10, 16, 512), (0, 0));
    }
}
