//! KVH64 of device bytes (`pdnode_core::kvh64`, kernels/kvh64.cu): [`kvh64`] hashes a range in
//! one pass, and [`kv_copy_h64`] is `kv_copy` (gather or scatter between the pool and a staging
//! span) that also adds the staging words' terms to a device sum, so a hand-off through a device
//! arena is verified on the copy it runs anyway. The sum is the caller's (zeroed once per span,
//! read back with [`read_sum`] after the span's last copy), since the staging span of one rank
//! is filled by many launches (one per layer group).

use super::super::CudaError;
use super::super::device::{DevBuf, Gpu};
use super::{cfg, launched, need, shape, u32_of};
use pdnode_core::kvh64::{WORD, finish};

/// Threads per block of `kvh64_words`.
const BLOCK: u32 = 256;

/// Blocks of `kvh64_words` per SM: enough loads in flight to reach the read bandwidth.
const BLOCKS_PER_SM: u32 = 8;

/// Adds the terms of `len` bytes at `offset` of `buf` to the sum at `sum` (a `u64` on the
/// device), the first word at index `word0` of its span. `offset` and `len` are whole words.
pub fn add_words(
    gpu: &Gpu,
    buf: &DevBuf,
    offset: usize,
    len: usize,
    word0: u64,
    sum: u64,
) -> Result<(), CudaError> {
    const OP: &str = "kvh64";
    shape(
        OP,
        offset.checked_add(len).is_some_and(|e| e <= buf.bytes()),
        || format!("{len} bytes at {offset} of a {}-byte buffer", buf.bytes()),
    )?;
    shape(
        OP,
        offset.is_multiple_of(WORD) && len.is_multiple_of(WORD),
        || format!("{len} bytes at {offset}: not whole {WORD}-byte words"),
    )?;
    let nwords = (len / WORD) as i64;
    if nwords == 0 {
        return Ok(());
    }
    let blocks = (gpu.sm_count.max(1) * BLOCKS_PER_SM)
        .min(u32_of(OP, (nwords as usize).div_ceil(BLOCK as usize))?);
    let f = gpu.kernel("kvh64_words")?;
    let (data, w0) = (buf.at(offset), word0 as i64);
    let mut b = gpu.launch_builder(f);
    b.arg(&data).arg(&nwords).arg(&w0).arg(&sum);
    // SAFETY: the range lies inside `buf` and is whole 16-byte words at a 16-byte-aligned
    // offset (checked above; allocations are 256-byte aligned); the kernel reads `nwords` words
    // and adds to the one u64 at `sum`, the caller's device word.
    unsafe { b.launch(cfg((blocks, 1, 1), BLOCK)) }.map_err(launched(OP))?;
    Ok(())
}

/// Reads the device sum at `offset` of `buf` and finishes it as the hash of `len` bytes.
pub fn read_sum(gpu: &Gpu, buf: &DevBuf, offset: usize, len: u64) -> Result<u64, CudaError> {
    let mut s = [0u64];
    gpu.download(&mut s, buf, offset)?;
    Ok(finish(s[0], len))
}

/// KVH64 of bytes `offset .. offset + len` of `buf` (whole words), equal to
/// `pdnode_core::kvh64::kvh64` of the same bytes. Allocates the 8-byte sum, launches once and
/// waits for it.
pub fn kvh64(gpu: &Gpu, buf: &DevBuf, offset: usize, len: usize) -> Result<u64, CudaError> {
    let scratch = gpu.alloc(8)?;
    gpu.memset(&scratch, 0)?;
    add_words(gpu, buf, offset, len, 0, scratch.ptr())?;
    read_sum(gpu, &scratch, 0, len as u64)
}

/// `kv_copy` (`gather`: pool -> staging, else staging -> pool) of `nlayers` layers from
/// `layer0` and the `nblocks` blocks whose ids are at device address `blocks`, between the pool
/// and `staging` from byte `staging_offset`, adding the terms of the staging words to the device
/// `u64` at `sum`; those words are indices `word0 ..` of the hashed span.
#[allow(clippy::too_many_arguments)]
pub fn kv_copy_h64(
    gpu: &Gpu,
    gather: bool,
    pool: &DevBuf,
    staging: &DevBuf,
    staging_offset: usize,
    blocks: u64,
    nblocks: usize,
    layer0: usize,
    nlayers: usize,
    num_blocks: usize,
    layer_block_bytes: usize,
    word0: u64,
    sum: u64,
) -> Result<(), CudaError> {
    const OP: &str = "kv_copy_h64";
    shape(OP, staging_offset.is_multiple_of(WORD), || {
        format!("staging offset {staging_offset} is not a multiple of {WORD}")
    })?;
    shape(OP, layer_block_bytes.is_multiple_of(WORD), || {
        format!("layer-block of {layer_block_bytes} bytes is not a multiple of {WORD}")
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
        staging_offset + nlayers * nblocks * layer_block_bytes,
    )?;
    if nblocks * nlayers == 0 {
        return Ok(());
    }
    let f = gpu.kernel(if gather {
        "kv_gather_h64"
    } else {
        "kv_scatter_h64"
    })?;
    let (nb, l0, numb, lbv, w0) = (
        nblocks as i32,
        layer0 as i32,
        num_blocks as i32,
        (layer_block_bytes / WORD) as i64,
        word0 as i64,
    );
    let dst = staging.at(staging_offset);
    let stride = lbv * nblocks as i64;
    let mut b = gpu.launch_builder(f);
    b.arg(pool.ptr_ref())
        .arg(&dst)
        .arg(&blocks)
        .arg(&nb)
        .arg(&l0)
        .arg(&numb)
        .arg(&lbv)
        .arg(&stride)
        .arg(&w0)
        .arg(&sum);
    // SAFETY: sizes checked above; block ids are the caller's (< num_blocks); the kernel adds
    // to the one u64 at `sum`, the caller's device word.
    unsafe { b.launch(cfg((u32_of(OP, nblocks * nlayers)?, 1, 1), 256)) }.map_err(launched(OP))?;
    Ok(())
}
