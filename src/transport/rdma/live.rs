//! The verbs transport: regions registered in MR chunks, one RC queue pair per
//! (producer, consumer) pair, RDMA WRITEs with the batch's last WITH IMMEDIATE,
//! and the exchange over an authenticated tcp bootstrap ([`super::wire`]).

use super::ffi;
use super::options::{RdmaError, RdmaOptions};
use super::plan::{self, MrChunk, WrLimits};
use super::qp::{self, QpInfo};
use super::verbs::{Device, Mr, Qp};
use super::wire::{self, Ask, Control, Message, RegionKeys, Reply};
use crate::transport::host::Mem;
use crate::transport::{
    BatchCompletion, BatchId, Completions, Incident, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, TcpTransport, Transport,
    TransportError, TransportExt, host_only, lock, pieces, read, usize_len, validate, write,
};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A local region: its memory and its registrations (dropped first: fields
/// drop in order, so the MRs go before the mapping they cover).
struct Region {
    _mrs: Vec<Mr>,
    /// The MR chunks with their lkeys (local use) and rkeys (what peers get).
    lkeys: Vec<MrChunk>,
    rkeys: Vec<MrChunk>,
    kind: RegionKind,
    len: u64,
    mem: RwLock<Mem>,
}

struct Attachment {
    addr: SocketAddr,
    keys: RegionKeys,
}

/// One round of posted work requests on a producer's queue pair.
struct Round {
    wr_id: u64,
    n: u32,
    batch: BatchId,
    /// The batch's write sequence number when this round ends the batch.
    ends: Option<u32>,
}

struct OutState {
    credits: u32,
    inflight: VecDeque<Round>,
    /// The last write sequence number posted, and the last completed.
    posted: u32,
    done: u32,
    dead: Option<String>,
}

/// A producer's queue pair to one consumer.
struct OutConn {
    addr: SocketAddr,
    qp: Qp,
    /// Held through the posting of a whole batch, so batches go out in
    /// sequence-number order.
    send: Mutex<()>,
    state: Mutex<OutState>,
    cv: Condvar,
}

struct InState {
    landed: u32,
    /// Notices from this producer waiting for their fence to land, in order.
    held: VecDeque<(u32, Notification)>,
    dead: bool,
}

/// A consumer's queue pair from one producer.
struct InConn {
    addr: SocketAddr,
    qp: Qp,
    state: Mutex<InState>,
}

struct Inner {
    dev: Arc<Device>,
    opts: RdmaOptions,
    boot: TcpTransport,
    endpoint: PeerAddr,
    shutdown: AtomicBool,
    next_id: AtomicU64,
    regions: RwLock<HashMap<u64, Arc<Region>>>,
    attachments: RwLock<HashMap<u64, Attachment>>,
    out: Mutex<HashMap<SocketAddr, Arc<OutConn>>>,
    inbound: Mutex<HashMap<SocketAddr, Arc<InConn>>>,
    replies: Mutex<HashMap<u64, Option<Control>>>,
    replied: Condvar,
    completions: Completions,
    inbox: Mutex<Vec<Notification>>,
    incidents: Mutex<Vec<Incident>>,
}

/// The ibverbs transport (built with the `rdma` feature).
pub struct RdmaTransport {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

fn unavailable(what: impl Into<String>, reason: impl Into<String>) -> TransportError {
    TransportError::Unavailable { what: what.into(), reason: reason.into() }
}

/// Why this end refuses a peer's CONNECT or KEYS_REQUEST; its text goes back
/// as the REFUSE's reason.
#[derive(Debug, thiserror::Error)]
enum RefuseReason {
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Peer(#[from] qp::QpInfoError),
    #[error("no region {region} here")]
    NoRegion { region: u64 },
}

fn random_u64() -> Result<u64> {
    let b = crate::transport::auth::random_bytes::<8>().map_err(|e| TransportError::io("random token", e))?;
    Ok(u64::from_le_bytes(b))
}

impl RdmaTransport {
    /// Opens the device and the bootstrap listener, and starts the exchange
    /// and completion threads.
    pub fn open_with(opts: RdmaOptions) -> std::result::Result<Self, RdmaError> {
        plan::mr_chunks(0, opts.mr_chunk).map_err(|e| RdmaError::Options(e.to_string()))?;
        if opts.sq_depth == 0 || opts.rq_depth == 0 || opts.max_sge == 0 {
            return Err(RdmaError::Options("sq_depth, rq_depth and max_sge must be at least 1".into()));
        }
        let dev = Device::open(&opts)?;
        let boot = TcpTransport::bind(opts.bootstrap.clone()).map_err(RdmaError::Bootstrap)?;
        let endpoint = PeerAddr::Rdma { addr: boot.addr() };
        let inner = Arc::new(Inner {
            dev,
            opts,
            boot,
            endpoint,
            shutdown: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            regions: RwLock::new(HashMap::new()),
            attachments: RwLock::new(HashMap::new()),
            out: Mutex::new(HashMap::new()),
            inbound: Mutex::new(HashMap::new()),
            replies: Mutex::new(HashMap::new()),
            replied: Condvar::new(),
            completions: Completions::default(),
            inbox: Mutex::new(Vec::new()),
            incidents: Mutex::new(Vec::new()),
        });
        let mut threads = Vec::new();
        for (name, f) in [("rdma-exchange", exchange_loop as fn(&Inner)), ("rdma-cq", completion_loop)] {
            let me = Arc::clone(&inner);
            let h = std::thread::Builder::new().name(name.into()).spawn(move || f(&me)).map_err(|e| RdmaError::Bootstrap(TransportError::io("spawn", e)))?;
            threads.push(h);
        }
        Ok(RdmaTransport { inner, threads })
    }

    /// The verbs device in use.
    pub fn device(&self) -> &str {
        &self.inner.dev.name
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Inner {
    fn send(&self, addr: SocketAddr, m: &Message) -> Result<()> {
        self.boot.notify(&PeerAddr::Tcp { addr }, &wire::encode(m))
    }

    /// Sends `control` to `addr` and waits for the reply that answers it.
    fn ask(&self, addr: SocketAddr, control: Control, request: Ask) -> Result<Reply> {
        let token = random_u64()?;
        lock(&self.replies).insert(token, None);
        let sent = self.send(addr, &Message::Control { token, control });
        let deadline = Instant::now() + self.opts.reply_timeout;
        let mut replies = lock(&self.replies);
        let got = loop {
            if sent.is_err() {
                break None;
            }
            if let Some(Some(_)) = replies.get(&token) {
                break replies.remove(&token).flatten();
            }
            let now = Instant::now();
            if now >= deadline {
                break None;
            }
            replies = match self.replied.wait_timeout(replies, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        replies.remove(&token);
        drop(replies);
        sent?;
        let control =
            got.ok_or_else(|| TransportError::Timeout { what: format!("the rdma exchange with {addr} ({request:?})"), after: self.opts.reply_timeout })?;
        Reply::answers(request, control).map_err(|e| TransportError::Protocol { peer: format!("rdma:{addr}"), message: e.to_string() })
    }

    fn local_info(&self, qp: &Qp, psn: u32) -> QpInfo {
        let p = self.dev.port;
        QpInfo { qpn: qp.qpn(), psn, lid: p.lid, gid: p.gid, mtu: p.mtu, link: p.link }
    }

    /// The live queue pair to the consumer at `addr`, connecting if needed.
    fn out_conn(&self, addr: SocketAddr) -> Result<Arc<OutConn>> {
        let mut out = lock(&self.out);
        if let Some(c) = out.get(&addr)
            && lock(&c.state).dead.is_none()
        {
            return Ok(Arc::clone(c));
        }
        let qp = self.dev.queue_pair(self.opts.sq_depth, 1, self.opts.max_sge)?;
        let psn = (random_u64()? as u32) & qp::MAX_QPN;
        let peer = match self.ask(addr, Control::Connect(self.local_info(&qp, psn)), Ask::Connect)? {
            Reply::Accept(q) => q,
            Reply::Keys(_) => unreachable!("answers() pairs CONNECT with ACCEPT"),
        };
        let rtr = qp::to_rtr(&self.dev.port, &peer).map_err(|e| TransportError::Protocol { peer: format!("rdma:{addr}"), message: e.to_string() })?;
        qp.modify(&rtr)?;
        qp.modify(&qp::to_rts(psn))?;
        tracing::debug!(peer = %addr, qpn = qp.qpn(), peer_qpn = peer.qpn, "rdma queue pair connected");
        let state = OutState { credits: self.opts.sq_depth, inflight: VecDeque::new(), posted: 0, done: 0, dead: None };
        let c = Arc::new(OutConn { addr, qp, send: Mutex::new(()), state: Mutex::new(state), cv: Condvar::new() });
        out.insert(addr, Arc::clone(&c));
        Ok(c)
    }

    /// A producer's CONNECT: a queue pair towards it, in RTR (and RTS) before
    /// the ACCEPT goes back, with its receive queue full.
    fn accept(&self, addr: SocketAddr, peer: &QpInfo) -> std::result::Result<QpInfo, RefuseReason> {
        let qp = self.dev.queue_pair(1, self.opts.rq_depth, 1)?;
        qp.post_receives(self.opts.rq_depth)?;
        let rtr = qp::to_rtr(&self.dev.port, peer)?;
        qp.modify(&rtr)?;
        let psn = (random_u64()? as u32) & qp::MAX_QPN;
        qp.modify(&qp::to_rts(psn))?;
        let info = self.local_info(&qp, psn);
        let c = Arc::new(InConn { addr, qp, state: Mutex::new(InState { landed: 0, held: VecDeque::new(), dead: false }) });
        // A producer that connects again (restarted) replaces its old queue pair.
        if let Some(old) = lock(&self.inbound).insert(addr, c) {
            self.release(&old, true);
        }
        Ok(info)
    }

    fn keys(&self, region: u64) -> std::result::Result<RegionKeys, RefuseReason> {
        let r = read(&self.regions).get(&region).cloned().ok_or(RefuseReason::NoRegion { region })?;
        Ok(RegionKeys { region, kind: r.kind, len: r.len, chunks: r.rkeys.clone() })
    }

    /// Delivers what `c` holds that has landed (everything when `all`).
    fn release(&self, c: &InConn, all: bool) {
        let mut s = lock(&c.state);
        let mut ready = Vec::new();
        while let Some((fence, _)) = s.held.front() {
            if !all && !wire::reached(s.landed, *fence) {
                break;
            }
            ready.extend(s.held.pop_front().map(|(_, n)| n));
        }
        drop(s);
        if !ready.is_empty() {
            lock(&self.inbox).extend(ready);
        }
    }

    fn on_message(&self, from: Option<PeerAddr>, bytes: &[u8]) {
        let Some(PeerAddr::Tcp { addr }) = from else {
            tracing::warn!("rdma exchange message without a sender: dropped");
            return;
        };
        let m = match wire::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(peer = %addr, error = %e, "rdma exchange message refused");
                lock(&self.incidents).push(Incident {
                    peer: Some(PeerAddr::Rdma { addr }),
                    error: TransportError::Protocol { peer: format!("rdma:{addr}"), message: e.to_string() },
                });
                return;
            }
        };
        match m {
            Message::Notice { fence, bytes } => {
                let n = Notification { from: Some(PeerAddr::Rdma { addr }), bytes };
                let conn = lock(&self.inbound).get(&addr).cloned();
                match conn {
                    Some(c) => {
                        let mut s = lock(&c.state);
                        if s.dead || (s.held.is_empty() && wire::reached(s.landed, fence)) {
                            drop(s);
                            lock(&self.inbox).push(n);
                        } else {
                            s.held.push_back((fence, n));
                        }
                    }
                    None => {
                        if fence != 0 {
                            tracing::warn!(peer = %addr, fence, "notice fenced on writes over a queue pair this end does not hold: delivered as is");
                        }
                        lock(&self.inbox).push(n);
                    }
                }
            }
            Message::Control { token, control } => {
                let reply = match control {
                    Control::Connect(q) => Some(self.accept(addr, &q).map_or_else(|e| Control::Refuse(e.to_string()), Control::Accept)),
                    Control::KeysRequest { region } => Some(self.keys(region).map_or_else(|e| Control::Refuse(e.to_string()), Control::Keys)),
                    answer => {
                        let mut replies = lock(&self.replies);
                        match replies.get_mut(&token) {
                            Some(slot @ None) => {
                                *slot = Some(answer);
                                self.replied.notify_all();
                            }
                            _ => tracing::debug!(peer = %addr, token, "rdma exchange reply to no pending request: dropped"),
                        }
                        None
                    }
                };
                if let Some(reply) = reply
                    && let Err(e) = self.send(addr, &Message::Control { token, control: reply })
                {
                    tracing::warn!(peer = %addr, error = %e, "rdma exchange reply not sent");
                }
            }
        }
    }

    /// A producer's send completion.
    fn on_send(&self, c: &OutConn, wc: &ffi::ibv_wc) {
        let mut s = lock(&c.state);
        if wc.status != ffi::IBV_WC_SUCCESS {
            let why = format!("work completion {} (vendor error {:#x})", ffi::wc_status_name(wc.status), wc.vendor_err);
            if s.dead.is_none() {
                tracing::warn!(peer = %c.addr, reason = %why, "rdma queue pair failed");
                s.dead = Some(why.clone());
            }
            let failed: Vec<BatchId> = s.inflight.drain(..).map(|r| r.batch).collect();
            c.cv.notify_all();
            drop(s);
            let mut seen = std::collections::HashSet::new();
            for b in failed.into_iter().filter(|b| seen.insert(*b)) {
                self.completions.finish(b, Err(TransportError::Disconnected { peer: format!("rdma:{}", c.addr), reason: why.clone() }));
            }
            return;
        }
        let Some(round) = s.inflight.pop_front() else { return };
        if round.wr_id != wc.wr_id {
            tracing::warn!(want = round.wr_id, got = wc.wr_id, "rdma send completions out of order");
        }
        s.credits += round.n;
        if let Some(seq) = round.ends {
            s.done = seq;
        }
        c.cv.notify_all();
        drop(s);
        if round.ends.is_some() {
            self.completions.finish(round.batch, Ok(()));
        }
    }

    /// A consumer's receive completion: a write with immediate landed.
    fn on_recv(&self, c: &InConn, wc: &ffi::ibv_wc) {
        if wc.status != ffi::IBV_WC_SUCCESS {
            let mut s = lock(&c.state);
            if !s.dead {
                s.dead = true;
                drop(s);
                let why = format!("work completion {} (vendor error {:#x})", ffi::wc_status_name(wc.status), wc.vendor_err);
                lock(&self.incidents).push(Incident {
                    peer: Some(PeerAddr::Rdma { addr: c.addr }),
                    error: TransportError::Disconnected { peer: format!("rdma:{}", c.addr), reason: why },
                });
            }
            return;
        }
        if wc.opcode == ffi::IBV_WC_RECV_RDMA_WITH_IMM && wc.wc_flags & ffi::IBV_WC_WITH_IMM != 0 {
            let seq = u32::from_be(wc.imm_data);
            lock(&c.state).landed = seq;
            tracing::trace!(peer = %c.addr, seq, "rdma write with immediate landed");
            if let Err(e) = c.qp.post_receives(1) {
                tracing::warn!(peer = %c.addr, error = %e, "rdma receive not reposted");
            }
            self.release(c, false);
        }
    }
}

fn exchange_loop(inner: &Inner) {
    while !inner.shutdown.load(Ordering::Relaxed) {
        for n in inner.boot.wait_notifications(Duration::from_millis(20)) {
            inner.on_message(n.from, &n.bytes);
        }
    }
}

fn completion_loop(inner: &Inner) {
    let mut wc = [ffi::ibv_wc::default(); 32];
    let mut pause = Duration::from_micros(5);
    while !inner.shutdown.load(Ordering::Relaxed) {
        let mut any = false;
        let outs: Vec<Arc<OutConn>> = lock(&inner.out).values().cloned().collect();
        for c in &outs {
            match c.qp.poll(&mut wc) {
                Ok(n) => {
                    any |= n > 0;
                    for w in &wc[..n] {
                        inner.on_send(c, w);
                    }
                }
                Err(e) => tracing::warn!(peer = %c.addr, error = %e, "rdma completion queue"),
            }
        }
        let ins: Vec<Arc<InConn>> = lock(&inner.inbound).values().cloned().collect();
        for c in &ins {
            match c.qp.poll(&mut wc) {
                Ok(n) => {
                    any |= n > 0;
                    for w in &wc[..n] {
                        inner.on_recv(c, w);
                    }
                }
                Err(e) => tracing::warn!(peer = %c.addr, error = %e, "rdma completion queue"),
            }
        }
        if any {
            pause = Duration::from_micros(5);
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn endpoint(&self) -> PeerAddr {
        self.inner.endpoint.clone()
    }

    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle> {
        host_only(memory, "rdma")?;
        let n = usize_len(len)?;
        let mut mem = if n == 0 { Mem::Heap(Vec::new()) } else { Mem::Map(memmap2::MmapMut::map_anon(n).map_err(|e| TransportError::io("map region", e))?) };
        let base = mem.bytes_mut().as_mut_ptr();
        let (mut mrs, mut lkeys, mut rkeys) = (Vec::new(), Vec::new(), Vec::new());
        for (offset, l) in plan::mr_chunks(len, self.inner.opts.mr_chunk).map_err(|e| unavailable("rdma region", e.to_string()))? {
            // SAFETY: `offset + l <= len`, inside the mapping, which lives as long as the MRs.
            let at = unsafe { base.add(offset as usize) };
            let mr = self.inner.dev.register(at, l)?;
            lkeys.push(MrChunk { offset, len: l, addr: at as u64, key: mr.lkey() });
            rkeys.push(MrChunk { offset, len: l, addr: at as u64, key: mr.rkey() });
            mrs.push(mr);
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        write(&self.inner.regions).insert(id, Arc::new(Region { _mrs: mrs, lkeys, rkeys, kind, len, mem: RwLock::new(mem) }));
        Ok(RegionHandle { peer: self.endpoint(), id, rank, kind, len, memory, ipc: None, remote_key: None })
    }

    fn unregister(&self, handle: &RegionHandle) -> Result<()> {
        self.local(handle)?;
        write(&self.inner.regions).remove(&handle.id).map(drop).ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }

    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion> {
        let PeerAddr::Rdma { addr } = handle.peer else {
            return Err(unavailable(format!("peer {}", handle.peer), "the rdma transport reaches only rdma endpoints"));
        };
        host_only(handle.memory, "rdma")?;
        // Connect now, so that an unreachable peer fails at attach, not mid-plan.
        self.inner.out_conn(addr)?;
        let keys =
            match self.inner.ask(addr, Control::KeysRequest { region: handle.id }, Ask::Keys { region: handle.id, kind: handle.kind, len: handle.len })? {
                Reply::Keys(k) => k,
                Reply::Accept(_) => unreachable!("answers() pairs KEYS_REQUEST with KEYS"),
            };
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        write(&self.inner.attachments).insert(id, Attachment { addr, keys });
        Ok(RemoteRegion { id, kind: handle.kind, len: handle.len })
    }

    fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let r = self.local(handle)?;
        f(read(&r.mem).bytes());
        Ok(())
    }

    fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        let r = self.local(handle)?;
        f(write(&r.mem).bytes_mut());
        Ok(())
    }

    fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId> {
        let inner = &self.inner;
        let s = self.local(src)?;
        let (addr, keys) = {
            let atts = read(&inner.attachments);
            let a = atts.get(&dst.id).ok_or_else(|| TransportError::UnknownRegion(format!("attachment {}", dst.id)))?;
            (a.addr, a.keys.chunks.clone())
        };
        validate(descriptors, Some(s.len), dst.len, dst.kind)?;
        let c = inner.out_conn(addr)?;
        let limits = WrLimits { max_sge: inner.opts.max_sge, max_wr_bytes: inner.dev.max_msg.min(plan::MAX_MR_CHUNK) };
        let _order = lock(&c.send);
        let seq = wire::next_seq(lock(&c.state).posted);
        let wrs = plan::work_requests(&pieces(descriptors), &s.lkeys, &keys, limits, seq).map_err(|e| unavailable("rdma batch", e.to_string()))?;
        let batch = inner.completions.begin();
        let _span = tracing::trace_span!("transport.rdma.send", peer = %addr, batch = batch.0, requests = wrs.len()).entered();
        let rounds = plan::rounds(wrs.len(), inner.opts.sq_depth);
        let last = rounds.len() - 1;
        for (i, r) in rounds.into_iter().enumerate() {
            let n = r.len() as u32;
            let mut st = lock(&c.state);
            let deadline = Instant::now() + inner.opts.bootstrap.idle_timeout;
            while st.credits < n && st.dead.is_none() {
                let now = Instant::now();
                if now >= deadline {
                    drop(st);
                    inner.completions.finish(
                        batch,
                        Err(TransportError::Timeout { what: format!("send queue room on rdma:{addr}"), after: inner.opts.bootstrap.idle_timeout }),
                    );
                    return Ok(batch);
                }
                st = match c.cv.wait_timeout(st, deadline - now) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
            if let Some(why) = st.dead.clone() {
                drop(st);
                lock(&inner.out).retain(|_, o| !Arc::ptr_eq(o, &c));
                if i == 0 {
                    inner.completions.cancel(batch);
                    return Err(TransportError::Disconnected { peer: format!("rdma:{addr}"), reason: why });
                }
                inner.completions.finish(batch, Err(TransportError::Disconnected { peer: format!("rdma:{addr}"), reason: why }));
                return Ok(batch);
            }
            let wr_id = batch.0 << 16 | (i as u64 & 0xffff);
            st.credits -= n;
            st.inflight.push_back(Round { wr_id, n, batch, ends: (i == last).then_some(seq) });
            if i == last {
                st.posted = seq;
            }
            // Posted under the state lock, so the completion thread cannot see
            // this round's completion before its record.
            if let Err(e) = c.qp.post_writes(&wrs[r], wr_id) {
                st.dead = Some(e.to_string());
                st.inflight.retain(|x| x.batch != batch);
                drop(st);
                lock(&inner.out).retain(|_, o| !Arc::ptr_eq(o, &c));
                if i == 0 {
                    inner.completions.cancel(batch);
                    return Err(e.into());
                }
                inner.completions.finish(batch, Err(e.into()));
                return Ok(batch);
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
        let PeerAddr::Rdma { addr } = peer else {
            return Err(unavailable(format!("peer {peer}"), "not an rdma endpoint"));
        };
        let fence = lock(&self.inner.out).get(addr).map_or(0, |c| lock(&c.state).done);
        self.inner.send(*addr, &Message::Notice { fence, bytes: bytes.to_vec() })
    }

    fn recv_notifications(&self) -> Vec<Notification> {
        std::mem::take(&mut *lock(&self.inner.inbox))
    }

    fn take_incidents(&self) -> Vec<Incident> {
        let mut v = std::mem::take(&mut *lock(&self.inner.incidents));
        v.extend(self.inner.boot.take_incidents());
        v
    }

    fn unauthenticated(&self) -> u64 {
        self.inner.boot.unauthenticated()
    }

    fn refused_frames(&self) -> u64 {
        self.inner.boot.refused_frames()
    }
}

impl RdmaTransport {
    fn local(&self, handle: &RegionHandle) -> Result<Arc<Region>> {
        if handle.peer != self.inner.endpoint {
            return Err(TransportError::ForeignHandle { handle: handle.to_string(), owner: handle.peer.to_string(), transport: "rdma" });
        }
        read(&self.inner.regions).get(&handle.id).cloned().ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }
}
