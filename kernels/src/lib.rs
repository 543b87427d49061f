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
//! design.md section 5.
//!
//! [`CpuBackend`] is the reference (f32 storage and accumulation, rayon).
//! [`CudaBackend`] and [`HipBackend`] are stubs that refuse with
//! [`KernelError::BackendUnavailable`]; the device kernel sources live in
//! `kernels/hip/` (see [`KDA_DECODE_HIP`]).

pub mod backend;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod gpu;
pub mod rng;
pub mod shapes;

#[cfg(test)]
pub(crate) mod testutil;

pub use backend::Backend;
pub use dtype::StorageDtype;
pub use cpu::{CpuBackend, CpuBuf, CpuF64Buf, CpuIBuf, KDA_CHUNK};
pub use error::{KernelError, Result};
pub use gpu::{CudaBackend, HipBackend, KDA_DECODE_HIP, NoBuf};
pub use rng::SplitMix64;
pub use shapes::*;
