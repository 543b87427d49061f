//! The generic ops of the GPU backends, written once over the launch seam
//! ([`Driver`]): `GpuBackend<D>` implements [`crate::Backend`] for any driver,
//! and `CudaBackend` (cudarc) and `HipBackend` (hip-sys) are this type over
//! their drivers. Every decision of a launch lives here (kernel, grid, block,
//! shared memory, argument order, the checks against the CPU reference's
//! errors, the fallbacks); what differs between the platforms is the driver's
//! calls and how the kernels were compiled (NVRTC at open, hipcc at build).
//! Device memory for regions (`memory.rs`, `DeviceMem<D>`) is written once
//! over the same seam, with the calls it needs beyond launches in
//! `MemoryDriver`.
//!
//! - One stream per backend; every op enqueues on it in call order, so ops
//!   need no events between them. `download*` synchronizes. Ops that must
//!   validate device data against the CPU reference's errors (token ids,
//!   replay cursors) read that small data back first (or take the host's
//!   known copy of an i32 buffer, see [`DeviceIBuf`]).
//! - Buffers are allocated with at least one element (a zero-length device
//!   allocation is not portable) and remember their logical length.
//!
//! Files: `buffers.rs` (the buffers, allocation, up/download), `backend.rs`
//! (`impl Backend`: each op's checks and launches), one launcher file per
//! `hip/` family (`copy.rs`, `dense.rs`, `kda.rs`, `mla.rs`), `open.rs` (the
//! kernels resolved and given their shared memory), `tests/` (every op's
//! launches through a recording driver, against the kernels' signatures).

use std::fmt;
use std::sync::Arc;

use super::KdaKernel;
use crate::backend::Backend;
use crate::cpu::{kda as cpu_kda, mla as cpu_mla};
use crate::dtype::StorageDtype;
use crate::error::{KernelError, Result, check_len, check_nonzero, elems, range};
use crate::gpu::launch::{Arg, Driver, MemoryDriver, dev};
use crate::region::{DeviceMemory, DeviceRegion, RegionItems};
use crate::shapes::{
    ColsCopy, ConvShape, EmbeddingShape, KdaInputs, KdaParams, KdaPrefillShape, KdaRaggedShape, KdaStepShape, MatmulShape, MergeShape, MlaShape, MlpShape,
    MlpWeights, NormShape, ReplayShape, RowSet, UnitProduct, UnitsOut, UnitsShape, mla_partial_width,
};

mod backend;
mod buffers;
mod copy;
mod dense;
mod kda;
mod marks;
mod memory;
mod mla;
mod open;
#[cfg(test)]
pub(super) mod tests;

pub use buffers::{DeviceBuf, DeviceIBuf, Elem};
pub(crate) use dense::{TCB_MIN_TILES, WG_MIN_TILES};
use dense::{UNITS_PER_LAUNCH, UnitsTable};
pub(crate) use memory::DeviceMem;
pub(crate) use open::{Funcs, SmemPolicy};

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
/// [`GpuBackend::set_mla_kernel`] picks another, for measuring the
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

/// Bytes of chunk partials `mla_partial_tc` keeps between calls; a larger
/// scratch is freed after its call.
const MLA_SCRATCH_KEEP: usize = 256 << 20;

/// The device side of one shape of `mla_partial_tc`: the work table for these
/// row counts and chunk size, and the chunk partials' scratch.
struct MlaScratch<D: Driver> {
    counts: Vec<usize>,
    chunk: usize,
    heads: usize,
    table: DeviceBuf<i64, D>,
    parts: DeviceBuf<f64, D>,
}

/// Device memory for registered regions on a backend's device, or why not
/// (a plain function of the driver: CUDA and HIP open `DeviceMem` on it).
pub(crate) type MemoryOf<D> = fn(&D) -> Result<Arc<dyn DeviceMemory>>;

/// A GPU backend: device buffers and the model's ops as kernels of the one set
/// of sources, launched through driver `D` on one stream. `CudaBackend` and
/// `HipBackend` are this type over their drivers.
///
/// Cloning shares the driver (context, stream, loaded kernels): no recompile.
pub struct GpuBackend<D: Driver> {
    pub(crate) drv: D,
    f: Arc<Funcs<D::Func>>,
    device_name: String,
    ordinal: usize,
    /// What `Debug` prints after the device's name (CUDA: its `sm_XY`).
    arch: String,
    kda_kernel: KdaKernel,
    mla_tc: MlaTc,
    /// Multiprocessors of the device (the MLA partial's ring depth).
    sms: usize,
    /// The tensor-core MLA partial's work table and chunk scratch, kept while
    /// the row counts repeat (`mla_partial_tc`); clones share it as they
    /// share the stream its kernels run on.
    mla_scratch: Arc<std::sync::Mutex<Option<MlaScratch<D>>>>,
    /// The launch-saving paths ([`GpuBackend::set_fused`]).
    fused: bool,
    /// Output tiles from which a matmul runs as matmul_tcb
    /// ([`GpuBackend::set_tcb_min_tiles`]); None: the tiled kernel's own default.
    tcb_min_tiles: Option<usize>,
    /// Whether the tiled products run as matmul_wg where the build has it
    /// ([`GpuBackend::set_matmul_wg`]).
    matmul_wg: bool,
    memory: MemoryOf<D>,
    /// Records layer marks on this backend's stream
    /// ([`GpuBackend::with_layer_marks`]); None: `mark_layer` gives none, and
    /// the engine waits for a layer on the host instead.
    marker: Option<Arc<dyn marks::MarkLayer>>,
}

/// `be`, recording layer marks on its stream for device memory's copies to
/// wait on ([`crate::Backend::mark_layer`]). A free function: the memory
/// driver's trait is private to the crate.
pub(crate) fn with_layer_marks<D: MemoryDriver>(mut be: GpuBackend<D>) -> GpuBackend<D> {
    be.marker = Some(Arc::new(marks::Marker::new(be.drv.clone())));
    be
}

impl<D: Driver> GpuBackend<D> {
    /// Events this backend holds for its layer marks (0 without marks).
    #[cfg(test)]
    pub(crate) fn mark_events(&self) -> usize {
        self.marker.as_ref().map_or(0, |m| m.events())
    }
}

impl<D: Driver> Clone for GpuBackend<D> {
    fn clone(&self) -> Self {
        GpuBackend {
            drv: self.drv.clone(),
            f: Arc::clone(&self.f),
            device_name: self.device_name.clone(),
            ordinal: self.ordinal,
            arch: self.arch.clone(),
            kda_kernel: self.kda_kernel,
            mla_tc: self.mla_tc,
            sms: self.sms,
            mla_scratch: Arc::clone(&self.mla_scratch),
            fused: self.fused,
            tcb_min_tiles: self.tcb_min_tiles,
            matmul_wg: self.matmul_wg,
            memory: self.memory,
            marker: self.marker.clone(),
        }
    }
}

impl<D: Driver> fmt::Debug for GpuBackend<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}Backend(device {} {:?}{})", D::TYPE_PREFIX, self.ordinal, self.device_name, self.arch)
    }
}

/// A launch's grid, block and dynamic shared memory (blocks are 1-D).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cfg {
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: u32,
    pub(crate) smem: u32,
}

fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::InvalidShape { op, reason: format!("{what} = {v} exceeds the device kernels' 32-bit index") })
}

fn i64_of(v: usize) -> i64 {
    // Buffer lengths come from allocations, far below i64::MAX.
    v as i64
}

/// A grid-stride launch over `n` elements.
fn ew_cfg(n: usize) -> Cfg {
    let blocks = n.div_ceil(EW_THREADS as usize).clamp(1, EW_MAX_BLOCKS) as u32;
    Cfg { grid: (blocks, 1, 1), block: EW_THREADS, smem: 0 }
}

/// The address of element `at` of a buffer of `T` at `ptr`.
fn at<T>(ptr: u64, at: usize) -> u64 {
    ptr + (at * std::mem::size_of::<T>()) as u64
}

impl<D: Driver> GpuBackend<D> {
    /// Launches `f` (binding the device first, as every call does): `head`
    /// is the units kernels' by-value table, `args` the rest in the kernel's
    /// order. A failure is `KernelError::Device` naming `op`.
    ///
    /// # Safety
    /// `head` and `args` match `f`'s signature, and every address in them is
    /// valid for what the kernel reads and writes.
    unsafe fn launch(&self, op: &'static str, f: D::Func, cfg: Cfg, head: Option<&UnitsTable>, args: &[Arg]) -> Result<()> {
        self.drv.bind().map_err(dev(op))?;
        let head = head.map(UnitsTable::bytes);
        // SAFETY: the caller's contract.
        unsafe { self.drv.launch_args(f, cfg.grid, cfg.block, cfg.smem, head, args) }.map_err(dev(op))
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
        self.ordinal
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

    /// See [`GpuBackend::set_tcb_min_tiles`].
    pub fn tcb_min_tiles(&self) -> usize {
        self.tcb_min_tiles.unwrap_or(if self.matmul_wg() { WG_MIN_TILES } else { TCB_MIN_TILES })
    }

    /// Whether the tiled products (those `set_tcb_min_tiles` sends to
    /// `matmul_tcb`) run on Hopper's warpgroup products instead, `matmul_wg`
    /// (on by default; only where the build has it: compute capability 9.0).
    /// The same bits either way (`cuda_check` checks it); off, for measuring.
    pub fn set_matmul_wg(&mut self, on: bool) {
        self.matmul_wg = on;
    }

    /// Whether the tiled products run as `matmul_wg` (see
    /// [`GpuBackend::set_matmul_wg`]): on, and present in this build.
    pub fn matmul_wg(&self) -> bool {
        self.matmul_wg && self.f.matmul_wg.is_some()
    }

    /// Waits until every queued op has finished; reports a failed one.
    pub fn synchronize(&self) -> Result<()> {
        let op = "synchronize";
        self.drv.bind().map_err(dev(op))?;
        self.drv.synchronize().map_err(dev(op))
    }

    /// Device time of `f`, mean microseconds per call over `reps` calls:
    /// events around the `reps` calls queued back to back, one wait at the
    /// end (launch overhead overlaps the previous call's run).
    pub fn time_us(&self, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let op = "time_us";
        self.drv.bind().map_err(dev(op))?;
        let start = self.drv.record_event().map_err(dev(op))?;
        for _ in 0..reps {
            f()?;
        }
        self.drv.bind().map_err(dev(op))?;
        let end = self.drv.record_event().map_err(dev(op))?;
        let ms = self.drv.elapsed_ms(&start, &end).map_err(dev(op))?;
        Ok(ms as f64 * 1e3 / reps.max(1) as f64)
    }

    /// Device-to-device copy bandwidth in GB/s (1e9 bytes/s), counting the
    /// bytes read plus the bytes written, of `reps` copies of `bytes` bytes:
    /// the roofline that state traffic is compared against.
    pub fn copy_bandwidth_gbs(&self, bytes: usize, reps: usize) -> Result<f64> {
        let op = "copy_bandwidth";
        let n = (bytes / 4).max(1);
        let src = self.alloc_t::<f32>(op, n)?;
        let dst = self.alloc_t::<f32>(op, n)?;
        let copy = || -> Result<()> {
            self.drv.bind().map_err(dev(op))?;
            // SAFETY: both hold n floats.
            unsafe { self.drv.copy_dtod(dst.ptr, src.ptr, n * 4) }.map_err(dev(op))
        };
        // Warm-up copy, then the timed ones.
        copy()?;
        let us = self.time_us(reps, copy)?;
        Ok(2.0 * (n * 4) as f64 / (us * 1e-6) / 1e9)
    }
}
