//! Layer marks: an event recorded on a backend's stream after a prefill
//! layer's work ([`crate::Backend::mark_layer`]), that the copy streams of
//! device memory for regions wait on, on the device
//! ([`crate::DeviceMemory::copy_after`]: `cuStreamWaitEvent`,
//! `hipStreamWaitEvent`). The host never waits for the layer.
//!
//! A role opens its backend and its transport's device memory apart (both on
//! the device's primary context, `roles/host.rs`), and a mark crosses the
//! engine's phases as plain data (its id), so the two meet here: one
//! registry a driver type, process-wide, from mark id to event.
//!
//! An event is recorded again for a later mark only once its last record has
//! completed (an event query). So a mark whose id is no longer in the
//! registry, and was given out before, is complete: a copy queued after it
//! needs no wait. The events of one backend are as many as its marks not yet
//! complete (a stage's layers at most, the host running ahead of the
//! device), kept and recorded again for later passes; they are destroyed with
//! the backend, after their work.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::error::{KernelError, Result};
use crate::gpu::launch::{MemoryDriver, dev};
use crate::region::StreamMark;

/// Mark ids: process-wide, from 1, never reused.
static NEXT_MARK: AtomicU64 = AtomicU64::new(1);
/// Owners (backends) of events.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// One event of one backend, and the mark its last record stands for.
struct Slot<D: MemoryDriver> {
    fence: D::Fence,
    owner: u64,
    mark: Option<u64>,
}

/// The events of every backend on driver type `D`.
pub(crate) struct Registry<D: MemoryDriver> {
    slots: Vec<Slot<D>>,
    /// Live mark id -> its slot.
    by_mark: HashMap<u64, usize>,
}

impl<D: MemoryDriver> Registry<D> {
    fn reindex(&mut self) {
        self.by_mark = self.slots.iter().enumerate().filter_map(|(i, s)| s.mark.map(|m| (m, i))).collect();
    }
}

/// The registry of driver type `D` (statics cannot be generic: one per type,
/// made on first use and kept for the process).
fn registry<D: MemoryDriver>() -> Result<MutexGuard<'static, Registry<D>>> {
    type All = Mutex<HashMap<TypeId, &'static (dyn Any + Send + Sync)>>;
    static ALL: OnceLock<All> = OnceLock::new();
    let reg: &'static (dyn Any + Send + Sync) = {
        let mut all = ALL.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        *all.entry(TypeId::of::<D>()).or_insert_with(|| {
            let r: &'static Mutex<Registry<D>> = Box::leak(Box::new(Mutex::new(Registry::<D> { slots: Vec::new(), by_mark: HashMap::new() })));
            r
        })
    };
    let reg = reg
        .downcast_ref::<Mutex<Registry<D>>>()
        .ok_or_else(|| KernelError::InvalidShape { op: "layer mark", reason: "the mark registry of a driver type holds another type".into() })?;
    Ok(reg.lock().unwrap_or_else(|p| p.into_inner()))
}

/// What a backend records its marks with (object-safe: `GpuBackend<D>` runs on
/// any `Driver`, and only a memory driver has events to record).
pub(crate) trait MarkLayer: Send + Sync {
    /// Records a new mark on the backend's stream, after everything queued.
    fn mark(&self) -> Result<StreamMark>;
    /// Events this backend holds (the tests' bound).
    #[cfg_attr(not(test), allow(dead_code))]
    fn events(&self) -> usize;
}

/// The marks of one backend: its stream, and its events in the registry.
pub(crate) struct Marker<D: MemoryDriver> {
    drv: D,
    owner: u64,
}

impl<D: MemoryDriver> Marker<D> {
    pub(crate) fn new(drv: D) -> Self {
        Marker { drv, owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed) }
    }
}

impl<D: MemoryDriver> MarkLayer for Marker<D> {
    fn mark(&self) -> Result<StreamMark> {
        let op = "layer mark";
        let mut reg = registry::<D>()?;
        // An event of this backend whose last record has completed (or was
        // never made) is recorded again; a failed query keeps it out.
        let free = reg.slots.iter().position(|s| s.owner == self.owner && (s.mark.is_none() || self.drv.fence_done(&s.fence).unwrap_or(false)));
        let i = match free {
            Some(i) => {
                if let Some(old) = reg.slots[i].mark.take() {
                    reg.by_mark.remove(&old);
                }
                i
            }
            None => {
                let fence = self.drv.new_fence().map_err(dev(op))?;
                reg.slots.push(Slot { fence, owner: self.owner, mark: None });
                reg.slots.len() - 1
            }
        };
        self.drv.record_fence(&reg.slots[i].fence).map_err(dev(op))?;
        let id = NEXT_MARK.fetch_add(1, Ordering::Relaxed);
        reg.slots[i].mark = Some(id);
        reg.by_mark.insert(id, i);
        Ok(StreamMark(id))
    }

    fn events(&self) -> usize {
        registry::<D>().map(|r| r.slots.iter().filter(|s| s.owner == self.owner).count()).unwrap_or(0)
    }
}

impl<D: MemoryDriver> Drop for Marker<D> {
    fn drop(&mut self) {
        let Ok(mut reg) = registry::<D>() else { return };
        // A mark that leaves the registry must be complete (see the module
        // docs): wait for this backend's last records before their events go.
        for s in reg.slots.iter().filter(|s| s.owner == self.owner && s.mark.is_some()) {
            let _ = self.drv.fence_wait(&s.fence);
        }
        reg.slots.retain(|s| s.owner != self.owner);
        reg.reindex();
    }
}

/// Queues, on `stream`, a device-side wait for each of `marks`: the work
/// queued on `stream` after this call starts once every mark's layer has run.
/// A mark no longer in the registry was complete before its event was
/// recorded again (nothing to wait for); an id never given out is an error.
pub(crate) fn wait_on<D: MemoryDriver>(stream: &D, marks: &[StreamMark]) -> Result<()> {
    if marks.is_empty() {
        return Ok(());
    }
    let op = "wait on layer mark";
    // Held across the waits: an event is not recorded again between the
    // look-up and the wait that must see this record.
    let reg = registry::<D>()?;
    let mut seen: Vec<u64> = Vec::with_capacity(marks.len());
    for &StreamMark(id) in marks {
        if seen.contains(&id) {
            continue;
        }
        seen.push(id);
        match reg.by_mark.get(&id) {
            Some(&i) => stream.wait_fence(&reg.slots[i].fence).map_err(dev(op))?,
            None if id == 0 || id >= NEXT_MARK.load(Ordering::Relaxed) => {
                return Err(KernelError::InvalidShape { op, reason: format!("layer mark {id} was never recorded in this process") });
            }
            None => {}
        }
    }
    Ok(())
}
