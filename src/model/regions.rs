//! Byte access to registered regions, for the compute path's caches.
//!
//! The model never names a transport or the oracle: prefill ranks store into, and
//! decode ranks read and write, regions through a [`RegionView`]. The roles
//! implement it over their transport's registered regions; verify and the tests
//! over a plain host map (the impl below). Callers take the view once per (rank,
//! kind) per layer per step and do all of that step's rows inside, because a
//! transport-backed view takes a lock per call.

use super::ModelError;
use handoff_components::vocab::{RankId, RegionKind};
use handoff_kernels::DeviceRegion;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Byte access to the registered regions of this process's ranks: host bytes,
/// or device regions that the backend's region ops reach in place. The roles implement it over
/// their transport's registered regions, verify and tests over plain host maps.
pub trait RegionView: Send + Sync {
    /// Calls `f` with the bytes of `rank`'s `kind` region.
    fn with(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&[u8])) -> Result<(), ModelError>;
    /// Calls `f` with the bytes of `rank`'s `kind` region, writable.
    fn with_mut(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&mut [u8])) -> Result<(), ModelError>;
    /// The region in device memory, when it lives there: then the model reaches
    /// it with the backend's region ops, in place, and never through `with`.
    fn device(&self, rank: RankId, kind: RegionKind) -> Option<DeviceRegion> {
        let _ = (rank, kind);
        None
    }

    /// `len` bytes at `off` of a region, copied out (a check's snapshot of
    /// what a request holds).
    fn read_bytes(&self, rank: RankId, kind: RegionKind, off: u64, len: usize) -> Result<Vec<u8>, ModelError> {
        let mut out = Err(ModelError::Region(format!("{rank} {kind}: the region view did not call back")));
        self.with(rank, kind, &mut |bytes| out = span(bytes, rank, kind, off, len).map(|b| b.to_vec()))?;
        out
    }
}

/// Host regions by (rank, kind), as verify and the tests hold them (the shape of
/// `oracle::Memory`). One lock per call.
impl RegionView for Mutex<BTreeMap<(RankId, RegionKind), Vec<u8>>> {
    fn with(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&[u8])) -> Result<(), ModelError> {
        let map = self.lock().map_err(|_| ModelError::Region(format!("{rank} {kind}: region map lock poisoned")))?;
        let bytes = map.get(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} has no {kind} memory")))?;
        f(bytes);
        Ok(())
    }

    fn with_mut(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&mut [u8])) -> Result<(), ModelError> {
        let mut map = self.lock().map_err(|_| ModelError::Region(format!("{rank} {kind}: region map lock poisoned")))?;
        let bytes = map.get_mut(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} has no {kind} memory")))?;
        f(bytes);
        Ok(())
    }
}

/// [`RegionView::with`] for a closure that can fail and return a value.
pub fn read<T>(view: &dyn RegionView, rank: RankId, kind: RegionKind, f: impl FnOnce(&[u8]) -> Result<T, ModelError>) -> Result<T, ModelError> {
    let mut f = Some(f);
    let mut out = None;
    view.with(rank, kind, &mut |b| {
        if let Some(f) = f.take() {
            out = Some(f(b));
        }
    })?;
    out.unwrap_or_else(|| Err(ModelError::Region(format!("{rank} {kind}: the region view did not call back"))))
}

/// [`RegionView::with_mut`] for a closure that can fail and return a value.
pub fn write<T>(view: &dyn RegionView, rank: RankId, kind: RegionKind, f: impl FnOnce(&mut [u8]) -> Result<T, ModelError>) -> Result<T, ModelError> {
    let mut f = Some(f);
    let mut out = None;
    view.with_mut(rank, kind, &mut |b| {
        if let Some(f) = f.take() {
            out = Some(f(b));
        }
    })?;
    out.unwrap_or_else(|| Err(ModelError::Region(format!("{rank} {kind}: the region view did not call back"))))
}

/// `len` bytes at `off` of a region's bytes, or an error naming the region.
pub fn span(bytes: &[u8], rank: RankId, kind: RegionKind, off: u64, len: usize) -> Result<&[u8], ModelError> {
    let total = bytes.len();
    usize::try_from(off)
        .ok()
        .and_then(|o| o.checked_add(len).map(|e| (o, e)))
        .and_then(|(o, e)| bytes.get(o..e))
        .ok_or_else(|| ModelError::Region(format!("{rank} {kind}: {off}+{len} outside {total} bytes")))
}

/// [`span`], writable.
pub fn span_mut(bytes: &mut [u8], rank: RankId, kind: RegionKind, off: u64, len: usize) -> Result<&mut [u8], ModelError> {
    let total = bytes.len();
    usize::try_from(off)
        .ok()
        .and_then(|o| o.checked_add(len).map(|e| (o, e)))
        .and_then(move |(o, e)| bytes.get_mut(o..e))
        .ok_or_else(|| ModelError::Region(format!("{rank} {kind}: {off}+{len} outside {total} bytes")))
}

/// Registered regions in a backend's device memory, by (rank, kind), as verify
/// and the compute bench hold them on a GPU: the model reaches them in place
/// through the backend's region ops and the fused decode step, exactly as the
/// roles' regions; `with` and `with_mut` copy a whole region to the host and
/// back (for setup and the oracle's checks only).
pub struct DeviceRegions {
    pub mem: std::sync::Arc<dyn handoff_kernels::DeviceMemory>,
    pub regions: BTreeMap<(RankId, RegionKind), DeviceRegion>,
}

impl DeviceRegions {
    /// Allocates every region of `sizes` (zeroed) in `mem`.
    pub fn alloc(mem: std::sync::Arc<dyn handoff_kernels::DeviceMemory>, sizes: &[((RankId, RegionKind), u64)]) -> Result<DeviceRegions, ModelError> {
        let mut regions = BTreeMap::new();
        for &(key, len) in sizes {
            let addr = mem.alloc(len.max(1)).map_err(|e| ModelError::Region(format!("{} {}: {e}", key.0, key.1)))?;
            regions.insert(key, DeviceRegion { addr, len });
        }
        Ok(DeviceRegions { mem, regions })
    }

    fn get(&self, rank: RankId, kind: RegionKind) -> Result<DeviceRegion, ModelError> {
        self.regions.get(&(rank, kind)).copied().ok_or_else(|| ModelError::Region(format!("{rank} has no {kind} region")))
    }

    /// The bytes of a region, copied to the host.
    pub fn read_all(&self, rank: RankId, kind: RegionKind) -> Result<Vec<u8>, ModelError> {
        let r = self.get(rank, kind)?;
        let mut out = vec![0u8; r.len as usize];
        // SAFETY: the range is the whole of a live allocation of `mem`.
        unsafe { self.mem.read(r.addr, &mut out) }.map_err(|e| ModelError::Region(format!("{rank} {kind}: {e}")))?;
        Ok(out)
    }

    /// Overwrites a whole region with `data` (its length).
    pub fn write_all(&self, rank: RankId, kind: RegionKind, data: &[u8]) -> Result<(), ModelError> {
        let r = self.get(rank, kind)?;
        if data.len() as u64 != r.len {
            return Err(ModelError::Region(format!("{rank} {kind}: {} bytes for a region of {}", data.len(), r.len)));
        }
        // SAFETY: as in read_all.
        unsafe { self.mem.write(r.addr, data) }.map_err(|e| ModelError::Region(format!("{rank} {kind}: {e}")))
    }
}

impl Drop for DeviceRegions {
    fn drop(&mut self) {
        for r in self.regions.values() {
            // SAFETY: every region came from `mem.alloc`; whoever dropped the
            // regions waited for the copies and kernels that used them.
            unsafe { self.mem.free(r.addr) };
        }
    }
}

impl RegionView for DeviceRegions {
    fn with(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&[u8])) -> Result<(), ModelError> {
        let bytes = self.read_all(rank, kind)?;
        f(&bytes);
        Ok(())
    }

    fn with_mut(&self, rank: RankId, kind: RegionKind, f: &mut dyn FnMut(&mut [u8])) -> Result<(), ModelError> {
        let mut bytes = self.read_all(rank, kind)?;
        f(&mut bytes);
        self.write_all(rank, kind, &bytes)
    }

    fn device(&self, rank: RankId, kind: RegionKind) -> Option<DeviceRegion> {
        self.regions.get(&(rank, kind)).copied()
    }

    fn read_bytes(&self, rank: RankId, kind: RegionKind, off: u64, len: usize) -> Result<Vec<u8>, ModelError> {
        let r = self.get(rank, kind)?;
        if off.checked_add(len as u64).is_none_or(|e| e > r.len) {
            return Err(ModelError::Region(format!("{rank} {kind}: {off}+{len} outside {} bytes", r.len)));
        }
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside the region, a live allocation of `mem`.
        unsafe { self.mem.read(r.addr + off, &mut out) }.map_err(|e| ModelError::Region(format!("{rank} {kind}: {e}")))?;
        Ok(out)
    }
}
