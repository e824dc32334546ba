//! The one way the backend launches its own kernels: [`Launch`], a builder with cudarc's
//! `launch_builder(..).arg(..).launch(cfg)` shape that, when programmatic dependent launch (PDL)
//! is on for the GPU, launches through `cuLaunchKernelEx` with
//! `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, and through `cuLaunchKernel` (what
//! cudarc does) otherwise. cuBLAS and NCCL launch their own kernels and are not affected.
//!
//! # Programmatic dependent launch
//! With the attribute, a kernel may be scheduled while the previous kernel of the stream is still
//! running (as soon as every block of that one has run `griddepcontrol.launch_dependents`), so
//! its launch latency and the drain gap between the two overlap. Every kernel in
//! `kernels/*.cu` begins with `PD_GRID_WAIT()` (`griddepcontrol.wait`: blocks until the previous
//! grid has completed and its memory is visible) before any global memory access, then
//! `PD_GRID_LAUNCH_DEPENDENTS()`; both are no-ops for a grid launched without the attribute, so
//! the results are the same either way. Launches with the attribute are captured into CUDA
//! graphs as programmatic edges (driver 12.3 or later), so replayed decode steps keep the
//! overlap. `engine.cuda.pdl = true` ([`crate::CudaOptions::pdl`]) switches it on for the
//! backend's GPUs ([`crate::device::Gpu::set_pdl`]); Hopper (sm_90) or later and a 12.3+ driver are
//! required ([`pdl_supported`]), elsewhere launches stay plain.
//!
//! # What cudarc's launch does that this keeps
//! cudarc 0.19's `LaunchArgs::launch` binds the stream's context to the thread, makes the stream
//! wait on the read/write events of `CudaSlice`/`CudaView` arguments and records them afterwards
//! (only with several streams and event tracking), then calls `cuLaunchKernel`. Our kernels take
//! raw `cuMemAlloc` pointers as plain `u64` values ([`super::device::DevBuf`]), never cudarc
//! slices, so there are no events to wait on or record: [`Launch::arg`] takes plain values only
//! ([`DeviceRepr`]), and [`Launch::launch`] binds the context and launches.

use super::device::Gpu;
use cudarc::driver::{CudaFunction, DeviceRepr, DriverError, LaunchConfig, result, sys};
use std::ffi::c_void;

/// The lowest driver (`cuDriverGetVersion`) that captures launches with the programmatic
/// attribute into CUDA graphs: CUDA 12.3.
pub const PDL_MIN_DRIVER: i32 = 12030;

/// Whether a device of compute capability `cc` under driver version `driver` takes launches
/// with the programmatic attribute, in streams and in graph capture (sm_90+, driver 12.3+).
pub fn pdl_supported(cc: (i32, i32), driver: i32) -> bool {
    cc.0 >= 9 && driver >= PDL_MIN_DRIVER
}

/// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0); 0 without a driver or if the call fails.
pub fn driver_version() -> i32 {
    // SAFETY: only tries to dlopen libcuda (cudarc panics on a driver call without it).
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    let mut v: std::ffi::c_int = 0;
    // SAFETY: the driver library is present and the call writes one int through a valid
    // pointer (it needs no cuInit).
    match unsafe { sys::cuDriverGetVersion(&mut v) }.result() {
        Ok(()) => v,
        Err(_) => 0,
    }
}

/// A kernel launch being built: [`Gpu::launch_builder`], then [`Launch::arg`] once per kernel
/// parameter, in order, then [`Launch::launch`].
pub struct Launch<'a> {
    gpu: &'a Gpu,
    func: &'a CudaFunction,
    /// Pointers to the argument values (borrowed for `'a`), as `cuLaunchKernel` takes them.
    args: Vec<*mut c_void>,
}

impl<'a> Launch<'a> {
    pub fn new(gpu: &'a Gpu, func: &'a CudaFunction) -> Self {
        Self {
            gpu,
            func,
            args: Vec::with_capacity(16),
        }
    }

    /// Appends the next kernel parameter: a reference to its value (device pointers are `u64`),
    /// borrowed until the builder is gone, so it outlives the launch call.
    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(v as *const T as *mut c_void);
        self
    }

    /// Whether this launch carries the programmatic-stream-serialization attribute.
    pub fn programmatic(&self) -> bool {
        self.gpu.pdl()
    }

    /// Enqueues the kernel on the GPU's stream (or into the stream's capture).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// device pointer among them must be valid for what the kernel reads and writes under `cfg`
    /// until the work completes (the wrappers in `ops` check the shapes first).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let stream = &self.gpu.stream;
        stream.context().bind_to_thread()?;
        let f = self.func.cu_function();
        if !self.programmatic() {
            // SAFETY: the caller's contract; `args` points to live values (borrowed for 'a).
            return unsafe {
                result::launch_kernel(
                    f,
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    stream.cu_stream(),
                    &mut self.args,
                )
            };
        }
        let mut attrs = [programmatic_serialization()];
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as std::ffi::c_uint,
        };
        // SAFETY: the caller's contract for the kernel and its arguments; `lc` and `attrs` live
        // across the call (the driver copies them), `args` holds one pointer per parameter to a
        // live value, as cuLaunchKernel takes them, and `extra` is null.
        unsafe {
            sys::cuLaunchKernelEx(&lc, f, self.args.as_mut_ptr(), std::ptr::null_mut()).result()
        }
    }
}

/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1`.
fn programmatic_serialization() -> sys::CUlaunchAttribute {
    let mut value = sys::CUlaunchAttributeValue { pad: [0; 64] };
    value.programmaticStreamSerializationAllowed = 1;
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdl_needs_hopper_and_a_12_3_driver() {
        assert!(pdl_supported((9, 0), 13000));
        assert!(pdl_supported((9, 0), 12030));
        assert!(pdl_supported((10, 0), 12080));
        assert!(
            !pdl_supported((9, 0), 12020),
            "capture of PDL launches needs 12.3"
        );
        assert!(!pdl_supported((8, 9), 13000), "Ada has no griddepcontrol");
        assert!(!pdl_supported((8, 0), 13000));
        assert!(!pdl_supported((9, 0), 0), "unknown driver");
    }

    #[test]
    fn driver_version_never_panics() {
        // 0 on a host without libcuda (CI), the driver's version where there is one
        let v = driver_version();
        assert!(v == 0 || v >= 9000, "{v}");
    }

    #[test]
    fn attribute_is_programmatic_serialization_on() {
        let a = programmatic_serialization();
        assert_eq!(
            a.id,
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        );
        assert_eq!(a.id as u32, 6, "the driver's enum value");
        // SAFETY: the union was written through this field (and zeroed before).
        assert_eq!(unsafe { a.value.programmaticStreamSerializationAllowed }, 1);
        // the rest of the value stays zero (the driver reads the whole union)
        // SAFETY: `pad` covers the union's bytes, all initialized above.
        let pad = unsafe { a.value.pad };
        assert!(pad[4..].iter().all(|&b| b == 0));
    }
}
