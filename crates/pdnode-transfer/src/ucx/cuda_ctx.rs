//! The CUDA context of the UCX worker thread: with `UcxConfig::cuda_device` set, the thread
//! binds that device's primary context before it creates the UCP context, so UCX's CUDA
//! transports (cuda_copy, cuda_ipc) detect device memory in that context. Built with the
//! `cuda` feature (cudarc, loaded at run time); without it, or without libcuda, asking for a
//! device is a clear error.

use crate::TransferError;
use crate::region::MemKind;

/// Retains `ordinal`'s primary context (for the process's lifetime: the retain is not
/// released) and returns the device and the context; nothing is made current.
#[cfg(feature = "cuda")]
pub fn retain_primary_context(
    ordinal: u32,
) -> Result<
    (
        cudarc::driver::sys::CUdevice,
        cudarc::driver::sys::CUcontext,
    ),
    TransferError,
> {
    use cudarc::driver::sys;
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { sys::is_culib_present() } {
        return Err(TransferError::UnsupportedMemory {
            transport: "UCX (libcuda not found)",
            mem: MemKind::Cuda(ordinal).to_string(),
        });
    }
    let mut dev: sys::CUdevice = 0;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: libcuda is present; the out-pointers are valid locals.
    unsafe {
        check("cuInit", sys::cuInit(0))?;
        check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
        )?;
    }
    Ok((dev, ctx))
}

/// A driver call's result as this crate's error.
#[cfg(feature = "cuda")]
pub fn check(op: &'static str, r: cudarc::driver::sys::CUresult) -> Result<(), TransferError> {
    if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(TransferError::Device {
            op,
            reason: format!("{r:?}"),
        })
    }
}

/// Retains `ordinal`'s primary context and makes it current on the calling thread (for the
/// process's lifetime: the retain is not released).
#[cfg(feature = "cuda")]
pub fn bind_primary_context(ordinal: u32) -> Result<(), TransferError> {
    let (_, ctx) = retain_primary_context(ordinal)?;
    // SAFETY: `ctx` is a retained primary context.
    unsafe { check("cuCtxSetCurrent", cudarc::driver::sys::cuCtxSetCurrent(ctx)) }
}

/// Without the `cuda` feature there is no device context to bind.
#[cfg(not(feature = "cuda"))]
pub fn bind_primary_context(ordinal: u32) -> Result<(), TransferError> {
    Err(TransferError::UnsupportedMemory {
        transport: "UCX (built without the cuda feature)",
        mem: MemKind::Cuda(ordinal).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (or the feature) binding a device is a clear error naming it; with one,
    /// a device far beyond any host's count is refused by the driver, not a panic.
    #[test]
    fn binding_a_missing_device_is_an_error() {
        match bind_primary_context(9999) {
            Err(TransferError::UnsupportedMemory { mem, .. }) => assert_eq!(mem, "cuda:9999"),
            Err(TransferError::Device { .. }) => {}
            other => panic!("unexpected: {other:?}"),
        }
    }
}
