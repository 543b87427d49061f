//! Device memory for regions (`DeviceMem`, `gpu/ops/memory.rs`) through the
//! recording driver: the calls a few copy batches become, held against
//! records worked out by hand from CUDA's `gpu/cuda_memory.rs` as it was
//! before it moved onto the seam (8e1a783: the `copy_table` launches, grids,
//! tables and copy-engine calls it made, in its order, on its round robin of
//! streams), the tickets' events, the allocations, and the table's bytes
//! against `hk_copy_table` in memcopy.hip.

use super::*;
use crate::gpu::ops::memory::{CopyTable, DeviceMem};
use crate::region::{Copy2d, CopyTicket, DeviceMemory, TABLE_COPIES};

/// Memory on a fresh recorder whose made-up addresses are only logged: host
/// access on stream 0, copy streams 1 to 8.
fn memory() -> (DeviceMem<Recorder>, Recorder) {
    let rec = Recorder::new(None, false);
    rec.state().loose = true;
    let mem = DeviceMem::new(rec.clone()).unwrap_or_else(|e| panic!("{e}"));
    rec.state().log.clear();
    (mem, rec)
}

fn row(src: u64, dst: u64, width: u64) -> Copy2d {
    Copy2d { src, src_pitch: width, dst, dst_pitch: width, width, height: 1 }
}

/// A `copy_table` table's bytes, laid out by hand as hk_copy_table's C
/// layout: 48 rows of 7 i64 (src, dst, words per row, height, src pitch, dst
/// pitch, word bytes), then 49 i64 starts, then n and a pad as i32.
fn table(rows: &[[i64; 7]], start: &[i64]) -> Vec<u8> {
    let mut b = vec![0u8; 3088];
    for (i, r) in rows.iter().enumerate() {
        for (k, v) in r.iter().enumerate() {
            b[i * 56 + k * 8..][..8].copy_from_slice(&v.to_le_bytes());
        }
    }
    for (j, v) in start.iter().enumerate() {
        b[2688 + j * 8..][..8].copy_from_slice(&v.to_le_bytes());
    }
    b[3080..3084].copy_from_slice(&(rows.len() as i32).to_le_bytes());
    b
}

fn launch(stream: usize, grid: u32, rows: &[[i64; 7]], start: &[i64]) -> MemOp {
    MemOp::Launch { stream, f: "copy_table", grid: (grid, 1, 1), block: 256, smem: 0, head: Some(table(rows, start)) }
}

/// Compares two logs entry by entry, naming the first that differs (a table
/// by its first differing field).
fn same_log(got: &[MemOp], want: &[MemOp]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if let (MemOp::Launch { head: Some(gh), .. }, MemOp::Launch { head: Some(wh), .. }) = (g, w)
            && gh != wh
        {
            let at = gh.iter().zip(wh).position(|(a, b)| a != b).unwrap_or(gh.len().min(wh.len()));
            let field = if at < 2688 {
                format!("c[{}][{}]", at / 56, at % 56 / 8)
            } else if at < 3080 {
                format!("start[{}]", (at - 2688) / 8)
            } else {
                "n".into()
            };
            let word = |h: &[u8]| h.get(at / 8 * 8..at / 8 * 8 + 8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()));
            panic!("entry {i} (a copy_table launch): the table's {field} is {:?}, want {:?}", word(gh), word(wh));
        }
        assert_eq!(g, w, "entry {i}");
    }
    assert_eq!(got.len(), want.len(), "{} calls, want {}: {:?}", got.len(), want.len(), &got[want.len().min(got.len())..]);
}

/// Nine batches: tables split where copies conflict and at 48 copies, words
/// of 16, 4 and 1 bytes, empty copies left out, a 256 MiB contiguous copy and
/// a row of 2^31 one-byte words on the copy engines (the table copies before
/// each queued first), a copy of 2^32 words in two tables' rows, grids
/// clamped at 4096 blocks, an empty batch that still records its event, and
/// batches going round the eight copy streams.
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
            4096,
            &[[4 << 40, 5 << 40, 64, 1 << 25, 2048, 2048, 16], [(4 << 40) + (1 << 36), (5 << 40) + (1 << 36), 64, 1 << 25, 2048, 2048, 16]],
            &[0, 1 << 31, 1 << 32],
        ),
        MemOp::Record { stream: 2, fence: 2 },
    ];
    let rows48: Vec<[i64; 7]> = (0..48).map(|i| [0x7000_0000 + i * 64, 0x8000_0000 + i * 64, 4, 1, 64, 64, 16]).collect();
    let start48: Vec<i64> = (0..=48).map(|i| i * 4).collect();
    want.push(launch(3, 1, &rows48, &start48));
    want.push(launch(
        3,
        1,
        &[[0x7000_0000 + 48 * 64, 0x8000_0000 + 48 * 64, 4, 1, 64, 64, 16], [0x7000_0000 + 49 * 64, 0x8000_0000 + 49 * 64, 4, 1, 64, 64, 16]],
        &[0, 4, 8],
    ));
    want.push(MemOp::Record { stream: 3, fence: 3 });
    for (stream, fence) in [(4, 4), (5, 5), (6, 6), (7, 7), (8, 8), (1, 9)] {
        want.push(MemOp::Record { stream, fence });
    }
    same_log(&rec.state().log, &want);
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

/// The C layout of `struct hk_copy_table` in memcopy.hip, read from the
/// source: each field's name, byte offset and element count (i64 or int).
fn hk_copy_table() -> (usize, Vec<(String, usize, usize, usize)>) {
    let src = crate::gpu::HIP_SOURCES.iter().find(|(n, _)| *n == "memcopy.hip").unwrap().1;
    let copies: usize = src.lines().find_map(|l| l.trim().strip_prefix("#define CT_COPIES ")).unwrap().trim().parse().unwrap();
    let body = &src[src.find("struct hk_copy_table {").unwrap()..];
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
                let e = d.trim_end_matches(']').replace("CT_COPIES", &copies.to_string());
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

/// The table `copy_table` is launched with has hk_copy_table's size, and each
/// field of the source's struct holds, at its offset, what the copies say.
#[test]
fn the_table_argument_is_hk_copy_table_byte_for_byte() {
    let (size, fields) = hk_copy_table();
    let names: Vec<&str> = fields.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(names, ["c", "start", "n", "pad"]);
    assert_eq!((size, std::mem::size_of::<CopyTable>()), (3088, 3088));
    assert_eq!(fields[0].3, TABLE_COPIES * 7, "CT_COPIES is TABLE_COPIES");
    let copies = [Copy2d { src: 0x1000, src_pitch: 64, dst: 0x9000, dst_pitch: 128, width: 48, height: 3 }, row(0x5001, 0x6000, 5)];
    let (t, words) = CopyTable::of(&copies);
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
    assert_eq!((at("n", 0), at("pad", 0)), (2, 0));
    assert!((14..TABLE_COPIES * 7).all(|k| at("c", k) == 0));
    let sig = crate::gpu::step_gpu::tests::signature(&crate::gpu::device_program(), "copy_table").unwrap();
    assert_eq!(sig, [Kind::S], "copy_table takes the table alone, by value");
}
