//! DeepSeek mixture of experts (kernels/moe.cu): routing ([`moe_route`]), the routed experts'
//! GEMVs for a few (token, expert) pairs, expert-major ([`moe_gate_up_swiglu`], [`moe_down`]),
//! the weighted sum into the residual ([`moe_combine`]) and a row gather for the host-grouped
//! path ([`gather_rows_bf16`]). The math of the CPU reference, `pdnode-engine`
//! `backend/cpu/moe.rs`. Re-exported from [`super`].

use super::super::CudaError;
use super::super::device::{DevBuf, Gpu};
use super::{BF16, F32, cfg, i32_of, launched, need, shape, u32_of};
use pdnode_engine::spec::{MoeScoring, MoeSpec};

/// Most tokens * top_k pairs the two expert GEMV kernels take (`MOE_MAX_PAIRS` in moe.cu).
pub const MOE_GEMV_MAX_PAIRS: usize = 512;
/// Most experts a layer may have (`MOE_MAX_EXPERTS`).
pub const MOE_MAX_EXPERTS: usize = 1024;
/// Most experts a token is routed to (`MOE_MAX_TOPK`).
pub const MOE_MAX_TOP_K: usize = 16;
/// Threads of a `moe_route` block (`MOE_ROUTE_THREADS`).
const ROUTE_THREADS: u32 = 256;
/// Threads of a GEMV block and the rows it covers (`MOE_GEMV_THREADS`, `MOE_ROWS_PER_BLOCK`).
const GEMV_THREADS: u32 = 256;
const GEMV_ROWS_PER_BLOCK: usize = 16;

const I32: usize = 4;

fn check_experts(op: &'static str, experts: usize, top_k: usize) -> Result<(), CudaError> {
    shape(
        op,
        (1..=MOE_MAX_EXPERTS).contains(&experts)
            && (1..=MOE_MAX_TOP_K.min(experts)).contains(&top_k),
        || {
            format!(
                "{experts} experts, top_k {top_k}: need 1..={MOE_MAX_EXPERTS} experts and \
                 1..={MOE_MAX_TOP_K} (at most the experts) picks"
            )
        },
    )
}

/// Routing as cpu/moe.rs `route`, one token a block. Scoring from `spec.scoring`: `Softmax {
/// group_limited }` or `SigmoidBiased` with `bias` (f32 `[experts]`) added for the choice only;
/// grouped scorings keep the `topk_groups` groups with the best group score (the best expert under
/// softmax, the sum of the best two under sigmoid) when `topk_groups < num_groups` and mask the
/// others (0 under softmax, -inf under sigmoid); the `top_k` experts by choice score in descending
/// order, the lower index first among equals (Rust's `total_cmp` order); weights the (masked)
/// softmax score or the unbiased sigmoid, divided by their sum + 1e-20 when `norm_topk_prob &&
/// top_k > 1`, times `routed_scaling_factor`. `logits`: f32 `[tokens][experts]`; `ids`: i32
/// `[tokens][top_k]`; `weights`: f32 `[tokens][top_k]`.
pub fn moe_route(
    gpu: &Gpu,
    spec: &MoeSpec,
    logits: &DevBuf,
    bias: Option<&DevBuf>,
    tokens: usize,
    ids: &DevBuf,
    weights: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "moe_route";
    let (experts, top_k, groups) = (spec.num_experts, spec.top_k, spec.num_groups);
    check_experts(OP, experts, top_k)?;
    let scoring = match spec.scoring {
        MoeScoring::Softmax {
            group_limited: false,
        } => 0i32,
        MoeScoring::Softmax {
            group_limited: true,
        } => 1,
        MoeScoring::SigmoidBiased => 2,
    };
    shape(OP, groups > 0 && experts.is_multiple_of(groups), || {
        format!("{experts} experts in {groups} groups")
    })?;
    // V3's group score is the sum of a group's best two
    let masks = scoring != 0 && spec.topk_groups < groups;
    shape(OP, !(masks && scoring == 2 && experts / groups < 2), || {
        format!("sigmoid group scores need two experts a group ({experts} in {groups})")
    })?;
    need(OP, "logits", logits, tokens * experts * F32)?;
    if let Some(b) = bias {
        need(OP, "bias", b, experts * F32)?;
    }
    need(OP, "ids", ids, tokens * top_k * I32)?;
    need(OP, "weights", weights, tokens * top_k * F32)?;
    if tokens == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let bp = bias.map_or(0u64, |b| b.ptr());
    let (e, k, g, kg) = (
        experts as i32,
        top_k as i32,
        i32_of(OP, groups)?,
        i32_of(OP, spec.topk_groups)?,
    );
    let norm = i32::from(spec.norm_topk_prob);
    let scaling = spec.routed_scaling_factor;
    let mut b = gpu.launch_builder(f);
    b.arg(logits.ptr_ref())
        .arg(&bp)
        .arg(&e)
        .arg(&k)
        .arg(&g)
        .arg(&kg)
        .arg(&scoring)
        .arg(&norm)
        .arg(&scaling)
        .arg(ids.ptr_ref())
        .arg(weights.ptr_ref());
    // SAFETY: sizes checked above; experts and top_k within the kernel's shared arrays.
    unsafe { b.launch(cfg((u32_of(OP, tokens)?, 1, 1), ROUTE_THREADS)) }.map_err(launched(OP))?;
    Ok(())
}

/// The checks both expert GEMVs share: the expert count, the pairs, the reduction length (a
/// multiple of 8: 16-byte loads) and the alignment of the bf16 operands.
fn check_gemv(
    op: &'static str,
    experts: usize,
    top_k: usize,
    tokens: usize,
    reduce: usize,
    aligned: &[(&str, &DevBuf)],
) -> Result<(), CudaError> {
    check_experts(op, experts, top_k)?;
    shape(op, tokens * top_k <= MOE_GEMV_MAX_PAIRS, || {
        format!(
            "{tokens} tokens x top_k {top_k} pairs: at most {MOE_GEMV_MAX_PAIRS} (larger batches: the grouped GEMMs)"
        )
    })?;
    shape(op, reduce.is_multiple_of(8) && reduce > 0, || {
        format!("reduction length {reduce}: needs a positive multiple of 8")
    })?;
    for (what, b) in aligned {
        shape(op, b.ptr().is_multiple_of(16), || {
            format!("{what} at {:#x}: not 16-byte aligned", b.ptr())
        })?;
    }
    Ok(())
}

/// For each pair `p = t * top_k + j` with expert `e = ids[p]`: `act[p][n] = silu(g) * u`, `g =
/// W[e][n] . x[t]`, `u = W[e][inter + n] . x[t]`. `w`: bf16 `[experts][2 * inter][hidden]` (gate
/// rows, then up rows); `x`: bf16 `[tokens][hidden]`; `ids`: i32 `[tokens * top_k]`; `act`: bf16
/// `[tokens * top_k][inter]`. Expert-major: grid (row tiles, min(experts, pairs)), a block finds its expert's
/// pairs in `ids` (blocks of untouched experts exit at once), so each touched expert's weights
/// are read from memory once. A pair whose id is outside `0..experts` gets a zero row (nothing is
/// read for it). `hidden % 8 == 0`, `w` and `x` 16-byte aligned, `tokens * top_k <=`
/// [`MOE_GEMV_MAX_PAIRS`].
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up_swiglu(
    gpu: &Gpu,
    experts: usize,
    inter: usize,
    hidden: usize,
    top_k: usize,
    w: &DevBuf,
    x: &DevBuf,
    ids: &DevBuf,
    tokens: usize,
    act: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "moe_gate_up_swiglu";
    check_gemv(OP, experts, top_k, tokens, hidden, &[("w", w), ("x", x)])?;
    let pairs = tokens * top_k;
    need(OP, "w", w, experts * 2 * inter * hidden * BF16)?;
    need(OP, "x", x, tokens * hidden * BF16)?;
    need(OP, "ids", ids, pairs * I32)?;
    need(OP, "act", act, pairs * inter * BF16)?;
    if tokens == 0 || inter == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (p, k, e, i, h) = (
        pairs as i32,
        top_k as i32,
        experts as i32,
        i32_of(OP, inter)?,
        i32_of(OP, hidden)?,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(x.ptr_ref())
        .arg(ids.ptr_ref())
        .arg(&p)
        .arg(&k)
        .arg(&e)
        .arg(&i)
        .arg(&h)
        .arg(act.ptr_ref());
    let grid = (
        u32_of(OP, inter.div_ceil(GEMV_ROWS_PER_BLOCK))?,
        // a slot per expert the pairs can touch: the smaller of the experts and the pairs
        experts.min(tokens * top_k) as u32,
        1,
    );
    // SAFETY: sizes and alignment checked above; ids outside 0..experts are never used to index.
    unsafe { b.launch(cfg(grid, GEMV_THREADS)) }.map_err(launched(OP))?;
    Ok(())
}

/// `y[p][n] = W[e][n] . act[p]` for each pair, `e = ids[p]` (a zero row for an id outside
/// `0..experts`). `w`: bf16 `[experts][hidden][inter]`; `act`: bf16 `[tokens * top_k][inter]`;
/// `y`: f32 `[tokens * top_k][hidden]`. Expert-major as [`moe_gate_up_swiglu`]; `inter % 8 == 0`,
/// `w` and `act` 16-byte aligned.
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    gpu: &Gpu,
    experts: usize,
    hidden: usize,
    inter: usize,
    top_k: usize,
    w: &DevBuf,
    act: &DevBuf,
    ids: &DevBuf,
    tokens: usize,
    y: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "moe_down";
    check_gemv(OP, experts, top_k, tokens, inter, &[("w", w), ("act", act)])?;
    let pairs = tokens * top_k;
    need(OP, "w", w, experts * hidden * inter * BF16)?;
    need(OP, "act", act, pairs * inter * BF16)?;
    need(OP, "ids", ids, pairs * I32)?;
    need(OP, "y", y, pairs * hidden * F32)?;
    if tokens == 0 || hidden == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (p, e, h, i) = (
        pairs as i32,
        experts as i32,
        i32_of(OP, hidden)?,
        i32_of(OP, inter)?,
    );
    let mut b = gpu.launch_builder(f);
    b.arg(w.ptr_ref())
        .arg(act.ptr_ref())
        .arg(ids.ptr_ref())
        .arg(&p)
        .arg(&e)
        .arg(&h)
        .arg(&i)
        .arg(y.ptr_ref());
    let grid = (
        u32_of(OP, hidden.div_ceil(GEMV_ROWS_PER_BLOCK))?,
        // a slot per expert the pairs can touch: the smaller of the experts and the pairs
        experts.min(tokens * top_k) as u32,
        1,
    );
    // SAFETY: sizes and alignment checked above; ids outside 0..experts are never used to index.
    unsafe { b.launch(cfg(grid, GEMV_THREADS)) }.map_err(launched(OP))?;
    Ok(())
}

/// `resid[t][n] += sum_j weights[t][j] * y[row(t * top_k + j)][n]`, `j` in order `0..top_k`
/// (deterministic), `row(p) = map[p]` when `map` (device i32 `[tokens * top_k]`) is given, else
/// `p`; a row outside the rows `y` holds adds nothing. `y`: f32 `[rows][hidden]`; `weights`: f32
/// `[tokens][top_k]`; `resid`: f32 `[tokens][hidden]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    gpu: &Gpu,
    hidden: usize,
    top_k: usize,
    y: &DevBuf,
    map: Option<u64>,
    weights: &DevBuf,
    tokens: usize,
    resid: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "moe_combine";
    shape(
        OP,
        (1..=MOE_MAX_TOP_K).contains(&top_k) && hidden > 0,
        || format!("top_k {top_k}, hidden {hidden}"),
    )?;
    let pairs = tokens * top_k;
    let y_rows = y.bytes() / (hidden * F32);
    if map.is_none() {
        need(OP, "y", y, pairs * hidden * F32)?;
    }
    need(OP, "weights", weights, pairs * F32)?;
    need(OP, "resid", resid, tokens * hidden * F32)?;
    if tokens == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let (yr, k, h) = (
        y_rows.min(i32::MAX as usize) as i32,
        top_k as i32,
        i32_of(OP, hidden)?,
    );
    let mp = map.unwrap_or(0);
    let mut b = gpu.launch_builder(f);
    b.arg(y.ptr_ref())
        .arg(&yr)
        .arg(&mp)
        .arg(weights.ptr_ref())
        .arg(&k)
        .arg(&h)
        .arg(resid.ptr_ref());
    // SAFETY: sizes checked above; mapped rows are bounded by y's rows in the kernel; `map` holds
    // tokens * top_k entries (caller contract).
    unsafe { b.launch(cfg((u32_of(OP, tokens)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}

/// `dst[i] = src[idx[i]]` for `i < n`: bf16 rows of `cols`; `idx` device i32 `[n]` (a zero row for
/// an index outside `0..src_rows`). 16-byte copies where `cols % 8 == 0` and both buffers are
/// 16-byte aligned.
pub fn gather_rows_bf16(
    gpu: &Gpu,
    src: &DevBuf,
    src_rows: usize,
    idx: u64,
    n: usize,
    cols: usize,
    dst: &DevBuf,
) -> Result<(), CudaError> {
    const OP: &str = "gather_rows_bf16";
    need(OP, "src", src, src_rows * cols * BF16)?;
    need(OP, "dst", dst, n * cols * BF16)?;
    if n == 0 || cols == 0 {
        return Ok(());
    }
    let f = gpu.kernel(OP)?;
    let vec = i32::from(
        cols.is_multiple_of(8) && src.ptr().is_multiple_of(16) && dst.ptr().is_multiple_of(16),
    );
    let (sr, c) = (i32_of(OP, src_rows)?, i32_of(OP, cols)?);
    let mut b = gpu.launch_builder(f);
    b.arg(src.ptr_ref())
        .arg(&sr)
        .arg(&idx)
        .arg(&c)
        .arg(&vec)
        .arg(dst.ptr_ref());
    // SAFETY: sizes checked above; indices are bounded by src_rows in the kernel; `idx` holds n
    // entries (caller contract).
    unsafe { b.launch(cfg((u32_of(OP, n)?, 1, 1), 128)) }.map_err(launched(OP))?;
    Ok(())
}
