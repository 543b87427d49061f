//! The piece copy of the in-host backends: non-temporal (streaming) stores for
//! the pieces of a large batch where the CPU has AVX2, and the fence that makes
//! them visible. [`super::multicopy`] spreads a batch (or many) over rayon.

use super::Piece;

/// Below this many bytes a batch is copied on the calling thread: spreading costs
/// more than it saves.
pub(super) const PARALLEL_MIN_BYTES: u64 = 1 << 20;

/// Pieces at least this long are copied with non-temporal stores in the parallel
/// branch. Shorter ones gain nothing: the aligned head and the tail are most of them.
const STREAM_MIN_BYTES: usize = 256;

/// Whether `copy_piece` may take the streaming path on this CPU.
pub(super) fn streaming_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Makes every non-temporal store issued so far by this thread globally visible.
pub(super) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` is part of SSE, which every x86_64 CPU has; it only orders
    // stores.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Copies `n` bytes, with non-temporal stores when `streaming` and the piece is
/// long enough. Why: glibc's memcpy picks cached stores at these sizes (it sizes its
/// non-temporal threshold from the L3, which this VM reports as 504 MiB), so every
/// destination line is first read for ownership and then evicted again; streaming
/// stores skip the read, which matters most for the MLA rows (1,152 bytes at a
/// 9,216-byte stride). After streaming, call `store_fence` before the bytes are
/// handed to anyone.
///
/// # Safety
/// `src` valid for `n` reads, `dst` valid for `n` writes, the two ranges disjoint,
/// and `streaming` true only if `streaming_available()`.
pub(super) unsafe fn copy_piece(src: *const u8, dst: *mut u8, n: usize, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming && n >= STREAM_MIN_BYTES {
        // SAFETY: the caller's contract, and AVX2 is present (`streaming`).
        unsafe { stream_avx2(src, dst, n) };
        return;
    }
    let _ = streaming;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// Destination alignment of the streaming loop: a whole cache line, so each pair of
/// 32-byte stores fills one write-combining buffer.
#[cfg(target_arch = "x86_64")]
const STREAM_ALIGN: usize = 64;

/// `n` bytes from `src` to `dst`: a cached copy up to a `STREAM_ALIGN`-aligned
/// destination, then 32-byte unaligned loads and aligned streaming stores (four a
/// step, then one), then a cached copy of the tail. Correct for any `n`.
///
/// # Safety
/// `src` valid for `n` reads, `dst` valid for `n` writes, the ranges disjoint, and
/// the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let head = ((STREAM_ALIGN - (dst as usize) % STREAM_ALIGN) % STREAM_ALIGN).min(n);
    // SAFETY: `head <= n`, so within both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut off = head;
    while n - off >= 128 {
        // SAFETY: `off + 128 <= n`, so every load and store is inside the ranges;
        // `dst + off` is 32-byte aligned (it starts on `STREAM_ALIGN` and moves by
        // multiples of 32), as `_mm256_stream_si256` requires; loads are unaligned.
        unsafe {
            let s = src.add(off) as *const __m256i;
            let d = dst.add(off) as *mut __m256i;
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            let c = _mm256_loadu_si256(s.add(2));
            let e = _mm256_loadu_si256(s.add(3));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
        }
        off += 128;
    }
    while n - off >= 32 {
        // SAFETY: `off + 32 <= n`; `dst + off` is 32-byte aligned, as above.
        unsafe { _mm256_stream_si256(dst.add(off) as *mut __m256i, _mm256_loadu_si256(src.add(off) as *const __m256i)) };
        off += 32;
    }
    // SAFETY: `off <= n`, so the last `n - off` bytes are inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), n - off) };
}

/// `src` into `dst` (equal lengths) with the piece copy, streaming where the
/// CPU allows, fenced: the copy limit that the in-host transports run at.
pub(super) fn copy_slice(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    let streaming = streaming_available();
    // SAFETY: equal lengths, distinct buffers (a shared and a mutable borrow);
    // `streaming` only where the CPU has AVX2.
    unsafe { copy_piece(src.as_ptr(), dst.as_mut_ptr(), src.len(), streaming) };
    store_fence();
}

/// Copies validated pieces within one buffer, each with memmove semantics, in order.
pub(crate) fn copy_within(buf: &mut [u8], pieces: &[Piece]) {
    for p in pieces {
        let s = p.src as usize;
        buf.copy_within(s..s + p.len as usize, p.dst as usize);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Bytes that do not repeat within any short window, so a copy shifted by a few
    /// bytes, or one that writes one byte too many or too few, compares unequal.
    pub(in crate::transport) fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    /// The first byte where `got` and `want` differ, with the case that produced it.
    fn check(got: &[u8], want: &[u8], case: &str) {
        if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
            panic!("{case}: destination byte {i} is {:#04x}, want {:#04x}", got[i], want[i]);
        }
        assert_eq!(got.len(), want.len(), "{case}");
    }

    /// Runs `copy_piece` (and, where the CPU has AVX2, the streaming loop itself
    /// with no length floor) from `src[s..s + n]` into `dst[d..d + n]`, and compares
    /// the whole destination buffer, canary bytes included, with `copy_from_slice`.
    fn compare_one(src: &[u8], canary: &[u8], s: usize, d: usize, n: usize) {
        let mut want = canary.to_vec();
        want[d..d + n].copy_from_slice(&src[s..s + n]);
        for streaming in [false, true] {
            if streaming && !streaming_available() {
                continue;
            }
            let mut got = canary.to_vec();
            // SAFETY: both ranges are in bounds of distinct buffers; `streaming` only
            // where available.
            unsafe { copy_piece(src.as_ptr().add(s), got.as_mut_ptr().add(d), n, streaming) };
            store_fence();
            check(&got, &want, &format!("copy_piece(streaming {streaming}) src offset {s}, dst offset {d}, len {n}"));
            #[cfg(target_arch = "x86_64")]
            if streaming {
                let mut got = canary.to_vec();
                // SAFETY: as above; AVX2 is present.
                unsafe { stream_avx2(src.as_ptr().add(s), got.as_mut_ptr().add(d), n) };
                store_fence();
                check(&got, &want, &format!("stream_avx2 src offset {s}, dst offset {d}, len {n}"));
            }
        }
    }

    #[test]
    fn streaming_copy_equals_copy_from_slice_at_every_offset_and_length_to_600() {
        let src = pattern(600 + 128, 1);
        let canary = pattern(600 + 128 + 64, 2);
        // Offsets relative to the start of each buffer; the streaming head depends on
        // the destination's address modulo 64, so the destination sweeps 0..64
        // (whatever the allocation's own alignment, that covers every residue).
        for s in [0, 1, 3, 7, 31, 32, 33, 63, 64, 100] {
            for d in 0..64 {
                for n in 0..=600 {
                    compare_one(&src, &canary, s, d, n);
                }
            }
        }
    }

    #[test]
    fn streaming_copy_equals_copy_from_slice_on_large_pieces() {
        let big = (1 << 20) + 4096;
        let src = pattern(big + 200, 3);
        let canary = pattern(big + 200, 4);
        for n in [1152, 4095, 4096, 4097, 9216 + 17, 65_536 + 37, (1 << 20) + 95, 1 << 20] {
            for (s, d) in [(0, 0), (1, 0), (0, 1), (5, 59), (33, 31), (64, 96), (127, 3)] {
                compare_one(&src, &canary, s, d, n);
            }
        }
    }
}
