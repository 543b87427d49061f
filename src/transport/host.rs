//! Host memory regions and the bookkeeping that the in-host backends (local, shm)
//! share: region and attachment tables, synchronous submit, completions, inbox.

use super::{
    BatchCompletion, BatchId, Completions, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, TransportError, copy, lock, pieces, read, validate,
    write,
};
use handoff_components::plan::Descriptor;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// The bytes behind a region: a heap buffer or a shared mapping.
pub(crate) enum Mem {
    Heap(Vec<u8>),
    Map(memmap2::MmapMut),
}

impl Mem {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Mem::Heap(v) => v,
            Mem::Map(m) => m,
        }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Mem::Heap(v) => v,
            Mem::Map(m) => m,
        }
    }
}

/// One region's memory, with an id that orders lock acquisition across regions
/// (so that concurrent A->B and B->A copies cannot deadlock).
pub(crate) struct HostRegion {
    pub uid: u64,
    pub kind: handoff_components::vocab::RegionKind,
    pub len: u64,
    pub mem: RwLock<Mem>,
}

impl HostRegion {
    pub fn new(kind: handoff_components::vocab::RegionKind, len: u64, mem: Mem) -> Arc<Self> {
        static UID: AtomicU64 = AtomicU64::new(1);
        Arc::new(HostRegion { uid: UID.fetch_add(1, Ordering::Relaxed), kind, len, mem: RwLock::new(mem) })
    }
}

/// Tables and queues of one in-host transport instance.
pub(crate) struct HostCore {
    pub name: &'static str,
    pub endpoint: PeerAddr,
    next_id: AtomicU64,
    pub regions: RwLock<HashMap<u64, Arc<HostRegion>>>,
    attachments: RwLock<HashMap<u64, Arc<HostRegion>>>,
    completions: Completions,
    inbox: Mutex<Vec<Notification>>,
}

impl HostCore {
    pub fn new(name: &'static str, endpoint: PeerAddr) -> Self {
        HostCore {
            name,
            endpoint,
            next_id: AtomicU64::new(1),
            regions: RwLock::new(HashMap::new()),
            attachments: RwLock::new(HashMap::new()),
            completions: Completions::default(),
            inbox: Mutex::new(Vec::new()),
        }
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn insert(&self, id: u64, region: Arc<HostRegion>) {
        write(&self.regions).insert(id, region);
    }

    pub fn remove(&self, handle: &RegionHandle) -> Result<Arc<HostRegion>> {
        self.check_owner(handle)?;
        write(&self.regions).remove(&handle.id).ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }

    fn check_owner(&self, handle: &RegionHandle) -> Result<()> {
        if handle.peer != self.endpoint {
            return Err(TransportError::ForeignHandle { handle: handle.to_string(), owner: handle.peer.to_string(), transport: self.name });
        }
        Ok(())
    }

    /// A region registered here.
    pub fn local(&self, handle: &RegionHandle) -> Result<Arc<HostRegion>> {
        self.check_owner(handle)?;
        read(&self.regions).get(&handle.id).cloned().ok_or_else(|| TransportError::UnknownRegion(handle.to_string()))
    }

    pub fn attach_region(&self, region: Arc<HostRegion>) -> RemoteRegion {
        let id = self.next_id();
        let remote = RemoteRegion { id, kind: region.kind, len: region.len };
        write(&self.attachments).insert(id, region);
        remote
    }

    pub fn with_region(&self, handle: &RegionHandle, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let r = self.local(handle)?;
        let g = read(&r.mem);
        f(g.bytes());
        Ok(())
    }

    pub fn with_region_mut(&self, handle: &RegionHandle, f: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        let r = self.local(handle)?;
        let mut g = write(&r.mem);
        f(g.bytes_mut());
        Ok(())
    }

    /// Validates, then copies synchronously; the completion is ready on return.
    pub fn submit(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<BatchId> {
        let s = self.local(src)?;
        let d = read(&self.attachments).get(&dst.id).cloned().ok_or_else(|| TransportError::UnknownRegion(format!("attachment {}", dst.id)))?;
        validate(descriptors, Some(s.len), d.len, d.kind)?;
        let ps = pieces(descriptors);
        let _span = tracing::trace_span!("transport.copy", transport = self.name, pieces = ps.len()).entered();
        if Arc::ptr_eq(&s, &d) {
            copy::copy_within(write(&s.mem).bytes_mut(), &ps);
        } else if s.uid < d.uid {
            let sg = read(&s.mem);
            let mut dg = write(&d.mem);
            copy::copy_between(sg.bytes(), dg.bytes_mut(), &ps);
        } else {
            let mut dg = write(&d.mem);
            let sg = read(&s.mem);
            copy::copy_between(sg.bytes(), dg.bytes_mut(), &ps);
        }
        let batch = self.completions.begin();
        self.completions.finish(batch, Ok(()));
        Ok(batch)
    }

    pub fn poll(&self) -> Vec<BatchCompletion> {
        self.completions.poll()
    }

    pub fn wait(&self, batch: BatchId, timeout: Duration) -> Result<()> {
        self.completions.wait(batch, timeout)
    }

    pub fn deliver(&self, n: Notification) {
        lock(&self.inbox).push(n);
    }

    pub fn take_inbox(&self) -> Vec<Notification> {
        std::mem::take(&mut *lock(&self.inbox))
    }
}
