//! The hand-off oracle: a byte-exact check of a transfer, written only from the rules of
//! docs/design.md section 4 and the layout convention of docs/layout.md, never from planner
//! output.
//!
//! How it is used:
//!
//! 1. Every region, producer and consumer, is filled with a **canary** ([`fill_canary`]):
//!    bytes that depend on (rank, kind, offset) only, so a byte nobody wrote can be told
//!    apart from a written one, and a byte copied from an untouched source is not the
//!    consumer's own canary either.
//! 2. Each request's bytes on each producer are filled with the **pattern**
//!    ([`fill_producer`]): every byte encodes its semantic coordinate (kind, request,
//!    module layer, token / head / group / repeat, byte index). The value depends on the
//!    coordinate only, never on the rank or the offset, so the same MLA row is the same
//!    bytes on every prefill TP rank and the same KDA head is the same bytes whether a
//!    TP2 or a TP4 prefill rank holds it.
//! 3. The plans are executed ([`execute_counted`]), which checks that every descriptor
//!    stays inside its regions and that no destination byte is written twice.
//! 4. Each consumer region is checked ([`check_consumer`]): every byte that belongs to a
//!    request (the decode blocks of the tokens its dcp rank owns, its slot's heads of
//!    every KDA layer, the cursor) must equal the pattern, every other byte must still
//!    be the canary. The first wrong byte comes back with its coordinate.
//!
//! ## The pattern
//!
//! A coordinate [`Coord`] (with the region kind) is hashed into a 64-bit key with a
//! chain of splitmix64 finalisers. Byte `b` of the coordinate's span (the token's row,
//! the head's contiguous bytes of one group and one repeat, the 4-byte cursor) is byte
//! `b % 8` (little endian) of `splitmix64(key + (b / 8 + 1) * golden) & 0xFEFE..FE`.
//! Pattern bytes are always **even**; canary bytes are always **odd**
//! (`splitmix64(canary_key(rank, kind) + (offset / 8 + 1) * golden) | 0x0101..01`), so a
//! pattern byte can never be mistaken for a canary byte, whatever the data.

use handoff_components::Topology;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::fmt;

/// Identifies one request for the pattern (so cross-request mix-ups are caught).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OracleRequest {
    pub id: u64,
    /// Prompt tokens handed off (positions `0..tokens`).
    pub tokens: u64,
}

/// Where one request lives on one rank: its block table (block ids in the rank's
/// position order: prefill positions on a prefill rank, local DCP positions on a
/// decode rank) and its state slot. Paged kinds read only `blocks`, per-slot kinds
/// only `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement<'a> {
    pub blocks: &'a [u32],
    pub slot: u32,
}

/// The semantic coordinate of one span of pattern bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coord {
    /// The row of token `token` (global prompt position) of MLA module layer `layer`
    /// (`mla.kv`, `mla.indexer`); byte index = byte in the token's row.
    Token { req: u64, layer: u32, token: u64 },
    /// The bytes of global KDA head `head` of module layer `layer` in channel group
    /// `group` (conv: 0 = q, 1 = k, 2 = v; other kinds: 0) and repeat `repeat` (conv:
    /// window row; replay records: ring entry; state: 0); byte index = byte within
    /// that head's contiguous bytes (state: `[Dk, Dv]` f32; records: k^, u, g f32).
    Head { req: u64, layer: u32, head: u32, group: u32, repeat: u32 },
    /// The replay cursor (4 bytes) of KDA module layer `layer`.
    Cursor { req: u64, layer: u32 },
}

/// Byte counts of a successful [`check_consumer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OracleStats {
    /// Bytes that belong to a request and equal the pattern.
    pub pattern_bytes: u64,
    /// Bytes that belong to no request (free blocks or slots, rows past a request's
    /// tokens) and still hold the canary.
    pub canary_bytes: u64,
}

impl std::ops::Add for OracleStats {
    type Output = OracleStats;
    fn add(self, o: OracleStats) -> OracleStats {
        OracleStats { pattern_bytes: self.pattern_bytes + o.pattern_bytes, canary_bytes: self.canary_bytes + o.canary_bytes }
    }
}

/// The first wrong byte of a consumer region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub rank: RankId,
    pub kind: RegionKind,
    /// Byte offset in the region.
    pub offset: u64,
    /// The coordinate and byte index the byte should hold, or `None` when it should
    /// still be the canary.
    pub expected_coord: Option<(Coord, u64)>,
    /// The readable coordinate (layer, token or head/group/channel, ...).
    pub what: String,
    pub expected: u8,
    pub got: u8,
    /// What the wrong byte is: "canary: untouched", a foreign canary, or the pattern of
    /// an identified coordinate.
    pub got_note: String,
}

/// Why [`check_consumer`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OracleError {
    /// A byte differs from what the rules say.
    Mismatch(Box<Mismatch>),
    /// The arguments are inconsistent (buffer length, a block or slot out of range or
    /// held twice, a block table too short for the tokens): a harness bug.
    Input(String),
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {} (offset {}): expected 0x{:02x}, got 0x{:02x} ({})",
            self.rank, self.kind, self.what, self.offset, self.expected, self.got, self.got_note
        )
    }
}

impl fmt::Display for OracleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OracleError::Mismatch(m) => m.fmt(f),
            OracleError::Input(s) => write!(f, "oracle input: {s}"),
        }
    }
}

impl std::error::Error for OracleError {}

/// Every region of every rank, by (rank, kind): the memory [`execute_counted`] copies in.
pub type Memory = BTreeMap<(RankId, RegionKind), Vec<u8>>;

// ---------------------------------------------------------------------------------
// Hashing: the pattern and the canary.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const PATTERN_MASK: u64 = 0xFEFE_FEFE_FEFE_FEFE;
const CANARY_BITS: u64 = 0x0101_0101_0101_0101;

use crate::base::mix;

fn chain(fields: &[u64]) -> u64 {
    fields.iter().fold(0x6A09_E667_F3BC_C909, |h, &f| mix(h.wrapping_add(GOLDEN) ^ f))
}

#[inline]
fn word(key: u64, i: u64) -> u64 {
    mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
}

#[inline]
fn pattern_word(key: u64, i: u64) -> u64 {
    word(key, i) & PATTERN_MASK
}

#[inline]
fn canary_word(ckey: u64, i: u64) -> u64 {
    word(ckey, i) | CANARY_BITS
}

fn coord_key(kind: RegionKind, c: &Coord) -> u64 {
    let k = kind.index() as u64;
    match *c {
        Coord::Token { req, layer, token } => chain(&[1, k, req, layer as u64, token]),
        Coord::Head { req, layer, head, group, repeat } => chain(&[2, k, req, layer as u64, head as u64, group as u64, repeat as u64]),
        Coord::Cursor { req, layer } => chain(&[3, k, req, layer as u64]),
    }
}

fn rank_code(rank: RankId) -> u64 {
    match rank {
        RankId::Prefill(p) => (1 << 62) | ((p.pp as u64) << 31) | p.tp as u64,
        RankId::Decode(d) => (2 << 62) | d.tp as u64,
    }
}

fn canary_key(rank: RankId, kind: RegionKind) -> u64 {
    chain(&[4, rank_code(rank), kind.index() as u64])
}

/// The pattern byte `byte` of a coordinate's span (always even).
pub fn pattern_byte(kind: RegionKind, coord: &Coord, byte: u64) -> u8 {
    (pattern_word(coord_key(kind, coord), byte / 8) >> (8 * (byte % 8))) as u8
}

/// The canary byte at `offset` of a rank's region (always odd).
pub fn canary_byte(rank: RankId, kind: RegionKind, offset: u64) -> u8 {
    (canary_word(canary_key(rank, kind), offset / 8) >> (8 * (offset % 8))) as u8
}

fn fill_pattern(key: u64, dst: &mut [u8]) {
    let mut chunks = dst.chunks_exact_mut(8);
    let mut i = 0u64;
    for c in &mut chunks {
        c.copy_from_slice(&pattern_word(key, i).to_le_bytes());
        i += 1;
    }
    let rest = chunks.into_remainder();
    let n = rest.len();
    if n > 0 {
        rest.copy_from_slice(&pattern_word(key, i).to_le_bytes()[..n]);
    }
}

/// First index where `s` differs from the pattern of `key`.
fn pattern_mismatch(key: u64, s: &[u8]) -> Option<usize> {
    let mut chunks = s.chunks_exact(8);
    let mut i = 0u64;
    for c in &mut chunks {
        let w = pattern_word(key, i);
        let g = u64::from_le_bytes(c.try_into().unwrap());
        if g != w {
            return Some(i as usize * 8 + ((g ^ w).trailing_zeros() / 8) as usize);
        }
        i += 1;
    }
    let rest = chunks.remainder();
    let w = pattern_word(key, i).to_le_bytes();
    rest.iter().zip(w).position(|(a, b)| *a != b).map(|p| i as usize * 8 + p)
}

/// Bytes before the first 8-byte-aligned offset at or after `off`, capped at `len`.
fn head_len(off: u64, len: usize) -> usize {
    (((8 - off % 8) % 8) as usize).min(len)
}

/// Writes the canary of `ckey` into `dst`, which starts at region offset `off`.
fn fill_canary_at(ckey: u64, off: u64, dst: &mut [u8]) {
    let h = head_len(off, dst.len());
    let (head, rest) = dst.split_at_mut(h);
    for (i, b) in head.iter_mut().enumerate() {
        let abs = off + i as u64;
        *b = (canary_word(ckey, abs / 8) >> (8 * (abs % 8))) as u8;
    }
    let w0 = (off + h as u64) / 8;
    let mut chunks = rest.chunks_exact_mut(8);
    let mut i = w0;
    for c in &mut chunks {
        c.copy_from_slice(&canary_word(ckey, i).to_le_bytes());
        i += 1;
    }
    let tail = chunks.into_remainder();
    let n = tail.len();
    if n > 0 {
        tail.copy_from_slice(&canary_word(ckey, i).to_le_bytes()[..n]);
    }
}

/// First index where `s` (at region offset `off`) differs from the canary.
fn canary_mismatch(ckey: u64, off: u64, s: &[u8]) -> Option<usize> {
    let h = head_len(off, s.len());
    for (i, &b) in s[..h].iter().enumerate() {
        let abs = off + i as u64;
        if b != (canary_word(ckey, abs / 8) >> (8 * (abs % 8))) as u8 {
            return Some(i);
        }
    }
    let w0 = (off + h as u64) / 8;
    let mut chunks = s[h..].chunks_exact(8);
    let mut i = w0;
    for c in &mut chunks {
        let w = canary_word(ckey, i);
        let g = u64::from_le_bytes(c.try_into().unwrap());
        if g != w {
            return Some(h + (i - w0) as usize * 8 + ((g ^ w).trailing_zeros() / 8) as usize);
        }
        i += 1;
    }
    let tail = chunks.remainder();
    let w = canary_word(ckey, i).to_le_bytes();
    tail.iter().zip(w).position(|(a, b)| *a != b).map(|p| h + (i - w0) as usize * 8 + p)
}

// ---------------------------------------------------------------------------------
// Geometry of one rank's region, from docs/layout.md.

/// One rank's region of one kind: the rows and the size of one cell. A cell is one
/// block of one row (paged: cell index = row x units + block) or one layer of one slot
/// (per-slot: cell index = slot x rows + row).
struct Geom {
    rank: RankId,
    kind: RegionKind,
    /// Module layers of the region's kind that the rank holds, increasing.
    layers: Vec<u32>,
    /// Paged: tokens per block and bytes per token row.
    bs: u64,
    token_bytes: u64,
    /// Per-slot: heads held, the first global head, head bytes per group, repeats.
    hl: u32,
    first_head: u32,
    groups: Vec<u64>,
    repeat: u32,
    /// Bytes of one repeat over all groups and heads (conv: one window row).
    row_bytes: u64,
    /// Bytes of one cell.
    cell: u64,
}

fn group_shapes(topo: &Topology, kind: RegionKind) -> (Vec<u64>, u32) {
    let m = topo.model();
    let (dk, dv) = (m.kda.head_k_dim as u64, m.kda.head_v_dim as u64);
    let e = m.dtype.bytes();
    match kind {
        RegionKind::KdaState => (vec![dk * dv * 4], 1),
        RegionKind::KdaConv => (vec![dk * e, dk * e, dv * e], m.kda.conv_kernel.saturating_sub(1)),
        RegionKind::ReplayRecords => (vec![(2 * dk + dv) * 4], m.replay.as_ref().map_or(0, |r| r.capacity)),
        _ => (vec![], 0),
    }
}

impl Geom {
    fn new(topo: &Topology, rank: RankId, kind: RegionKind) -> Geom {
        let m = topo.model();
        let lk = kind.layer_kind();
        let range = match rank {
            RankId::Prefill(p) => topo.stage_layers[p.pp as usize].clone(),
            RankId::Decode(_) => 0..m.num_layers,
        };
        let layers: Vec<u32> = range.filter(|&l| topo.layer_kinds[l as usize] == lk).collect();
        let (side_tp, side_bs, side_rank) = match rank {
            RankId::Prefill(p) => (topo.prefill().tp, topo.prefill().block_size, p.tp),
            RankId::Decode(d) => (topo.decode().tp, topo.decode().block_size, d.tp),
        };
        let hl = m.kda.heads / side_tp;
        let e = m.dtype.bytes();
        let mut g =
            Geom { rank, kind, layers, bs: side_bs as u64, token_bytes: 0, hl, first_head: side_rank * hl, groups: vec![], repeat: 0, row_bytes: 0, cell: 0 };
        match kind {
            RegionKind::MlaKv | RegionKind::MlaIndexer => {
                g.token_bytes = if kind == RegionKind::MlaKv { (m.mla.kv_lora_rank + m.mla.rope_dim) as u64 * e } else { m.mla.indexer_dim as u64 * e };
                g.cell = g.bs * g.token_bytes;
            }
            RegionKind::ReplayCursor => g.cell = 4,
            _ => {
                let (groups, repeat) = group_shapes(topo, kind);
                g.row_bytes = groups.iter().map(|b| b * hl as u64).sum();
                g.groups = groups;
                g.repeat = repeat;
                g.cell = g.row_bytes * repeat as u64;
            }
        }
        g
    }

    fn nrows(&self) -> u64 {
        self.layers.len() as u64
    }

    fn len(&self, units: u32) -> u64 {
        self.nrows() * units as u64 * self.cell
    }

    /// Offset within a (slot, layer) cell of (repeat t, group gi, local head j).
    fn head_off(&self, t: u32, gi: usize, j: u32) -> u64 {
        let base: u64 = self.groups[..gi].iter().map(|b| b * self.hl as u64).sum();
        t as u64 * self.row_bytes + base + j as u64 * self.groups[gi]
    }

    /// Splits an offset within a head-split cell into (repeat, group, local head, byte).
    fn head_of(&self, off: u64) -> (u32, usize, u32, u64) {
        let t = off / self.row_bytes;
        let mut r = off % self.row_bytes;
        for (gi, &hb) in self.groups.iter().enumerate() {
            let w = hb * self.hl as u64;
            if r < w {
                return (t as u32, gi, (r / hb) as u32, r % hb);
            }
            r -= w;
        }
        unreachable!("offset inside the cell")
    }
}

/// Bytes of a rank's region of `kind` holding `units` blocks (paged) or slots (per-slot),
/// per docs/layout.md: rows x units x block_bytes, or units x rows x layer_bytes.
pub fn region_len(topo: &Topology, rank: RankId, kind: RegionKind, units: u32) -> u64 {
    Geom::new(topo, rank, kind).len(units)
}

/// Fills a whole region with the canary of (rank, kind, offset).
pub fn fill_canary(rank: RankId, kind: RegionKind, buf: &mut [u8]) {
    const CHUNK: usize = 1 << 16;
    let ckey = canary_key(rank, kind);
    buf.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| fill_canary_at(ckey, (i * CHUNK) as u64, c));
}

/// Fills one request's bytes of a producer region with the pattern: every token row of
/// its blocks (positions `blocks[i] x bs_p + j`, including the rows past `tokens` in a
/// partial last block, which must not move) for every MLA layer of the stage, or its
/// slot's heads of every KDA layer of the stage, or its cursors. Bytes of other blocks
/// and slots are left as they are (fill the canary first). Panics if a block or the
/// slot is out of range or `buf` is not the region's length.
pub fn fill_producer(topo: &Topology, rank: PrefillRank, kind: RegionKind, units: u32, req: &OracleRequest, at: &Placement<'_>, buf: &mut [u8]) {
    let g = Geom::new(topo, RankId::Prefill(rank), kind);
    assert_eq!(buf.len() as u64, g.len(units), "{} {kind} region length", RankId::Prefill(rank));
    if g.cell == 0 || g.layers.is_empty() {
        return;
    }
    let cell = g.cell as usize;
    if kind.is_paged() {
        let mut table = vec![u32::MAX; units as usize];
        for (bi, &b) in at.blocks.iter().enumerate() {
            assert!(b < units, "block {b} out of {units}");
            assert_eq!(table[b as usize], u32::MAX, "block {b} listed twice");
            table[b as usize] = bi as u32;
        }
        buf.par_chunks_mut(cell).enumerate().for_each(|(c, chunk)| {
            let (row, blk) = (c / units as usize, c % units as usize);
            let bi = table[blk];
            if bi == u32::MAX {
                return;
            }
            let layer = g.layers[row];
            for (j, tok) in chunk.chunks_mut(g.token_bytes as usize).enumerate() {
                let token = bi as u64 * g.bs + j as u64;
                fill_pattern(coord_key(kind, &Coord::Token { req: req.id, layer, token }), tok);
            }
        });
    } else {
        assert!(at.slot < units, "slot {} out of {units}", at.slot);
        let start = at.slot as usize * g.layers.len() * cell;
        let slot = &mut buf[start..start + g.layers.len() * cell];
        slot.par_chunks_mut(cell).enumerate().for_each(|(row, c)| {
            let layer = g.layers[row];
            fill_cell(&g, req.id, layer, c);
        });
    }
}

/// Fills one (slot, layer) cell of a per-slot region with its pattern.
fn fill_cell(g: &Geom, req: u64, layer: u32, c: &mut [u8]) {
    if g.kind == RegionKind::ReplayCursor {
        fill_pattern(coord_key(g.kind, &Coord::Cursor { req, layer }), c);
        return;
    }
    for t in 0..g.repeat {
        for (gi, &hb) in g.groups.iter().enumerate() {
            for j in 0..g.hl {
                let o = g.head_off(t, gi, j) as usize;
                let coord = Coord::Head { req, layer, head: g.first_head + j, group: gi as u32, repeat: t };
                fill_pattern(coord_key(g.kind, &coord), &mut c[o..o + hb as usize]);
            }
        }
    }
}

/// Tokens among `0..tokens` that dcp rank `d` owns: `(p / S) % dcp == d`.
fn owned_tokens(tokens: u64, s: u64, dcp: u64, d: u64) -> u64 {
    let cycle = s * dcp;
    let full = tokens / cycle * s;
    let rem = tokens % cycle;
    full + rem.saturating_sub(d * s).min(s)
}

/// The global position of local position `lp` of dcp rank `d`.
fn global_of_local(lp: u64, s: u64, dcp: u64, d: u64) -> u64 {
    (lp / s) * s * dcp + d * s + lp % s
}

/// Bytes a decode rank receives per region kind for one request of `tokens` tokens,
/// from the rules: paged kinds, the tokens its dcp rank owns x token bytes x MLA layers;
/// head-split kinds, the whole slot unit of its heads (conv: every window row, replay
/// records: the whole ring) x KDA layers; the cursor, 4 B x KDA layers.
pub fn expected_bytes(topo: &Topology, rank: DecodeRank, tokens: u64) -> BTreeMap<RegionKind, u64> {
    let d = topo.decode();
    topo.region_kinds()
        .into_iter()
        .map(|kind| {
            let g = Geom::new(topo, RankId::Decode(rank), kind);
            let per_layer =
                if kind.is_paged() { owned_tokens(tokens, d.interleave as u64, d.dcp as u64, rank.dcp_rank(d.dcp) as u64) * g.token_bytes } else { g.cell };
            (kind, per_layer * g.nrows())
        })
        .collect()
}

// ---------------------------------------------------------------------------------
// The consumer check.

type CellResult = Result<OracleStats, Box<Mismatch>>;

/// Runs `f` on every cell in parallel; the first mismatch in offset order wins.
fn run_cells<F>(buf: &[u8], cell: u64, f: F) -> CellResult
where
    F: Fn(usize, &[u8]) -> CellResult + Sync,
{
    if cell == 0 || buf.is_empty() {
        return Ok(OracleStats::default());
    }
    let results: Vec<CellResult> = buf.par_chunks(cell as usize).enumerate().map(|(c, s)| f(c, s)).collect();
    let mut total = OracleStats::default();
    for r in results {
        total = total + r?;
    }
    Ok(total)
}

/// Describes the bytes of a paged token row (byte `b` of the row).
fn describe_token_byte(topo: &Topology, kind: RegionKind, b: u64) -> String {
    let m = topo.model();
    let e = m.dtype.bytes();
    let ch = b / e;
    if kind == RegionKind::MlaKv {
        if ch < m.mla.kv_lora_rank as u64 {
            format!("latent channel {ch} byte {}", b % e)
        } else {
            format!("rope channel {} byte {}", ch - m.mla.kv_lora_rank as u64, b % e)
        }
    } else {
        format!("channel {ch} byte {}", b % e)
    }
}

/// Describes byte `b` of a head span of group `gi`, repeat `t` of a head-split kind.
fn describe_head_byte(topo: &Topology, kind: RegionKind, gi: usize, t: u32, b: u64) -> String {
    let m = topo.model();
    let (dk, dv) = (m.kda.head_k_dim as u64, m.kda.head_v_dim as u64);
    match kind {
        RegionKind::KdaState => {
            let el = b / 4;
            format!("state [k {}][v {}] byte {}", el / dv, el % dv, b % 4)
        }
        RegionKind::KdaConv => {
            let e = m.dtype.bytes();
            let name = ["q", "k", "v"][gi];
            format!("group {name} channel {} row {t} byte {}", b / e, b % e)
        }
        RegionKind::ReplayRecords => {
            let el = b / 4;
            let (name, ch) = if el < dk {
                ("k^", el)
            } else if el < dk + dv {
                ("u", el - dk)
            } else {
                ("g", el - dk - dv)
            };
            format!("entry {t} {name} channel {ch} byte {}", b % 4)
        }
        _ => format!("byte {b}"),
    }
}

fn head_coord_str(c: &Coord) -> String {
    match *c {
        Coord::Token { req, layer, token } => format!("request {req} layer {layer} token {token}"),
        Coord::Head { req, layer, head, group, repeat } => {
            format!("request {req} layer {layer} head {head} group {group} repeat {repeat}")
        }
        Coord::Cursor { req, layer } => format!("request {req} layer {layer} cursor"),
    }
}

/// Checks one consumer region after the transfer. `reqs` are every request transferred
/// into this region, with their placement on this rank (decode blocks in local DCP
/// position order, slot). Every byte of a request (the rows of the tokens this dcp rank
/// owns among `0..tokens`, every byte of its slot's cell of every KDA layer, its
/// cursors) must equal the pattern; every other byte must still be the canary.
pub fn check_consumer(
    topo: &Topology,
    rank: DecodeRank,
    kind: RegionKind,
    units: u32,
    reqs: &[(OracleRequest, Placement<'_>)],
    buf: &[u8],
) -> Result<OracleStats, OracleError> {
    let rid = RankId::Decode(rank);
    let g = Geom::new(topo, rid, kind);
    if buf.len() as u64 != g.len(units) {
        return Err(OracleError::Input(format!("{rid} {kind}: buffer is {} bytes, the region of {units} units is {}", buf.len(), g.len(units))));
    }
    let ckey = canary_key(rid, kind);
    let d = topo.decode();
    let (s, dcp, dr) = (d.interleave as u64, d.dcp as u64, rank.dcp_rank(d.dcp) as u64);
    let nrows = g.layers.len().max(1);
    let mismatch = |offset: u64, expected: u8, got: u8, ec: Option<(Coord, u64)>, what: String| {
        Box::new(Mismatch { rank: rid, kind, offset, expected_coord: ec, what, expected, got, got_note: String::new() })
    };
    let res = if kind.is_paged() {
        // block id -> (request index, index in its block table)
        let mut table = vec![(u32::MAX, 0u32); units as usize];
        let mut owned = Vec::with_capacity(reqs.len());
        for (q, (req, at)) in reqs.iter().enumerate() {
            let n = owned_tokens(req.tokens, s, dcp, dr);
            if (at.blocks.len() as u64) * g.bs < n {
                return Err(OracleError::Input(format!(
                    "{rid} {kind}: request {} owns {n} tokens here but has {} blocks of {}",
                    req.id,
                    at.blocks.len(),
                    g.bs
                )));
            }
            owned.push(n);
            for (bi, &b) in at.blocks.iter().enumerate() {
                if b >= units || table[b as usize].0 != u32::MAX {
                    return Err(OracleError::Input(format!("{rid} {kind}: block {b} of request {} is out of {units} or held twice", req.id)));
                }
                table[b as usize] = (q as u32, bi as u32);
            }
        }
        let tb = g.token_bytes as usize;
        run_cells(buf, g.cell, |c, chunk| {
            let (row, blk) = (c / units as usize, c % units as usize);
            let layer = g.layers[row];
            let base = c as u64 * g.cell;
            let (q, bi) = table[blk];
            let mut st = OracleStats::default();
            if q == u32::MAX {
                if let Some(i) = canary_mismatch(ckey, base, chunk) {
                    let o = base + i as u64;
                    let what = format!("layer {layer} block {blk} row {} byte {} (no request holds this block)", i / tb, i % tb);
                    return Err(mismatch(o, canary_byte(rid, kind, o), chunk[i], None, what));
                }
                st.canary_bytes += chunk.len() as u64;
                return Ok(st);
            }
            let req = &reqs[q as usize].0;
            for (j, tok) in chunk.chunks(tb).enumerate() {
                let lp = bi as u64 * g.bs + j as u64;
                let token = global_of_local(lp, s, dcp, dr);
                let toff = base + (j * tb) as u64;
                if lp < owned[q as usize] {
                    let coord = Coord::Token { req: req.id, layer, token };
                    let key = coord_key(kind, &coord);
                    if let Some(i) = pattern_mismatch(key, tok) {
                        let what =
                            format!("request {} layer {layer} token {token} {} (block {blk} row {j})", req.id, describe_token_byte(topo, kind, i as u64));
                        let exp = pattern_byte(kind, &coord, i as u64);
                        return Err(mismatch(toff + i as u64, exp, tok[i], Some((coord, i as u64)), what));
                    }
                    st.pattern_bytes += tok.len() as u64;
                } else {
                    if let Some(i) = canary_mismatch(ckey, toff, tok) {
                        let o = toff + i as u64;
                        let what = format!(
                            "request {} layer {layer} block {blk} row {j} byte {i} (local position {lp}, token {token}: past its {} tokens, must stay canary)",
                            req.id, req.tokens
                        );
                        return Err(mismatch(o, canary_byte(rid, kind, o), tok[i], None, what));
                    }
                    st.canary_bytes += tok.len() as u64;
                }
            }
            Ok(st)
        })
    } else {
        let mut table = vec![u32::MAX; units as usize];
        for (q, (req, at)) in reqs.iter().enumerate() {
            if at.slot >= units || table[at.slot as usize] != u32::MAX {
                return Err(OracleError::Input(format!("{rid} {kind}: slot {} of request {} is out of {units} or held twice", at.slot, req.id)));
            }
            table[at.slot as usize] = q as u32;
        }
        run_cells(buf, g.cell, |c, chunk| {
            let (slot, row) = (c / nrows, c % nrows);
            let layer = g.layers[row];
            let base = c as u64 * g.cell;
            let q = table[slot];
            if q == u32::MAX {
                if let Some(i) = canary_mismatch(ckey, base, chunk) {
                    let o = base + i as u64;
                    let what = format!("slot {slot} layer {layer} byte {i} (no request holds this slot)");
                    return Err(mismatch(o, canary_byte(rid, kind, o), chunk[i], None, what));
                }
                return Ok(OracleStats { pattern_bytes: 0, canary_bytes: chunk.len() as u64 });
            }
            let req = reqs[q as usize].0.id;
            if kind == RegionKind::ReplayCursor {
                let coord = Coord::Cursor { req, layer };
                if let Some(i) = pattern_mismatch(coord_key(kind, &coord), chunk) {
                    let what = format!("request {req} layer {layer} cursor byte {i} (slot {slot})");
                    let exp = pattern_byte(kind, &coord, i as u64);
                    return Err(mismatch(base + i as u64, exp, chunk[i], Some((coord, i as u64)), what));
                }
                return Ok(OracleStats { pattern_bytes: 4, canary_bytes: 0 });
            }
            for t in 0..g.repeat {
                for (gi, &hb) in g.groups.iter().enumerate() {
                    for j in 0..g.hl {
                        let o = g.head_off(t, gi, j) as usize;
                        let head = g.first_head + j;
                        let coord = Coord::Head { req, layer, head, group: gi as u32, repeat: t };
                        let span = &chunk[o..o + hb as usize];
                        if let Some(i) = pattern_mismatch(coord_key(kind, &coord), span) {
                            let what = format!("request {req} layer {layer} head {head} {} (slot {slot})", describe_head_byte(topo, kind, gi, t, i as u64));
                            let exp = pattern_byte(kind, &coord, i as u64);
                            return Err(mismatch(base + (o + i) as u64, exp, span[i], Some((coord, i as u64)), what));
                        }
                    }
                }
            }
            Ok(OracleStats { pattern_bytes: chunk.len() as u64, canary_bytes: 0 })
        })
    };
    res.map_err(|mut m| {
        m.got_note = explain_got(topo, &g, reqs, buf, m.offset);
        OracleError::Mismatch(m)
    })
}

/// Says what a wrong byte is: this offset's canary (never written), another canary
/// byte (read from untouched memory or written at the wrong offset), or the pattern of
/// a coordinate found among the requests (rows of other tokens or layers, other heads,
/// groups or repeats), matching the aligned 8-byte word that holds the byte.
fn explain_got(topo: &Topology, g: &Geom, reqs: &[(OracleRequest, Placement<'_>)], buf: &[u8], offset: u64) -> String {
    let got = buf[offset as usize];
    if got == canary_byte(g.rank, g.kind, offset) {
        return "canary: untouched".into();
    }
    if got & 1 == 1 {
        return "an odd byte: a canary from elsewhere, e.g. read from untouched source memory".into();
    }
    // The span holding the byte, by structure only (whoever owns it).
    let cell_off = offset % g.cell;
    let (span_len, b, cands): (u64, u64, Vec<Coord>) = match g.kind {
        RegionKind::MlaKv | RegionKind::MlaIndexer => {
            let b = cell_off % g.token_bytes;
            let mut v = Vec::new();
            for (req, _) in reqs {
                let bs_p = topo.prefill().block_size as u64;
                let upto = req.tokens.div_ceil(bs_p) * bs_p;
                for &layer in &g.layers {
                    for token in 0..upto {
                        v.push(Coord::Token { req: req.id, layer, token });
                    }
                }
            }
            (g.token_bytes, b, v)
        }
        RegionKind::ReplayCursor => {
            let v = reqs.iter().flat_map(|(r, _)| g.layers.iter().map(|&layer| Coord::Cursor { req: r.id, layer })).collect();
            (4, cell_off, v)
        }
        _ => {
            let (_, gi, _, b) = g.head_of(cell_off);
            let heads = topo.model().kda.heads;
            let mut v = Vec::new();
            for (req, _) in reqs {
                for &layer in &g.layers {
                    for head in 0..heads {
                        for (gj, &hb) in g.groups.iter().enumerate() {
                            if hb != g.groups[gi] {
                                continue;
                            }
                            for t in 0..g.repeat {
                                v.push(Coord::Head { req: req.id, layer, head, group: gj as u32, repeat: t });
                            }
                        }
                    }
                }
            }
            (g.groups[gi], b, v)
        }
    };
    if cands.len() > 50_000_000 {
        return "pattern-like (even), not identified: too many candidates".into();
    }
    let span_start = offset - b;
    let w0 = span_start + (b / 8) * 8;
    let w1 = (w0 + 8).min(span_start + span_len).min(buf.len() as u64);
    let got_word = &buf[w0 as usize..w1 as usize];
    let n = got_word.len();
    let found = cands.par_iter().find_first(|c| pattern_word(coord_key(g.kind, c), b / 8).to_le_bytes()[..n] == *got_word);
    match found {
        Some(c) => format!("the pattern of {} byte {b}", head_coord_str(c)),
        None => "pattern-like (even), not identified among the requests' coordinates".into(),
    }
}

// ---------------------------------------------------------------------------------
// Executing plans with a write count: `exec.rs`.

mod exec;
pub use exec::{BadShape, ExecError, ExecStats, check_counted, execute_counted};

// ---------------------------------------------------------------------------------

#[cfg(test)]
mod tests;
