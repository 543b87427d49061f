//! TCP transport, for hosts without RDMA.
//!
//! Every `TcpTransport` listens (it can be a consumer) and connects on demand (it can
//! be a producer). A producer keeps one connection per peer address; `submit`
//! streams one WRITE frame (descriptors, then the gathered payload, through a large
//! buffered writer) and the batch completes when the consumer's ACK arrives, read
//! by a per-connection thread. The consumer checks every descriptor against its
//! region before writing, reads the payload in large chunks and scatters each chunk
//! under the region's lock, then acks (or rejects, naming the reason).
//!
//! Authentication ([`crate::transport::auth`]): the accepting side opens every
//! connection with a CHALLENGE (its fresh nonce Na); the connecting side's first
//! frame must be a HELLO carrying its endpoint, its own fresh nonce Nc and its
//! proof of the cluster secret over both nonces and the endpoint; the acceptor
//! answers with a WELCOME carrying its own proof, which the connector checks
//! before it sends anything else (an endpoint without the secret gets no WRITE).
//! A connection whose first frame is anything else, or whose proof is wrong, is
//! refused before any later frame is read (so no byte of a region is touched),
//! told why in an ACK of batch 0, closed, and counted
//! ([`TcpTransport::unauthenticated`]). A connection closed before its first
//! byte (a port probe) is not counted.
//!
//! After the handshake every frame, both ways, carries a MAC under the
//! connection's session key and its number in its direction ([`wire`] says
//! which bytes). A frame whose MAC does not hold (altered, replayed, reordered,
//! from another connection) is refused: the connection is closed, an
//! [`Incident`] with [`TransportError::Refused`] is recorded, and it is counted
//! ([`TcpTransport::refused_frames`]). A WRITE is checked before its payload
//! is read, so a refused one moves no byte.
//!
//! Failure: a connection that drops fails that connection's pending batches with
//! [`TransportError::Disconnected`]; a consumer whose producer vanishes or stalls
//! longer than [`TcpOptions::idle_timeout`] in the middle of a frame records an
//! [`Incident`] and closes the connection, so nothing waits forever.

pub mod wire;

use super::host::{HostCore, HostRegion, Mem};
use super::{
    BatchCompletion, BatchId, Completions, Incident, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport, TransportError,
    host_only, lock, read, usize_len, validate, write,
};
use crate::transport::auth::{ClusterSecret, End, Opener, Sealer};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::{HashMap, HashSet};
use std::io::{BufWriter, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Settings of a TCP transport.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Where to listen; port 0 picks one. Default 127.0.0.1:0.
    pub bind: SocketAddr,
    /// The address peers should use, when it differs from the bound one (0.0.0.0,
    /// NAT); port 0 there means the bound port.
    pub advertise: Option<SocketAddr>,
    /// How long a frame may make no progress before the connection is given up.
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
    /// SO_SNDBUF/SO_RCVBUF; `None` keeps the kernel's autotuning (usually better).
    pub socket_buffer: Option<usize>,
    /// Bytes of the producer's write buffer and the consumer's receive chunk.
    pub io_chunk: usize,
    /// What a peer's HELLO must prove, and what this transport proves to the
    /// peers it connects to. Default: [`ClusterSecret::process`].
    pub secret: ClusterSecret,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise: None,
            idle_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            socket_buffer: None,
            io_chunk: 4 << 20,
            secret: ClusterSecret::process(),
        }
    }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}
fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Why a read stopped.
enum ReadStop {
    /// The peer closed at a frame boundary: a normal end.
    Closed,
    /// This transport is shutting down.
    Shutdown,
    /// The peer closed or reset in the middle of a frame.
    Lost(String),
    /// No progress for the idle timeout in the middle of a frame.
    Stalled(Duration),
    /// A frame whose MAC does not hold: the connection is closed.
    Refused(crate::transport::auth::MessageRefused),
}

/// Reads with a short socket timeout, so that a reader notices shutdown and
/// mid-frame stalls instead of blocking forever.
struct FrameReader<'a> {
    stream: TcpStream,
    shutdown: &'a AtomicBool,
    idle: Duration,
    /// While set, waiting even at a frame boundary ends here (the HELLO must
    /// come in time: a silent stranger must not hold a thread).
    deadline: Option<Instant>,
}

const TICK: Duration = Duration::from_millis(100);

impl FrameReader<'_> {
    fn new(stream: TcpStream, shutdown: &AtomicBool, idle: Duration) -> std::io::Result<FrameReader<'_>> {
        stream.set_read_timeout(Some(TICK.min(idle)))?;
        Ok(FrameReader { stream, shutdown, idle, deadline: None })
    }

    /// Fills `buf`. `boundary`: the first byte of a frame, where waiting is normal.
    fn fill(&mut self, buf: &mut [u8], boundary: bool) -> std::result::Result<(), ReadStop> {
        let mut filled = 0;
        let mut last = Instant::now();
        while filled < buf.len() {
            match self.stream.read(&mut buf[filled..]) {
                Ok(0) if boundary && filled == 0 => return Err(ReadStop::Closed),
                Ok(0) => return Err(ReadStop::Lost("peer closed the connection mid-frame".into())),
                Ok(n) => {
                    filled += n;
                    last = Instant::now();
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if self.shutdown.load(Ordering::Relaxed) {
                        return Err(ReadStop::Shutdown);
                    }
                    if !(boundary && filled == 0) && last.elapsed() >= self.idle {
                        return Err(ReadStop::Stalled(self.idle));
                    }
                    if let Some(d) = self.deadline
                        && Instant::now() >= d
                    {
                        return Err(ReadStop::Stalled(self.idle.min(d.saturating_duration_since(last))));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if boundary && filled == 0 && e.kind() == std::io::ErrorKind::ConnectionReset => {
                    return Err(ReadStop::Closed);
                }
                Err(e) => {
                    if self.shutdown.load(Ordering::Relaxed) {
                        return Err(ReadStop::Shutdown);
                    }
                    return Err(ReadStop::Lost(e.to_string()));
                }
            }
        }
        Ok(())
    }

    /// Reads `n` bytes of a frame's body into a fresh buffer that grows as they
    /// arrive: a length field is the peer's word, so a header announcing megabytes
    /// and then stalling must not make us allocate them up front.
    fn fill_vec(&mut self, n: usize) -> std::result::Result<Vec<u8>, ReadStop> {
        const STEP: usize = 64 << 10;
        let mut out = Vec::with_capacity(n.min(STEP));
        while out.len() < n {
            let at = out.len();
            out.resize(at + (n - at).min(STEP.max(at)), 0);
            let end = out.len();
            self.fill(&mut out[at..end], false)?;
        }
        Ok(out)
    }

    /// Reads the MAC after a frame of type `ty` whose bytes after the type are
    /// `body`, and checks it with `opener`.
    fn open(&mut self, opener: &mut Opener, ty: u8, body: &[&[u8]]) -> std::result::Result<(), ReadStop> {
        let mut mac = [0u8; wire::MAC_BYTES];
        self.fill(&mut mac, false)?;
        let joined: Vec<u8> = body.concat();
        opener.open(&[&[ty], &joined], &mac).map_err(ReadStop::Refused)
    }

    /// Reads a frame's magic and type; `None` at a clean end.
    fn frame_type(&mut self) -> std::result::Result<u8, ReadStop> {
        let mut h = [0u8; 5];
        self.fill(&mut h, true)?;
        if le_u32(&h) != wire::MAGIC {
            return Err(ReadStop::Lost(format!("bad frame magic {:#x}", le_u32(&h))));
        }
        Ok(h[4])
    }
}

/// A peer's region as this transport writes it.
#[derive(Clone)]
struct Attachment {
    addr: SocketAddr,
    region: u64,
    kind: RegionKind,
    len: u64,
}

/// One outbound connection.
struct Conn {
    addr: SocketAddr,
    /// The stream and what seals its frames: one lock, so that frames go out
    /// in the order of their numbers.
    writer: Mutex<(BufWriter<TcpStream>, Sealer)>,
    /// Batches sent and not yet acked; `None` once the connection is dead.
    pending: Mutex<Option<HashSet<BatchId>>>,
    /// Why it died (a refusal's reason outlives the connection, so that a batch
    /// submitted just after still says why).
    why: Mutex<Option<String>>,
    stream: TcpStream,
}

impl Conn {
    fn alive(&self) -> bool {
        lock(&self.pending).is_some()
    }

    /// Marks the connection dead and fails what it had in flight.
    fn fail(&self, completions: &Completions, reason: &str) {
        lock(&self.why).get_or_insert_with(|| reason.to_string());
        let pending = lock(&self.pending).take();
        let _ = self.stream.shutdown(Shutdown::Both);
        for batch in pending.into_iter().flatten() {
            completions.finish(batch, Err(TransportError::Disconnected { peer: self.addr.to_string(), reason: reason.to_string() }));
        }
    }
}

struct Inner {
    opts: TcpOptions,
    core: HostCore,
    endpoint_addr: SocketAddr,
    shutdown: AtomicBool,
    completions: Completions,
    next_attach: AtomicU64,
    attachments: RwLock<HashMap<u64, Attachment>>,
    conns: Mutex<HashMap<SocketAddr, Arc<Conn>>>,
    incidents: Mutex<Vec<Incident>>,
    /// Inbound connections refused for a missing or wrong HELLO.
    unauthenticated: AtomicU64,
    /// Frames refused after a handshake (either way: WRITE/NOTIFY in, ACK back).
    refused_frames: AtomicU64,
    /// Threads and their streams, joined (after a shutdown of the stream) on drop.
    threads: Mutex<Vec<(Option<TcpStream>, JoinHandle<()>)>>,
}

/// The TCP transport. See the module docs.
pub struct TcpTransport {
    inner: Arc<Inner>,
    accept: Option<JoinHandle<()>>,
}

fn tune(stream: &TcpStream, opts: &TcpOptions) {
    let _ = stream.set_nodelay(true);
    if let Some(bytes) = opts.socket_buffer {
        use std::os::fd::AsRawFd;
        let v = bytes.min(i32::MAX as usize) as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: a valid socket fd and a c_int option value of the right size.
            unsafe {
                libc::setsockopt(
                    stream.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
    }
}

impl TcpTransport {
    /// Listens on `opts.bind` and starts the accept thread.
    pub fn bind(opts: TcpOptions) -> Result<Self> {
        let listener = TcpListener::bind(opts.bind).map_err(|e| TransportError::io(format!("bind {}", opts.bind), e))?;
        let local = listener.local_addr().map_err(|e| TransportError::io("local_addr", e))?;
        let endpoint_addr = match opts.advertise {
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), local.port()),
            Some(a) => a,
            None => local,
        };
        let inner = Arc::new(Inner {
            core: HostCore::new("tcp", PeerAddr::Tcp { addr: endpoint_addr }),
            opts,
            endpoint_addr,
            shutdown: AtomicBool::new(false),
            completions: Completions::default(),
            next_attach: AtomicU64::new(1),
            attachments: RwLock::new(HashMap::new()),
            conns: Mutex::new(HashMap::new()),
            incidents: Mutex::new(Vec::new()),
            unauthenticated: AtomicU64::new(0),
            refused_frames: AtomicU64::new(0),
            threads: Mutex::new(Vec::new()),
        });
        let acceptor = Arc::clone(&inner);
        let accept = std::thread::Builder::new()
            .name(format!("tcp-accept-{local}"))
            .spawn(move || accept_loop(acceptor, listener))
            .map_err(|e| TransportError::io("spawn accept thread", e))?;
        Ok(TcpTransport { inner, accept: Some(accept) })
    }

    /// A transport on 127.0.0.1, any port.
    pub fn loopback() -> Result<Self> {
        Self::bind(TcpOptions::default())
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.inner.endpoint_addr
    }

    /// Inbound connections refused so far because their first frame was not a
    /// HELLO proving the cluster secret.
    pub fn unauthenticated(&self) -> u64 {
        self.inner.unauthenticated.load(Ordering::Relaxed)
    }

    /// Frames refused so far after a handshake because their MAC did not hold
    /// (each closed its connection).
    pub fn refused_frames(&self) -> u64 {
        self.inner.refused_frames.load(Ordering::Relaxed)
    }

    /// The connection to `addr` (made, with its handshake, if there is none),
    /// held to learn when that peer goes away: its process's end closes the
    /// connection, and the ack reader marks it dead within a read tick. A
    /// transport whose data path reports no peer failure (UCX's shared-memory
    /// lanes) asks this [`Link`] instead.
    pub fn link(&self, addr: SocketAddr) -> Result<Link> {
        Ok(Link(self.inner.conn(addr)?))
    }
}

/// One connection to a peer, watched for its close (see [`TcpTransport::link`]).
/// A later reconnection to the same address is another connection: a peer
/// restarted at the same port is not taken for the one that died.
#[derive(Clone)]
pub struct Link(Arc<Conn>);

impl Link {
    /// Why the connection died, or `None` while it lives.
    pub fn dead(&self) -> Option<String> {
        if self.0.alive() {
            return None;
        }
        Some(lock(&self.0.why).clone().unwrap_or_else(|| "connection closed".into()))
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.shutdown.store(true, Ordering::Relaxed);
        // Wake the accept thread with a connection to ourselves.
        let mut wake = inner.endpoint_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() { IpAddr::V4(Ipv4Addr::LOCALHOST) } else { IpAddr::V6(Ipv6Addr::LOCALHOST) });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for conn in lock(&inner.conns).drain().map(|(_, c)| c) {
            conn.fail(&inner.completions, "transport shut down");
        }
        let threads = std::mem::take(&mut *lock(&inner.threads));
        for (stream, handle) in threads {
            if let Some(s) = stream {
                let _ = s.shutdown(Shutdown::Both);
            }
            let _ = handle.join();
        }
    }
}

fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    for stream in listener.incoming() {
        if inner.shutdown.load(Ordering::Relaxed) {
            return;
        }
        let Ok(stream) = stream else { continue };
        tune(&stream, &inner.opts);
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "unknown".into());
        let Ok(keep) = stream.try_clone() else { continue };
        let worker = Arc::clone(&inner);
        let spawned = std::thread::Builder::new().name(format!("tcp-recv-{peer}")).spawn(move || serve_connection(&worker, stream));
        if let Ok(handle) = spawned {
            let mut threads = lock(&inner.threads);
            threads.retain(|(_, h)| !h.is_finished());
            threads.push((Some(keep), handle));
        }
    }
}

/// The consumer side of one connection: frames until the peer closes.
fn serve_connection(inner: &Inner, stream: TcpStream) {
    let peer_sock = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "unknown".into());
    let Ok(ack_stream) = stream.try_clone() else { return };
    let mut acks = BufWriter::new(ack_stream);
    let Ok(mut r) = FrameReader::new(stream, &inner.shutdown, inner.opts.idle_timeout) else { return };
    let Ok(nonce) = crate::transport::auth::nonce().inspect_err(|e| tracing::error!(peer = %peer_sock, error = %e, "cannot challenge a connection")) else {
        return;
    };
    if wire::write_challenge(&mut acks, &nonce).and_then(|()| acks.flush()).is_err() {
        return;
    }
    r.deadline = Some(Instant::now() + inner.opts.connect_timeout.max(Duration::from_secs(1)));
    let (from, mut session) = match read_hello(&mut r, &inner.opts.secret, &nonce) {
        Ok(hello) => hello,
        Err(NoHello::Closed) => return,
        Err(NoHello::Refused(reason)) => {
            inner.unauthenticated.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %peer_sock, %reason, "tcp: refused an unauthenticated connection");
            let told = format!("refused: {reason} (do the roles share one cluster secret, {}?)", crate::transport::auth::SECRET_FILE_ENV);
            let _ = wire::write_refusal(&mut acks, &told).and_then(|()| acks.flush());
            let _ = r.stream.shutdown(Shutdown::Both);
            return;
        }
    };
    r.deadline = None;
    let mut chunk = Vec::new();
    let mut current: Option<u64> = None;
    let outcome: std::result::Result<(), (ReadStop, Option<u64>)> = (|| loop {
        current = None;
        let ty = r.frame_type().map_err(|s| (s, None))?;
        match ty {
            wire::NOTIFY => {
                let mut n = [0u8; 4];
                r.fill(&mut n, false).map_err(|s| (s, None))?;
                let len = n;
                let n = le_u32(&n);
                if n > wire::MAX_NOTIFY {
                    return Err((ReadStop::Lost(format!("notification of {n} B")), None));
                }
                let bytes = r.fill_vec(n as usize).map_err(|s| (s, None))?;
                r.open(&mut session.opener, wire::NOTIFY, &[&len, &bytes]).map_err(|s| (s, None))?;
                inner.core.deliver(Notification { from: from.clone(), bytes });
            }
            wire::WRITE => {
                let mut h = [0u8; 28];
                r.fill(&mut h, false).map_err(|s| (s, None))?;
                let (batch, region, ndesc, payload) = (le_u64(&h), le_u64(&h[8..]), le_u32(&h[16..]), le_u64(&h[20..]));
                current = Some(batch);
                if ndesc > wire::MAX_DESCRIPTORS {
                    return Err((ReadStop::Lost(format!("{ndesc} descriptors in one frame")), Some(batch)));
                }
                let raw = r.fill_vec(ndesc as usize * wire::DESC_BYTES).map_err(|s| (s, Some(batch)))?;
                // Checked before anything of the frame is believed or a byte of
                // its payload is read.
                r.open(&mut session.opener, wire::WRITE, &[&h, &raw]).map_err(|s| (s, Some(batch)))?;
                let mut descs = Vec::with_capacity(ndesc as usize);
                for d in raw.chunks_exact(wire::DESC_BYTES) {
                    let Some(kind) = wire::kind_from_code(d[0]) else {
                        return Err((ReadStop::Lost(format!("unknown region kind code {}", d[0])), Some(batch)));
                    };
                    descs.push(Descriptor {
                        kind,
                        src_offset: 0,
                        src_stride: 0,
                        dst_offset: le_u64(&d[1..]),
                        len: le_u64(&d[9..]),
                        count: le_u32(&d[17..]),
                        dst_stride: le_u64(&d[21..]),
                    });
                }
                let expected = descs.iter().try_fold(0u64, |acc, d| acc.checked_add(d.len.checked_mul(d.count as u64)?));
                if expected != Some(payload) {
                    return Err((ReadStop::Lost(format!("payload of {payload} B but descriptors cover {expected:?}")), Some(batch)));
                }
                let target = read(&inner.core.regions).get(&region).cloned();
                let verdict = match &target {
                    None => Err(format!("no region {region} registered at {}", inner.endpoint_addr)),
                    Some(t) => validate(&descs, None, t.len, t.kind).map_err(|e| e.to_string()),
                };
                match (verdict, target) {
                    (Ok(()), Some(t)) => {
                        receive_payload(&mut r, &t, &descs, payload, inner.opts.io_chunk, &mut chunk).map_err(|s| (s, Some(batch)))?;
                        wire::write_ack(&mut acks, &mut session.sealer, batch, None)
                            .and_then(|()| acks.flush())
                            .map_err(|e| (ReadStop::Lost(e.to_string()), None))?;
                    }
                    (verdict, _) => {
                        let reason = verdict.err().unwrap_or_default();
                        tracing::warn!(peer = %peer_sock, batch, %reason, "tcp: rejected batch");
                        drain(&mut r, payload, inner.opts.io_chunk, &mut chunk).map_err(|s| (s, Some(batch)))?;
                        wire::write_ack(&mut acks, &mut session.sealer, batch, Some(&reason))
                            .and_then(|()| acks.flush())
                            .map_err(|e| (ReadStop::Lost(e.to_string()), None))?;
                    }
                }
            }
            other => return Err((ReadStop::Lost(format!("unknown frame type {other}")), current)),
        }
    })();
    // Close the socket itself, not only this thread's handles: the accept loop keeps
    // a clone of the stream, and until it is shut down the producer never sees the
    // connection end (its batches would wait for their timeout, not fail at once).
    // After the incident is recorded, so that a peer seeing the end can see why.
    let close = || {
        let _ = acks.get_ref().shutdown(Shutdown::Both);
    };
    let Err((stop, batch)) = outcome else {
        close();
        return;
    };
    let peer = from.as_ref().map(|p| p.to_string()).unwrap_or_else(|| peer_sock.clone());
    let what = batch.map(|b| format!(" during batch {b}")).unwrap_or_default();
    let error = match stop {
        ReadStop::Closed | ReadStop::Shutdown => {
            close();
            return;
        }
        ReadStop::Lost(reason) => TransportError::Disconnected { peer, reason: format!("{reason}{what}") },
        ReadStop::Stalled(after) => TransportError::Timeout { what: format!("bytes from {peer}{what}"), after },
        ReadStop::Refused(e) => {
            inner.refused_frames.fetch_add(1, Ordering::Relaxed);
            TransportError::Refused { peer, reason: format!("{e}{what}") }
        }
    };
    tracing::warn!(%error, "tcp: inbound connection failed");
    lock(&inner.incidents).push(Incident { peer: from, error });
    close();
}

/// Why a connection's first frame let no peer in.
enum NoHello {
    /// Closed before a byte: a probe, not a refusal.
    Closed,
    /// Refused; why, as the refusal tells the peer.
    Refused(String),
}

/// Reads the connection's first frame, which must be a HELLO proving `secret`
/// over `na` and its own nonce, and answers it with this side's proof (WELCOME);
/// the peer's endpoint and this side's session when it does.
fn read_hello(r: &mut FrameReader<'_>, secret: &ClusterSecret, na: &[u8; 32]) -> std::result::Result<(Option<PeerAddr>, wire::Session), NoHello> {
    let ty = match r.frame_type() {
        Ok(t) => t,
        Err(ReadStop::Closed | ReadStop::Shutdown) => return Err(NoHello::Closed),
        Err(e) => return Err(NoHello::Refused(format!("no HELLO: {}", stop_reason(e)))),
    };
    if ty != wire::HELLO {
        return Err(NoHello::Refused(format!("the first frame is of type {ty}, not a HELLO")));
    }
    let mut n = [0u8; 4];
    r.fill(&mut n, false).map_err(|e| NoHello::Refused(stop_reason(e)))?;
    let n = le_u32(&n);
    if n > 1 << 16 {
        return Err(NoHello::Refused(format!("a HELLO of {n} B")));
    }
    let mut body = vec![0u8; n as usize + 64];
    r.fill(&mut body, false).map_err(|e| NoHello::Refused(stop_reason(e)))?;
    let (json, rest) = body.split_at(n as usize);
    let (nc, proof) = rest.split_at(32);
    if !crate::transport::auth::ct_eq(&secret.proof(crate::transport::auth::context::TCP_HELLO, End::Connector, na, nc, json), proof) {
        return Err(NoHello::Refused("the HELLO does not prove the cluster secret".into()));
    }
    let welcome = secret.proof(crate::transport::auth::context::TCP_HELLO, End::Acceptor, na, nc, json);
    let mut out = Vec::new();
    wire::write_welcome(&mut out, &welcome).map_err(|e| NoHello::Refused(e.to_string()))?;
    // A peer that vanished here is a closed connection, not a stranger.
    (&r.stream).write_all(&out).map_err(|_| NoHello::Closed)?;
    Ok((serde_json::from_slice(json).ok(), wire::Session::new(secret, na, nc, End::Acceptor)))
}

/// Reads `payload` bytes in chunks and scatters them over the descriptors' pieces.
fn receive_payload(
    r: &mut FrameReader<'_>,
    target: &HostRegion,
    descs: &[Descriptor],
    payload: u64,
    io_chunk: usize,
    chunk: &mut Vec<u8>,
) -> std::result::Result<(), ReadStop> {
    // Pieces are walked lazily, and empty descriptors skipped whole: a descriptor's
    // count is the peer's word (u32::MAX zero-length pieces carry no payload and
    // pass validation), so collecting them first allocated and looped per piece.
    let mut ps = descs.iter().filter(|d| d.len > 0).flat_map(|d| d.pieces().map(move |(_, dst)| (dst, d.len)));
    let mut cur: Option<(u64, u64)> = ps.next();
    let mut left = payload;
    while left > 0 {
        let n = left.min(io_chunk as u64) as usize;
        chunk.resize(n, 0);
        r.fill(&mut chunk[..n], false)?;
        left -= n as u64;
        let mut g = write(&target.mem);
        let dst = g.bytes_mut();
        let mut at = 0usize;
        while at < n {
            let Some((off, len)) = cur.as_mut() else { break };
            let take = (*len as usize).min(n - at);
            dst[*off as usize..*off as usize + take].copy_from_slice(&chunk[at..at + take]);
            at += take;
            *off += take as u64;
            *len -= take as u64;
            if *len == 0 {
                cur = ps.next();
            }
        }
    }
    Ok(())
}

fn drain(r: &mut FrameReader<'_>, mut left: u64, io_chunk: usize, chunk: &mut Vec<u8>) -> std::result::Result<(), ReadStop> {
    while left > 0 {
        let n = left.min(io_chunk as u64) as usize;
        chunk.resize(n, 0);
        r.fill(&mut chunk[..n], false)?;
        left -= n as u64;
    }
    Ok(())
}

/// The producer side of one connection: acks (checked with `opener`) until the
/// connection ends.
fn read_acks(inner: &Inner, conn: &Conn, stream: TcpStream, mut opener: Opener) {
    let reason = match FrameReader::new(stream, &inner.shutdown, inner.opts.idle_timeout) {
        Err(e) => e.to_string(),
        Ok(mut r) => loop {
            let ty = match r.frame_type() {
                Ok(t) => t,
                Err(ReadStop::Closed) => break "peer closed the connection".to_string(),
                Err(ReadStop::Shutdown) => break "transport shut down".to_string(),
                Err(ReadStop::Lost(m)) => break m,
                Err(ReadStop::Stalled(d)) => break format!("no progress for {d:?}"),
                Err(ReadStop::Refused(e)) => break e.to_string(),
            };
            if ty != wire::ACK {
                break format!("unexpected frame type {ty} on an outbound connection");
            }
            let mut h = [0u8; 13];
            if let Err(e) = r.fill(&mut h, false) {
                break stop_reason(e);
            }
            let (batch, status, n) = (BatchId(le_u64(&h)), h[8], le_u32(&h[9..]));
            if n > 1 << 20 {
                break format!("ack reason of {n} B");
            }
            let mut msg = vec![0u8; n as usize];
            if let Err(e) = r.fill(&mut msg, false) {
                break stop_reason(e);
            }
            if let Err(e) = r.open(&mut opener, wire::ACK, &[&h, &msg]) {
                if let ReadStop::Refused(why) = &e {
                    inner.refused_frames.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = %conn.addr, %why, "tcp: refused an ACK; connection closed");
                }
                break stop_reason(e);
            }
            let known = lock(&conn.pending).as_mut().is_some_and(|p| p.remove(&batch));
            if known {
                let result = if status == 0 {
                    Ok(())
                } else {
                    Err(TransportError::Rejected { peer: conn.addr.to_string(), batch, message: String::from_utf8_lossy(&msg).into_owned() })
                };
                inner.completions.finish(batch, result);
            }
        },
    };
    conn.fail(&inner.completions, &reason);
}

fn stop_reason(s: ReadStop) -> String {
    match s {
        ReadStop::Closed => "peer closed the connection".into(),
        ReadStop::Shutdown => "transport shut down".into(),
        ReadStop::Lost(m) => m,
        ReadStop::Stalled(d) => format!("no progress for {d:?}"),
        ReadStop::Refused(e) => e.to_string(),
    }
}

/// One stream's read and write halves as one `Read + Write`, for the handshake.
struct HandshakeStream<'a> {
    r: &'a mut TcpStream,
    w: &'a mut TcpStream,
}

impl Read for HandshakeStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.r.read(buf)
    }
}

impl Write for HandshakeStream<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.w.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

impl Inner {
    /// The live connection to `addr`, connecting (and saying hello) if needed.
    fn conn(self: &Arc<Self>, addr: SocketAddr) -> Result<Arc<Conn>> {
        let mut conns = lock(&self.conns);
        if let Some(c) = conns.get(&addr)
            && c.alive()
        {
            return Ok(Arc::clone(c));
        }
        let stream = TcpStream::connect_timeout(&addr, self.opts.connect_timeout)
            .map_err(|e| TransportError::Disconnected { peer: addr.to_string(), reason: format!("connect: {e}") })?;
        tune(&stream, &self.opts);
        let io = |e| TransportError::io(format!("set up connection to {addr}"), e);
        let mut reader = stream.try_clone().map_err(io)?;
        let keep = stream.try_clone().map_err(io)?;
        let mut writer = BufWriter::with_capacity(self.opts.io_chunk.max(64 << 10), stream.try_clone().map_err(io)?);
        reader.set_read_timeout(Some(self.opts.connect_timeout)).map_err(io)?;
        // The handshake reads and writes the stream itself, unbuffered; the
        // buffered writer takes over once it holds.
        let mut hs = HandshakeStream { r: &mut reader, w: writer.get_mut() };
        let session = wire::connect_handshake(&mut hs, &self.core.endpoint, &self.opts.secret).map_err(|e| match e {
            wire::HandshakeError::Io(e) => TransportError::Disconnected { peer: addr.to_string(), reason: format!("handshake: {e}") },
            wire::HandshakeError::RefusedByPeer(why) => TransportError::Disconnected { peer: addr.to_string(), reason: format!("{addr} {why}") },
            e @ wire::HandshakeError::AcceptorUnproven => TransportError::Refused { peer: addr.to_string(), reason: e.to_string() },
        })?;
        let wire::Session { sealer, opener } = session;
        let conn = Arc::new(Conn { addr, writer: Mutex::new((writer, sealer)), pending: Mutex::new(Some(HashSet::new())), why: Mutex::new(None), stream });
        let (me, c) = (Arc::clone(self), Arc::clone(&conn));
        let handle = std::thread::Builder::new()
            .name(format!("tcp-acks-{addr}"))
            .spawn(move || read_acks(&me, &c, reader, opener))
            .map_err(|e| TransportError::io("spawn ack thread", e))?;
        {
            let mut threads = lock(&self.threads);
            threads.retain(|(_, h)| !h.is_finished());
            threads.push((Some(keep), handle));
        }
        conns.insert(addr, Arc::clone(&conn));
        Ok(conn)
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn endpoint(&self) -> PeerAddr {
        self.inner.core.endpoint.clone()
    }

    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle> {
        host_only(memory, "tcp")?;
        let bytes = vec![0u8; usize_len(len)?];
        let id = self.inner.core.next_id();
        self.inner.core.insert(id, HostRegion::new(kind, len, Mem::Heap(bytes)));
        Ok(RegionHandle { peer: self.endpoint(), id, rank, kind, len, memory, ipc: None, remote_key: None })
    }

    fn unregister(&self, handle: &RegionHandle) -> Result<()> {
        self.inner.core.remove(handle).map(drop)
    }

    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion> {
        let PeerAddr::Tcp { addr } = handle.peer else {
            return Err(TransportError::Unavailable { what: format!("peer {}", handle.peer), reason: "the tcp transport reaches only tcp endpoints".into() });
        };
        host_only(handle.memory, "tcp")?;
        // Connect now, so that an unreachable peer fails at attach, not mid-plan.
        self.inner.conn(addr)?;
        let id = self.inner.next_attach.fetch_add(1, Ordering::Relaxed);
        write(&self.inner.attachments).insert(id, Attachment { addr, region: handle.id, kind: handle.kind, len: handle.len });
        Ok(RemoteRegion { id, kind: handle.kind, len: handle.len })
    }

    fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.inner.core.with_region(handle, f)
    }

    fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        self.inner.core.with_region_mut(handle, f)
    }

    fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId> {
        let inner = &self.inner;
        let s = inner.core.local(src)?;
        let att = read(&inner.attachments).get(&dst.id).cloned().ok_or_else(|| TransportError::UnknownRegion(format!("attachment {}", dst.id)))?;
        validate(descriptors, Some(s.len), att.len, att.kind)?;
        if descriptors.len() > wire::MAX_DESCRIPTORS as usize {
            return Err(TransportError::BatchTooLarge { count: descriptors.len(), max: wire::MAX_DESCRIPTORS as usize });
        }
        let payload: u64 = descriptors.iter().map(Descriptor::bytes).sum();
        let conn = inner.conn(att.addr)?;
        let batch = inner.completions.begin();
        let registered = lock(&conn.pending).as_mut().map(|p| p.insert(batch)).is_some();
        if !registered {
            inner.completions.cancel(batch);
            let reason = lock(&conn.why).clone().unwrap_or_else(|| "connection closed".into());
            return Err(TransportError::Disconnected { peer: att.addr.to_string(), reason });
        }
        let _span = tracing::trace_span!("transport.tcp.send", peer = %att.addr, batch = batch.0, bytes = payload).entered();
        let sent = (|| -> std::io::Result<()> {
            let mut guard = lock(&conn.writer);
            let (w, sealer) = &mut *guard;
            wire::write_batch_header(w, sealer, batch.0, att.region, descriptors, payload)?;
            let g = read(&s.mem);
            let bytes = g.bytes();
            for d in descriptors {
                if d.len == 0 {
                    continue;
                }
                for (off, _) in d.pieces() {
                    w.write_all(&bytes[off as usize..(off + d.len) as usize])?;
                }
            }
            w.flush()
        })();
        if let Err(e) = sent {
            let owned = lock(&conn.pending).as_mut().is_some_and(|p| p.remove(&batch));
            if owned {
                inner.completions.cancel(batch);
            }
            // A peer that refuses a connection says why in a frame and then
            // closes, which can break this send first: give the ack reader a
            // moment to read that frame, so the error names the refusal
            // rather than the broken pipe it caused.
            let deadline = Instant::now() + Duration::from_millis(200);
            while lock(&conn.why).is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            conn.fail(&inner.completions, &format!("send: {e}"));
            let reason = lock(&conn.why).clone().unwrap_or_else(|| format!("send: {e}"));
            return Err(TransportError::Disconnected { peer: att.addr.to_string(), reason });
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
        let PeerAddr::Tcp { addr } = peer else {
            return Err(TransportError::Unavailable { what: format!("peer {peer}"), reason: "not a tcp endpoint".into() });
        };
        if bytes.len() > wire::MAX_NOTIFY as usize {
            return Err(TransportError::Unavailable {
                what: format!("a {}-byte notification", bytes.len()),
                reason: format!("tcp notifications carry at most {} B", wire::MAX_NOTIFY),
            });
        }
        let conn = self.inner.conn(*addr)?;
        let mut guard = lock(&conn.writer);
        let (w, sealer) = &mut *guard;
        let sent = wire::write_notify(w, sealer, bytes).and_then(|()| w.flush());
        drop(guard);
        sent.map_err(|e| {
            conn.fail(&self.inner.completions, &e.to_string());
            TransportError::Disconnected { peer: addr.to_string(), reason: format!("notify: {e}") }
        })
    }

    fn recv_notifications(&self) -> Vec<Notification> {
        self.inner.core.take_inbox()
    }

    fn take_incidents(&self) -> Vec<Incident> {
        std::mem::take(&mut *lock(&self.inner.incidents))
    }

    fn unauthenticated(&self) -> u64 {
        TcpTransport::unauthenticated(self)
    }

    fn refused_frames(&self) -> u64 {
        TcpTransport::refused_frames(self)
    }
}
