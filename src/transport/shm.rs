//! Shared-memory transport between processes of one host.
//!
//! Each region is a file `{dir}/{prefix}-r{id}` (dir is /dev/shm, a tmpfs) mapped
//! shared with memmap2; the prefix `handoff-{pid}-{nonce}` is unique per transport
//! instance. A producer maps the file named by the handle and copies into it, so a
//! write is a memcpy into the consumer's pages. Notifications travel as datagrams on
//! the Unix socket `{dir}/{prefix}.sock`: u32 n, n bytes of the sender's endpoint
//! (JSON), a u64 counter of the sender's, the MAC, the bytes. The MAC is
//! [`ClusterSecret::mac`] over the sender's endpoint (its length prefix is n),
//! the receiver's endpoint, the counter and the bytes ([`crate::transport::auth`]).
//! A datagram has no connection to carry a session, so the counter does its
//! work: each sender counts its datagrams from 1 and the receiver refuses one
//! whose counter is not above the last it took from that sender (a replay, or
//! one sent out of order), and one addressed to another receiver fails the MAC.
//!
//! Who may write: region files and the socket are mode 0600, so only processes of
//! the same user can map a region or send a datagram at all; a mapping writes
//! without any handshake, so the file mode is the boundary for region bytes. A
//! datagram whose tag does not prove the cluster secret is dropped before it is
//! delivered and counted ([`ShmTransport::unauthenticated`]): a same-user process
//! that does not hold the secret cannot forge a write-done report. A datagram
//! that proves the secret but repeats an old counter is dropped and counted
//! ([`ShmTransport::refused_frames`]): a captured report sent again is not
//! delivered twice.
//! The files and the socket are removed on drop; [`sweep_stale`] removes those left
//! by processes that died without dropping.

use super::host::{HostCore, HostRegion, Mem};
use super::{
    BatchCompletion, BatchId, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport, TransportError, host_only, lock, usize_len,
};
use crate::transport::auth::{ClusterSecret, context};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest notification, bounded by what one datagram carries on Linux by default.
pub const MAX_NOTIFICATION_BYTES: usize = 64 << 10;

/// The shared-memory transport. Completions are ready when `submit` returns.
pub struct ShmTransport {
    core: Arc<HostCore>,
    dir: PathBuf,
    prefix: String,
    socket: UnixDatagram,
    secret: ClusterSecret,
    unauthenticated: AtomicU64,
    /// This sender's last counter. Held while a datagram is sealed and sent, so
    /// that datagrams leave in the order of their counters (a receiver would
    /// refuse a lower one that overtook a higher).
    sent: Mutex<u64>,
    /// The last counter taken from each sender (its endpoint JSON). Only
    /// senders that proved the secret get an entry.
    seen: Mutex<HashMap<Vec<u8>, u64>>,
    refused_frames: AtomicU64,
}

fn region_path(dir: &Path, prefix: &str, id: u64) -> PathBuf {
    dir.join(format!("{prefix}-r{id}"))
}

fn socket_path(dir: &Path, prefix: &str) -> PathBuf {
    dir.join(format!("{prefix}.sock"))
}

/// The default directory: /dev/shm where it exists, the temp dir otherwise.
pub fn default_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() { shm } else { std::env::temp_dir() }
}

impl ShmTransport {
    /// A transport with its files under [`default_dir`].
    pub fn new() -> Result<Self> {
        Self::in_dir(default_dir())
    }

    /// A transport with its files under `dir` (must be shared by the peers).
    pub fn in_dir(dir: impl Into<PathBuf>) -> Result<Self> {
        Self::with_secret(dir, ClusterSecret::process())
    }

    /// A transport under `dir` whose notifications carry and require `secret`.
    pub fn with_secret(dir: impl Into<PathBuf>, secret: ClusterSecret) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let dir = dir.into();
        let prefix = format!("handoff-{}-{:016x}", std::process::id(), super::nonce());
        let sock = socket_path(&dir, &prefix);
        let socket = UnixDatagram::bind(&sock).map_err(|e| TransportError::io(format!("bind {}", sock.display()), e))?;
        // Only this user may send to it (bind applies the umask, often 0755).
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).map_err(|e| TransportError::io(format!("chmod 600 {}", sock.display()), e))?;
        socket.set_nonblocking(true).map_err(|e| TransportError::io("set_nonblocking", e))?;
        let endpoint = PeerAddr::Shm { dir: dir.clone(), prefix: prefix.clone() };
        Ok(ShmTransport {
            core: Arc::new(HostCore::new("shm", endpoint)),
            dir,
            prefix,
            socket,
            secret,
            unauthenticated: AtomicU64::new(0),
            sent: Mutex::new(0),
            seen: Mutex::new(HashMap::new()),
            refused_frames: AtomicU64::new(0),
        })
    }

    /// Notification datagrams dropped so far because their tag did not prove the
    /// cluster secret (or they were not of this protocol).
    pub fn unauthenticated(&self) -> u64 {
        self.unauthenticated.load(Ordering::Relaxed)
    }

    /// Notification datagrams dropped so far that proved the secret but not
    /// their place: a counter not above the last one taken from their sender.
    pub fn refused_frames(&self) -> u64 {
        self.refused_frames.load(Ordering::Relaxed)
    }

    /// The path of this transport's notification socket.
    pub fn socket_path(&self) -> PathBuf {
        socket_path(&self.dir, &self.prefix)
    }

    /// The path of a local region's file.
    pub fn region_path(&self, handle: &RegionHandle) -> PathBuf {
        region_path(&self.dir, &self.prefix, handle.id)
    }

    fn map(file: &File, len: u64) -> Result<Mem> {
        if len == 0 {
            return Ok(Mem::Heap(Vec::new()));
        }
        // SAFETY: the file is a region file of this protocol; other processes write
        // into it only through their own mapping, and the engine does not read a
        // region while a write into it may be in flight (see `Transport`).
        let map = unsafe { memmap2::MmapMut::map_mut(file) }.map_err(|e| TransportError::io("mmap", e))?;
        Ok(Mem::Map(map))
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        let ids: Vec<u64> = super::read(&self.core.regions).keys().copied().collect();
        for id in ids {
            let _ = std::fs::remove_file(region_path(&self.dir, &self.prefix, id));
        }
        let _ = std::fs::remove_file(socket_path(&self.dir, &self.prefix));
    }
}

/// Removes region files and sockets under `dir` left by `handoff-{pid}-...`
/// transports whose process no longer exists. Returns how many it removed.
pub fn sweep_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("handoff-")) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn endpoint(&self) -> PeerAddr {
        self.core.endpoint.clone()
    }

    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle> {
        host_only(memory, "shm")?;
        usize_len(len)?;
        let id = self.core.next_id();
        let path = region_path(&self.dir, &self.prefix, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| TransportError::io(format!("create {}", path.display()), e))?;
        let mem = file.set_len(len).map_err(|e| TransportError::io(format!("size {} to {len} B", path.display()), e)).and_then(|()| Self::map(&file, len));
        let mem = match mem {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        self.core.insert(id, HostRegion::new(kind, len, mem));
        Ok(RegionHandle { peer: self.endpoint(), id, rank, kind, len, memory, ipc: None, remote_key: None })
    }

    fn unregister(&self, handle: &RegionHandle) -> Result<()> {
        self.core.remove(handle)?;
        let _ = std::fs::remove_file(region_path(&self.dir, &self.prefix, handle.id));
        Ok(())
    }

    /// A peer region is mapped here (its file): a write is a memcpy.
    fn writes_in_place(&self, _: RemoteRegion) -> bool {
        true
    }

    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion> {
        if handle.peer == self.core.endpoint {
            return Ok(self.core.attach_region(self.core.local(handle)?));
        }
        let PeerAddr::Shm { dir, prefix } = &handle.peer else {
            return Err(TransportError::Unavailable { what: format!("peer {}", handle.peer), reason: "the shm transport maps only shm regions".into() });
        };
        host_only(handle.memory, "shm")?;
        let path = region_path(dir, prefix, handle.id);
        let file = OpenOptions::new().read(true).write(true).open(&path).map_err(|e| TransportError::io(format!("open {}", path.display()), e))?;
        let actual = file.metadata().map_err(|e| TransportError::io("stat", e))?.len();
        if actual != handle.len {
            return Err(TransportError::UnknownRegion(format!("{handle}: {} holds {actual} B", path.display())));
        }
        let mem = Self::map(&file, handle.len)?;
        Ok(self.core.attach_region(HostRegion::new(handle.kind, handle.len, mem)))
    }

    fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        self.core.with_region(handle, f)
    }

    fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        self.core.with_region_mut(handle, f)
    }

    fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId> {
        self.core.submit(src, dst, descriptors)
    }

    /// All the batches in one copy: each source region is read once, in order,
    /// for every batch that reads it.
    fn submit_all(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])]) -> Vec<Result<BatchId>> {
        self.core.submit_all(writes)
    }

    /// One `submit_all` of many plans reads each shared source once.
    fn plans_per_submission(&self) -> usize {
        64
    }

    fn poll(&self) -> Vec<BatchCompletion> {
        self.core.poll()
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        self.core.wait(batch, timeout)
    }

    fn notify(&self, peer: &PeerAddr, bytes: &[u8]) -> Result<()> {
        let PeerAddr::Shm { dir, prefix } = peer else {
            return Err(TransportError::Unavailable { what: format!("peer {peer}"), reason: "not an shm endpoint".into() });
        };
        let from = serde_json::to_vec(&self.core.endpoint).map_err(|e| TransportError::Protocol { peer: peer.to_string(), message: e.to_string() })?;
        let to = serde_json::to_vec(peer).map_err(|e| TransportError::Protocol { peer: peer.to_string(), message: e.to_string() })?;
        if bytes.len() + from.len() + 4 + 8 + 32 > MAX_NOTIFICATION_BYTES {
            return Err(TransportError::Unavailable {
                what: format!("a {}-byte notification", bytes.len()),
                reason: format!("shm notifications carry at most {MAX_NOTIFICATION_BYTES} B"),
            });
        }
        let sock = UnixDatagram::unbound().map_err(|e| TransportError::io("socket", e))?;
        sock.set_write_timeout(Some(Duration::from_secs(5))).map_err(|e| TransportError::io("set_write_timeout", e))?;
        let path = socket_path(dir, prefix);
        let mut sent = lock(&self.sent);
        let counter = *sent + 1;
        let mac = self.secret.mac(context::SHM_NOTIFY, &[&from, &to, &counter.to_le_bytes(), bytes]);
        let mut msg = Vec::with_capacity(4 + from.len() + 8 + 32 + bytes.len());
        msg.extend_from_slice(&(from.len() as u32).to_le_bytes());
        msg.extend_from_slice(&from);
        msg.extend_from_slice(&counter.to_le_bytes());
        msg.extend_from_slice(&mac);
        msg.extend_from_slice(bytes);
        sock.send_to(&msg, &path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                TransportError::Disconnected { peer: peer.to_string(), reason: e.to_string() }
            }
            _ => TransportError::io(format!("send to {}", path.display()), e),
        })?;
        // Counted once sent: a counter skipped by a failed send would do no harm
        // (only order matters), but keeping them dense keeps the logs readable.
        *sent = counter;
        Ok(())
    }

    fn recv_notifications(&self) -> Vec<Notification> {
        let mut out = self.core.take_inbox();
        let mut buf = vec![0u8; MAX_NOTIFICATION_BYTES];
        let to = serde_json::to_vec(&self.core.endpoint).unwrap_or_default();
        while let Ok(n) = self.socket.recv(&mut buf) {
            match authentic(&self.secret, &to, &buf[..n]) {
                Some((note, from, counter)) => {
                    let mut seen = lock(&self.seen);
                    let last = seen.entry(from).or_insert(0);
                    if counter <= *last {
                        self.refused_frames.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(counter, last = *last, "shm: dropped a notification whose counter is not above its sender's last (a replay)");
                        continue;
                    }
                    *last = counter;
                    out.push(note);
                }
                None => {
                    // Not of this protocol, or not from this cluster: dropped, not trusted.
                    self.unauthenticated.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(bytes = n, "shm: dropped a notification that does not prove the cluster secret");
                }
            }
        }
        out
    }

    fn unauthenticated(&self) -> u64 {
        ShmTransport::unauthenticated(self)
    }

    fn refused_frames(&self) -> u64 {
        ShmTransport::refused_frames(self)
    }
}

/// The notification in datagram `msg` when its MAC proves `secret` for the
/// receiver `to`, with its sender's endpoint bytes and counter.
fn authentic(secret: &ClusterSecret, to: &[u8], msg: &[u8]) -> Option<(Notification, Vec<u8>, u64)> {
    let head = msg.get(..4)?;
    let from_len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let from_end = 4usize.checked_add(from_len)?;
    let from = msg.get(4..from_end)?;
    let counter = msg.get(from_end..from_end + 8)?;
    let mac = msg.get(from_end + 8..from_end + 8 + 32)?;
    let bytes = &msg[from_end + 8 + 32..];
    if !secret.verify(context::SHM_NOTIFY, &[from, to, counter, bytes], mac) {
        return None;
    }
    let counter = u64::from_le_bytes(counter.try_into().ok()?);
    Some((Notification { from: serde_json::from_slice::<PeerAddr>(from).ok(), bytes: bytes.to_vec() }, from.to_vec(), counter))
}
