//! Pure planning of the verbs backend: how a region is cut into memory
//! registrations, and how a batch of pieces becomes RDMA WRITE work requests.
//! No verbs here, so all of it is tested on any machine.
//!
//! `ibv_reg_mr` takes a `size_t` but many providers refuse (or silently
//! truncate) a registration of 2 GiB or more, and an `ibv_sge` length is a
//! `u32`. So a region is registered as consecutive chunks of at most
//! [`MAX_MR_CHUNK`] bytes, each its own MR with its own lkey and rkey, and a
//! piece that crosses a chunk boundary on either side is split there into
//! several work requests: one work request addresses one remote MR, and each
//! of its scatter/gather entries one local MR.

use super::super::Piece;

/// The largest chunk one memory registration may cover: 1 GiB, half of the
/// 2 GiB at which providers refuse `ibv_reg_mr`.
pub const MAX_MR_CHUNK: u64 = 1 << 30;
/// Chunks are whole pages, so every MR after the first starts on a page of a
/// page-aligned region.
pub const CHUNK_ALIGN: u64 = 4096;

/// One registered chunk of a region: which bytes of the region it covers,
/// where they are in the owner's address space, and its key (the lkey on the
/// side that owns it, the rkey as a peer sees it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrChunk {
    /// Offset of the chunk's first byte within the region.
    pub offset: u64,
    pub len: u64,
    /// Virtual address of the chunk's first byte in the owning process.
    pub addr: u64,
    pub key: u32,
}

impl MrChunk {
    fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Why a region cannot be chunked, or a batch cannot be turned into work requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("MR chunk of {chunk} B: must be a positive multiple of {CHUNK_ALIGN} B and at most {MAX_MR_CHUNK} B")]
    BadChunk { chunk: u64 },
    #[error("{side} region has no registered chunk for bytes {start}..{end} (registered: {covered} B)")]
    Uncovered { side: &'static str, start: u64, end: u64, covered: u64 },
    #[error("limits {what} = {value}: must be at least 1")]
    BadLimit { what: &'static str, value: u64 },
    #[error("chunk {chunk} starts at byte {offset} of the region, expected {expected}")]
    CoverGap { chunk: usize, offset: u64, expected: u64 },
    #[error("chunk {chunk} is {len} B (1 B to {MAX_MR_CHUNK} B)")]
    CoverChunkLen { chunk: usize, len: u64 },
    #[error("chunk {chunk} at address {addr:#x} wraps the address space")]
    CoverWraps { chunk: usize, addr: u64 },
    #[error("chunks cover {covered} B of a {len}-byte region")]
    CoverShort { covered: u64, len: u64 },
}

/// The `(offset, len)` of each memory registration of a region of `len` bytes
/// cut at `chunk` bytes: consecutive, covering, none empty (a 0-byte region has none).
pub fn mr_chunks(len: u64, chunk: u64) -> Result<Vec<(u64, u64)>, PlanError> {
    if chunk == 0 || chunk > MAX_MR_CHUNK || !chunk.is_multiple_of(CHUNK_ALIGN) {
        return Err(PlanError::BadChunk { chunk });
    }
    let n = len.div_ceil(chunk);
    Ok((0..n).map(|i| (i * chunk, chunk.min(len - i * chunk))).collect())
}

/// Checks that `chunks` cover `0..len` in order without gaps or overlaps: what a
/// peer's key list must satisfy before any write is aimed at it.
pub fn check_cover(chunks: &[MrChunk], len: u64) -> Result<(), PlanError> {
    let mut at = 0u64;
    for (i, c) in chunks.iter().enumerate() {
        if c.offset != at {
            return Err(PlanError::CoverGap { chunk: i, offset: c.offset, expected: at });
        }
        if c.len == 0 || c.len > MAX_MR_CHUNK {
            return Err(PlanError::CoverChunkLen { chunk: i, len: c.len });
        }
        if c.addr.checked_add(c.len).is_none() {
            return Err(PlanError::CoverWraps { chunk: i, addr: c.addr });
        }
        at = c.end();
    }
    if at != len {
        return Err(PlanError::CoverShort { covered: at, len });
    }
    Ok(())
}

/// The index of the chunk that holds byte `offset` (chunks cover the region in order).
// Without the feature only the tests call it.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
fn chunk_at(chunks: &[MrChunk], offset: u64) -> Option<usize> {
    let i = chunks.partition_point(|c| c.end() <= offset);
    (i < chunks.len() && chunks[i].offset <= offset).then_some(i)
}

/// Limits of one queue pair that shape the work requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrLimits {
    /// Scatter/gather entries per work request (the QP's `max_send_sge`).
    pub max_sge: u32,
    /// Bytes of one work request (under the port's `max_msg_sz`; an `ibv_sge`
    /// length is a `u32`).
    pub max_wr_bytes: u64,
}

impl Default for WrLimits {
    fn default() -> Self {
        WrLimits { max_sge: 4, max_wr_bytes: 1 << 30 }
    }
}

/// One local gather entry: an `ibv_sge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// One RDMA WRITE: gather `sges` from local memory, write them back to back
/// at `remote_addr` under `rkey`. `imm` set: an RDMA WRITE WITH IMMEDIATE
/// (the batch's last), which completes a receive on the peer carrying it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRequest {
    pub sges: Vec<Sge>,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: Option<u32>,
}

impl WorkRequest {
    /// Bytes the work request writes.
    pub fn bytes(&self) -> u64 {
        self.sges.iter().map(|s| s.len as u64).sum()
    }
}

/// The work requests of one batch: `pieces` (already bounds-checked against
/// both regions) from the local region registered as `local` into the peer's
/// region registered as `remote`, in piece order.
///
/// Each piece is cut where either side crosses a chunk boundary and at
/// `max_wr_bytes`; consecutive cuts whose remote bytes follow each other in one
/// remote chunk share a work request (up to `max_sge` gather entries, local
/// runs that follow each other in one local chunk share an entry). The last
/// work request carries `imm`; a batch that writes nothing is one 0-byte
/// RDMA WRITE WITH IMMEDIATE, so that its completion still reaches the peer.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn work_requests(pieces: &[Piece], local: &[MrChunk], remote: &[MrChunk], limits: WrLimits, imm: u32) -> Result<Vec<WorkRequest>, PlanError> {
    if limits.max_sge == 0 {
        return Err(PlanError::BadLimit { what: "max_sge", value: 0 });
    }
    if limits.max_wr_bytes == 0 {
        return Err(PlanError::BadLimit { what: "max_wr_bytes", value: 0 });
    }
    let max_wr = limits.max_wr_bytes.min(u32::MAX as u64);
    let covered = |c: &[MrChunk]| c.last().map_or(0, |c| c.end());
    let mut out: Vec<WorkRequest> = Vec::new();
    // Bytes of the work request being filled (`out.last()`), and where its
    // remote bytes end, in (chunk index, region offset): the next cut joins it
    // only there.
    let mut open: Option<(u64, usize, u64)> = None;
    for p in pieces {
        let (mut src, mut dst, mut left) = (p.src, p.dst, p.len);
        while left > 0 {
            let li = chunk_at(local, src).ok_or(PlanError::Uncovered { side: "source", start: src, end: src + left, covered: covered(local) })?;
            let ri = chunk_at(remote, dst).ok_or(PlanError::Uncovered { side: "destination", start: dst, end: dst + left, covered: covered(remote) })?;
            let (l, r) = (local[li], remote[ri]);
            let n_full = left.min(l.end() - src).min(r.end() - dst).min(max_wr);
            let addr = l.addr + (src - l.offset);
            // The open request takes this cut when its remote bytes end where
            // the cut's begin, in the same remote chunk, with room for it.
            let join = match (open, out.last_mut()) {
                (Some((bytes, chunk, end)), Some(wr)) if chunk == ri && end == dst && bytes < max_wr => {
                    let n = n_full.min(max_wr - bytes);
                    let last = wr.sges.len() - 1;
                    let extends = wr.sges[last].lkey == l.key && wr.sges[last].addr + wr.sges[last].len as u64 == addr;
                    if extends {
                        wr.sges[last].len += n as u32;
                        Some((bytes, n))
                    } else if wr.sges.len() < limits.max_sge as usize {
                        wr.sges.push(Sge { addr, len: n as u32, lkey: l.key });
                        Some((bytes, n))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            let n = match join {
                Some((bytes, n)) => {
                    open = Some((bytes + n, ri, dst + n));
                    n
                }
                None => {
                    out.push(WorkRequest {
                        sges: vec![Sge { addr, len: n_full as u32, lkey: l.key }],
                        remote_addr: r.addr + (dst - r.offset),
                        rkey: r.key,
                        imm: None,
                    });
                    open = Some((n_full, ri, dst + n_full));
                    n_full
                }
            };
            src += n;
            dst += n;
            left -= n;
        }
    }
    match out.last_mut() {
        Some(wr) => wr.imm = Some(imm),
        None => {
            // A 0-byte write needs no valid address; the peer's first chunk (or
            // nothing) keeps the request well formed.
            let (remote_addr, rkey) = remote.first().map_or((0, 0), |c| (c.addr, c.key));
            out.push(WorkRequest { sges: Vec::new(), remote_addr, rkey, imm: Some(imm) });
        }
    }
    Ok(out)
}

/// How a batch's work requests are posted to a send queue of `depth`
/// entries: consecutive rounds of at most `depth` requests, the last of each
/// round signaled, so that its completion returns the round's slots (RC
/// completes a send queue in order, so the unsignaled requests before a
/// signaled one are done when it is).
pub fn rounds(requests: usize, depth: u32) -> Vec<std::ops::Range<usize>> {
    let depth = depth.max(1) as usize;
    (0..requests.div_ceil(depth)).map(|i| i * depth..((i + 1) * depth).min(requests)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(src: u64, dst: u64, len: u64) -> Piece {
        Piece { src, dst, len }
    }

    /// Registers a region of `len` bytes at address `base` in chunks of `chunk`, key = 100 + index (or 200 + for the peer).
    fn chunks(len: u64, chunk: u64, base: u64, key0: u32) -> Vec<MrChunk> {
        mr_chunks(len, chunk)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, (offset, len))| MrChunk { offset, len, addr: base + offset, key: key0 + i as u32 })
            .collect()
    }

    /// Replays the work requests on byte arrays (local and remote address
    /// spaces), checking keys against the chunks, as the NIC would.
    fn replay(wrs: &[WorkRequest], local: &[MrChunk], remote: &[MrChunk], src: &[u8], dst: &mut [u8], limits: WrLimits) {
        for (i, wr) in wrs.iter().enumerate() {
            assert!(wr.sges.len() <= limits.max_sge as usize, "request {i} has {} entries", wr.sges.len());
            assert!(wr.bytes() <= limits.max_wr_bytes, "request {i} writes {} B", wr.bytes());
            let r = remote.iter().find(|c| c.key == wr.rkey).expect("rkey of a remote chunk");
            assert!(wr.remote_addr >= r.addr && wr.remote_addr + wr.bytes() <= r.addr + r.len, "request {i} leaves remote chunk {}", r.key);
            let mut at = (wr.remote_addr - r.addr + r.offset) as usize;
            for s in &wr.sges {
                let l = local.iter().find(|c| c.key == s.lkey).expect("lkey of a local chunk");
                assert!(s.addr >= l.addr && s.addr + s.len as u64 <= l.addr + l.len, "entry leaves local chunk {}", l.key);
                let from = (s.addr - l.addr + l.offset) as usize;
                dst[at..at + s.len as usize].copy_from_slice(&src[from..from + s.len as usize]);
                at += s.len as usize;
            }
        }
    }

    fn naive(pieces: &[Piece], src: &[u8], dst: &mut [u8]) {
        for p in pieces {
            dst[p.dst as usize..(p.dst + p.len) as usize].copy_from_slice(&src[p.src as usize..(p.src + p.len) as usize]);
        }
    }

    #[test]
    fn mr_chunks_cover_a_region_in_pieces_of_at_most_the_chunk() {
        assert_eq!(mr_chunks(0, 4096).unwrap(), vec![]);
        assert_eq!(mr_chunks(4096, 4096).unwrap(), vec![(0, 4096)]);
        assert_eq!(mr_chunks(10_000, 4096).unwrap(), vec![(0, 4096), (4096, 4096), (8192, 1808)]);
        // A 5 GiB region under the default chunk: five MRs of 1 GiB, none at the 2 GiB limit.
        let big = mr_chunks(5 << 30, MAX_MR_CHUNK).unwrap();
        assert_eq!(big.len(), 5);
        assert!(big.iter().all(|&(_, l)| l == 1 << 30));
        assert_eq!(mr_chunks(5 << 30 | 1, MAX_MR_CHUNK).unwrap().last(), Some(&(5 << 30, 1)));
    }

    #[test]
    fn mr_chunks_refuse_chunks_at_or_over_the_limit_or_off_page() {
        for bad in [0, 100, 4097, 2 << 30, MAX_MR_CHUNK + 4096] {
            assert_eq!(mr_chunks(1 << 20, bad), Err(PlanError::BadChunk { chunk: bad }), "{bad}");
        }
    }

    #[test]
    fn a_piece_within_one_chunk_is_one_write_with_immediate() {
        let (l, r) = (chunks(8192, 4096, 0x1000_0000, 100), chunks(8192, 4096, 0x7000_0000, 200));
        let wrs = work_requests(&[piece(16, 32, 100)], &l, &r, WrLimits::default(), 7).unwrap();
        assert_eq!(wrs, vec![WorkRequest { sges: vec![Sge { addr: 0x1000_0010, len: 100, lkey: 100 }], remote_addr: 0x7000_0020, rkey: 200, imm: Some(7) }]);
    }

    #[test]
    fn a_piece_across_a_remote_chunk_boundary_is_split_into_two_writes() {
        let (l, r) = (chunks(16384, 16384, 0x1000_0000, 100), chunks(16384, 4096, 0x7000_0000, 200));
        let wrs = work_requests(&[piece(0, 4000, 200)], &l, &r, WrLimits::default(), 1).unwrap();
        assert_eq!(wrs.len(), 2);
        assert_eq!((wrs[0].rkey, wrs[0].remote_addr, wrs[0].bytes(), wrs[0].imm), (200, 0x7000_0000 + 4000, 96, None));
        assert_eq!((wrs[1].rkey, wrs[1].remote_addr, wrs[1].bytes(), wrs[1].imm), (201, 0x7000_0000 + 4096, 104, Some(1)));
    }

    #[test]
    fn a_piece_across_a_local_chunk_boundary_is_one_write_of_two_entries() {
        let (l, r) = (chunks(16384, 4096, 0x1000_0000, 100), chunks(16384, 16384, 0x7000_0000, 200));
        let wrs = work_requests(&[piece(4000, 0, 200)], &l, &r, WrLimits::default(), 1).unwrap();
        assert_eq!(wrs.len(), 1);
        assert_eq!(wrs[0].sges, vec![Sge { addr: 0x1000_0000 + 4000, len: 96, lkey: 100 }, Sge { addr: 0x1000_1000, len: 104, lkey: 101 }]);
        // With one entry per request the same piece is two requests.
        let one = work_requests(&[piece(4000, 0, 200)], &l, &r, WrLimits { max_sge: 1, ..WrLimits::default() }, 1).unwrap();
        assert_eq!(one.len(), 2);
    }

    #[test]
    fn gathers_into_one_remote_run_share_a_request_up_to_max_sge() {
        let (l, r) = (chunks(1 << 16, 1 << 16, 0x1000_0000, 100), chunks(1 << 16, 1 << 16, 0x7000_0000, 200));
        // Eight 64-byte pieces from every other 64 bytes into one contiguous run.
        let ps: Vec<Piece> = (0..8).map(|i| piece(i * 128, 1024 + i * 64, 64)).collect();
        let wrs = work_requests(&ps, &l, &r, WrLimits { max_sge: 3, max_wr_bytes: 1 << 30 }, 9).unwrap();
        assert_eq!(wrs.iter().map(|w| w.sges.len()).collect::<Vec<_>>(), vec![3, 3, 2]);
        // Local runs that follow each other merge into one entry.
        let ps: Vec<Piece> = (0..8).map(|i| piece(i * 64, 1024 + i * 64, 64)).collect();
        let wrs = work_requests(&ps, &l, &r, WrLimits { max_sge: 1, max_wr_bytes: 1 << 30 }, 9).unwrap();
        assert_eq!(wrs.len(), 1);
        assert_eq!(wrs[0].sges, vec![Sge { addr: 0x1000_0000, len: 512, lkey: 100 }]);
    }

    #[test]
    fn no_request_exceeds_max_wr_bytes() {
        let (l, r) = (chunks(1 << 20, 1 << 20, 0, 100), chunks(1 << 20, 1 << 20, 1 << 40, 200));
        let limits = WrLimits { max_sge: 4, max_wr_bytes: 1000 };
        let wrs = work_requests(&[piece(0, 0, 5500)], &l, &r, limits, 3).unwrap();
        assert_eq!(wrs.iter().map(WorkRequest::bytes).collect::<Vec<_>>(), vec![1000, 1000, 1000, 1000, 1000, 500]);
    }

    #[test]
    fn an_empty_batch_is_one_zero_byte_write_with_immediate() {
        let r = chunks(4096, 4096, 0x7000_0000, 200);
        let wrs = work_requests(&[], &[], &r, WrLimits::default(), 42).unwrap();
        assert_eq!(wrs, vec![WorkRequest { sges: vec![], remote_addr: 0x7000_0000, rkey: 200, imm: Some(42) }]);
    }

    #[test]
    fn bytes_outside_the_registered_chunks_are_refused() {
        let (l, r) = (chunks(4096, 4096, 0, 100), chunks(4096, 4096, 1 << 40, 200));
        let e = work_requests(&[piece(0, 4000, 200)], &l, &r, WrLimits::default(), 1).unwrap_err();
        assert_eq!(e, PlanError::Uncovered { side: "destination", start: 4096, end: 4200, covered: 4096 });
        assert!(work_requests(&[piece(0, 0, 1)], &l, &r, WrLimits { max_sge: 0, max_wr_bytes: 1 }, 1).is_err());
    }

    /// Invariant: for any chunking of either side, any limits and any pieces,
    /// replaying the work requests writes exactly what a naive copy writes,
    /// every request stays in one remote chunk and every entry in one local
    /// chunk, within the limits, and only the last carries the immediate.
    #[test]
    fn work_requests_write_what_a_naive_copy_writes_for_any_chunking() {
        use proptest::prelude::*;
        let len = 1u64 << 15;
        let strat = (1u64..=4, 1u64..=4, 1u32..=4, prop_oneof![Just(u64::MAX), 1u64..5000], proptest::collection::vec((0..len, 0..len, 1u64..6000), 0..24));
        proptest!(ProptestConfig::with_cases(400), |((lc, rc, max_sge, max_wr_bytes, raw) in strat)| {
            let l = chunks(len, lc * 4096, 0x10_0000, 100);
            let r = chunks(len, rc * 4096, 0x90_0000, 500);
            let ps: Vec<Piece> = raw.iter().map(|&(s, d, n)| piece(s.min(len - 1), d.min(len - 1), n.min(len - s.min(len - 1)).min(len - d.min(len - 1)))).collect();
            let limits = WrLimits { max_sge, max_wr_bytes };
            let wrs = work_requests(&ps, &l, &r, limits, 77).unwrap();
            let src: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
            let (mut got, mut want) = (vec![0u8; len as usize], vec![0u8; len as usize]);
            replay(&wrs, &l, &r, &src, &mut got, limits);
            naive(&ps, &src, &mut want);
            prop_assert!(got == want, "bytes differ at {:?}", got.iter().zip(&want).position(|(a, b)| a != b));
            prop_assert_eq!(wrs.iter().filter(|w| w.imm.is_some()).count(), 1);
            prop_assert_eq!(wrs.last().and_then(|w| w.imm), Some(77));
            let total: u64 = ps.iter().map(|p| p.len).sum();
            prop_assert_eq!(wrs.iter().map(WorkRequest::bytes).sum::<u64>(), total);
        });
    }

    #[test]
    fn rounds_fill_the_send_queue_and_cover_every_request_once() {
        assert!(rounds(0, 16).is_empty());
        assert_eq!(rounds(5, 16), vec![0..5]);
        assert_eq!(rounds(33, 16), vec![0..16, 16..32, 32..33]);
        assert_eq!(rounds(3, 0), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn check_cover_refuses_gaps_overlaps_and_short_lists() {
        let c = chunks(10_000, 4096, 0x1000, 1);
        assert_eq!(check_cover(&c, 10_000), Ok(()));
        assert!(check_cover(&c, 10_001).unwrap_err().to_string().contains("cover 10000 B"));
        let mut gap = c.clone();
        gap[1].offset += 1;
        assert!(check_cover(&gap, 10_000).unwrap_err().to_string().contains("chunk 1 starts"));
        let mut huge = c.clone();
        huge[0].len = 3 << 30;
        assert!(check_cover(&huge, 10_000).is_err());
        let mut wraps = c;
        wraps[2].addr = u64::MAX - 10;
        assert!(check_cover(&wraps, 10_000).unwrap_err().to_string().contains("wraps"));
    }
}
