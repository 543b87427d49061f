//! The generic ops' launches without a device: a recording driver stands in
//! for CUDA and HIP (kernels are their names, device memory is host memory,
//! launches are recorded, not run), every op runs through it for shapes that
//! take each of its paths, and each launch is held against the signature of
//! the kernel it names, parsed from `kernels/hip/` (`every_launch.rs`), and
//! against launch records worked out by hand from the CUDA backend as it was
//! before its ops moved onto the seam (`golden.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use super::*;
use crate::gpu::launch::{DriverFault, IPC_HANDLE_BYTES, MemoryDriver};
use crate::gpu::step_gpu::tests::{Kind, kind_of, signature};

mod every_launch;
mod golden;
mod memory;

/// Every kernel a generic op may name (the warpgroup three only where the
/// recorder says the build has them).
pub(in crate::gpu) const OP_KERNELS: &[&str] = &[
    "kda_step_c1",
    "kda_step_c2",
    "kda_step_c2x4",
    "kda_step_c4x1",
    "kda_prefill",
    "kda_recurrent_wide",
    "kda_chunk_prep",
    "kda_chunk_state",
    "kda_chunk_out",
    "replay_append",
    "replay_commit",
    "conv_prefill_out",
    "conv_prefill_state",
    "conv_step",
    "rms_norm",
    "gated_rms_norm",
    "mla_attend_f32",
    "mla_partial_f64",
    "mla_partial_tc4",
    "mla_partial_tc8",
    "mla_partial_tc8_deep",
    "mla_chunk_merge_f64",
    "dcp_merge_f32",
    "dcp_merge_f64",
    "matmul_tc16",
    "matmul_tc32",
    "matmul_tcb",
    "matmul_chunk_sum",
    "matmul_units_sum",
    "add_units",
    "silu_mul",
    "add_inplace",
    "embedding",
    "argmax_rows",
    "fill_f32",
    "copy_cols",
    "round_to",
    "region_gather_b32",
    "region_scatter_b32",
    "region_gather_b16",
    "region_scatter_b16",
];
const WG_KERNELS: &[&str] = &["matmul_wg", "mwg_pack_x", "mwg_pack_w"];
/// The kernels of device memory for regions (`memory.rs`), not of an op.
pub(in crate::gpu) const MEMORY_KERNELS: &[&str] = &["copy_table", "copy_table_small", "copy_gate"];

/// A call device memory for regions makes, with the stream it queues on
/// (the recorder's first stream is 0; each `with_new_stream` the next).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum MemOp {
    /// A launch: kernel, grid, block, shared memory, the by-value table's bytes.
    Launch {
        stream: usize,
        f: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        head: Option<Vec<u8>>,
    },
    /// A plain device-to-device copy (the copy engines).
    Dtod {
        stream: usize,
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// A 2D copy on the copy engines.
    Copy2d {
        stream: usize,
        dst: u64,
        dst_pitch: u64,
        src: u64,
        src_pitch: u64,
        width: u64,
        height: u64,
    },
    /// An event recorded.
    Record {
        stream: usize,
        fence: u64,
    },
    /// A device-side wait of the stream on an event's last record.
    Wait {
        stream: usize,
        fence: u64,
        /// The waited record: (its stream, its place there).
        on: (usize, u64),
    },
    Sync {
        stream: usize,
    },
    Zero {
        stream: usize,
        ptr: u64,
        bytes: usize,
    },
    Alloc {
        ptr: u64,
        bytes: usize,
    },
    Free {
        ptr: u64,
    },
    IpcOpen {
        ptr: u64,
    },
    IpcClose {
        ptr: u64,
    },
}

/// One launch as the op asked for it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Rec {
    pub(super) f: &'static str,
    pub(super) grid: (u32, u32, u32),
    pub(super) block: u32,
    pub(super) smem: u32,
    /// The by-value table ahead of the arguments, if any (its bytes).
    pub(super) head: Option<Vec<u8>>,
    pub(super) args: Vec<Arg>,
}

/// What the recorder saw: device memory (allocation base to bytes), the
/// launches, the shared memory each kernel was given, the frees.
#[derive(Default)]
pub(super) struct State {
    next: u64,
    mem: BTreeMap<u64, Vec<u8>>,
    /// Freed allocations, kept for [`Recorder::read`] (an op's temporaries
    /// are gone when it returns).
    freed: BTreeMap<u64, Vec<u8>>,
    pub(super) launches: Vec<Rec>,
    pub(super) smem: BTreeMap<&'static str, u32>,
    pub(super) allocs: usize,
    pub(super) frees: usize,
    /// Host-to-device copies and zeroings in order: (b'u' or b'z', address, bytes).
    pub(super) writes: Vec<(u8, u64, usize)>,
    /// What device memory for regions would have queued, in call order.
    pub(super) log: Vec<MemOp>,
    /// Device-to-device copies are only logged, not made (the memory tests'
    /// addresses are made up).
    pub(super) loose: bool,
    /// Streams made so far (the first is 0).
    streams: usize,
    /// Per stream: events recorded on it, and how many of them have run.
    queued: BTreeMap<usize, u64>,
    ran: BTreeMap<usize, u64>,
    /// Per event: its stream and its place there at its last record (0: never recorded).
    fences: BTreeMap<u64, (usize, u64)>,
}

impl State {
    /// Runs everything queued so far on `stream`.
    pub(super) fn run(&mut self, stream: usize) {
        let q = self.queued.get(&stream).copied().unwrap_or(0);
        self.ran.insert(stream, q);
    }
}

impl State {
    /// The allocation holding `bytes` bytes at `addr`, and the offset in it.
    fn at(&mut self, addr: u64, bytes: usize) -> std::result::Result<(&mut Vec<u8>, usize), DriverFault> {
        let (&base, buf) = self.mem.range_mut(..=addr).next_back().ok_or_else(|| DriverFault(format!("{addr:#x}: not device memory")))?;
        let off = (addr - base) as usize;
        if off + bytes > buf.len() {
            return Err(DriverFault(format!("{addr:#x} + {bytes} bytes past an allocation of {} at {base:#x}", buf.len())));
        }
        Ok((buf, off))
    }
}

/// A driver that runs nothing: kernels are their names, device memory is
/// host memory, launches are recorded.
#[derive(Clone)]
pub(super) struct Recorder {
    pub(super) st: Arc<Mutex<State>>,
    /// Shared memory a block may take (HIP's rule: no opt-in past it); None:
    /// CUDA's opt-in, anything asked.
    lds: Option<u32>,
    /// Whether the build has the warpgroup products (sm_90a).
    wg: bool,
    /// The stream this value queues on (see [`MemOp`]).
    pub(super) stream: usize,
}

impl Recorder {
    pub(super) fn new(lds: Option<u32>, wg: bool) -> Recorder {
        Recorder { st: Arc::new(Mutex::new(State { next: 0x1000_0000, streams: 1, ..State::default() })), lds, wg, stream: 0 }
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap()
    }

    /// Takes the launches recorded so far (and forgets the writes).
    pub(super) fn take(&self) -> Vec<Rec> {
        let mut st = self.state();
        st.writes.clear();
        std::mem::take(&mut st.launches)
    }

    /// `n` values of `T` at device address `addr`, live or freed.
    pub(super) fn read<T: Copy + Default>(&self, addr: u64, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        let bytes = std::mem::size_of_val(v.as_slice());
        let st = self.state();
        let (base, b) = st.mem.range(..=addr).next_back().into_iter().chain(st.freed.range(..=addr).next_back()).max_by_key(|(b, _)| **b).unwrap();
        let off = (addr - base) as usize;
        assert!(off + bytes <= b.len(), "{addr:#x}: {bytes} bytes past an allocation");
        // SAFETY: plain values written as bytes, within the allocation.
        unsafe { std::ptr::copy_nonoverlapping(b[off..].as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes) };
        v
    }
}

impl Driver for Recorder {
    type Func = &'static str;
    type Graph = ();
    type Event = ();
    const NAME: &'static str = "recorder";
    const LABEL: &'static str = "recorder";
    const TYPE_PREFIX: &'static str = "Recorder";

    fn function(&self, name: &str) -> std::result::Result<&'static str, DriverFault> {
        let wg = if self.wg { WG_KERNELS } else { &[] };
        OP_KERNELS.iter().chain(wg).chain(MEMORY_KERNELS).copied().find(|k| *k == name).ok_or_else(|| DriverFault(format!("{name} is not in the program")))
    }
    fn set_max_dynamic_smem(&self, f: &'static str, bytes: u32) -> std::result::Result<(), DriverFault> {
        if let Some(max) = self.lds
            && bytes > max
        {
            return Err(DriverFault(format!("{bytes} bytes past {max}")));
        }
        self.state().smem.insert(f, bytes);
        Ok(())
    }
    fn prefer_shared_carveout(&self, _: &'static str) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn multiprocessors(&self) -> std::result::Result<usize, DriverFault> {
        Ok(132)
    }
    fn bind(&self) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn alloc(&self, bytes: usize) -> std::result::Result<u64, DriverFault> {
        let mut st = self.state();
        let p = st.next;
        st.next += bytes.next_multiple_of(256) as u64 + 256;
        st.mem.insert(p, vec![0xa5; bytes]);
        st.allocs += 1;
        st.log.push(MemOp::Alloc { ptr: p, bytes });
        Ok(p)
    }
    unsafe fn free(&self, ptr: u64) {
        let mut st = self.state();
        let b = st.mem.remove(&ptr).unwrap_or_else(|| panic!("{ptr:#x} freed twice or never allocated"));
        st.freed.insert(ptr, b);
        st.frees += 1;
        st.log.push(MemOp::Free { ptr });
    }
    fn alloc_async(&self, bytes: usize) -> std::result::Result<u64, DriverFault> {
        self.alloc(bytes)
    }
    unsafe fn free_async(&self, ptr: u64) {
        // SAFETY: the recorder's memory is host memory.
        unsafe { self.free(ptr) }
    }
    unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        st.log.push(MemOp::Dtod { stream: self.stream, dst, src, bytes });
        if st.loose {
            return Ok(());
        }
        let (b, o) = st.at(src, bytes)?;
        let v = b[o..o + bytes].to_vec();
        let (b, o) = st.at(dst, bytes)?;
        b[o..o + bytes].copy_from_slice(&v);
        Ok(())
    }
    unsafe fn memset_zero(&self, ptr: u64, bytes: usize) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        st.writes.push((b'z', ptr, bytes));
        st.log.push(MemOp::Zero { stream: self.stream, ptr, bytes });
        let (b, o) = st.at(ptr, bytes)?;
        b[o..o + bytes].fill(0);
        Ok(())
    }
    unsafe fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> std::result::Result<(), DriverFault> {
        let bytes = std::mem::size_of_val(src);
        // SAFETY: reading a slice of plain values as bytes.
        let raw = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), bytes) };
        let mut st = self.state();
        st.writes.push((b'u', dst, bytes));
        let (b, o) = st.at(dst, bytes)?;
        b[o..o + bytes].copy_from_slice(raw);
        Ok(())
    }
    unsafe fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> std::result::Result<(), DriverFault> {
        let bytes = std::mem::size_of_val(dst);
        let mut st = self.state();
        let (b, o) = st.at(src, bytes)?;
        // SAFETY: dst is plain values (f32, i32, f64) written as bytes.
        unsafe { std::ptr::copy_nonoverlapping(b[o..].as_ptr(), dst.as_mut_ptr().cast::<u8>(), bytes) };
        Ok(())
    }
    unsafe fn launch(&self, _: &'static str, _: (u32, u32, u32), _: u32, _: u32, _: &mut [*mut c_void]) -> std::result::Result<(), DriverFault> {
        Err(DriverFault("the recorder records through launch_args".into()))
    }
    unsafe fn launch_args(
        &self,
        f: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        head: Option<&[u8]>,
        args: &[Arg],
    ) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        st.log.push(MemOp::Launch { stream: self.stream, f, grid, block, smem, head: head.map(<[u8]>::to_vec) });
        st.launches.push(Rec { f, grid, block, smem, head: head.map(<[u8]>::to_vec), args: args.to_vec() });
        Ok(())
    }
    fn synchronize(&self) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        st.log.push(MemOp::Sync { stream: self.stream });
        st.run(self.stream);
        Ok(())
    }
    fn begin_capture(&self) -> std::result::Result<(), DriverFault> {
        Err(DriverFault("the recorder captures nothing".into()))
    }
    fn end_capture(&self) -> std::result::Result<Option<()>, DriverFault> {
        Ok(None)
    }
    fn prepare_graph(&self, _: &()) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn replay(&self, _: &()) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn record_event(&self) -> std::result::Result<(), DriverFault> {
        Ok(())
    }
    fn elapsed_ms(&self, _: &(), _: &()) -> std::result::Result<f32, DriverFault> {
        Ok(0.0)
    }
}

/// Device memory's calls: streams are numbers, events complete when the
/// test runs their stream ([`State::run`]) or waits on them, an IPC handle
/// is the allocation's address and 56 bytes of 0xee.
impl MemoryDriver for Recorder {
    type Fence = u64;

    fn ordinal(&self) -> usize {
        0
    }
    /// CUDA's wide table, HIP's (a recorder with an `lds` limit) 4 KB one.
    fn table_copies(&self) -> usize {
        if self.lds.is_some() { crate::region::TABLE_COPIES } else { crate::region::WIDE_TABLE_COPIES }
    }
    fn with_new_stream(&self) -> std::result::Result<Self, DriverFault> {
        let mut st = self.state();
        let stream = st.streams;
        st.streams += 1;
        Ok(Recorder { stream, ..self.clone() })
    }
    unsafe fn copy_2d(&self, dst: u64, dst_pitch: u64, src: u64, src_pitch: u64, width: u64, height: u64) -> std::result::Result<(), DriverFault> {
        self.state().log.push(MemOp::Copy2d { stream: self.stream, dst, dst_pitch, src, src_pitch, width, height });
        Ok(())
    }
    fn new_fence(&self) -> std::result::Result<u64, DriverFault> {
        let mut st = self.state();
        let id = st.fences.len() as u64 + 1;
        st.fences.insert(id, (self.stream, 0));
        Ok(id)
    }
    fn record_fence(&self, f: &u64) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        let q = st.queued.entry(self.stream).or_insert(0);
        *q += 1;
        let at = *q;
        st.fences.insert(*f, (self.stream, at));
        st.log.push(MemOp::Record { stream: self.stream, fence: *f });
        Ok(())
    }
    fn wait_fence(&self, f: &u64) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        let &on = st.fences.get(f).ok_or_else(|| DriverFault(format!("event {f} was never made")))?;
        st.log.push(MemOp::Wait { stream: self.stream, fence: *f, on });
        Ok(())
    }
    fn fence_done(&self, f: &u64) -> std::result::Result<bool, DriverFault> {
        let st = self.state();
        let &(stream, at) = st.fences.get(f).ok_or_else(|| DriverFault(format!("event {f} was never made")))?;
        Ok(st.ran.get(&stream).copied().unwrap_or(0) >= at)
    }
    fn fence_wait(&self, f: &u64) -> std::result::Result<(), DriverFault> {
        let mut st = self.state();
        let &(stream, at) = st.fences.get(f).ok_or_else(|| DriverFault(format!("event {f} was never made")))?;
        let ran = st.ran.entry(stream).or_insert(0);
        *ran = (*ran).max(at);
        Ok(())
    }
    fn ipc_export(&self, ptr: u64) -> std::result::Result<[u8; IPC_HANDLE_BYTES], DriverFault> {
        let mut h = [0xee; IPC_HANDLE_BYTES];
        h[..8].copy_from_slice(&ptr.to_le_bytes());
        Ok(h)
    }
    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> std::result::Result<u64, DriverFault> {
        let ptr = u64::from_le_bytes(handle[..8].try_into().unwrap_or_default()) | (1 << 48);
        self.state().log.push(MemOp::IpcOpen { ptr });
        Ok(ptr)
    }
    unsafe fn ipc_close(&self, ptr: u64) -> std::result::Result<(), DriverFault> {
        self.state().log.push(MemOp::IpcClose { ptr });
        Ok(())
    }
}

fn no_memory(_: &Recorder) -> Result<Arc<dyn DeviceMemory>> {
    Err(KernelError::Unsupported { op: "device_memory", backend: "recorder".into(), reason: "no device memory".into() })
}

/// A backend on a fresh recorder: CUDA's policy (every opt-in given), or
/// HIP's on a device whose blocks take `lds` bytes.
pub(super) fn backend(lds: Option<u32>, wg: bool) -> (GpuBackend<Recorder>, Recorder) {
    let rec = Recorder::new(lds, wg);
    let policy = if lds.is_some() { SmemPolicy::FallBack } else { SmemPolicy::Refuse };
    let be = GpuBackend::on_driver(rec.clone(), "recorder".into(), 0, String::new(), policy, no_memory).unwrap_or_else(|e| panic!("{e}"));
    (be, rec)
}

/// A device buffer of `n` floats of `v`.
pub(super) fn buf(be: &GpuBackend<Recorder>, n: usize, v: f32) -> DeviceBuf<f32, Recorder> {
    be.upload(&vec![v; n]).unwrap()
}

/// The parameter kinds a launch passes (the table first, where it has one).
pub(super) fn kinds(r: &Rec) -> Vec<Kind> {
    r.head.as_ref().map(|_| Kind::S).into_iter().chain(r.args.iter().map(kind_of)).collect()
}

/// Buffers freed: every allocation the ops made is freed once (the recorder
/// panics on a second free) when the backend and its buffers are gone.
#[test]
fn every_allocation_is_freed_once() {
    let (be, rec) = backend(None, false);
    let x = buf(&be, 300, 1.0);
    let w = buf(&be, 300 * 200, 0.5);
    let mut out = be.alloc(200).unwrap();
    be.matmul(MatmulShape { rows: 1, inner: 300, cols: 200 }, &x, &w, &mut out).unwrap();
    let ids = be.upload_i32(&[1, 2]).unwrap();
    drop((x, w, out, ids));
    drop(be);
    let st = rec.state();
    assert!(st.allocs > 4, "{} allocations", st.allocs);
    assert_eq!(st.allocs, st.frees, "{} allocations, {} frees", st.allocs, st.frees);
}

/// Buffers round-trip through the driver: upload, upload_into at an offset,
/// copy between offsets, download; the i32 buffer answers from what the host
/// knows while `fused` is on and asks the device (here the recorder's memory)
/// when it is off.
#[test]
fn buffers_copy_and_download_through_the_driver() {
    let (mut be, _rec) = backend(None, false);
    let mut a = be.upload(&[1.0, 2.0, 3.0, 4.0]).unwrap();
    be.upload_into(&mut a, 1, &[9.0, 8.0]).unwrap();
    assert_eq!(be.download(&a).unwrap(), vec![1.0, 9.0, 8.0, 4.0]);
    let mut b = be.alloc(3).unwrap();
    be.copy(&a, 1, &mut b, 0, 3).unwrap();
    assert_eq!(be.download(&b).unwrap(), vec![9.0, 8.0, 4.0]);
    assert!(be.copy(&a, 2, &mut b, 0, 3).is_err(), "a copy past the source is refused");
    let e = be.alloc(0).unwrap();
    assert_eq!((be.buf_len(&e), e.cap), (0, 1), "a zero-length buffer still allocates one element");
    assert_eq!(format!("{e:?}"), "RecorderBuf(0 x f32)");
    let f = be.upload_f64(&[0.5, 0.25]).unwrap();
    let mut g = be.alloc_f64(2).unwrap();
    be.copy_f64(&f, 0, &mut g, 0, 2).unwrap();
    assert_eq!(be.download_f64(&g).unwrap(), vec![0.5, 0.25]);
    let ids = be.upload_i32(&[5, 6, 7]).unwrap();
    *ids.known() = Some(vec![1, 2, 3]);
    assert_eq!(be.download_i32(&ids).unwrap(), vec![1, 2, 3], "fused: the known copy answers");
    be.set_fused(false);
    assert_eq!(be.download_i32(&ids).unwrap(), vec![5, 6, 7], "unfused: the device answers");
    assert_eq!(*ids.known(), Some(vec![5, 6, 7]), "and the download is what the host now knows");
}

/// Opening under HIP's rule on a 64 KiB device leaves out exactly the kernels
/// whose blocks take more (the tensor-core MLA partials, matmul_tc16,
/// matmul_tcb, the chunked KDA prefill) and keeps the rest; under CUDA's rule
/// a refused opt-in is a refusal naming the kernel's family.
#[test]
fn a_64_kib_device_falls_back_under_hip_and_refuses_under_cuda() {
    let (be, _) = backend(Some(64 * 1024), false);
    assert!(be.f.mla_tc.is_none() && be.f.matmul_tc16.is_none() && be.f.matmul_tcb.is_none() && be.f.kda_chunk.is_none());
    assert!(!be.tcb_pays(4096, 4096, 1));
    let shape = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 0.1 };
    assert!(!be.mla_tc_applies(shape));
    let rec = Recorder::new(Some(64 * 1024), false);
    let e = GpuBackend::on_driver(rec, "r".into(), 0, String::new(), SmemPolicy::Refuse, no_memory).unwrap_err();
    let KernelError::BackendUnavailable(msg) = e else { panic!("{e:?}") };
    assert!(msg.starts_with("recorder: cannot give the MLA kernel its shared memory: "), "{msg}");
}

#[test]
fn launch_shapes_depend_on_widths_only() {
    assert_eq!(kda::kda_block(128, 4), (256, ((4 * 128 + 2 * 8 * 128 + 16) * 4) as u32));
    assert_eq!(kda::kda_block(16, 1).0, 32);
    assert_eq!(kda::kda_block(7, 1).0, 32);
    assert_eq!(mla::mla_warps("t", 512, 576, 8).unwrap().0, 256);
    assert!(mla::mla_warps("t", 100_000, 100_064, 8).is_err());
}

/// The backend's `Debug` names its platform's type, as `CudaBackend` did.
#[test]
fn debug_text_names_the_platform() {
    let (be, _) = backend(None, false);
    assert_eq!(format!("{be:?}"), "RecorderBackend(device 0 \"recorder\")");
    let ids = be.upload_i32(&[1]).unwrap();
    assert_eq!(format!("{ids:?}"), "RecorderIBuf(1 x i32)");
}
