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
//! (`examples/cuda_check.rs`) states the tolerance of each op.

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
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape, MlpWeights,
    NormShape, ReplayShape, RowSet, UnitProduct, UnitsOut, UnitsShape, mla_partial_width,
};

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
const KDA_CHUNK_PREP_SMEM: u32 = ((3 * 64 * (KDA_CHUNK_DK + 1) + 64) * 4) as u32;
const KDA_CHUNK_STATE_SMEM: u32 = ((KDA_CHUNK_DK * KDA_CHUNK_TILE + 64 * KDA_CHUNK_TILE + 64 * 68 + 3 * 64 * (KDA_CHUNK_DK + 4) + KDA_CHUNK_DK) * 4) as u32;
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
    ((nw * 8 + 8) * 20 + 8) * 8 + 2 * MLA_TC_TILE * (MLA_TC_L + MLA_TC_R) * 4
}
/// Threads of `mla_chunk_merge_f64` (MLA_MERGE_THREADS); it keeps 4 columns
/// per thread, so L <= 512.
const MLA_MERGE_THREADS: u32 = 128;

/// Which kernel runs the f64 MLA partials of K3's row shape (L = 512, R = 64,
/// heads a multiple of 8), and how many rows a chunk (one block) takes. Other
/// shapes always run the scalar `mla_partial_f64`. The choice changes bits
/// (another chunking is another sum order) but never batch invariance: a
/// request's chunks are its own rows. Default `tc8` (8 warps a block) with
/// 512-row chunks, the fastest measured on the H200 at B = 88;
/// [`CudaBackend::set_mla_kernel`] picks another, for measuring the
/// alternatives (`cuda_check --mla`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MlaTc {
    /// Warps per block: 4 or 8; 0 = the scalar kernel.
    warps: usize,
    /// Rows per chunk.
    chunk: usize,
}

const DEFAULT_MLA_TC: MlaTc = MlaTc { warps: 8, chunk: 512 };

impl MlaTc {
    /// Parses `scalar`, `tc4` or `tc8`, optionally `:<rows per chunk>` (a
    /// multiple of 16); None for anything else.
    fn parse(v: &str) -> Option<MlaTc> {
        let (kind, chunk) = match v.split_once(':') {
            Some((k, c)) => (k, Some(c.trim().parse::<usize>().ok()?)),
            None => (v, None),
        };
        let warps = match kind.trim() {
            "scalar" => 0,
            "tc4" => 4,
            "tc8" => 8,
            _ => return None,
        };
        let chunk = chunk.unwrap_or(DEFAULT_MLA_TC.chunk);
        (chunk > 0 && chunk.is_multiple_of(MLA_TC_TILE)).then_some(MlaTc { warps, chunk })
    }
}

/// An f32 buffer in device memory.
pub struct CudaBuf {
    data: CudaSlice<f32>,
    len: usize,
}

/// An i32 buffer in device memory (token ids, replay cursors).
///
/// `known` holds the contents when the host knows them without asking the
/// device: what was uploaded, the zeros of an allocation, the cursors an op set
/// from values it checked, or what the last download read. A download then
/// needs no round trip (under ReplaySSM a decode step reads its cursors back
/// several times a layer, and every read used to wait for the stream). Every op
/// that writes the buffer on the device from values the host does not have
/// (argmax, a region gather) clears it; those all take the buffer `&mut` or
/// create it.
pub struct CudaIBuf {
    data: CudaSlice<i32>,
    len: usize,
    known: std::sync::Mutex<Option<Vec<i32>>>,
}

impl CudaIBuf {
    fn new(data: CudaSlice<i32>, len: usize, known: Option<Vec<i32>>) -> Self {
        CudaIBuf { data, len, known: std::sync::Mutex::new(known) }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Option<Vec<i32>>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_known(&mut self, v: Option<Vec<i32>>) {
        *self.known.get_mut().unwrap_or_else(|e| e.into_inner()) = v;
    }
}

/// An f64 buffer in device memory (attention partials).
pub struct CudaF64Buf {
    data: CudaSlice<f64>,
    len: usize,
}

impl fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBuf({} x f32)", self.len)
    }
}
impl fmt::Debug for CudaIBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaIBuf({} x i32)", self.len)
    }
}
impl fmt::Debug for CudaF64Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaF64Buf({} x f64)", self.len)
    }
}

/// The kernels of the loaded module.
#[derive(Clone)]
struct Funcs {
    /// The decode-step kernels, indexed like `KdaKernel::ALL`.
    kda_step: Vec<CudaFunction>,
    kda_prefill: CudaFunction,
    kda_recurrent_wide: CudaFunction,
    /// The chunked prefill's two phases (kda_chunk_prep, kda_chunk_state of
    /// kda_chunk.hip); None on a device that cannot give their blocks the
    /// shared memory they take (the prefill stays recurrent there).
    kda_chunk: Option<(CudaFunction, CudaFunction)>,
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
    mla_chunk_merge_f64: CudaFunction,
    dcp_merge_f32: CudaFunction,
    dcp_merge_f64: CudaFunction,
    matmul_tc16: CudaFunction,
    matmul_tc32: CudaFunction,
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
    /// The launch-saving paths ([`CudaBackend::set_fused`]).
    fused: bool,
    /// The compiled program (the fused decode step loads its kernels from it).
    module: Arc<cudarc::driver::CudaModule>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBackend(device {} {:?}, sm_{}{})", self.ctx.ordinal(), self.device_name, self.cc.0, self.cc.1)
    }
}

/// Why the CUDA libraries cannot be used on this machine, if they cannot. Asks
/// with cudarc's own candidate names (libloading, which returns an error where
/// cudarc's loaders would panic).
fn runtime_missing() -> Option<String> {
    // SAFETY: these only try to open the libraries by name and close them again.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("cuda: no CUDA driver: libcuda.so.1 not found on the loader path (no NVIDIA driver on this machine)".to_string());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Some(
            "cuda: no NVRTC: libnvrtc.so.13 (or libnvrtc.so) not found on the loader path; \
             add the CUDA toolkit's lib directory to LD_LIBRARY_PATH"
                .to_string(),
        );
    }
    None
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

/// Compiles the device program with NVRTC for `sm_<arch>` and returns the cubin.
pub(crate) fn nvrtc_cubin(arch: &str) -> Result<Vec<u8>> {
    nvrtc_cubin_of(&super::device_program(), arch)
}

/// Compiles `program` (prelude and sources) with NVRTC for `sm_<arch>`.
pub(crate) fn nvrtc_cubin_of(program: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as nr, sys as ns};
    let nvrtc_err = |what: &str, e: nr::NvrtcError| KernelError::BackendUnavailable(format!("cuda: NVRTC {what}: {e:?}"));
    let src = CString::new(program).expect("kernel sources contain no NUL");
    let name = CString::new("handoff_kernels.cu").expect("no NUL");
    let prog = nr::create_program(&src, Some(&name)).map_err(|e| nvrtc_err("create", e))?;
    let gpu_arch = format!("--gpu-architecture=sm_{arch}");
    let opts = [gpu_arch.as_str(), "--std=c++17"];
    // SAFETY: prog is a live program; the options are NUL-free strings.
    let compiled = unsafe { nr::compile_program(prog, &opts) };
    let result = match compiled {
        Err(e) => {
            // SAFETY: prog is live; the log is a NUL-terminated byte string.
            let log = unsafe { nr::get_program_log(prog) }
                .map(|l| l.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(KernelError::BackendUnavailable(format!("cuda: NVRTC failed to compile kernels/hip for sm_{arch} ({e:?}):\n{log}")))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: prog compiled; size and the buffer are valid for writes.
            unsafe { ns::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| nvrtc_err("cubin size", e)).and_then(|()| {
                let mut cubin = vec![0u8; size];
                unsafe { ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }.result().map_err(|e| nvrtc_err("cubin", e)).map(|()| cubin)
            })
        }
    };
    // SAFETY: prog is live and not used after this.
    let _ = unsafe { nr::destroy_program(prog) };
    result
}

/// NVRTC present on this machine (no driver needed): lets the tests compile
/// the sources where only libnvrtc is installed.
#[cfg(test)]
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::InvalidShape { op, reason: format!("{what} = {v} exceeds the device kernels' 32-bit index") })
}

fn i64_of(v: usize) -> i64 {
    // Buffer lengths come from allocations, far below i64::MAX.
    v as i64
}

/// The matmul's k chunk (MM_KC in dense.hip).
const MATMUL_KC: usize = 128;
/// matmul_tc's dynamic shared memory for a `bm` x `bn` tile (dense.hip: x
/// rows of MM_KC + 8 floats, w rows of bn + 4).
const fn tc_smem(bm: usize, bn: usize) -> u32 {
    ((bm * (MATMUL_KC + 8) + MATMUL_KC * (bn + 4)) * 4) as u32
}
/// Products of one `matmul_tc` launch at most (MU_UNITS in dense.hip).
const UNITS_PER_LAUNCH: usize = 32;

/// `hk_mm_units` of dense.hip, the by-value table of the units kernels: per
/// product w's address, x's first column, out's element of row 0, the first
/// element of its scratch, inner, cols.
#[repr(C)]
struct UnitsTable {
    u: [[i64; 6]; UNITS_PER_LAUNCH],
}

// SAFETY: plain integers in the C layout of hk_mm_units (1,536 bytes, within
// the 4 KB kernel argument limit).
unsafe impl cudarc::driver::DeviceRepr for UnitsTable {}

/// A grid-stride launch over `n` elements.
fn ew_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(EW_THREADS as usize).clamp(1, EW_MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (EW_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// The checks of the CPU reference's KDA ops (same errors), on lengths.
#[allow(clippy::too_many_arguments)]
fn check_kda(
    op: &'static str,
    n: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    state_len: usize,
    state_n: usize,
    x: &KdaInputs<'_, CudaBuf>,
    p: &KdaParams<'_, CudaBuf>,
    out_len: usize,
    record_len: Option<usize>,
) -> Result<()> {
    check_nonzero(op, "heads", heads)?;
    check_nonzero(op, "dk", dk)?;
    check_nonzero(op, "dv", dv)?;
    check_len(op, "state", state_len, elems(op, &[state_n, heads, dk, dv])?)?;
    check_len(op, "q", x.q.len, elems(op, &[n, heads, dk])?)?;
    check_len(op, "k", x.k.len, elems(op, &[n, heads, dk])?)?;
    check_len(op, "v", x.v.len, elems(op, &[n, heads, dv])?)?;
    check_len(op, "g_raw", x.g_raw.len, elems(op, &[n, heads, dk])?)?;
    check_len(op, "b_raw", x.b_raw.len, elems(op, &[n, heads])?)?;
    check_len(op, "a_log", p.a_log.len, heads)?;
    check_len(op, "dt_bias", p.dt_bias.len, elems(op, &[heads, dk])?)?;
    check_len(op, "out", out_len, elems(op, &[n, heads, dv])?)?;
    if let Some(len) = record_len {
        let w = dk.checked_add(dk).and_then(|x| x.checked_add(dv)).ok_or(KernelError::SizeOverflow { op, dims: vec![dk, dv] })?;
        check_len(op, "record", len, elems(op, &[n, heads, w])?)?;
    }
    if dk > KDA_MAX_DK {
        return Err(KernelError::InvalidShape { op, reason: format!("dk = {dk}: the device KDA kernels hold at most {KDA_MAX_DK} key rows per head") });
    }
    Ok(())
}

/// Block size and dynamic shared memory of the KDA kernels for `dk` and
/// `cols` value columns per lane: warps of 16 key rows each. Depends on the
/// widths only, never on the batch.
fn kda_block(dk: usize, cols: usize) -> (u32, u32) {
    let nw = dk.div_ceil(KDA_ROWS).max(1);
    let kpad = nw * KDA_ROWS;
    let smem = (4 * kpad + 2 * nw * 32 * cols + 2 * nw) * 4;
    ((nw * 32) as u32, smem as u32)
}

/// Warps per block of the MLA kernels: 8 when their shared memory
/// (q, one accumulator per warp, (m, l) per warp) fits, fewer for wide rows.
/// Depends on the widths only, so a request's reduction order never depends
/// on the batch.
fn mla_warps(op: &'static str, l: usize, width: usize, elem: usize) -> Result<(u32, u32)> {
    for nw in [8usize, 4, 2, 1] {
        let bytes = (width + nw * l + 2 * nw) * elem;
        if bytes <= SMEM_BUDGET {
            return Ok(((nw * 32) as u32, bytes as u32));
        }
    }
    Err(KernelError::InvalidShape { op, reason: format!("rows of {width} (latent {l}) do not fit the device kernel's shared memory") })
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
        let cc = ctx.compute_capability().map_err(|e| unavailable("compute capability", e))?;
        let device_name = ctx.name().map_err(|e| unavailable("device name", e))?;
        let cubin = nvrtc_cubin(&format!("{}{}", cc.0, cc.1))?;
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| unavailable("cannot load the compiled kernels", e))?;
        let get = |name: &str| module.load_function(name).map_err(|e| unavailable(&format!("kernel {name} missing from the module"), e));
        let mut f = Funcs {
            kda_step: KdaKernel::ALL.iter().map(|k| get(k.kernel_name())).collect::<Result<_>>()?,
            kda_prefill: get("kda_prefill")?,
            kda_recurrent_wide: get("kda_recurrent_wide")?,
            kda_chunk: Some((get("kda_chunk_prep")?, get("kda_chunk_state")?)),
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
            mla_chunk_merge_f64: get("mla_chunk_merge_f64")?,
            dcp_merge_f32: get("dcp_merge_f32")?,
            dcp_merge_f64: get("dcp_merge_f64")?,
            matmul_tc16: get("matmul_tc16")?,
            matmul_tc32: get("matmul_tc32")?,
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
        for (func, nw) in [(&f.mla_partial_tc4, 4usize), (&f.mla_partial_tc8, 8)] {
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, mla_tc_smem(nw) as i32)
                .map_err(|e| unavailable("cannot give the MLA kernel its shared memory", e))?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(|e| unavailable("cannot set the MLA kernel's shared memory carveout", e))?;
        }
        // The tensor-core matmul stages a whole k chunk of x and w (52 and 75
        // KB, dense.hip): opt in.
        for (func, bytes) in [(&f.matmul_tc16, tc_smem(16, 128)), (&f.matmul_tc32, tc_smem(32, 64))] {
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| unavailable("cannot give the matmul its shared memory", e))?;
        }
        // The chunked KDA prefill's blocks hold a chunk's 64 x 128 operands in
        // shared memory (97 and 129 KB, kda_chunk.hip): opt in likewise; a
        // device with less per block keeps the recurrent prefill.
        let chunk_ok = f.kda_chunk.as_ref().is_some_and(|(prep, state)| {
            [(prep, KDA_CHUNK_PREP_SMEM), (state, KDA_CHUNK_STATE_SMEM)]
                .iter()
                .all(|(func, bytes)| func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, *bytes as i32).is_ok())
        });
        if !chunk_ok {
            f.kda_chunk = None;
        }
        Ok(Self { ctx, stream, f, device_name, cc, kda_kernel: DEFAULT_KDA_KERNEL, mla_tc: DEFAULT_MLA_TC, fused: true, module })
    }

    /// The fused decode step's tensor-core product alone (see
    /// `step_cuda::tc_matmul`): the product and its mean device time in us.
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
        super::step_cuda::tc_matmul(&self.ctx, &self.stream, &self.module, x, m, w, dtype, terms, reps)
    }

    /// Picks the generic path's MLA partial kernel: `scalar`, `tc4` or `tc8`,
    /// optionally `:<rows per chunk>` (a multiple of 16). Another kernel or
    /// chunk gives other bits (another sum order), each batch invariant; for
    /// measuring. A name it does not know is refused.
    pub fn set_mla_kernel(&mut self, kernel: &str) -> Result<()> {
        self.mla_tc = MlaTc::parse(kernel).ok_or_else(|| KernelError::InvalidShape {
            op: "set_mla_kernel",
            reason: format!("{kernel:?}: expected scalar, tc4 or tc8, optionally :<rows per chunk, a multiple of 16>"),
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

    fn alloc_t<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, op: &'static str, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(len.max(1)).map_err(dev(op))
    }

    fn upload_t<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, op: &'static str, data: &[T]) -> Result<CudaSlice<T>> {
        let mut buf = self.alloc_t::<T>(op, data.len())?;
        if !data.is_empty() {
            self.stream.memcpy_htod(data, &mut buf.slice_mut(0..data.len())).map_err(dev(op))?;
        }
        Ok(buf)
    }

    fn download_t<T: cudarc::driver::DeviceRepr>(&self, op: &'static str, data: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let v = self.stream.clone_dtoh(&data.slice(0..len)).map_err(dev(op))?;
        self.stream.synchronize().map_err(dev(op))?;
        Ok(v)
    }

    /// Recurrent KDA over `seqs` sequences of `tokens` tokens (see kda.hip).
    #[allow(clippy::too_many_arguments)]
    fn kda_recurrent(
        &self,
        op: &'static str,
        seqs: usize,
        tokens: usize,
        heads: usize,
        dk: usize,
        dv: usize,
        state: &mut CudaBuf,
        x: KdaInputs<'_, CudaBuf>,
        p: KdaParams<'_, CudaBuf>,
        out: &mut CudaBuf,
        record: Option<&mut CudaBuf>,
    ) -> Result<()> {
        if seqs == 0 || tokens == 0 {
            return Ok(());
        }
        let grid_x = int(op, "slots x heads", seqs * heads)? as u32;
        // The step kernels are compiled for tokens == 1 (no token loop).
        let (func, cols) = if dk > 128 {
            (&self.f.kda_recurrent_wide, 1)
        } else if tokens == 1 {
            let k = self.kda_kernel;
            let at = KdaKernel::ALL.iter().position(|&x| x == k).expect("every variant is loaded");
            (&self.f.kda_step[at], k.cols_per_lane())
        } else {
            (&self.f.kda_prefill, 1)
        };
        let tiles = dv.div_ceil(32 * cols);
        if tiles > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("dv = {dv} is too wide") });
        }
        let (threads, smem) = kda_block(dk, cols);
        let cfg = LaunchConfig { grid_dim: (grid_x, tiles as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let (t, h, k, v) = (int(op, "tokens", tokens)?, int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut state.data)
            .arg(&x.q.data)
            .arg(&x.k.data)
            .arg(&x.v.data)
            .arg(&x.g_raw.data)
            .arg(&x.b_raw.data)
            .arg(&p.a_log.data)
            .arg(&p.dt_bias.data)
            .arg(&mut out.data);
        match record {
            Some(r) => b.arg(&mut r.data),
            None => b.arg(&null),
        };
        b.arg(&t).arg(&h).arg(&k).arg(&v);
        // SAFETY: argument types and order match kda_recurrent; every buffer
        // was checked to hold the elements the launch touches.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// f32 MLA attention: decode (tokens = 1, base = rows) or causal prefill.
    #[allow(clippy::too_many_arguments)]
    fn mla_attend(
        &self,
        op: &'static str,
        shape: MlaShape,
        tokens: usize,
        base: usize,
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        out: &mut CudaBuf,
        lse: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let (h, l, width) = (shape.heads, shape.kv_lora_rank, shape.row_width());
        if tokens == 0 {
            return Ok(());
        }
        let (threads, smem) = mla_warps(op, l, width, 4)?;
        let cfg = LaunchConfig { grid_dim: (int(op, "tokens x heads", tokens * h)? as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let (hh, ll, ww) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?, int(op, "row width", width)?);
        let base = i64_of(base);
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(&self.f.mla_attend_f32);
        b.arg(&q_lat.data).arg(&rows.data).arg(&mut out.data);
        match lse {
            Some(x) => b.arg(&mut x.data),
            None => b.arg(&null),
        };
        b.arg(&hh).arg(&ll).arg(&ww).arg(&base).arg(&shape.scale);
        // SAFETY: types and order match mla_attend_f32; lengths were checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// f64 partials of `counts.len()` requests whose rows lie one after the
    /// other in `rows` (lengths checked by the caller): the tensor-core kernel
    /// for K3's row shape, else the scalar one.
    fn mla_partial_any(&self, op: &'static str, shape: MlaShape, q_lat: &CudaBuf, rows: &CudaBuf, counts: &[usize], partial: &mut CudaF64Buf) -> Result<()> {
        let batch = counts.len();
        if batch == 0 {
            return Ok(());
        }
        let tc = self.mla_tc;
        if tc.warps != 0 && shape.kv_lora_rank == MLA_TC_L && shape.rope_dim == MLA_TC_R && shape.heads.is_multiple_of(8) {
            return self.mla_partial_tc(op, shape, q_lat, rows, counts, partial, tc);
        }
        if batch == 1 {
            return self.mla_partial(op, shape, 1, q_lat, rows, None, counts[0], partial);
        }
        // Row offsets of the requests, uploaded for this call (B + 1 values);
        // the temporary is freed on the stream after the kernel.
        let mut starts = Vec::with_capacity(batch + 1);
        let mut at = 0u64;
        starts.push(0);
        for &c in counts {
            at += c as u64;
            starts.push(at);
        }
        let starts = self.upload_t(op, &starts)?;
        self.mla_partial(op, shape, batch, q_lat, rows, Some(&starts), 0, partial)
    }

    /// The tensor-core partial (mla.hip, `mla_partial_tc4/8`): every request's
    /// rows cut into chunks of `tc.chunk` rows counted from the request's first
    /// row, one block per (chunk, 8 heads) into a scratch of chunk partials,
    /// then `mla_chunk_merge_f64` merges each request's chunks in order.
    #[allow(clippy::too_many_arguments)]
    fn mla_partial_tc(
        &self,
        op: &'static str,
        shape: MlaShape,
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        counts: &[usize],
        partial: &mut CudaF64Buf,
        tc: MlaTc,
    ) -> Result<()> {
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        let batch = counts.len();
        // One table: [B + 1] first chunk of each request, then per chunk
        // (first row, rows, request).
        let nchunks: usize = counts.iter().map(|&n| n.div_ceil(tc.chunk)).sum();
        let mut table: Vec<i64> = Vec::with_capacity(batch + 1 + 3 * nchunks);
        let mut c = 0usize;
        table.push(0);
        for &n in counts {
            c += n.div_ceil(tc.chunk);
            table.push(i64_of(c));
        }
        let mut row0 = 0usize;
        for (b, &n) in counts.iter().enumerate() {
            let mut r = 0usize;
            while r < n {
                let k = tc.chunk.min(n - r);
                table.extend([i64_of(row0 + r), i64_of(k), i64_of(b)]);
                r += k;
            }
            row0 += n;
        }
        let table = self.upload_t(op, &table)?;
        let pw = mla_partial_width(l);
        let (hh, ll) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?);
        // SAFETY: every element of the scratch is written by the chunk kernel
        // (each (chunk, head) block writes its m, l and all L columns) before
        // the merge reads it; both run on this stream in order.
        let mut parts = unsafe { self.stream.alloc::<f64>((nchunks * h * pw).max(1)) }.map_err(dev(op))?;
        if nchunks > 0 {
            if nchunks > i32::MAX as usize || h / 8 > 65535 {
                return Err(KernelError::InvalidShape { op, reason: format!("{nchunks} chunks x {h} heads exceed the device grid") });
            }
            let nw = tc.warps;
            let cfg =
                LaunchConfig { grid_dim: (nchunks as u32, (h / 8) as u32, 1), block_dim: ((32 * nw) as u32, 1, 1), shared_mem_bytes: mla_tc_smem(nw) as u32 };
            let func = if nw == 8 { &self.f.mla_partial_tc8 } else { &self.f.mla_partial_tc4 };
            let work = table.slice((batch + 1)..);
            let scale = shape.scale as f64;
            let mut b = self.stream.launch_builder(func);
            b.arg(&q_lat.data).arg(&rows.data).arg(&work).arg(&mut parts).arg(&hh).arg(&scale);
            // SAFETY: types and order match mla_partial_tc4/8; the table's rows
            // lie inside `rows` (checked by the caller), q_lat holds B x H rows.
            unsafe { b.launch(cfg) }.map_err(dev(op))?;
        }
        let cfg = LaunchConfig { grid_dim: (int(op, "requests x heads", batch * h)? as u32, 1, 1), block_dim: (MLA_MERGE_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.f.mla_chunk_merge_f64);
        b.arg(&parts).arg(&table).arg(&mut partial.data).arg(&hh).arg(&ll);
        // SAFETY: types and order match mla_chunk_merge_f64; partial holds B x H x (2 + L).
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// f64 partials for `batch` requests; `starts` (batch + 1 row offsets) or,
    /// when None, one request of `count` rows.
    #[allow(clippy::too_many_arguments)]
    fn mla_partial(
        &self,
        op: &'static str,
        shape: MlaShape,
        batch: usize,
        q_lat: &CudaBuf,
        rows: &CudaBuf,
        starts: Option<&CudaSlice<u64>>,
        count: usize,
        partial: &mut CudaF64Buf,
    ) -> Result<()> {
        let (h, l, width) = (shape.heads, shape.kv_lora_rank, shape.row_width());
        if batch == 0 {
            return Ok(());
        }
        let (threads, smem) = mla_warps(op, l, width, 8)?;
        let cfg = LaunchConfig { grid_dim: (int(op, "requests x heads", batch * h)? as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let (hh, ll, ww) = (int(op, "heads", h)?, int(op, "kv_lora_rank", l)?, int(op, "row width", width)?);
        let count = i64_of(count);
        let scale = shape.scale as f64;
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(&self.f.mla_partial_f64);
        b.arg(&q_lat.data).arg(&rows.data);
        match starts {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(&mut partial.data).arg(&hh).arg(&ll).arg(&ww).arg(&count).arg(&scale);
        // SAFETY: types and order match mla_partial_f64; lengths were checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// Both matmul kernels sum in the one order dense.hip describes, so the
    /// choice between them never changes a bit: few rows (decode) go split
    /// over k chunks, many rows (prefill) through the tiled kernel.
    #[allow(clippy::too_many_arguments)]
    fn matmul_unchecked(
        &self,
        op: &'static str,
        rows: usize,
        inner: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        use cudarc::driver::DevicePtr;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if inner == 0 {
            return self.stream.memset_zeros(out).map_err(dev(op));
        }
        int(op, "inner", inner)?;
        int(op, "cols", cols)?;
        let chunks = inner.div_ceil(MATMUL_KC);
        let mut t = UnitsTable { u: [[0; 6]; UNITS_PER_LAUNCH] };
        let (wp, _sync) = w.device_ptr(&self.stream);
        t.u[0] = [wp as i64, 0, 0, 0, i64_of(inner), i64_of(cols)];
        // SAFETY: matmul_tc writes every chunk sum of every element before
        // matmul_chunk_sum, queued after it on the same stream, reads any.
        let mut part = unsafe { self.stream.alloc::<f32>(chunks * rows * cols) }.map_err(dev(op))?;
        self.tc_launch(op, &t, 1, x, i64_of(inner), &mut part, rows, cols, chunks)?;
        let n = rows * cols;
        let (nn, nc) = (i64_of(n), chunks as i32);
        let mut b = self.stream.launch_builder(&self.f.matmul_chunk_sum);
        b.arg(&part).arg(out).arg(&nn).arg(&nc);
        // SAFETY: types and order match matmul_chunk_sum; part holds chunks x
        // rows x cols sums, out rows x cols.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }

    /// matmul_tc over the `units` products of `t` (chunk sums into `part`),
    /// its tile from the row count: 16 x 128 for few rows, 32 x 64 for more.
    #[allow(clippy::too_many_arguments)]
    fn tc_launch(
        &self,
        op: &'static str,
        t: &UnitsTable,
        units: usize,
        x: &CudaSlice<f32>,
        x_row: i64,
        part: &mut CudaSlice<f32>,
        rows: usize,
        max_cols: usize,
        max_chunks: usize,
    ) -> Result<()> {
        let (func, bm, bn) = if rows <= 16 { (&self.f.matmul_tc16, 16, 128) } else { (&self.f.matmul_tc32, 32, 64) };
        let z = rows.div_ceil(bm) * units;
        if z > 65535 || max_chunks > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{rows} rows x {units} products exceed the device grid") });
        }
        let cfg = LaunchConfig {
            grid_dim: (int(op, "column tiles", max_cols.div_ceil(bn))? as u32, max_chunks as u32, z as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: tc_smem(bm, bn),
        };
        let r = int(op, "rows", rows)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(t).arg(x).arg(part).arg(&r).arg(&x_row);
        // SAFETY: types and order match matmul_tc16/32; the caller checked the
        // table's blocks of x and w and sized part for every product's chunks.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// The products of a checked `matmul_units` one matmul at a time: a block of
    /// x that is not all of it copied out; a stacked product written in place, a
    /// side-by-side one copied to its columns.
    fn matmul_units_each(&self, op: &'static str, shape: UnitsShape, x: &CudaBuf, units: &[UnitProduct<'_, CudaBuf>], out: &mut CudaBuf) -> Result<()> {
        let rows = shape.rows;
        for (i, u) in units.iter().enumerate() {
            let block = if u.x_col == 0 && u.inner == shape.x_width {
                None
            } else {
                let mut b = self.alloc(rows * u.inner)?;
                let cols = ColsCopy { rows, src_cols: shape.x_width, src_col: u.x_col, dst_cols: u.inner, dst_col: 0, width: u.inner };
                self.copy_cols(cols, x, &mut b)?;
                Some(b)
            };
            let xb = &block.as_ref().unwrap_or(x).data;
            let (at, _) = shape.out_at(i, u);
            match shape.out {
                UnitsOut::Stacked => {
                    let mut o = out.data.slice_mut(at..at + rows * u.cols);
                    self.matmul_unchecked(op, rows, u.inner, u.cols, xb, &u.w.data, &mut o)?;
                }
                UnitsOut::Columns { width } => {
                    let mut p = self.alloc(rows * u.cols)?;
                    self.matmul_unchecked(op, rows, u.inner, u.cols, xb, &u.w.data, &mut p.data.slice_mut(..))?;
                    self.copy_cols(ColsCopy { rows, src_cols: u.cols, src_col: 0, dst_cols: width, dst_col: at, width: u.cols }, &p, out)?;
                }
            }
        }
        Ok(())
    }

    /// Up to UNITS_PER_LAUNCH split-k products (checked by the caller) in two
    /// launches: the chunk sums of all, then their sums into place.
    fn matmul_units_launch(
        &self,
        op: &'static str,
        shape: UnitsShape,
        x: &CudaBuf,
        units: &[UnitProduct<'_, CudaBuf>],
        first: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let rows = shape.rows;
        let mut t = UnitsTable { u: [[0; 6]; UNITS_PER_LAUNCH] };
        let (mut scratch, mut max_cols, mut max_chunks, mut max_n) = (0usize, 1usize, 1usize, 1usize);
        for (i, u) in units.iter().enumerate() {
            let (at, _) = shape.out_at(first + i, u);
            let (w, _sync) = u.w.data.device_ptr(&self.stream);
            let chunks = u.inner.div_ceil(MATMUL_KC);
            t.u[i] = [w as i64, i64_of(u.x_col), i64_of(at), i64_of(scratch), i64_of(u.inner), i64_of(u.cols)];
            int(op, "inner", u.inner)?;
            int(op, "cols", u.cols)?;
            scratch += chunks * rows * u.cols;
            max_cols = max_cols.max(u.cols);
            max_chunks = max_chunks.max(chunks);
            max_n = max_n.max(rows * u.cols);
        }
        // SAFETY: every element of a product's scratch is written by
        // matmul_tc before matmul_units_sum reads it.
        let mut part = unsafe { self.stream.alloc::<f32>(scratch.max(1)) }.map_err(dev(op))?;
        let r = int(op, "rows", rows)?;
        let xr = i64_of(shape.x_width);
        self.tc_launch(op, &t, units.len(), &x.data, xr, &mut part, rows, max_cols, max_chunks)?;
        let (_, pitch) = units.first().map_or((0, 0), |u| shape.out_at(first, u));
        let or = i64_of(pitch);
        let mut cfg = ew_cfg(max_n);
        cfg.grid_dim.0 = cfg.grid_dim.0.min((EW_MAX_BLOCKS / units.len()).max(1) as u32);
        cfg.grid_dim.1 = units.len() as u32;
        let mut b = self.stream.launch_builder(&self.f.matmul_units_sum);
        b.arg(&t).arg(&part).arg(&mut out.data).arg(&r).arg(&or);
        // SAFETY: types and order match matmul_units_sum; every product's rows
        // fall inside out (UnitsShape::out_len).
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    fn silu_mul_unchecked(&self, op: &'static str, n: usize, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let nn = i64_of(n);
        let mut b = self.stream.launch_builder(&self.f.silu_mul);
        b.arg(gate).arg(up).arg(out).arg(&nn);
        // SAFETY: types and order match silu_mul; lengths were checked.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }

    fn fill_unchecked(&self, op: &'static str, buf: &mut CudaSlice<f32>, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let nn = i64_of(n);
        let mut b = self.stream.launch_builder(&self.f.fill_f32);
        b.arg(buf).arg(&value).arg(&nn);
        // SAFETY: types and order match fill_f32; n is within the buffer.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }

    /// Reads and validates the replay cursors (the CPU's errors) on the host.
    fn read_cursors(&self, op: &'static str, cursor: &CudaIBuf, capacity: usize) -> Result<Vec<usize>> {
        let host = self.download_i32(cursor)?;
        cpu_kda::read_cursors(op, &host, capacity)
    }
}

/// [`super::cuda_device_memory`]: the device's primary context, checked like
/// [`CudaBackend::new`] (libraries first, then the device count).
pub(crate) fn open_memory(device: usize) -> Result<Arc<dyn DeviceMemory>> {
    if let Some(why) = runtime_missing() {
        return Err(KernelError::BackendUnavailable(why));
    }
    let open = || -> Result<Arc<dyn DeviceMemory>> {
        let count = CudaContext::device_count().map_err(|e| unavailable("no device (cuInit or device count failed)", e))?;
        if device >= count.max(0) as usize {
            return Err(KernelError::BackendUnavailable(format!("cuda: no device {device}: the driver reports {count}")));
        }
        let ctx = CudaContext::new(device).map_err(|e| unavailable("cannot open the device context", e))?;
        Ok(Arc::new(super::CudaMemory::new(ctx)?))
    };
    match std::panic::catch_unwind(open) {
        Ok(r) => r,
        Err(p) => Err(KernelError::BackendUnavailable(format!("cuda: the CUDA runtime failed while opening device {device}: {}", panic_text(p.as_ref())))),
    }
}

/// The region kernels' launch: items, values per item, the device offsets.
impl CudaBackend {
    fn region_launch(
        &self,
        op: &'static str,
        region: DeviceRegion,
        items: RegionItems<'_>,
        buf_len: usize,
        launch: impl FnOnce(&CudaSlice<i64>, i64, i64, i32) -> Result<()>,
    ) -> Result<()> {
        let n = items.check(op, region)?;
        check_len(op, "buffer", buf_len, n)?;
        if n == 0 {
            return Ok(());
        }
        let offs: Vec<i64> = items.offsets.iter().map(|&o| o as i64).collect();
        let offs = self.upload_t::<i64>(op, &offs)?;
        let code = match items.dtype {
            StorageDtype::F32 => 0,
            StorageDtype::Bf16 => 1,
            StorageDtype::F16 => 2,
        };
        launch(&offs, i64_of(items.offsets.len()), i64_of(items.values), code)
    }

    /// Launches a 4-byte (`code` 0) or 16-bit region kernel over `n` elements.
    #[allow(clippy::too_many_arguments)]
    fn region_kernel<T: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        b32: &CudaFunction,
        b16: &CudaFunction,
        region: DeviceRegion,
        offs: &CudaSlice<i64>,
        items: i64,
        per: i64,
        code: i32,
        buf: &CudaSlice<T>,
    ) -> Result<()> {
        let n = (items * per) as usize;
        let base = region.addr;
        let mut b = self.stream.launch_builder(if code == 0 { b32 } else { b16 });
        b.arg(&base).arg(offs).arg(&items).arg(&per);
        if code != 0 {
            b.arg(&code);
        }
        b.arg(buf);
        // SAFETY: argument types and order match region_{gather,scatter}_b{32,16}
        // (the base is a device address, passed as 8 bytes); every item was
        // checked against the region by `RegionItems::check`.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn decode_step(&self, spec: &crate::step::StepSpec) -> Result<Box<dyn crate::step::DecodeStep>> {
        let step = super::step_cuda::CudaStep::new(self.ctx.clone(), self.stream.clone(), self.module.clone(), spec)?;
        Ok(Box::new(step))
    }

    fn device_memory(&self) -> Result<Arc<dyn DeviceMemory>> {
        Ok(Arc::new(super::CudaMemory::new(Arc::clone(&self.ctx))?))
    }

    fn region_gather(&self, region: DeviceRegion, items: RegionItems<'_>) -> Result<CudaBuf> {
        let op = "region_gather";
        let n = items.check(op, region)?;
        let out = self.alloc(n)?;
        self.region_launch(op, region, items, n, |offs, it, per, code| {
            self.region_kernel(op, &self.f.region_gather_b32, &self.f.region_gather_b16, region, offs, it, per, code, &out.data)
        })?;
        Ok(out)
    }

    fn region_scatter(&self, src: &CudaBuf, region: DeviceRegion, items: RegionItems<'_>) -> Result<()> {
        let op = "region_scatter";
        self.region_launch(op, region, items, src.len, |offs, it, per, code| {
            self.region_kernel(op, &self.f.region_scatter_b32, &self.f.region_scatter_b16, region, offs, it, per, code, &src.data)
        })
    }

    fn region_gather_i32(&self, region: DeviceRegion, offsets: &[u64]) -> Result<CudaIBuf> {
        let op = "region_gather_i32";
        let items = RegionItems { offsets, values: 1, dtype: StorageDtype::F32 };
        let mut out = self.alloc_i32(offsets.len())?;
        out.set_known(None);
        self.region_launch(op, region, items, offsets.len(), |offs, it, per, code| {
            self.region_kernel(op, &self.f.region_gather_b32, &self.f.region_gather_b16, region, offs, it, per, code, &out.data)
        })?;
        Ok(out)
    }

    fn region_scatter_i32(&self, src: &CudaIBuf, region: DeviceRegion, offsets: &[u64]) -> Result<()> {
        let op = "region_scatter_i32";
        let items = RegionItems { offsets, values: 1, dtype: StorageDtype::F32 };
        self.region_launch(op, region, items, src.len, |offs, it, per, code| {
            self.region_kernel(op, &self.f.region_scatter_b32, &self.f.region_scatter_b16, region, offs, it, per, code, &src.data)
        })
    }

    fn synchronize(&self) -> Result<()> {
        CudaBackend::synchronize(self)
    }

    type Buf = CudaBuf;
    type IBuf = CudaIBuf;
    type F64Buf = CudaF64Buf;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf> {
        Ok(CudaBuf { data: self.alloc_t("alloc", len)?, len })
    }

    fn upload(&self, data: &[f32]) -> Result<CudaBuf> {
        Ok(CudaBuf { data: self.upload_t("upload", data)?, len: data.len() })
    }

    fn upload_into(&self, dst: &mut CudaBuf, offset: usize, data: &[f32]) -> Result<()> {
        let op = "upload_into";
        let r = range(op, "dst", offset, data.len(), dst.len)?;
        if !data.is_empty() {
            self.stream.memcpy_htod(data, &mut dst.data.slice_mut(r)).map_err(dev(op))?;
        }
        Ok(())
    }

    fn download(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        self.download_t("download", &buf.data, buf.len)
    }

    fn buf_len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn alloc_i32(&self, len: usize) -> Result<CudaIBuf> {
        Ok(CudaIBuf::new(self.alloc_t("alloc_i32", len)?, len, Some(vec![0; len])))
    }

    fn upload_i32(&self, data: &[i32]) -> Result<CudaIBuf> {
        Ok(CudaIBuf::new(self.upload_t("upload_i32", data)?, data.len(), Some(data.to_vec())))
    }

    fn download_i32(&self, buf: &CudaIBuf) -> Result<Vec<i32>> {
        let mut known = buf.known();
        if let (true, Some(v)) = (self.fused, known.as_ref()) {
            return Ok(v.clone());
        }
        let v = self.download_t("download_i32", &buf.data, buf.len)?;
        *known = Some(v.clone());
        Ok(v)
    }

    fn alloc_f64(&self, len: usize) -> Result<CudaF64Buf> {
        Ok(CudaF64Buf { data: self.alloc_t("alloc_f64", len)?, len })
    }

    fn upload_f64(&self, data: &[f64]) -> Result<CudaF64Buf> {
        Ok(CudaF64Buf { data: self.upload_t("upload_f64", data)?, len: data.len() })
    }

    fn download_f64(&self, buf: &CudaF64Buf) -> Result<Vec<f64>> {
        self.download_t("download_f64", &buf.data, buf.len)
    }

    fn fill(&self, buf: &mut CudaBuf, value: f32) -> Result<()> {
        let n = buf.len;
        self.fill_unchecked("fill", &mut buf.data, n, value)
    }

    fn copy(&self, src: &CudaBuf, src_off: usize, dst: &mut CudaBuf, dst_off: usize, len: usize) -> Result<()> {
        let op = "copy";
        let rs = range(op, "src", src_off, len, src.len)?;
        let rd = range(op, "dst", dst_off, len, dst.len)?;
        if len > 0 {
            self.stream.memcpy_dtod(&src.data.slice(rs), &mut dst.data.slice_mut(rd)).map_err(dev(op))?;
        }
        Ok(())
    }

    fn copy_cols(&self, shape: ColsCopy, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
        let op = "copy_cols";
        let ColsCopy { rows, src_cols, src_col, dst_cols, dst_col, width } = shape;
        check_len(op, "src", src.len, elems(op, &[rows, src_cols])?)?;
        check_len(op, "dst", dst.len, elems(op, &[rows, dst_cols])?)?;
        range(op, "src row", src_col, width, src_cols)?;
        range(op, "dst row", dst_col, width, dst_cols)?;
        let n = rows * width;
        if n == 0 {
            return Ok(());
        }
        let a = [rows, src_cols, src_col, dst_cols, dst_col, width].map(i64_of);
        let mut b = self.stream.launch_builder(&self.f.copy_cols);
        b.arg(&src.data).arg(&mut dst.data);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: types and order match copy_cols; ranges were checked.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }

    fn copy_f64(&self, src: &CudaF64Buf, src_off: usize, dst: &mut CudaF64Buf, dst_off: usize, len: usize) -> Result<()> {
        let op = "copy_f64";
        let rs = range(op, "src", src_off, len, src.len)?;
        let rd = range(op, "dst", dst_off, len, dst.len)?;
        if len > 0 {
            self.stream.memcpy_dtod(&src.data.slice(rs), &mut dst.data.slice_mut(rd)).map_err(dev(op))?;
        }
        Ok(())
    }

    fn round_to(&self, buf: &mut CudaBuf, dtype: StorageDtype) -> Result<()> {
        let op = "round_to";
        let code: i32 = match dtype {
            StorageDtype::F32 => return Ok(()),
            StorageDtype::Bf16 => 1,
            StorageDtype::F16 => 2,
        };
        let n = buf.len;
        if n == 0 {
            return Ok(());
        }
        let nn = i64_of(n);
        let mut b = self.stream.launch_builder(&self.f.round_to);
        b.arg(&mut buf.data).arg(&code).arg(&nn);
        // SAFETY: types and order match round_to.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }

    fn kda_step(
        &self,
        shape: KdaStepShape,
        state: &mut CudaBuf,
        x: KdaInputs<'_, CudaBuf>,
        params: KdaParams<'_, CudaBuf>,
        out: &mut CudaBuf,
        record: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let op = "kda_step";
        let KdaStepShape { batch, heads, dk, dv } = shape;
        check_kda(op, batch, heads, dk, dv, state.len, batch, &x, &params, out.len, record.as_ref().map(|r| r.len))?;
        self.kda_recurrent(op, batch, 1, heads, dk, dv, state, x, params, out, record)
    }

    /// The chunked form (kda_chunk.hip) where the CPU reference takes it too
    /// (at least one chunk of 64 tokens and 2 dv >= 3 x 64), dk <= 128 and the
    /// device gives the kernels their shared memory (the H200 does): a
    /// parallel pass over all chunks, then one block per (head, 16 value
    /// columns) walks the chunks; it agrees with the CPU's chunked form to
    /// rounding. Otherwise the recurrent form: one block per (head, column
    /// tile) walks the tokens with the state in registers, so the result
    /// equals `tokens` decode steps bit for bit.
    fn kda_prefill(
        &self,
        shape: KdaPrefillShape,
        state: &mut CudaBuf,
        x: KdaInputs<'_, CudaBuf>,
        params: KdaParams<'_, CudaBuf>,
        out: &mut CudaBuf,
        record: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let op = "kda_prefill";
        let KdaPrefillShape { tokens, heads, dk, dv } = shape;
        check_kda(op, tokens, heads, dk, dv, state.len, 1, &x, &params, out.len, record.as_ref().map(|r| r.len))?;
        let chunk = cpu_kda::KDA_CHUNK;
        let Some((prep, pass)) = self.f.kda_chunk.as_ref().filter(|_| tokens >= chunk && dk <= KDA_CHUNK_DK && 2 * dv >= 3 * chunk) else {
            return self.kda_recurrent(op, 1, tokens, heads, dk, dv, state, x, params, out, record);
        };
        // Workspace of kda_chunk.hip (kda_chunk_ws), every element written by
        // kda_chunk_prep before kda_chunk_state reads it.
        let chunks = tokens.div_ceil(chunk);
        let ws_len = (|| {
            let rows = heads.checked_mul(chunks)?.checked_mul(chunk)?;
            let per_chunk = heads.checked_mul(chunks)?.checked_mul(chunk * chunk + KDA_CHUNK_DK)?;
            rows.checked_mul(3 * KDA_CHUNK_DK + dv)?.checked_add(per_chunk)
        })()
        .ok_or(KernelError::SizeOverflow { op, dims: vec![tokens, heads, dv] })?;
        // SAFETY: kda_chunk_prep writes every element before kda_chunk_state,
        // queued after it on the same stream, reads any.
        let ws = unsafe { self.stream.alloc::<f32>(ws_len) }.map_err(dev(op))?;
        let tiles = dv.div_ceil(KDA_CHUNK_TILE);
        if tiles > 65535 || heads > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{heads} heads of dv = {dv}: too many blocks") });
        }
        let (t, h, k, v) = (int(op, "tokens", tokens)?, int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let nch = int(op, "chunks", chunks)?;
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(prep);
        b.arg(&x.q.data).arg(&x.k.data).arg(&x.v.data).arg(&x.g_raw.data).arg(&x.b_raw.data).arg(&params.a_log.data).arg(&params.dt_bias.data);
        match record.as_deref() {
            Some(r) => b.arg(&r.data),
            None => b.arg(&null),
        };
        b.arg(&ws).arg(&t).arg(&h).arg(&k).arg(&v);
        let cfg = LaunchConfig { grid_dim: (nch as u32, heads as u32, 1), block_dim: (KDA_CHUNK_THREADS, 1, 1), shared_mem_bytes: KDA_CHUNK_PREP_SMEM };
        // SAFETY: argument types and order match kda_chunk_prep; the inputs
        // and the record were checked to hold tokens x heads rows, the
        // workspace is sized as kda_chunk_ws lays it out.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        let mut b = self.stream.launch_builder(pass);
        b.arg(&mut state.data).arg(&mut out.data);
        match record {
            Some(r) => b.arg(&mut r.data),
            None => b.arg(&null),
        };
        b.arg(&ws).arg(&t).arg(&h).arg(&k).arg(&v);
        let cfg = LaunchConfig { grid_dim: (heads as u32, tiles as u32, 1), block_dim: (KDA_CHUNK_THREADS, 1, 1), shared_mem_bytes: KDA_CHUNK_STATE_SMEM };
        // SAFETY: argument types and order match kda_chunk_state; state, out
        // and record were checked against the shape.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    fn replay_append(&self, shape: ReplayShape, tokens: usize, ring: &mut CudaBuf, cursor: &mut CudaIBuf, records: &CudaBuf) -> Result<()> {
        let op = "replay_append";
        let w = cpu_kda::check_replay(op, &shape, ring.len, cursor.len)?;
        let ReplayShape { batch, heads, capacity, .. } = shape;
        check_len(op, "records", records.len, elems(op, &[batch, tokens, heads, w])?)?;
        let cur = self.read_cursors(op, cursor, capacity)?;
        for (b, &c) in cur.iter().enumerate() {
            if c + tokens > capacity {
                return Err(KernelError::ReplayFull { slot: b, cursor: c, tokens, capacity });
            }
        }
        let per = heads * w;
        let n = tokens * per;
        if batch == 0 || n == 0 {
            return Ok(());
        }
        if batch > 65535 {
            return Err(KernelError::InvalidShape { op, reason: format!("{batch} slots exceed the device grid") });
        }
        let mut cfg = ew_cfg(n);
        cfg.grid_dim.0 = cfg.grid_dim.0.min((EW_MAX_BLOCKS / batch).max(1) as u32);
        cfg.grid_dim.1 = batch as u32;
        let (cap, tok, per64) = (int(op, "capacity", capacity)?, int(op, "tokens", tokens)?, i64_of(per));
        let mut b = self.stream.launch_builder(&self.f.replay_append);
        b.arg(&mut ring.data).arg(&cursor.data).arg(&records.data).arg(&cap).arg(&tok).arg(&per64);
        // SAFETY: types and order match replay_append; every cursor + tokens
        // was checked to fit the ring.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        // c + tokens <= capacity, which the cursor range check bounds by i32.
        let next: Vec<i32> = cur.iter().map(|&c| (c + tokens) as i32).collect();
        self.stream.memcpy_htod(&next, &mut cursor.data.slice_mut(0..batch)).map_err(dev(op))?;
        cursor.set_known(Some(next));
        Ok(())
    }

    fn replay_commit(&self, shape: ReplayShape, state: &mut CudaBuf, ring: &CudaBuf, cursor: &mut CudaIBuf) -> Result<()> {
        let op = "replay_commit";
        cpu_kda::check_replay(op, &shape, ring.len, cursor.len)?;
        let ReplayShape { batch, heads, dk, dv, capacity } = shape;
        check_len(op, "state", state.len, elems(op, &[batch, heads, dk, dv])?)?;
        self.read_cursors(op, cursor, capacity)?;
        if dk > KDA_MAX_DK {
            return Err(KernelError::InvalidShape { op, reason: format!("dk = {dk}: the device KDA kernels hold at most {KDA_MAX_DK} key rows per head") });
        }
        if batch == 0 {
            return Ok(());
        }
        let tiles = dv.div_ceil(128); // replay_commit's tile: 4 columns per lane
        let (threads, _) = kda_block(dk, 4);
        let cfg =
            LaunchConfig { grid_dim: (int(op, "slots x heads", batch * heads)? as u32, tiles as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let (cap, h, k, v) = (int(op, "capacity", capacity)?, int(op, "heads", heads)?, int(op, "dk", dk)?, int(op, "dv", dv)?);
        let mut b = self.stream.launch_builder(&self.f.replay_commit);
        b.arg(&mut state.data).arg(&ring.data).arg(&cursor.data).arg(&cap).arg(&h).arg(&k).arg(&v);
        // SAFETY: types and order match replay_commit; cursors were checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        self.stream.memset_zeros(&mut cursor.data.slice_mut(0..batch)).map_err(dev(op))?;
        cursor.set_known(Some(vec![0; batch]));
        Ok(())
    }

    fn conv_prefill(&self, shape: ConvShape, tokens: usize, x: &CudaBuf, weight: &CudaBuf, state: &mut CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "conv_prefill";
        let ConvShape { channels: ch, width } = shape;
        check_nonzero(op, "conv width", width)?;
        check_len(op, "weight", weight.len, elems(op, &[ch, width])?)?;
        let hist = width - 1;
        check_len(op, "x", x.len, elems(op, &[tokens, ch])?)?;
        check_len(op, "out", out.len, elems(op, &[tokens, ch])?)?;
        check_len(op, "state", state.len, elems(op, &[hist, ch])?)?;
        if ch == 0 {
            return Ok(());
        }
        let (t, c, w) = (int(op, "tokens", tokens)?, int(op, "channels", ch)?, int(op, "width", width)?);
        if tokens > 0 {
            let mut b = self.stream.launch_builder(&self.f.conv_prefill_out);
            b.arg(&x.data).arg(&weight.data).arg(&state.data).arg(&mut out.data).arg(&t).arg(&c).arg(&w);
            // SAFETY: types and order match conv_prefill_out; lengths checked.
            unsafe { b.launch(ew_cfg(tokens * ch)) }.map_err(dev(op))?;
        }
        if hist > 0 {
            // After the outputs (same stream), which read the old state.
            let mut b = self.stream.launch_builder(&self.f.conv_prefill_state);
            b.arg(&x.data).arg(&mut state.data).arg(&t).arg(&c).arg(&w);
            // SAFETY: types and order match conv_prefill_state; lengths checked.
            unsafe { b.launch(ew_cfg(ch)) }.map_err(dev(op))?;
        }
        Ok(())
    }

    fn conv_step(&self, shape: ConvShape, batch: usize, x: &CudaBuf, weight: &CudaBuf, state: &mut CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "conv_step";
        let ConvShape { channels: ch, width } = shape;
        check_nonzero(op, "conv width", width)?;
        check_len(op, "weight", weight.len, elems(op, &[ch, width])?)?;
        let hist = width - 1;
        check_len(op, "x", x.len, elems(op, &[batch, ch])?)?;
        check_len(op, "out", out.len, elems(op, &[batch, ch])?)?;
        check_len(op, "state", state.len, elems(op, &[batch, hist, ch])?)?;
        if ch == 0 || batch == 0 {
            return Ok(());
        }
        let (bb, c, w) = (int(op, "batch", batch)?, int(op, "channels", ch)?, int(op, "width", width)?);
        let mut b = self.stream.launch_builder(&self.f.conv_step);
        b.arg(&x.data).arg(&weight.data).arg(&mut state.data).arg(&mut out.data).arg(&bb).arg(&c).arg(&w);
        // SAFETY: types and order match conv_step; lengths checked.
        unsafe { b.launch(ew_cfg(batch * ch)) }.map_err(dev(op))?;
        Ok(())
    }

    fn rms_norm(&self, shape: NormShape, x: &CudaBuf, weight: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "rms_norm";
        let n = elems(op, &[shape.rows, shape.dim])?;
        check_len(op, "x", x.len, n)?;
        check_len(op, "weight", weight.len, shape.dim)?;
        check_len(op, "out", out.len, n)?;
        if shape.dim == 0 || shape.rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig { grid_dim: (int(op, "rows", shape.rows)? as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: (256 / 32) * 4 };
        let d = int(op, "dim", shape.dim)?;
        let mut b = self.stream.launch_builder(&self.f.rms_norm);
        b.arg(&x.data).arg(&weight.data).arg(&mut out.data).arg(&d).arg(&shape.eps);
        // SAFETY: types and order match rms_norm; lengths checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    fn gated_rms_norm(&self, shape: NormShape, o: &CudaBuf, gate: &CudaBuf, weight: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "gated_rms_norm";
        let n = elems(op, &[shape.rows, shape.dim])?;
        check_len(op, "x", o.len, n)?;
        check_len(op, "weight", weight.len, shape.dim)?;
        check_len(op, "out", out.len, n)?;
        check_len(op, "gate", gate.len, o.len)?;
        if shape.dim == 0 || shape.rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig { grid_dim: (int(op, "rows", shape.rows)? as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: (256 / 32) * 4 };
        let d = int(op, "dim", shape.dim)?;
        let mut b = self.stream.launch_builder(&self.f.gated_rms_norm);
        b.arg(&o.data).arg(&gate.data).arg(&weight.data).arg(&mut out.data).arg(&d).arg(&shape.eps);
        // SAFETY: types and order match gated_rms_norm; lengths checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    fn mla_prefill(
        &self,
        shape: MlaShape,
        tokens: usize,
        q_lat: &CudaBuf,
        rows: RowSet<'_, CudaBuf>,
        out: &mut CudaBuf,
        lse: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let op = "mla_prefill";
        let n = rows.count;
        let width = cpu_mla::check_rows(op, &shape, rows.buf.len, n)?;
        if n < tokens {
            return Err(KernelError::InvalidShape { op, reason: format!("{tokens} query tokens need at least as many rows, got {n}") });
        }
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        check_len(op, "q_lat", q_lat.len, elems(op, &[tokens, h, width])?)?;
        check_len(op, "out", out.len, elems(op, &[tokens, h, l])?)?;
        if let Some(x) = lse.as_ref() {
            check_len(op, "lse", x.len, elems(op, &[tokens, h])?)?;
        }
        // Query t sees rows 0..=prefix + t: base = prefix + 1 rows for t = 0.
        self.mla_attend(op, shape, tokens, n - tokens + 1, q_lat, rows.buf, out, lse)
    }

    fn mla_decode(&self, shape: MlaShape, q_lat: &CudaBuf, rows: RowSet<'_, CudaBuf>, out: &mut CudaBuf, lse: &mut CudaBuf) -> Result<()> {
        let op = "mla_decode";
        let n = rows.count;
        let width = cpu_mla::check_rows(op, &shape, rows.buf.len, n)?;
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        check_len(op, "q_lat", q_lat.len, elems(op, &[h, width])?)?;
        check_len(op, "out", out.len, elems(op, &[h, l])?)?;
        check_len(op, "lse", lse.len, h)?;
        self.mla_attend(op, shape, 1, n, q_lat, rows.buf, out, Some(lse))
    }

    fn dcp_merge(&self, shape: MergeShape, o_shards: &CudaBuf, lse_shards: &CudaBuf, out: &mut CudaBuf, lse: &mut CudaBuf) -> Result<()> {
        let op = "dcp_merge";
        let MergeShape { shards, heads, width } = shape;
        check_len(op, "o_shards", o_shards.len, elems(op, &[shards, heads, width])?)?;
        check_len(op, "lse_shards", lse_shards.len, elems(op, &[shards, heads])?)?;
        check_len(op, "out", out.len, elems(op, &[heads, width])?)?;
        check_len(op, "lse", lse.len, heads)?;
        if heads == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig { grid_dim: (int(op, "heads", heads)? as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let (s, h, w) = (int(op, "shards", shards)?, int(op, "heads", heads)?, int(op, "width", width)?);
        let mut b = self.stream.launch_builder(&self.f.dcp_merge_f32);
        b.arg(&o_shards.data).arg(&lse_shards.data).arg(&mut out.data).arg(&mut lse.data).arg(&s).arg(&h).arg(&w);
        // SAFETY: types and order match dcp_merge_f32; lengths checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    fn mla_decode_partial(&self, shape: MlaShape, q_lat: &CudaBuf, rows: RowSet<'_, CudaBuf>, partial: &mut CudaF64Buf) -> Result<()> {
        let op = "mla_decode_partial";
        let n = rows.count;
        let width = cpu_mla::check_rows(op, &shape, rows.buf.len, n)?;
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        check_len(op, "q_lat", q_lat.len, elems(op, &[h, width])?)?;
        check_len(op, "partial", partial.len, elems(op, &[h, mla_partial_width(l)])?)?;
        self.mla_partial_any(op, shape, q_lat, rows.buf, &[n], partial)
    }

    fn mla_decode_partial_ragged(&self, shape: MlaShape, q_lat: &CudaBuf, rows: &CudaBuf, counts: &[usize], partial: &mut CudaF64Buf) -> Result<()> {
        let op = "mla_decode_partial_ragged";
        let total = counts.iter().try_fold(0usize, |a, &n| a.checked_add(n)).ok_or_else(|| KernelError::SizeOverflow { op, dims: counts.to_vec() })?;
        let width = cpu_mla::check_rows(op, &shape, rows.len, total)?;
        let (h, l) = (shape.heads, shape.kv_lora_rank);
        let batch = counts.len();
        check_len(op, "q_lat", q_lat.len, elems(op, &[batch, h, width])?)?;
        check_len(op, "partial", partial.len, elems(op, &[batch, h, mla_partial_width(l)])?)?;
        self.mla_partial_any(op, shape, q_lat, rows, counts, partial)
    }

    fn dcp_merge_partials(&self, shape: MergeShape, partials: &CudaF64Buf, out: &mut CudaBuf, lse: &mut CudaBuf) -> Result<()> {
        let op = "dcp_merge_partials";
        let MergeShape { shards, heads, width } = shape;
        check_len(op, "partials", partials.len, elems(op, &[shards, heads, mla_partial_width(width)])?)?;
        check_len(op, "out", out.len, elems(op, &[heads, width])?)?;
        check_len(op, "lse", lse.len, heads)?;
        if heads == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig { grid_dim: (int(op, "heads", heads)? as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let (s, h, w) = (int(op, "shards", shards)?, int(op, "heads", heads)?, int(op, "width", width)?);
        let mut b = self.stream.launch_builder(&self.f.dcp_merge_f64);
        b.arg(&partials.data).arg(&mut out.data).arg(&mut lse.data).arg(&s).arg(&h).arg(&w);
        // SAFETY: types and order match dcp_merge_f64; lengths checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    /// Both matmul kernels sum in one order whatever the rows (dense.hip).
    fn matmul_fixed_order(&self) -> bool {
        true
    }

    fn matmul(&self, shape: MatmulShape, x: &CudaBuf, w: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "matmul";
        let MatmulShape { rows, inner, cols } = shape;
        check_len(op, "x", x.len, elems(op, &[rows, inner])?)?;
        check_len(op, "w", w.len, elems(op, &[inner, cols])?)?;
        check_len(op, "out", out.len, elems(op, &[rows, cols])?)?;
        self.matmul_unchecked(op, rows, inner, cols, &x.data, &w.data, &mut out.data.slice_mut(..))
    }

    fn swiglu(&self, shape: MlpShape, x: &CudaBuf, w: MlpWeights<'_, CudaBuf>, out: &mut CudaBuf) -> Result<()> {
        let op = "swiglu";
        let MlpShape { tokens, hidden, intermediate } = shape;
        check_len(op, "x", x.len, elems(op, &[tokens, hidden])?)?;
        check_len(op, "gate", w.gate.len, elems(op, &[hidden, intermediate])?)?;
        check_len(op, "up", w.up.len, elems(op, &[hidden, intermediate])?)?;
        check_len(op, "down", w.down.len, elems(op, &[intermediate, hidden])?)?;
        check_len(op, "out", out.len, elems(op, &[tokens, hidden])?)?;
        if hidden == 0 || tokens == 0 {
            return Ok(());
        }
        if intermediate == 0 {
            return self.fill_unchecked(op, &mut out.data, out.len, 0.0);
        }
        let n = tokens * intermediate;
        let mut g = self.alloc_t::<f32>(op, n)?;
        let mut u = self.alloc_t::<f32>(op, n)?;
        let mut a = self.alloc_t::<f32>(op, n)?;
        self.matmul_unchecked(op, tokens, hidden, intermediate, &x.data, &w.gate.data, &mut g.slice_mut(..))?;
        self.matmul_unchecked(op, tokens, hidden, intermediate, &x.data, &w.up.data, &mut u.slice_mut(..))?;
        self.silu_mul_unchecked(op, n, &g, &u, &mut a)?;
        self.matmul_unchecked(op, tokens, intermediate, hidden, &a, &w.down.data, &mut out.data.slice_mut(..))
    }

    fn silu_mul(&self, gate: &CudaBuf, up: &CudaBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "silu_mul";
        check_len(op, "up", up.len, gate.len)?;
        check_len(op, "out", out.len, gate.len)?;
        self.silu_mul_unchecked(op, gate.len, &gate.data, &up.data, &mut out.data)
    }

    fn embedding(&self, shape: EmbeddingShape, table: &CudaBuf, ids: &CudaIBuf, out: &mut CudaBuf) -> Result<()> {
        let op = "embedding";
        let EmbeddingShape { tokens, vocab, dim } = shape;
        check_len(op, "table", table.len, elems(op, &[vocab, dim])?)?;
        check_len(op, "ids", ids.len, tokens)?;
        check_len(op, "out", out.len, elems(op, &[tokens, dim])?)?;
        // The ids are device data (argmax writes them): read them back to give
        // the CPU's IndexOutOfRange instead of reading outside the table.
        let host = self.download_i32(ids)?;
        for (t, &id) in host.iter().enumerate() {
            if id < 0 || id as usize >= vocab {
                return Err(KernelError::IndexOutOfRange { op, what: "token id", index: id as i64, position: t, bound: vocab });
            }
        }
        if dim == 0 || tokens == 0 {
            return Ok(());
        }
        let (t, d) = (int(op, "tokens", tokens)?, int(op, "dim", dim)?);
        let mut b = self.stream.launch_builder(&self.f.embedding);
        b.arg(&table.data).arg(&ids.data).arg(&mut out.data).arg(&t).arg(&d);
        // SAFETY: types and order match embedding; ids were checked.
        unsafe { b.launch(ew_cfg(tokens * dim)) }.map_err(dev(op))?;
        Ok(())
    }

    fn argmax(&self, rows: usize, cols: usize, logits: &CudaBuf, ids: &mut CudaIBuf) -> Result<()> {
        let op = "argmax";
        check_len(op, "logits", logits.len, elems(op, &[rows, cols])?)?;
        check_len(op, "ids", ids.len, rows)?;
        if cols > i32::MAX as usize {
            return Err(KernelError::InvalidShape { op, reason: format!("{cols} columns do not fit an i32 id") });
        }
        if cols == 0 {
            return Err(KernelError::InvalidShape { op, reason: "argmax over 0 columns".into() });
        }
        if rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig { grid_dim: (int(op, "rows", rows)? as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let c = cols as i32;
        ids.set_known(None);
        let mut b = self.stream.launch_builder(&self.f.argmax_rows);
        b.arg(&logits.data).arg(&mut ids.data).arg(&c);
        // SAFETY: types and order match argmax_rows; lengths checked.
        unsafe { b.launch(cfg) }.map_err(dev(op))?;
        Ok(())
    }

    fn matmul_units(&self, shape: UnitsShape, x: &CudaBuf, units: &[UnitProduct<'_, CudaBuf>], out: &mut CudaBuf) -> Result<()> {
        let op = "matmul_units";
        check_len(op, "x", x.len, elems(op, &[shape.rows, shape.x_width])?)?;
        check_len(op, "out", out.len, shape.out_len(op, units)?)?;
        for u in units {
            check_len(op, "w", u.w.len, elems(op, &[u.inner, u.cols])?)?;
        }
        if shape.rows == 0 {
            return Ok(());
        }
        if !self.fused {
            return self.matmul_units_each(op, shape, x, units, out);
        }
        for (g, group) in units.chunks(UNITS_PER_LAUNCH).enumerate() {
            self.matmul_units_launch(op, shape, x, group, g * UNITS_PER_LAUNCH, out)?;
        }
        Ok(())
    }

    fn add_units(&self, acc: &mut CudaBuf, stacked: &CudaBuf, units: std::ops::Range<usize>) -> Result<()> {
        let op = "add_units";
        let n = acc.len;
        crate::error::check_units(op, n, stacked.len, &units)?;
        if n == 0 || units.is_empty() {
            return Ok(());
        }
        let nn = i64_of(n);
        if !self.fused {
            // Unit by unit through add_inplace, reading each unit in place.
            for u in units {
                let unit = stacked.data.slice(u * n..(u + 1) * n);
                let mut b = self.stream.launch_builder(&self.f.add_inplace);
                b.arg(&mut acc.data).arg(&unit).arg(&nn);
                // SAFETY: types and order match add_inplace; the unit lies in stacked.
                unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
            }
            return Ok(());
        }
        let (from, to) = (int(op, "units", units.start)?, int(op, "units", units.end)?);
        let mut b = self.stream.launch_builder(&self.f.add_units);
        b.arg(&mut acc.data).arg(&stacked.data).arg(&nn).arg(&from).arg(&to);
        // SAFETY: types and order match add_units; every unit lies in stacked.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }

    fn add_inplace(&self, dst: &mut CudaBuf, src: &CudaBuf) -> Result<()> {
        let op = "add_inplace";
        check_len(op, "src", src.len, dst.len)?;
        let n = dst.len;
        if n == 0 {
            return Ok(());
        }
        let nn = i64_of(n);
        let mut b = self.stream.launch_builder(&self.f.add_inplace);
        b.arg(&mut dst.data).arg(&src.data).arg(&nn);
        // SAFETY: types and order match add_inplace; lengths checked.
        unsafe { b.launch(ew_cfg(n)) }.map_err(dev(op))?;
        Ok(())
    }
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
        let cubin = nvrtc_cubin("90").unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.starts_with(b"\x7fELF"), "NVRTC did not return a cubin");
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
