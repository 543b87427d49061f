//! The few entry points of UCX's `ucp.h` (API 1.13) that the transport calls,
//! loaded at run time from `libucp.so.0` (`dlopen`), so that building with the
//! `ucx` feature needs no UCX headers or library; only running it does.
//!
//! The parameter structs mirror Debian's 1.13 headers byte for byte (their
//! sizes and the offsets of the fields set here were checked against the C
//! headers with `offsetof`, see the unit test); UCX reads only the fields a
//! struct's `field_mask` names, so the rest stay zero.

#![allow(non_camel_case_types)]

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

pub type UcsStatus = i32;
pub const UCS_OK: UcsStatus = 0;
pub const UCS_INPROGRESS: UcsStatus = 1;
pub const UCS_ERR_BUSY: UcsStatus = -15;

pub type Context = *mut c_void;
pub type Worker = *mut c_void;
pub type Ep = *mut c_void;
pub type MemH = *mut c_void;
pub type RKey = *mut c_void;
pub type UcpConfig = *mut c_void;

pub const UCP_API_MAJOR: c_uint = 1;
pub const UCP_API_MINOR: c_uint = 13;

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCS_THREAD_MODE_MULTI: c_int = 2;

pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;

pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;

/// `ucp_params_t` (80 bytes).
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *mut c_void,
    pub request_cleanup: *mut c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t` (200 bytes); only the thread mode is set.
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub rest: [u8; 188],
}

pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;

/// `ucp_err_handler_cb_t`.
pub type ErrHandler = unsafe extern "C" fn(arg: *mut c_void, ep: Ep, status: UcsStatus);

/// `ucp_ep_params_t` (104 bytes).
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler: Option<ErrHandler>,
    pub err_arg: *mut c_void,
    pub rest: [u8; 64],
}

/// `ucp_mem_map_params_t` (40 bytes).
#[repr(C)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

/// `ucp_mem_attr_t` (32 bytes).
#[repr(C)]
pub struct MemAttr {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: c_int,
}

/// `ucp_request_param_t` (72 bytes); no callback: completion is polled with
/// `ucp_request_check_status`.
#[repr(C, align(8))]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub rest: [u8; 64],
}

impl RequestParam {
    pub fn none() -> Self {
        RequestParam { op_attr_mask: 0, flags: 0, rest: [0; 64] }
    }
    pub fn with_flags(flags: u32) -> Self {
        RequestParam { op_attr_mask: UCP_OP_ATTR_FIELD_FLAGS, flags, rest: [0; 64] }
    }
}

/// A `ucs_status_ptr_t`: null (done), an error code, or a request.
pub enum StatusPtr {
    Done,
    Failed(UcsStatus),
    Pending(*mut c_void),
}

impl StatusPtr {
    pub fn from_raw(p: *mut c_void) -> Self {
        let v = p as isize;
        if p.is_null() {
            StatusPtr::Done
        } else if (-100..0).contains(&v) {
            // UCS_PTR_IS_ERR: the status codes are the small negative numbers.
            StatusPtr::Failed(v as UcsStatus)
        } else {
            StatusPtr::Pending(p)
        }
    }
}

/// The loaded library: its entry points.
pub struct Lib {
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut UcpConfig) -> UcsStatus,
    pub config_modify: unsafe extern "C" fn(UcpConfig, *const c_char, *const c_char) -> UcsStatus,
    pub config_release: unsafe extern "C" fn(UcpConfig),
    pub init_version: unsafe extern "C" fn(c_uint, c_uint, *const Params, UcpConfig, *mut Context) -> UcsStatus,
    pub cleanup: unsafe extern "C" fn(Context),
    pub worker_create: unsafe extern "C" fn(Context, *const WorkerParams, *mut Worker) -> UcsStatus,
    pub worker_destroy: unsafe extern "C" fn(Worker),
    pub worker_get_address: unsafe extern "C" fn(Worker, *mut *mut c_void, *mut usize) -> UcsStatus,
    pub worker_release_address: unsafe extern "C" fn(Worker, *mut c_void),
    pub worker_progress: unsafe extern "C" fn(Worker) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(Worker, *mut c_int) -> UcsStatus,
    pub worker_arm: unsafe extern "C" fn(Worker) -> UcsStatus,
    pub worker_signal: unsafe extern "C" fn(Worker) -> UcsStatus,
    pub worker_fence: unsafe extern "C" fn(Worker) -> UcsStatus,
    pub ep_create: unsafe extern "C" fn(Worker, *const EpParams, *mut Ep) -> UcsStatus,
    pub ep_close_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> *mut c_void,
    pub ep_flush_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> *mut c_void,
    pub mem_map: unsafe extern "C" fn(Context, *const MemMapParams, *mut MemH) -> UcsStatus,
    pub mem_unmap: unsafe extern "C" fn(Context, MemH) -> UcsStatus,
    pub mem_query: unsafe extern "C" fn(MemH, *mut MemAttr) -> UcsStatus,
    pub rkey_pack: unsafe extern "C" fn(Context, MemH, *mut *mut c_void, *mut usize) -> UcsStatus,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack: unsafe extern "C" fn(Ep, *const c_void, *mut RKey) -> UcsStatus,
    pub rkey_destroy: unsafe extern "C" fn(RKey),
    pub rkey_ptr: unsafe extern "C" fn(RKey, u64, *mut *mut c_void) -> UcsStatus,
    pub put_nbx: unsafe extern "C" fn(Ep, *const c_void, usize, u64, RKey, *const RequestParam) -> *mut c_void,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> UcsStatus,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(UcsStatus) -> *const c_char,
}

/// The file loaded: the soname Debian's `libucx0` installs.
pub const LIBRARY: &str = "libucp.so.0";

/// Why UCX's library cannot be used; each message says what to install.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxLibError {
    #[error("{library} could not be loaded ({reason}); install UCX (Debian: apt-get install libucx0, or libucx-dev)")]
    Open { library: &'static str, reason: String },
    #[error("{library} has no symbol {symbol} (UCX older than 1.13?)")]
    Symbol { library: &'static str, symbol: &'static str },
}

/// The library, loaded once per process; the error says what to install.
pub fn lib() -> Result<&'static Lib, UcxLibError> {
    static LIB: OnceLock<Result<Lib, UcxLibError>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

// Each symbol's type is the field's it is assigned to, spelled once there.
#[allow(clippy::missing_transmute_annotations)]
fn load() -> Result<Lib, UcxLibError> {
    let name = CString::new(LIBRARY).map_err(|e| UcxLibError::Open { library: LIBRARY, reason: e.to_string() })?;
    // SAFETY: dlopen with a valid C string; the handle is kept for the process's life.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a valid C string.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() { "unknown".to_string() } else { CStr::from_ptr(e).to_string_lossy().into_owned() }
        };
        return Err(UcxLibError::Open { library: LIBRARY, reason: why });
    }
    macro_rules! sym {
        ($name:literal) => {{
            let c = concat!($name, "\0");
            // SAFETY: a NUL-terminated name; dlsym searches the library and its dependencies.
            let p = unsafe { libc::dlsym(handle, c.as_ptr().cast()) };
            if p.is_null() {
                return Err(UcxLibError::Symbol { library: LIBRARY, symbol: $name });
            }
            // SAFETY: the symbol is the C function of that name, whose signature
            // the field's type copies from ucp.h.
            unsafe { std::mem::transmute::<*mut c_void, _>(p) }
        }};
    }
    Ok(Lib {
        config_read: sym!("ucp_config_read"),
        config_modify: sym!("ucp_config_modify"),
        config_release: sym!("ucp_config_release"),
        init_version: sym!("ucp_init_version"),
        cleanup: sym!("ucp_cleanup"),
        worker_create: sym!("ucp_worker_create"),
        worker_destroy: sym!("ucp_worker_destroy"),
        worker_get_address: sym!("ucp_worker_get_address"),
        worker_release_address: sym!("ucp_worker_release_address"),
        worker_progress: sym!("ucp_worker_progress"),
        worker_get_efd: sym!("ucp_worker_get_efd"),
        worker_arm: sym!("ucp_worker_arm"),
        worker_signal: sym!("ucp_worker_signal"),
        worker_fence: sym!("ucp_worker_fence"),
        ep_create: sym!("ucp_ep_create"),
        ep_close_nbx: sym!("ucp_ep_close_nbx"),
        ep_flush_nbx: sym!("ucp_ep_flush_nbx"),
        mem_map: sym!("ucp_mem_map"),
        mem_unmap: sym!("ucp_mem_unmap"),
        mem_query: sym!("ucp_mem_query"),
        rkey_pack: sym!("ucp_rkey_pack"),
        rkey_buffer_release: sym!("ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!("ucp_ep_rkey_unpack"),
        rkey_destroy: sym!("ucp_rkey_destroy"),
        rkey_ptr: sym!("ucp_rkey_ptr"),
        put_nbx: sym!("ucp_put_nbx"),
        request_check_status: sym!("ucp_request_check_status"),
        request_free: sym!("ucp_request_free"),
        status_string: sym!("ucs_status_string"),
    })
}

impl Lib {
    /// UCX's own words for a status.
    pub fn describe(&self, status: UcsStatus) -> String {
        // SAFETY: ucs_status_string returns a static C string for any status.
        let p = unsafe { (self.status_string)(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        format!("{s} ({status})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The structs' sizes, as `sizeof` gives them for Debian's UCX 1.13 headers.
    #[test]
    fn parameter_structs_have_the_c_sizes_of_ucx_1_13() {
        assert_eq!(std::mem::size_of::<Params>(), 80);
        assert_eq!(std::mem::offset_of!(Params, mt_workers_shared), 48);
        assert_eq!(std::mem::offset_of!(Params, name), 72);
        assert_eq!(std::mem::size_of::<WorkerParams>(), 200);
        assert_eq!(std::mem::size_of::<EpParams>(), 104);
        assert_eq!(std::mem::offset_of!(EpParams, err_mode), 16);
        assert_eq!(std::mem::offset_of!(EpParams, err_handler), 24);
        assert_eq!(std::mem::size_of::<MemMapParams>(), 40);
        assert_eq!(std::mem::offset_of!(MemMapParams, memory_type), 32);
        assert_eq!(std::mem::size_of::<MemAttr>(), 32);
        assert_eq!(std::mem::size_of::<RequestParam>(), 72);
    }

    #[test]
    fn a_status_pointer_tells_done_errors_and_requests_apart() {
        assert!(matches!(StatusPtr::from_raw(std::ptr::null_mut()), StatusPtr::Done));
        assert!(matches!(StatusPtr::from_raw(-6isize as *mut c_void), StatusPtr::Failed(-6)));
        assert!(matches!(StatusPtr::from_raw(0x1000 as *mut c_void), StatusPtr::Pending(_)));
    }
}
