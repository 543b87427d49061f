//! Compute ops of handoff behind one backend trait.
//!
//! [`Backend`] owns its buffers ([`Backend::Buf`] f32, [`Backend::IBuf`] i32)
//! and exposes the model's ops on them: the KDA recurrent step and chunked
//! prefill, ReplaySSM record/commit, the short conv, RMSNorm and the gated
//! output norm, absorbed MLA prefill and decode with LSE, the DCP LSE merge
//! (and their f64 forms: decode partials and their merge, which do not depend
//! on the DCP decomposition),
//! matmul, SwiGLU (and its activation alone), embedding, argmax, the residual
//! add, and the copies and storage rounding the model needs between them. The math is
//! docs/design.md section 5.
//!
//! [`CpuBackend`] is the reference (f32 storage and accumulation, rayon).
//! [`CudaBackend`] runs the same ops on an NVIDIA GPU with the `cuda` feature
//! (NVRTC-compiled kernels, driver loaded at run time) and refuses with
//! [`KernelError::BackendUnavailable`] without it or without a driver;
//! [`HipBackend`] (feature `hip`, never run on AMD hardware) runs only the fused
//! decode step, through the same launch table as CUDA, and refuses every
//! other op by name. The device kernel sources live in `kernels/hip/` (see
//! [`HIP_SOURCES`]).

pub mod backend;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod gpu;
pub mod region;
pub mod rng;
pub mod shapes;
pub mod step;

#[cfg(test)]
pub(crate) mod testutil;

pub use backend::{Backend, kda_prefill_ragged_by_copies};
pub use cpu::{CpuBackend, CpuBuf, CpuF64Buf, CpuIBuf, KDA_CHUNK};
pub use dtype::StorageDtype;
pub use error::{KernelError, Result};
pub use gpu::{
    CudaBackend, CudaBuf, CudaF64Buf, CudaIBuf, HIP_CODE_OBJECTS, HIP_PRELUDE, HIP_SOURCES, HipBackend, HipBuf, HipF64Buf, HipIBuf, KdaKernel, NoBuf,
    cuda_device_memory, device_program, hip_device_memory,
};
pub use region::{
    Copy2d, CopyStamp, CopyTicket, DeviceMemory, DeviceRegion, RegionItems, SMALL_TABLE_COPIES, StreamMark, TABLE_COPIES, WIDE_TABLE_COPIES, table_launches,
};
pub use rng::SplitMix64;
pub use shapes::*;
