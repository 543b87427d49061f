//! Executing plans with a write count: every copy inside its regions, every
//! destination byte written at most once, then the copies themselves.
//!
//! A staged group ([`StagedRows`]) is run token row by token row from the DCP rule
//! of docs/design.md section 4 (local position `lp` of dcp rank `d` is token
//! `(lp / S) S dcp + d S + lp % S`) and the two block tables the group carries, not
//! through the pieces the transports cut it into: what lands where is then the
//! oracle's own reading of the group, and [`super::check_consumer`] judges the bytes.

use super::{Memory, global_of_local};
use handoff_components::plan::{Plan, StagedRows, StagedWrite};
use handoff_components::vocab::{DecodeRank, RankId, RegionKind};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Counts of an [`execute_counted`] run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecStats {
    pub descriptors: u64,
    /// Staged writes: one per staging buffer of a staged group.
    pub staged_writes: u64,
    /// Contiguous pieces copied (a strided descriptor has `count`; a staged write
    /// one per token row).
    pub pieces: u64,
    pub bytes: u64,
    /// Bytes written per (consumer, kind).
    pub written: BTreeMap<(DecodeRank, RegionKind), u64>,
}

/// Why [`execute_counted`] refused the plans. `plan` and `desc` index `plans` and the
/// plan's descriptors; `group` and `write` a plan's staged groups and a group's writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecError {
    /// `len` or `count` is zero.
    Empty { plan: usize, desc: usize, len: u64, count: u32 },
    /// The plan names a region that is not in memory.
    MissingRegion { rank: RankId, kind: RegionKind },
    /// A descriptor reads (`side` = "source") or writes ("destination") outside its region.
    OutOfBounds { plan: usize, desc: usize, side: &'static str, rank: RankId, kind: RegionKind, end: Option<u64>, region_len: u64 },
    /// A destination byte is written twice: first by `first`, again by `second`,
    /// each (plan, write). A plan's writes are numbered descriptors first, then its
    /// staged writes group by group.
    DoubleWrite { rank: RankId, kind: RegionKind, offset: u64, first: (usize, usize), second: (usize, usize) },
    /// A staged group that names no position: a zero size, a dcp rank outside its
    /// instance, or a write that is empty or names a row the group lacks.
    StagedShape { plan: usize, group: usize, reason: BadShape },
    /// A staged write holds more bytes than the staging buffer it was cut for.
    StagedTooLarge { plan: usize, group: usize, write: usize, bytes: u64, staging: u64 },
    /// A staged write's local position that has no token row: past the request's
    /// tokens, past a block table, or at an address past u64.
    StagedPosition { plan: usize, group: usize, write: usize, position: u64, reason: &'static str },
    /// A staged write's token row read (`side` = "source") or landed ("destination")
    /// outside its region.
    StagedOutOfBounds { plan: usize, group: usize, write: usize, side: &'static str, rank: RankId, kind: RegionKind, end: u64, region_len: u64 },
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExecError::Empty { plan, desc, len, count } => {
                write!(f, "plan {plan} descriptor {desc}: empty copy (len {len}, count {count})")
            }
            ExecError::MissingRegion { rank, kind } => write!(f, "{rank} has no {kind} region in memory"),
            ExecError::OutOfBounds { plan, desc, side, rank, kind, end, region_len } => match end {
                Some(e) => write!(f, "plan {plan} descriptor {desc}: {side} {rank} {kind} range ends at {e}, past the region's {region_len} bytes"),
                None => write!(f, "plan {plan} descriptor {desc}: {side} {rank} {kind} range overflows u64 (region {region_len} bytes)"),
            },
            ExecError::DoubleWrite { rank, kind, offset, first, second } => write!(
                f,
                "{rank} {kind} byte {offset} written twice: by plan {} write {} and again by plan {} write {} (descriptors first, then staged writes)",
                first.0, first.1, second.0, second.1
            ),
            ExecError::StagedShape { plan, group, reason } => write!(f, "plan {plan} staged group {group}: {reason}"),
            ExecError::StagedTooLarge { plan, group, write, bytes, staging } => {
                write!(f, "plan {plan} staged group {group} write {write}: {bytes} B, past its {staging} B staging buffer")
            }
            ExecError::StagedPosition { plan, group, write, position, reason } => {
                write!(f, "plan {plan} staged group {group} write {write}: local position {position} {reason}")
            }
            ExecError::StagedOutOfBounds { plan, group, write, side, rank, kind, end, region_len } => {
                write!(f, "plan {plan} staged group {group} write {write}: a {side} row of {rank} {kind} ends at {end}, past the region's {region_len} bytes")
            }
        }
    }
}

impl std::error::Error for ExecError {}

/// One past the last byte of a strided range, or `None` on overflow.
fn range_end(off: u64, stride: u64, count: u32, len: u64) -> Option<u64> {
    (count as u64 - 1).checked_mul(stride)?.checked_add(off)?.checked_add(len)
}

/// Sets bits `[a, b)`; returns the first bit that was already set, if any (bits are set
/// anyway up to it).
fn mark(bits: &mut [u64], a: u64, b: u64) -> Option<u64> {
    let mut i = a;
    while i < b {
        let w = (i / 64) as usize;
        let lo = i % 64;
        let hi = (b - (i - lo)).min(64);
        let mask = if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo };
        let dup = bits[w] & mask;
        if dup != 0 {
            return Some(w as u64 * 64 + dup.trailing_zeros() as u64);
        }
        bits[w] |= mask;
        i = i - lo + hi;
    }
    None
}

/// Why a staged group names no position (see `staged_shape`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadShape {
    /// A size the divisions and row index of `token_row` divide by.
    Zero(&'static str),
    /// A dcp rank outside its instance.
    DcpRank { rank: u32, dcp: u32 },
    /// A write that is empty or names a row the group lacks.
    Write { write: usize, start: u64, end: u64, row: u32, rows: usize },
}

impl std::fmt::Display for BadShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadShape::Zero(what) => write!(f, "{what} is 0"),
            BadShape::DcpRank { rank, dcp } => write!(f, "dcp rank {rank} of a dcp {dcp} instance"),
            BadShape::Write { write, start, end, row, rows } => {
                write!(f, "write {write} covers positions {start}..{end} of row {row} ({rows} rows)")
            }
        }
    }
}

/// Refuses a staged group whose positions cannot be read: the divisions and the
/// row index of [`token_row`] need these.
fn staged_shape(g: &StagedRows) -> Result<(), BadShape> {
    for (what, v) in [
        ("token bytes", g.token_bytes),
        ("dcp", u64::from(g.dcp)),
        ("interleave", u64::from(g.interleave)),
        ("producer block size", u64::from(g.src.block_size)),
        ("consumer block size", u64::from(g.dst.block_size)),
    ] {
        if v == 0 {
            return Err(BadShape::Zero(what));
        }
    }
    if g.dcp_rank >= g.dcp {
        return Err(BadShape::DcpRank { rank: g.dcp_rank, dcp: g.dcp });
    }
    if let Some((i, w)) = g.writes.iter().enumerate().find(|(_, w)| w.start >= w.end || w.row as usize >= g.rows.len()) {
        return Err(BadShape::Write { write: i, start: w.start, end: w.end, row: w.row, rows: g.rows.len() });
    }
    Ok(())
}

/// The (producer, consumer) byte offsets of local position `lp` of write `w`'s row,
/// from the DCP rule and the group's block tables; or why it has none. The group
/// passed [`staged_shape`].
fn token_row(g: &StagedRows, w: &StagedWrite, lp: u64) -> Result<(u64, u64), &'static str> {
    let (s, dcp, d) = (u64::from(g.interleave), u64::from(g.dcp), u64::from(g.dcp_rank));
    let p = global_of_local(lp, s, dcp, d);
    if p >= g.tokens {
        return Err("is a token past the request's");
    }
    let (pbs, dbs) = (u64::from(g.src.block_size), u64::from(g.dst.block_size));
    let sb = *g.src.blocks.get((p / pbs) as usize).ok_or("has no producer block")?;
    let db = *g.dst.blocks.get((lp / dbs) as usize).ok_or("has no consumer block")?;
    let (src_row, dst_row) = g.rows[w.row as usize];
    let at = |row: u64, block: u32, stride: u64, within: u64| {
        u64::from(block).checked_mul(stride)?.checked_add(row)?.checked_add(within.checked_mul(g.token_bytes)?)
    };
    let src = at(src_row, sb, g.src.block_stride, p % pbs).ok_or("has a producer address past u64")?;
    let dst = at(dst_row, db, g.dst.block_stride, lp % dbs).ok_or("has a consumer address past u64")?;
    Ok((src, dst))
}

/// Checks `plans` against the regions' lengths `lens`: every descriptor's `len` and
/// `count` non-zero, both ranges inside their regions, every staged write within
/// its staging buffer and each of its token rows inside both regions, and every
/// destination byte written at most once over all the plans (a bit per destination
/// byte). What [`execute_counted`] checks before it copies, and a device hand-off
/// (verify on a GPU) before it queues its copies.
pub fn check_counted(plans: &[Plan], lens: &HashMap<(RankId, RegionKind), u64>) -> Result<ExecStats, ExecError> {
    let mut bits: HashMap<(RankId, RegionKind), Vec<u64>> = HashMap::new();
    let mut stats = ExecStats::default();
    for (pi, plan) in plans.iter().enumerate() {
        let src_rank = RankId::Prefill(plan.producer);
        let dst_rank = RankId::Decode(plan.consumer);
        let region_lens = |kind| -> Result<(u64, u64), ExecError> {
            let src = *lens.get(&(src_rank, kind)).ok_or(ExecError::MissingRegion { rank: src_rank, kind })?;
            let dst = *lens.get(&(dst_rank, kind)).ok_or(ExecError::MissingRegion { rank: dst_rank, kind })?;
            Ok((src, dst))
        };
        for (di, d) in plan.descriptors.iter().enumerate() {
            if d.len == 0 || d.count == 0 {
                return Err(ExecError::Empty { plan: pi, desc: di, len: d.len, count: d.count });
            }
            let (src_len, dst_len) = region_lens(d.kind)?;
            for (side, rank, off, stride, rlen) in
                [("source", src_rank, d.src_offset, d.src_stride, src_len), ("destination", dst_rank, d.dst_offset, d.dst_stride, dst_len)]
            {
                let end = range_end(off, stride, d.count, d.len);
                if end.is_none_or(|e| e > rlen) {
                    return Err(ExecError::OutOfBounds { plan: pi, desc: di, side, rank, kind: d.kind, end, region_len: rlen });
                }
            }
            let b = bits.entry((dst_rank, d.kind)).or_insert_with(|| vec![0; dst_len.div_ceil(64) as usize]);
            for (_, dst) in d.pieces() {
                if let Some(off) = mark(b, dst, dst + d.len) {
                    let first = first_writer(plans, dst_rank, d.kind, off, (pi, di));
                    return Err(ExecError::DoubleWrite { rank: dst_rank, kind: d.kind, offset: off, first, second: (pi, di) });
                }
            }
            stats.descriptors += 1;
            stats.pieces += d.count as u64;
            stats.bytes += d.bytes();
            *stats.written.entry((plan.consumer, d.kind)).or_default() += d.bytes();
        }
        let mut wi = plan.descriptors.len();
        for (gi, g) in plan.staged.iter().enumerate() {
            staged_shape(g).map_err(|reason| ExecError::StagedShape { plan: pi, group: gi, reason })?;
            let (src_len, dst_len) = region_lens(g.kind)?;
            let tb = g.token_bytes;
            for (k, w) in g.writes.iter().enumerate() {
                let bytes = (w.end - w.start).saturating_mul(tb);
                if bytes > g.staging_bytes {
                    return Err(ExecError::StagedTooLarge { plan: pi, group: gi, write: k, bytes, staging: g.staging_bytes });
                }
                let b = bits.entry((dst_rank, g.kind)).or_insert_with(|| vec![0; dst_len.div_ceil(64) as usize]);
                for lp in w.start..w.end {
                    let (src, dst) = token_row(g, w, lp).map_err(|reason| ExecError::StagedPosition { plan: pi, group: gi, write: k, position: lp, reason })?;
                    for (side, rank, off, rlen) in [("source", src_rank, src, src_len), ("destination", dst_rank, dst, dst_len)] {
                        if off.checked_add(tb).is_none_or(|e| e > rlen) {
                            let end = off.saturating_add(tb);
                            return Err(ExecError::StagedOutOfBounds { plan: pi, group: gi, write: k, side, rank, kind: g.kind, end, region_len: rlen });
                        }
                    }
                    if let Some(off) = mark(b, dst, dst + tb) {
                        let first = first_writer(plans, dst_rank, g.kind, off, (pi, wi));
                        return Err(ExecError::DoubleWrite { rank: dst_rank, kind: g.kind, offset: off, first, second: (pi, wi) });
                    }
                }
                stats.staged_writes += 1;
                stats.pieces += w.end - w.start;
                stats.bytes += bytes;
                *stats.written.entry((plan.consumer, g.kind)).or_default() += bytes;
                wi += 1;
            }
        }
    }
    Ok(stats)
}

/// Executes `plans` as plain copies in `mem` (the descriptor's kind names the region on
/// the plan's producer and consumer), after [`check_counted`]'s checks. On error
/// nothing is copied. This reads the descriptors only to check and run them; what the
/// bytes must be is [`super::check_consumer`]'s business.
pub fn execute_counted(plans: &[Plan], mem: &mut Memory) -> Result<ExecStats, ExecError> {
    let lens: HashMap<(RankId, RegionKind), u64> = mem.iter().map(|(k, v)| (*k, v.len() as u64)).collect();
    let stats = check_counted(plans, &lens)?;
    for plan in plans {
        let src_rank = RankId::Prefill(plan.producer);
        let dst_rank = RankId::Decode(plan.consumer);
        for d in &plan.descriptors {
            let mut dst = mem.remove(&(dst_rank, d.kind)).expect("checked above");
            let src = &mem[&(src_rank, d.kind)];
            let len = d.len as usize;
            for (s, t) in d.pieces() {
                let (s, t) = (s as usize, t as usize);
                dst[t..t + len].copy_from_slice(&src[s..s + len]);
            }
            mem.insert((dst_rank, d.kind), dst);
        }
        for g in &plan.staged {
            let mut dst = mem.remove(&(dst_rank, g.kind)).expect("checked above");
            let src = &mem[&(src_rank, g.kind)];
            let tb = g.token_bytes as usize;
            for w in &g.writes {
                for lp in w.start..w.end {
                    let (s, t) = token_row(g, w, lp).expect("checked above");
                    let (s, t) = (s as usize, t as usize);
                    dst[t..t + tb].copy_from_slice(&src[s..s + tb]);
                }
            }
            mem.insert((dst_rank, g.kind), dst);
        }
    }
    Ok(stats)
}

/// The first (plan, write) before `upto` (in execution order, or `upto` itself for
/// a self-overlapping strided descriptor) that writes byte `off` of a region.
/// Writes are numbered as in [`ExecError::DoubleWrite`].
fn first_writer(plans: &[Plan], rank: RankId, kind: RegionKind, off: u64, upto: (usize, usize)) -> (usize, usize) {
    for (pi, plan) in plans.iter().enumerate().take(upto.0 + 1) {
        if RankId::Decode(plan.consumer) != rank {
            continue;
        }
        for (di, d) in plan.descriptors.iter().enumerate() {
            if (pi, di) > upto {
                return upto;
            }
            if d.kind == kind && d.pieces().any(|(_, t)| t <= off && off < t + d.len) {
                return (pi, di);
            }
        }
        let mut wi = plan.descriptors.len();
        for g in &plan.staged {
            for w in &g.writes {
                if (pi, wi) > upto {
                    return upto;
                }
                let lands = |lp| token_row(g, w, lp).is_ok_and(|(_, t)| t <= off && off < t + g.token_bytes);
                if g.kind == kind && (w.start..w.end).any(lands) {
                    return (pi, wi);
                }
                wi += 1;
            }
        }
    }
    upto
}
