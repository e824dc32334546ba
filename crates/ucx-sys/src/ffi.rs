//! Raw declarations of the UCP subset, written from the UCX 1.13 headers (`ucp/api/ucp.h`,
//! `ucp/api/ucp_def.h`, `ucs/type/status.h`). Sizes and offsets are checked against the C compiler
//! by `tests/layout.rs` (expected values from `layout/check.sh`).
//!
//! Stability across versions: every parameter struct starts with a field mask, and UCX reads only
//! the fields whose bit is set. Newer releases (1.22 on the GPU hosts) only append fields, so a
//! 1.13-sized struct with 1.13 bits set is read correctly by them.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ucs_status_t`: a packed (one byte) signed enum.
pub type ucs_status_t = i8;
/// `ucs_status_ptr_t`: NULL (done), an error code cast to a pointer, or a request handle.
pub type ucs_status_ptr_t = *mut c_void;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
pub const UCS_ERR_LAST: ucs_status_t = -100;

/// Opaque handles.
#[repr(C)]
pub struct ucp_context {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ucp_worker {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ucp_ep {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ucp_mem {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ucp_rkey {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ucp_config {
    _p: [u8; 0],
}
#[repr(C)]
pub struct ucp_address {
    _p: [u8; 0],
}

pub type ucp_context_h = *mut ucp_context;
pub type ucp_worker_h = *mut ucp_worker;
pub type ucp_ep_h = *mut ucp_ep;
pub type ucp_mem_h = *mut ucp_mem;
pub type ucp_rkey_h = *mut ucp_rkey;
pub type ucp_config_t = ucp_config;
pub type ucp_address_t = ucp_address;

// ucs_thread_mode_t
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
pub const UCS_THREAD_MODE_MULTI: c_int = 2;

// ucs_memory_type_t
pub const UCS_MEMORY_TYPE_HOST: c_int = 0;
pub const UCS_MEMORY_TYPE_CUDA: c_int = 1;

// ucp_err_handling_mode_t
pub const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;

// ucp_params_t field mask and features
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;

// ucp_worker_params_t field mask, wake-up events
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCP_WORKER_PARAM_FIELD_EVENTS: u64 = 1 << 2;
pub const UCP_WAKEUP_RMA: c_uint = 1 << 0;
pub const UCP_WAKEUP_TX: c_uint = 1 << 10;
pub const UCP_WAKEUP_RX: c_uint = 1 << 11;

// ucp_ep_params_t field mask
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;

// ucp_ep_close_nbx flags (ucp_request_param_t::flags)
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// ucp_mem_map_params_t field mask
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
/// `ucp_mem_map` flag: UCX allocates the memory (e.g. in a shared-memory segment that peers on
/// the same host can map and write directly).
pub const UCP_MEM_MAP_ALLOCATE: u32 = 1 << 1;

// ucp_mem_attr_t field mask
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;

// ucp_request_param_t op_attr_mask
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ucs_cpu_set_t {
    pub ucs_bits: [u64; 16],
}

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    pub request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: ucs_cpu_set_t,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

pub type ucp_err_handler_cb_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;

#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: ucp_err_handler_cb_t,
    pub arg: *mut c_void,
}

#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const c_void,
    pub addrlen: u32,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: c_int,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

#[repr(C)]
pub struct ucp_mem_attr_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: c_int,
}

/// The callback union of `ucp_request_param_t` (all members are function pointers).
pub type ucp_send_nbx_callback_t = Option<
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void),
>;

#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_send_nbx_callback_t,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: ucp_mem_h,
}

impl ucp_request_param_t {
    /// All fields unset (`op_attr_mask = 0`): UCX's defaults.
    pub fn empty() -> Self {
        Self {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: None,
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

// Active messages (ucp_worker_set_am_recv_handler, ucp_am_send_nbx)
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
/// The handler gets a message only whole (no fragments).
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
/// `ucp_am_send_nbx` flag: the receiver gets a reply endpoint.
pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1 << 0;
/// `ucp_am_send_nbx` flag: eager protocol only (never rendezvous).
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
/// `ucp_am_recv_param_t::recv_attr`: `reply_ep` is valid.
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
/// `ucp_am_recv_param_t::recv_attr`: `data` persists if the handler returns UCS_INPROGRESS.
pub const UCP_AM_RECV_ATTR_FLAG_DATA: u64 = 1 << 16;
/// `ucp_am_recv_param_t::recv_attr`: `data` is a rendezvous descriptor, not the bytes.
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;
pub const UCS_ERR_UNSUPPORTED: ucs_status_t = -22;

#[repr(C)]
pub struct ucp_am_recv_param_t {
    pub recv_attr: u64,
    pub reply_ep: ucp_ep_h,
}

/// `ucp_am_recv_callback_t`.
pub type ucp_am_recv_callback_t = Option<
    unsafe extern "C" fn(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        data: *mut c_void,
        length: usize,
        param: *const ucp_am_recv_param_t,
    ) -> ucs_status_t,
>;

#[repr(C)]
pub struct ucp_am_handler_param_t {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: ucp_am_recv_callback_t,
    pub arg: *mut c_void,
}

/// `UCS_PTR_IS_ERR`.
pub fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_STATUS` for a pointer that is NULL or an error (not a request).
pub fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}

/// `struct pollfd` of `poll(2)`, for sleeping on the worker's event fd and a wake-up fd.
#[repr(C)]
pub struct pollfd {
    pub fd: c_int,
    pub events: i16,
    pub revents: i16,
}
pub const POLLIN: i16 = 0x1;

unsafe extern "C" {
    /// libc's `poll(2)` (libc is linked into every Rust binary on Linux).
    pub fn poll(fds: *mut pollfd, nfds: u64, timeout: c_int) -> c_int;
}
