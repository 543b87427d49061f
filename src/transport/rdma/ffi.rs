//! The few libibverbs entry points the backend calls, loaded at run time with
//! `dlopen("libibverbs.so.1")`: `--features rdma` links against nothing, and a
//! machine without rdma-core gets [`super::options::RdmaError::NoLibrary`], not a
//! loader failure at start.
//!
//! The structs mirror `<infiniband/verbs.h>` (rdma-core; the verbs ABI has been
//! stable since libibverbs 1.1) for the fields the backend touches, with the
//! rest as padding of the right size; the tests pin every size and offset
//! against the header's, as compiled on x86_64.
//!
//! `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are `static inline` in
//! verbs.h: they call through the provider's ops table in `struct
//! ibv_context` (`qp->context->ops.post_send` and so on), and so do
//! [`Verbs::post_send`], [`Verbs::post_recv`] and [`Verbs::poll_cq`]. The
//! exported `ibv_query_port` fills the compat prefix of `ibv_port_attr`
//! (everything up to `link_layer`), which is all that is read.

#![allow(non_camel_case_types)]

use super::options::RdmaError;
use std::ffi::{CStr, c_char, c_int, c_void};

#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ibv_pd {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ibv_comp_channel {
    _opaque: [u8; 0],
}

pub type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;

/// `struct ibv_context_ops`: 32 pointers; the backend calls three of them.
#[repr(C)]
pub struct ibv_context_ops {
    _before_poll_cq: [*mut c_void; 11],
    pub poll_cq: Option<PollCq>,
    _before_post_send: [*mut c_void; 13],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    _after: [*mut c_void; 5],
}

/// The head of `struct ibv_context` (the rest is the provider's).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
}

/// The head of `struct ibv_qp`, up to `qp_num`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    _ptrs: [*mut c_void; 5],
    pub handle: u32,
    pub qp_num: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr` with the `rdma` arm of its `wr` union.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    _rest_of_wr: [u8; 20],
    _qp_type_and_bind: [u8; 56],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            remote_addr: 0,
            rkey: 0,
            _rest_of_wr: [0; 20],
            _qp_type_and_bind: [0; 56],
        }
    }
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// Aligned as verbs.h's, whose `union ibv_gid` holds `__be64`s.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const IBV_SEND_SIGNALED: u32 = 2;
pub const IBV_WC_SUCCESS: u32 = 0;
pub const IBV_WC_RECV_RDMA_WITH_IMM: u32 = 129;
pub const IBV_WC_WITH_IMM: u32 = 2;
pub const IBV_QPT_RC: u32 = 2;
pub const IBV_PORT_ACTIVE: u32 = 4;

/// The name of an `ibv_wc_status` (what `ibv_wc_status_str` says, without the call).
pub fn wc_status_name(status: u32) -> String {
    const NAMES: [&str; 23] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "work request flushed error",
        "memory bind operation error",
        "bad response error",
        "local access error",
        "remote invalid request error",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation error",
        "remote invalid RD request",
        "aborted error",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout error",
        "general error",
        "TM error",
    ];
    match NAMES.get(status as usize) {
        Some(n) => format!("{n} ({status})"),
        None => format!("status {status}"),
    }
}

/// The exported entry points, resolved once per process.
pub struct Verbs {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut [u8; 16]) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_cq: unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
}

/// The library's file name (the runtime package: Debian's `libibverbs1`).
pub const LIBRARY: &str = "libibverbs.so.1";

impl Verbs {
    /// The process's libibverbs, loaded on first use; [`RdmaError::NoLibrary`]
    /// with the loader's message when it cannot be loaded or lacks a symbol.
    pub fn get() -> Result<&'static Verbs, RdmaError> {
        static VERBS: std::sync::OnceLock<Result<Verbs, RdmaError>> = std::sync::OnceLock::new();
        VERBS.get_or_init(Verbs::load).as_ref().map_err(Clone::clone)
    }

    // Each transmute's target is the field it initializes: the field's type is
    // the entry point's C signature, written once, in the struct.
    #[allow(clippy::missing_transmute_annotations)]
    fn load() -> Result<Verbs, RdmaError> {
        let no_library = |reason: String| RdmaError::NoLibrary { library: LIBRARY, reason };
        let name = std::ffi::CString::new(LIBRARY).map_err(|e| no_library(e.to_string()))?;
        // SAFETY: dlopen with a valid C string; the handle is never closed, so
        // the resolved functions stay valid for the process's life.
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(no_library(dlerror()));
        }
        macro_rules! sym {
            ($name:literal) => {{
                let c = concat!($name, "\0");
                // SAFETY: a NUL-terminated name; the symbol's C signature is
                // the field's type (verbs.h), checked by the caller's use.
                let p = unsafe { libc::dlsym(lib, c.as_ptr().cast()) };
                if p.is_null() {
                    return Err(no_library(format!("{LIBRARY} has no {}: {}", $name, dlerror())));
                }
                // SAFETY: a non-null function pointer of the declared signature.
                unsafe { std::mem::transmute::<*mut c_void, _>(p) }
            }};
        }
        Ok(Verbs {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
        })
    }

    /// `ibv_post_send`: through the QP's context's ops table, as verbs.h's inline does.
    ///
    /// # Safety
    /// `qp` is a live queue pair and `wr` a valid chain whose buffers outlive the call.
    pub unsafe fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr) -> c_int {
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the caller's contract; a provider always fills post_send.
        unsafe {
            match (*(*qp).context).ops.post_send {
                Some(f) => f(qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        }
    }

    /// `ibv_post_recv`, through the ops table.
    ///
    /// # Safety
    /// As [`Verbs::post_send`].
    pub unsafe fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr) -> c_int {
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the caller's contract.
        unsafe {
            match (*(*qp).context).ops.post_recv {
                Some(f) => f(qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        }
    }

    /// `ibv_poll_cq`, through the ops table: completions taken into `wc`, or
    /// a negative value on error.
    ///
    /// # Safety
    /// `cq` is a live completion queue.
    pub unsafe fn poll_cq(cq: *mut ibv_cq, wc: &mut [ibv_wc]) -> c_int {
        // SAFETY: the caller's contract; `wc` has room for its length.
        unsafe {
            match (*(*cq).context).ops.poll_cq {
                Some(f) => f(cq, wc.len() as c_int, wc.as_mut_ptr()),
                None => -libc::ENOSYS,
            }
        }
    }

    /// A device's name.
    ///
    /// # Safety
    /// `dev` comes from a live device list.
    pub unsafe fn device_name(&self, dev: *mut ibv_device) -> String {
        // SAFETY: the caller's contract; libibverbs returns a NUL-terminated name.
        unsafe {
            let p = (self.get_device_name)(dev);
            if p.is_null() { String::from("?") } else { CStr::from_ptr(p).to_string_lossy().into_owned() }
        }
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() { "unknown dlopen error".into() } else { CStr::from_ptr(e).to_string_lossy().into_owned() }
    }
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn completion_statuses_are_named() {
        assert_eq!(wc_status_name(10), "remote access error (10)");
        assert_eq!(wc_status_name(12), "transport retry counter exceeded (12)");
        assert_eq!(wc_status_name(99), "status 99");
    }

    /// Sizes and offsets printed by a C program that includes rdma-core 44's
    /// verbs.h (Debian 12, x86_64): `offsetof` of each field read or written.
    #[test]
    fn struct_layouts_match_verbs_h() {
        assert_eq!(offset_of!(ibv_context, ops), 8);
        assert_eq!(offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, poll_cq), 96);
        assert_eq!(offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, post_send), 208);
        assert_eq!(offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, post_recv), 216);
        assert_eq!(size_of::<ibv_context_ops>(), 32 * 8);
        assert_eq!(size_of::<ibv_sge>(), 16);
        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(
            [offset_of!(ibv_send_wr, next), offset_of!(ibv_send_wr, sg_list), offset_of!(ibv_send_wr, num_sge), offset_of!(ibv_send_wr, opcode)],
            [8, 16, 24, 28]
        );
        assert_eq!(
            [offset_of!(ibv_send_wr, send_flags), offset_of!(ibv_send_wr, imm_data), offset_of!(ibv_send_wr, remote_addr), offset_of!(ibv_send_wr, rkey)],
            [32, 36, 40, 48]
        );
        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(
            [
                offset_of!(ibv_wc, status),
                offset_of!(ibv_wc, opcode),
                offset_of!(ibv_wc, byte_len),
                offset_of!(ibv_wc, imm_data),
                offset_of!(ibv_wc, qp_num),
                offset_of!(ibv_wc, wc_flags)
            ],
            [8, 12, 20, 24, 28, 36]
        );
        assert_eq!(size_of::<ibv_qp_cap>(), 20);
        assert_eq!(size_of::<ibv_global_route>(), 24);
        assert_eq!(size_of::<ibv_ah_attr>(), 32);
        assert_eq!([offset_of!(ibv_ah_attr, dlid), offset_of!(ibv_ah_attr, is_global), offset_of!(ibv_ah_attr, port_num)], [24, 29, 30]);
        assert_eq!(size_of::<ibv_qp_attr>(), 144);
        assert_eq!(std::mem::align_of::<ibv_qp_attr>(), 8);
        assert_eq!(
            [
                offset_of!(ibv_qp_attr, qkey),
                offset_of!(ibv_qp_attr, rq_psn),
                offset_of!(ibv_qp_attr, dest_qp_num),
                offset_of!(ibv_qp_attr, qp_access_flags),
                offset_of!(ibv_qp_attr, cap),
                offset_of!(ibv_qp_attr, ah_attr),
                offset_of!(ibv_qp_attr, alt_ah_attr),
                offset_of!(ibv_qp_attr, pkey_index)
            ],
            [16, 20, 28, 32, 36, 56, 88, 120]
        );
        assert_eq!(
            [
                offset_of!(ibv_qp_attr, max_rd_atomic),
                offset_of!(ibv_qp_attr, max_dest_rd_atomic),
                offset_of!(ibv_qp_attr, min_rnr_timer),
                offset_of!(ibv_qp_attr, port_num),
                offset_of!(ibv_qp_attr, timeout),
                offset_of!(ibv_qp_attr, retry_cnt),
                offset_of!(ibv_qp_attr, rnr_retry),
                offset_of!(ibv_qp_attr, rate_limit)
            ],
            [126, 127, 128, 129, 130, 131, 132, 136]
        );
        assert_eq!(size_of::<ibv_qp_init_attr>(), 64);
        assert_eq!([offset_of!(ibv_qp_init_attr, cap), offset_of!(ibv_qp_init_attr, qp_type), offset_of!(ibv_qp_init_attr, sq_sig_all)], [32, 52, 56]);
        assert_eq!(size_of::<ibv_port_attr>(), 52);
        assert_eq!(
            [
                offset_of!(ibv_port_attr, active_mtu),
                offset_of!(ibv_port_attr, gid_tbl_len),
                offset_of!(ibv_port_attr, lid),
                offset_of!(ibv_port_attr, link_layer)
            ],
            [8, 12, 34, 46]
        );
        assert_eq!(size_of::<ibv_mr>(), 48);
        assert_eq!([offset_of!(ibv_mr, lkey), offset_of!(ibv_mr, rkey)], [36, 40]);
        assert_eq!(offset_of!(ibv_qp, qp_num), 52);
    }
}
