//! The feature-off twin of this transport: the same type and API, every
//! constructor refusing with the reason (a build holds this one or the real one,
//! never both, so the name is declared once per build).

use super::super::{BatchCompletion, BatchId, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport, TransportError};
use super::{UcxOptions, unavailable};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::time::Duration;

/// A UCX transport. Cannot be constructed in this build (no `ucx` feature).
pub struct UcxTransport {
    _unconstructible: (),
}

impl UcxTransport {
    /// Refuses: built without the `ucx` feature.
    pub fn open(opts: UcxOptions) -> Result<Self> {
        let _ = opts;
        Err(unavailable("transport"))
    }

    /// Puts issued and their bytes (none: never constructed).
    pub fn put_stats(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Pieces stored into mapped peer regions and their bytes (none: never constructed).
    pub fn stored_stats(&self) -> (u64, u64) {
        (0, 0)
    }

    /// The byte-weighted mean write size (none: never constructed).
    pub fn weighted_write_size(&self) -> u64 {
        0
    }
}

impl Transport for UcxTransport {
    fn name(&self) -> &'static str {
        "ucx"
    }
    fn endpoint(&self) -> PeerAddr {
        unreachable!("UcxTransport cannot be constructed in this build")
    }
    fn register_memory(&self, _: RankId, _: RegionKind, _: u64, _: MemoryKind) -> Result<RegionHandle> {
        Err(unavailable("register"))
    }
    fn unregister(&self, _: &RegionHandle) -> Result<()> {
        Err(unavailable("unregister"))
    }
    fn attach(&self, _: &RegionHandle) -> Result<RemoteRegion> {
        Err(unavailable("attach"))
    }
    fn with_region(&self, _: &RegionHandle, _: &mut dyn FnMut(&[u8])) -> Result<()> {
        Err(unavailable("with_region"))
    }
    fn with_region_mut(&self, _: &RegionHandle, _: &mut dyn FnMut(&mut [u8])) -> Result<()> {
        Err(unavailable("with_region_mut"))
    }
    fn submit(&self, _: &RegionHandle, _: RemoteRegion, _: &[Descriptor]) -> Result<BatchId> {
        Err(unavailable("submit"))
    }
    fn poll(&self) -> Vec<BatchCompletion> {
        Vec::new()
    }
    fn wait(&self, batch: BatchId, _: Duration) -> Result<()> {
        Err(TransportError::UnknownBatch(batch))
    }
    fn notify(&self, _: &PeerAddr, _: &[u8]) -> Result<()> {
        Err(unavailable("notify"))
    }
    fn recv_notifications(&self) -> Vec<Notification> {
        Vec::new()
    }
}
