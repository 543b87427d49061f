//! Device memory for regions (`DeviceMem`, `gpu/ops/memory.rs`) through the
//! recording driver: the calls a few copy batches become, held against
//! records worked out by hand from CUDA's `gpu/cuda_memory.rs` as it was
//! before it moved onto the seam (8e1a783: the `copy_table` launches, grids,
//! tables and copy-engine calls it made, in its order, on its round robin of
//! streams), the tickets' events, the allocations, and the table's bytes
//! against `hk_copy_table` in memcopy.hip.

use super::*;
use crate::gpu::ops::memory::{COPY_UNROLL, CopyTable, DeviceMem};
use crate::region::{Copy2d, CopyTicket, DeviceMemory, SMALL_TABLE_COPIES, TABLE_COPIES, WIDE_TABLE_COPIES};

/// Memory on a fresh recorder whose made-up addresses are only logged: host
/// access on stream 0, copy streams 1 to 8; CUDA's tables (500 copies).
fn memory() -> (DeviceMem<Recorder>, Recorder) {
    memory_on(None)
}

/// As [`memory`], on a recorder with HIP's shared-memory rule (`lds`) and
/// so HIP's tables (48 copies).
fn memory_on(lds: Option<u32>) -> (DeviceMem<Recorder>, Recorder) {
    let rec = Recorder::new(lds, false);
    rec.state().loose = true;
    let mem = DeviceMem::new(rec.clone()).unwrap_or_else(|e| panic!("{e}"));
    rec.state().log.clear();
    (mem, rec)
}

fn row(src: u64, dst: u64, width: u64) -> Copy2d {
    Copy2d { src, src_pitch: width, dst, dst_pitch: width, width, height: 1 }
}

/// A `copy_table` table's bytes, laid out by hand as hk_copy_table's C
/// layout for `cap` copies: `cap` rows of 7 i64 (src, dst, words per row,
/// height, src pitch, dst pitch, word bytes), then `cap + 1` i64 starts,
/// then n and a pad as i32.
fn table(cap: usize, rows: &[[i64; 7]], start: &[i64]) -> Vec<u8> {
    let mut b = vec![0u8; 64 * cap + 16];
    for (i, r) in rows.iter().enumerate() {
        for (k, v) in r.iter().enumerate() {
            b[i * 56 + k * 8..][..8].copy_from_slice(&v.to_le_bytes());
        }
    }
    for (j, v) in start.iter().enumerate() {
        b[56 * cap + j * 8..][..8].copy_from_slice(&v.to_le_bytes());
    }
    b[64 * cap + 8..][..4].copy_from_slice(&(rows.len() as i32).to_le_bytes());
    b
}

/// A `copy_table` launch of CUDA's table (500 copies).
fn launch(stream: usize, grid: u32, rows: &[[i64; 7]], start: &[i64]) -> MemOp {
    launch_of(WIDE_TABLE_COPIES, stream, grid, rows, start)
}

fn launch_of(cap: usize, stream: usize, grid: u32, rows: &[[i64; 7]], start: &[i64]) -> MemOp {
    // CUDA's short lists take the small table (copy_table_small).
    let (f, cap) = if cap == WIDE_TABLE_COPIES && rows.len() <= SMALL_TABLE_COPIES { ("copy_table_small", SMALL_TABLE_COPIES) } else { ("copy_table", cap) };
    MemOp::Launch { stream, f, grid: (grid, 1, 1), block: 256, smem: 0, head: Some(table(cap, rows, start)) }
}

/// Compares two logs entry by entry, naming the first that differs (a table
/// by its first differing field).
fn same_log(got: &[MemOp], want: &[MemOp]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if let (MemOp::Launch { head: Some(gh), .. }, MemOp::Launch { head: Some(wh), .. }) = (g, w)
            && gh != wh
        {
            let cap = (wh.len() - 16) / 64;
            let at = gh.iter().zip(wh).position(|(a, b)| a != b).unwrap_or(gh.len().min(wh.len()));
            let field = if at < 56 * cap {
                format!("c[{}][{}]", at / 56, at % 56 / 8)
            } else if at < 64 * cap + 8 {
                format!("start[{}]", (at - 56 * cap) / 8)
            } else {
                "n".into()
            };
            let word = |h: &[u8]| h.get(at / 8 * 8..at / 8 * 8 + 8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()));
            panic!("entry {i} (a copy_table launch): the table's {field} is {:?}, want {:?} ({} and {} bytes)", word(gh), word(wh), gh.len(), wh.len());
        }
        assert_eq!(g, w, "entry {i}");
    }
    assert_eq!(got.len(), want.len(), "{} calls, want {}: {:?}", got.len(), want.len(), &got[want.len().min(got.len())..]);
}

/// Nine batches on CUDA's tables: tables split where copies conflict, 50
/// copies in one table (CUDA's 500-copy table), words of 16, 4 and 1 bytes,
/// empty copies left out, a 256 MiB contiguous copy and a row of 2^31
/// one-byte words on the copy engines (the table copies before each queued
/// first), a copy of 2^32 words in two tables' rows, grids of one block per
/// 2,048 words (256 threads of 8 words: 2^21 blocks for the 2^32 words), an
/// empty batch that still records its event, and batches going round the
/// eight copy streams.
#[test]
fn copy_batches_make_the_launches_and_engine_copies_cuda_made() {
    let (mem, rec) = memory();
    let b1 = [
        row(0x1000_0000, 0x2000_0000, 1152),
        Copy2d { src: 0x1000_1000, src_pitch: 4096, dst: 0x2000_1000, dst_pitch: 1152, width: 576, height: 4 },
        row(0x1000_2001, 0x2000_2003, 7),
        Copy2d { width: 0, ..row(0x1000_5000, 0x2000_5000, 0) },
        row(0x1000_3000, 0x2000_0040, 64),
        row(0x1000_4004, 0x2000_4008, 12),
    ];
    let p = Copy2d { src: 4 << 40, src_pitch: 2048, dst: 5 << 40, dst_pitch: 2048, width: 1024, height: 1 << 26 };
    let b2 = [
        row(0x3000_0000, 0x4000_0000, 256),
        row(1 << 40, 2 << 40, 256 << 20),
        row(0x3000_1000, 0x4000_1000, 32),
        Copy2d { src: (3 << 40) + 1, src_pitch: 3 << 30, dst: 6 << 40, dst_pitch: 1 << 32, width: 1 << 31, height: 2 },
        p,
    ];
    let b3: Vec<Copy2d> = (0..50).map(|i| row(0x7000_0000 + i * 64, 0x8000_0000 + i * 64, 64)).collect();
    let mut tickets = Vec::new();
    for b in [&b1[..], &b2[..], &b3[..]] {
        // SAFETY: the recorder only logs these (loose).
        tickets.push(unsafe { mem.copy(b) }.unwrap().0);
    }
    for _ in 0..6 {
        // SAFETY: as above; no copies.
        tickets.push(unsafe { mem.copy(&[]) }.unwrap().0);
    }
    assert_eq!(tickets, (1..=9).collect::<Vec<u64>>());
    let mut want = vec![
        launch(
            1,
            1,
            &[[0x1000_0000, 0x2000_0000, 72, 1, 1152, 1152, 16], [0x1000_1000, 0x2000_1000, 36, 4, 4096, 1152, 16], [0x1000_2001, 0x2000_2003, 7, 1, 7, 7, 1]],
            &[0, 72, 216, 223],
        ),
        launch(1, 1, &[[0x1000_3000, 0x2000_0040, 4, 1, 64, 64, 16], [0x1000_4004, 0x2000_4008, 3, 1, 12, 12, 4]], &[0, 4, 7]),
        MemOp::Record { stream: 1, fence: 1 },
        launch(2, 1, &[[0x3000_0000, 0x4000_0000, 16, 1, 256, 256, 16]], &[0, 16]),
        MemOp::Dtod { stream: 2, dst: 2 << 40, src: 1 << 40, bytes: 256 << 20 },
        launch(2, 1, &[[0x3000_1000, 0x4000_1000, 2, 1, 32, 32, 16]], &[0, 2]),
        MemOp::Copy2d { stream: 2, dst: 6 << 40, dst_pitch: 1 << 32, src: (3 << 40) + 1, src_pitch: 3 << 30, width: 1 << 31, height: 2 },
        launch(
            2,
            1 << 21,
            &[[4 << 40, 5 << 40, 64, 1 << 25, 2048, 2048, 16], [(4 << 40) + (1 << 36), (5 << 40) + (1 << 36), 64, 1 << 25, 2048, 2048, 16]],
            &[0, 1 << 31, 1 << 32],
        ),
        MemOp::Record { stream: 2, fence: 2 },
    ];
    let rows50: Vec<[i64; 7]> = (0..50).map(|i| [0x7000_0000 + i * 64, 0x8000_0000 + i * 64, 4, 1, 64, 64, 16]).collect();
    let start50: Vec<i64> = (0..=50).map(|i| i * 4).collect();
    want.push(launch(3, 1, &rows50, &start50));
    want.push(MemOp::Record { stream: 3, fence: 3 });
    for (stream, fence) in [(4, 4), (5, 5), (6, 6), (7, 7), (8, 8), (1, 9)] {
        want.push(MemOp::Record { stream, fence });
    }
    same_log(&rec.state().log, &want);
}

/// Tables split at their size: 50 disjoint copies are 48 and 2 on HIP's
/// 4 KB table, 501 are 500 and 1 on CUDA's; a table takes a block for every
/// 2,048 words begun, with no cap.
#[test]
fn tables_split_at_the_platforms_table_size() {
    let rows = |n: i64, at: i64| -> Vec<[i64; 7]> { (at..at + n).map(|i| [0x7000_0000 + i * 64, 0x8000_0000 + i * 64, 4, 1, 64, 64, 16]).collect() };
    let starts = |n: i64| -> Vec<i64> { (0..=n).map(|i| i * 4).collect() };
    let batch = |n: u64| -> Vec<Copy2d> { (0..n).map(|i| row(0x7000_0000 + i * 64, 0x8000_0000 + i * 64, 64)).collect() };

    let (hip, rec) = memory_on(Some(64 << 10));
    // SAFETY: the recorder only logs these (loose).
    unsafe { hip.copy(&batch(50)) }.unwrap();
    let want = vec![
        launch_of(TABLE_COPIES, 1, 1, &rows(48, 0), &starts(48)),
        launch_of(TABLE_COPIES, 1, 1, &rows(2, 48), &starts(2)),
        MemOp::Record { stream: 1, fence: 1 },
    ];
    same_log(&rec.state().log, &want);
    assert_eq!(table(TABLE_COPIES, &[], &[]).len(), 3088);

    let (cuda, rec) = memory();
    // SAFETY: as above.
    unsafe { cuda.copy(&batch(501)) }.unwrap();
    let want = vec![launch(1, 1, &rows(500, 0), &starts(500)), launch(1, 1, &rows(1, 500), &starts(1)), MemOp::Record { stream: 1, fence: 1 }];
    same_log(&rec.state().log, &want);
    assert_eq!(table(WIDE_TABLE_COPIES, &[], &[]).len(), 32016);

    let (cuda, rec) = memory();
    let wide = |words: u64| Copy2d { src: 1 << 40, src_pitch: 16 * words, dst: 2 << 40, dst_pitch: 16 * words, width: 16 * words, height: 1 };
    for words in [4096u64, 4097, 396 * 2048, 396 * 2048 + 1] {
        // SAFETY: as above.
        unsafe { cuda.copy(&[wide(words)]) }.unwrap();
    }
    let grids: Vec<u32> = rec.state().log.iter().filter_map(|o| if let MemOp::Launch { grid, .. } = o { Some(grid.0) } else { None }).collect();
    assert_eq!(grids, [2, 3, 396, 397]);
}

/// A batch's ticket is done once its stream has run past its event, not
/// before; asking again after `true` is an error; `wait` returns the event
/// for a later batch to record again; batches on one stream complete in the
/// order they were queued.
#[test]
fn tickets_complete_with_their_stream_in_order() {
    let (mem, rec) = memory();
    let b = [row(0x1000, 0x2000, 64)];
    // SAFETY: the recorder only logs (loose).
    let copy = |b: &[Copy2d]| unsafe { mem.copy(b) }.unwrap();
    let (t1, t2, t3) = (copy(&b), copy(&b), copy(&b));
    assert_eq!((t1.0, t2.0, t3.0), (1, 2, 3));
    assert!(!mem.done(t1).unwrap() && !mem.done(t2).unwrap() && !mem.done(t3).unwrap(), "nothing has run");
    rec.state().run(2);
    assert!(mem.done(t2).unwrap(), "ticket 2's stream ran");
    assert!(!mem.done(t1).unwrap() && !mem.done(t3).unwrap(), "the other streams did not");
    let e = mem.done(t2).unwrap_err();
    assert_eq!(e.to_string(), KernelError::InvalidShape { op: "region copy", reason: "unknown copy ticket 2".into() }.to_string());
    mem.wait(t1).unwrap();
    assert!(mem.done(t1).is_err(), "a waited ticket is forgotten");
    // Ticket 4 goes to stream 4 and records ticket 1's event again.
    let t4 = copy(&b);
    assert_eq!(rec.state().log.last(), Some(&MemOp::Record { stream: 4, fence: 1 }));
    assert!(!mem.done(t4).unwrap(), "a reused event is pending again");
    // Tickets 5 to 8 go to streams 5 to 8, 9 to stream 1 again; 10 to
    // stream 2 after ticket 2 ran there.
    let later: Vec<CopyTicket> = (5..=10).map(|_| copy(&b)).collect();
    assert!(!mem.done(later[5]).unwrap(), "stream 2 ran only what was queued before");
    rec.state().run(1);
    assert!(mem.done(later[4]).unwrap(), "ticket 9, stream 1");
    assert!(!mem.done(t3).unwrap());
    mem.wait(t3).unwrap();
    mem.wait(t4).unwrap();
    let fences: BTreeSet<u64> = rec.state().log.iter().filter_map(|o| if let MemOp::Record { fence, .. } = o { Some(*fence) } else { None }).collect();
    assert_eq!(fences.len(), 9, "ten batches, one event reused: {fences:?}");
}

/// Allocations are zeroed on the host stream and waited for, freed once (the
/// recorder panics on a second free); an IPC handle has 64 bytes and a
/// handle of another length is refused before the driver sees it; closing an
/// opened address first drains every copy stream.
#[test]
fn allocations_are_freed_once_and_handles_checked() {
    let rec = Recorder::new(None, false);
    let mem = DeviceMem::new(rec.clone()).unwrap();
    rec.state().log.clear();
    assert_eq!(mem.label(), "recorder:0");
    let a = mem.alloc(100).unwrap();
    let b = mem.alloc(0).unwrap();
    assert_eq!(
        rec.state().log,
        vec![
            MemOp::Alloc { ptr: a, bytes: 100 },
            MemOp::Zero { stream: 0, ptr: a, bytes: 100 },
            MemOp::Sync { stream: 0 },
            MemOp::Alloc { ptr: b, bytes: 1 },
            MemOp::Zero { stream: 0, ptr: b, bytes: 1 },
            MemOp::Sync { stream: 0 },
        ]
    );
    // SAFETY: both are allocations of 100 and 1 bytes.
    unsafe {
        mem.write(a + 10, &[1, 2, 3]).unwrap();
        let mut out = [9u8; 5];
        mem.read(a + 9, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 0], "zeroed, then written");
    }
    let h = mem.export(a).unwrap();
    assert_eq!(h.len(), 64);
    let e = mem.open(&h[..63]).unwrap_err();
    assert_eq!(e.to_string(), KernelError::InvalidShape { op: "ipc open", reason: "an IPC handle has 64 bytes, got 63".into() }.to_string());
    let opened = mem.open(&h).unwrap();
    rec.state().log.clear();
    // SAFETY: nothing is queued on it.
    unsafe { mem.close(opened) };
    let mut want: Vec<MemOp> = (1..=8).map(|stream| MemOp::Sync { stream }).collect();
    want.push(MemOp::IpcClose { ptr: opened });
    assert_eq!(rec.state().log, want);
    // SAFETY: allocations of `alloc`, unused.
    unsafe {
        mem.free(a);
        mem.free(b);
    }
    drop(mem);
    let st = rec.state();
    assert_eq!((st.allocs, st.frees), (2, 2));
}

/// memcopy.hip's source.
fn memcopy_hip() -> &'static str {
    crate::gpu::HIP_SOURCES.iter().find(|(n, _)| *n == "memcopy.hip").unwrap().1
}

/// The value of `#define NAME` in memcopy.hip as HIP (`__HIPCC__` defined)
/// or NVRTC compiles it: the source's `#ifdef __HIPCC__ ... #else ...
/// #endif` blocks followed by hand.
fn define(name: &str, hip: bool) -> usize {
    let mut taking = vec![true];
    let mut found = None;
    for l in memcopy_hip().lines().map(str::trim) {
        if l == "#ifdef __HIPCC__" {
            taking.push(hip);
        } else if l == "#else" {
            let t = taking.pop().unwrap();
            taking.push(!t);
        } else if l == "#endif" {
            taking.pop();
        } else if taking.iter().all(|t| *t)
            && let Some(v) = l.strip_prefix(&format!("#define {name} "))
        {
            assert!(found.is_none(), "{name} defined twice for hip = {hip}");
            found = Some(v.trim().parse().unwrap());
        }
    }
    found.unwrap_or_else(|| panic!("{name} is not defined for hip = {hip}"))
}

/// The C layout of `struct hk_copy_table` in memcopy.hip for a platform,
/// read from the source: its size and each field's name, byte offset,
/// element size and count (i64 or int).
fn hk_copy_table(hip: bool) -> (usize, Vec<(String, usize, usize, usize)>) {
    table_struct("hk_copy_table", "CT_COPIES", hip)
}

/// The C layout of memcopy.hip's `struct NAME`, whose arrays are sized by
/// `#define CAP`: (size, [(field, offset, bytes, count)]).
fn table_struct(name: &str, cap: &str, hip: bool) -> (usize, Vec<(String, usize, usize, usize)>) {
    let src = memcopy_hip();
    let copies = define(cap, hip);
    let body = &src[src.find(&format!("struct {name} {{")).unwrap()..];
    let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
    let (mut off, mut align, mut fields) = (0usize, 1usize, Vec::new());
    for decl in body.split(';').map(|d| d.split("//").last().unwrap_or("").trim()).filter(|d| !d.is_empty()) {
        let decl = decl.lines().last().unwrap().trim();
        let (ty, rest) = decl.split_once(' ').unwrap();
        let size = match ty {
            "hk_i64" => 8,
            "int" => 4,
            other => panic!("hk_copy_table: unexpected field type {other}"),
        };
        let name = rest.split('[').next().unwrap().trim().to_string();
        let count: usize = rest
            .split('[')
            .skip(1)
            .map(|d| {
                let e = d.trim_end_matches(']').replace(cap, &copies.to_string());
                e.split('+').map(|t| t.trim().parse::<usize>().unwrap()).sum::<usize>()
            })
            .product();
        off = off.next_multiple_of(size);
        align = align.max(size);
        fields.push((name, off, size, count));
        off += size * count;
    }
    (off.next_multiple_of(align), fields)
}

/// The table `copy_table` is launched with has hk_copy_table's size on each
/// platform (HIP's within 4 KB, CUDA's within CUDA 12.1's 32,764 bytes), and
/// each field of the source's struct holds, at its offset, what the copies
/// say; the kernel's words a turn are the host's.
#[test]
fn the_table_argument_is_hk_copy_table_byte_for_byte() {
    assert_eq!(define("CT_UNROLL", true), COPY_UNROLL as usize);
    assert_eq!(define("CT_UNROLL", false), COPY_UNROLL as usize);
    for (hip, cap, size, limit) in [(true, TABLE_COPIES, 3088, 4096), (false, WIDE_TABLE_COPIES, 32016, 32764)] {
        let (got_size, fields) = hk_copy_table(hip);
        let names: Vec<&str> = fields.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(names, ["c", "start", "n", "pad"]);
        assert_eq!((got_size, CopyTable::size(cap)), (size, size), "hip = {hip}");
        assert!(size <= limit, "hip = {hip}: {size} bytes of kernel arguments");
        assert_eq!(fields[0].3, cap * 7, "CT_COPIES is the platform's table size (hip = {hip})");
        let copies = [Copy2d { src: 0x1000, src_pitch: 64, dst: 0x9000, dst_pitch: 128, width: 48, height: 3 }, row(0x5001, 0x6000, 5)];
        let (t, words) = CopyTable::of(&copies, cap);
        assert_eq!(words, 3 * 3 + 5);
        let bytes = t.bytes();
        assert_eq!(bytes.len(), size);
        let at = |name: &str, i: usize| -> i64 {
            let (_, off, sz, n) = fields.iter().find(|f| f.0 == name).unwrap();
            assert!(i < *n);
            let b = &bytes[off + i * sz..][..*sz];
            if *sz == 8 { i64::from_le_bytes(b.try_into().unwrap()) } else { i32::from_le_bytes(b.try_into().unwrap()) as i64 }
        };
        let c: Vec<i64> = (0..14).map(|k| at("c", k)).collect();
        assert_eq!(c, [0x1000, 0x9000, 3, 3, 64, 128, 16, 0x5001, 0x6000, 5, 1, 5, 5, 1]);
        assert_eq!((at("start", 0), at("start", 1), at("start", 2)), (0, 9, 14));
        assert!((3..=cap).all(|j| at("start", j) == 0));
        assert_eq!((at("n", 0), at("pad", 0)), (2, 0));
        assert!((14..cap * 7).all(|k| at("c", k) == 0));
    }
    // CUDA's small table: the same fields at CT_SMALL copies, within 4 KB.
    let (size, fields) = table_struct("hk_copy_table_small", "CT_SMALL", false);
    assert_eq!((size, CopyTable::size(SMALL_TABLE_COPIES)), (4048, 4048));
    assert_eq!(fields[0].3, SMALL_TABLE_COPIES * 7);
    let (t, _) = CopyTable::of(&[row(0x5001, 0x6000, 5)], SMALL_TABLE_COPIES);
    let start = fields.iter().find(|f| f.0 == "start").unwrap().1;
    assert_eq!(i64::from_le_bytes(t.bytes()[start + 8..start + 16].try_into().unwrap()), 5, "start[1] where the kernel reads it");
    for k in ["copy_table", "copy_table_small"] {
        let sig = crate::gpu::step_gpu::tests::signature(&crate::gpu::device_program(), k).unwrap();
        assert_eq!(sig, [Kind::S], "{k} takes the table alone, by value");
    }
}

/// One launch's table as `copy_table` reads it: its copies (src, dst, words
/// per row, height, src pitch, dst pitch, word bytes) and starts.
fn parse_table(head: &[u8]) -> (Vec<[i64; 7]>, Vec<i64>) {
    let cap = (head.len() - 16) / 64;
    let word = |at: usize| i64::from_le_bytes(head[at..at + 8].try_into().unwrap());
    let n = i32::from_le_bytes(head[64 * cap + 8..][..4].try_into().unwrap()) as usize;
    assert!(n <= cap);
    let c = (0..n).map(|i| std::array::from_fn(|k| word(i * 56 + k * 8))).collect();
    let start = (0..=n).map(|j| word(56 * cap + j * 8)).collect();
    (c, start)
}

/// What `copy_table` loads and stores for one launch, thread by thread, with
/// the index math of memcopy.hip (chunks of block x CT_UNROLL words, a
/// block's chunks a grid apart, a thread's first copy found by bisection,
/// 32-bit row division): every thread's loads read `mem` as it was
/// before the launch (as if every thread loaded before any stored: the
/// harshest order the device may choose within a table), and the stores
/// come back as (address, bytes), each thread's in its order.
fn kernel_stores(head: &[u8], grid: u32, block: u32, mem: &[u8]) -> Vec<(u64, Vec<u8>)> {
    let (c, start) = parse_table(head);
    let n = c.len();
    let words = start[n];
    let unroll = COPY_UNROLL as i64;
    let chunk = block as i64 * unroll;
    let mut stores = Vec::new();
    for (b, t) in (0..grid as i64).flat_map(|b| (0..block as i64).map(move |t| (b, t))) {
        let mut base = b * chunk;
        if base >= words {
            continue;
        }
        // The last copy whose start is at most the thread's first word.
        let (mut ci, mut hi) = (0usize, n);
        while hi - ci > 1 {
            let mid = (ci + hi) / 2;
            if start[mid] <= base + t {
                ci = mid;
            } else {
                hi = mid;
            }
        }
        while base < words {
            let g0 = base + t;
            for k in 0..unroll {
                let g = g0 + k * block as i64;
                if g >= words {
                    continue;
                }
                while g >= start[ci + 1] {
                    ci += 1;
                }
                let t = &c[ci];
                let per_row = t[2] as u32;
                let local = (g - start[ci]) as u32;
                let row = local / per_row;
                let col = local - row * per_row;
                let b = t[6];
                assert!(matches!(b, 1 | 4 | 16), "a word of {b} bytes");
                let src = t[0] + row as i64 * t[4] + col as i64 * b;
                let dst = t[1] + row as i64 * t[5] + col as i64 * b;
                assert!(src % b == 0 && dst % b == 0, "a {b}-byte word at {src:#x} -> {dst:#x}: the device faults on it");
                stores.push((dst as u64, mem[src as usize..(src + b) as usize].to_vec()));
            }
            base += grid as i64 * chunk;
        }
    }
    stores
}

/// Bytes of `copies`' destination (or source) rows, each once.
fn rows_of(c: &[i64; 7], dst: bool) -> impl Iterator<Item = u64> {
    let (base, pitch) = if dst { (c[1], c[5]) } else { (c[0], c[4]) };
    let width = c[2] * c[6];
    (0..c[3]).flat_map(move |r| (0..width).map(move |x| (base + r * pitch + x) as u64))
}

/// Runs a recorder's log of table launches on `mem` with [`kernel_stores`]
/// at `grid` (None: the grid the launch was given), checking each launch:
/// every destination byte of each of its copies is stored exactly once,
/// nothing else is stored, and every load reads a source row of the table.
/// Stores go to memory in reverse order, so that copies wrongly put in one
/// table (one writing what another reads or writes) come out different from
/// running them in order.
fn run_log(log: &[MemOp], mem: &mut [u8], grid: Option<(u32, u32)>) {
    for op in log {
        let MemOp::Launch { f: "copy_table" | "copy_table_small", grid: (gx, 1, 1), block, head: Some(head), .. } = op else {
            assert!(matches!(op, MemOp::Record { .. }), "only table launches in these batches: {op:?}");
            continue;
        };
        let (gx, block) = grid.unwrap_or((*gx, *block));
        let (table, _) = parse_table(head);
        let stores = kernel_stores(head, gx, block, mem);
        let mut count: BTreeMap<u64, u32> = BTreeMap::new();
        for (at, bytes) in &stores {
            for b in 0..bytes.len() as u64 {
                *count.entry(at + b).or_default() += 1;
            }
        }
        let want: BTreeSet<u64> = table.iter().flat_map(|c| rows_of(c, true)).collect();
        if let Some((at, n)) = count.iter().find(|(_, n)| **n != 1) {
            panic!("byte {at:#x} stored {n} times by one launch (grid {gx}, block {block}): {table:?}");
        }
        let got: BTreeSet<u64> = count.keys().copied().collect();
        if got != want {
            let missing = want.difference(&got).next();
            let extra = got.difference(&want).next();
            panic!(
                "the launch (grid {gx}, block {block}) stores {} bytes for {} destination bytes; first missing {missing:?}, first extra {extra:?}: {table:?}",
                got.len(),
                want.len()
            );
        }
        for (at, bytes) in stores.iter().rev() {
            mem[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
        }
    }
}

/// Every byte of every copy is moved exactly once and batches equal their
/// copies run one after another, over random batches on CUDA's and HIP's
/// tables: rows of 1 to 300 bytes (words of 16, 4 and 1 bytes from the
/// addresses', pitches' and widths' alignment; the emulation refuses a word
/// the device would fault on), pitches wider than rows and less aligned,
/// and copies that read what an earlier one writes or write over it (they
/// must land in later tables). Each launch is run with its own grid and
/// with grids of one to three blocks of 256 and 7 of 32 threads, so that
/// blocks take many chunks and chunks straddle copies.
#[test]
fn table_launches_move_every_byte_once_and_keep_batch_order() {
    const MEM: usize = 1 << 16;
    let mut seed = 5u64;
    let mut next_u = |n: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    let mut tables = 0;
    for round in 0..60 {
        let lds = if round % 2 == 0 { None } else { Some(64 << 10) };
        let n = if round % 5 == 0 { 1 + next_u(120) } else { 1 + next_u(12) };
        let mut copies = Vec::new();
        for _ in 0..n {
            let align = [16u64, 4, 1][next_u(3) as usize];
            let width = (1 + next_u(300 / align)) * align;
            let height = 1 + next_u(6);
            // Mostly as aligned as the rows; one pitch in four only to 4 bytes.
            let pitch = |n: &mut dyn FnMut(u64) -> u64| width + n(3) * if n(4) == 0 { 4 } else { align * 4 };
            let (src_pitch, dst_pitch) = (pitch(&mut next_u), pitch(&mut next_u));
            let span = |p: u64| (height - 1) * p + width;
            // Sources mostly in the low half, destinations in the high
            // half; one copy in six reads from the high half instead.
            let src_half = if next_u(6) == 0 { MEM as u64 / 2 } else { 0 };
            let src = src_half + next_u((MEM as u64 / 2 - span(src_pitch)) / align) * align;
            let dst = MEM as u64 / 2 + next_u((MEM as u64 / 2 - span(dst_pitch)) / align) * align;
            let c = Copy2d { src, src_pitch, dst, dst_pitch, width, height };
            let (s, d) = ((src, src + span(src_pitch)), (dst, dst + span(dst_pitch)));
            if s.0 < d.1 && d.0 < s.1 {
                continue; // a copy onto itself has no order to keep
            }
            copies.push(c);
        }
        let mut reference: Vec<u8> = (0..MEM).map(|i| (i * 7 + i / 251) as u8).collect();
        let init = reference.clone();
        for c in &copies {
            for r in 0..c.height {
                let (s, d) = ((c.src + r * c.src_pitch) as usize, (c.dst + r * c.dst_pitch) as usize);
                reference.copy_within(s..s + c.width as usize, d);
            }
        }
        let (mem, rec) = memory_on(lds);
        // SAFETY: the recorder only logs these (loose).
        unsafe { mem.copy(&copies) }.unwrap();
        let log = rec.state().log.clone();
        tables += log.iter().filter(|o| matches!(o, MemOp::Launch { .. })).count();
        for grid in [None, Some((1, 256)), Some((2, 256)), Some((3, 256)), Some((7, 32))] {
            let mut got = init.clone();
            run_log(&log, &mut got, grid);
            if let Some(at) = got.iter().zip(&reference).position(|(a, b)| a != b) {
                panic!("round {round}, grid {grid:?}: byte {at:#x} is {}, want {} (copies {copies:?})", got[at], reference[at]);
            }
        }
    }
    assert!(tables > 120, "the batches take several tables each: {tables}");
}

/// A backend with layer marks and device memory on one recorder, as a role
/// has them: the backend on stream 0, the memory's host access on stream 1,
/// its copy streams 2 to 9. Device-to-device copies are only logged.
fn marked() -> (GpuBackend<Recorder>, DeviceMem<Recorder>, Recorder) {
    let (be, rec) = backend(None, false);
    let be = crate::gpu::ops::with_layer_marks(be);
    rec.state().loose = true;
    let mem = DeviceMem::new(rec.with_new_stream().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    rec.state().log.clear();
    (be, mem, rec)
}

/// Streaming a stage's layers on a device: each layer's copies are queued
/// after a device-side wait on the event recorded on the backend's stream
/// after that layer's work (in the log: the layer's launch on stream 0, the
/// event's record on stream 0, then, on the copy stream, the wait on exactly
/// that record before the copy's launch), and the host never synchronizes
/// the backend's stream for it.
#[test]
fn a_layers_copies_wait_on_the_device_for_the_mark_after_its_compute() {
    let (be, mem, rec) = marked();
    let src = buf(&be, 64, 1.0);
    let mut dst = buf(&be, 64, 0.0);
    rec.state().log.clear();
    for layer in 0..4u64 {
        // The layer's compute, then its mark, then its copies.
        be.add_inplace(&mut dst, &src).unwrap();
        let mark = Backend::mark_layer(&be).unwrap().expect("a device backend with marks gives one");
        // SAFETY: the recorder only logs device-to-device copies.
        unsafe { mem.copy_after(&[row(0x1000 + layer * 256, 0x9000 + layer * 256, 256)], &[mark]) }.unwrap();
    }
    let log = rec.state().log.clone();
    assert!(!log.iter().any(|op| matches!(op, MemOp::Sync { .. })), "a host synchronize while streaming layers: {log:#?}");
    let mut records_on_0 = 0u64;
    let mut layers = 0;
    let mut computed_since_record = false;
    let mut last_record: Option<(u64, u64)> = None; // (fence, place)
    let mut waited: Option<usize> = None; // the copy stream that waited for the last record
    for (i, op) in log.iter().enumerate() {
        match op {
            MemOp::Launch { stream: 0, f, .. } => {
                assert_eq!(*f, "add_inplace", "entry {i}");
                computed_since_record = true;
            }
            MemOp::Record { stream: 0, fence } => {
                assert!(computed_since_record, "entry {i}: a mark recorded before its layer's compute");
                records_on_0 += 1;
                computed_since_record = false;
                last_record = Some((*fence, records_on_0));
                waited = None;
            }
            MemOp::Wait { stream, fence, on } => {
                let (f, place) = last_record.unwrap_or_else(|| panic!("entry {i}: a wait before any mark"));
                assert_eq!((*fence, *on), (f, (0, place)), "entry {i}: the copy stream waits on another record than its layer's mark");
                assert!(*stream >= 2, "entry {i}: the wait is on stream {stream}, not a copy stream");
                waited = Some(*stream);
            }
            MemOp::Launch { stream, f: "copy_table" | "copy_table_small", .. } => {
                assert_eq!(waited, Some(*stream), "entry {i}: layer {layers}'s copies launched on stream {stream} without a device wait on its mark");
                layers += 1;
            }
            _ => {}
        }
    }
    assert_eq!((layers, records_on_0), (4, 4));
}

/// A backend's mark events are recorded again once their work has run: over
/// many passes of a stage's layers (the device catching up between passes)
/// the backend holds as many events as one pass's layers, not one per layer
/// ever marked; and a mark whose event was recorded again for a later layer
/// was complete, so copies after it wait for nothing, while a mark never
/// given out is refused.
#[test]
fn mark_events_are_reused_and_bounded_over_many_passes() {
    let (be, mem, rec) = marked();
    let layers = 6;
    let mut first = None;
    for _pass in 0..50 {
        for _ in 0..layers {
            let m = Backend::mark_layer(&be).unwrap().unwrap();
            first.get_or_insert(m);
        }
        // The device runs the pass (the engine's end-of-pass synchronize).
        rec.state().run(0);
    }
    assert_eq!(be.mark_events(), layers, "events held after 50 passes of {layers} layers");
    // The host running ahead of the device: one event a mark not yet run.
    for _ in 0..3 * layers {
        Backend::mark_layer(&be).unwrap().unwrap();
    }
    assert_eq!(be.mark_events(), 3 * layers);
    rec.state().log.clear();
    // SAFETY: the recorder only logs device-to-device copies.
    unsafe { mem.copy_after(&[row(0x1000, 0x9000, 256)], &[first.unwrap()]) }.unwrap();
    assert!(!rec.state().log.iter().any(|op| matches!(op, MemOp::Wait { .. })), "a wait on a mark long complete");
    // SAFETY: as above.
    let bogus = unsafe { mem.copy_after(&[row(0x1000, 0x9000, 256)], &[crate::region::StreamMark(u64::MAX)]) };
    assert!(bogus.unwrap_err().to_string().contains("never recorded"));
    // A dropped backend's events go with it, after their work.
    let clone = be.clone();
    drop(be);
    assert_eq!(clone.mark_events(), 3 * layers, "a clone keeps the events");
}

/// Without marks (a backend opened without them) `mark_layer` gives none, as
/// on the CPU, and copies with no mark queue no wait.
#[test]
fn a_backend_without_marks_gives_none_and_copies_wait_for_nothing() {
    let (be, rec) = backend(None, false);
    assert_eq!(Backend::mark_layer(&be).unwrap(), None);
    assert_eq!(Backend::mark_layer(&crate::CpuBackend::new()).unwrap(), None);
    rec.state().loose = true;
    let mem = DeviceMem::new(rec.with_new_stream().unwrap()).unwrap();
    rec.state().log.clear();
    // SAFETY: the recorder only logs device-to-device copies.
    unsafe { mem.copy_after(&[row(0x1000, 0x9000, 256)], &[]) }.unwrap();
    assert!(!rec.state().log.iter().any(|op| matches!(op, MemOp::Wait { .. })));
}
