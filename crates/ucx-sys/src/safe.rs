//! Safe owners of UCP objects. Children hold an `Rc` of their parent, so a parent is destroyed
//! only after every child: rkey -> endpoint -> worker -> context, memory handle -> context.
//! Everything here is `!Send`: one thread (the transport's worker thread) creates and drives it,
//! which is what `UCS_THREAD_MODE_SINGLE` asks for.

use crate::UcxError;
use crate::ffi::*;
use crate::loader::Ucp;
use std::cell::Cell;
use std::ffi::{CString, c_void};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a registered region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryType {
    Host,
    Cuda,
}

impl MemoryType {
    fn raw(self) -> i32 {
        match self {
            MemoryType::Host => UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => UCS_MEMORY_TYPE_CUDA,
        }
    }
}

/// A UCP context (`ucp_init_version` with RMA, active-message and wake-up features).
pub struct Context {
    ucp: Arc<Ucp>,
    h: ucp_context_h,
}

impl Context {
    /// Reads the UCX configuration from the environment (`UCX_*`), applies `overrides`
    /// (`("NET_DEVICES", "lo")`, `("TLS", "tcp")`: names without the `UCX_` prefix) and creates a
    /// context.
    pub fn new(
        ucp: Arc<Ucp>,
        name: &str,
        overrides: &[(&str, &str)],
    ) -> Result<Rc<Context>, UcxError> {
        let mut config: *mut ucp_config_t = std::ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_ from the environment, no file"; out-pointer valid.
        let st = unsafe { (ucp.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        ucp.check("ucp_config_read", st)?;
        for (key, value) in overrides {
            let (Ok(k), Ok(v)) = (CString::new(*key), CString::new(*value)) else {
                // SAFETY: config came from ucp_config_read and is released once.
                unsafe { (ucp.ucp_config_release)(config) };
                return Err(UcxError::InvalidArgument {
                    what: format!("UCX setting {key:?} = {value:?} contains NUL"),
                });
            };
            // SAFETY: valid config and NUL-terminated strings that outlive the call.
            let st = unsafe { (ucp.ucp_config_modify)(config, k.as_ptr(), v.as_ptr()) };
            if st != UCS_OK {
                // SAFETY: as above.
                unsafe { (ucp.ucp_config_release)(config) };
                return Err(UcxError::InvalidArgument {
                    what: format!("UCX setting {key} = {value:?}: {}", ucp.status_string(st)),
                });
            }
        }
        let cname = CString::new(name.replace('\0', "")).unwrap_or_default();
        let params = ucp_params_t {
            field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
            features: UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: cname.as_ptr(),
        };
        let mut h: ucp_context_h = std::ptr::null_mut();
        // SAFETY: params is a valid 1.13-layout struct whose mask names only initialised fields;
        // config came from ucp_config_read; the API version is the one the structs follow.
        let st = unsafe { (ucp.ucp_init_version)(1, 13, &params, config, &mut h) };
        // SAFETY: config came from ucp_config_read and is released once.
        unsafe { (ucp.ucp_config_release)(config) };
        ucp.check("ucp_init_version", st)?;
        Ok(Rc::new(Context { ucp, h }))
    }

    pub fn ucp(&self) -> &Arc<Ucp> {
        &self.ucp
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child (worker, memory handle) holds an Rc of self, so none is left.
        unsafe { (self.ucp.ucp_cleanup)(self.h) };
    }
}

/// A UCP worker in single-thread mode with wake-up on RMA and network events.
pub struct Worker {
    ctx: Rc<Context>,
    h: ucp_worker_h,
}

impl Worker {
    pub fn new(ctx: &Rc<Context>) -> Result<Rc<Worker>, UcxError> {
        let ucp = &ctx.ucp;
        let params = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS,
            thread_mode: UCS_THREAD_MODE_SINGLE,
            cpu_mask: ucs_cpu_set_t { ucs_bits: [0; 16] },
            events: UCP_WAKEUP_RMA | UCP_WAKEUP_TX | UCP_WAKEUP_RX,
            user_data: std::ptr::null_mut(),
            event_fd: -1,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut h: ucp_worker_h = std::ptr::null_mut();
        // SAFETY: valid context; params follow the 1.13 layout with only masked fields read.
        let st = unsafe { (ucp.ucp_worker_create)(ctx.h, &params, &mut h) };
        ucp.check("ucp_worker_create", st)?;
        Ok(Rc::new(Worker {
            ctx: ctx.clone(),
            h,
        }))
    }

    fn ucp(&self) -> &Ucp {
        &self.ctx.ucp
    }

    pub fn context(&self) -> &Rc<Context> {
        &self.ctx
    }

    /// The worker's address, to be sent to peers out of band.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: valid worker and out-pointers.
        let st = unsafe { (self.ucp().ucp_worker_get_address)(self.h, &mut addr, &mut len) };
        self.ucp().check("ucp_worker_get_address", st)?;
        // SAFETY: UCX returned `len` readable bytes at `addr`; copied before release.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address on this worker; released once.
        unsafe { (self.ucp().ucp_worker_release_address)(self.h, addr) };
        Ok(bytes)
    }

    /// One round of progress; returns the number of events processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: valid worker, driven only from this (the owning) thread.
        unsafe { (self.ucp().ucp_worker_progress)(self.h) }
    }

    /// The event fd that becomes readable when the armed worker has work.
    pub fn event_fd(&self) -> Result<i32, UcxError> {
        let mut fd = -1;
        // SAFETY: valid worker created with UCP_FEATURE_WAKEUP; out-pointer valid.
        let st = unsafe { (self.ucp().ucp_worker_get_efd)(self.h, &mut fd) };
        self.ucp().check("ucp_worker_get_efd", st)?;
        Ok(fd)
    }

    /// Arms the event fd. `Ok(false)`: events are pending (`UCS_ERR_BUSY`), progress again.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: valid worker.
        let st = unsafe { (self.ucp().ucp_worker_arm)(self.h) };
        if st == UCS_ERR_BUSY {
            return Ok(false);
        }
        self.ucp().check("ucp_worker_arm", st)?;
        Ok(true)
    }

    /// Flushes every endpoint of the worker.
    pub fn flush(self: &Rc<Self>) -> Result<Option<Request>, UcxError> {
        let param = ucp_request_param_t::empty();
        // SAFETY: valid worker; param with an empty mask.
        let p = unsafe { (self.ucp().ucp_worker_flush_nbx)(self.h, &param) };
        Request::from_status_ptr(self, "ucp_worker_flush_nbx", p)
    }
}

impl Worker {
    /// Sets the handler of active messages `id` (whole messages only; see
    /// `ucp_worker_set_am_recv_handler`).
    ///
    /// # Safety
    /// `cb` runs inside [`Worker::progress`] on this thread with `arg`; `arg` must stay valid for
    /// as long as the worker lives (or until the handler is replaced).
    pub unsafe fn set_am_handler(
        &self,
        id: u32,
        cb: ucp_am_recv_callback_t,
        arg: *mut c_void,
    ) -> Result<(), UcxError> {
        let params = ucp_am_handler_param_t {
            field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID
                | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | UCP_AM_HANDLER_PARAM_FIELD_CB
                | UCP_AM_HANDLER_PARAM_FIELD_ARG,
            id,
            flags: UCP_AM_FLAG_WHOLE_MSG,
            cb,
            arg,
        };
        // SAFETY: valid worker and a fully initialised parameter struct; the caller vouches
        // for `cb` and `arg`.
        let st = unsafe { (self.ucp().ucp_worker_set_am_recv_handler)(self.h, &params) };
        self.ucp().check("ucp_worker_set_am_recv_handler", st)
    }
}

/// Sends active message `id` on the raw endpoint `ep` of `worker` (`ucp_am_send_nbx`, host
/// memory, `flags` from `UCP_AM_SEND_FLAG_*`).
///
/// # Safety
/// `ep` must be a live endpoint of `worker` (one the caller owns, or a reply endpoint UCX handed
/// to an active-message handler that is running now); `header..header+header_len` and
/// `data..data+len` must stay valid and unmodified until the returned request completes (or
/// until the call returns, for `None`).
pub unsafe fn am_send_raw(
    worker: &Rc<Worker>,
    ep: ucp_ep_h,
    id: u32,
    header: &[u8],
    data: *const u8,
    len: usize,
    flags: u32,
) -> Result<Option<Request>, UcxError> {
    let mut param = ucp_request_param_t::empty();
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.flags = flags;
    param.memory_type = UCS_MEMORY_TYPE_HOST;
    // SAFETY: the caller guarantees the endpoint and the buffers.
    let p = unsafe {
        (worker.ucp().ucp_am_send_nbx)(
            ep,
            id,
            header.as_ptr() as *const c_void,
            header.len(),
            data as *const c_void,
            len,
            &param,
        )
    };
    Request::from_status_ptr(worker, "ucp_am_send_nbx", p)
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: endpoints and requests hold an Rc of self, so none is left.
        unsafe { (self.ctx.ucp.ucp_worker_destroy)(self.h) };
    }
}

/// An outstanding non-blocking operation.
pub struct Request {
    worker: Rc<Worker>,
    p: *mut c_void,
    call: &'static str,
}

/// The state of an operation.
#[derive(Debug)]
pub enum RequestState {
    InProgress,
    Done(Result<(), UcxError>),
}

impl Request {
    /// Interprets a `ucs_status_ptr_t`: `None` when the operation completed immediately.
    fn from_status_ptr(
        worker: &Rc<Worker>,
        call: &'static str,
        p: ucs_status_ptr_t,
    ) -> Result<Option<Request>, UcxError> {
        if p.is_null() {
            return Ok(None);
        }
        if ptr_is_err(p) {
            let st = ptr_status(p);
            return Err(UcxError::Call {
                call,
                status: st,
                message: worker.ucp().status_string(st),
            });
        }
        Ok(Some(Request {
            worker: worker.clone(),
            p,
            call,
        }))
    }

    pub fn state(&self) -> RequestState {
        let ucp = self.worker.ucp();
        // SAFETY: p is a live request handle (freed only in Drop).
        let st = unsafe { (ucp.ucp_request_check_status)(self.p) };
        if st == UCS_INPROGRESS {
            RequestState::InProgress
        } else {
            RequestState::Done(ucp.check(self.call, st))
        }
    }

    /// Progresses the worker until the request completes or `deadline` passes.
    pub fn wait(self, deadline: Instant) -> Result<(), UcxError> {
        loop {
            if let RequestState::Done(r) = self.state() {
                return r;
            }
            if Instant::now() >= deadline {
                return Err(UcxError::Timeout { call: self.call });
            }
            self.worker.progress();
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let ucp = self.worker.ucp();
        // SAFETY: p is a live request; an in-progress request is cancelled first (its
        // completion then reports UCS_ERR_CANCELED) and UCX releases it when it completes.
        unsafe {
            if (ucp.ucp_request_check_status)(self.p) == UCS_INPROGRESS {
                (ucp.ucp_request_cancel)(self.worker.h, self.p);
            }
            (ucp.ucp_request_free)(self.p);
        }
    }
}

/// Error-handler state of one endpoint, at a stable heap address handed to UCX.
struct EpErrState {
    status: Cell<ucs_status_t>,
}

unsafe extern "C" fn ep_error_cb(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    if arg.is_null() {
        return;
    }
    // SAFETY: arg is the EpErrState boxed in the Endpoint, which outlives the UCX endpoint
    // (closed in Endpoint::drop before the box is freed); called on the owning thread.
    let st = unsafe { &*(arg as *const EpErrState) };
    st.status.set(status);
}

/// How long closing an endpoint may take before it is abandoned (forced).
const EP_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection to a peer worker.
pub struct Endpoint {
    worker: Rc<Worker>,
    h: ucp_ep_h,
    err: Box<EpErrState>,
}

impl Endpoint {
    /// Connects to a peer's worker address. With `peer_failure`, a dead peer fails the
    /// endpoint's operations (UCP_ERR_HANDLING_MODE_PEER) instead of hanging them.
    pub fn connect(
        worker: &Rc<Worker>,
        address: &[u8],
        peer_failure: bool,
    ) -> Result<Rc<Endpoint>, UcxError> {
        if address.is_empty() {
            return Err(UcxError::InvalidArgument {
                what: "empty worker address".into(),
            });
        }
        let err = Box::new(EpErrState {
            status: Cell::new(UCS_OK),
        });
        let mut mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        if peer_failure {
            mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        }
        let params = ucp_ep_params_t {
            field_mask: mask,
            address: address.as_ptr() as *const ucp_address_t,
            err_mode: if peer_failure {
                UCP_ERR_HANDLING_MODE_PEER
            } else {
                UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: ucp_err_handler_t {
                cb: Some(ep_error_cb),
                arg: &*err as *const EpErrState as *mut c_void,
            },
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
        };
        let mut h: ucp_ep_h = std::ptr::null_mut();
        // SAFETY: valid worker; `address` is readable for the call (UCX copies what it needs and
        // validates the packed address); the error-state box outlives the endpoint.
        let st = unsafe { (worker.ucp().ucp_ep_create)(worker.h, &params, &mut h) };
        worker.ucp().check("ucp_ep_create", st)?;
        Ok(Rc::new(Endpoint {
            worker: worker.clone(),
            h,
            err,
        }))
    }

    /// The status UCX reported through the error handler, if the endpoint failed.
    pub fn failure(&self) -> Option<UcxError> {
        let st = self.err.status.get();
        (st != UCS_OK).then(|| UcxError::Call {
            call: "UCX endpoint",
            status: st,
            message: self.worker.ucp().status_string(st),
        })
    }

    pub fn worker(&self) -> &Rc<Worker> {
        &self.worker
    }

    /// Writes `len` bytes at `local` to `remote_addr` under `rkey`.
    ///
    /// # Safety
    /// `local..local+len` must stay valid and unmodified until the returned request completes
    /// (or immediately, for `None`), and be of memory type `mem`.
    pub unsafe fn put(
        &self,
        local: *const u8,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
        mem: MemoryType,
    ) -> Result<Option<Request>, UcxError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.memory_type = mem.raw();
        // SAFETY: the caller guarantees the local buffer; rkey was unpacked on this endpoint.
        let p = unsafe {
            (self.worker.ucp().ucp_put_nbx)(
                self.h,
                local as *const c_void,
                len,
                remote_addr,
                rkey.h,
                &param,
            )
        };
        Request::from_status_ptr(&self.worker, "ucp_put_nbx", p)
    }

    /// Sends active message `id` (`header`, then `len` bytes at `data`, host memory).
    ///
    /// # Safety
    /// `header` and `data..data+len` must stay valid and unmodified until the returned request
    /// completes (or until the call returns, for `None`).
    pub unsafe fn am_send(
        &self,
        id: u32,
        header: &[u8],
        data: *const u8,
        len: usize,
        flags: u32,
    ) -> Result<Option<Request>, UcxError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        // SAFETY: our own live endpoint; the caller guarantees the buffers.
        unsafe { am_send_raw(&self.worker, self.h, id, header, data, len, flags) }
    }

    /// Completes every operation issued on this endpoint (remote visibility).
    pub fn flush(&self) -> Result<Option<Request>, UcxError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let param = ucp_request_param_t::empty();
        // SAFETY: valid endpoint.
        let p = unsafe { (self.worker.ucp().ucp_ep_flush_nbx)(self.h, &param) };
        Request::from_status_ptr(&self.worker, "ucp_ep_flush_nbx", p)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let ucp = self.worker.ucp();
        let mut param = ucp_request_param_t::empty();
        if self.failure().is_some() {
            // A failed endpoint (peer mode) must be closed in force mode.
            param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: valid endpoint, closed once; rkeys unpacked on it hold an Rc of it, so none is
        // left.
        let p = unsafe { (ucp.ucp_ep_close_nbx)(self.h, &param) };
        if let Ok(Some(req)) = Request::from_status_ptr(&self.worker, "ucp_ep_close_nbx", p) {
            // Best effort: a peer that does not answer leaves the close to the worker's
            // destruction.
            let _ = req.wait(Instant::now() + EP_CLOSE_TIMEOUT);
        }
    }
}

/// A registered memory region of the local context.
pub struct MemHandle {
    ctx: Rc<Context>,
    h: ucp_mem_h,
    addr: u64,
    len: usize,
}

impl MemHandle {
    /// Registers `addr..addr+len`.
    ///
    /// # Safety
    /// The range must be memory of type `mem` that stays allocated until the handle is dropped.
    pub unsafe fn map(
        ctx: &Rc<Context>,
        addr: *mut u8,
        len: usize,
        mem: MemoryType,
    ) -> Result<MemHandle, UcxError> {
        if len == 0 {
            return Err(UcxError::InvalidArgument {
                what: "cannot register an empty region".into(),
            });
        }
        let params = ucp_mem_map_params_t {
            field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: addr as *mut c_void,
            length: len,
            flags: 0,
            prot: 0,
            memory_type: mem.raw(),
        };
        let mut h: ucp_mem_h = std::ptr::null_mut();
        // SAFETY: valid context; the caller guarantees the range.
        let st = unsafe { (ctx.ucp.ucp_mem_map)(ctx.h, &params, &mut h) };
        ctx.ucp.check("ucp_mem_map", st)?;
        Ok(MemHandle {
            ctx: ctx.clone(),
            h,
            addr: addr as u64,
            len,
        })
    }

    /// Lets UCX allocate and register `len` bytes of host memory (`UCP_MEM_MAP_ALLOCATE`): on
    /// one host, peers may then map the region and write it without the owner's progress. The
    /// memory is freed when the handle is dropped.
    pub fn allocate(ctx: &Rc<Context>, len: usize) -> Result<MemHandle, UcxError> {
        if len == 0 {
            return Err(UcxError::InvalidArgument {
                what: "cannot allocate an empty region".into(),
            });
        }
        let params = ucp_mem_map_params_t {
            field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            address: std::ptr::null_mut(),
            length: len,
            flags: UCP_MEM_MAP_ALLOCATE,
            prot: 0,
            memory_type: UCS_MEMORY_TYPE_HOST,
        };
        let mut h: ucp_mem_h = std::ptr::null_mut();
        // SAFETY: valid context; no address (UCX chooses); only masked fields are read.
        let st = unsafe { (ctx.ucp.ucp_mem_map)(ctx.h, &params, &mut h) };
        ctx.ucp.check("ucp_mem_map(ALLOCATE)", st)?;
        let mut attr = ucp_mem_attr_t {
            field_mask: UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH,
            address: std::ptr::null_mut(),
            length: 0,
            mem_type: 0,
        };
        // SAFETY: h is the handle just mapped; attr is a valid out-struct.
        let st = unsafe { (ctx.ucp.ucp_mem_query)(h, &mut attr) };
        let handle = MemHandle {
            ctx: ctx.clone(),
            h,
            addr: attr.address as u64,
            len: attr.length,
        };
        ctx.ucp.check("ucp_mem_query", st)?;
        if handle.addr == 0 || handle.len < len {
            return Err(UcxError::InvalidArgument {
                what: format!("UCX allocated {} bytes at {:#x}", handle.len, handle.addr),
            });
        }
        Ok(handle)
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed remote key a peer needs to write this region.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let ucp = &self.ctx.ucp;
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid context and memory handle; out-pointers valid.
        let st = unsafe { (ucp.ucp_rkey_pack)(self.ctx.h, self.h, &mut buf, &mut size) };
        ucp.check("ucp_rkey_pack", st)?;
        // SAFETY: UCX returned `size` readable bytes; copied before release.
        let v = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack; released once.
        unsafe { (ucp.ucp_rkey_buffer_release)(buf) };
        Ok(v)
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: handle mapped on this context, unmapped once.
        let _ = unsafe { (self.ctx.ucp.ucp_mem_unmap)(self.ctx.h, self.h) };
    }
}

/// Zero bytes appended to a packed rkey before UCX parses it.
const RKEY_PAD: usize = 256;

/// A peer's region key, unpacked on an endpoint.
pub struct RemoteKey {
    ep: Rc<Endpoint>,
    h: ucp_rkey_h,
}

impl RemoteKey {
    pub fn unpack(ep: &Rc<Endpoint>, packed: &[u8]) -> Result<RemoteKey, UcxError> {
        if packed.is_empty() {
            return Err(UcxError::InvalidArgument {
                what: "empty packed rkey".into(),
            });
        }
        let ucp = ep.worker.ucp();
        // UCX parses the buffer without a length: pad it so a truncated key cannot make it read
        // past our allocation.
        let mut buf = Vec::with_capacity(packed.len() + RKEY_PAD);
        buf.extend_from_slice(packed);
        buf.resize(packed.len() + RKEY_PAD, 0);
        let mut h: ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: valid endpoint; the padded buffer is readable for the call (UCX parses and
        // copies what it needs).
        let st = unsafe { (ucp.ucp_ep_rkey_unpack)(ep.h, buf.as_ptr() as *const c_void, &mut h) };
        ucp.check("ucp_ep_rkey_unpack", st)?;
        Ok(RemoteKey { ep: ep.clone(), h })
    }

    pub fn endpoint(&self) -> &Rc<Endpoint> {
        &self.ep
    }

    /// Where the peer's `raddr` is mapped in this process (`ucp_rkey_ptr`: memory UCX allocated
    /// in a shared-memory segment on the same host), or `None` when it is not reachable that way.
    /// The mapping lives as long as this key.
    pub fn local_ptr(&self, raddr: u64) -> Option<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live rkey and a valid out-pointer; UCX only computes an address.
        let st = unsafe { (self.ep.worker.ucp().ucp_rkey_ptr)(self.h, raddr, &mut p) };
        (st == UCS_OK && !p.is_null()).then_some(p as *mut u8)
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: unpacked once, destroyed once, before its endpoint (held by Rc).
        unsafe { (self.ep.worker.ucp().ucp_rkey_destroy)(self.h) };
    }
}
