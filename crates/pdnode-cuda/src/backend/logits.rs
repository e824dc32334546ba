//! The logits landing on the host: full rows straight into a page-locked buffer the engine's
//! [`StepLogits`] owns between steps (one copy, no allocation after the first step), greedy rows
//! reduced to their arg-max and sampled rows to their token on the device (`kernels/sample.cu`
//! `argmax_rows`, `sample_rows`) so only one id per row crosses PCIe.
//!
//! `sample_rows` takes its per-row parameters by value (a [`SampleBatch`] kernel argument of up
//! to [`SAMPLE_ROWS_PER_LAUNCH`] rows, one launch per that many sampled rows): no device buffer
//! and no upload, so it runs the same after an eager step and after a replayed CUDA graph.
//! `engine.cuda.gpu_sampling = false` ([`crate::CudaOptions::gpu_sampling`]) turns device
//! sampling off: the engine then asks for full rows and samples them on the host.

use super::CudaBackend;
use crate::CudaError;
use crate::device::Pinned;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use pdnode_engine::backend::{
    BackendError, LogitsWant, RowOut, RowStore, StepLogits, check_logits_wants,
};
use pdnode_engine::sampling::RowDraw;

/// Sampled rows per `sample_rows` launch (`SAMPLE_ROWS_PER_LAUNCH` in `kernels/sample.cu`): 64
/// x 32 bytes of kernel arguments, under the 4 KiB every driver takes.
pub const SAMPLE_ROWS_PER_LAUNCH: usize = 64;

/// One sampled row as `sample_rows` reads it (`SampleRowArg` in `kernels/sample.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleRowArg {
    pub u: f64,
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: u32,
    pub row: i32,
    pub pad: i32,
}

/// The by-value argument of one `sample_rows` launch (`SampleBatch` in `kernels/sample.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SampleBatch {
    pub rows: [SampleRowArg; SAMPLE_ROWS_PER_LAUNCH],
}

// SAFETY: plain `repr(C)` data (numbers only, no padding the kernel reads: `pad` fills the
// struct to its 8-byte alignment), laid out as the kernel's `SampleBatch`.
unsafe impl DeviceRepr for SampleBatch {}

impl SampleRowArg {
    fn new(row: usize, d: &RowDraw) -> Self {
        Self {
            u: d.u,
            temperature: d.temperature,
            top_p: d.top_p,
            min_p: d.min_p,
            top_k: d.top_k,
            row: row as i32,
            pad: 0,
        }
    }
}

/// The `sample_rows` launches of `want` (rows with [`LogitsWant::Sample`]), in order.
pub(super) fn sample_batches(want: &[LogitsWant]) -> Vec<(SampleBatch, usize)> {
    let rows: Vec<SampleRowArg> = want
        .iter()
        .enumerate()
        .filter_map(|(i, w)| match w {
            LogitsWant::Sample(d) => Some(SampleRowArg::new(i, d)),
            _ => None,
        })
        .collect();
    rows.chunks(SAMPLE_ROWS_PER_LAUNCH)
        .map(|c| {
            let mut b = SampleBatch {
                rows: [SampleRowArg::default(); SAMPLE_ROWS_PER_LAUNCH],
            };
            b.rows[..c.len()].copy_from_slice(c);
            (b, c.len())
        })
        .collect()
}

/// Copies the landed logits into the host buffer the step returns. Past a few MiB (batch
/// 64 x 128k vocab is 33 MB) the copy is split over the rayon pool.
pub(super) fn copy_logits(src: &[f32], dst: &mut [f32]) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20; // f32 elements: 4 MiB
    if dst.len() <= CHUNK {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// Runs of consecutive `Full` rows as `(first element, element count)` over rows of `vocab`.
pub(super) fn full_runs(want: &[LogitsWant], vocab: usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, w) in want.iter().enumerate() {
        if *w != LogitsWant::Full {
            continue;
        }
        match runs.last_mut() {
            Some((off, len)) if *off + *len == i * vocab => *len += vocab,
            _ => runs.push((i * vocab, vocab)),
        }
    }
    runs
}

impl RowStore for Pinned {
    fn as_slice(&self) -> &[f32] {
        Pinned::as_slice(self)
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// Threads per block of `argmax_rows` (a multiple of 32, at most 1024).
const ARGMAX_THREADS: u32 = 1024;
/// Threads per block of `sample_rows` (its `__launch_bounds__`).
const SAMPLE_THREADS: u32 = 1024;

impl CudaBackend {
    /// Checks that `rows` logits rows fit `ws.logits` and their ids `ws.tokens`; the
    /// vocabulary as the kernels' `int`.
    fn token_rows_vocab(&self, op: &'static str, rows: usize) -> Result<i32, CudaError> {
        let vocab = self.spec.vocab_size;
        if rows * vocab * 4 > self.ws.logits.bytes() || rows * 4 > self.ws.tokens.bytes() {
            return Err(CudaError::Shape {
                op,
                reason: format!("{rows} rows of {vocab}"),
            });
        }
        i32::try_from(vocab).map_err(|_| CudaError::Shape {
            op,
            reason: format!("vocabulary {vocab} exceeds i32"),
        })
    }

    /// Enqueues `argmax_rows` over the first `rows` logits rows into `ws.tokens` (i32, -1 for a
    /// row without a finite value), on the step's stream right after the step (graph or eager).
    pub(crate) fn enqueue_argmax(&self, rows: usize) -> Result<(), CudaError> {
        const OP: &str = "argmax_rows";
        let v = self.token_rows_vocab(OP, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.gpu.kernel(OP)?;
        let mut b = self.gpu.launch_builder(f);
        b.arg(self.ws.logits.ptr_ref())
            .arg(&v)
            .arg(self.ws.tokens.ptr_ref());
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ARGMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `rows` rows of `vocab` f32 lie in `ws.logits` and `rows` i32 in `ws.tokens`
        // (checked above); the kernel reads and writes nothing else.
        unsafe { b.launch(cfg) }.map_err(crate::drv(OP))?;
        Ok(())
    }

    /// Enqueues `sample_rows` for the [`LogitsWant::Sample`] rows of `want` (over the first
    /// `want.len()` logits rows) into their entries of `ws.tokens`, after whatever the stream
    /// holds (the step, the arg-max).
    pub(crate) fn enqueue_sample(&self, want: &[LogitsWant]) -> Result<(), CudaError> {
        const OP: &str = "sample_rows";
        let v = self.token_rows_vocab(OP, want.len())?;
        let f = self.gpu.kernel(OP)?;
        for (batch, n) in sample_batches(want) {
            let mut b = self.gpu.launch_builder(f);
            b.arg(self.ws.logits.ptr_ref())
                .arg(&v)
                .arg(&batch)
                .arg(self.ws.tokens.ptr_ref());
            let cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (SAMPLE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the first `n` entries of `batch` name rows below `rows`, whose `vocab` f32
            // lie in `ws.logits`, and whose i32 lie in `ws.tokens` (checked above); the kernel
            // reads and writes nothing else.
            unsafe { b.launch(cfg) }.map_err(crate::drv(OP))?;
        }
        Ok(())
    }

    /// The device sampling (`sample_rows`) of `logits`, whole rows of the vocabulary, one
    /// [`RowDraw`] per row, at most `max_seqs` rows: uploads them in place of a step's logits
    /// and runs the kernel a step runs (tests: against [`pdnode_engine::sampling::sample_row`]). Waits
    /// for the device.
    pub fn device_sample(
        &mut self,
        logits: &[f32],
        draws: &[RowDraw],
    ) -> Result<Vec<Option<u32>>, BackendError> {
        let vocab = self.spec.vocab_size;
        if vocab == 0 || logits.len() != draws.len() * vocab {
            return Err(BackendError::InvalidBatch {
                reason: format!(
                    "{} logits for {} rows of {vocab}",
                    logits.len(),
                    draws.len()
                ),
            });
        }
        let rows = draws.len();
        self.gpu.bind()?;
        if logits.len() * 4 > self.ws.logits.bytes() {
            return Err(BackendError::InvalidBatch {
                reason: format!("{rows} rows exceed the logits workspace"),
            });
        }
        self.gpu.upload(&self.ws.logits, 0, logits)?;
        self.gpu.memset(&self.ws.tokens, 0x7f)?;
        let want: Vec<LogitsWant> = draws.iter().map(|d| LogitsWant::Sample(*d)).collect();
        let mut out = StepLogits::default();
        self.land_logits(rows, &want, &mut out)?;
        Ok(out
            .rows()
            .iter()
            .map(|r| match r {
                RowOut::Sampled(t) => *t,
                _ => None,
            })
            .collect())
    }

    /// The device arg-max (`argmax_rows`) of `logits`, whole rows of the vocabulary, at most
    /// `max_seqs` of them: uploads them in place of a step's logits and runs the kernel a step
    /// runs (tests: crafted rows with NaN, infinities and ties). Waits for the device.
    pub fn device_argmax(&mut self, logits: &[f32]) -> Result<Vec<Option<u32>>, BackendError> {
        let vocab = self.spec.vocab_size;
        if vocab == 0 || !logits.len().is_multiple_of(vocab) {
            return Err(BackendError::InvalidBatch {
                reason: format!("{} logits for rows of {vocab}", logits.len()),
            });
        }
        let rows = logits.len() / vocab;
        self.gpu.bind()?;
        if logits.len() * 4 > self.ws.logits.bytes() {
            return Err(BackendError::InvalidBatch {
                reason: format!("{rows} rows exceed the logits workspace"),
            });
        }
        self.gpu.upload(&self.ws.logits, 0, logits)?;
        self.gpu.memset(&self.ws.tokens, 0x7f)?;
        let want = vec![LogitsWant::Argmax; rows];
        let mut out = StepLogits::default();
        self.land_logits(rows, &want, &mut out)?;
        Ok(out
            .rows()
            .iter()
            .map(|r| match r {
                RowOut::Argmax(t) => *t,
                _ => None,
            })
            .collect())
    }

    /// After a step that left `rows` logits rows on the device: the arg-max of the `Argmax`
    /// rows and the token of the `Sample` rows (computed on the device) and the `Full` rows
    /// (copied) into `out`, whose buffer is reused. Waits for the device.
    pub(crate) fn land_logits(
        &mut self,
        rows: usize,
        want: &[LogitsWant],
        out: &mut StepLogits,
    ) -> Result<(), BackendError> {
        check_logits_wants(want, rows)?;
        let vocab = self.spec.vocab_size;
        let mut tokens = Vec::new();
        let argmax = want.contains(&LogitsWant::Argmax);
        let sample = want.iter().any(|w| matches!(w, LogitsWant::Sample(_)));
        if argmax {
            self.enqueue_argmax(rows)?;
        }
        if sample {
            // After the arg-max: both write `ws.tokens`, each its own rows last.
            self.enqueue_sample(want)?;
        }
        if argmax || sample {
            tokens = vec![-1i32; rows];
            // Waits for the step, the arg-max and the sampling.
            self.gpu.download(&mut tokens, &self.ws.tokens, 0)?;
        }
        let runs = full_runs(want, vocab);
        let (full, old) = out.begin_store(vocab, want);
        if full > 0 {
            // The previous step's buffer when it is ours (this context) and large enough; else a
            // fresh one sized for the most rows a step can have.
            let reuse = old.map(|s| s.into_any().downcast::<Pinned>());
            let mut pinned = match reuse {
                Some(Ok(p)) if p.is_of(&self.gpu) && p.len() >= full * vocab => *p,
                _ => self
                    .gpu
                    .alloc_pinned(self.opts.max_seqs.max(rows) * vocab)?,
            };
            self.gpu
                .download_pinned_runs(&mut pinned, &self.ws.logits, &runs)?;
            out.set_store(Box::new(pinned))?;
        } else {
            if let Some(old) = old {
                // Kept for a later step with full rows (it holds none now).
                out.set_store(old)?;
            }
            if tokens.is_empty() {
                // Nothing to land (no rows): still surface the step's asynchronous errors.
                self.gpu.sync()?;
            }
        }
        for (i, w) in want.iter().enumerate() {
            let op = match w {
                LogitsWant::Full => continue,
                LogitsWant::Argmax => "argmax_rows",
                LogitsWant::Sample(_) => "sample_rows",
            };
            let t = tokens[i];
            let token = match u32::try_from(t) {
                Ok(t) if (t as usize) < vocab => Some(t),
                Ok(_) => {
                    // a kernel bug, not a transient failure: not retried
                    return Err(BackendError::DeviceFailure {
                        kind: pdnode_core::ErrorKind::Internal,
                        message: format!("{op} returned id {t} for a vocabulary of {vocab}"),
                    });
                }
                Err(_) => None,
            };
            if matches!(w, LogitsWant::Argmax) {
                out.set_argmax(i, token);
            } else {
                out.set_sampled(i, token);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_copy_is_exact_small_and_split() {
        for n in [0usize, 5, (1 << 20) + 3, 5 * (1 << 20) + 17] {
            let src: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut dst = vec![0f32; n];
            copy_logits(&src, &mut dst);
            assert!(dst == src, "{n} elements");
        }
    }

    #[test]
    fn sample_arguments_are_laid_out_as_the_kernel_reads_them() {
        assert_eq!(std::mem::size_of::<SampleRowArg>(), 32);
        assert_eq!(std::mem::align_of::<SampleRowArg>(), 8);
        assert_eq!(
            std::mem::size_of::<SampleBatch>(),
            32 * SAMPLE_ROWS_PER_LAUNCH
        );
        let src = pdnode_kernels::source("sample.cu").expect("sample.cu is a kernel source");
        assert!(src.contains(&format!(
            "#define SAMPLE_ROWS_PER_LAUNCH {SAMPLE_ROWS_PER_LAUNCH}"
        )));
        let d = |u: f64| RowDraw {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            min_p: 0.1,
            u,
        };
        // 130 sampled rows among others: 64 + 64 + 2, each naming its row
        let want: Vec<LogitsWant> = (0..200)
            .map(|i| match i % 3 {
                0 => LogitsWant::Full,
                1 => LogitsWant::Argmax,
                _ => LogitsWant::Sample(d(i as f64 / 1000.0)),
            })
            .chain((0..64).map(|i| LogitsWant::Sample(d(0.5 + i as f64 / 1000.0))))
            .collect();
        let b = sample_batches(&want);
        let lens: Vec<usize> = b.iter().map(|x| x.1).collect();
        assert_eq!(lens, [64, 64, 2]);
        let rows: Vec<i32> = b
            .iter()
            .flat_map(|(x, n)| x.rows[..*n].iter().map(|r| r.row))
            .collect();
        let want_rows: Vec<i32> = want
            .iter()
            .enumerate()
            .filter(|(_, w)| matches!(w, LogitsWant::Sample(_)))
            .map(|(i, _)| i as i32)
            .collect();
        assert_eq!(rows, want_rows);
        let r = b[0].0.rows[0];
        assert_eq!(
            (r.row, r.u, r.top_k, r.top_p, r.min_p),
            (2, 0.002, 5, 0.9, 0.1)
        );
        assert!(sample_batches(&[LogitsWant::Full, LogitsWant::Argmax]).is_empty());
    }

    #[test]
    fn full_runs_merge_consecutive_rows() {
        use LogitsWant::{Argmax as A, Full as F};
        assert_eq!(full_runs(&[], 10), vec![]);
        assert_eq!(full_runs(&[A, A], 10), vec![]);
        assert_eq!(full_runs(&[F, F, F], 10), vec![(0, 30)]);
        assert_eq!(
            full_runs(&[F, A, F, F, A, F], 10),
            vec![(0, 10), (20, 20), (50, 10)]
        );
    }
}
