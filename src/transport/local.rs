//! In-process transport: regions are heap buffers, submit copies them with rayon.
//!
//! Several `LocalTransport`s in one process reach each other through a process-wide
//! table of live instances, so that tests and single-process deployments can give
//! every rank its own transport, as separate processes would have.

use super::host::{HostCore, HostRegion, Mem};
use super::{
    BatchCompletion, BatchId, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport, TransportError, host_only, lock, usize_len,
};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

fn instances() -> &'static Mutex<HashMap<u64, Weak<HostCore>>> {
    static INSTANCES: OnceLock<Mutex<HashMap<u64, Weak<HostCore>>>> = OnceLock::new();
    INSTANCES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The in-process transport. Completions are ready when `submit` returns.
pub struct LocalTransport {
    instance: u64,
    core: Arc<HostCore>,
}

impl Default for LocalTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalTransport {
    pub fn new() -> Self {
        let instance = super::nonce();
        let core = Arc::new(HostCore::new("local", PeerAddr::Local { instance }));
        lock(instances()).insert(instance, Arc::downgrade(&core));
        LocalTransport { instance, core }
    }

    fn peer(&self, addr: &PeerAddr) -> Result<Arc<HostCore>> {
        let PeerAddr::Local { instance } = addr else {
            return Err(TransportError::Unavailable {
                what: format!("peer {addr}"),
                reason: "the local transport reaches only local instances in this process".into(),
            });
        };
        lock(instances())
            .get(instance)
            .and_then(Weak::upgrade)
            .ok_or_else(|| TransportError::Disconnected { peer: addr.to_string(), reason: "no such live instance in this process".into() })
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        lock(instances()).remove(&self.instance);
    }
}

impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        "local"
    }

    fn endpoint(&self) -> PeerAddr {
        self.core.endpoint.clone()
    }

    fn register_memory(&self, rank: RankId, kind: RegionKind, len: u64, memory: MemoryKind) -> Result<RegionHandle> {
        host_only(memory, "local")?;
        let bytes = vec![0u8; usize_len(len)?];
        let id = self.core.next_id();
        self.core.insert(id, HostRegion::new(kind, len, Mem::Heap(bytes)));
        Ok(RegionHandle { peer: self.endpoint(), id, rank, kind, len, memory, ipc: None, remote_key: None })
    }

    fn unregister(&self, handle: &RegionHandle) -> Result<()> {
        self.core.remove(handle).map(drop)
    }

    /// Regions of this process: a write is a memcpy.
    fn writes_in_place(&self, _: RemoteRegion) -> bool {
        true
    }

    fn attach(&self, handle: &RegionHandle) -> Result<RemoteRegion> {
        let owner = self.peer(&handle.peer)?;
        let region = owner.local(handle)?;
        if region.len != handle.len || region.kind != handle.kind {
            return Err(TransportError::UnknownRegion(format!("{handle} (the owner holds {} B of {})", region.len, region.kind)));
        }
        Ok(self.core.attach_region(region))
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
        self.peer(peer)?.deliver(Notification { from: Some(self.endpoint()), bytes: bytes.to_vec() });
        Ok(())
    }

    fn recv_notifications(&self) -> Vec<Notification> {
        self.core.take_inbox()
    }
}
