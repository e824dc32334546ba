//! The NCCL communicator of a tensor-parallel group: [`NcclId`] (made once, handed to every
//! rank) and [`NcclComm`] (one per rank, the all-reduces the ranks join).

use crate::CudaError;
use crate::device::Gpu;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

fn nccl_err(op: &'static str) -> impl FnOnce(nccl::NcclError) -> CudaError {
    move |e| CudaError::Nccl {
        op,
        msg: format!("{e:?}"),
    }
}

/// The unique id that names one NCCL communicator (made once, handed to every rank).
#[derive(Clone, Copy)]
pub struct NcclId(nccl_sys::ncclUniqueId);

impl NcclId {
    /// Checks that libnccl can be loaded (cudarc panics on a call into a missing library), then
    /// makes a fresh id.
    pub fn new() -> Result<Self, CudaError> {
        // SAFETY: only tries to dlopen libnccl; no symbol is called.
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(CudaError::Unsupported {
                reason: "tensor parallelism needs NCCL (libnccl.so.2), not found on this host"
                    .into(),
            });
        }
        nccl::get_uniqueid()
            .map(NcclId)
            .map_err(nccl_err("ncclGetUniqueId"))
    }
}

/// One rank's handle on an NCCL communicator, bound to that rank's GPU and stream.
pub struct NcclComm {
    comm: nccl_sys::ncclComm_t,
    pub rank: usize,
    pub size: usize,
}

// SAFETY: the communicator is used by one thread at a time (the owner of the rank's backend),
// always with that rank's context bound; NCCL allows a communicator to move between threads.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `size` on `gpu` (blocks until every rank joined).
    pub fn init(gpu: &Gpu, id: &NcclId, rank: usize, size: usize) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut comm = std::mem::MaybeUninit::uninit();
        let (n, r) = (
            i32::try_from(size).map_err(|_| CudaError::Unsupported {
                reason: format!("tensor_parallel = {size}"),
            })?,
            rank as i32,
        );
        // SAFETY: `comm` is written by NCCL on success and read only then; the id came from
        // ncclGetUniqueId (NcclId::new checked the library is present).
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), n, id.0, r)
                .map_err(nccl_err("ncclCommInitRank"))?;
            comm.assume_init()
        };
        Ok(Self { comm, rank, size })
    }

    fn all_reduce(
        &self,
        gpu: &Gpu,
        buf: u64,
        count: usize,
        ty: nccl_sys::ncclDataType_t,
        op: nccl_sys::ncclRedOp_t,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `buf` is a live device allocation of this rank's context holding `count`
        // elements of `ty` (callers pass workspace buffers sized for them); the reduction is
        // ordered on this rank's stream like the kernels around it.
        unsafe {
            nccl::all_reduce(
                buf as *const std::ffi::c_void,
                buf as *mut std::ffi::c_void,
                count,
                ty,
                op,
                self.comm,
                gpu.stream.cu_stream() as _,
            )
        }
        .map_err(nccl_err("ncclAllReduce"))?;
        Ok(())
    }

    /// In-place f32 sum of `count` elements at `buf` over the ranks (asynchronous).
    pub fn all_reduce_sum_f32(&self, gpu: &Gpu, buf: u64, count: usize) -> Result<(), CudaError> {
        self.all_reduce(
            gpu,
            buf,
            count,
            nccl_sys::ncclDataType_t::ncclFloat32,
            nccl_sys::ncclRedOp_t::ncclSum,
        )
    }

    /// The smallest of every rank's `v` (synchronous).
    pub fn min_u64(&self, gpu: &Gpu, v: u64) -> Result<u64, CudaError> {
        let buf = gpu.alloc(8)?;
        gpu.upload(&buf, 0, &[v])?;
        self.all_reduce(
            gpu,
            buf.ptr(),
            1,
            nccl_sys::ncclDataType_t::ncclUint64,
            nccl_sys::ncclRedOp_t::ncclMin,
        )?;
        let mut out = [0u64];
        gpu.download(&mut out, &buf, 0)?;
        gpu.sync()?;
        Ok(out[0])
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was initialized and is released once, here; its owner
        // synchronized the stream before dropping (CudaBackend's Drop runs first).
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}
