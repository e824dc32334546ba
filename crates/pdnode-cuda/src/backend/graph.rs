//! CUDA graphs of decode steps.
//!
//! A decode step (every sequence has exactly one new token and wants its logits) launches about
//! ten small kernels per layer; at small batches the launches, not the bytes, set the step time.
//! Such steps are captured once per `(batch-size bucket, context bucket)` into a CUDA graph and
//! replayed:
//!
//! - Every buffer the graph reads lives at a fixed device address: the workspace (allocated once
//!   at start), the KV pool, the weights, and one metadata buffer per graph (token ids,
//!   positions, KV slots, sequence of each token, block tables `[bucket, ctx_bucket /
//!   block_size]`, logits rows), refreshed with one host-to-device copy before each replay.
//! - Launch shapes that depend on the context (attention split-K partitions) are fixed per
//!   graph: it is captured with `max_ctx = ctx_bucket` (a power of two >= the longest context of
//!   the step); partitions past a sequence's own context exit early with neutral partials, as
//!   they already do for the shorter sequences of an eager mixed batch.
//! - Padding rows (bucket > batch) repeat the real row with the shortest context: same token,
//!   position, KV slot and block table. They compute the same K/V values as that row and write
//!   them to that row's own slot, so no block outside the batch's sequences is ever written
//!   (no scratch block is taken from the scheduler, and the pool geometry seen by the KV
//!   hand-off is unchanged); their logits rows are computed and dropped.
//! - cuBLAS runs with a fixed workspace (`blas::BLAS_WORKSPACE_BYTES`), so nothing is allocated
//!   inside the capture; NCCL all-reduces (tensor parallelism) are captured like kernels, each
//!   rank's thread capturing its own graph (mode thread-local).
//!
//! A capture that fails logs one warning and that key runs eagerly from then on; a step that
//! cannot use a graph (prefill rows, more sequences than the workspace) runs eagerly.

use super::CudaBackend;
use super::plan::{MetaOffsets, StepPlan, StepShape};
use crate::device::DevBuf;
use crate::{CudaError, drv};
use cudarc::driver::{CudaGraph, sys};
use pdnode_engine::backend::{BackendError, ForwardBatch};
use std::collections::{HashMap, HashSet};

/// Batch-size buckets; past the last one, multiples of 64. Capped at the backend's `max_seqs`
/// (and `max_batch_tokens`), which is then a bucket of its own.
const BATCH_BUCKETS: [usize; 14] = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256];
/// Smallest context bucket (contexts are rounded up to a power of two at least this large).
const MIN_CTX_BUCKET: usize = 256;
/// Most graphs kept at once; past this, the cache is emptied and refilled on demand.
pub(super) const MAX_GRAPHS: usize = 128;

/// The graph batch size for `n` sequences when at most `cap` fit the workspace (None: `n` is 0
/// or above `cap`).
pub fn decode_bucket(n: usize, cap: usize) -> Option<usize> {
    if n == 0 || n > cap {
        return None;
    }
    let b = BATCH_BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= n)
        .unwrap_or_else(|| n.next_multiple_of(64));
    Some(b.min(cap))
}

/// The context a graph is captured for when the longest context of the step is `max_ctx`.
pub(super) fn ctx_bucket(max_ctx: usize) -> usize {
    max_ctx.next_power_of_two().max(MIN_CTX_BUCKET)
}

/// Whether `batch` is a decode step a graph can run: one new token per sequence, all wanting
/// logits.
pub(super) fn is_decode(batch: &ForwardBatch<'_>) -> bool {
    !batch.seqs.is_empty()
        && batch
            .seqs
            .iter()
            .all(|s| s.tokens.len() == 1 && s.want_logits)
}

/// Counters of the decode graphs of one backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (and instantiated) so far.
    pub captures: u64,
    /// Decode steps run by replaying a graph.
    pub replays: u64,
    /// Decode steps run eagerly with graphs enabled (no bucket, or its capture had failed).
    pub eager_decode_steps: u64,
    /// Captures that failed (each key falls back to eager for good).
    pub capture_failures: u64,
    /// Graphs held now.
    pub graphs: usize,
}

struct Entry {
    // Field order is drop order: the graph before the metadata it reads.
    graph: CudaGraph,
    meta: DevBuf,
}

// SAFETY: CUDA graph objects must not be used by two threads at once, but may move between
// threads; the entry is only reached through its backend (`&mut` for capture and replay), which
// binds its context on the calling thread first, so one thread at a time uses it.
unsafe impl Send for Entry {}

/// The captured decode graphs of one backend, keyed by `(batch bucket, context bucket)`.
pub(super) struct DecodeGraphs {
    map: HashMap<(usize, usize), Entry>,
    failed: HashSet<(usize, usize)>,
    enabled: bool,
    warned: bool,
    stats: GraphStats,
}

impl DecodeGraphs {
    pub(super) fn new(enabled: bool) -> Self {
        Self {
            map: HashMap::new(),
            failed: HashSet::new(),
            enabled,
            warned: false,
            stats: GraphStats::default(),
        }
    }

    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }

    pub(super) fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    /// Drops every graph (the caller has synchronized the stream: none is running).
    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.failed.clear();
    }

    /// Stops using graphs without dropping them (when the stream could not be synchronized).
    pub(super) fn disable(&mut self) {
        self.enabled = false;
    }

    pub(super) fn stats(&self) -> GraphStats {
        GraphStats {
            graphs: self.map.len(),
            ..self.stats
        }
    }

    fn warn_once(&mut self, what: &str, err: &CudaError) {
        if !self.warned {
            self.warned = true;
            tracing::warn!(error = %err, "CUDA graph {what} failed; those decode steps run eagerly");
        } else {
            tracing::debug!(error = %err, "CUDA graph {what} failed");
        }
    }
}

/// Per-step metadata of a graph of `bucket` rows and `mb` blocks per table, from a validated
/// decode batch (see the module docs for the padding rows).
fn decode_layout(
    batch: &ForwardBatch<'_>,
    bucket: usize,
    mb: usize,
    bs: usize,
) -> (Vec<u8>, MetaOffsets) {
    let n = batch.seqs.len();
    let mut ids = Vec::with_capacity(bucket);
    let mut pos = Vec::with_capacity(bucket);
    let mut slots = Vec::with_capacity(bucket);
    let mut tok_seq = Vec::with_capacity(bucket);
    let mut tables = vec![0i32; bucket * mb];
    for (i, s) in batch.seqs.iter().enumerate() {
        let p = s.start_pos;
        ids.push(s.tokens[0]);
        pos.push(p as i32);
        slots.push(s.block_table[p / bs].0 as i64 * bs as i64 + (p % bs) as i64);
        tok_seq.push(i as i32);
        let nb = (p + 1).div_ceil(bs);
        for (j, b) in s.block_table[..nb].iter().enumerate() {
            tables[i * mb + j] = b.0 as i32;
        }
    }
    let shortest = (0..n).min_by_key(|&i| batch.seqs[i].start_pos).unwrap_or(0);
    for _ in n..bucket {
        ids.push(ids[shortest]);
        pos.push(pos[shortest]);
        slots.push(slots[shortest]);
        tok_seq.push(shortest as i32);
    }
    let rows: Vec<i32> = (0..bucket as i32).collect();
    MetaOffsets::pack(&ids, &pos, &slots, &tok_seq, &tables, &rows, &[])
}

impl CudaBackend {
    /// Runs the decode step `batch` (validated into `p`) from a graph, capturing it first if
    /// needed. Ok(false): no graph for it; the caller runs the step eagerly.
    pub(super) fn replay_decode(
        &mut self,
        batch: &ForwardBatch<'_>,
        p: &StepPlan,
    ) -> Result<bool, BackendError> {
        let cap = self.opts.max_seqs.min(self.opts.max_batch_tokens);
        let Some(bucket) = decode_bucket(batch.seqs.len(), cap) else {
            self.graphs.stats.eager_decode_steps += 1;
            return Ok(false);
        };
        let bs = self.opts.block_size as usize;
        let ctx_b = ctx_bucket(p.max_ctx);
        let key = (bucket, ctx_b);
        if self.graphs.failed.contains(&key) {
            self.graphs.stats.eager_decode_steps += 1;
            return Ok(false);
        }
        let mb = ctx_b.div_ceil(bs);
        let (bytes, off) = decode_layout(batch, bucket, mb, bs);
        if !self.graphs.map.contains_key(&key) {
            if self.graphs.map.len() >= MAX_GRAPHS {
                // A replay may still read them.
                self.gpu.sync()?;
                self.graphs.map.clear();
            }
            match self.capture(bucket, ctx_b, mb, &off, &bytes) {
                Ok(e) => {
                    self.graphs.stats.captures += 1;
                    self.graphs.map.insert(key, e);
                }
                Err(e) => {
                    self.graphs.warn_once("capture", &e);
                    self.graphs.stats.capture_failures += 1;
                    self.graphs.stats.eager_decode_steps += 1;
                    self.graphs.failed.insert(key);
                    // Surfaces a sticky device error now rather than in the eager step.
                    self.gpu.sync()?;
                    return Ok(false);
                }
            }
        }
        let Some(e) = self.graphs.map.get(&key) else {
            return Ok(false);
        };
        self.gpu.upload(&e.meta, 0, &bytes)?;
        if let Err(err) = e.graph.launch().map_err(drv("cuGraphLaunch")) {
            self.graphs.warn_once("launch", &err);
            self.gpu.sync()?;
            self.graphs.map.remove(&key);
            self.graphs.failed.insert(key);
            self.graphs.stats.eager_decode_steps += 1;
            return Ok(false);
        }
        self.graphs.stats.replays += 1;
        Ok(true)
    }

    /// Captures the decode step of `bucket` rows over contexts up to `ctx_b` (tables of `mb`
    /// blocks) reading its metadata from a fresh buffer, after running this step's padded
    /// metadata `bytes` once eagerly with the same shapes: that loads every kernel (cuBLAS
    /// included) and sets NCCL's connections up outside the capture. The caller's replay then
    /// runs the same step again, writing the same K/V values to the same slots.
    fn capture(
        &mut self,
        bucket: usize,
        ctx_b: usize,
        mb: usize,
        off: &MetaOffsets,
        bytes: &[u8],
    ) -> Result<Entry, CudaError> {
        let meta = self.gpu.alloc(bytes.len())?;
        self.gpu.upload(&meta, 0, bytes)?;
        let shape = StepShape {
            off,
            tokens: bucket,
            rows: bucket,
            max_blocks: mb,
            max_ctx: ctx_b,
            long: &[],
            short_len: bucket,
        };
        let t0 = std::time::Instant::now();
        self.encode(meta.ptr(), &shape)?;
        // Nothing may be pending in the stream when capture begins (and a device error of the
        // warm-up surfaces here, not as a failed capture).
        self.gpu.sync()?;
        self.gpu
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("cuStreamBeginCapture"))?;
        let encoded = self.encode(meta.ptr(), &shape);
        // Always end the capture, so the stream leaves capture mode whatever happened.
        let ended = self
            .gpu
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0));
        encoded?;
        let graph = ended
            .map_err(drv("cuStreamEndCapture/cuGraphInstantiate"))?
            .ok_or_else(|| CudaError::Unsupported {
                reason: "stream capture produced no graph".into(),
            })?;
        graph.upload().map_err(drv("cuGraphUpload"))?;
        tracing::debug!(
            gpu = self.gpu.ordinal,
            bucket,
            ctx_bucket = ctx_b,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "captured decode CUDA graph"
        );
        Ok(Entry { graph, meta })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::BlockId;
    use pdnode_engine::backend::SeqStep;

    #[test]
    fn buckets_cover_every_batch_up_to_the_cap() {
        for cap in [1, 3, 8, 33, 64, 100, 256, 300, 1000] {
            let mut last = 0;
            for n in 1..=cap {
                let b = decode_bucket(n, cap).expect("a bucket");
                assert!(b >= n && b <= cap, "n {n} cap {cap} -> {b}");
                assert!(b >= last, "buckets grow with n");
                last = b;
            }
            assert_eq!(decode_bucket(0, cap), None);
            assert_eq!(decode_bucket(cap + 1, cap), None);
        }
        assert_eq!(decode_bucket(3, 128), Some(4));
        assert_eq!(decode_bucket(33, 128), Some(48));
        assert_eq!(decode_bucket(33, 40), Some(40));
        assert_eq!(decode_bucket(300, 1000), Some(320));
        // few distinct graphs: 1..=128 maps onto 10 buckets
        let distinct: HashSet<usize> = (1..=128).filter_map(|n| decode_bucket(n, 128)).collect();
        assert_eq!(distinct.len(), 10);
    }

    #[test]
    fn context_buckets_are_powers_of_two_covering_the_context() {
        for c in [1, 255, 256, 257, 1000, 4096, 4097, 131072] {
            let b = ctx_bucket(c);
            assert!(b >= c && b >= MIN_CTX_BUCKET && b.is_power_of_two());
            assert!(b < 2 * c.max(MIN_CTX_BUCKET));
        }
    }

    fn read<T: Copy + Default>(bytes: &[u8], off: usize, n: usize) -> Vec<T> {
        let sz = std::mem::size_of::<T>();
        (0..n)
            .map(|i| {
                let mut v = T::default();
                // SAFETY: T is a plain integer type; the slice holds `sz` bytes at this offset.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes[off + i * sz..].as_ptr(),
                        &mut v as *mut T as *mut u8,
                        sz,
                    )
                };
                v
            })
            .collect()
    }

    #[test]
    fn padding_rows_repeat_the_shortest_sequence_and_write_only_its_slot() {
        let bs = 4;
        let t0 = [BlockId(7), BlockId(3), BlockId(9)];
        let t1 = [BlockId(5)];
        let t2 = [BlockId(11), BlockId(2)];
        let batch = ForwardBatch {
            seqs: vec![
                SeqStep {
                    tokens: &[10],
                    start_pos: 9,
                    block_table: &t0,
                    want_logits: true,
                },
                SeqStep {
                    tokens: &[20],
                    start_pos: 2,
                    block_table: &t1,
                    want_logits: true,
                },
                SeqStep {
                    tokens: &[30],
                    start_pos: 4,
                    block_table: &t2,
                    want_logits: true,
                },
            ],
        };
        assert!(is_decode(&batch));
        let (bucket, mb) = (4, ctx_bucket(10) / bs);
        let (bytes, off) = decode_layout(&batch, bucket, mb, bs);
        assert_eq!(read::<u32>(&bytes, off.ids, 4), vec![10, 20, 30, 20]);
        assert_eq!(read::<i32>(&bytes, off.pos, 4), vec![9, 2, 4, 2]);
        assert_eq!(
            read::<i64>(&bytes, off.slots, 4),
            vec![9 * 4 + 1, 5 * 4 + 2, 2 * 4, 5 * 4 + 2]
        );
        assert_eq!(read::<i32>(&bytes, off.tok_seq, 4), vec![0, 1, 2, 1]);
        assert_eq!(read::<i32>(&bytes, off.rows, 4), vec![0, 1, 2, 3]);
        let tables = read::<i32>(&bytes, off.tables, bucket * mb);
        assert_eq!(&tables[..3], &[7, 3, 9]);
        assert_eq!(tables[mb], 5);
        assert_eq!(&tables[2 * mb..2 * mb + 2], &[11, 2]);
        // the layout (offsets, size) depends only on (bucket, mb): one buffer per graph
        let one = ForwardBatch {
            seqs: vec![batch.seqs[1]],
        };
        let (b1, o1) = decode_layout(&one, bucket, mb, bs);
        assert_eq!(b1.len(), bytes.len());
        assert_eq!(
            (o1.tables, o1.rows, o1.short),
            (off.tables, off.rows, off.short)
        );
        let not_decode = ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &[1, 2],
                start_pos: 0,
                block_table: &t1,
                want_logits: true,
            }],
        };
        assert!(!is_decode(&not_decode));
    }
}
