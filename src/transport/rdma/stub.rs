//! The feature-off twin of this transport: the same type and API, every
//! constructor refusing with the reason (a build holds this one or the real one,
//! never both, so the name is declared once per build).

use super::options::{RdmaError, RdmaOptions};
use crate::transport::{BatchCompletion, BatchId, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport, TransportError};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::time::Duration;

/// An RDMA transport on one verbs device. Cannot be constructed in this build.
pub struct RdmaTransport {
    _unconstructible: (),
}

impl RdmaTransport {
    pub fn open_with(_: RdmaOptions) -> std::result::Result<Self, RdmaError> {
        Err(RdmaError::NotBuilt)
    }
    /// The verbs device in use.
    pub fn device(&self) -> &str {
        unreachable!("RdmaTransport cannot be constructed in this build")
    }
}

fn unavailable(what: &str) -> TransportError {
    TransportError::Unavailable { what: format!("rdma {what}"), reason: RdmaError::NotBuilt.to_string() }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }
    fn endpoint(&self) -> PeerAddr {
        unreachable!("RdmaTransport cannot be constructed in this build")
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
