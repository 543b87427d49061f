//! The memcpy engine of the in-host backends: sequential semantics, rayon when a
//! batch is large and its destinations are disjoint.

use super::Piece;
use rayon::prelude::*;

/// Below this many bytes a batch is copied on the calling thread: spreading costs
/// more than it saves.
const PARALLEL_MIN_BYTES: u64 = 1 << 20;
/// Work unit for rayon: pieces are grouped (and big ones split) to about this size.
const TASK_BYTES: u64 = 512 << 10;

/// Whether any two destination ranges intersect.
fn dst_overlaps(pieces: &[Piece]) -> bool {
    let mut ranges: Vec<(u64, u64)> = pieces.iter().map(|p| (p.dst, p.dst + p.len)).collect();
    ranges.sort_unstable();
    ranges.windows(2).any(|w| w[1].0 < w[0].1)
}

/// Groups pieces into tasks of about `TASK_BYTES`, splitting big pieces.
fn tasks(pieces: &[Piece]) -> Vec<Vec<Piece>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut cur_bytes = 0;
    for p in pieces {
        let mut done = 0;
        while done < p.len {
            let take = (p.len - done).min(TASK_BYTES - cur_bytes);
            cur.push(Piece { src: p.src + done, dst: p.dst + done, len: take });
            cur_bytes += take;
            done += take;
            if cur_bytes >= TASK_BYTES {
                out.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer is only used for writes to disjoint destination ranges, one
// task each, while the owning `&mut [u8]` is borrowed for the whole parallel call.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Copies validated pieces from `src` into `dst` (distinct buffers).
pub(crate) fn copy_between(src: &[u8], dst: &mut [u8], pieces: &[Piece]) {
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    if total < PARALLEL_MIN_BYTES || rayon::current_num_threads() < 2 || dst_overlaps(pieces) {
        for p in pieces {
            let (s, d, n) = (p.src as usize, p.dst as usize, p.len as usize);
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        }
        return;
    }
    // Bounds were validated against these very slices; re-check cheaply so that a
    // caller bug panics instead of writing out of range.
    for p in pieces {
        assert!(p.src + p.len <= src.len() as u64 && p.dst + p.len <= dst.len() as u64);
    }
    let dst_ptr = SendPtr(dst.as_mut_ptr());
    tasks(pieces).par_iter().for_each(|task| {
        let d = dst_ptr;
        for p in task {
            // SAFETY: in bounds (asserted above); destinations are pairwise disjoint
            // (checked by dst_overlaps), and `src` cannot alias `dst` (a shared and a
            // mutable borrow), so each write races with nothing.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr().add(p.src as usize), d.0.add(p.dst as usize), p.len as usize);
            }
        }
    });
}

/// Copies validated pieces within one buffer, each with memmove semantics, in order.
pub(crate) fn copy_within(buf: &mut [u8], pieces: &[Piece]) {
    for p in pieces {
        let s = p.src as usize;
        buf.copy_within(s..s + p.len as usize, p.dst as usize);
    }
}
