//! GPU backends. Not wired to a device runtime yet: `CudaBackend` and
//! `HipBackend` are stubs with the full [`Backend`] API whose constructors
//! return [`KernelError::BackendUnavailable`], with or without their feature,
//! so callers compile and fail the same way everywhere (as candle does).
//! The kernel sources for the device live in `kernels/hip/`.

use crate::backend::Backend;
use crate::dtype::StorageDtype;
use crate::error::{KernelError, Result};
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaStepShape,
    MatmulShape, MergeShape, MlaShape, MlpShape, MlpWeights, NormShape, ReplayShape, RowSet,
};

/// HIP/CUDA-common source of the KDA recurrent decode step (`kda_decode_step`),
/// for hipcc and NVRTC.
pub const KDA_DECODE_HIP: &str = include_str!("../hip/kda_decode.hip");

/// The buffer type of a backend that cannot exist in this build: it has no
/// values, so no op of a stub backend can ever receive one.
#[derive(Debug)]
pub enum NoBuf {}

macro_rules! stub_backend {
    ($(#[$doc:meta])* $name:ident, $label:literal, $enabled:expr, $off:literal, $on:literal) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            _unconstructible: (),
        }

        impl $name {
            /// Opens device `device`. In this build it always fails with
            /// `BackendUnavailable`, saying why.
            pub fn new(device: usize) -> Result<Self> {
                let _ = device;
                Err(Self::unavailable())
            }

            /// Whether this build could ever construct the backend.
            pub fn is_available() -> bool {
                false
            }

            fn unavailable() -> KernelError {
                KernelError::BackendUnavailable(if $enabled { $on } else { $off }.to_string())
            }
        }

        impl Backend for $name {
            type Buf = NoBuf;
            type IBuf = NoBuf;
            type F64Buf = NoBuf;

            fn name(&self) -> &'static str {
                $label
            }
            fn alloc(&self, _: usize) -> Result<NoBuf> {
                Err(Self::unavailable())
            }
            fn upload(&self, _: &[f32]) -> Result<NoBuf> {
                Err(Self::unavailable())
            }
            fn upload_into(&self, dst: &mut NoBuf, _: usize, _: &[f32]) -> Result<()> {
                match *dst {}
            }
            fn download(&self, buf: &NoBuf) -> Result<Vec<f32>> {
                match *buf {}
            }
            fn buf_len(&self, buf: &NoBuf) -> usize {
                match *buf {}
            }
            fn alloc_i32(&self, _: usize) -> Result<NoBuf> {
                Err(Self::unavailable())
            }
            fn upload_i32(&self, _: &[i32]) -> Result<NoBuf> {
                Err(Self::unavailable())
            }
            fn download_i32(&self, buf: &NoBuf) -> Result<Vec<i32>> {
                match *buf {}
            }
            fn alloc_f64(&self, _: usize) -> Result<NoBuf> {
                Err(Self::unavailable())
            }
            fn upload_f64(&self, _: &[f64]) -> Result<NoBuf> {
                Err(Self::unavailable())
            }
            fn download_f64(&self, buf: &NoBuf) -> Result<Vec<f64>> {
                match *buf {}
            }
            fn mla_decode_partial(&self, _: MlaShape, q_lat: &NoBuf, _: RowSet<'_, NoBuf>, _: &mut NoBuf) -> Result<()> {
                match *q_lat {}
            }
            fn dcp_merge_partials(&self, _: MergeShape, partials: &NoBuf, _: &mut NoBuf, _: &mut NoBuf) -> Result<()> {
                match *partials {}
            }
            fn mla_decode_partial_ragged(&self, _: MlaShape, q_lat: &NoBuf, _: &NoBuf, _: &[usize], _: &mut NoBuf) -> Result<()> {
                match *q_lat {}
            }
            fn copy_f64(&self, src: &NoBuf, _: usize, _: &mut NoBuf, _: usize, _: usize) -> Result<()> {
                match *src {}
            }
            fn round_to(&self, buf: &mut NoBuf, _: StorageDtype) -> Result<()> {
                match *buf {}
            }
            fn silu_mul(&self, gate: &NoBuf, _: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *gate {}
            }
            fn fill(&self, buf: &mut NoBuf, _: f32) -> Result<()> {
                match *buf {}
            }
            fn copy(&self, src: &NoBuf, _: usize, _: &mut NoBuf, _: usize, _: usize) -> Result<()> {
                match *src {}
            }
            fn copy_cols(&self, _: ColsCopy, src: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *src {}
            }
            fn kda_step(
                &self,
                _: KdaStepShape,
                state: &mut NoBuf,
                _: KdaInputs<'_, NoBuf>,
                _: KdaParams<'_, NoBuf>,
                _: &mut NoBuf,
                _: Option<&mut NoBuf>,
            ) -> Result<()> {
                match *state {}
            }
            fn kda_prefill(
                &self,
                _: KdaPrefillShape,
                state: &mut NoBuf,
                _: KdaInputs<'_, NoBuf>,
                _: KdaParams<'_, NoBuf>,
                _: &mut NoBuf,
                _: Option<&mut NoBuf>,
            ) -> Result<()> {
                match *state {}
            }
            fn replay_append(&self, _: ReplayShape, _: usize, ring: &mut NoBuf, _: &mut NoBuf, _: &NoBuf) -> Result<()> {
                match *ring {}
            }
            fn replay_commit(&self, _: ReplayShape, state: &mut NoBuf, _: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *state {}
            }
            fn conv_prefill(&self, _: ConvShape, _: usize, x: &NoBuf, _: &NoBuf, _: &mut NoBuf, _: &mut NoBuf) -> Result<()> {
                match *x {}
            }
            fn conv_step(&self, _: ConvShape, _: usize, x: &NoBuf, _: &NoBuf, _: &mut NoBuf, _: &mut NoBuf) -> Result<()> {
                match *x {}
            }
            fn rms_norm(&self, _: NormShape, x: &NoBuf, _: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *x {}
            }
            fn gated_rms_norm(&self, _: NormShape, o: &NoBuf, _: &NoBuf, _: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *o {}
            }
            fn mla_prefill(
                &self,
                _: MlaShape,
                _: usize,
                q_lat: &NoBuf,
                _: RowSet<'_, NoBuf>,
                _: &mut NoBuf,
                _: Option<&mut NoBuf>,
            ) -> Result<()> {
                match *q_lat {}
            }
            fn mla_decode(&self, _: MlaShape, q_lat: &NoBuf, _: RowSet<'_, NoBuf>, _: &mut NoBuf, _: &mut NoBuf) -> Result<()> {
                match *q_lat {}
            }
            fn dcp_merge(&self, _: MergeShape, o: &NoBuf, _: &NoBuf, _: &mut NoBuf, _: &mut NoBuf) -> Result<()> {
                match *o {}
            }
            fn matmul(&self, _: MatmulShape, x: &NoBuf, _: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *x {}
            }
            fn swiglu(&self, _: MlpShape, x: &NoBuf, _: MlpWeights<'_, NoBuf>, _: &mut NoBuf) -> Result<()> {
                match *x {}
            }
            fn embedding(&self, _: EmbeddingShape, table: &NoBuf, _: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *table {}
            }
            fn argmax(&self, _: usize, _: usize, logits: &NoBuf, _: &mut NoBuf) -> Result<()> {
                match *logits {}
            }
            fn add_inplace(&self, dst: &mut NoBuf, _: &NoBuf) -> Result<()> {
                match *dst {}
            }
        }
    };
}

stub_backend!(
    /// NVIDIA backend (the H200 test platform; CUDA runtime loaded at run
    /// time, kernels through NVRTC). A stub in this build.
    CudaBackend,
    "cuda",
    cfg!(feature = "cuda"),
    "cuda: built without the `cuda` feature",
    "cuda: the `cuda` feature is on but the device runtime was not found (no CUDA loader is wired into this build yet)"
);

stub_backend!(
    /// AMD backend (hip-sys, kernels from `kernels/hip/` built with hipcc).
    /// A stub in this build.
    HipBackend,
    "hip",
    cfg!(feature = "hip"),
    "hip: built without the `hip` feature",
    "hip: the `hip` feature is on but the device runtime was not found (no HIP runtime is wired into this build yet)"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_stubs_refuse_with_a_typed_reason() {
        let e = HipBackend::new(0).unwrap_err();
        let KernelError::BackendUnavailable(msg) = &e else {
            panic!("wrong error {e:?}")
        };
        assert!(msg.starts_with("hip: "), "{msg}");
        if cfg!(feature = "hip") {
            assert!(msg.contains("runtime was not found"), "{msg}");
        } else {
            assert_eq!(msg, "hip: built without the `hip` feature");
        }
        let e = CudaBackend::new(0).unwrap_err();
        let KernelError::BackendUnavailable(msg) = &e else {
            panic!("wrong error {e:?}")
        };
        assert!(msg.starts_with("cuda: "), "{msg}");
        assert!(!HipBackend::is_available() && !CudaBackend::is_available());
    }

    /// The ops the batched decode added (ragged MLA partials, f64 copy, storage
    /// rounding, the SwiGLU activation) exist on the stubs with the same
    /// signatures: they can only be reached through a constructed backend, and
    /// construction refuses, so a caller generic over `Backend` fails at `new`.
    #[test]
    fn gpu_stubs_carry_the_batched_decode_ops() {
        fn takes_backend<B: Backend>(_: Option<&B>) -> &'static str {
            let _ = B::mla_decode_partial_ragged;
            let _ = B::copy_f64;
            let _ = B::round_to;
            let _ = B::silu_mul;
            "ok"
        }
        assert_eq!(takes_backend::<CudaBackend>(None), "ok");
        assert_eq!(takes_backend::<HipBackend>(None), "ok");
        assert!(matches!(CudaBackend::new(0), Err(KernelError::BackendUnavailable(_))));
    }

    #[test]
    fn hip_source_defines_the_kda_decode_kernel() {
        assert!(KDA_DECODE_HIP.contains("extern \"C\" __global__ void kda_decode_step("));
    }
}
