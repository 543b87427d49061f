//! Splitting: the descriptors of one (producer, consumer) pair, planned from the
//! producer's own layout and the consumer's *published* layout alone (never from
//! global knowledge), so the same code serves when the roles are separate processes.

use crate::coalesce::Coalescer;
pub use crate::share::{Share, share};
use handoff_components::layout::{ConsumerLayout, ProducerLayout, RegionLayout};
use handoff_components::plan::{Descriptor, Plan};
use handoff_components::vocab::{Distribution, ModuleLayer, RegionKind};
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
        if r.units > 0 {
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
}

impl<'a> ProducerPlanner<'a> {
    pub fn new(producer: &'a ProducerLayout, tokens: u64) -> Self {
        let src_runs = producer
            .layout
            .regions
            .iter()
            .filter(|r| r.kind.is_paged())
            .map(|r| (r.kind, runs(&producer.blocks, r.block_size, r.unit_stride, r.token_bytes, tokens)))
            .collect();
        ProducerPlanner { producer, tokens, src_runs }
    }

    pub fn plan(&self, consumer: &ConsumerLayout, share: Share) -> Result<Plan, SplitError> {
        check_consumer(consumer)?;
        let producer = self.producer;
        let mut out = Coalescer::default();
        let mut uncoalesced = 0u64;
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
            let pairs = row_pairs(src, dst, consumer)?;
            uncoalesced += match src.kind.distribution() {
                Distribution::TokenSharded => {
                    let src_runs = self.src_runs.iter().find(|(k, _)| *k == src.kind).map(|(_, r)| r.as_slice()).unwrap_or(&[]);
                    plan_rows(producer, consumer, src, dst, src_runs, &pairs, self.tokens, &mut out)?
                }
                Distribution::HeadSplit => plan_heads(producer, consumer, src, dst, &pairs, &mut out)?,
                Distribution::Replicated => plan_whole(producer, consumer, src, dst, &pairs, &mut out)?,
            };
        }
        Ok(Plan { producer: producer.rank, consumer: consumer.rank, descriptors: out.finish(), uncoalesced })
    }
}

/// (producer row offset, consumer row offset) for each module layer the producer holds.
fn row_pairs(src: &RegionLayout, dst: &RegionLayout, consumer: &ConsumerLayout) -> Result<Vec<(ModuleLayer, u64, u64)>, SplitError> {
    src.rows
        .iter()
        .map(|r| {
            let d = dst.row(r.layer).ok_or(SplitError::MissingRow { kind: src.kind, consumer: consumer.rank.tp, layer: r.layer.0 })?;
            Ok((r.layer, r.offset, d.offset))
        })
        .collect()
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

fn runs(blocks: &[u32], block_size: u32, block_bytes: u64, token_bytes: u64, limit: u64) -> Vec<BlockRun> {
    let bs = block_size as u64;
    let mut out: Vec<BlockRun> = Vec::new();
    for (i, &b) in blocks.iter().enumerate() {
        let start = i as u64 * bs;
        if start >= limit {
            break;
        }
        let end = (start + bs).min(limit);
        let base = b as u64 * block_bytes;
        match out.last_mut() {
            Some(r) if r.end == start && r.base + (start - r.start) * token_bytes == base => r.end = end,
            _ => out.push(BlockRun { start, end, base }),
        }
    }
    out
}

/// Token-sharded rows: the tokens the consumer's dcp rank owns, as strided runs.
/// The row-relative template is built once and then instantiated for every layer.
#[allow(clippy::too_many_arguments)]
fn plan_rows(
    producer: &ProducerLayout,
    consumer: &ConsumerLayout,
    src: &RegionLayout,
    dst: &RegionLayout,
    src_runs: &[BlockRun],
    pairs: &[(ModuleLayer, u64, u64)],
    tokens: u64,
    out: &mut Coalescer,
) -> Result<u64, SplitError> {
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
    for &b in &consumer.blocks[..need_dst as usize] {
        check_unit(kind, "consumer", "block", b, dst)?;
    }
    let dst_runs = runs(&consumer.blocks, dst.block_size, dst.unit_stride, tb, owned);

    // Template: copies relative to the row start.
    let mut template = Coalescer::default();
    let (mut si, mut di) = (0usize, 0usize);
    let mut g = 0u64;
    loop {
        let p0 = (g * dcp + d) * s;
        if p0 >= tokens {
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
            let m = m_src.min(m_dst).min(m_tok).min(u32::MAX as u64);
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
) {
    let prefill_tp = topo.0.prefill().tp;
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
        let planners: Vec<ProducerPlanner> = producers.iter().map(|p| ProducerPlanner::new(p, req.tokens)).collect();
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
            holdings.plans.push(commands.spawn(PlanEntry { request: e, plan, state: WriteState::Pending }).id());
        }
        *status = Status::Planned;
    }
}
