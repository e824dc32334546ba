//! Loading libucp at run time.

use crate::UcxError;
use crate::ffi::*;
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::Arc;

/// Library names tried, in order, when no path is given.
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &["libucp.so.0", "libucp.so"];

macro_rules! ucp_fns {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The loaded UCP library: one function pointer per symbol pdnode uses.
        pub struct Ucp {
            /// What was loaded (path or soname).
            pub library: String,
            $( pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            _lib: Library,
        }

        impl Ucp {
            fn from_library(lib: Library, library: String) -> Result<Self, UcxError> {
                $(
                    // SAFETY: the symbol's type is the C prototype from ucp.h (checked by hand
                    // against the 1.13 headers); the pointer is only used while `_lib` is alive,
                    // which it is for as long as `Self` is.
                    let $name = unsafe {
                        *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                        .map_err(|e| UcxError::MissingSymbol {
                            library: library.clone(),
                            symbol: stringify!($name),
                            reason: e.to_string(),
                        })?
                    };
                )*
                Ok(Self { library, $($name,)* _lib: lib })
            }
        }
    };
}

ucp_fns! {
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint);
    ucp_config_read: fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t;
    ucp_config_release: fn(*mut ucp_config_t);
    ucp_config_modify: fn(*mut ucp_config_t, *const c_char, *const c_char) -> ucs_status_t;
    ucp_init_version: fn(c_uint, c_uint, *const ucp_params_t, *const ucp_config_t, *mut ucp_context_h) -> ucs_status_t;
    ucp_cleanup: fn(ucp_context_h);
    ucp_worker_create: fn(ucp_context_h, *const ucp_worker_params_t, *mut ucp_worker_h) -> ucs_status_t;
    ucp_worker_destroy: fn(ucp_worker_h);
    ucp_worker_get_address: fn(ucp_worker_h, *mut *mut ucp_address_t, *mut usize) -> ucs_status_t;
    ucp_worker_release_address: fn(ucp_worker_h, *mut ucp_address_t);
    ucp_worker_progress: fn(ucp_worker_h) -> c_uint;
    ucp_worker_get_efd: fn(ucp_worker_h, *mut c_int) -> ucs_status_t;
    ucp_worker_arm: fn(ucp_worker_h) -> ucs_status_t;
    ucp_worker_signal: fn(ucp_worker_h) -> ucs_status_t;
    ucp_worker_flush_nbx: fn(ucp_worker_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_ep_create: fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t;
    ucp_ep_close_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_ep_flush_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_mem_map: fn(ucp_context_h, *const ucp_mem_map_params_t, *mut ucp_mem_h) -> ucs_status_t;
    ucp_mem_unmap: fn(ucp_context_h, ucp_mem_h) -> ucs_status_t;
    ucp_mem_query: fn(ucp_mem_h, *mut ucp_mem_attr_t) -> ucs_status_t;
    ucp_rkey_pack: fn(ucp_context_h, ucp_mem_h, *mut *mut c_void, *mut usize) -> ucs_status_t;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t;
    ucp_rkey_destroy: fn(ucp_rkey_h);
    ucp_rkey_ptr: fn(ucp_rkey_h, u64, *mut *mut c_void) -> ucs_status_t;
    ucp_put_nbx: fn(ucp_ep_h, *const c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_worker_set_am_recv_handler: fn(ucp_worker_h, *const ucp_am_handler_param_t) -> ucs_status_t;
    ucp_am_send_nbx: fn(ucp_ep_h, c_uint, *const c_void, usize, *const c_void, usize, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_get_nbx: fn(ucp_ep_h, *mut c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_request_check_status: fn(*mut c_void) -> ucs_status_t;
    ucp_request_cancel: fn(ucp_worker_h, *mut c_void);
    ucp_request_free: fn(*mut c_void);
    ucs_status_string: fn(ucs_status_t) -> *const c_char;
}

impl Ucp {
    /// Loads libucp from `path`, or from [`DEFAULT_LIBRARY_NAMES`] when `None`. A missing library
    /// or symbol is an error naming what was tried.
    pub fn load(path: Option<&str>) -> Result<Arc<Ucp>, UcxError> {
        let candidates: Vec<&str> = match path {
            Some(p) => vec![p],
            None => DEFAULT_LIBRARY_NAMES.to_vec(),
        };
        let mut reasons = Vec::new();
        for name in &candidates {
            // SAFETY: loading libucp runs its constructors (UCX's global init), which have no
            // preconditions; the library stays loaded while the returned `Ucp` lives.
            match unsafe { Library::new(name) } {
                Ok(lib) => return Ok(Arc::new(Ucp::from_library(lib, name.to_string())?)),
                Err(e) => reasons.push(format!("{name}: {e}")),
            }
        }
        Err(UcxError::LibraryNotFound {
            tried: candidates.join(", "),
            reason: reasons.join("; "),
        })
    }

    /// `(major, minor, release)` of the loaded library.
    pub fn version(&self) -> (u32, u32, u32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        unsafe { (self.ucp_get_version)(&mut a, &mut b, &mut c) };
        (a, b, c)
    }

    /// `ucs_status_string`.
    pub fn status_string(&self, status: ucs_status_t) -> String {
        // SAFETY: UCX returns a pointer to a static NUL-terminated string for any status value.
        let p = unsafe { (self.ucs_status_string)(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// `Ok(())` for `UCS_OK`, else an error naming the call.
    pub fn check(&self, call: &'static str, status: ucs_status_t) -> Result<(), UcxError> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(UcxError::Call {
                call,
                status,
                message: self.status_string(status),
            })
        }
    }
}
