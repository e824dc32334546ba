//! The logits landing on the host: full rows straight into a page-locked buffer the engine's
//! [`StepLogits`] owns between steps (one copy, no allocation after the first step), greedy rows
//! reduced to their arg-max on the device (`kernels/sample.cu`) so only one id per row crosses
//! PCIe.

use super::CudaBackend;
use crate::backend::cuda::CudaError;
use crate::backend::cuda::device::Pinned;
use crate::backend::{BackendError, LogitsWant, RowStore, StepLogits, check_logits_wants};
use cudarc::driver::LaunchConfig;

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

impl CudaBackend {
    /// Enqueues `argmax_rows` over the first `rows` logits rows into `ws.tokens` (i32, -1 for a
    /// row without a finite value), on the step's stream right after the step (graph or eager).
    pub(crate) fn enqueue_argmax(&self, rows: usize) -> Result<(), CudaError> {
        const OP: &str = "argmax_rows";
        let vocab = self.spec.vocab_size;
        if rows * vocab * 4 > self.ws.logits.bytes() || rows * 4 > self.ws.tokens.bytes() {
            return Err(CudaError::Shape {
                op: OP,
                reason: format!("{rows} rows of {vocab}"),
            });
        }
        if rows == 0 {
            return Ok(());
        }
        let v = i32::try_from(vocab).map_err(|_| CudaError::Shape {
            op: OP,
            reason: format!("vocabulary {vocab} exceeds i32"),
        })?;
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
        unsafe { b.launch(cfg) }.map_err(crate::backend::cuda::drv(OP))?;
        Ok(())
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
                crate::backend::RowOut::Argmax(t) => *t,
                crate::backend::RowOut::Full(_) => None,
            })
            .collect())
    }

    /// After a step that left `rows` logits rows on the device: the arg-max of the `Argmax`
    /// rows (computed on the device) and the `Full` rows (copied) into `out`, whose buffer is
    /// reused. Waits for the device.
    pub(crate) fn land_logits(
        &mut self,
        rows: usize,
        want: &[LogitsWant],
        out: &mut StepLogits,
    ) -> Result<(), BackendError> {
        check_logits_wants(want, rows)?;
        let vocab = self.spec.vocab_size;
        let mut tokens = Vec::new();
        if want.contains(&LogitsWant::Argmax) {
            self.enqueue_argmax(rows)?;
            tokens = vec![-1i32; rows];
            // Waits for the step and the arg-max.
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
            if *w != LogitsWant::Argmax {
                continue;
            }
            let t = tokens[i];
            let token = match u32::try_from(t) {
                Ok(t) if (t as usize) < vocab => Some(t),
                Ok(_) => {
                    return Err(BackendError::Device(format!(
                        "argmax_rows returned id {t} for a vocabulary of {vocab}"
                    )));
                }
                Err(_) => None,
            };
            out.set_argmax(i, token);
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
