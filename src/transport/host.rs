//! Host memory regions and the bookkeeping that the in-host backends (local, shm)
//! share: region and attachment tables, synchronous submit, completions, inbox.

use super::{
    BatchCompletion, BatchId, Completions, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, TransportError, copy, lock, multicopy, pieces, read,
    validate, write,
};
use handoff_components::plan::Descriptor;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
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
        self.submit_all(&[(src, dst, descriptors)]).pop().unwrap_or_else(|| Err(TransportError::UnknownRegion(src.to_string())))
    }

    /// Validates each batch on its own, then copies every valid one in one
    /// pass ([`multicopy::copy_batches`]: each source read once, in order, for
    /// all the batches that read it); the completions are ready on return. A
    /// rejected batch moves nothing and fails alone.
    pub fn submit_all(&self, writes: &[(&RegionHandle, RemoteRegion, &[Descriptor])]) -> Vec<Result<BatchId>> {
        let mut results: Vec<Option<Result<BatchId>>> = writes.iter().map(|_| None).collect();
        let mut valid: Vec<(usize, Arc<HostRegion>, Arc<HostRegion>)> = Vec::new();
        for (i, &(src, dst, descriptors)) in writes.iter().enumerate() {
            match self.resolve(src, dst, descriptors) {
                Ok((s, d)) => valid.push((i, s, d)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        // A region that one batch reads and another (or the same) writes cannot
        // be borrowed both ways at once: such a group is copied batch by batch.
        let read_uids: HashSet<u64> = valid.iter().map(|(_, s, _)| s.uid).collect();
        if valid.iter().any(|(_, _, d)| read_uids.contains(&d.uid)) {
            for (i, s, d) in &valid {
                let _span = tracing::trace_span!("transport.copy", transport = self.name, batches = 1).entered();
                if Arc::ptr_eq(s, d) {
                    copy::copy_within(write(&s.mem).bytes_mut(), &pieces(writes[*i].2));
                } else {
                    copy_group(&[(Arc::clone(s), Arc::clone(d), writes[*i].2)]);
                }
            }
        } else if !valid.is_empty() {
            let _span = tracing::trace_span!("transport.copy", transport = self.name, batches = valid.len()).entered();
            let group: Vec<(Arc<HostRegion>, Arc<HostRegion>, &[Descriptor])> =
                valid.iter().map(|(i, s, d)| (Arc::clone(s), Arc::clone(d), writes[*i].2)).collect();
            copy_group(&group);
        }
        for (i, _, _) in &valid {
            let batch = self.completions.begin();
            self.completions.finish(batch, Ok(()));
            results[*i] = Some(Ok(batch));
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(TransportError::UnknownRegion("a batch that was not copied".into())))).collect()
    }

    /// A batch's local source and attached destination, its descriptors checked
    /// against both.
    fn resolve(&self, src: &RegionHandle, dst: RemoteRegion, descriptors: &[Descriptor]) -> Result<(Arc<HostRegion>, Arc<HostRegion>)> {
        let s = self.local(src)?;
        let d = read(&self.attachments).get(&dst.id).cloned().ok_or_else(|| TransportError::UnknownRegion(format!("attachment {}", dst.id)))?;
        validate(descriptors, Some(s.len), d.len, d.kind)?;
        Ok((s, d))
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

/// A region's lock, held for reading (a source) or writing (a destination).
enum Held<'a> {
    Read(RwLockReadGuard<'a, Mem>),
    Write(RwLockWriteGuard<'a, Mem>),
}

/// Copies validated batches whose sources are never destinations: locks every
/// region once, in `uid` order (so that concurrent groups cannot deadlock),
/// and hands the buffers to [`multicopy::copy_batches`].
fn copy_group(group: &[(Arc<HostRegion>, Arc<HostRegion>, &[Descriptor])]) {
    let mut regions: BTreeMap<u64, (&HostRegion, bool)> = BTreeMap::new();
    for (s, d, _) in group {
        regions.entry(s.uid).or_insert((s, false));
        regions.insert(d.uid, (d, true));
    }
    let mut held: Vec<(u64, Held)> =
        regions.iter().map(|(&uid, &(r, w))| (uid, if w { Held::Write(write(&r.mem)) } else { Held::Read(read(&r.mem)) })).collect();
    let (mut srcs, mut dsts): (Vec<&[u8]>, Vec<&mut [u8]>) = (Vec::new(), Vec::new());
    let (mut src_at, mut dst_at): (HashMap<u64, usize>, HashMap<u64, usize>) = (HashMap::new(), HashMap::new());
    for (uid, h) in held.iter_mut() {
        match h {
            Held::Read(g) => {
                src_at.insert(*uid, srcs.len());
                srcs.push(g.bytes());
            }
            Held::Write(g) => {
                dst_at.insert(*uid, dsts.len());
                dsts.push(g.bytes_mut());
            }
        }
    }
    let batches: Vec<multicopy::Batch> =
        group.iter().map(|(s, d, descriptors)| multicopy::Batch { src: src_at[&s.uid], dst: dst_at[&d.uid], descriptors }).collect();
    multicopy::copy_batches(&srcs, &mut dsts, &batches);
}
