//! Owned verbs objects over [`super::ffi`]: the device (context and protection
//! domain), memory registrations, and a queue pair with its completion queue.
//! Each holds an `Arc` of the device, so the context outlives everything made
//! from it, and frees its object on drop.

use super::ffi::{self, Verbs};
use super::options::RdmaOptions;
use super::options::{DeviceNames, RdmaError};
use super::plan::WorkRequest;
use super::qp::{LinkLayer, PortInfo, Transition};
use std::ffi::c_int;
use std::sync::Arc;

/// An opened device: its context, one protection domain and the port in use.
pub struct Device {
    verbs: &'static Verbs,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    pub name: String,
    pub port: PortInfo,
    /// The port's largest message (`max_msg_sz`).
    pub max_msg: u64,
}

// SAFETY: libibverbs objects may be used from any thread (the library and its
// providers lock where they must); the pointers are only freed on drop.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn verbs_err(call: &'static str, device: &str, code: i32) -> RdmaError {
    RdmaError::Verbs { call, device: device.to_string(), errno: code, message: std::io::Error::from_raw_os_error(code).to_string() }
}

/// A port or GID index the device does not have (the configured
/// `[transport.rdma]` value), named as the field it came from.
fn not_on_device(call: &'static str, device: &str, field: &'static str, value: u8, code: i32) -> RdmaError {
    let message = std::io::Error::from_raw_os_error(code).to_string();
    RdmaError::NotOnDevice { device: device.to_string(), field, value, call, message }
}

/// Why `ibv_get_device_list` returned no list: ENOSYS is a kernel without
/// its RDMA core (no /sys/class/infiniband_verbs), the usual case on a machine
/// without an RDMA NIC.
fn list_failed(code: i32) -> String {
    if code == libc::ENOSYS {
        "ibv_get_device_list lists none (this kernel has no RDMA core loaded: no /sys/class/infiniband_verbs)".into()
    } else {
        format!("ibv_get_device_list failed: {}", std::io::Error::from_raw_os_error(code))
    }
}

/// The names of the devices `ibv_get_device_list` lists, or why there are none.
pub fn device_names() -> Result<DeviceNames, RdmaError> {
    let verbs = Verbs::get()?;
    let mut n: c_int = 0;
    // SAFETY: a valid out pointer; the list is freed below.
    let list = unsafe { (verbs.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(RdmaError::NoDevice { detail: list_failed(errno()) });
    }
    // SAFETY: `list` holds `n` device pointers, valid until freed.
    let names = (0..n.max(0) as usize).map(|i| unsafe { verbs.device_name(*list.add(i)) }).collect();
    // SAFETY: the list from get_device_list, freed once.
    unsafe { (verbs.free_device_list)(list) };
    Ok(names)
}

impl Device {
    /// Opens the named device (the first listed when `None`), allocates a
    /// protection domain and reads the port's address.
    pub fn open(opts: &RdmaOptions) -> Result<Arc<Device>, RdmaError> {
        let verbs = Verbs::get()?;
        let mut n: c_int = 0;
        // SAFETY: as in device_names.
        let list = unsafe { (verbs.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(RdmaError::NoDevice { detail: list_failed(errno()) });
        }
        // SAFETY: `list` holds `n` device pointers until freed.
        let devs: Vec<*mut ffi::ibv_device> = (0..n.max(0) as usize).map(|i| unsafe { *list.add(i) }).collect();
        // SAFETY: live list entries.
        let names: Vec<String> = devs.iter().map(|&d| unsafe { verbs.device_name(d) }).collect();
        let pick = match &opts.device {
            None => (!devs.is_empty()).then_some(0),
            Some(want) => names.iter().position(|n| n == want),
        };
        let opened = pick.map(|i| {
            // SAFETY: a live list entry; a device may be opened after its list is freed.
            let ctx = unsafe { (verbs.open_device)(devs[i]) };
            (ctx, errno(), names[i].clone())
        });
        // SAFETY: the list from get_device_list, freed once; opened contexts stay valid.
        unsafe { (verbs.free_device_list)(list) };
        let (ctx, code, name) = match (opened, &opts.device) {
            (Some(o), _) => o,
            (None, None) => return Err(RdmaError::NoDevice { detail: "ibv_get_device_list lists none".into() }),
            (None, Some(want)) => return Err(RdmaError::UnknownDevice { name: want.clone(), available: names }),
        };
        if ctx.is_null() {
            return Err(verbs_err("ibv_open_device", &name, code));
        }
        let close = |e: RdmaError| {
            // SAFETY: the context opened above, closed once on this error path.
            unsafe { (verbs.close_device)(ctx) };
            e
        };
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: a live context and a zeroed attribute struct (the compat prefix is filled).
        let rc = unsafe { (verbs.query_port)(ctx, opts.port, &mut attr) };
        if rc != 0 {
            return Err(close(not_on_device("ibv_query_port", &name, "port", opts.port, rc)));
        }
        if attr.state != ffi::IBV_PORT_ACTIVE {
            return Err(close(RdmaError::PortDown { device: name, port: opts.port, state: attr.state }));
        }
        let link = LinkLayer::from_code(attr.link_layer).ok_or_else(|| {
            close(RdmaError::Verbs { call: "ibv_query_port", device: name.clone(), errno: 0, message: format!("unknown link layer {}", attr.link_layer) })
        })?;
        let mut gid = [0u8; 16];
        // SAFETY: a live context and a 16-byte out buffer.
        let rc = unsafe { (verbs.query_gid)(ctx, opts.port, opts.gid_index as c_int, &mut gid) };
        if rc != 0 {
            return Err(close(not_on_device("ibv_query_gid", &name, "gid_index", opts.gid_index, rc)));
        }
        // SAFETY: a live context.
        let pd = unsafe { (verbs.alloc_pd)(ctx) };
        if pd.is_null() {
            return Err(close(verbs_err("ibv_alloc_pd", &name, errno())));
        }
        let port = PortInfo { port: opts.port, lid: attr.lid, gid, gid_index: opts.gid_index, mtu: attr.active_mtu as u8, link };
        let max_msg = if attr.max_msg_sz == 0 { 1 << 30 } else { attr.max_msg_sz as u64 };
        tracing::info!(device = %name, port = opts.port, lid = attr.lid, ?link, mtu = attr.active_mtu, "rdma device open");
        Ok(Arc::new(Device { verbs, ctx, pd, name, port, max_msg }))
    }

    /// Registers `len` bytes at `addr` for local use and remote writes.
    pub fn register(self: &Arc<Self>, addr: *mut u8, len: u64) -> Result<Mr, RdmaError> {
        let access = (super::qp::access::LOCAL_WRITE | super::qp::access::REMOTE_WRITE) as c_int;
        // SAFETY: the caller keeps `addr..addr+len` mapped until the Mr drops.
        let mr = unsafe { (self.verbs.reg_mr)(self.pd, addr.cast(), len as usize, access) };
        if mr.is_null() {
            return Err(verbs_err("ibv_reg_mr", &self.name, errno()));
        }
        Ok(Mr { dev: Arc::clone(self), mr })
    }

    /// A queue pair of the RC type on its own completion queue, moved to INIT.
    pub fn queue_pair(self: &Arc<Self>, sq_depth: u32, rq_depth: u32, max_sge: u32) -> Result<Qp, RdmaError> {
        let cqe = (sq_depth + rq_depth + 1) as c_int;
        // SAFETY: a live context; no channel.
        let cq = unsafe { (self.verbs.create_cq)(self.ctx, cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(verbs_err("ibv_create_cq", &self.name, errno()));
        }
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: std::ptr::null_mut(),
            cap: ffi::ibv_qp_cap { max_send_wr: sq_depth, max_recv_wr: rq_depth, max_send_sge: max_sge, max_recv_sge: 1, max_inline_data: 0 },
            qp_type: ffi::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a live PD and CQ.
        let qp = unsafe { (self.verbs.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            let code = errno();
            // SAFETY: the CQ created above, unused.
            unsafe { (self.verbs.destroy_cq)(cq) };
            return Err(verbs_err("ibv_create_qp", &self.name, code));
        }
        let qp = Qp { dev: Arc::clone(self), qp, cq };
        qp.modify(&super::qp::to_init(self.port.port))?;
        Ok(qp)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every object made from the PD and context holds an Arc of
        // this device, so none is left; each is freed once.
        unsafe {
            (self.verbs.dealloc_pd)(self.pd);
            (self.verbs.close_device)(self.ctx);
        }
    }
}

/// One memory registration.
pub struct Mr {
    dev: Arc<Device>,
    mr: *mut ffi::ibv_mr,
}

// SAFETY: see Device.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Mr {
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        unsafe { (self.dev.verbs.dereg_mr)(self.mr) };
    }
}

/// A reliable-connected queue pair and the completion queue of both its queues.
pub struct Qp {
    dev: Arc<Device>,
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
}

// SAFETY: see Device; posting is serialized by the transport per queue pair.
unsafe impl Send for Qp {}
unsafe impl Sync for Qp {}

impl Qp {
    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP.
        unsafe { (*self.qp).qp_num }
    }

    /// `ibv_modify_qp` with the transition's attributes and mask.
    pub fn modify(&self, t: &Transition) -> Result<(), RdmaError> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: t.state as u32,
            path_mtu: t.path_mtu as u32,
            rq_psn: t.rq_psn,
            sq_psn: t.sq_psn,
            dest_qp_num: t.dest_qpn,
            qp_access_flags: t.access,
            pkey_index: t.pkey_index,
            max_rd_atomic: t.max_rd_atomic,
            max_dest_rd_atomic: t.max_dest_rd_atomic,
            min_rnr_timer: t.min_rnr_timer,
            port_num: t.port,
            timeout: t.timeout,
            retry_cnt: t.retry_cnt,
            rnr_retry: t.rnr_retry,
            ..Default::default()
        };
        a.ah_attr.dlid = t.av.dlid;
        a.ah_attr.port_num = t.av.port;
        a.ah_attr.is_global = t.av.is_global as u8;
        a.ah_attr.grh.dgid = t.av.dgid;
        a.ah_attr.grh.sgid_index = t.av.sgid_index;
        a.ah_attr.grh.hop_limit = t.av.hop_limit;
        // SAFETY: a live QP and a filled attribute struct.
        let rc = unsafe { (self.dev.verbs.modify_qp)(self.qp, &mut a, t.mask as c_int) };
        if rc != 0 {
            return Err(verbs_err(
                match t.state {
                    super::qp::QpState::Init => "ibv_modify_qp(INIT)",
                    super::qp::QpState::Rtr => "ibv_modify_qp(RTR)",
                    super::qp::QpState::Rts => "ibv_modify_qp(RTS)",
                    _ => "ibv_modify_qp",
                },
                &self.dev.name,
                rc,
            ));
        }
        Ok(())
    }

    /// Posts `wrs` as one chain, in order; only the last is signaled, with
    /// `wr_id`. Immediates go out in network byte order.
    pub fn post_writes(&self, wrs: &[WorkRequest], wr_id: u64) -> Result<(), RdmaError> {
        let sges: Vec<Vec<ffi::ibv_sge>> =
            wrs.iter().map(|w| w.sges.iter().map(|s| ffi::ibv_sge { addr: s.addr, length: s.len, lkey: s.lkey }).collect()).collect();
        let mut chain: Vec<ffi::ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (w, s) in wrs.iter().zip(&sges) {
            let mut wr = ffi::ibv_send_wr::default();
            wr.wr_id = wr_id;
            wr.sg_list = if s.is_empty() { std::ptr::null_mut() } else { s.as_ptr().cast_mut() };
            wr.num_sge = s.len() as c_int;
            wr.opcode = if w.imm.is_some() { ffi::IBV_WR_RDMA_WRITE_WITH_IMM } else { ffi::IBV_WR_RDMA_WRITE };
            wr.imm_data = w.imm.unwrap_or(0).to_be();
            wr.remote_addr = w.remote_addr;
            wr.rkey = w.rkey;
            chain.push(wr);
        }
        let n = chain.len();
        if n == 0 {
            return Ok(());
        }
        chain[n - 1].send_flags = ffi::IBV_SEND_SIGNALED;
        let base = chain.as_mut_ptr();
        for i in 0..n - 1 {
            // SAFETY: indices within the vector, which no longer grows.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        // SAFETY: a live QP; the chain and its entries live until the call returns
        // (the provider copies them into the send queue).
        let rc = unsafe { Verbs::post_send(self.qp, base) };
        if rc != 0 {
            return Err(verbs_err("ibv_post_send", &self.dev.name, rc));
        }
        Ok(())
    }

    /// Posts `n` receives without buffers: each takes one RDMA WRITE WITH IMMEDIATE.
    pub fn post_receives(&self, n: u32) -> Result<(), RdmaError> {
        for _ in 0..n {
            let mut wr = ffi::ibv_recv_wr { wr_id: 0, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
            // SAFETY: a live QP and a request that lives through the call.
            let rc = unsafe { Verbs::post_recv(self.qp, &mut wr) };
            if rc != 0 {
                return Err(verbs_err("ibv_post_recv", &self.dev.name, rc));
            }
        }
        Ok(())
    }

    /// Takes up to `wc.len()` completions.
    pub fn poll(&self, wc: &mut [ffi::ibv_wc]) -> Result<usize, RdmaError> {
        // SAFETY: a live CQ.
        let n = unsafe { Verbs::poll_cq(self.cq, wc) };
        if n < 0 {
            return Err(verbs_err("ibv_poll_cq", &self.dev.name, -n));
        }
        Ok(n as usize)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP before its CQ, each once.
        unsafe {
            (self.dev.verbs.destroy_qp)(self.qp);
            (self.dev.verbs.destroy_cq)(self.cq);
        }
    }
}
