//! The decode attention kernel alone, Llama-3.1-8B attention shapes (32 query heads, 8 KV heads,
//! head_dim 128, blocks of 16), one layer: achieved bandwidth of the K/V bytes it must read, as a
//! fraction of the device-to-device copy ceiling measured in the same process
//! ([`crate::measure_ceilings`]). Each kernel variant's output is compared with the first
//! variant's, so a fast but wrong kernel shows.

use crate::measure_ceilings;
use cudarc::driver::sys::CUevent_flags;
use pdnode_cuda::CudaError;
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, AttnDims, AttnMeta, AttnVariant, AttnWorkspace};

/// Llama-3.1-8B attention geometry (per layer).
pub const NUM_HEADS: usize = 32;
pub const NUM_KV_HEADS: usize = 8;
pub const HEAD_DIM: usize = 128;
pub const BLOCK_SIZE: usize = 16;

/// One measurement.
#[derive(Debug, Clone)]
pub struct AttnBenchRow {
    pub variant: AttnVariant,
    pub batch: usize,
    pub ctx: usize,
    /// Mean time of one `paged_attention_ex` call (kernel + combine), microseconds.
    pub us: f64,
    /// K/V bytes the call must read: batch * ctx * kv heads * head_dim * 2 (K, V) * 2 bytes.
    pub kv_bytes: f64,
    /// kv_bytes / time.
    pub gbps: f64,
    /// gbps over the copy ceiling (bytes read + written per second by a 1 GiB D2D copy).
    pub frac_of_copy: f64,
    /// Relative error against the first variant's output (0 for the first variant).
    pub rel_to_first: f64,
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    if a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Kernels whose resident blocks per SM the bench reports, with their threads and dynamic
/// shared memory per block (head_dim 128).
pub const OCCUPANCY_KERNELS: [(&str, u32, usize); 5] = [
    (
        "paged_attention_v4_d128_g8",
        128,
        ops::v4_smem_bytes(HEAD_DIM),
    ),
    (
        "paged_attention_v4_d128_g16",
        128,
        ops::v4_smem_bytes(HEAD_DIM),
    ),
    (
        "paged_attention_v4_d128_g8_w2",
        64,
        ops::v4_smem_bytes_warps(HEAD_DIM, 2),
    ),
    ("paged_attention_v2_d16", 128, 0),
    ("paged_attention", 128, 0),
];

/// What [`run_attention`] measured.
#[derive(Debug, Clone)]
pub struct AttnBench {
    /// The copy ceiling, bytes read + written per second.
    pub copy_bps: f64,
    pub rows: Vec<AttnBenchRow>,
    /// Resident blocks per SM of each of [`OCCUPANCY_KERNELS`] (after the runs, so with the
    /// shared-memory carveout the launches asked for).
    pub occupancy: Vec<(&'static str, u32)>,
}

/// Runs every `(batch, ctx)` case for every variant, `iters` timed calls each (after one
/// warm-up), timed with CUDA events.
pub fn run_attention(
    cases: &[(usize, usize)],
    variants: &[AttnVariant],
    iters: usize,
    mut report: impl FnMut(&AttnBenchRow),
) -> Result<AttnBench, CudaError> {
    if cases.is_empty() || variants.is_empty() || cases.iter().any(|&(b, c)| b == 0 || c == 0) {
        return Err(CudaError::Unsupported {
            reason: "attention bench: no case, no variant, or an empty case".into(),
        });
    }
    let gpu = Gpu::new(0)?;
    let copy_bps = measure_ceilings(&gpu)?.hbm_traffic_bps;
    let (nh, nkv, hd, bs) = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE);
    let max_blocks_total = cases
        .iter()
        .map(|&(b, c)| b * c.div_ceil(bs))
        .max()
        .unwrap_or(1);
    let max_batch = cases.iter().map(|c| c.0).max().unwrap_or(1);
    let d = AttnDims {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        num_blocks: max_blocks_total,
    };
    let pool = gpu.alloc(d.layer_elems() * 2)?;
    ops::fill_uniform_bf16(&gpu, &pool, d.layer_elems(), 7, 1.0)?;
    let q = gpu.alloc(max_batch * nh * hd * 2)?;
    ops::fill_uniform_bf16(&gpu, &q, max_batch * nh * hd, 8, 3.0)?;
    let out = gpu.alloc(max_batch * nh * hd * 2)?;
    let rows_splits = (64usize << 20) / (hd * 4);
    let (part_ml, part_acc) = (
        gpu.alloc(rows_splits * 8)?,
        gpu.alloc(rows_splits * hd * 4)?,
    );
    let ws = AttnWorkspace {
        part_ml: &part_ml,
        part_acc: &part_acc,
    };
    let mut rows = Vec::new();
    for &(batch, ctx) in cases {
        let nbps = ctx.div_ceil(bs);
        // sequence i's block j is block j * batch + i: scattered, as a busy pool would be
        let tables: Vec<i32> = (0..batch)
            .flat_map(|i| (0..nbps).map(move |j| (j * batch + i) as i32))
            .collect();
        let up = |v: &[i32]| -> Result<DevBuf, CudaError> {
            let b = gpu.alloc(v.len() * 4)?;
            gpu.upload(&b, 0, v)?;
            Ok(b)
        };
        let seq: Vec<i32> = (0..batch as i32).collect();
        let (dtab, dseq, dpos) = (up(&tables)?, up(&seq)?, up(&vec![ctx as i32 - 1; batch])?);
        let meta = AttnMeta {
            tok_seq: dseq.ptr(),
            tok_pos: dpos.ptr(),
            block_tables: dtab.ptr(),
            max_blocks: nbps,
            max_ctx: ctx,
            window: 0,
        };
        let call = |v: AttnVariant| {
            ops::paged_attention_ex(&gpu, &d, &q, &pool, 0, &meta, batch, None, &out, &ws, v)
        };
        let mut first: Option<Vec<f32>> = None;
        for &v in variants {
            gpu.memset(&out, 0xFF)?;
            call(v)?;
            let got = gpu.download_bf16(&out, batch * nh * hd)?;
            let rel_to_first = match &first {
                None => {
                    let r = if got.iter().all(|x| x.is_finite()) {
                        0.0
                    } else {
                        f64::INFINITY
                    };
                    first = Some(got);
                    r
                }
                Some(f) => rel(&got, f),
            };
            let ev = |what: &'static str| {
                gpu.stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(pdnode_cuda::drv(what))
            };
            let start = ev("cuEventRecord")?;
            for _ in 0..iters.max(1) {
                call(v)?;
            }
            let end = ev("cuEventRecord")?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(pdnode_cuda::drv("cuEventElapsedTime"))? as f64
                / iters.max(1) as f64;
            let kv_bytes = (batch * ctx * nkv * hd * 2 * 2) as f64;
            let gbps = kv_bytes / (ms * 1e-3) / 1e9;
            let row = AttnBenchRow {
                variant: v,
                batch,
                ctx,
                us: ms * 1e3,
                kv_bytes,
                gbps,
                frac_of_copy: gbps * 1e9 / copy_bps,
                rel_to_first,
            };
            report(&row);
            rows.push(row);
        }
    }
    let mut occupancy = Vec::new();
    for (name, threads, dyn_smem) in OCCUPANCY_KERNELS {
        let f = gpu.kernel(name)?;
        if dyn_smem > 0 {
            ops::prefer_shared_memory(f, dyn_smem)?;
        }
        let n = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, dyn_smem, None)
            .map_err(pdnode_cuda::drv(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            ))?;
        occupancy.push((name, n));
    }
    Ok(AttnBench {
        copy_bps,
        rows,
        occupancy,
    })
}
