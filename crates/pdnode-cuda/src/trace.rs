//! Kernel timelines from inside the GPU (profiling only; no Nsight Systems on the GPU hosts, and
//! Nsight Compute times one kernel at a time): with [`set_trace_kernels`] on before a [`Gpu`]
//! opens, its programs are the `PD_TRACE` builds of common.cuh, in which every block of every
//! kernel appends one record (launch id, function, SM, block, and `%globaltimer` when it reached
//! `griddepcontrol.wait`, when the wait returned and when it returned). [`Gpu::trace_take`]
//! reads them back; [`launches`] folds them into one span a launch, in launch order. This is how
//! a graph-replayed decode step's kernels are seen overlapping under programmatic dependent
//! launch (`bench_decode_trace`). Never on in serving: the records cost an atomic and a store a
//! block.

use super::device::Gpu;
use super::{CudaError, drv};
use pdnode_kernels::{KERNEL_NAMES, TRACE_CAP, TRACE_WORDS, WGMMA_KERNEL_NAMES, trace_name_hash};
use std::sync::atomic::{AtomicBool, Ordering};

static TRACED: AtomicBool = AtomicBool::new(false);

/// Makes GPUs opened from now on in this process load the traced kernel builds (or, with
/// `false`, the normal ones again). GPUs already open keep what they loaded.
pub fn set_trace_kernels(on: bool) {
    TRACED.store(on, Ordering::SeqCst);
}

pub(crate) fn kernels_traced() -> bool {
    TRACED.load(Ordering::SeqCst)
}

/// One block's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    /// The launch (`%gridid`): unique per grid launch, increasing in launch order.
    pub grid: u64,
    /// [`trace_name_hash`] of the function holding the wait (the kernel, or the device function
    /// it calls that does, e.g. `gemv_stream_impl`).
    pub func: u32,
    pub sm: u32,
    /// Linear block index, low 16 bits.
    pub block: u32,
    /// `%globaltimer` (ns) at the wait, after it, and at return.
    pub t_start: u64,
    pub t_waited: u64,
    pub t_end: u64,
}

impl TraceRecord {
    /// Decodes the `TRACE_WORDS` u64 words of one record.
    pub fn from_words(w: &[u64]) -> Option<TraceRecord> {
        let &[grid, meta, t_start, t_waited, t_end] = w else {
            return None;
        };
        Some(TraceRecord {
            grid,
            func: (meta >> 32) as u32,
            sm: ((meta >> 16) & 0xffff) as u32,
            block: (meta & 0xffff) as u32,
            t_start,
            t_waited,
            t_end,
        })
    }
}

/// What [`Gpu::trace_take`] read: the records and how many did not fit the buffer.
#[derive(Debug, Clone, Default)]
pub struct TraceDump {
    pub records: Vec<TraceRecord>,
    pub dropped: usize,
}

/// The name of a kernel entry (or of `gemv_stream_impl`, the function of the streaming GEMVs
/// that holds their wait) whose [`trace_name_hash`] is `h`.
pub fn trace_func_name(h: u32) -> Option<&'static str> {
    KERNEL_NAMES
        .iter()
        .chain(WGMMA_KERNEL_NAMES.iter())
        .chain(["gemv_stream_impl"].iter())
        .copied()
        .find(|n| trace_name_hash(n) == h)
}

impl Gpu {
    /// Empties the record buffers of this GPU's traced programs (after a sync: nothing may be
    /// running). Fails if the programs are not the traced builds.
    pub fn trace_reset(&self) -> Result<(), CudaError> {
        self.bind()?;
        for m in self.modules() {
            let mut n = m
                .get_global("pd_trace_n", &self.stream)
                .map_err(drv("cuModuleGetGlobal (pd_trace_n)"))?;
            self.stream
                .memcpy_htod(&[0u8; 4], &mut n)
                .map_err(drv("cuMemcpyHtoD (pd_trace_n)"))?;
        }
        self.sync()
    }

    /// Reads (and empties) the records of every traced program of this GPU, after a sync.
    pub fn trace_take(&self) -> Result<TraceDump, CudaError> {
        self.sync()?;
        let mut dump = TraceDump::default();
        for m in self.modules() {
            let n_view = m
                .get_global("pd_trace_n", &self.stream)
                .map_err(drv("cuModuleGetGlobal (pd_trace_n)"))?;
            let mut nb = [0u8; 4];
            self.stream
                .memcpy_dtoh(&n_view, &mut nb[..])
                .map_err(drv("cuMemcpyDtoH (pd_trace_n)"))?;
            self.sync()?;
            let n = u32::from_le_bytes(nb) as usize;
            let kept = n.min(TRACE_CAP);
            dump.dropped += n - kept;
            let buf = m
                .get_global("pd_trace_buf", &self.stream)
                .map_err(drv("cuModuleGetGlobal (pd_trace_buf)"))?;
            let bytes = kept * TRACE_WORDS * 8;
            if buf.len() < bytes {
                return Err(CudaError::Shape {
                    op: "trace_take",
                    reason: format!("pd_trace_buf holds {} bytes, {bytes} recorded", buf.len()),
                });
            }
            let mut raw = vec![0u8; bytes];
            if bytes > 0 {
                let src = buf.slice(0..bytes);
                self.stream
                    .memcpy_dtoh(&src, &mut raw[..])
                    .map_err(drv("cuMemcpyDtoH (pd_trace_buf)"))?;
                self.sync()?;
            }
            let words: Vec<u64> = raw
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            dump.records.extend(
                words
                    .chunks_exact(TRACE_WORDS)
                    .filter_map(TraceRecord::from_words),
            );
        }
        self.trace_reset()?;
        Ok(dump)
    }
}

/// One launch folded from its blocks' records.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSpan {
    pub grid: u64,
    /// [`trace_func_name`], or the hash in hex.
    pub name: String,
    pub blocks: usize,
    /// Earliest block at its wait (its blocks were resident from about then).
    pub first_start: u64,
    /// Earliest return from the wait: when the kernel before it had completed, as seen here.
    pub first_waited: u64,
    /// Earliest and latest block return.
    pub first_end: u64,
    pub last_end: u64,
}

/// The records grouped by launch, in launch order (by launch id; the ids of one process's
/// launches increase).
pub fn launches(records: &[TraceRecord]) -> Vec<LaunchSpan> {
    let mut by: std::collections::BTreeMap<u64, LaunchSpan> = Default::default();
    for r in records {
        let e = by.entry(r.grid).or_insert_with(|| LaunchSpan {
            grid: r.grid,
            name: trace_func_name(r.func)
                .map(str::to_string)
                .unwrap_or_else(|| format!("{:08x}", r.func)),
            blocks: 0,
            first_start: u64::MAX,
            first_waited: u64::MAX,
            first_end: u64::MAX,
            last_end: 0,
        });
        e.blocks += 1;
        e.first_start = e.first_start.min(r.t_start);
        e.first_waited = e.first_waited.min(r.t_waited);
        e.first_end = e.first_end.min(r.t_end);
        e.last_end = e.last_end.max(r.t_end);
    }
    by.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(grid: u64, name: &str, block: u32, t: [u64; 3]) -> TraceRecord {
        TraceRecord {
            grid,
            func: trace_name_hash(name),
            sm: block % 132,
            block,
            t_start: t[0],
            t_waited: t[1],
            t_end: t[2],
        }
    }

    #[test]
    fn records_decode_and_fold_into_launches_in_order() {
        let words = [7u64, (0xdead_beefu64 << 32) | (5 << 16) | 9, 10, 20, 30];
        let r = TraceRecord::from_words(&words).unwrap();
        assert_eq!(
            (
                r.grid, r.func, r.sm, r.block, r.t_start, r.t_waited, r.t_end
            ),
            (7, 0xdead_beef, 5, 9, 10, 20, 30)
        );
        assert!(TraceRecord::from_words(&words[..4]).is_none());
        // two launches, blocks out of order, the later launch listed first
        let recs = [
            rec(12, "attention_combine", 0, [50, 60, 70]),
            rec(11, "rope_qkv_v4", 1, [5, 12, 40]),
            rec(11, "rope_qkv_v4", 0, [3, 11, 35]),
            rec(12, "attention_combine", 1, [45, 61, 80]),
            rec(13, "no_such_kernel", 0, [1, 2, 3]),
        ];
        let l = launches(&recs);
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].name, "rope_qkv_v4");
        assert_eq!(
            (
                l[0].blocks,
                l[0].first_start,
                l[0].first_waited,
                l[0].first_end,
                l[0].last_end
            ),
            (2, 3, 11, 35, 40)
        );
        assert_eq!(l[1].name, "attention_combine");
        assert_eq!((l[1].first_start, l[1].last_end), (45, 80));
        assert_eq!(
            l[2].name,
            format!("{:08x}", trace_name_hash("no_such_kernel"))
        );
        assert_eq!(
            trace_func_name(trace_name_hash("gemv_stream_impl")),
            Some("gemv_stream_impl")
        );
    }
}
