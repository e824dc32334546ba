//! Per-op device time of eager steps: a CUDA event recorded after each op of
//! [`CudaBackend::encode`](super::CudaBackend) while timing is on (benchmarks only). Timing
//! switches the decode graphs off, so no event is ever recorded into a capture.

use super::CudaBackend;
use crate::device::Gpu;
use crate::{CudaError, drv};
use cudarc::driver::{CudaEvent, sys};
use std::sync::Mutex;

/// The marks of the steps enqueued since the last [`CudaBackend::take_op_times`].
#[derive(Default)]
pub(super) struct OpProfile {
    marks: Mutex<Vec<(&'static str, CudaEvent)>>,
}

/// Label of the mark at the start of each step (the time before it is the host's gap; the
/// step writes this literal).
pub const STEP_START: &str = "(step start)";

impl OpProfile {
    /// Records an event after the work enqueued so far, labelled `name`.
    pub(super) fn mark(&self, gpu: &Gpu, name: &'static str) -> Result<(), CudaError> {
        let ev = gpu
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))?;
        let mut m = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        m.push((name, ev));
        Ok(())
    }
}

impl CudaBackend {
    /// Per-op timing on (`true`: CUDA graphs off, every eager step records an event after each
    /// op) or off (graphs stay as they are; turn them back on with `set_cuda_graphs`).
    pub fn set_op_timing(&mut self, on: bool) {
        if on {
            self.set_cuda_graphs(false);
            if self.prof.is_none() {
                self.prof = Some(OpProfile::default());
            }
        } else {
            self.prof = None;
        }
    }

    /// The ops enqueued since the last call, in order: `(label, device microseconds)`, each the
    /// time between the event after the previous op (or the step's start) and its own. The
    /// first mark of each step is [`STEP_START`] (its time is the gap since the previous step;
    /// the very first is dropped). Waits for the device. Empty when timing is off.
    pub fn take_op_times(&mut self) -> Result<Vec<(&'static str, f64)>, CudaError> {
        let Some(p) = &self.prof else {
            return Ok(Vec::new());
        };
        let marks = std::mem::take(&mut *p.marks.lock().unwrap_or_else(|e| e.into_inner()));
        let mut out = Vec::with_capacity(marks.len());
        for pair in marks.windows(2) {
            let ms = pair[0]
                .1
                .elapsed_ms(&pair[1].1)
                .map_err(drv("cuEventElapsedTime"))?;
            out.push((pair[1].0, ms as f64 * 1e3));
        }
        Ok(out)
    }
}
