//! One GPU: its context (bound to the calling thread before every use), one stream, one cuBLAS
//! handle and the compiled kernels; plus [`DevBuf`], a raw `cuMemAlloc` allocation.
//!
//! Every buffer is a plain `cuMemAlloc` region (never the stream-ordered pool), so the KV pool can
//! be exported over CUDA IPC, and kernels take raw device pointers (`u64`).

use super::{CudaError, drv, launch};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, result};
use pdnode_kernels::{
    KERNEL_NAMES, WGMMA_KERNEL_NAMES, ptx_for, ptx_for_wgmma, ptx_for_wgmma_traced, ptx_traced,
};
use std::collections::HashMap;
use std::sync::Arc;

/// A raw device allocation (`cuMemAlloc`), freed on drop.
pub struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl DevBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The pointer as a kernel argument (the launch builder keeps a reference).
    pub fn ptr_ref(&self) -> &u64 {
        &self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Device pointer `offset` bytes in (checked against the allocation).
    pub fn at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once, here; work
            // using it was ordered on the stream, which the owner synchronizes before dropping.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevBuf({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

/// Page-locked host memory (`cuMemHostAlloc`), for fast device-to-host copies; freed on drop.
pub struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the allocation is owned uniquely by this value; access goes through &/&mut self.
unsafe impl Send for Pinned {}

impl Pinned {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: `ptr` points to `len` f32 of page-locked memory owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// Whether this buffer was allocated in `gpu`'s context (device copies may target it).
    pub fn is_of(&self, gpu: &Gpu) -> bool {
        Arc::ptr_eq(&self.ctx, &gpu.ctx)
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `Gpu::alloc_pinned`, freed once.
            let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

/// Compiles (for sm_90a) and loads the wgmma program's entry points. The streaming GEMVs get
/// their shared-memory limit here, once (`ops::gemv_stream` launches them without a driver call
/// of its own: decode steps run them eagerly too).
type Loaded = (Arc<CudaModule>, Vec<(&'static str, CudaFunction)>);

fn load_wgmma(ctx: &Arc<CudaContext>) -> Result<Loaded, CudaError> {
    let ptx = if crate::trace::kernels_traced() {
        ptx_for_wgmma_traced()?
    } else {
        ptx_for_wgmma()?
    };
    let module = ctx
        .load_module(ptx)
        .map_err(drv("cuModuleLoadData (wgmma)"))?;
    let fs = WGMMA_KERNEL_NAMES
        .iter()
        .map(|&name| {
            let f = module
                .load_function(name)
                .map_err(drv("cuModuleGetFunction"))?;
            if name.starts_with("gemv_stream_") {
                crate::ops::prefer_shared_memory(&f, crate::ops::STREAM_SMEM_MAX)?;
            }
            Ok((name, f))
        })
        .collect::<Result<Vec<_>, CudaError>>()?;
    Ok((module, fs))
}

/// One GPU with its stream, cuBLAS handle and kernels.
pub struct Gpu {
    pub ordinal: u32,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: super::blas::Blas,
    kernels: HashMap<&'static str, CudaFunction>,
    /// The loaded programs (main, then the wgmma one where loaded): [`crate::trace`] reads
    /// their record buffers.
    modules: Vec<Arc<CudaModule>>,
    pub compute_capability: (i32, i32),
    pub sm_count: u32,
    /// Launches of our kernels carry the programmatic-dependent-launch attribute
    /// ([`super::launch`]); only ever true where `pdl_ok`.
    pdl: bool,
    /// The device and driver take programmatic dependent launches.
    pdl_ok: bool,
}

// SAFETY: the cuBLAS handle and CUDA objects are used only by the thread holding `&mut`/`&` of the
// backend, and every entry point binds the context to the calling thread first.
unsafe impl Send for Gpu {}

impl Gpu {
    /// Opens device `ordinal`: probes first (never panics without a driver), creates the context,
    /// a stream and a cuBLAS handle, and compiles/loads the kernels.
    pub fn new(ordinal: u32) -> Result<Self, CudaError> {
        let p = super::probe::probe()?;
        if ordinal >= p.device_count {
            return Err(CudaError::NoDevice {
                ordinal,
                count: p.device_count,
            });
        }
        let ctx = CudaContext::new(ordinal as usize).map_err(drv("cuCtxCreate"))?;
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let cc = ctx
            .compute_capability()
            .map_err(drv("cuDeviceGetAttribute"))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let sm_count = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))? as u32;
        let arch = format!("compute_{}{}", cc.0, cc.1);
        let ptx = if crate::trace::kernels_traced() {
            ptx_traced(&arch)?
        } else {
            ptx_for(&arch)?
        };
        let module = ctx.load_module(ptx).map_err(drv("cuModuleLoadData"))?;
        let mut kernels = HashMap::new();
        for name in KERNEL_NAMES {
            let f = module
                .load_function(name)
                .map_err(drv("cuModuleGetFunction"))?;
            kernels.insert(name, f);
        }
        let mut modules = vec![module];
        if cc == (9, 0) {
            // the Hopper-only program (wgmma): without it the prefill attention that would use
            // it runs flashv3, so a failure here is logged, not fatal
            match load_wgmma(&ctx) {
                Ok((m, fs)) => {
                    kernels.extend(fs);
                    modules.push(m);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "wgmma kernels unavailable (prefill attention runs flashv3)")
                }
            }
        }
        let blas = super::blas::Blas::new(&stream)?;
        let pdl_ok = launch::pdl_supported(cc, launch::driver_version());
        // Off until asked for ([`Gpu::set_pdl`]; the backend applies `engine.cuda.pdl`).
        let pdl = false;
        Ok(Self {
            ordinal,
            ctx,
            stream,
            blas,
            kernels,
            modules,
            compute_capability: cc,
            sm_count,
            pdl,
            pdl_ok,
        })
    }

    /// The loaded kernel programs (main first).
    pub(crate) fn modules(&self) -> &[Arc<CudaModule>] {
        &self.modules
    }

    /// Whether our kernel launches on this GPU are programmatic dependent launches.
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Switches programmatic dependent launch for later launches on this GPU (`engine.cuda.pdl` sets
    /// it when the GPU is opened); returns what it is now: false where the device or driver
    /// cannot ([`launch::pdl_supported`]). Graphs captured before keep how they were captured.
    pub fn set_pdl(&mut self, on: bool) -> bool {
        self.pdl = on && self.pdl_ok;
        self.pdl
    }

    /// A launch of `f` (one of [`Gpu::kernel`]'s) on this GPU's stream: see [`launch::Launch`].
    pub fn launch_builder<'a>(&'a self, f: &'a CudaFunction) -> launch::Launch<'a> {
        launch::Launch::new(self, f)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
    }

    /// Whether kernel `name` was loaded (the wgmma ones only on compute capability 9.0).
    pub fn has_kernel(&self, name: &str) -> bool {
        self.kernels.contains_key(name)
    }

    /// A compiled kernel by entry-point name ([`pdnode_kernels::KERNEL_NAMES`], and on a compute
    /// capability 9.0 device [`pdnode_kernels::WGMMA_KERNEL_NAMES`]).
    pub fn kernel(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        self.kernels.get(name).ok_or(CudaError::NoKernel { name })
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.bind()?;
        self.ctx.mem_get_info().map_err(drv("cuMemGetInfo"))
    }

    /// Allocates `bytes` with `cuMemAlloc` (uninitialized).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, CudaError> {
        self.bind()?;
        let bytes_req = bytes.max(16);
        // SAFETY: the context is current; the size is non-zero.
        let ptr = unsafe { result::malloc_sync(bytes_req) }.map_err(|e| {
            let free = self.ctx.mem_get_info().map(|m| m.0).unwrap_or(0);
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                CudaError::OutOfMemory {
                    what: "allocation",
                    need: bytes_req,
                    have: free,
                }
            } else {
                drv("cuMemAlloc")(e)
            }
        })?;
        Ok(DevBuf {
            ctx: self.ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// Page-locked host buffer of `len` f32 (at least one).
    pub fn alloc_pinned(&self, len: usize) -> Result<Pinned, CudaError> {
        self.bind()?;
        let len = len.max(1);
        // SAFETY: the context is current; flags 0 = plain page-locked memory.
        let p = unsafe { result::malloc_host(len * 4, 0) }.map_err(drv("cuMemHostAlloc"))?;
        Ok(Pinned {
            ctx: self.ctx.clone(),
            ptr: p as *mut f32,
            len,
        })
    }

    /// Copies `n` f32 from `src` into `dst` (page-locked) and waits; returns them.
    pub fn download_pinned<'a>(
        &self,
        dst: &'a mut Pinned,
        src: &DevBuf,
        n: usize,
    ) -> Result<&'a [f32], CudaError> {
        if n > dst.len() || n * 4 > src.bytes {
            return Err(CudaError::Shape {
                op: "download_pinned",
                reason: format!("{n} f32 into {} / from {} bytes", dst.len(), src.bytes),
            });
        }
        self.download(&mut dst.as_mut_slice()[..n], src, 0)?;
        Ok(&dst.as_slice()[..n])
    }

    /// Copies runs of f32 from `src`, each `(element offset, length)`, into `dst` (page-locked)
    /// back to back, with one wait for all of them; returns the landed prefix.
    pub fn download_pinned_runs<'a>(
        &self,
        dst: &'a mut Pinned,
        src: &DevBuf,
        runs: &[(usize, usize)],
    ) -> Result<&'a [f32], CudaError> {
        let mut at = 0usize;
        for &(off, len) in runs {
            let end = off.checked_add(len).and_then(|e| e.checked_mul(4));
            if at + len > dst.len() || end.is_none_or(|e| e > src.bytes) {
                return Err(CudaError::Shape {
                    op: "download_pinned_runs",
                    reason: format!(
                        "{len} f32 at {off} into {at} of {} / from {} bytes",
                        dst.len(),
                        src.bytes
                    ),
                });
            }
            at += len;
        }
        let mut at = 0usize;
        for &(off, len) in runs {
            if len == 0 {
                continue;
            }
            let d = &mut dst.as_mut_slice()[at..at + len];
            // SAFETY: bounds checked above; `dst` is page-locked and stays borrowed (so alive and
            // untouched by the host) until a wait: the one below, or this one on a failed enqueue.
            let r = unsafe {
                result::memcpy_dtoh_async(d, src.ptr + off as u64 * 4, self.stream.cu_stream())
            };
            if let Err(e) = r {
                let _ = self.sync();
                return Err(drv("cuMemcpyDtoHAsync")(e));
            }
            at += len;
        }
        self.sync()?;
        Ok(&dst.as_slice()[..at])
    }

    /// Fills `buf` with the byte `v` (0xFF poisons bf16 and f32 buffers with NaN).
    pub fn memset(&self, buf: &DevBuf, v: u8) -> Result<(), CudaError> {
        // SAFETY: `buf` is a live allocation of `buf.bytes` bytes in this context.
        unsafe { result::memset_d8_async(buf.ptr, v, buf.bytes, self.stream.cu_stream()) }
            .map_err(drv("cuMemsetD8Async"))
    }

    /// Copies `src` to `dst + offset` (ordered on the stream; `src` may be dropped on return).
    pub fn upload<T: Copy>(&self, dst: &DevBuf, offset: usize, src: &[T]) -> Result<(), CudaError> {
        let n = std::mem::size_of_val(src);
        if offset + n > dst.bytes {
            return Err(CudaError::Shape {
                op: "upload",
                reason: format!("{n} bytes at {offset} into a buffer of {}", dst.bytes),
            });
        }
        if n == 0 {
            return Ok(());
        }
        // SAFETY: bounds checked above; pageable host -> device copies return once the source
        // has been staged, so `src` may be dropped afterwards.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, src, self.stream.cu_stream()) }
            .map_err(drv("cuMemcpyHtoDAsync"))
    }

    /// Copies `dst.len()` elements from `src + offset` and waits for them.
    pub fn download<T: Copy>(
        &self,
        dst: &mut [T],
        src: &DevBuf,
        offset: usize,
    ) -> Result<(), CudaError> {
        let n = std::mem::size_of_val(dst);
        if offset + n > src.bytes {
            return Err(CudaError::Shape {
                op: "download",
                reason: format!("{n} bytes at {offset} from a buffer of {}", src.bytes),
            });
        }
        if n > 0 {
            // SAFETY: bounds checked above; `dst` outlives the copy because we synchronize below.
            unsafe {
                result::memcpy_dtoh_async(dst, src.ptr + offset as u64, self.stream.cu_stream())
            }
            .map_err(drv("cuMemcpyDtoHAsync"))?;
        }
        self.sync()
    }

    /// Waits for all work on the stream; surfaces asynchronous kernel errors.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// Host f32 -> device bf16 (round to nearest even).
    pub fn upload_bf16(&self, data: &[f32]) -> Result<DevBuf, CudaError> {
        let h: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let b = self.alloc(h.len() * 2)?;
        self.upload(&b, 0, &h)?;
        Ok(b)
    }

    /// Host f32 -> device f32.
    pub fn upload_f32(&self, data: &[f32]) -> Result<DevBuf, CudaError> {
        let b = self.alloc(data.len() * 4)?;
        self.upload(&b, 0, data)?;
        Ok(b)
    }

    /// Device bf16 -> host f32.
    pub fn download_bf16(&self, src: &DevBuf, n: usize) -> Result<Vec<f32>, CudaError> {
        let mut h = vec![half::bf16::ZERO; n];
        self.download(&mut h, src, 0)?;
        Ok(h.into_iter().map(f32::from).collect())
    }

    /// Device f32 -> host f32.
    pub fn download_f32(&self, src: &DevBuf, n: usize) -> Result<Vec<f32>, CudaError> {
        let mut h = vec![0f32; n];
        self.download(&mut h, src, 0)?;
        Ok(h)
    }
}
