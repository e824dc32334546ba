//! Device memory for `bench-transfer --mem cuda:N`: plain `cuMemAlloc` memory (not the
//! stream-ordered pool, which CUDA IPC cannot export), filled and read back with synchronous
//! host copies outside the timed sections. Built with the `cuda` feature (cudarc, loaded at run
//! time); without it, or without libcuda, asking for device memory is a clear error.

use pdnode_transfer::TransferError;
use pdnode_transfer::region::{LocalRegion, MemKind};

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use cudarc::driver::sys;

    use pdnode_transfer::ucx::cuda_ctx::{check, retain_primary_context};

    /// `len` bytes of device memory on device `ordinal` (as this process sees the devices).
    pub(crate) struct DevBuf {
        ptr: sys::CUdeviceptr,
        len: usize,
        ordinal: u32,
        dev: sys::CUdevice,
        ctx: sys::CUcontext,
    }

    // SAFETY: the context handle and device pointer are process-wide driver handles; every use
    // makes the context current on the calling thread first.
    unsafe impl Send for DevBuf {}

    impl DevBuf {
        pub(crate) fn new(ordinal: u32, len: usize) -> Result<Self, TransferError> {
            // Device memory for the bench: the same context the UCX thread binds.
            let (dev, ctx) = retain_primary_context(ordinal)?;
            let mut ptr: sys::CUdeviceptr = 0;
            let mut buf = DevBuf {
                ptr: 0,
                len,
                ordinal,
                dev,
                ctx,
            };
            buf.current()?;
            // SAFETY: a context is current; `ptr` is a valid out-pointer.
            unsafe { check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, len))? };
            buf.ptr = ptr;
            Ok(buf)
        }

        fn current(&self) -> Result<(), TransferError> {
            // SAFETY: `ctx` is the retained primary context of `dev`.
            unsafe { check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx)) }
        }

        pub(crate) fn region(&self) -> LocalRegion {
            LocalRegion {
                addr: self.ptr as usize,
                len: self.len,
                mem: MemKind::Cuda(self.ordinal),
            }
        }

        fn range(&self, offset: usize, n: usize) -> Result<(), TransferError> {
            if offset.checked_add(n).is_none_or(|end| end > self.len) {
                return Err(TransferError::Geometry {
                    reason: format!("{offset}+{n} outside device buffer of {}", self.len),
                });
            }
            Ok(())
        }

        /// Host bytes to `offset` (synchronous).
        pub(crate) fn upload(&self, offset: usize, src: &[u8]) -> Result<(), TransferError> {
            self.range(offset, src.len())?;
            self.current()?;
            // SAFETY: the range is inside the allocation (checked); `src` is valid for its length.
            unsafe {
                check(
                    "cuMemcpyHtoD",
                    sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len()),
                )
            }
        }

        /// Bytes at `offset` to host memory (synchronous).
        pub(crate) fn download(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransferError> {
            self.range(offset, dst.len())?;
            self.current()?;
            // SAFETY: as in `upload`, with `dst` writable for its length.
            unsafe {
                check(
                    "cuMemcpyDtoH",
                    sys::cuMemcpyDtoH_v2(
                        dst.as_mut_ptr().cast(),
                        self.ptr + offset as u64,
                        dst.len(),
                    ),
                )
            }
        }
    }

    impl Drop for DevBuf {
        fn drop(&mut self) {
            // SAFETY: the allocation and the context retain are ours; errors at teardown are
            // ignored (nothing to do about them).
            unsafe {
                if self.current().is_ok() && self.ptr != 0 {
                    let _ = sys::cuMemFree_v2(self.ptr);
                }
                let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    /// Stand-in without the `cuda` feature: every constructor fails clearly.
    pub(crate) struct DevBuf {
        never: std::convert::Infallible,
    }

    impl DevBuf {
        pub(crate) fn new(ordinal: u32, _len: usize) -> Result<Self, TransferError> {
            Err(TransferError::UnsupportedMemory {
                transport: "bench-transfer (built without the cuda feature)",
                mem: MemKind::Cuda(ordinal).to_string(),
            })
        }
        pub(crate) fn region(&self) -> LocalRegion {
            match self.never {}
        }
        pub(crate) fn upload(&self, _: usize, _: &[u8]) -> Result<(), TransferError> {
            match self.never {}
        }
        pub(crate) fn download(&self, _: usize, _: &mut [u8]) -> Result<(), TransferError> {
            match self.never {}
        }
    }
}

pub(crate) use imp::DevBuf;

#[cfg(test)]
mod tests {
    use super::*;

    /// Where CUDA is absent (or the feature is off) device memory is a clear error; where a GPU
    /// is present, bytes go up and come back unchanged and out-of-range copies are refused.
    #[test]
    fn device_memory_round_trips_or_says_unsupported() {
        match DevBuf::new(0, 1 << 16) {
            Err(TransferError::UnsupportedMemory { mem, .. }) => assert_eq!(mem, "cuda:0"),
            Err(other) => panic!("unexpected error: {other}"),
            Ok(buf) => {
                let src: Vec<u8> = (0..1u32 << 16).map(|i| (i * 7 + 3) as u8).collect();
                buf.upload(0, &src).unwrap();
                let mut back = vec![0u8; src.len()];
                buf.download(0, &mut back).unwrap();
                assert_eq!(back, src);
                assert!(buf.upload(1, &src).is_err());
                assert_eq!(buf.region().mem, MemKind::Cuda(0));
            }
        }
    }
}
