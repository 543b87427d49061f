//! RDMA (ibverbs) backend: the API, with no verbs behind it yet.
//!
//! Built without the `rdma` feature, [`RdmaTransport::open`] says so; built with it,
//! it says that the verbs path is not written yet. Either way the rest of the engine
//! compiles against the same types (a disabled backend is a stub
//! that returns a clear error). Handles already carry [`super::MemoryKind`] so that
//! registered device memory (GPUDirect) needs no API change.

use super::{BatchCompletion, BatchId, MemoryKind, Notification, PeerAddr, RegionHandle, RemoteRegion, Result, Transport, TransportError};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{RankId, RegionKind};
use std::time::Duration;

/// An RDMA transport on one verbs device. Cannot be constructed in this build.
pub struct RdmaTransport {
    _unconstructible: (),
}

fn unavailable(what: &str) -> TransportError {
    let reason = if cfg!(feature = "rdma") {
        "the ibverbs backend is not implemented in this build yet".to_string()
    } else {
        "built without the `rdma` feature (cargo build --features rdma)".to_string()
    };
    TransportError::Unavailable { what: format!("rdma {what}"), reason }
}

impl RdmaTransport {
    /// Opens verbs device `device` (e.g. `mlx5_0`).
    pub fn open(device: &str) -> Result<Self> {
        Err(unavailable(&format!("device {device}")))
    }
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
