//! Splitting: the descriptors of one (producer, consumer) pair, planned from the
//! producer's own layout and the consumer's *published* layout alone (never from
//! global knowledge), so the same code serves when the roles are separate processes.

use crate::coalesce::Coalescer;
pub use crate::share::{Share, share};
use handoff_components::layout::{ConsumerLayout, ProducerLayout, RegionLayout};
use handoff_components::plan::{Descriptor, LayerPart, Plan, StagedBlocks, StagedRows, StagedWrite};
use handoff_components::vocab::{Distribution, ModuleLayer, RegionKind};
use std::sync::{Arc, OnceLock};
use thiserror::Error;

/// Why a pair cannot be planned. Each names the values involved.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SplitError {
    #[error("decode tp{consumer} holds {kind} heads {c0}..{c1}, outside the head group {p0}..{p1} of prefill pp{pp} tp{producer}")]
    HeadsOutsideGroup { kind: RegionKind, consumer: u32, c0: u32, c1: u32, pp: u32, producer: u32, p0: u32, p1: u32 },
    #[error("decode tp{consumer} published no {kind} region, but prefill pp{pp} holds one")]
    MissingRegion { kind: RegionKind, consumer: u32, pp: u32 },
    #[error("decode tp{consumer} has no {kind} row for module layer {layer}")]
    MissingRow { kind: RegionKind, consumer: u32, layer: u32 },
    #[error("{kind} geometry differs: producer {what} {producer}, consumer {consumer}")]
    Geometry { kind: RegionKind, what: &'static str, producer: u64, consumer: u64 },
    #[error("{kind}: {side} has {have} blocks, request needs {need} for its tokens")]
    ShortBlocks { kind: RegionKind, side: &'static str, have: u64, need: u64 },
    #[error("{kind}: {side} {what} {index} is outside its region of {units} units")]
    OutOfRegion { kind: RegionKind, side: &'static str, what: &'static str, index: u32, units: u32 },
    #[error("decode tp{consumer} published an inconsistent layout: {reason}")]
    Layout { consumer: u32, reason: String },
}

/// Refuses a published consumer layout that no placement produces: it came over
/// the wire, and the planner divides by its DCP figures and block size and adds
/// its offsets. Every extent is checked against the region's published length
/// with checked arithmetic, so that planning cannot overflow or divide by zero
/// (bounds against the real region are the transport's check).
pub fn check_consumer(consumer: &ConsumerLayout) -> Result<(), SplitError> {
    let bad = |reason: String| Err(SplitError::Layout { consumer: consumer.rank.tp, reason });
    if consumer.tp == 0 || consumer.dcp == 0 || consumer.interleave == 0 {
        return bad(format!("tp {}, dcp {}, interleave {} must be at least 1", consumer.tp, consumer.dcp, consumer.interleave));
    }
    if consumer.rank.tp >= consumer.tp {
        return bad(format!("rank tp{} of a tp {} instance", consumer.rank.tp, consumer.tp));
    }
    for r in &consumer.layout.regions {
        let kind = r.kind.name();
        // One addressable unit: a block of a paged row, a slot of a per-slot row.
        let unit = if r.kind.is_paged() {
            if r.block_size == 0 {
                return bad(format!("{kind} block size 0"));
            }
            u64::from(r.block_size).checked_mul(r.token_bytes)
        } else {
            Some(r.unit_bytes)
        };
        let Some(unit) = unit else { return bad(format!("{kind} block of {} x {} B", r.block_size, r.token_bytes)) };
        // A row ends at its offset plus the span of its units, so the row at the
        // largest offset ends last: when it fits, every row fits (one pass for the
        // maximum); otherwise the first row that does not is named.
        let span = r.units.checked_sub(1).and_then(|u| u64::from(u).checked_mul(r.unit_stride)?.checked_add(unit));
        let last = r.rows.iter().map(|row| row.offset).max();
        let fits = match (span, last) {
            (_, None) => true,
            (Some(span), Some(last)) => last.checked_add(span).is_some_and(|e| e <= r.len),
            (None, Some(_)) => r.units == 0,
        };
        if !fits {
            for row in &r.rows {
                let end = u64::from(r.units - 1).checked_mul(r.unit_stride).and_then(|x| x.checked_add(row.offset)?.checked_add(unit));
                if end.is_none_or(|e| e > r.len) {
                    return bad(format!(
                        "{kind} row of layer {} at {} with {} units of {unit} B every {} B exceeds the region's {} B",
                        row.layer.0, row.offset, r.units, r.unit_stride, r.len
                    ));
                }
            }
        }
        if let Some(seg) = &r.segment {
            if seg.heads.start > seg.heads.end {
                return bad(format!("{kind} head range {}..{}", seg.heads.start, seg.heads.end));
            }
            let heads = u64::from(seg.heads.end - seg.heads.start);
            for g in &seg.groups {
                let end = heads
                    .checked_mul(g.head_bytes)
                    .and_then(|h| u64::from(g.repeat.saturating_sub(1)).checked_mul(g.stride)?.checked_add(g.offset)?.checked_add(h));
                if g.repeat > 0 && end.is_none_or(|e| e > unit) {
                    return bad(format!(
                        "{kind} head group at {} ({} x {} B every {} B) exceeds its unit of {unit} B",
                        g.offset, g.repeat, g.head_bytes, g.stride
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Plans one request's copies from `producer` to `consumer`.
pub fn plan_pair(producer: &ProducerLayout, consumer: &ConsumerLayout, tokens: u64, share: Share) -> Result<Plan, SplitError> {
    ProducerPlanner::new(producer, tokens).plan(consumer, share)
}

/// A producer's side of one request, prepared once (its block runs) and then
/// planned against each consumer.
pub struct ProducerPlanner<'a> {
    producer: &'a ProducerLayout,
    tokens: u64,
    /// Physically contiguous runs of the producer's blocks, per paged region.
    src_runs: Vec<(RegionKind, Vec<BlockRun>)>,
    /// Set by [`ProducerPlanner::staging`]: the staging buffer's bytes.
    staging: Option<u64>,
    /// The producer's block table that every staged group of this producer
    /// shares, made when the first group is.
    src_table: OnceLock<Arc<[u32]>>,
    /// Set by [`ProducerPlanner::chunked`]: tokens a chunk.
    chunk_tokens: Option<u64>,
    /// Set by [`ProducerPlanner::layered`]: the plan is cut by module layer.
    layered: bool,
}

impl<'a> ProducerPlanner<'a> {
    pub fn new(producer: &'a ProducerLayout, tokens: u64) -> Self {
        let src_runs = producer
            .layout
            .regions
            .iter()
            .filter(|r| r.kind.is_paged())
            // A producer's own blocks: checked per pair, against its own region, in `plan_rows`.
            .map(|r| (r.kind, runs(&producer.blocks, r.block_size, r.unit_stride, r.token_bytes, tokens, None).unwrap_or_default()))
            .collect();
        ProducerPlanner { producer, tokens, src_runs, staging: None, src_table: OnceLock::new(), chunk_tokens: None, layered: false }
    }

    /// Plans a chunked transfer ([`Plan::chunks`]): token rows in chunks of
    /// `tokens` (rounded down to whole groups of the consumer's DCP, interleave x
    /// dcp tokens, and at least one group), in token order, and every head-split
    /// and replicated kind with the last chunk. Chunked plans stage nothing: a
    /// staged group spans the whole request. `None`: one plain plan.
    pub fn chunked(mut self, tokens: Option<u64>) -> Self {
        self.chunk_tokens = tokens.filter(|&t| t > 0);
        if self.chunk_tokens.is_some() {
            self.staging = None;
        }
        self
    }

    /// Plans a layered transfer ([`Plan::layers`], layer-wise streaming): every
    /// kind's writes cut by module layer, in layer order, each layer's
    /// descriptors coalesced apart from the others' and its token rows staged in
    /// groups of their own, so that each part can be written as soon as its
    /// layer is computed. The bytes are those of the plain plan. A chunked plan
    /// ([`ProducerPlanner::chunked`]) keeps its token order and is not layered.
    pub fn layered(mut self, on: bool) -> Self {
        self.layered = on;
        self
    }

    /// Plans token rows whose blocks do not line up as staged groups cut for
    /// buffers of `bytes` (docs/design.md section 4, "Coalescing"), where that
    /// takes fewer writes than descriptors would; `None` plans every row as
    /// descriptors. Only for a mover that runs staged groups
    /// ([`crate::transfer::Mover::staging_bytes`]).
    pub fn staging(mut self, bytes: Option<u64>) -> Self {
        self.staging = bytes.filter(|&b| b > 0 && self.chunk_tokens.is_none());
        self
    }

    /// The producer's blocks that hold the request's positions, shared: a spare
    /// block past them may lie anywhere, and a group's bounds are taken over its
    /// whole table.
    fn src_table(&self, block_size: u32) -> Arc<[u32]> {
        let need = |bs: u32| (self.tokens.div_ceil(u64::from(bs.max(1))) as usize).min(self.producer.blocks.len());
        let table = self.src_table.get_or_init(|| Arc::from(&self.producer.blocks[..need(block_size)]));
        // Paged kinds share the prefill block size; another would need its own cut.
        if table.len() == need(block_size) { Arc::clone(table) } else { Arc::from(&self.producer.blocks[..need(block_size)]) }
    }

    pub fn plan(&self, consumer: &ConsumerLayout, share: Share) -> Result<Plan, SplitError> {
        check_consumer(consumer)?;
        if self.layered && self.chunk_tokens.is_none() {
            return self.plan_layered(consumer, share);
        }
        let producer = self.producer;
        // Token groups (interleave x dcp tokens) a chunk, and the chunks: one
        // coalescer each, so no descriptor spans two chunks.
        let group = u64::from(consumer.interleave) * u64::from(consumer.dcp);
        let (per_chunk, n_chunks) = match self.chunk_tokens {
            Some(t) => {
                let per = (t / group).max(1);
                (per, self.tokens.div_ceil(per * group).max(1) as usize)
            }
            None => (u64::MAX, 1),
        };
        let mut outs: Vec<Coalescer> = (0..n_chunks).map(|_| Coalescer::default()).collect();
        let mut staged = Vec::new();
        let mut uncoalesced = 0u64;
        let mut pairs = Vec::new();
        for src in &producer.layout.regions {
            if src.rows.is_empty() {
                continue;
            }
            let wanted = match src.kind.distribution() {
                Distribution::TokenSharded => share.rows,
                Distribution::HeadSplit | Distribution::Replicated => share.state,
            };
            if !wanted {
                continue;
            }
            let dst = consumer.layout.region(src.kind).ok_or(SplitError::MissingRegion { kind: src.kind, consumer: consumer.rank.tp, pp: producer.rank.pp })?;
            row_pairs(src, dst, consumer, &mut pairs)?;
            let last = outs.len() - 1;
            uncoalesced += match src.kind.distribution() {
                Distribution::TokenSharded => {
                    let src_runs = self.src_runs.iter().find(|(k, _)| *k == src.kind).map(|(_, r)| r.as_slice()).unwrap_or(&[]);
                    let src_table = || self.src_table(src.block_size);
                    let mut pieces = 0;
                    for (k, out) in outs.iter_mut().enumerate() {
                        let k = k as u64;
                        let groups = k * per_chunk..if n_chunks == 1 { u64::MAX } else { (k + 1) * per_chunk };
                        let rows = RowsOut { descriptors: out, staged: &mut staged, staging: self.staging, src_table: &src_table };
                        pieces = plan_rows(producer, consumer, src, dst, src_runs, &pairs, self.tokens, groups, rows)?;
                    }
                    pieces
                }
                Distribution::HeadSplit => plan_heads(producer, consumer, src, dst, &pairs, &mut outs[last])?,
                Distribution::Replicated => plan_whole(producer, consumer, src, dst, &pairs, &mut outs[last])?,
            };
        }
        let mut descriptors = Vec::new();
        let mut chunks = Vec::new();
        for out in outs {
            descriptors.extend(out.finish());
            chunks.push(descriptors.len() as u32);
        }
        if self.chunk_tokens.is_none() {
            chunks.clear();
        }
        Ok(Plan { producer: producer.rank, consumer: consumer.rank, descriptors, staged, uncoalesced, chunks, layers: Vec::new() })
    }

    /// The plan of [`ProducerPlanner::layered`]: one coalescer and one list of
    /// staged groups a module layer, each kind planned row by row into its
    /// layer's, then laid out in layer order.
    fn plan_layered(&self, consumer: &ConsumerLayout, share: Share) -> Result<Plan, SplitError> {
        let producer = self.producer;
        let wanted = |src: &&RegionLayout| {
            !src.rows.is_empty()
                && match src.kind.distribution() {
                    Distribution::TokenSharded => share.rows,
                    Distribution::HeadSplit | Distribution::Replicated => share.state,
                }
        };
        let mut layers: Vec<ModuleLayer> = producer.layout.regions.iter().filter(wanted).flat_map(|r| r.rows.iter().map(|row| row.layer)).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut outs: Vec<Coalescer> = layers.iter().map(|_| Coalescer::default()).collect();
        let mut staged: Vec<Vec<StagedRows>> = layers.iter().map(|_| Vec::new()).collect();
        let mut uncoalesced = 0u64;
        let mut pairs = Vec::new();
        for src in producer.layout.regions.iter().filter(wanted) {
            let dst = consumer.layout.region(src.kind).ok_or(SplitError::MissingRegion { kind: src.kind, consumer: consumer.rank.tp, pp: producer.rank.pp })?;
            row_pairs(src, dst, consumer, &mut pairs)?;
            let src_runs = self.src_runs.iter().find(|(k, _)| *k == src.kind).map(|(_, r)| r.as_slice()).unwrap_or(&[]);
            let src_table = || self.src_table(src.block_size);
            for one in pairs.chunks(1) {
                // Every row's layer is in `layers`, which was collected from them.
                let Ok(i) = layers.binary_search(&one[0].0) else { continue };
                uncoalesced += match src.kind.distribution() {
                    Distribution::TokenSharded => {
                        let rows = RowsOut { descriptors: &mut outs[i], staged: &mut staged[i], staging: self.staging, src_table: &src_table };
                        plan_rows(producer, consumer, src, dst, src_runs, one, self.tokens, 0..u64::MAX, rows)?
                    }
                    Distribution::HeadSplit => plan_heads(producer, consumer, src, dst, one, &mut outs[i])?,
                    Distribution::Replicated => plan_whole(producer, consumer, src, dst, one, &mut outs[i])?,
                };
            }
        }
        let (mut descriptors, mut all_staged, mut parts) = (Vec::new(), Vec::new(), Vec::new());
        for ((layer, out), groups) in layers.into_iter().zip(outs).zip(staged) {
            let before = (descriptors.len(), all_staged.len());
            descriptors.extend(out.finish());
            all_staged.extend(groups);
            // A layer with nothing for this consumer is no part.
            if (descriptors.len(), all_staged.len()) != before {
                parts.push(LayerPart { layer, descriptors: descriptors.len() as u32, staged: all_staged.len() as u32 });
            }
        }
        Ok(Plan { producer: producer.rank, consumer: consumer.rank, descriptors, staged: all_staged, uncoalesced, chunks: Vec::new(), layers: parts })
    }
}

/// The consumer's row of each layer the producer holds, as (module layer, producer
/// row offset, consumer row offset), into `out`. A stage holds a run of layers and
/// both row tables are sorted by layer, so the consumer's next row is the one after
/// the last match; it is looked up only where that guess is wrong.
fn row_pairs(src: &RegionLayout, dst: &RegionLayout, consumer: &ConsumerLayout, out: &mut Vec<(ModuleLayer, u64, u64)>) -> Result<(), SplitError> {
    out.clear();
    let mut next = 0;
    for r in &src.rows {
        let i = match dst.rows.get(next) {
            Some(d) if d.layer == r.layer => next,
            _ => dst.rows.binary_search_by_key(&r.layer, |d| d.layer).map_err(|_| SplitError::MissingRow {
                kind: src.kind,
                consumer: consumer.rank.tp,
                layer: r.layer.0,
            })?,
        };
        next = i + 1;
        out.push((r.layer, r.offset, dst.rows[i].offset));
    }
    Ok(())
}

fn check_unit(kind: RegionKind, side: &'static str, what: &'static str, index: u32, region: &RegionLayout) -> Result<(), SplitError> {
    if index >= region.units {
        return Err(SplitError::OutOfRegion { kind, side, what, index, units: region.units });
    }
    Ok(())
}

/// A maximal run of positions whose blocks are physically consecutive.
#[derive(Debug, Clone, Copy)]
struct BlockRun {
    start: u64,
    end: u64,
    /// Row-relative byte offset of position `start`.
    base: u64,
}

/// The runs of the blocks that hold the first `limit` positions. With `units`, every
/// one of those blocks must lie below it: `Err` names the first that does not, in
/// block order, before any offset is taken from it.
fn runs(blocks: &[u32], block_size: u32, block_bytes: u64, token_bytes: u64, limit: u64, units: Option<u32>) -> Result<Vec<BlockRun>, u32> {
    let bs = block_size as u64;
    if bs == 0 {
        return Ok(Vec::new());
    }
    let blocks = &blocks[..limit.div_ceil(bs).min(blocks.len() as u64) as usize];
    let mut out: Vec<BlockRun> = Vec::new();
    if block_bytes == 0 || bs.checked_mul(token_bytes) != Some(block_bytes) {
        // Blocks that do not tile the row: checked, then merged block by block.
        if let Some(units) = units
            && let Some(&bad) = blocks.iter().find(|&&b| b >= units)
        {
            return Err(bad);
        }
        for (i, &b) in blocks.iter().enumerate() {
            let start = i as u64 * bs;
            let end = (start + bs).min(limit);
            let base = b as u64 * block_bytes;
            match out.last_mut() {
                Some(r) if r.end == start && r.base + (start - r.start) * token_bytes == base => r.end = end,
                _ => out.push(BlockRun { start, end, base }),
            }
        }
        return Ok(out);
    }
    // Blocks tile the row (a block is `block_size` tokens of `token_bytes`): positions
    // continue physically exactly where block numbers continue, so each run is one
    // scan for the end of a run of consecutive block numbers, and checked as a whole
    // (its blocks are `b .. b + n`).
    let mut i = 0;
    while i < blocks.len() {
        let (b, n) = (blocks[i], consecutive(&blocks[i..]));
        if let Some(units) = units
            && u64::from(b) + n as u64 > u64::from(units)
        {
            return Err(b.max(units));
        }
        out.push(BlockRun { start: i as u64 * bs, end: ((i + n) as u64 * bs).min(limit), base: u64::from(b).wrapping_mul(block_bytes) });
        i += n;
    }
    Ok(out)
}

/// How many leading entries of `blocks` (not empty) continue `blocks[0]` one by one:
/// compared a chunk at a time, so that a long run costs a few instructions a chunk.
fn consecutive(blocks: &[u32]) -> usize {
    const W: usize = 16;
    let b0 = blocks[0];
    if blocks.get(1).is_none_or(|&b| b.wrapping_sub(b0) != 1 || b0 == u32::MAX) {
        return 1;
    }
    // No number past u32::MAX: `b0 + k` never wraps below.
    let blocks = &blocks[..blocks.len().min((u32::MAX - b0) as usize + 1)];
    let mut n = 0;
    for chunk in blocks.chunks_exact(W) {
        let k = n as u32;
        if !chunk.iter().zip(0..W as u32).fold(true, |ok, (&b, j)| ok & (b.wrapping_sub(b0) == k + j)) {
            break;
        }
        n += W;
    }
    while n < blocks.len() && blocks[n].wrapping_sub(b0) == n as u32 {
        n += 1;
    }
    n
}

/// Where [`plan_rows`] puts a kind's rows: descriptors, or one staged group when
/// `staging` is set and staging takes fewer writes.
struct RowsOut<'o> {
    descriptors: &'o mut Coalescer,
    staged: &'o mut Vec<StagedRows>,
    staging: Option<u64>,
    /// The producer's shared block table, asked for only when a group is made.
    src_table: &'o dyn Fn() -> Arc<[u32]>,
}

/// Token-sharded rows: the tokens the consumer's dcp rank owns, as strided runs.
/// The row-relative template is built once and then instantiated for every layer.
/// Where the blocks do not line up and staging was asked for, the rows go out as
/// one staged group instead (see [`staged_rows`]).
#[allow(clippy::too_many_arguments)]
fn plan_rows(
    producer: &ProducerLayout,
    consumer: &ConsumerLayout,
    src: &RegionLayout,
    dst: &RegionLayout,
    src_runs: &[BlockRun],
    pairs: &[(ModuleLayer, u64, u64)],
    tokens: u64,
    groups: std::ops::Range<u64>,
    rows: RowsOut<'_>,
) -> Result<u64, SplitError> {
    let out = rows.descriptors;
    let kind = src.kind;
    let tb = src.token_bytes;
    if tb != dst.token_bytes {
        return Err(SplitError::Geometry { kind, what: "token bytes", producer: tb, consumer: dst.token_bytes });
    }
    let (s, dcp, d) = (consumer.interleave as u64, consumer.dcp as u64, consumer.dcp_rank() as u64);
    let owned = handoff_components::layout::owned_tokens(tokens, consumer.dcp, consumer.dcp_rank(), consumer.interleave);
    let need_src = tokens.div_ceil(src.block_size as u64);
    if (producer.blocks.len() as u64) < need_src {
        return Err(SplitError::ShortBlocks { kind, side: "producer", have: producer.blocks.len() as u64, need: need_src });
    }
    let need_dst = owned.div_ceil(dst.block_size as u64);
    if (consumer.blocks.len() as u64) < need_dst {
        return Err(SplitError::ShortBlocks { kind, side: "consumer", have: consumer.blocks.len() as u64, need: need_dst });
    }
    // Producer blocks were range-checked once, when its runs were built.
    if let Some(bad) = src_runs.iter().find(|r| r.base + (r.end - r.start) * tb > src.units as u64 * src.unit_stride) {
        return Err(SplitError::OutOfRegion { kind, side: "producer", what: "block", index: (bad.base / src.unit_stride) as u32, units: src.units });
    }
    let dst_runs = runs(&consumer.blocks, dst.block_size, dst.unit_stride, tb, owned, Some(dst.units)).map_err(|index| SplitError::OutOfRegion {
        kind,
        side: "consumer",
        what: "block",
        index,
        units: dst.units,
    })?;

    if let Some(bytes) = rows.staging
        && let Some(group) = staged_rows(consumer, src, dst, src_runs.len() + dst_runs.len(), pairs, tokens, owned, bytes, rows.src_table)
    {
        rows.staged.push(group);
        return Ok(owned * pairs.len() as u64);
    }

    // Template: copies relative to the row start, of the token groups in `groups`
    // (a chunk of a chunked transfer; all of them otherwise).
    let mut template = Coalescer::default();
    let (mut si, mut di) = (0usize, 0usize);
    let mut g = groups.start;
    loop {
        let p0 = g.saturating_mul(dcp).saturating_add(d).saturating_mul(s);
        if p0 >= tokens || g >= groups.end {
            break;
        }
        let lp0 = g * s;
        let glen = s.min(tokens - p0);
        while src_runs[si].end <= p0 {
            si += 1;
        }
        while dst_runs[di].end <= lp0 {
            di += 1;
        }
        let (sr, dr) = (src_runs[si], dst_runs[di]);
        if glen == s && p0 + s <= sr.end && lp0 + s <= dr.end {
            // Whole groups inside both runs form one arithmetic sequence.
            let m_src = (sr.end - p0 - s) / (s * dcp) + 1;
            let m_dst = (dr.end - lp0 - s) / s + 1;
            let m_tok = (tokens - p0 - s) / (s * dcp) + 1;
            let m = m_src.min(m_dst).min(m_tok).min(groups.end - g).min(u32::MAX as u64);
            template.push(Descriptor {
                kind,
                src_offset: sr.base + (p0 - sr.start) * tb,
                dst_offset: dr.base + (lp0 - dr.start) * tb,
                len: s * tb,
                count: m as u32,
                src_stride: s * dcp * tb,
                dst_stride: s * tb,
            });
            g += m;
        } else {
            // A group that crosses a run boundary: copy it piecewise.
            let mut t = 0;
            while t < glen {
                while src_runs[si].end <= p0 + t {
                    si += 1;
                }
                while dst_runs[di].end <= lp0 + t {
                    di += 1;
                }
                let (sr, dr) = (src_runs[si], dst_runs[di]);
                let n = (glen - t).min(sr.end - (p0 + t)).min(dr.end - (lp0 + t));
                template.push(Descriptor::copy(kind, sr.base + (p0 + t - sr.start) * tb, dr.base + (lp0 + t - dr.start) * tb, n * tb));
                t += n;
            }
            g += 1;
        }
    }
    let template = template.finish();
    for &(_, so, doff) in pairs {
        for t in &template {
            out.push(Descriptor { src_offset: t.src_offset + so, dst_offset: t.dst_offset + doff, ..*t });
        }
    }
    Ok(owned * pairs.len() as u64)
}

/// The staged group of one kind's rows, when it takes fewer writes than the
/// descriptors would: the template has at least one descriptor per run of
/// physically consecutive blocks on either side (less one, where two runs end
/// together), while a staged row takes one write per staging buffer of positions.
/// Writes are cut at whole consumer blocks where a buffer holds one, so that each
/// lands as whole blocks. `None`: plan descriptors (blocks that line up, or a token
/// row larger than the buffer).
#[allow(clippy::too_many_arguments)]
fn staged_rows(
    consumer: &ConsumerLayout,
    src: &RegionLayout,
    dst: &RegionLayout,
    runs: usize,
    pairs: &[(ModuleLayer, u64, u64)],
    tokens: u64,
    owned: u64,
    bytes: u64,
    src_table: &dyn Fn() -> Arc<[u32]>,
) -> Option<StagedRows> {
    let (tb, dbs) = (src.token_bytes, u64::from(dst.block_size));
    let mut per = bytes / tb;
    if per == 0 || owned == 0 {
        return None;
    }
    if per >= dbs {
        per -= per % dbs;
    }
    let per_row = owned.div_ceil(per);
    if (runs as u64).saturating_sub(1) <= per_row {
        return None;
    }
    // Each side's table cut to the blocks that hold the positions (see `src_table`).
    let src_blocks = src_table();
    let dst_blocks: Arc<[u32]> = Arc::from(&consumer.blocks[..(owned.div_ceil(dbs) as usize).min(consumer.blocks.len())]);
    let mut writes = Vec::with_capacity(per_row as usize * pairs.len());
    for row in 0..pairs.len() as u32 {
        let mut start = 0;
        while start < owned {
            let end = (start + per).min(owned);
            writes.push(StagedWrite { row, start, end });
            start = end;
        }
    }
    Some(StagedRows {
        kind: src.kind,
        token_bytes: tb,
        tokens,
        dcp: consumer.dcp,
        dcp_rank: consumer.dcp_rank(),
        interleave: consumer.interleave,
        src: StagedBlocks { blocks: src_blocks, block_size: src.block_size, block_stride: src.unit_stride },
        dst: StagedBlocks { blocks: dst_blocks, block_size: dst.block_size, block_stride: dst.unit_stride },
        rows: pairs.iter().map(|&(_, s, d)| (s, d)).collect(),
        staging_bytes: bytes,
        writes,
    })
}

/// Head-split state: the consumer's heads, from the producer's segment, per group.
fn plan_heads(
    producer: &ProducerLayout,
    consumer: &ConsumerLayout,
    src: &RegionLayout,
    dst: &RegionLayout,
    pairs: &[(ModuleLayer, u64, u64)],
    out: &mut Coalescer,
) -> Result<u64, SplitError> {
    let kind = src.kind;
    let (Some(ps), Some(cs)) = (&src.segment, &dst.segment) else {
        return Err(SplitError::Geometry { kind, what: "segments published", producer: src.segment.is_some() as u64, consumer: dst.segment.is_some() as u64 });
    };
    if cs.heads.start < ps.heads.start || cs.heads.end > ps.heads.end {
        return Err(SplitError::HeadsOutsideGroup {
            kind,
            consumer: consumer.rank.tp,
            c0: cs.heads.start,
            c1: cs.heads.end,
            pp: producer.rank.pp,
            producer: producer.rank.tp,
            p0: ps.heads.start,
            p1: ps.heads.end,
        });
    }
    if ps.groups.len() != cs.groups.len() {
        return Err(SplitError::Geometry { kind, what: "channel groups", producer: ps.groups.len() as u64, consumer: cs.groups.len() as u64 });
    }
    check_unit(kind, "producer", "slot", producer.slot, src)?;
    check_unit(kind, "consumer", "slot", consumer.slot, dst)?;
    let heads = (cs.heads.end - cs.heads.start) as u64;
    let head_off = (cs.heads.start - ps.heads.start) as u64;
    let src_slot = producer.slot as u64 * src.unit_stride;
    let dst_slot = consumer.slot as u64 * dst.unit_stride;
    let mut pieces = 0;
    for (pg, cg) in ps.groups.iter().zip(&cs.groups) {
        if pg.head_bytes != cg.head_bytes || pg.repeat != cg.repeat {
            return Err(SplitError::Geometry {
                kind,
                what: "head bytes x repeat",
                producer: pg.head_bytes * pg.repeat as u64,
                consumer: cg.head_bytes * cg.repeat as u64,
            });
        }
        if pg.repeat == 0 {
            continue;
        }
        // Group-major, then layer: consecutive layers of a slot continue the stride.
        for &(_, so, doff) in pairs {
            out.push(Descriptor {
                kind,
                src_offset: so + src_slot + pg.offset + head_off * pg.head_bytes,
                dst_offset: doff + dst_slot + cg.offset,
                len: heads * cg.head_bytes,
                count: pg.repeat,
                src_stride: pg.stride,
                dst_stride: cg.stride,
            });
            pieces += pg.repeat as u64;
        }
    }
    Ok(pieces)
}

/// Replicated per-slot data: each layer's unit written whole.
fn plan_whole(
    producer: &ProducerLayout,
    consumer: &ConsumerLayout,
    src: &RegionLayout,
    dst: &RegionLayout,
    pairs: &[(ModuleLayer, u64, u64)],
    out: &mut Coalescer,
) -> Result<u64, SplitError> {
    let kind = src.kind;
    if src.unit_bytes != dst.unit_bytes {
        return Err(SplitError::Geometry { kind, what: "unit bytes", producer: src.unit_bytes, consumer: dst.unit_bytes });
    }
    check_unit(kind, "producer", "slot", producer.slot, src)?;
    check_unit(kind, "consumer", "slot", consumer.slot, dst)?;
    for &(_, so, doff) in pairs {
        out.push(Descriptor::copy(kind, so + producer.slot as u64 * src.unit_stride, doff + consumer.slot as u64 * dst.unit_stride, src.unit_bytes));
    }
    Ok(pairs.len() as u64)
}

// ---- systems ----

use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::failure::{Cause, Failure};
use handoff_components::vocab::RankId;

/// Plans every (local producer, consumer) pair of each placed request from the
/// consumers' published layouts: those of this World's decode ranks, or the copy a
/// stage received with the request. A pair that cannot be planned fails the request.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn split_requests(
    mut commands: Commands,
    mut requests: Query<(Entity, &Request, &mut Status, &mut Holdings, Option<&RemoteConsumers>)>,
    leases: Query<(&Lease, Option<&Published>)>,
    regions: Query<&Region>,
    segments: Query<&Segment>,
    mut entries: Query<&mut ProducerEntry>,
    topo: Res<TopologyRes>,
    local: Res<LocalRanks>,
    transfers: Option<Res<crate::transfer::Transfers>>,
) {
    let prefill_tp = topo.0.prefill().tp;
    let staging = transfers.and_then(|t| t.0.staging_bytes());
    for (e, req, mut status, mut holdings, remote) in requests.iter_mut() {
        if *status != Status::Placed {
            continue;
        }
        let mut producers = Vec::new();
        let mut consumers: Vec<&ConsumerLayout> = remote.map(|r| r.0.iter().collect()).unwrap_or_default();
        for &l in &holdings.leases {
            let Ok((lease, published)) = leases.get(l) else { continue };
            match (lease.rank, published) {
                (RankId::Prefill(p), _) => producers.push(ProducerLayout {
                    rank: p,
                    blocks: lease.blocks.clone(),
                    slot: lease.slot,
                    layout: crate::placement::publish(lease.rank, &regions, &segments),
                }),
                (RankId::Decode(_), Some(p)) => consumers.push(&p.0),
                _ => {}
            }
        }
        let mut plans = Vec::new();
        let mut failure = None;
        let chunk = topo.0.config.prefill.chunked.then_some(u64::from(topo.0.config.prefill.chunk_tokens));
        let layered = topo.0.config.prefill.streams_layers();
        let planners: Vec<ProducerPlanner> =
            producers.iter().map(|p| ProducerPlanner::new(p, req.tokens).chunked(chunk).layered(layered).staging(staging)).collect();
        'pairs: for c in &consumers {
            for p in &planners {
                let sh = share(prefill_tp, c.tp, p.producer.rank.tp, c.rank.tp);
                if !sh.rows && !sh.state {
                    continue;
                }
                match p.plan(c, sh) {
                    Ok(plan) => plans.push(plan),
                    Err(err) => {
                        failure = Some(err.to_string());
                        break 'pairs;
                    }
                }
            }
        }
        if let Some(detail) = failure {
            // A consumer the producer cannot serve is refused at hand-off time
            // (docs/design.md section 3).
            *status = Status::Failed(Failure::new(PhaseName::Transfer, local.role(), Cause::Refused { detail }));
            continue;
        }
        for plan in plans {
            if let Some(entry) = holdings.entries.iter().find(|&&pe| entries.get(pe).is_ok_and(|x| x.stage == plan.producer.pp))
                && let Ok(mut entry) = entries.get_mut(*entry)
            {
                entry.pending += 1;
            }
            holdings.plans.push(commands.spawn(PlanEntry::new(e, plan)).id());
        }
        *status = Status::Planned;
    }
}

#[cfg(test)]
mod tests;
