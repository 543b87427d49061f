//! Stub backends: the full [`Backend`] API on a type that cannot be
//! constructed. `new` returns [`KernelError::BackendUnavailable`] saying why, so
//! callers compile and fail the same way in every build (as candle's disabled
//! backends do). Used for `CudaBackend` without the `cuda` feature and for
//! `HipBackend` without the `hip` feature.
//!
//! [`backend_without_buffers`] is the `Backend` impl of a type whose buffer is
//! [`NoBuf`]: every op that takes a buffer is statically unreachable, and the
//! ops that would make one ask [`RefuseBuffers`]. A stub can never be asked
//! (it has no values).

/// The buffer type of a backend that cannot exist in this build: it has no
/// values, so no op of a stub backend can ever receive one.
#[derive(Debug)]
pub enum NoBuf {}

/// An uninhabited marker: a stub backend holds one, so it has no values and
/// every method on it is statically unreachable.
#[derive(Debug, Clone)]
pub(crate) enum Never {}

/// What a backend without buffers answers to an op that would make one
/// (`alloc`, `upload`, ...): the typed refusal naming the op.
pub(crate) trait RefuseBuffers {
    fn refuse_buffers<T>(&self, op: &'static str) -> crate::error::Result<T>;
}

macro_rules! stub_backend {
    ($(#[$doc:meta])* $name:ident, $label:literal, $reason:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name {
            never: $crate::gpu::stub::Never,
        }

        impl $name {
            /// Opens device `device`. In this build it always fails with
            /// `BackendUnavailable`, saying why.
            pub fn new(device: usize) -> $crate::error::Result<Self> {
                let reason: fn(usize) -> String = $reason;
                Err($crate::error::KernelError::BackendUnavailable(reason(device)))
            }

            /// Whether `new` could succeed in this build on this machine (never, for a stub).
            pub fn is_available() -> bool {
                false
            }

            /// The device's name (unreachable: a stub has no values).
            pub fn device_name(&self) -> &str {
                match self.never {}
            }

            /// The device ordinal (unreachable: a stub has no values).
            pub fn ordinal(&self) -> usize {
                match self.never {}
            }

            /// Compute capability (unreachable: a stub has no values).
            pub fn compute_capability(&self) -> (i32, i32) {
                match self.never {}
            }

            /// Waits for all queued work (unreachable: a stub has no values).
            pub fn synchronize(&self) -> $crate::error::Result<()> {
                match self.never {}
            }

            /// Device time per call of `f` (unreachable: a stub has no values).
            pub fn time_us(
                &self,
                reps: usize,
                f: impl FnMut() -> $crate::error::Result<()>,
            ) -> $crate::error::Result<f64> {
                let _ = (reps, f);
                match self.never {}
            }

            /// Device copy bandwidth (unreachable: a stub has no values).
            pub fn copy_bandwidth_gbs(&self, bytes: usize, reps: usize) -> $crate::error::Result<f64> {
                let _ = (bytes, reps);
                match self.never {}
            }

            /// The launch-saving paths (unreachable: a stub has no values).
            pub fn set_fused(&mut self, on: bool) {
                let _ = on;
                match self.never {}
            }

            pub fn set_tcb_min_tiles(&mut self, tiles: usize) {
                let _ = tiles;
                match self.never {}
            }

            pub fn tcb_min_tiles(&self) -> usize {
                match self.never {}
            }

            pub fn set_matmul_wg(&mut self, on: bool) {
                let _ = on;
                match self.never {}
            }

            pub fn matmul_wg(&self) -> bool {
                match self.never {}
            }

            /// MLA kernel choice (unreachable: a stub has no values).
            pub fn set_mla_kernel(&mut self, kernel: &str) -> $crate::error::Result<()> {
                let _ = kernel;
                match self.never {}
            }

            /// KDA kernel choice (unreachable: a stub has no values).
            pub fn set_kda_kernel(&mut self, kernel: $crate::gpu::KdaKernel) {
                let _ = kernel;
                match self.never {}
            }

            /// The KDA kernel in use (unreachable: a stub has no values).
            pub fn kda_kernel(&self) -> $crate::gpu::KdaKernel {
                match self.never {}
            }

            /// The fused step's product alone (unreachable: a stub has no values).
            pub fn step_matmul(
                &self,
                x: &[f32],
                m: usize,
                w: &$crate::step::StepMat,
                dtype: $crate::step::WeightDtype,
                terms: u32,
                reps: usize,
            ) -> $crate::error::Result<(Vec<f32>, f64)> {
                let _ = (x, m, w, dtype, terms, reps);
                match self.never {}
            }
        }

        impl $crate::gpu::stub::RefuseBuffers for $name {
            fn refuse_buffers<T>(&self, _: &'static str) -> $crate::error::Result<T> {
                match self.never {}
            }
        }

        $crate::gpu::stub::backend_without_buffers!($name, $label, {});
    };
}

macro_rules! backend_without_buffers {
    ($name:ident, $label:literal, { $($extra:tt)* }) => {
        impl $crate::backend::Backend for $name {
            type Buf = $crate::gpu::NoBuf;
            type IBuf = $crate::gpu::NoBuf;
            type F64Buf = $crate::gpu::NoBuf;

            fn name(&self) -> &'static str {
                $label
            }
            fn alloc(&self, _: usize) -> Result<NoBuf> {
                $crate::gpu::stub::RefuseBuffers::refuse_buffers(self, "alloc")
            }
            fn upload(&self, _: &[f32]) -> Result<NoBuf> {
                $crate::gpu::stub::RefuseBuffers::refuse_buffers(self, "upload")
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
                $crate::gpu::stub::RefuseBuffers::refuse_buffers(self, "alloc_i32")
            }
            fn upload_i32(&self, _: &[i32]) -> Result<NoBuf> {
                $crate::gpu::stub::RefuseBuffers::refuse_buffers(self, "upload_i32")
            }
            fn download_i32(&self, buf: &NoBuf) -> Result<Vec<i32>> {
                match *buf {}
            }
            fn alloc_f64(&self, _: usize) -> Result<NoBuf> {
                $crate::gpu::stub::RefuseBuffers::refuse_buffers(self, "alloc_f64")
            }
            fn upload_f64(&self, _: &[f64]) -> Result<NoBuf> {
                $crate::gpu::stub::RefuseBuffers::refuse_buffers(self, "upload_f64")
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
            fn add_units(&self, acc: &mut NoBuf, _: &NoBuf, _: std::ops::Range<usize>) -> Result<()> {
                match *acc {}
            }
            $($extra)*
        }
    };
}

pub(crate) use {backend_without_buffers, stub_backend};
