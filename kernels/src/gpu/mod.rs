//! GPU backends and their one set of kernel sources.
//!
//! The device kernels live in `kernels/hip/*.hip`, HIP/CUDA-common C++ behind
//! the small `hip/prelude.h`; the same text is compiled by NVRTC for NVIDIA
//! (at [`CudaBackend::new`], feature `cuda`) and by hipcc for AMD (in
//! `build.rs`, feature `hip`, to gfx90a code objects).
//!
//! - [`CudaBackend`]: with `cuda`, a real backend (cudarc: the driver API and
//!   NVRTC, both loaded at run time). `new` first checks that `libcuda` and
//!   `libnvrtc` can be loaded and returns `BackendUnavailable("cuda: no CUDA
//!   driver: ...")` when not, so the same binary runs its CPU path on a machine
//!   without a GPU. Without `cuda`, a stub with the same API that refuses.
//! - [`HipBackend`]: with `hip`, the same backend on the HIP runtime
//!   (hip-sys) and the gfx90a code objects [`HIP_CODE_OBJECTS`]: the fused
//!   decode step through the same launch table as CUDA (`step_gpu/`) and every
//!   generic op through the same launch decisions (`ops/`), and device memory
//!   for regions through the same implementation (`ops/memory.rs`). Never run
//!   on AMD hardware: here `new` reports "no device". Without `hip`, a stub
//!   that refuses.
//!
//! Both real backends are one type, `GpuBackend<D>` (`ops/`), over a driver
//! `D` (`launch.rs`), and their device memory for regions one type,
//! `DeviceMem<D>`: CUDA and HIP differ only in the driver's calls and how the
//! kernels were compiled.

use crate::dtype::StorageDtype;
use crate::error::Result;
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape, MlpWeights,
    NormShape, ReplayShape, RowSet,
};

pub(crate) mod stub;
pub use stub::NoBuf;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaBuf, CudaF64Buf, CudaIBuf};

#[cfg(feature = "hip")]
mod hip;
#[cfg(feature = "hip")]
pub use hip::{HipBackend, HipBuf, HipF64Buf, HipIBuf};

// The launch seam and the fused decode step over it: plain Rust, built in
// every configuration so that the launch table's tests run on any machine
// (a recording driver stands in for the device).
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
mod launch;
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
mod step_gpu;
// The generic ops over the seam (GpuBackend<D>), likewise built everywhere so
// that their launches are checked against the sources on any machine.
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code, unused_imports))]
mod ops;
/// The one GPU backend type and its buffers: `CudaBackend`, `HipBackend` and
/// their buffer types are these over each platform's driver (which code
/// outside this crate cannot name, so only those aliases can be built).
pub use ops::{DeviceBuf, DeviceIBuf, GpuBackend};

/// Device memory for registered regions on CUDA GPU `ordinal`, without
/// compiling the kernels (a transport opens it before the compute backend; both
/// share the device's primary context, hence one address space). Refuses like
/// [`CudaBackend::new`] where CUDA cannot run.
pub fn cuda_device_memory(ordinal: usize) -> Result<std::sync::Arc<dyn crate::region::DeviceMemory>> {
    #[cfg(feature = "cuda")]
    {
        cuda::open_memory(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(crate::error::KernelError::BackendUnavailable("cuda: built without the `cuda` feature".to_string()))
    }
}

/// Device memory for registered regions on HIP device `ordinal`, without the
/// backend's kernels (only `copy_table`'s code object is loaded): the same
/// implementation as [`cuda_device_memory`] over the HIP runtime. Refuses like
/// [`HipBackend::new`] where HIP cannot run. Never run on AMD hardware.
pub fn hip_device_memory(ordinal: usize) -> Result<std::sync::Arc<dyn crate::region::DeviceMemory>> {
    #[cfg(feature = "hip")]
    {
        hip::open_memory(ordinal)
    }
    #[cfg(not(feature = "hip"))]
    {
        let _ = ordinal;
        Err(crate::error::KernelError::BackendUnavailable("hip: built without the `hip` feature".to_string()))
    }
}

/// The KDA decode-step kernels of the CUDA backend for dk <= 128
/// (`kernels/hip/kda.hip`): how wide a column tile one block owns and how many
/// blocks share a multiprocessor. They differ only in speed: each column is
/// computed by the same arithmetic in the same order in all of them, so they
/// give the same bits (`cuda_check` checks it) and the choice never changes a
/// result. (Prefill always runs the 32-column kernel: one sequence has few
/// heads, so the narrowest tiles give it the most blocks.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaKernel {
    /// 32-column tiles (16 KB of a 128 x 128 state per block), 4 blocks per multiprocessor.
    C1,
    /// 64-column tiles, 3 blocks per multiprocessor (the default: fastest on the H200).
    C2,
    /// 64-column tiles, 4 blocks per multiprocessor (64 registers, a few bytes spilled).
    C2x4,
    /// 128-column tiles, 1 block per multiprocessor (no register cap).
    C4x1,
}

impl KdaKernel {
    /// Every variant, for benchmarks.
    pub const ALL: [KdaKernel; 4] = [Self::C1, Self::C2, Self::C2x4, Self::C4x1];

    /// The kernel's name in the sources.
    pub fn kernel_name(self) -> &'static str {
        match self {
            Self::C1 => "kda_step_c1",
            Self::C2 => "kda_step_c2",
            Self::C2x4 => "kda_step_c2x4",
            Self::C4x1 => "kda_step_c4x1",
        }
    }

    /// Value columns per lane (the tile is 32 times this wide).
    pub fn cols_per_lane(self) -> usize {
        match self {
            Self::C1 => 1,
            Self::C2 | Self::C2x4 => 2,
            Self::C4x1 => 4,
        }
    }
}

/// The prelude every kernel source is compiled behind (spellings that differ
/// between hipcc and NVRTC, 16-bit conversions, reductions).
pub const HIP_PRELUDE: &str = include_str!("../../hip/prelude.h");

/// Every kernel source of `kernels/hip/`, by file name. build.rs compiles each
/// `*.hip` file of that directory with hipcc; a test checks that this list
/// names exactly those files, so NVRTC never misses one.
pub const HIP_SOURCES: &[(&str, &str)] = &[
    ("conv.hip", include_str!("../../hip/conv.hip")),
    ("copy.hip", include_str!("../../hip/copy.hip")),
    ("dense.hip", include_str!("../../hip/dense.hip")),
    ("kda.hip", include_str!("../../hip/kda.hip")),
    ("kda_chunk.hip", include_str!("../../hip/kda_chunk.hip")),
    ("memcopy.hip", include_str!("../../hip/memcopy.hip")),
    ("mla.hip", include_str!("../../hip/mla.hip")),
    ("norm.hip", include_str!("../../hip/norm.hip")),
    ("step.hip", include_str!("../../hip/step.hip")),
    ("step_mm.hip", include_str!("../../hip/step_mm.hip")),
];

/// The NVRTC program: the prelude, then every source, as one translation unit
/// (NVRTC is given no headers, so the prelude travels as text).
pub fn device_program() -> String {
    program_of(|_| true)
}

/// The prelude and the sources `keep` names, as one translation unit.
pub(crate) fn program_of(keep: impl Fn(&str) -> bool) -> String {
    let mut s = String::with_capacity(HIP_PRELUDE.len() + HIP_SOURCES.iter().map(|(_, t)| t.len() + 64).sum::<usize>());
    s.push_str(HIP_PRELUDE);
    for (name, text) in HIP_SOURCES.iter().filter(|(n, _)| keep(n)) {
        s.push_str("\n// ---- ");
        s.push_str(name);
        s.push('\n');
        s.push_str(text);
    }
    s
}

/// The gfx90a code objects that build.rs made with hipcc from each source
/// (`(file name, clang offload bundle)`), with the `hip` feature; empty
/// without it.
#[cfg(feature = "hip")]
pub const HIP_CODE_OBJECTS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs"));
/// The gfx90a code objects that build.rs made with hipcc from each source
/// (`(file name, clang offload bundle)`), with the `hip` feature; empty
/// without it.
#[cfg(not(feature = "hip"))]
pub const HIP_CODE_OBJECTS: &[(&str, &[u8])] = &[];

#[cfg(not(feature = "cuda"))]
stub::stub_backend!(
    /// NVIDIA backend (CUDA driver and NVRTC loaded at run time). This build
    /// has no `cuda` feature: a stub whose `new` refuses.
    CudaBackend,
    "cuda",
    |_| "cuda: built without the `cuda` feature".to_string()
);

/// The f32 buffer of [`CudaBackend`] (no values without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub type CudaBuf = NoBuf;
/// The i32 buffer of [`CudaBackend`] (no values without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub type CudaIBuf = NoBuf;
/// The f64 buffer of [`CudaBackend`] (no values without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub type CudaF64Buf = NoBuf;

#[cfg(not(feature = "hip"))]
stub::stub_backend!(
    /// AMD backend (hip-sys and gfx90a code objects). This build has no `hip`
    /// feature: a stub whose `new` refuses.
    HipBackend,
    "hip",
    |_| "hip: built without the `hip` feature".to_string()
);

/// The f32 buffer of [`HipBackend`] (no values without the `hip` feature).
#[cfg(not(feature = "hip"))]
pub type HipBuf = NoBuf;
/// The i32 buffer of [`HipBackend`] (no values without the `hip` feature).
#[cfg(not(feature = "hip"))]
pub type HipIBuf = NoBuf;
/// The f64 buffer of [`HipBackend`] (no values without the `hip` feature).
#[cfg(not(feature = "hip"))]
pub type HipF64Buf = NoBuf;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::error::KernelError;

    /// Without `hip` the stub refuses; with it, the real backend stops at the
    /// device count here (no AMD GPU), before loading anything.
    #[test]
    fn hip_refuses_with_a_typed_reason_where_there_is_no_device() {
        let e = HipBackend::new(0).unwrap_err();
        let KernelError::BackendUnavailable(msg) = &e else { panic!("wrong error {e:?}") };
        assert!(msg.starts_with("hip: "), "{msg}");
        eprintln!("HipBackend::new(0): {msg}");
        if cfg!(feature = "hip") {
            // No AMD GPU exists where this runs: the runtime must say so.
            assert!(msg.contains("no device"), "{msg}");
        } else {
            assert_eq!(msg, "hip: built without the `hip` feature");
        }
        assert!(!HipBackend::is_available());
    }

    /// Device memory for regions on HIP opens the same way as the backend,
    /// so here it stops at the device count too (or at the missing feature).
    #[test]
    fn hip_device_memory_refuses_where_there_is_no_device() {
        let Err(e) = hip_device_memory(0) else { panic!("a HIP device here?") };
        let KernelError::BackendUnavailable(msg) = &e else { panic!("wrong error {e:?}") };
        if cfg!(feature = "hip") {
            assert!(msg.starts_with("hip: no device"), "{msg}");
        } else {
            assert_eq!(msg, "hip: built without the `hip` feature");
        }
    }

    #[test]
    fn cuda_refuses_with_a_typed_reason_where_it_cannot_run() {
        match CudaBackend::new(0) {
            Ok(be) => {
                // A machine with a driver and a device (the H200): fine.
                assert_eq!(be.name(), "cuda");
            }
            Err(KernelError::BackendUnavailable(msg)) => {
                assert!(msg.starts_with("cuda: "), "{msg}");
                if !cfg!(feature = "cuda") {
                    assert_eq!(msg, "cuda: built without the `cuda` feature");
                    assert!(!CudaBackend::is_available());
                }
            }
            Err(e) => panic!("wrong error {e:?}"),
        }
    }

    /// The ops the batched decode added exist on every backend type with the
    /// same signatures, so code generic over `Backend` compiles against each.
    #[test]
    fn gpu_backends_carry_the_batched_decode_ops() {
        fn takes_backend<B: Backend>(_: Option<&B>) -> &'static str {
            let _ = B::mla_decode_partial_ragged;
            let _ = B::copy_f64;
            let _ = B::round_to;
            let _ = B::silu_mul;
            "ok"
        }
        assert_eq!(takes_backend::<CudaBackend>(None), "ok");
        assert_eq!(takes_backend::<HipBackend>(None), "ok");
    }

    #[test]
    fn the_source_list_is_every_hip_file_and_defines_every_kernel() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hip");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                name.ends_with(".hip").then_some(name)
            })
            .collect();
        on_disk.sort();
        let listed: Vec<String> = HIP_SOURCES.iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(listed, on_disk, "HIP_SOURCES must list every kernels/hip/*.hip");
        let program = device_program();
        assert!(program.starts_with(HIP_PRELUDE));
        // Every kernel the generic ops and the region memory load (the lists
        // their launch tests check against).
        for k in ops::tests::OP_KERNELS.iter().chain(ops::tests::MEMORY_KERNELS) {
            assert!(program.lines().any(|l| l.starts_with("extern \"C\" __global__") && l.contains(&format!(" {k}("))), "kernel {k} missing");
        }
        // No standard header anywhere: NVRTC has none.
        for (name, text) in HIP_SOURCES {
            assert!(!text.contains("#include"), "{name} includes a header");
        }
    }

    #[cfg(feature = "hip")]
    #[test]
    fn every_source_has_a_gfx90a_code_object() {
        let names: Vec<&str> = HIP_CODE_OBJECTS.iter().map(|(n, _)| *n).collect();
        let sources: Vec<&str> = HIP_SOURCES.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, sources);
        for (name, co) in HIP_CODE_OBJECTS {
            assert!(co.starts_with(b"__CLANG_OFFLOAD_BUNDLE__"), "{name}: not an offload bundle");
            let tail = String::from_utf8_lossy(&co[..co.len().min(4096)]).into_owned();
            assert!(tail.contains("gfx90a"), "{name}: no gfx90a target in the bundle");
        }
    }
}
