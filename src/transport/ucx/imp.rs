//! The UCX transport proper (the `ucx` feature). See the module docs of [`super`].

use super::sys::{self, Lib, StatusPtr};
use super::{UcxOptions, from_hex, to_hex};
use crate::transport::multicopy::{Batch, copy_batches};
use crate::transport::tcp::Link;
use crate::transport::{
    BatchCompletion, BatchId, Completions, Incident, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteKey, RemoteRegion, Result, TcpTransport,
    Transport, TransportError, host_only, lock, pieces, read, usize_len, validate, write,
};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

fn failed(what: impl Into<String>, lib: &Lib, status: sys::UcsStatus) -> TransportError {
    TransportError::Unavailable { what: format!("ucx {}", what.into()), reason: lib.describe(status) }
}

/// One local region: memory UCX allocated and registered.
struct Region {
    len: u64,
    ptr: *mut u8,
    memh: sys::MemH,
    /// Guards the bytes against this process's own readers and writers; a
    /// peer's puts do not take it (the engine reads no region it is written).
    lock: RwLock<()>,
}

// SAFETY: the pointer is to memory owned by this region until it is unmapped,
// which happens only once no Arc of it remains in the tables (drop of the
// transport) or on unregister (after which the engine no longer uses it).
unsafe impl Send for Region {}
// SAFETY: access to the bytes goes through `lock`.
unsafe impl Sync for Region {}

/// A peer's region opened for puts.
struct Attachment {
    ep: sys::Ep,
    rkey: sys::RKey,
    addr: u64,
    kind: RegionKind,
    len: u64,
    peer: String,
    /// The peer's region in this process's address space, where UCX reaches it
    /// through shared memory (`ucp_rkey_ptr`) and the transport was opened
    /// with [`UcxOptions::direct`].
    mapped: Option<Arc<Mapped>>,
    /// The notice connection to the peer, whose close tells that the peer's
    /// process ended: UCX's shared-memory lanes report no peer failure.
    link: Link,
    /// Whether the endpoint has UCX's peer error handling (network-only
    /// lanes), so that UCX itself fails a put to a dead peer: its puts then
    /// do not consult `link`, whose connection may drop for reasons of its own
    /// across a network. Stores into `mapped` always do.
    ucx_reports: bool,
}

/// A peer's region mapped here by UCX (the rkey's shared-memory mapping).
struct Mapped {
    ptr: *mut u8,
    len: u64,
    /// Held over each batch's stores: one writer of the mapping at a time (as
    /// the shm transport's regions), and [`Transport::detach`] waits for it
    /// before the rkey, and with it the mapping, goes.
    lock: Mutex<()>,
}

// SAFETY: the mapping lives until the rkey is destroyed, which happens only
// under `lock` (detach) or with no batch running (drop of the transport).
unsafe impl Send for Mapped {}
// SAFETY: stores through the pointer happen under `lock`.
unsafe impl Sync for Mapped {}

/// What only the worker's lock holder touches: endpoints, keys, pending flushes.
struct State {
    /// Per peer worker address: the endpoint, and whether it has UCX's peer
    /// error handling.
    eps: HashMap<Vec<u8>, (sys::Ep, bool)>,
    attachments: HashMap<u64, Attachment>,
    /// Batches whose flush is in flight, with its request, the peer's name and
    /// its notice link where UCX reports no peer failure on that endpoint.
    pending: Vec<(BatchId, *mut c_void, String, Option<Link>)>,
}

struct Inner {
    lib: &'static Lib,
    context: sys::Context,
    worker: sys::Worker,
    state: Mutex<State>,
    regions: RwLock<HashMap<u64, Arc<Region>>>,
    completions: Completions,
    next_id: AtomicU64,
    shutdown: AtomicBool,
    endpoint: PeerAddr,
    puts: AtomicU64,
    put_bytes: AtomicU64,
    /// Sum over puts and stores of len * len / 1024: the byte-weighted mean
    /// write size.
    write_weight: AtomicU64,
    /// Pieces and bytes stored through mapped peer regions instead of put.
    stored: AtomicU64,
    stored_bytes: AtomicU64,
}

// SAFETY: the UCX handles are used under `state`'s lock (the worker was created
// UCS_THREAD_MODE_MULTI besides); the context's mem_map/unmap/rkey_pack are
// thread safe in UCX.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// The UCX transport. See the module docs.
pub struct UcxTransport {
    inner: Arc<Inner>,
    peer_errors: bool,
    direct: bool,
    notices: TcpTransport,
    progress: Option<JoinHandle<()>>,
}

impl UcxTransport {
    /// Loads UCX, creates its context (with `[transport.ucx]` applied) and worker,
    /// and starts the notice listener and the progress thread.
    pub fn open(opts: UcxOptions) -> Result<Self> {
        let lib = sys::lib().map_err(|e| TransportError::Unavailable { what: "ucx".into(), reason: e.to_string() })?;
        let notices = TcpTransport::bind(opts.notify.clone())?;
        let PeerAddr::Tcp { addr: notify } = notices.endpoint() else {
            return Err(TransportError::Unavailable { what: "ucx notices".into(), reason: "the notice transport is not tcp".into() });
        };
        let mut config: sys::UcpConfig = std::ptr::null_mut();
        // SAFETY: null prefix and file: UCX's defaults and its environment.
        let st = unsafe { (lib.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        if st != sys::UCS_OK {
            return Err(failed("ucp_config_read", lib, st));
        }
        let settings = [("TLS", opts.ucx.tls.as_deref()), ("NET_DEVICES", opts.ucx.net_devices.as_deref())];
        for (name, value) in settings {
            let Some(value) = value else { continue };
            let (n, v) = (CString::new(name), CString::new(value));
            let (Ok(n), Ok(v)) = (n, v) else {
                // SAFETY: the config read above.
                unsafe { (lib.config_release)(config) };
                return Err(TransportError::Unavailable { what: format!("ucx {name} {value:?}"), reason: "contains a NUL byte".into() });
            };
            // SAFETY: a config from ucp_config_read and two C strings.
            let st = unsafe { (lib.config_modify)(config, n.as_ptr(), v.as_ptr()) };
            if st != sys::UCS_OK {
                // SAFETY: as above.
                unsafe { (lib.config_release)(config) };
                return Err(failed(format!("[transport.ucx] {} = {value:?}", name.to_lowercase()), lib, st));
            }
        }
        let params = sys::Params {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            features: sys::UCP_FEATURE_RMA,
            request_size: 0,
            request_init: std::ptr::null_mut(),
            request_cleanup: std::ptr::null_mut(),
            tag_sender_mask: 0,
            mt_workers_shared: 1,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: std::ptr::null(),
        };
        let mut context: sys::Context = std::ptr::null_mut();
        // SAFETY: valid params and config; the config is released right after.
        let st = unsafe { (lib.init_version)(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config, &mut context) };
        // SAFETY: the config is no longer needed (ucp_init copied it).
        unsafe { (lib.config_release)(config) };
        if st != sys::UCS_OK {
            let tls = opts.ucx.tls.as_deref().unwrap_or("UCX's default");
            return Err(failed(format!("context (tls {tls})"), lib, st));
        }
        let wparams = sys::WorkerParams { field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE, thread_mode: sys::UCS_THREAD_MODE_MULTI, rest: [0; 188] };
        let mut worker: sys::Worker = std::ptr::null_mut();
        // SAFETY: a live context and valid params.
        let st = unsafe { (lib.worker_create)(context, &wparams, &mut worker) };
        if st != sys::UCS_OK {
            // SAFETY: the context made above, unused elsewhere.
            unsafe { (lib.cleanup)(context) };
            return Err(failed("worker", lib, st));
        }
        let mut addr: *mut c_void = std::ptr::null_mut();
        let mut addr_len = 0usize;
        // SAFETY: a live worker; the address is copied, then released.
        let st = unsafe { (lib.worker_get_address)(worker, &mut addr, &mut addr_len) };
        if st != sys::UCS_OK {
            // SAFETY: made above.
            unsafe {
                (lib.worker_destroy)(worker);
                (lib.cleanup)(context);
            }
            return Err(failed("worker address", lib, st));
        }
        // SAFETY: UCX returned addr_len bytes at addr.
        let worker_addr = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), addr_len) }.to_vec();
        // SAFETY: released once, after the copy.
        unsafe { (lib.worker_release_address)(worker, addr) };
        let inner = Arc::new(Inner {
            lib,
            context,
            worker,
            state: Mutex::new(State { eps: HashMap::new(), attachments: HashMap::new(), pending: Vec::new() }),
            regions: RwLock::new(HashMap::new()),
            completions: Completions::default(),
            next_id: AtomicU64::new(1),
            shutdown: AtomicBool::new(false),
            endpoint: PeerAddr::Ucx { worker: to_hex(&worker_addr), notify },
            puts: AtomicU64::new(0),
            put_bytes: AtomicU64::new(0),
            write_weight: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
        });
        let runner = Arc::clone(&inner);
        let progress = std::thread::Builder::new()
            .name("ucx-progress".into())
            .spawn(move || progress_loop(&runner))
            .map_err(|e| TransportError::io("spawn ucx progress thread", e))?;
        tracing::debug!(endpoint = %inner.endpoint, worker_address_bytes = addr_len, tls = ?opts.ucx.tls, "ucx transport open");
        Ok(UcxTransport { inner, peer_errors: peer_errors(opts.ucx.tls.as_deref()), direct: opts.direct, notices, progress: Some(progress) })
    }

    /// Puts issued so far and their bytes: the message sizes UCX saw, for
    /// comparing with `ucx_perftest` at the same size.
    pub fn put_stats(&self) -> (u64, u64) {
        (self.inner.puts.load(Ordering::Relaxed), self.inner.put_bytes.load(Ordering::Relaxed))
    }

    /// Pieces and bytes stored so far through peer regions that UCX mapped
    /// into this process ([`UcxOptions::direct`]) rather than put.
    pub fn stored_stats(&self) -> (u64, u64) {
        (self.inner.stored.load(Ordering::Relaxed), self.inner.stored_bytes.load(Ordering::Relaxed))
    }

    /// The byte-weighted mean size of the writes (puts and stores) so far (the
    /// size of the write that carries a typical byte): sum of len^2 over sum of len.
    pub fn weighted_write_size(&self) -> u64 {
        let bytes = (self.inner.put_bytes.load(Ordering::Relaxed) + self.inner.stored_bytes.load(Ordering::Relaxed)).max(1) as u128;
        (self.inner.write_weight.load(Ordering::Relaxed) as u128 * 1024 / bytes) as u64
    }

    fn wake(&self) {
        if let Some(h) = &self.progress {
            h.thread().unpark();
        }
    }

    fn local(&self, handle: &RegionHandle) -> Result<Arc<Region>> {
        if handle.peer != self.inner.endpoint {
            return Err(TransportError::ForeignHandle { handle: handle.to_string(), owner: handle.peer.to_string(), transport: "ucx" });
        }
        read(&self.inner.regions).get(&handle.id).cloned().ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }

    /// A batch into a mapped peer region: the pieces stored by this thread
    /// (and rayon's, for a large batch), as the shm transport copies, with no
    /// UCX call and no message per piece; then the peer's liveness decides.
    fn store(&self, src: &Region, dst: &Mapped, descriptors: &[Descriptor], link: &Link, peer: String) -> BatchId {
        let batch = self.inner.completions.begin();
        if let Some(why) = link.dead() {
            self.inner.completions.finish(batch, Err(peer_gone(peer, &why)));
            return batch;
        }
        let pieces = pieces(descriptors);
        {
            let _s = read(&src.lock);
            let _d = lock(&dst.lock);
            // SAFETY: the source region's mapping, alive while the caller holds
            // its Arc, read under its lock; the peer's mapping, alive while its
            // rkey is (see `Mapped`), written under its lock. The descriptors were
            // validated against both lengths.
            let (s, d) = unsafe { (std::slice::from_raw_parts(src.ptr, src.len as usize), std::slice::from_raw_parts_mut(dst.ptr, dst.len as usize)) };
            copy_batches(&[s], &mut [d], &[Batch { src: 0, dst: 0, descriptors }]);
        }
        self.inner.stored.fetch_add(pieces.len() as u64, Ordering::Relaxed);
        self.inner.stored_bytes.fetch_add(pieces.iter().map(|p| p.len).sum(), Ordering::Relaxed);
        self.inner.write_weight.fetch_add(pieces.iter().map(|p| p.len.saturating_mul(p.len) / 1024).sum(), Ordering::Relaxed);
        // A peer that died while its bytes were stored has them in memory no
        // one reads: the batch fails rather than report them delivered.
        let result = match link.dead() {
            None => Ok(()),
            Some(why) => Err(peer_gone(peer, &why)),
        };
        self.inner.completions.finish(batch, result);
        batch
    }
}

/// A batch's failure when the peer's notice link closed: its process ended
/// (or shut its transport down), so what the batch wrote is not delivered.
fn peer_gone(peer: String, why: &str) -> TransportError {
    TransportError::Disconnected { peer, reason: format!("the peer's notice link closed ({why}): its process is gone, the batch undelivered") }
}

/// Where UCX mapped the peer's region into this process (its lanes to the
/// peer are shared memory), from `ucp_rkey_ptr` of the region's first byte.
/// `None` where it did not (network lanes). UCX checks no bounds there (a
/// handle claiming a terabyte got a pointer for every byte, measured): the
/// caller checks the length against the mapping ([`mapped_bytes_from`]).
fn mapped_at(lib: &Lib, rkey: sys::RKey, addr: u64) -> Option<usize> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: an unpacked rkey; UCX writes a pointer or returns an error.
    let st = unsafe { (lib.rkey_ptr)(rkey, addr, &mut p) };
    (st == sys::UCS_OK && !p.is_null()).then_some(p as usize)
}

/// The bytes from `at` to the end of the memory mapping that holds it, from
/// `/proc/self/maps` (one mapping: a peer's shared-memory segment is one; an
/// adjacent mapping of something else does not count). `None` where `at` is in
/// no mapping or the file cannot be read.
fn mapped_bytes_from(at: usize) -> Option<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let (start, end) = line.split_whitespace().next()?.split_once('-')?;
        let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
        (start <= at && at < end).then(|| (end - at) as u64)
    })
}

/// UCX's call when an endpoint's peer failed: the failure itself reaches the
/// batches through their flush's status; this only records it.
unsafe extern "C" fn peer_failed(_arg: *mut c_void, _ep: sys::Ep, status: sys::UcsStatus) {
    tracing::warn!(status, "ucx: a peer's endpoint failed");
}

/// Whether endpoints ask for peer failure handling: only where `tls` names
/// network lanes alone. UCX's shared-memory lanes have none, and asking for it
/// where they are allowed (UCX's default, `sm`) would make UCX pick its tcp
/// lanes even between processes of one host.
fn peer_errors(tls: Option<&str>) -> bool {
    tls.is_some_and(|t| {
        !t.split(',').any(|x| matches!(x.trim().trim_start_matches('^'), "all" | "sm" | "shm" | "posix" | "sysv" | "cma" | "knem" | "xpmem" | "mm" | "self"))
    })
}

/// Whether any two pieces' destinations overlap.
fn overlaps(pieces: &[crate::transport::Piece]) -> bool {
    let mut spans: Vec<(u64, u64)> = pieces.iter().map(|p| (p.dst, p.dst + p.len)).collect();
    spans.sort_unstable();
    spans.windows(2).any(|w| w[1].0 < w[0].1)
}

/// Progresses the worker: spins while flushes are pending or work is done,
/// sleeps (backing off up to 500 us) when idle; completes batches whose flush is done.
fn progress_loop(inner: &Inner) {
    let mut idle = Duration::from_micros(20);
    while !inner.shutdown.load(Ordering::Relaxed) {
        let (worked, busy) = inner.progress_once();
        if worked || busy {
            idle = Duration::from_micros(20);
            if !worked {
                std::thread::yield_now();
            }
            continue;
        }
        std::thread::park_timeout(idle);
        idle = (idle * 2).min(Duration::from_micros(500));
    }
}

impl Inner {
    /// One round of progress; (whether UCX did anything, whether a flush is pending).
    fn progress_once(&self) -> (bool, bool) {
        let mut st = lock(&self.state);
        let mut n = 0u32;
        for _ in 0..64 {
            // SAFETY: a live worker, under the state lock.
            let k = unsafe { (self.lib.worker_progress)(self.worker) };
            n += k;
            if k == 0 {
                break;
            }
        }
        let lib = self.lib;
        let mut finished = Vec::new();
        st.pending.retain(|&(batch, req, ref peer, ref link)| {
            // SAFETY: a request UCX returned and that is not freed yet.
            let s = unsafe { (lib.request_check_status)(req) };
            let dead = link.as_ref().and_then(Link::dead);
            if s == sys::UCS_INPROGRESS && dead.is_none() {
                return true;
            }
            // SAFETY: freed once; one still in progress (its peer gone, and UCX
            // without a word on it) is released by UCX when it ends.
            unsafe { (lib.request_free)(req) };
            let result = match dead {
                Some(why) => Err(peer_gone(peer.clone(), &why)),
                None if s == sys::UCS_OK => Ok(()),
                None => Err(TransportError::Disconnected { peer: peer.clone(), reason: format!("ucx flush: {}", lib.describe(s)) }),
            };
            finished.push((batch, result));
            false
        });
        let busy = !st.pending.is_empty();
        drop(st);
        for (batch, result) in finished {
            self.completions.finish(batch, result);
        }
        (n > 0, busy)
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.shutdown.store(true, Ordering::Relaxed);
        self.wake();
        if let Some(h) = self.progress.take() {
            let _ = h.join();
        }
        let lib = inner.lib;
        let mut st = lock(&inner.state);
        for (batch, req, peer, _) in std::mem::take(&mut st.pending) {
            // SAFETY: a pending request; UCX releases it when it ends.
            unsafe { (lib.request_free)(req) };
            inner.completions.finish(batch, Err(TransportError::Disconnected { peer, reason: "transport shut down".into() }));
        }
        for (_, a) in st.attachments.drain() {
            // SAFETY: unpacked on its endpoint, destroyed once, before the endpoint closes.
            unsafe { (lib.rkey_destroy)(a.rkey) };
        }
        let force = sys::RequestParam::with_flags(sys::UCP_EP_CLOSE_FLAG_FORCE);
        for (_, (ep, _)) in st.eps.drain() {
            // SAFETY: a live endpoint, closed once.
            let r = StatusPtr::from_raw(unsafe { (lib.ep_close_nbx)(ep, &force) });
            if let StatusPtr::Pending(req) = r {
                let deadline = Instant::now() + Duration::from_secs(2);
                // SAFETY: progress the worker until the close completes or we give up.
                while unsafe { (lib.request_check_status)(req) } == sys::UCS_INPROGRESS && Instant::now() < deadline {
                    unsafe { (lib.worker_progress)(inner.worker) };
                }
                // SAFETY: freed once.
                unsafe { (lib.request_free)(req) };
            }
        }
        drop(st);
        for (_, r) in write(&inner.regions).drain() {
            // SAFETY: mapped by this context; no one else holds the region now.
            unsafe { (lib.mem_unmap)(inner.context, r.memh) };
        }
        // SAFETY: every endpoint is closed; the worker, then the context, go last.
        unsafe {
            (lib.worker_destroy)(inner.worker);
            (lib.cleanup)(inner.context);
        }
    }
}

impl Transport for UcxTransport {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn endpoint(&self) -> PeerAddr {
        self.inner.endpoint.clone()
    }

    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle> {
        host_only(memory, "ucx")?;
        let bytes = usize_len(len)?.max(1);
        let lib = self.inner.lib;
        let params = sys::MemMapParams {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            address: std::ptr::null_mut(),
            length: bytes,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            prot: 0,
            memory_type: 0,
        };
        let mut memh: sys::MemH = std::ptr::null_mut();
        // SAFETY: a live context and valid params.
        let st = unsafe { (lib.mem_map)(self.inner.context, &params, &mut memh) };
        if st != sys::UCS_OK {
            return Err(failed(format!("ucp_mem_map of {len} B"), lib, st));
        }
        let mut attr = sys::MemAttr {
            field_mask: sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH,
            address: std::ptr::null_mut(),
            length: 0,
            mem_type: 0,
        };
        // SAFETY: a handle just mapped.
        let st = unsafe { (lib.mem_query)(memh, &mut attr) };
        if st != sys::UCS_OK || attr.address.is_null() || attr.length < bytes {
            // SAFETY: unmapped once.
            unsafe { (lib.mem_unmap)(self.inner.context, memh) };
            return Err(failed("ucp_mem_query", lib, if st == sys::UCS_OK { -1 } else { st }));
        }
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut buf_len = 0usize;
        // SAFETY: a live context and handle; the buffer is copied, then released.
        let st = unsafe { (lib.rkey_pack)(self.inner.context, memh, &mut buf, &mut buf_len) };
        if st != sys::UCS_OK {
            // SAFETY: unmapped once.
            unsafe { (lib.mem_unmap)(self.inner.context, memh) };
            return Err(failed("ucp_rkey_pack", lib, st));
        }
        // SAFETY: UCX returned buf_len bytes at buf.
        let rkey = to_hex(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), buf_len) });
        // SAFETY: released once, after the copy.
        unsafe { (lib.rkey_buffer_release)(buf) };
        let ptr = attr.address.cast::<u8>();
        // Zeroed, as every transport's regions are (UCX's allocation may be
        // recycled memory).
        // SAFETY: `bytes` bytes at ptr belong to this mapping.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let region = Arc::new(Region { len, ptr, memh, lock: RwLock::new(()) });
        write(&self.inner.regions).insert(id, region);
        Ok(RegionHandle { peer: self.endpoint(), id, rank, kind, len, memory, ipc: None, remote_key: Some(RemoteKey { addr: ptr as u64, rkey }) })
    }

    fn unregister(&self, handle: &RegionHandle) -> Result<()> {
        self.local(handle)?;
        let Some(r) = write(&self.inner.regions).remove(&handle.id) else {
            return Err(TransportError::UnknownRegion(handle.to_string()));
        };
        // Wait out this process's own users of the bytes.
        let _g = write(&r.lock);
        // SAFETY: mapped by this context, removed from the table: unmapped once.
        unsafe { (self.inner.lib.mem_unmap)(self.inner.context, r.memh) };
        Ok(())
    }

    /// Where UCX mapped the peer's region here (its shared-memory lanes, with
    /// [`super::UcxOptions::direct`]): submit stores into it.
    fn writes_in_place(&self, dst: RemoteRegion) -> bool {
        lock(&self.inner.state).attachments.get(&dst.id).is_some_and(|a| a.mapped.is_some())
    }

    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion> {
        let PeerAddr::Ucx { worker, .. } = &handle.peer else {
            return Err(TransportError::ForeignHandle { handle: handle.to_string(), owner: handle.peer.to_string(), transport: "ucx" });
        };
        host_only(handle.memory, "ucx")?;
        let bad = |what: &str| TransportError::Protocol { peer: handle.peer.to_string(), message: format!("region handle {handle}: {what}") };
        let key = handle.remote_key.as_ref().ok_or_else(|| bad("no remote key"))?;
        let address = from_hex(worker).ok_or_else(|| bad("worker address is not hex"))?;
        let rkey_buf = from_hex(&key.rkey).ok_or_else(|| bad("remote key is not hex"))?;
        if address.is_empty() || rkey_buf.is_empty() {
            return Err(bad("empty worker address or remote key"));
        }
        let PeerAddr::Ucx { notify, .. } = &handle.peer else { unreachable!("matched above") };
        // Before the state lock: it may connect (and shake hands) with the peer.
        let link = self.notices.link(*notify)?;
        let lib = self.inner.lib;
        let mut st = lock(&self.inner.state);
        let (ep, ucx_reports) = match st.eps.get(&address) {
            Some(&made) => made,
            None => {
                // Peer error handling on network lanes (a dead peer fails a
                // batch), see `peer_errors`.
                let mut made = Err(0);
                let peer_mode = (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER, sys::UCP_ERR_HANDLING_MODE_PEER);
                let modes: &[(u64, i32)] = if self.peer_errors { &[peer_mode, (0, 0)] } else { &[(0, 0)] };
                for &(mask, mode) in modes {
                    let params = sys::EpParams {
                        field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | mask,
                        address: address.as_ptr().cast(),
                        err_mode: mode,
                        err_handler: Some(peer_failed),
                        err_arg: std::ptr::null_mut(),
                        rest: [0; 64],
                    };
                    let mut ep: sys::Ep = std::ptr::null_mut();
                    // SAFETY: a live worker, under the lock; the address outlives the call.
                    let s = unsafe { (lib.ep_create)(self.inner.worker, &params, &mut ep) };
                    made = if s == sys::UCS_OK { Ok((ep, mode == sys::UCP_ERR_HANDLING_MODE_PEER)) } else { Err(s) };
                    if made.is_ok() {
                        break;
                    }
                }
                let made =
                    made.map_err(|s| TransportError::Disconnected { peer: handle.peer.to_string(), reason: format!("ucp_ep_create: {}", lib.describe(s)) })?;
                st.eps.insert(address, made);
                made
            }
        };
        let mut rkey: sys::RKey = std::ptr::null_mut();
        // SAFETY: a live endpoint and the peer's packed key.
        let s = unsafe { (lib.ep_rkey_unpack)(ep, rkey_buf.as_ptr().cast(), &mut rkey) };
        if s != sys::UCS_OK {
            return Err(bad(&format!("ucp_ep_rkey_unpack: {}", lib.describe(s))));
        }
        // Where UCX mapped the peer's region here, the handle's length must lie
        // inside that mapping: a put over these lanes is a memcpy into it, and
        // UCX checks no bounds, so a handle claiming more would have puts (or
        // stores) write past it.
        let mapped = match mapped_at(lib, rkey, key.addr) {
            None => None,
            Some(ptr) => {
                let room = mapped_bytes_from(ptr);
                if room.is_none_or(|room| room < handle.len) {
                    // SAFETY: unpacked above, destroyed once; never stored.
                    unsafe { (lib.rkey_destroy)(rkey) };
                    let room = room.map_or("no".to_string(), |r| format!("{r} B of"));
                    return Err(bad(&format!("claims {} B, but UCX maps {room} it here", handle.len)));
                }
                self.direct.then(|| Arc::new(Mapped { ptr: ptr as *mut u8, len: handle.len, lock: Mutex::new(()) }))
            }
        };
        tracing::debug!(peer = %handle.peer, region = handle.id, mapped = mapped.is_some(), "ucx: attached");
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let peer = handle.peer.to_string();
        st.attachments.insert(id, Attachment { ep, rkey, addr: key.addr, kind: handle.kind, len: handle.len, peer, mapped, link, ucx_reports });
        Ok(RemoteRegion { id, kind: handle.kind, len: handle.len })
    }

    fn detach(&self, remote: RemoteRegion) {
        let removed = lock(&self.inner.state).attachments.remove(&remote.id);
        if let Some(a) = removed {
            // A batch storing through the mapping finishes before the mapping goes.
            let _stores = a.mapped.as_ref().map(|m| lock(&m.lock));
            // SAFETY: unpacked by attach, destroyed once; no store uses its mapping.
            unsafe { (self.inner.lib.rkey_destroy)(a.rkey) };
        }
    }

    fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let r = self.local(handle)?;
        let _g = read(&r.lock);
        // SAFETY: the region's mapping, alive while the Arc is held.
        f(unsafe { std::slice::from_raw_parts(r.ptr, r.len as usize) });
        Ok(())
    }

    fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        let r = self.local(handle)?;
        let _g = write(&r.lock);
        // SAFETY: as above, exclusive under the write lock.
        f(unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len as usize) });
        Ok(())
    }

    fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId> {
        let s = self.local(src)?;
        let lib = self.inner.lib;
        let mut st = lock(&self.inner.state);
        let a = st.attachments.get(&dst.id).ok_or_else(|| TransportError::UnknownRegion(format!("attachment {}", dst.id)))?;
        validate(descriptors, Some(s.len), a.len, a.kind)?;
        if let Some(m) = a.mapped.clone() {
            let (link, peer) = (a.link.clone(), a.peer.clone());
            drop(st);
            return Ok(self.store(&s, &m, descriptors, &link, peer));
        }
        let (ep, rkey, base, peer) = (a.ep, a.rkey, a.addr, a.peer.clone());
        let link = (!a.ucx_reports).then(|| a.link.clone());
        let batch = self.inner.completions.begin();
        let param = sys::RequestParam::none();
        let (mut n, mut bytes, mut weight) = (0u64, 0u64, 0u64);
        let _g = read(&s.lock);
        let pieces = pieces(descriptors);
        // UCX orders no two puts; a batch whose destinations overlap must still
        // land as the descriptor loop would, so a fence goes between its puts.
        let fence = overlaps(&pieces);
        for (i, p) in pieces.into_iter().enumerate() {
            if fence && i > 0 {
                // SAFETY: a live worker, under the lock.
                unsafe { (lib.worker_fence)(self.inner.worker) };
            }
            // SAFETY: validated against both regions: src bytes lie in the source
            // mapping and the destination range in the peer's region.
            let r = unsafe { (lib.put_nbx)(ep, s.ptr.add(p.src as usize).cast(), p.len as usize, base + p.dst, rkey, &param) };
            match StatusPtr::from_raw(r) {
                StatusPtr::Done => {}
                // SAFETY: a request of ours; UCX completes it and then releases it.
                StatusPtr::Pending(req) => unsafe { (lib.request_free)(req) },
                StatusPtr::Failed(code) => {
                    drop(st);
                    let e = TransportError::Disconnected { peer, reason: format!("ucp_put_nbx: {}", lib.describe(code)) };
                    self.inner.completions.finish(batch, Err(e.clone()));
                    return Ok(batch);
                }
            }
            n += 1;
            bytes += p.len;
            weight += p.len.saturating_mul(p.len) / 1024;
        }
        self.inner.puts.fetch_add(n, Ordering::Relaxed);
        self.inner.put_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.inner.write_weight.fetch_add(weight, Ordering::Relaxed);
        // SAFETY: a live endpoint, under the lock.
        let r = unsafe { (lib.ep_flush_nbx)(ep, &param) };
        match StatusPtr::from_raw(r) {
            StatusPtr::Done => {
                drop(st);
                // Shared-memory lanes complete at once and say nothing of a dead peer.
                let result = match link.as_ref().and_then(Link::dead) {
                    None => Ok(()),
                    Some(why) => Err(peer_gone(peer, &why)),
                };
                self.inner.completions.finish(batch, result);
            }
            StatusPtr::Pending(req) => {
                st.pending.push((batch, req, peer, link));
                drop(st);
                self.wake();
            }
            StatusPtr::Failed(code) => {
                drop(st);
                self.inner.completions.finish(batch, Err(TransportError::Disconnected { peer, reason: format!("ucx flush: {}", lib.describe(code)) }));
            }
        }
        Ok(batch)
    }

    fn poll(&self) -> Vec<BatchCompletion> {
        self.inner.completions.poll()
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        self.inner.completions.wait(batch, timeout)
    }

    fn notify(&self, peer: &PeerAddr, bytes: &[u8]) -> Result<()> {
        let PeerAddr::Ucx { notify, .. } = peer else {
            return Err(TransportError::Unavailable { what: format!("peer {peer}"), reason: "not a ucx endpoint".into() });
        };
        self.notices.notify(&PeerAddr::Tcp { addr: *notify }, bytes)
    }

    /// The notices, without their sender: the notice listener knows the
    /// sender's tcp endpoint, not its ucx one.
    fn recv_notifications(&self) -> Vec<Notification> {
        self.notices.recv_notifications().into_iter().map(|n| Notification { from: None, bytes: n.bytes }).collect()
    }

    fn take_incidents(&self) -> Vec<Incident> {
        self.notices.take_incidents()
    }

    fn unauthenticated(&self) -> u64 {
        self.notices.unauthenticated()
    }

    fn refused_frames(&self) -> u64 {
        self.notices.refused_frames()
    }
}
