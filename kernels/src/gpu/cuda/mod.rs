//! The CUDA backend (feature `cuda`): cudarc's driver API and NVRTC, both
//! loaded at run time, and the HIP/CUDA-common sources of `kernels/hip/`.
//!
//! - [`CudaBackend::new`] checks that the driver (`libcuda.so.1`) and NVRTC
//!   (`libnvrtc.so*`) can be loaded *before* the first cudarc call, because
//!   cudarc's loaders panic on a missing library; a missing one is
//!   `BackendUnavailable("cuda: no CUDA driver: ...")`. It then opens the
//!   device's primary context, compiles [`super::device_program`] with NVRTC to
//!   a cubin for the device's architecture (sm_90 on the H200) and loads it.
//! - One stream per backend; every op enqueues on it in call order, so ops
//!   need no events between them (cudarc's per-buffer event tracking, meant
//!   for several streams, is switched off). `download*` synchronizes. Ops that
//!   must validate device data against the CPU reference's errors (token ids,
//!   replay cursors) read that small data back first, which synchronizes too.
//! - Buffers are allocated with at least one element (a zero-length device
//!   allocation is not portable) and remember their logical length.
//!
//! Numerics: f32 storage and accumulation, f64 for the MLA partials and their
//! merge, as on the CPU; reductions have a fixed order (see the sources), so a
//! result is the same bits on every run and a row's, slot's or request's result
//! does not depend on the batch it is in. Against the CPU the results agree to
//! rounding (fused multiply-adds, other summation trees); the device check
//! (`examples/cuda_check/`) states the tolerance of each op.

use std::ffi::CString;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, CudaViewMut, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::KdaKernel;
use crate::backend::Backend;
use crate::cpu::{kda as cpu_kda, mla as cpu_mla};
use crate::dtype::StorageDtype;
use crate::error::{KernelError, Result, check_len, check_nonzero, elems, range};
use crate::region::{DeviceMemory, DeviceRegion, RegionItems};
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaRaggedShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape,
    MlpWeights, NormShape, ReplayShape, RowSet, UnitProduct, UnitsOut, UnitsShape, mla_partial_width,
};

mod backend;
mod buffers;
mod copy;
mod dense;
mod driver;
mod kda;
mod mla;
mod program;

pub(crate) use buffers::open_memory;
pub use buffers::{CudaBuf, CudaF64Buf, CudaIBuf};
use dense::{UNITS_PER_LAUNCH, tc_smem};
use kda::{check_kda, kda_block};
#[cfg(test)]
use mla::mla_warps;
pub(crate) use program::nvrtc_cubin_of;
#[cfg(test)]
use program::nvrtc_present;
use program::{nvrtc_arch, nvrtc_cubin, runtime_missing};

/// Threads of the element-wise (grid-stride) kernels.
const EW_THREADS: u32 = 256;
/// Most blocks of a grid-stride launch (enough to fill any current device).
const EW_MAX_BLOCKS: usize = 8192;
/// Key rows per warp of the KDA kernels (kda.hip).
const KDA_ROWS: usize = 16;
/// The KDA kernel for dk <= 128 unless set otherwise.
const DEFAULT_KDA_KERNEL: KdaKernel = KdaKernel::C2;
/// Largest dk the KDA kernels take: 16 warps of 16 rows in registers.
const KDA_MAX_DK: usize = 256;
/// The chunked KDA prefill (kda_chunk.hip): key channels padded to (and at
/// most) KC_DK, 16 value columns per state block, 256 threads, and the
/// dynamic shared memory of its two kernels (opted in at open).
const KDA_CHUNK_DK: usize = 128;
const KDA_CHUNK_TILE: usize = 16;
const KDA_CHUNK_THREADS: u32 = 256;
const KDA_CHUNK_PREP_SMEM: u32 = ((3 * 64 * (KDA_CHUNK_DK + 4) + 64 + 6 * KDA_CHUNK_DK) * 4) as u32;
/// kda_chunk.hip's KC_H_SMEM: S^T, two buffers of W and of e^(..) k^, u, two
/// of U0's tile and of e^Gam_last.
const KDA_CHUNK_STATE_SMEM: u32 =
    ((KDA_CHUNK_TILE * (KDA_CHUNK_DK + 4) + 2 * 64 * (KDA_CHUNK_DK + 4) + 2 * 64 * (KDA_CHUNK_DK + 8) + 64 * 24 + 2 * 64 * KDA_CHUNK_TILE + 2 * KDA_CHUNK_DK)
        * 4) as u32;
/// kda_chunk.hip's KC_O_SMEM: e^Gam q^, S_c^T of 64 columns, P, u^T.
const KDA_CHUNK_OUT_SMEM: u32 = ((2 * 64 * (KDA_CHUNK_DK + 4) + 64 * 68 + KDA_CHUNK_OUT_TILE * 68) * 4) as u32;
/// Value columns per kda_chunk_out block (kda_chunk.hip's KC_OT).
const KDA_CHUNK_OUT_TILE: usize = 64;
/// Dynamic shared memory a block may use without opting in to more.
const SMEM_BUDGET: usize = 48 * 1024;
/// The row shape of the tensor-core MLA partial (mla.hip's MLA_TC_L, MLA_TC_W
/// - MLA_TC_L); heads go in groups of 8.
const MLA_TC_L: usize = 512;
const MLA_TC_R: usize = 64;
/// Rows per tile of the tensor-core MLA partial (MLA_TC_TILE); chunks are
/// whole tiles.
const MLA_TC_TILE: usize = 16;
/// Shared memory of `mla_partial_tc<nw>` (mla.hip's MLA_TC_SMEM).
const fn mla_tc_smem(nw: usize) -> usize {
    mla_tc_smem_ring(nw, 2)
}
/// Shared memory of `mla_partial_tc<nw, ring>` (mla.hip's MLA_TC_SMEM_RING
/// for f32 tiles): the scores' scratch and `ring` row tiles.
const fn mla_tc_smem_ring(nw: usize, ring: usize) -> usize {
    ((nw * 8 + 8) * 20 + 8) * 8 + ring * MLA_TC_TILE * (MLA_TC_L + MLA_TC_R) * 4
}
/// Row tiles in the ring of `mla_partial_tc8_deep`.
const MLA_TC_DEEP_RING: usize = 4;
/// Threads of `mla_chunk_merge_f64` (MLA_MERGE_THREADS) and the columns
/// a block takes (MLA_MERGE_COLS): ceil(L / 32) blocks a (request, head).
const MLA_MERGE_THREADS: u32 = 256;
const MLA_MERGE_COLS: usize = 32;

/// Which kernel runs the f64 MLA partials of K3's row shape (L = 512, R = 64,
/// heads a multiple of 8), and how many rows a chunk (one block) takes. Other
/// shapes always run the scalar `mla_partial_f64`. The choice changes bits
/// (another chunking is another sum order) but never batch invariance: a
/// request's chunks are its own rows. Default `tc8` (8 warps a block) with
/// 256-row chunks: on the H200 (session 6, `cuda_check --bench-mla --mla
/// tc8:N`) 512 rows gave B = 88 x 32K 1.05x of copy/2 but one 32K request
/// 0.35x (64 blocks); 256 gives 0.98x and 0.57x, 128 0.88x and 0.62x with
/// B = 88 x 8K below 0.8x (the chunk partials' traffic);
/// [`CudaBackend::set_mla_kernel`] picks another, for measuring the
/// alternatives (`cuda_check --mla`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MlaTc {
    /// Warps per block: 4 or 8; 0 = the scalar kernel.
    warps: usize,
    /// Rows per chunk.
    chunk: usize,
    /// Row tiles in flight for 8 warps (`tc8x2`, `tc8x4`): None picks by the
    /// launch (four where there are at most as many blocks as
    /// multiprocessors, see [`MlaTc::deep`]). Same bits either way.
    ring: Option<usize>,
}

const DEFAULT_MLA_TC: MlaTc = MlaTc { warps: 8, chunk: 256, ring: None };

impl MlaTc {
    /// Whether a launch of `blocks` blocks takes `mla_partial_tc8_deep`: a
    /// ring of four tiles, one block a multiprocessor. With about one block
    /// a multiprocessor (one 32K-row request: 128 blocks) each block's
    /// loads are the only ones its multiprocessor has in flight, so three
    /// tiles ahead rather than one; with many blocks two share a
    /// multiprocessor on the two-tile ring and hide each other's loads.
    fn deep(self, blocks: usize, sms: usize) -> bool {
        self.warps == 8 && self.ring.map_or(blocks <= sms, |r| r == MLA_TC_DEEP_RING)
    }
}

/// Bytes of chunk partials `mla_partial_tc` keeps between calls; a larger
/// scratch is freed after its call.
const MLA_SCRATCH_KEEP: usize = 256 << 20;

/// The device side of one shape of `mla_partial_tc`: the work table for these
/// row counts and chunk size, and the chunk partials' scratch.
struct MlaScratch {
    counts: Vec<usize>,
    chunk: usize,
    heads: usize,
    table: CudaSlice<i64>,
    parts: CudaSlice<f64>,
}

impl MlaTc {
    /// Parses `scalar`, `tc4` or `tc8`, optionally `:<rows per chunk>` (a
    /// multiple of 16); None for anything else.
    fn parse(v: &str) -> Option<MlaTc> {
        let (kind, chunk) = match v.split_once(':') {
            Some((k, c)) => (k, Some(c.trim().parse::<usize>().ok()?)),
            None => (v, None),
        };
        let (warps, ring) = match kind.trim() {
            "scalar" => (0, None),
            "tc4" => (4, None),
            "tc8" => (8, None),
            "tc8x2" => (8, Some(2)),
            "tc8x4" => (8, Some(MLA_TC_DEEP_RING)),
            _ => return None,
        };
        let chunk = chunk.unwrap_or(DEFAULT_MLA_TC.chunk);
        (chunk > 0 && chunk.is_multiple_of(MLA_TC_TILE)).then_some(MlaTc { warps, chunk, ring })
    }
}

/// matmul_wg and its two packing kernels (dense.hip), present together in an
/// sm_90a build.
#[derive(Clone)]
struct MatmulWg {
    product: CudaFunction,
    pack_x: CudaFunction,
    pack_w: CudaFunction,
}

/// The kernels of the loaded module.
#[derive(Clone)]
struct Funcs {
    /// The decode-step kernels, indexed like `KdaKernel::ALL`.
    kda_step: Vec<CudaFunction>,
    kda_prefill: CudaFunction,
    kda_recurrent_wide: CudaFunction,
    /// The chunked prefill's three phases (kda_chunk_prep, kda_chunk_state,
    /// kda_chunk_out of kda_chunk.hip); None on a device that cannot give
    /// their blocks the shared memory they take (the prefill stays recurrent
    /// there).
    kda_chunk: Option<(CudaFunction, CudaFunction, CudaFunction)>,
    replay_append: CudaFunction,
    replay_commit: CudaFunction,
    conv_prefill_out: CudaFunction,
    conv_prefill_state: CudaFunction,
    conv_step: CudaFunction,
    rms_norm: CudaFunction,
    gated_rms_norm: CudaFunction,
    mla_attend_f32: CudaFunction,
    mla_partial_f64: CudaFunction,
    mla_partial_tc4: CudaFunction,
    mla_partial_tc8: CudaFunction,
    mla_partial_tc8_deep: CudaFunction,
    mla_chunk_merge_f64: CudaFunction,
    dcp_merge_f32: CudaFunction,
    dcp_merge_f64: CudaFunction,
    matmul_tc16: CudaFunction,
    matmul_tc32: CudaFunction,
    matmul_tcb: CudaFunction,
    /// matmul_tcb's bits on Hopper's warpgroup products; only in an sm_90a
    /// build (dense.hip), None elsewhere.
    matmul_wg: Option<MatmulWg>,
    matmul_chunk_sum: CudaFunction,
    matmul_units_sum: CudaFunction,
    add_units: CudaFunction,
    silu_mul: CudaFunction,
    add_inplace: CudaFunction,
    embedding: CudaFunction,
    argmax_rows: CudaFunction,
    fill_f32: CudaFunction,
    copy_cols: CudaFunction,
    round_to: CudaFunction,
    region_gather_b32: CudaFunction,
    region_scatter_b32: CudaFunction,
    region_gather_b16: CudaFunction,
    region_scatter_b16: CudaFunction,
}

/// NVIDIA backend: device memory buffers and the model's ops as NVRTC-compiled
/// kernels on one stream.
///
/// ```no_run
/// use handoff_kernels::{Backend, CudaBackend};
/// if CudaBackend::is_available() {
///     let be = CudaBackend::new(0).unwrap();
///     let x = be.upload(&[1.0, 2.0]).unwrap();
///     assert_eq!(be.download(&x).unwrap(), vec![1.0, 2.0]);
/// }
/// ```
///
/// Cloning shares the context, stream and compiled program (no recompile).
#[derive(Clone)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    f: Funcs,
    device_name: String,
    cc: (i32, i32),
    kda_kernel: KdaKernel,
    mla_tc: MlaTc,
    /// Multiprocessors of the device (the MLA partial's ring depth).
    sms: usize,
    /// The tensor-core MLA partial's work table and chunk scratch, kept while
    /// the row counts repeat (`mla_partial_tc`); clones share it as they
    /// share the stream its kernels run on.
    mla_scratch: Arc<std::sync::Mutex<Option<MlaScratch>>>,
    /// The launch-saving paths ([`CudaBackend::set_fused`]).
    fused: bool,
    /// Output tiles from which a matmul runs as matmul_tcb
    /// ([`CudaBackend::set_tcb_min_tiles`]); None: the tiled kernel's own default.
    tcb_min_tiles: Option<usize>,
    /// Whether the tiled products run as matmul_wg where the build has it
    /// ([`CudaBackend::set_matmul_wg`]).
    matmul_wg: bool,
    /// The compiled program (the fused decode step loads its kernels from it).
    module: Arc<cudarc::driver::CudaModule>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBackend(device {} {:?}, sm_{}{})", self.ctx.ordinal(), self.device_name, self.cc.0, self.cc.1)
    }
}

fn unavailable(what: &str, e: DriverError) -> KernelError {
    KernelError::BackendUnavailable(format!("cuda: {what}: {e}"))
}

/// Maps a driver error of op `op` to a `KernelError::Device`.
fn dev(op: &'static str) -> impl Fn(DriverError) -> KernelError {
    move |e| KernelError::Device { op, message: e.to_string() }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::InvalidShape { op, reason: format!("{what} = {v} exceeds the device kernels' 32-bit index") })
}

fn i64_of(v: usize) -> i64 {
    // Buffer lengths come from allocations, far below i64::MAX.
    v as i64
}

/// A grid-stride launch over `n` elements.
fn ew_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(EW_THREADS as usize).clamp(1, EW_MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (EW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

impl CudaBackend {
    /// Opens CUDA device `device` and compiles the kernels for it (NVRTC, a
    /// few hundred milliseconds). Refuses with `BackendUnavailable` and a
    /// reason when the driver or NVRTC library is missing ("cuda: no CUDA
    /// driver: ..."), there is no such device, or the compile fails.
    pub fn new(device: usize) -> Result<Self> {
        if let Some(why) = runtime_missing() {
            return Err(KernelError::BackendUnavailable(why));
        }
        // cudarc still panics on a missing symbol (a driver older than the
        // CUDA 13 API it binds): keep that a refusal as well.
        match std::panic::catch_unwind(|| Self::open(device)) {
            Ok(r) => r,
            Err(p) => Err(KernelError::BackendUnavailable(format!("cuda: the CUDA runtime failed while opening device {device}: {}", panic_text(p.as_ref())))),
        }
    }

    /// Whether `CudaBackend::new(0)` can open a device here: the libraries
    /// load and the driver reports at least one device. Does not compile.
    pub fn is_available() -> bool {
        runtime_missing().is_none() && std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n > 0).unwrap_or(false)).unwrap_or(false)
    }

    fn open(device: usize) -> Result<Self> {
        let count = CudaContext::device_count().map_err(|e| unavailable("no device (cuInit or device count failed)", e))?;
        if count <= 0 {
            return Err(KernelError::BackendUnavailable("cuda: no device: the driver reports 0 CUDA devices".to_string()));
        }
        if device >= count as usize {
            return Err(KernelError::BackendUnavailable(format!("cuda: no device {device}: the driver reports {count}")));
        }
        let ctx = CudaContext::new(device).map_err(|e| unavailable("cannot open the device context", e))?;
        // SAFETY: called before any buffer or stream exists; every op of this
        // backend runs on its one stream, in order, so no buffer needs the
        // events cudarc records for cross-stream use.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| unavailable("cannot create a stream", e))?;
        keep_freed_memory(&ctx);
        let cc = ctx.compute_capability().map_err(|e| unavailable("compute capability", e))?;
        let device_name = ctx.name().map_err(|e| unavailable("device name", e))?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| unavailable("multiprocessor count", e))? as usize;
        let cubin = nvrtc_cubin(&nvrtc_arch(cc))?;
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| unavailable("cannot load the compiled kernels", e))?;
        let get = |name: &str| module.load_function(name).map_err(|e| unavailable(&format!("kernel {name} missing from the module"), e));
        let mut f = Funcs {
            kda_step: KdaKernel::ALL.iter().map(|k| get(k.kernel_name())).collect::<Result<_>>()?,
            kda_prefill: get("kda_prefill")?,
            kda_recurrent_wide: get("kda_recurrent_wide")?,
            kda_chunk: Some((get("kda_chunk_prep")?, get("kda_chunk_state")?, get("kda_chunk_out")?)),
            replay_append: get("replay_append")?,
            replay_commit: get("replay_commit")?,
            conv_prefill_out: get("conv_prefill_out")?,
            conv_prefill_state: get("conv_prefill_state")?,
            conv_step: get("conv_step")?,
            rms_norm: get("rms_norm")?,
            gated_rms_norm: get("gated_rms_norm")?,
            mla_attend_f32: get("mla_attend_f32")?,
            mla_partial_f64: get("mla_partial_f64")?,
            mla_partial_tc4: get("mla_partial_tc4")?,
            mla_partial_tc8: get("mla_partial_tc8")?,
            mla_partial_tc8_deep: get("mla_partial_tc8_deep")?,
            mla_chunk_merge_f64: get("mla_chunk_merge_f64")?,
            dcp_merge_f32: get("dcp_merge_f32")?,
            dcp_merge_f64: get("dcp_merge_f64")?,
            matmul_tc16: get("matmul_tc16")?,
            matmul_tc32: get("matmul_tc32")?,
            matmul_tcb: get("matmul_tcb")?,
            matmul_wg: match (module.load_function("matmul_wg"), module.load_function("mwg_pack_x"), module.load_function("mwg_pack_w")) {
                (Ok(product), Ok(pack_x), Ok(pack_w)) => Some(MatmulWg { product, pack_x, pack_w }),
                _ => None,
            },
            matmul_chunk_sum: get("matmul_chunk_sum")?,
            matmul_units_sum: get("matmul_units_sum")?,
            add_units: get("add_units")?,
            silu_mul: get("silu_mul")?,
            add_inplace: get("add_inplace")?,
            embedding: get("embedding")?,
            argmax_rows: get("argmax_rows")?,
            fill_f32: get("fill_f32")?,
            copy_cols: get("copy_cols")?,
            round_to: get("round_to")?,
            region_gather_b32: get("region_gather_b32")?,
            region_scatter_b32: get("region_scatter_b32")?,
            region_gather_b16: get("region_gather_b16")?,
            region_scatter_b16: get("region_scatter_b16")?,
        };
        // The tensor-core MLA partials take more than 48 KB of shared memory
        // (two 16-row tiles): opt in, and ask for the largest carveout so two
        // blocks share a multiprocessor.
        for (func, bytes) in
            [(&f.mla_partial_tc4, mla_tc_smem(4)), (&f.mla_partial_tc8, mla_tc_smem(8)), (&f.mla_partial_tc8_deep, mla_tc_smem_ring(8, MLA_TC_DEEP_RING))]
        {
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| unavailable("cannot give the MLA kernel its shared memory", e))?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(|e| unavailable("cannot set the MLA kernel's shared memory carveout", e))?;
        }
        // The tensor-core matmul stages a whole k chunk of x and w (52 and 75
        // KB, dense.hip): opt in.
        for (func, bytes) in [(&f.matmul_tc16, tc_smem(16, 128)), (&f.matmul_tc32, tc_smem(32, 64)), (&f.matmul_tcb, dense::TCB_SMEM)] {
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| unavailable("cannot give the matmul its shared memory", e))?;
        }
        if let Some(wg) = &f.matmul_wg {
            wg.product
                .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dense::MWG_SMEM as i32)
                .map_err(|e| unavailable("cannot give matmul_wg its shared memory", e))?;
        }
        // The chunked KDA prefill's blocks hold a chunk's 64 x 128 operands in
        // shared memory (97, 145 and 100 KB, kda_chunk.hip): opt in likewise; a
        // device with less per block keeps the recurrent prefill.
        let chunk_ok = f.kda_chunk.as_ref().is_some_and(|(prep, state, out)| {
            [(prep, KDA_CHUNK_PREP_SMEM), (state, KDA_CHUNK_STATE_SMEM), (out, KDA_CHUNK_OUT_SMEM)]
                .iter()
                .all(|(func, bytes)| func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, *bytes as i32).is_ok())
        });
        if !chunk_ok {
            f.kda_chunk = None;
        }
        Ok(Self {
            ctx,
            stream,
            f,
            device_name,
            cc,
            kda_kernel: DEFAULT_KDA_KERNEL,
            mla_tc: DEFAULT_MLA_TC,
            sms,
            mla_scratch: Arc::new(std::sync::Mutex::new(None)),
            fused: true,
            tcb_min_tiles: None,
            matmul_wg: true,
            module,
        })
    }

    /// The fused decode step's tensor-core product alone (see
    /// `step_gpu::tc_matmul`): the product and its mean device time in us.
    #[allow(clippy::too_many_arguments)]
    pub fn step_matmul(
        &self,
        x: &[f32],
        m: usize,
        w: &crate::step::StepMat,
        dtype: crate::step::WeightDtype,
        terms: u32,
        reps: usize,
    ) -> Result<(Vec<f32>, f64)> {
        crate::gpu::step_gpu::tc_matmul(&self.driver(), x, m, w, dtype, terms, reps)
    }

    /// The launch table's driver on this backend's context, stream and module.
    fn driver(&self) -> driver::CudaDriver {
        driver::CudaDriver { ctx: self.ctx.clone(), stream: self.stream.clone(), module: self.module.clone() }
    }

    /// Picks the generic path's MLA partial kernel: `scalar`, `tc4` or `tc8`
    /// (`tc8x2` / `tc8x4`: its ring of row tiles forced, same bits),
    /// optionally `:<rows per chunk>` (a multiple of 16). Another kernel or
    /// chunk gives other bits (another sum order), each batch invariant; for
    /// measuring. A name it does not know is refused.
    pub fn set_mla_kernel(&mut self, kernel: &str) -> Result<()> {
        self.mla_tc = MlaTc::parse(kernel).ok_or_else(|| KernelError::InvalidShape {
            op: "set_mla_kernel",
            reason: format!("{kernel:?}: expected scalar, tc4, tc8, tc8x2 or tc8x4, optionally :<rows per chunk, a multiple of 16>"),
        })?;
        Ok(())
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The device ordinal this backend opened.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Compute capability (major, minor); the kernels were compiled for it.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// Chooses the KDA decode-step kernel for dk <= 128 (see [`KdaKernel`];
    /// the default is the fastest measured on the H200). All give the same
    /// bits; `cuda_check --bench` times each.
    pub fn set_kda_kernel(&mut self, kernel: KdaKernel) {
        self.kda_kernel = kernel;
    }

    /// The KDA decode-step kernel in use for dk <= 128.
    pub fn kda_kernel(&self) -> KdaKernel {
        self.kda_kernel
    }

    /// The paths that save launches and round trips in the generic forward
    /// pass (on by default): `matmul_units` as two launches for up to 32
    /// products, `add_units` as one, and i32 downloads answered from what the
    /// host already knows of the buffer. Off, one matmul a product, one add a
    /// unit and a round trip a download: the same bits (`cuda_check` checks it),
    /// kept for that comparison.
    pub fn set_fused(&mut self, on: bool) {
        self.fused = on;
    }

    /// From how many 64 x 128 output tiles a matmul of 64 rows or more runs
    /// tiled (`matmul_wg` on Hopper, else `matmul_tcb`) rather than split over
    /// k (default 32 with `matmul_wg`, 96 with `matmul_tcb`). Both give the
    /// same bits; `cuda_check --bench-dense` times them at the prefill shapes
    /// with this (0: always tiled, `usize::MAX`: never).
    pub fn set_tcb_min_tiles(&mut self, tiles: usize) {
        self.tcb_min_tiles = Some(tiles);
    }

    /// See [`CudaBackend::set_tcb_min_tiles`].
    pub fn tcb_min_tiles(&self) -> usize {
        self.tcb_min_tiles.unwrap_or(if self.matmul_wg() { dense::WG_MIN_TILES } else { dense::TCB_MIN_TILES })
    }

    /// Whether the tiled products (those `set_tcb_min_tiles` sends to
    /// `matmul_tcb`) run on Hopper's warpgroup products instead, `matmul_wg`
    /// (on by default; only where the build has it: compute capability 9.0).
    /// The same bits either way (`cuda_check` checks it); off, for measuring.
    pub fn set_matmul_wg(&mut self, on: bool) {
        self.matmul_wg = on;
    }

    /// Whether the tiled products run as `matmul_wg` (see
    /// [`CudaBackend::set_matmul_wg`]): on, and present in this build.
    pub fn matmul_wg(&self) -> bool {
        self.matmul_wg && self.f.matmul_wg.is_some()
    }

    /// Waits until every queued op has finished; reports a failed one.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev("synchronize"))
    }

    /// Device time of `f`, mean microseconds per call over `reps` calls:
    /// CUDA events around the `reps` calls queued back to back, one wait at
    /// the end (launch overhead overlaps the previous call's run).
    pub fn time_us(&self, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let op = "time_us";
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).map_err(dev(op))?;
        for _ in 0..reps {
            f()?;
        }
        let end = self.stream.record_event(flags).map_err(dev(op))?;
        let ms = start.elapsed_ms(&end).map_err(dev(op))?;
        Ok(ms as f64 * 1e3 / reps.max(1) as f64)
    }

    /// Device-to-device copy bandwidth in GB/s (1e9 bytes/s), counting the
    /// bytes read plus the bytes written, of `reps` copies of `bytes` bytes:
    /// the roofline that state traffic is compared against.
    pub fn copy_bandwidth_gbs(&self, bytes: usize, reps: usize) -> Result<f64> {
        let op = "copy_bandwidth";
        let n = (bytes / 4).max(1);
        let src = self.stream.alloc_zeros::<f32>(n).map_err(dev(op))?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(dev(op))?;
        // Warm-up copy, then the timed ones.
        self.stream.memcpy_dtod(&src, &mut dst).map_err(dev(op))?;
        let us = self.time_us(reps, || self.stream.memcpy_dtod(&src, &mut dst).map_err(dev(op)))?;
        Ok(2.0 * (n * 4) as f64 / (us * 1e-6) / 1e9)
    }
}
/// Workspaces (the chunked KDA prefill's, the products' packed operands) are
/// allocated and freed on the stream each pass, from the device's default
/// stream-ordered pool. Its release threshold is 0 by default, so every
/// synchronize handed the freed memory back to the driver and the next pass
/// mapped it again; keeping it in the pool makes those allocations cheap.
/// The pool then holds at most the largest pass's workspaces. A driver that
/// refuses leaves the default, which is only slower.
fn keep_freed_memory(ctx: &CudaContext) {
    use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool, CUresult, cuDeviceGetDefaultMemPool, cuMemPoolSetAttribute};
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: pool is a valid out-pointer; the device ordinal is this context's.
    if unsafe { cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) } != CUresult::CUDA_SUCCESS || pool.is_null() {
        return;
    }
    let mut keep: u64 = u64::MAX;
    // SAFETY: the release threshold attribute takes a pointer to a u64 (cuuint64_t).
    let _ = unsafe { cuMemPoolSetAttribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut keep as *mut u64).cast()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles every kernel source through NVRTC for sm_90 where libnvrtc can
    /// be loaded (no driver or GPU needed); elsewhere there is nothing to run.
    #[test]
    fn nvrtc_compiles_the_sources_for_sm_90_where_nvrtc_exists() {
        if !nvrtc_present() {
            // CI puts NVIDIA's NVRTC wheel on the loader path (.ci/run), so
            // there a missing library is a failure, not a skip.
            assert!(std::env::var("CI").map_or(true, |v| v != "true"), "CI: libnvrtc is not on the loader path, so the kernels were not compiled for sm_90");
            eprintln!("libnvrtc not on the loader path: NVRTC compile not checked here");
            return;
        }
        // The H200's target (sm_90a: the warpgroup products are in it) and
        // plain sm_90 (they are left out, and the rest still builds).
        for (arch, wg) in [(nvrtc_arch((9, 0)), true), ("90".to_string(), false)] {
            let cubin = nvrtc_cubin(&arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(cubin.starts_with(b"\x7fELF"), "NVRTC did not return a cubin for sm_{arch}");
            let has = |name: &[u8]| cubin.windows(name.len()).any(|w| w == name);
            assert!(has(b"st_mm_few"), "sm_{arch}: st_mm_few missing");
            assert_eq!(has(b"matmul_wg"), wg, "sm_{arch}: matmul_wg present = {}", !wg);
            for nb in [32, 64, 96, 128] {
                for wp in [1, 2] {
                    let name = format!("st_mm_wg{nb}_{wp}");
                    assert_eq!(has(name.as_bytes()), wg, "sm_{arch}: {name} present = {}", !wg);
                }
            }
        }
    }

    #[test]
    fn without_a_driver_new_refuses_naming_the_missing_library() {
        if runtime_missing().is_none() {
            return; // a machine with the driver: CudaBackend::new is tested on the device
        }
        let e = CudaBackend::new(0).unwrap_err();
        let KernelError::BackendUnavailable(msg) = e else { panic!("{e:?}") };
        assert!(msg.starts_with("cuda: no "), "{msg}");
        assert!(!CudaBackend::is_available());
    }

    #[test]
    fn launch_shapes_depend_on_widths_only() {
        assert_eq!(kda_block(128, 4), (256, ((4 * 128 + 2 * 8 * 128 + 16) * 4) as u32));
        assert_eq!(kda_block(16, 1).0, 32);
        assert_eq!(kda_block(7, 1).0, 32);
        assert_eq!(mla_warps("t", 512, 576, 8).unwrap().0, 256);
        assert!(mla_warps("t", 100_000, 100_064, 8).is_err());
    }
}
