//! Registered regions in device memory.
//!
//! A transport that keeps a region on a GPU allocates it through a
//! [`DeviceMemory`] (raw, IPC-exportable device memory, not a backend buffer:
//! its bytes are laid out by docs/layout.md, not as f32 values). The model then
//! reaches those bytes with the backend's region ops
//! ([`crate::Backend::region_gather`] and friends), which take the region as a
//! [`DeviceRegion`] and the items they touch as byte offsets. Every offset is
//! checked against the region's length on the host before a kernel runs, so a
//! wrong layout is an error, never a wild device write.

use crate::dtype::StorageDtype;
use crate::error::{KernelError, Result};

/// A registered region in device memory: its device address and its length in
/// bytes. Only meaningful to a backend on the device that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRegion {
    pub addr: u64,
    pub len: u64,
}

/// The items a region op touches: item i is `values` consecutive values of
/// `dtype` at byte offset `offsets[i]` (f32 items as 4-byte values, bf16 and
/// f16 items as 2-byte ones); item i is row i of the backend buffer.
#[derive(Debug, Clone, Copy)]
pub struct RegionItems<'a> {
    pub offsets: &'a [u64],
    pub values: usize,
    pub dtype: StorageDtype,
}

impl RegionItems<'_> {
    /// Bytes per value.
    pub fn value_bytes(&self) -> u64 {
        match self.dtype {
            StorageDtype::F32 => 4,
            StorageDtype::Bf16 | StorageDtype::F16 => 2,
        }
    }

    /// Checks every item against the region (in bounds, aligned to its value
    /// size) and returns the element count of the matching buffer.
    pub fn check(&self, op: &'static str, region: DeviceRegion) -> Result<usize> {
        let vb = self.value_bytes();
        let item = (self.values as u64).checked_mul(vb).ok_or(KernelError::SizeOverflow { op, dims: vec![self.values] })?;
        if !region.addr.is_multiple_of(vb) {
            return Err(KernelError::InvalidShape { op, reason: format!("region address {:#x} is not {vb}-byte aligned", region.addr) });
        }
        for (i, &off) in self.offsets.iter().enumerate() {
            if off % vb != 0 {
                return Err(KernelError::InvalidShape { op, reason: format!("item {i} at byte {off} is not {vb}-byte aligned") });
            }
            match off.checked_add(item) {
                Some(end) if end <= region.len => {}
                _ => {
                    return Err(KernelError::InvalidShape {
                        op,
                        reason: format!("item {i} covers bytes {off}..{off}+{item}, past the end of the {}-byte region", region.len),
                    });
                }
            }
        }
        self.offsets.len().checked_mul(self.values).ok_or(KernelError::SizeOverflow { op, dims: vec![self.offsets.len(), self.values] })
    }
}

/// A layer mark: an event a backend recorded on its stream after a layer's
/// work ([`crate::Backend::mark_layer`]), by its id (process-wide, never
/// reused). Plain data, so that it can ride along with the copies of that
/// layer through the engine's phases to [`DeviceMemory::copy_after`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamMark(pub u64);

/// One strided device-to-device copy: `height` rows of `width` bytes, row r
/// from `src + r * src_pitch` to `dst + r * dst_pitch` (a 2D copy; a single row
/// is a plain copy). Addresses are device addresses of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    pub src: u64,
    pub src_pitch: u64,
    pub dst: u64,
    pub dst_pitch: u64,
    pub width: u64,
    pub height: u64,
}

impl Copy2d {
    /// Whether running `self` and `later` at the same time could differ from
    /// running them in order: one writes what the other reads or writes.
    pub fn conflicts_with(&self, later: &Copy2d) -> bool {
        let dst = |c: &Copy2d| Rows { base: c.dst, pitch: c.dst_pitch, width: c.width, height: c.height };
        let src = |c: &Copy2d| Rows { base: c.src, pitch: c.src_pitch, width: c.width, height: c.height };
        dst(self).meets(&dst(later)) || dst(self).meets(&src(later)) || src(self).meets(&dst(later))
    }
}

/// One side of a [`Copy2d`]: `height` rows of `width` bytes, `pitch` apart.
struct Rows {
    base: u64,
    pitch: u64,
    width: u64,
    height: u64,
}

impl Rows {
    /// `[start, end)` of all the rows: a bound (the gaps are not touched).
    fn span(&self) -> (u64, u64) {
        (self.base, self.base + self.height.saturating_sub(1) * self.pitch + self.width)
    }

    /// Whether some row of `self` shares a byte with some row of `other`.
    /// Exact when both have one pitch (or one of them a single row), as the
    /// rows of two layers or two requests interleaved in one region do; a
    /// bound on the spans otherwise.
    fn meets(&self, other: &Rows) -> bool {
        let (a, b) = (self.span(), other.span());
        if !(a.0 < b.1 && b.0 < a.1) || self.width == 0 || other.width == 0 {
            return false;
        }
        let pitch = match (self.height, other.height) {
            (1, 1) => return true,
            (1, _) => other.pitch,
            (_, 1) => self.pitch,
            _ if self.pitch == other.pitch => self.pitch,
            _ => return true,
        };
        if pitch < self.width.max(other.width) {
            return true; // rows of one side overlap each other: keep it simple
        }
        // Row j of other starts x = d + k * pitch after row i of self
        // (k = j - i); the two rows meet when -other.width < x < self.width.
        let (p, d) = (pitch as i128, other.base as i128 - self.base as i128);
        let (wa, wb) = (self.width as i128, other.width as i128);
        let k_lo = (-wb - d).div_euclid(p) + 1;
        let k_hi = (wa - d + p - 1).div_euclid(p) - 1;
        let lo = k_lo.max(-(self.height as i128 - 1));
        let hi = k_hi.min(other.height as i128 - 1);
        lo <= hi
    }
}

/// Copies one launch of a table copy kernel takes where kernel arguments are
/// limited to the 4 KB every driver accepts (`CT_COPIES` of
/// `kernels/hip/memcopy.hip` under HIP): the table is the kernel's by-value
/// argument.
pub const TABLE_COPIES: usize = 48;

/// Copies one launch of the table copy kernel takes on CUDA (`CT_COPIES` of
/// `kernels/hip/memcopy.hip` under NVRTC): CUDA 12.1 and later accept 32,764
/// bytes of kernel arguments on Volta and newer, and a table of 500 copies
/// takes 32,016 (64 a copy and 16 more).
pub const WIDE_TABLE_COPIES: usize = 500;

/// Copies of the small table a CUDA launch of up to this many copies takes
/// (`CT_SMALL`, `copy_table_small`): 4,048 bytes of argument where the wide
/// table's 32,016 cost each launch about 3.6 us more of the device's time.
pub const SMALL_TABLE_COPIES: usize = 63;

/// Splits a batch of copies, in queue order, into runs that one table launch
/// may copy all at once: at most `max` each ([`TABLE_COPIES`] or
/// [`WIDE_TABLE_COPIES`], the kernel's table size), and none holding two
/// copies where one writes bytes the other reads or writes (such a pair goes
/// into consecutive launches, which a stream runs in order). Empty copies are
/// left out. Returns index ranges into `copies`.
///
/// A run's copies are checked against the new one only where their spans
/// meet (a sorted index of the run's spans): the rows of many layers and
/// requests interleave in one region, but most copies of a pass lie in other
/// regions, and checking each against every earlier one of a run of 500
/// would cost a hand-off pass more host time than its launches.
pub fn table_launches(copies: &[Copy2d], max: usize) -> Vec<std::ops::Range<usize>> {
    let max = max.max(1);
    let mut out = Vec::new();
    // Whole tables of copies that meet nowhere (a hand-off pass: every row
    // lands in its own place) are found with one sort each; the first table
    // that holds a conflict or an empty copy, and everything after it, goes
    // through the run index, which splits exactly where the sort found the
    // conflict (a run starts fresh where a full table ended either way).
    let mut from = 0;
    while from < copies.len() {
        let to = (from + max).min(copies.len());
        if !conflict_free(&copies[from..to]) {
            break;
        }
        out.push(from..to);
        from = to;
    }
    if from < copies.len() {
        out.extend(table_runs(&copies[from..], max).into_iter().map(|r| r.start + from..r.end + from));
    }
    out
}

/// Whether no copy of `copies` is empty and no two conflict
/// ([`Copy2d::conflicts_with`]): the spans of each side sorted once, and
/// only copies whose spans meet compared.
fn conflict_free(copies: &[Copy2d]) -> bool {
    if copies.iter().any(|c| c.width == 0 || c.height == 0) {
        return false;
    }
    let spans = |dst: bool| -> Vec<(u64, u64, usize)> {
        let mut v: Vec<(u64, u64, usize)> = copies
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (d, s) = RunSpans::sides(c);
                let (lo, hi) = if dst { d } else { s };
                (lo, hi, i)
            })
            .collect();
        v.sort_unstable();
        v
    };
    let (dst, src) = (spans(true), spans(false));
    // Destinations against destinations: each pair whose spans overlap.
    for (k, a) in dst.iter().enumerate() {
        if dst[k + 1..].iter().take_while(|b| b.0 < a.1).any(|b| copies[a.2].conflicts_with(&copies[b.2])) {
            return false;
        }
    }
    // Destinations against the other copies' sources.
    let longest = src.iter().map(|s| s.1 - s.0).max().unwrap_or(0);
    dst.iter().all(|a| {
        let first = src.partition_point(|s| s.0.saturating_add(longest) <= a.0);
        !src[first..].iter().take_while(|s| s.0 < a.1).filter(|s| s.1 > a.0 && s.2 != a.2).any(|s| copies[a.2].conflicts_with(&copies[s.2]))
    })
}

/// [`table_launches`] copy by copy: a run grows until the next copy would
/// conflict with one of it or fill it past `max`.
fn table_runs(copies: &[Copy2d], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = None::<usize>;
    let mut run = RunSpans::default();
    for (i, c) in copies.iter().enumerate() {
        if c.width == 0 || c.height == 0 {
            if let Some(s) = start.take() {
                out.push(s..i);
            }
            run.clear();
            continue;
        }
        if let Some(s) = start {
            if i - s == max || run.conflicts(copies, c) {
                out.push(s..i);
                start = Some(i);
                run.clear();
            }
        } else {
            start = Some(i);
        }
        run.add(i, c);
    }
    if let Some(s) = start {
        out.push(s..copies.len());
    }
    out
}

/// The copies of one run of [`table_launches`], by the spans they touch
/// (`[lo, hi)` bounds of all the rows of one side): a new copy can conflict
/// only with a copy whose destination span meets one of its spans, or whose
/// source span meets its destination span (two copies reading one source
/// never conflict, and a pass's copies share their sources often).
#[derive(Default)]
struct RunSpans {
    dst: Spans,
    src: Spans,
}

/// Spans sorted by `lo`, as (lo, hi, copy index), and the longest of them.
#[derive(Default)]
struct Spans {
    spans: Vec<(u64, u64, usize)>,
    longest: u64,
}

impl Spans {
    fn add(&mut self, (lo, hi): (u64, u64), i: usize) {
        let at = self.spans.partition_point(|s| s.0 <= lo);
        self.spans.insert(at, (lo, hi, i));
        self.longest = self.longest.max(hi - lo);
    }

    /// The copies whose span meets `[lo, hi)`: those starting in
    /// `(lo - longest, hi)` whose end passes `lo`.
    fn meeting(&self, (lo, hi): (u64, u64)) -> impl Iterator<Item = usize> + '_ {
        let from = self.spans.partition_point(|s| s.0.saturating_add(self.longest) <= lo);
        self.spans[from..].iter().take_while(move |s| s.0 < hi).filter(move |s| s.1 > lo).map(|s| s.2)
    }
}

impl RunSpans {
    fn clear(&mut self) {
        *self = RunSpans::default();
    }

    fn add(&mut self, i: usize, c: &Copy2d) {
        let (d, s) = Self::sides(c);
        self.dst.add(d, i);
        self.src.add(s, i);
    }

    /// (destination span, source span).
    fn sides(c: &Copy2d) -> ((u64, u64), (u64, u64)) {
        let span = |base: u64, pitch: u64| (base, base + (c.height - 1) * pitch + c.width);
        (span(c.dst, c.dst_pitch), span(c.src, c.src_pitch))
    }

    /// Whether `c` conflicts with some copy of the run ([`Copy2d::conflicts_with`]).
    fn conflicts(&self, copies: &[Copy2d], c: &Copy2d) -> bool {
        let (d, s) = Self::sides(c);
        self.dst.meeting(d).chain(self.dst.meeting(s)).chain(self.src.meeting(d)).any(|e| copies[e].conflicts_with(c))
    }
}

/// A batch of copies queued on a [`DeviceMemory`]; [`DeviceMemory::done`] says
/// when every copy of it has completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyTicket(pub u64);

/// Where one copy list ran on the device's clock
/// ([`DeviceMemory::take_copy_stamps`]): microseconds from when stamping
/// started to an event recorded before its first launch (it fires when the
/// list's stream reaches it: after the marks it waits on and the lists
/// queued before it on that stream) and to one after its last.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyStamp {
    pub ticket: CopyTicket,
    pub start_us: f64,
    pub end_us: f64,
    /// Host microseconds the list's launches took to queue (the driver's
    /// calls between the two events).
    pub queue_us: f64,
}

/// Device memory for a transport's regions: allocation that another process
/// can open (an IPC handle), copies queued in order on the memory's own
/// stream and completed by events, and host access for setup and checks.
///
/// The unsafe methods take raw device addresses: the caller guarantees that
/// each address range lies inside a live allocation (the transport checks
/// every descriptor against its regions before it queues a copy).
pub trait DeviceMemory: Send + Sync {
    /// The device, as the user names it ("cuda:0").
    fn label(&self) -> String;
    /// Allocates `len` bytes, zeroed, exportable to other processes.
    fn alloc(&self, len: u64) -> Result<u64>;
    /// Frees an allocation of [`DeviceMemory::alloc`].
    ///
    /// # Safety
    /// `addr` came from `alloc` and no queued copy or kernel still uses it.
    unsafe fn free(&self, addr: u64);
    /// The IPC handle another process opens `addr` (an allocation) with.
    fn export(&self, addr: u64) -> Result<Vec<u8>>;
    /// Opens another process's exported allocation; returns its address here.
    fn open(&self, handle: &[u8]) -> Result<u64>;
    /// Closes an address that [`DeviceMemory::open`] returned.
    ///
    /// # Safety
    /// No queued copy still uses `addr`.
    unsafe fn close(&self, addr: u64);
    /// Queues `copies` in order and returns the ticket of the batch.
    ///
    /// # Safety
    /// Every range lies inside a live allocation of this device (or one opened here).
    unsafe fn copy(&self, copies: &[Copy2d]) -> Result<CopyTicket>;
    /// [`DeviceMemory::copy`], started on the device only once the work before
    /// each of `after` has run: marks a backend recorded on its stream
    /// ([`crate::Backend::mark_layer`]), waited on by the batch's copy stream
    /// (`cuStreamWaitEvent`, `hipStreamWaitEvent`), never by the host. With
    /// no mark it is `copy`; the default refuses marks (memory whose copies
    /// cannot wait on a backend's stream).
    ///
    /// # Safety
    /// As [`DeviceMemory::copy`].
    unsafe fn copy_after(&self, copies: &[Copy2d], after: &[StreamMark]) -> Result<CopyTicket> {
        if after.is_empty() {
            // SAFETY: the caller's contract.
            return unsafe { self.copy(copies) };
        }
        Err(KernelError::Unsupported { op: "copy_after", backend: self.label(), reason: "its copies cannot wait on a backend's layer marks".into() })
    }
    /// Whether every copy of `ticket` has completed (an event query). A
    /// ticket that reported `true` is forgotten: asking again is an error.
    fn done(&self, ticket: CopyTicket) -> Result<bool>;
    /// Waits until every copy of `ticket` has completed and forgets it. A
    /// device copy cannot be stalled by a peer (the bytes are on this device,
    /// and an opened allocation stays valid while it is open), so this returns
    /// once the device has run the batch. The default polls [`DeviceMemory::done`].
    fn wait(&self, ticket: CopyTicket) -> Result<()> {
        while !self.done(ticket)? {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        Ok(())
    }
    /// Runs `copies` as [`DeviceMemory::copy`] queues them, waits, and
    /// returns the device's time between an event recorded before the first
    /// and one after the last, with the stream held until all of them are
    /// queued: what the copies cost on the device, without the host's
    /// queueing and wake-ups (a bench's measure; the default says this
    /// memory cannot time its copies).
    ///
    /// # Safety
    /// As [`DeviceMemory::copy`].
    unsafe fn time_copies(&self, copies: &[Copy2d]) -> Result<std::time::Duration> {
        let _ = copies;
        Err(KernelError::Unsupported { op: "time_copies", backend: self.label(), reason: "it has no device timer".into() })
    }
    /// Starts (`true`) or stops stamping copy lists on the device's clock:
    /// while on, every list [`DeviceMemory::copy_after`] queues gets an event
    /// before its first launch and one after its last, two more driver calls
    /// a list (a timeline's measure, for one pass; the default says this
    /// memory has no device timer). Starting again drops the stamps not taken.
    fn stamp_copies(&self, on: bool) -> Result<()> {
        let _ = on;
        Err(KernelError::Unsupported { op: "stamp_copies", backend: self.label(), reason: "it has no device timer".into() })
    }
    /// The stamps of the lists queued since stamping started, in queue
    /// order, once their copies have run (it waits for them); stamping stops.
    fn take_copy_stamps(&self) -> Result<Vec<CopyStamp>> {
        Ok(Vec::new())
    }
    /// Copies `out.len()` bytes at `addr` to the host (waits).
    ///
    /// # Safety
    /// The range lies inside a live allocation.
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()>;
    /// Copies `data` to `addr` (waits).
    ///
    /// # Safety
    /// The range lies inside a live allocation.
    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()>;
}

/// The region ops' refusal on a backend without device regions (the CPU's
/// regions are host memory and go through the host path).
pub(crate) fn unsupported(backend: &str, op: &'static str) -> KernelError {
    KernelError::Unsupported { op, backend: backend.to_string(), reason: "its regions are host memory, reached through the region view's bytes".into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_checked_against_the_region() {
        let region = DeviceRegion { addr: 0x1000, len: 64 };
        let ok = RegionItems { offsets: &[0, 32], values: 8, dtype: StorageDtype::F32 };
        assert_eq!(ok.check("t", region).unwrap(), 16);
        let past = RegionItems { offsets: &[40], values: 8, dtype: StorageDtype::F32 };
        assert!(past.check("t", region).unwrap_err().to_string().contains("past the end of the 64-byte region"));
        let odd = RegionItems { offsets: &[3], values: 1, dtype: StorageDtype::Bf16 };
        assert!(odd.check("t", region).unwrap_err().to_string().contains("not 2-byte aligned"));
        let half = RegionItems { offsets: &[2, 62], values: 1, dtype: StorageDtype::Bf16 };
        assert_eq!(half.check("t", region).unwrap(), 2);
        let huge = RegionItems { offsets: &[u64::MAX - 1], values: 1, dtype: StorageDtype::Bf16 };
        assert!(huge.check("t", region).is_err());
    }

    fn row(src: u64, dst: u64, width: u64) -> Copy2d {
        Copy2d { src, src_pitch: width, dst, dst_pitch: width, width, height: 1 }
    }

    /// Whether two copies' destinations share a byte, row by row.
    fn naive_meet(a: &Copy2d, b: &Copy2d) -> bool {
        let rows = |c: Copy2d| (0..c.height).map(move |r| (c.dst + r * c.dst_pitch, c.dst + r * c.dst_pitch + c.width));
        rows(*a).any(|(s, e)| rows(*b).any(|(t, f)| s < f && t < e))
    }

    #[test]
    fn interleaved_rows_do_not_conflict_and_touching_ones_do() {
        // Two layers' rows interleaved in one destination, 128 apart: disjoint.
        let a = Copy2d { src: 0, src_pitch: 64, dst: 10_000, dst_pitch: 128, width: 32, height: 4 };
        let b = Copy2d { src: 1_000, src_pitch: 64, dst: 10_032, dst_pitch: 128, width: 32, height: 4 };
        assert!(!a.conflicts_with(&b) && !b.conflicts_with(&a));
        // One byte wider and they meet; shifted by a whole pitch they meet.
        let wide = Copy2d { width: 33, ..a };
        assert!(wide.conflicts_with(&b) && b.conflicts_with(&wide));
        let next = Copy2d { dst: 10_000 + 3 * 128, height: 1, ..a };
        assert!(a.conflicts_with(&next) && next.conflicts_with(&a));
        let past = Copy2d { dst: 10_000 + 4 * 128, ..a };
        assert!(!a.conflicts_with(&past));
        // Against a row-by-row check, over many shapes with one pitch.
        let mut seed = 7u64;
        let mut next_u = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..20_000 {
            let pitch = 16 + next_u(100);
            let mk = |base: u64, w: u64, h: u64| Copy2d { src: 1 << 40, src_pitch: pitch, dst: base, dst_pitch: pitch, width: w, height: h };
            let x = mk(1_000 + next_u(400), 1 + next_u(pitch), 1 + next_u(6));
            let y = mk(1_000 + next_u(400), 1 + next_u(pitch), 1 + next_u(6));
            assert_eq!(x.conflicts_with(&y), naive_meet(&x, &y), "{x:?} {y:?}");
        }
    }

    /// table_launches as it was before its span index: each copy checked
    /// against every earlier one of its run.
    fn naive_table_launches(copies: &[Copy2d], max: usize) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut start = None::<usize>;
        for (i, c) in copies.iter().enumerate() {
            if c.width == 0 || c.height == 0 {
                if let Some(s) = start.take() {
                    out.push(s..i);
                }
                continue;
            }
            match start {
                Some(s) if i - s == max || copies[s..i].iter().any(|e| e.conflicts_with(c)) => {
                    out.push(s..i);
                    start = Some(i);
                }
                Some(_) => {}
                None => start = Some(i),
            }
        }
        if let Some(s) = start {
            out.push(s..copies.len());
        }
        out
    }

    /// Invariant: the span index changes no split. Over random batches of
    /// strided and plain copies (some empty, some reading what others write,
    /// spans of very different lengths in one address range), the launches
    /// equal those of checking each copy against every earlier one of its run.
    #[test]
    fn table_launches_with_the_span_index_equal_the_pairwise_check() {
        let mut seed = 11u64;
        let mut next_u = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let (mut splits, mut whole) = (0, 0);
        for round in 0..3_000 {
            let n = 1 + next_u(40) as usize;
            let copies: Vec<Copy2d> = (0..n)
                .map(|_| {
                    let width = if next_u(20) == 0 { 0 } else { 1 + next_u(64) };
                    let tall = next_u(4) == 0;
                    let height = 1 + next_u(if tall { 200 } else { 5 });
                    let pitch = width + next_u(3) * 32;
                    // Every other round far apart (conflicts rare: whole
                    // tables pass the sorted check), else packed close.
                    let room = if round % 2 == 0 { 20_000 } else { 20_000_000 };
                    let (src, dst) = (next_u(room), next_u(room));
                    let dst_pitch = pitch + next_u(2) * 64;
                    Copy2d { src, src_pitch: pitch, dst, dst_pitch, width, height }
                })
                .collect();
            let max = [3, TABLE_COPIES, WIDE_TABLE_COPIES][round % 3];
            let got = table_launches(&copies, max);
            assert_eq!(got, naive_table_launches(&copies, max), "{copies:?} max {max}");
            splits += got.len();
            whole += usize::from(copies.len() > max && got.iter().filter(|r| r.len() == max).count() >= 2);
        }
        assert!(splits > 6_000, "the batches split often enough to test the splits: {splits}");
        assert!(whole > 300, "batches of several full tables, as the sorted check finds them: {whole}");
    }

    #[test]
    fn table_launches_keep_conflicting_copies_in_order() {
        // Strided copies whose rows meet in one destination conflict,
        // disjoint ones share a launch.
        let a = Copy2d { src: 0, src_pitch: 64, dst: 10_000, dst_pitch: 128, width: 32, height: 4 };
        let b = Copy2d { src: 1_000, src_pitch: 64, dst: 10_016, dst_pitch: 128, width: 32, height: 4 };
        assert!(a.conflicts_with(&b) && b.conflicts_with(&a));
        let c = row(2_000, 20_000, 100);
        assert!(!a.conflicts_with(&c));
        // c then d overwrites c's destination; e reads what d wrote; f writes what e reads.
        let d = row(3_000, 20_050, 100);
        let e = row(20_060, 30_000, 10);
        let f = row(5_000, 20_055, 8);
        assert_eq!(table_launches(&[a, c, b], TABLE_COPIES), vec![0..2, 2..3]);
        assert_eq!(table_launches(&[c, d], TABLE_COPIES), vec![0..1, 1..2]);
        assert_eq!(table_launches(&[row(0, 40_000, 8), e], TABLE_COPIES), vec![0..2]);
        assert_eq!(table_launches(&[row(9_000, 40_000, 8), e, f], TABLE_COPIES), vec![0..2, 2..3]);
        // Edges that touch do not conflict; empty copies are dropped.
        let empty = Copy2d { width: 0, ..row(0, 20_000, 0) };
        assert_eq!(table_launches(&[row(0, 100, 10), empty, row(0, 110, 10)], TABLE_COPIES), vec![0..1, 2..3]);
        assert_eq!(table_launches(&[row(0, 100, 10), row(0, 110, 10)], TABLE_COPIES), vec![0..2]);
        assert!(table_launches(&[], TABLE_COPIES).is_empty());
        // At most TABLE_COPIES a launch.
        let many: Vec<Copy2d> = (0..100u64).map(|i| row(i * 8, (1 << 20) | (i * 8), 8)).collect();
        assert_eq!(table_launches(&many, TABLE_COPIES), vec![0..48, 48..96, 96..100]);
        assert_eq!(table_launches(&many, WIDE_TABLE_COPIES), vec![0..100]);
        assert_eq!(table_launches(&many[..7], 3), vec![0..3, 3..6, 6..7]);
    }
}
