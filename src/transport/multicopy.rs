//! One copy of many batches at once: the in-host transports' `submit_all`.
//!
//! A hand-off reads one producer region for several consumers: under
//! token-interleaved DCP, each decode rank takes every DCP-th MLA row, so the
//! batch for one rank reads 1,152-byte rows at a 9,216-byte stride. Copied batch
//! by batch, every batch walks the whole source with gaps, and the prefetcher and
//! the DRAM pages gain little from it: on the 2-core machine such a copy runs at
//! about half the rate of a contiguous one. Copied together, the pieces of every
//! batch that reads one source go in source order, so the source is read once,
//! front to back, and the destinations are written as a few streams.
//!
//! The work is cut into windows of the source (`WINDOW` bytes of source offsets,
//! a rayon task each); inside a window, the pieces of all its batches are sorted
//! by source offset. Pieces keep their destinations, so the result is exactly
//! that of copying the batches one after another whenever no destination byte is
//! written twice; when one is, the batches are copied in order, on this thread.

use super::copy::{PARALLEL_MIN_BYTES, copy_piece, store_fence, streaming_available};
use handoff_components::plan::Descriptor;
use rayon::prelude::*;

/// Source bytes a task covers. Pieces this long or longer are cut into parts of
/// this size, so one long piece cannot hold a thread while the others idle.
const WINDOW: u64 = 512 << 10;

/// One batch of a group: its source and destination (indices into the group's
/// buffers) and its validated descriptors.
#[derive(Clone, Copy)]
pub(crate) struct Batch<'a> {
    pub src: usize,
    pub dst: usize,
    pub descriptors: &'a [Descriptor],
}

/// The part of one descriptor whose pieces start in one source window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    src: usize,
    window: u64,
    dst: usize,
    src_offset: u64,
    dst_offset: u64,
    len: u64,
    count: u64,
    src_stride: u64,
    dst_stride: u64,
}

impl Run {
    fn pieces(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map(|i| (self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride))
    }
}

/// Every non-empty descriptor of `batches`, cut into runs by source window.
fn runs(batches: &[Batch]) -> Vec<Run> {
    let mut out = Vec::new();
    for b in batches {
        for d in b.descriptors.iter().filter(|d| d.len > 0 && d.count > 0) {
            let (count, len) = (d.count as u64, d.len);
            let run = |src_offset: u64, dst_offset: u64, len: u64, count: u64| Run {
                src: b.src,
                window: src_offset / WINDOW,
                dst: b.dst,
                src_offset,
                dst_offset,
                len,
                count,
                src_stride: d.src_stride,
                dst_stride: d.dst_stride,
            };
            if len >= WINDOW {
                for (s, t) in d.pieces() {
                    let mut done = 0;
                    while done < len {
                        let part = (len - done).min(WINDOW);
                        out.push(run(s + done, t + done, part, 1));
                        done += part;
                    }
                }
            } else if count == 1 || d.src_stride == 0 {
                out.push(run(d.src_offset, d.dst_offset, len, count));
            } else {
                let mut i = 0;
                while i < count {
                    let start = d.src_offset + i * d.src_stride;
                    let next_window = (start / WINDOW + 1) * WINDOW;
                    // The first piece that starts in a later window (> i, since
                    // piece i starts before `next_window`).
                    let end = (next_window - d.src_offset).div_ceil(d.src_stride).min(count);
                    out.push(run(start, d.dst_offset + i * d.dst_stride, len, end - i));
                    i = end;
                }
            }
        }
    }
    out
}

/// Whether no destination byte is written twice across all of `batches`:
/// first by each descriptor's extent, and, for a destination whose extents
/// overlap (interleaved strided descriptors), piece by piece.
fn destinations_disjoint(batches: &[Batch], dsts: usize) -> bool {
    let mut extents: Vec<Vec<(u64, u64, usize, usize)>> = vec![Vec::new(); dsts];
    for (bi, b) in batches.iter().enumerate() {
        for (di, d) in b.descriptors.iter().enumerate().filter(|(_, d)| d.len > 0 && d.count > 0) {
            extents[b.dst].push((d.dst_offset, d.dst_end(), bi, di));
        }
    }
    extents.iter_mut().all(|ext| {
        ext.sort_unstable();
        if ext.windows(2).all(|w| w[1].0 >= w[0].1) && ext.iter().all(|&(_, _, bi, di)| own_pieces_disjoint(&batches[bi].descriptors[di])) {
            return true;
        }
        let mut pieces: Vec<(u64, u64)> =
            ext.iter().flat_map(|&(_, _, bi, di)| batches[bi].descriptors[di].pieces().map(move |(_, t)| (t, t + batches[bi].descriptors[di].len))).collect();
        pieces.sort_unstable();
        pieces.windows(2).all(|w| w[1].0 >= w[0].1)
    })
}

/// Whether one descriptor's own pieces are apart in the destination.
fn own_pieces_disjoint(d: &Descriptor) -> bool {
    d.count <= 1 || d.dst_stride >= d.len
}

#[derive(Clone, Copy)]
struct ConstPtr(*const u8);
#[derive(Clone, Copy)]
struct MutPtr(*mut u8);
// SAFETY: sources are only read; each destination byte is written by exactly one
// task (checked by `destinations_disjoint` before the parallel branch runs), and
// the owning borrows outlive the parallel call.
unsafe impl Send for ConstPtr {}
unsafe impl Sync for ConstPtr {}
unsafe impl Send for MutPtr {}
unsafe impl Sync for MutPtr {}

/// Copies every piece of `batches` from `srcs` into `dsts`, with the result of
/// copying the batches one after another, in order. Descriptors must have been
/// validated against the buffers' lengths (re-checked here, a panic on a bug).
pub(crate) fn copy_batches(srcs: &[&[u8]], dsts: &mut [&mut [u8]], batches: &[Batch]) {
    for b in batches {
        for d in b.descriptors.iter().filter(|d| d.len > 0 && d.count > 0) {
            assert!(d.src_end() <= srcs[b.src].len() as u64 && d.dst_end() <= dsts[b.dst].len() as u64, "descriptor out of bounds: {d:?}");
        }
    }
    let total: u64 = batches.iter().flat_map(|b| b.descriptors).map(Descriptor::bytes).sum();
    if total < PARALLEL_MIN_BYTES || rayon::current_num_threads() < 2 || !destinations_disjoint(batches, dsts.len()) {
        for b in batches {
            for d in b.descriptors.iter().filter(|d| d.len > 0) {
                for (s, t) in d.pieces() {
                    let (s, t, n) = (s as usize, t as usize, d.len as usize);
                    dsts[b.dst][t..t + n].copy_from_slice(&srcs[b.src][s..s + n]);
                }
            }
        }
        return;
    }
    let mut runs = runs(batches);
    runs.sort_unstable_by_key(|r| (r.src, r.window));
    let tasks: Vec<&[Run]> = runs.chunk_by(|a, b| (a.src, a.window) == (b.src, b.window)).collect();
    let src_ptrs: Vec<ConstPtr> = srcs.iter().map(|s| ConstPtr(s.as_ptr())).collect();
    let dst_ptrs: Vec<MutPtr> = dsts.iter_mut().map(|d| MutPtr(d.as_mut_ptr())).collect();
    let streaming = streaming_available();
    tasks.par_iter().for_each_init(Vec::new, |order: &mut Vec<(u64, usize, u64, u64)>, task| {
        order.clear();
        for r in task.iter() {
            order.extend(r.pieces().map(|(s, t)| (s, r.dst, t, r.len)));
        }
        // One run's pieces are already in source order; several runs' interleave.
        if task.len() > 1 {
            order.sort_unstable_by_key(|p| p.0);
        }
        let src = src_ptrs[task[0].src];
        for &(s, dst, t, n) in order.iter() {
            // SAFETY: in bounds (asserted above); every destination byte belongs
            // to one piece and so to one task (`destinations_disjoint`); sources
            // and destinations are distinct buffers (a shared and a mutable
            // borrow); `streaming` only where the CPU has AVX2.
            unsafe { copy_piece(src.0.add(s as usize), dst_ptrs[dst].0.add(t as usize), n as usize, streaming) };
        }
        // Streaming stores are weakly ordered: they may still sit in the CPU's
        // write-combining buffers when this task returns, and rayon's completion
        // latch (a release store on x86) does not order them. The fence makes
        // them visible before the task is seen as done, so once `copy_batches`
        // returns, the caller and the peer that reads the region next see them.
        if streaming {
            store_fence();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::copy::tests::pattern;
    use handoff_components::vocab::RegionKind;

    fn strided(src: u64, dst: u64, len: u64, count: u32, src_stride: u64, dst_stride: u64) -> Descriptor {
        Descriptor { kind: RegionKind::MlaKv, src_offset: src, dst_offset: dst, len, count, src_stride, dst_stride }
    }

    /// The batches copied one after another, piece by piece: what `copy_batches`
    /// must equal.
    fn sequential(srcs: &[Vec<u8>], dsts: &mut [Vec<u8>], batches: &[Batch]) {
        for b in batches {
            for d in b.descriptors {
                for (s, t) in d.pieces() {
                    let (s, t, n) = (s as usize, t as usize, d.len as usize);
                    dsts[b.dst][t..t + n].copy_from_slice(&srcs[b.src][s..s + n]);
                }
            }
        }
    }

    fn check(srcs: &[Vec<u8>], dst_lens: &[usize], batches: &[Batch], case: &str) {
        let canary: Vec<Vec<u8>> = dst_lens.iter().enumerate().map(|(i, &n)| pattern(n, 100 + i as u64)).collect();
        let mut want = canary.clone();
        sequential(srcs, &mut want, batches);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a 2-thread pool");
        let mut got = canary.clone();
        pool.install(|| {
            let src_refs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
            let mut dst_refs: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
            copy_batches(&src_refs, &mut dst_refs, batches);
        });
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
                panic!("{case}: destination {k} byte {i} is {:#04x}, want {:#04x}", g[i], w[i]);
            }
        }
    }

    #[test]
    fn interleaved_rows_to_eight_destinations_equal_the_batches_one_by_one() {
        // One source of MLA-like rows (1,152 B, odd base), every 8th row to each of
        // 8 destinations, packed there; plus a long contiguous piece and a strided
        // one crossing many windows, from a second source.
        let rows = 4000u64;
        let src0 = pattern((rows * 1152 + 7) as usize, 1);
        let src1 = pattern(3 << 20, 2);
        let descs: Vec<Vec<Descriptor>> = (0..8u64)
            .map(|w| {
                let count = (rows - w).div_ceil(8) as u32;
                vec![strided(7 + w * 1152, 3, 1152, count, 8 * 1152, 1152)]
            })
            .collect();
        let extra = [strided(5, 0, (2 << 20) + 77, 1, 0, 0), strided(1, (2 << 20) + 100, 3000, 300, 3100, 3001)];
        let mut batches: Vec<Batch> = descs.iter().enumerate().map(|(w, d)| Batch { src: 0, dst: w, descriptors: d }).collect();
        batches.push(Batch { src: 1, dst: 8, descriptors: &extra });
        let mut lens = vec![(rows.div_ceil(8) * 1152 + 3 + 5) as usize; 8];
        lens.push((2 << 20) + 100 + 300 * 3001 + 9);
        let total: u64 = batches.iter().flat_map(|b| b.descriptors).map(Descriptor::bytes).sum();
        assert!(total >= PARALLEL_MIN_BYTES && destinations_disjoint(&batches, lens.len()), "the test must take the parallel branch");
        check(&[src0, src1], &lens, &batches, "interleaved");
    }

    #[test]
    fn interleaved_destinations_that_do_not_overlap_stay_parallel_and_exact() {
        // Two strided descriptors whose extents overlap but whose pieces alternate.
        let src = pattern(4 << 20, 3);
        let a = [strided(0, 0, 1000, 1500, 2000, 2000)];
        let b = [strided(1000, 1000, 1000, 1500, 2000, 2000)];
        let batches = [Batch { src: 0, dst: 0, descriptors: &a }, Batch { src: 0, dst: 0, descriptors: &b }];
        assert!(destinations_disjoint(&batches, 1));
        check(&[src], &[3_000_000 + 11], &batches, "alternating");
    }

    #[test]
    fn a_destination_written_twice_keeps_the_order_of_the_batches() {
        // The second batch overwrites part of the first's destination: the later
        // batch's bytes must win, as with the batches copied one by one.
        let src = pattern(4 << 20, 4);
        let a = [strided(0, 0, 2 << 20, 1, 0, 0)];
        let b = [strided(3 << 20, 1 << 20, 4096, 100, 5000, 4096)];
        let batches = [Batch { src: 0, dst: 0, descriptors: &a }, Batch { src: 0, dst: 0, descriptors: &b }];
        assert!(!destinations_disjoint(&batches, 1));
        check(&[src], &[3 << 20], &batches, "overwrite");
    }

    #[test]
    fn runs_cover_every_piece_once_in_its_own_window() {
        let d = [strided(100, 0, 1152, 2000, 9216, 1152), strided(0, 0, 3 * WINDOW + 5, 1, 0, 0), strided(7, 9, 10, 50, 0, 10)];
        let batches = [Batch { src: 0, dst: 0, descriptors: &d }];
        let rs = runs(&batches);
        let mut covered: Vec<(u64, u64, u64)> = rs
            .iter()
            .flat_map(|r| {
                assert!(r.pieces().all(|(s, _)| s / WINDOW == r.window || r.src_stride == 0), "{r:?} leaves its window");
                r.pieces().map(move |(s, t)| (s, t, r.len)).collect::<Vec<_>>()
            })
            .collect();
        covered.sort_unstable();
        let bytes: u64 = covered.iter().map(|p| p.2).sum();
        assert_eq!(bytes, d.iter().map(Descriptor::bytes).sum::<u64>());
        let mut want: Vec<(u64, u64)> = d[0].pieces().chain(d[2].pieces()).collect();
        want.sort_unstable();
        let strided_pieces: Vec<(u64, u64)> = covered.iter().filter(|p| p.2 == 1152 || p.2 == 10).map(|p| (p.0, p.1)).collect();
        assert_eq!(strided_pieces, want);
    }
}
