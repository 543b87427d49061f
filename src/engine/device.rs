//! Where the compute runs: the one place that turns a [`DeviceConfig`] (the
//! topology's `[device]` table, or a command's `--device`) into a backend.
//!
//! The model and [`ModelCompute`] are generic over [`Backend`](handoff_kernels::Backend); callers that must
//! pick a backend at run time go through [`with_backend!`](crate::with_backend), which opens the
//! chosen one and runs the same generic code on it. A backend this build or this
//! host cannot open (no feature, no driver, no device) is refused with the
//! backend's own reason, before any work starts.

use crate::engine::compute::ModelCompute;
use crate::model::ranks::Layouts;
use crate::model::regions::RegionView;
use handoff_components::Topology;
use handoff_components::config::{DeviceConfig, DeviceKind};
use handoff_kernels::{CpuBackend, CudaBackend, HipBackend};
use handoff_systems::dispatch::Compute;
use std::sync::Arc;

/// The device in force: `flag` (a command's `--device`) when given, else the
/// topology's `[device]` table.
pub fn resolve(topo: &Topology, flag: Option<&str>) -> anyhow::Result<DeviceConfig> {
    match flag {
        // The flag names the backend; the table's other settings stay.
        Some(s) => {
            let d = DeviceConfig::parse(s).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
            Ok(DeviceConfig { kind: d.kind, ordinal: d.ordinal, ..topo.config.device })
        }
        None => Ok(topo.config.device),
    }
}

/// Opens the CUDA backend on GPU `ordinal`, or says why it cannot.
pub fn open_cuda(ordinal: u32) -> anyhow::Result<CudaBackend> {
    CudaBackend::new(ordinal as usize).map_err(|e| anyhow::anyhow!("device cuda:{ordinal}: {e}"))
}

/// Opens the HIP backend on GPU `ordinal`, or says why it cannot.
pub fn open_hip(ordinal: u32) -> anyhow::Result<HipBackend> {
    HipBackend::new(ordinal as usize).map_err(|e| anyhow::anyhow!("device hip:{ordinal}: {e}"))
}

/// Runs `$body` with `$be` bound to the backend `$dev` names (a
/// [`DeviceConfig`]), opened fresh; `?` inside the expansion returns an
/// `anyhow::Error` when the backend cannot be opened.
#[macro_export]
macro_rules! with_backend {
    ($dev:expr, |$be:ident| $body:expr) => {{
        let dev: handoff_components::config::DeviceConfig = $dev;
        match dev.kind {
            handoff_components::config::DeviceKind::Cpu => {
                let $be = handoff_kernels::CpuBackend::new();
                $body
            }
            handoff_components::config::DeviceKind::Cuda => {
                let $be = $crate::engine::device::open_cuda(dev.ordinal)?;
                $body
            }
            handoff_components::config::DeviceKind::Hip => {
                let $be = $crate::engine::device::open_hip(dev.ordinal)?;
                $body
            }
        }
    }};
}

/// The role processes' [`Compute`]: the model on `dev`, reading and writing the
/// regions through `view`. A sampled request's logits go back with its step's
/// output, for the dispatch phase to sample from.
pub fn model_compute(dev: DeviceConfig, topo: &Topology, layouts: Layouts, view: Arc<dyn RegionView>) -> anyhow::Result<Box<dyn Compute>> {
    let mut topo = topo.clone();
    topo.config.device = dev;
    let topo = &topo;
    let boxed: Box<dyn Compute> = match dev.kind {
        DeviceKind::Cpu => Box::new(ModelCompute::new(topo, CpuBackend::new(), layouts, view)?),
        DeviceKind::Cuda => Box::new(ModelCompute::new(topo, open_cuda(dev.ordinal)?, layouts, view)?),
        DeviceKind::Hip => Box::new(ModelCompute::new(topo, open_hip(dev.ordinal)?, layouts, view)?),
    };
    Ok(boxed)
}
