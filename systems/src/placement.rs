//! Placement: where each region's rows and segments lie on a rank (docs/layout.md).
//!
//! Pure functions over the topology; the placement system calls them once per rank at
//! startup and tests call them directly.

use handoff_components::config::Topology;
use handoff_components::layout::{HeadGroup, RankLayout, RegionLayout, Row, SegmentSpec};
use handoff_components::vocab::{Distribution, ModuleLayer, RankId, RegionKind};
use smallvec::SmallVec;

/// The module layers a rank holds: its stage's layers on prefill, all on decode.
pub fn rank_layers(topo: &Topology, rank: RankId) -> std::ops::Range<u32> {
    match rank {
        RankId::Prefill(p) => topo.stage_layers[p.pp as usize].clone(),
        RankId::Decode(_) => 0..topo.num_layers(),
    }
}

/// The global KDA heads a rank holds.
pub fn rank_heads(topo: &Topology, rank: RankId) -> std::ops::Range<u32> {
    let (tp, heads) = match rank {
        RankId::Prefill(p) => (p.tp, topo.prefill_heads()),
        RankId::Decode(d) => (d.tp, topo.decode_heads()),
    };
    tp * heads..(tp + 1) * heads
}

/// Lays out every region of one rank. `blocks` and `slots` are the capacities of its
/// paged and per-slot regions.
pub fn place_rank(topo: &Topology, rank: RankId, blocks: u32, slots: u32) -> RankLayout {
    let regions = topo.region_kinds().into_iter().map(|kind| place_region(topo, rank, kind, blocks, slots)).collect();
    RankLayout { rank, regions }
}

fn place_region(topo: &Topology, rank: RankId, kind: RegionKind, blocks: u32, slots: u32) -> RegionLayout {
    let layers = topo.layers_of(kind.layer_kind(), rank_layers(topo, rank));
    let nrows = layers.len() as u64;
    if kind.is_paged() {
        let block_size = match rank {
            RankId::Prefill(_) => topo.prefill().block_size,
            RankId::Decode(_) => topo.decode().block_size,
        };
        let token_bytes = topo.token_bytes(kind);
        let block_bytes = block_size as u64 * token_bytes;
        let row_bytes = blocks as u64 * block_bytes;
        RegionLayout {
            kind,
            rows: rows(&layers, row_bytes),
            unit_stride: block_bytes,
            units: blocks,
            block_size,
            token_bytes,
            unit_bytes: block_bytes,
            segment: None,
            len: nrows * row_bytes,
        }
    } else {
        let heads = rank_heads(topo, rank);
        let hl = heads.len() as u32;
        let unit_bytes = topo.slot_layer_bytes(kind, hl);
        let segment = (kind.distribution() == Distribution::HeadSplit).then(|| {
            let mut groups: SmallVec<[HeadGroup; 3]> = SmallVec::new();
            let mut offset = 0;
            for g in topo.head_groups(kind) {
                let stride = g.head_bytes * hl as u64;
                groups.push(HeadGroup { offset, head_bytes: g.head_bytes, stride, repeat: g.repeat });
                offset += stride * g.repeat as u64;
            }
            // Conv repeats a whole [q|k|v] row per conv step: the groups interleave.
            if kind == RegionKind::KdaConv {
                let row: u64 = groups.iter().map(|g| g.stride).sum();
                let mut off = 0;
                for g in groups.iter_mut() {
                    g.offset = off;
                    off += g.stride;
                    g.stride = row;
                }
            }
            SegmentSpec { heads, groups }
        });
        RegionLayout {
            kind,
            rows: rows(&layers, unit_bytes),
            unit_stride: nrows * unit_bytes,
            units: slots,
            block_size: 0,
            token_bytes: 0,
            unit_bytes,
            segment,
            len: slots as u64 * nrows * unit_bytes,
        }
    }
}

fn rows(layers: &[ModuleLayer], row_bytes: u64) -> Vec<Row> {
    layers.iter().enumerate().map(|(i, &layer)| Row { layer, offset: i as u64 * row_bytes }).collect()
}

pub use handoff_components::layout::{blocks_for, owned_tokens};

// ---- systems ----

use bevy_ecs::prelude::*;
use handoff_components::ecs::*;
use handoff_components::layout::ConsumerLayout;
use handoff_components::vocab::{DecodeRank, PrefillRank};
use std::time::{Duration, Instant};

/// Every rank of the topology.
pub fn all_ranks(topo: &Topology) -> Vec<RankId> {
    local_ranks(topo, &LocalRanks { stages: (0..topo.prefill().pp).collect(), decode: true })
}

/// The ranks a World of `local` holds: its stages' TP ranks, then the decode ranks.
pub fn local_ranks(topo: &Topology, local: &LocalRanks) -> Vec<RankId> {
    let p = topo.prefill();
    let mut v: Vec<RankId> = local.stages.iter().flat_map(|&pp| (0..p.tp).map(move |tp| RankId::Prefill(PrefillRank { pp, tp }))).collect();
    if local.decode {
        v.extend((0..topo.decode().tp).map(|tp| RankId::Decode(DecodeRank { tp })));
    }
    v
}

/// Capacity of the per-rank pools.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    pub prefill_blocks: u32,
    pub decode_blocks: u32,
    pub slots: u32,
}

impl Capacity {
    /// Room for `requests` requests of up to `tokens` tokens each on every rank.
    pub fn for_requests(topo: &Topology, requests: u32, tokens: u64) -> Capacity {
        let d = topo.decode();
        let owned = owned_tokens(tokens, d.dcp, 0, d.interleave);
        Capacity {
            prefill_blocks: (requests as u64 * blocks_for(tokens, topo.prefill().block_size)) as u32,
            decode_blocks: (requests as u64 * blocks_for(owned, d.block_size)) as u32,
            slots: requests,
        }
    }

    /// The serving capacity: `serve.max_requests` requests of `serve.max_context`.
    pub fn serving(topo: &Topology) -> Capacity {
        let s = &topo.config.serve;
        Capacity::for_requests(topo, s.max_requests, s.max_context as u64)
    }
}

/// Startup: spawns this World's ranks, their regions and segments, and fills the pools.
pub fn spawn_ranks(world: &mut World, topo: &Topology, cap: Capacity, local: &LocalRanks) {
    let mut pools = Pools::default();
    for rank in local_ranks(topo, local) {
        let blocks = match rank {
            RankId::Prefill(_) => cap.prefill_blocks,
            RankId::Decode(_) => cap.decode_blocks,
        };
        world.spawn(Rank { id: rank });
        for mut layout in place_rank(topo, rank, blocks, cap.slots).regions {
            if let Some(spec) = layout.segment.take() {
                world.spawn(Segment { rank, kind: layout.kind, spec });
            }
            world.spawn(Region { rank, layout });
        }
        pools.0.insert(rank, RankPool::new(blocks, cap.slots));
    }
    world.insert_resource(pools);
    world.insert_resource(local.clone());
}

/// Allocates `n` blocks: one contiguous range when one is free (first fit), else
/// the lowest free blocks. `None` leaves the pool unchanged.
pub fn alloc_blocks(pool: &mut RankPool, n: u32) -> Option<Vec<u32>> {
    if n == 0 {
        return Some(Vec::new());
    }
    if pool.free_block_count() < n as u64 {
        return None;
    }
    if let Some((&start, &len)) = pool.free_blocks.iter().find(|&(_, &len)| len >= n) {
        pool.free_blocks.remove(&start);
        if len > n {
            pool.free_blocks.insert(start + n, len - n);
        }
        return Some((start..start + n).collect());
    }
    let mut out = Vec::with_capacity(n as usize);
    while (out.len() as u32) < n {
        let (&start, &len) = pool.free_blocks.iter().next()?;
        let take = len.min(n - out.len() as u32);
        pool.free_blocks.remove(&start);
        if len > take {
            pool.free_blocks.insert(start + take, len - take);
        }
        out.extend(start..start + take);
    }
    Some(out)
}

/// Returns blocks to the pool, merging neighbouring free ranges.
pub fn free_blocks(pool: &mut RankPool, blocks: &[u32]) {
    for &b in blocks {
        let mut start = b;
        let mut len = 1;
        if let Some((&ps, &pl)) = pool.free_blocks.range(..b).next_back()
            && ps + pl == b
        {
            pool.free_blocks.remove(&ps);
            start = ps;
            len += pl;
        }
        if let Some(nl) = pool.free_blocks.remove(&(b + 1)) {
            len += nl;
        }
        pool.free_blocks.insert(start, len);
    }
}

/// Gives a lease's blocks and slot back to its rank's pool.
pub fn release_lease(pools: &mut Pools, lease: &Lease) {
    if let Some(pool) = pools.0.get_mut(&lease.rank) {
        free_blocks(pool, &lease.blocks);
        pool.free_slots.push(lease.slot);
    }
}

/// Blocks a request of `tokens` tokens needs on one rank.
pub fn blocks_needed(topo: &Topology, rank: RankId, tokens: u64) -> u32 {
    match rank {
        RankId::Prefill(_) => blocks_for(tokens, topo.prefill().block_size) as u32,
        RankId::Decode(r) => {
            let d = topo.decode();
            blocks_for(owned_tokens(tokens, d.dcp, r.dcp_rank(d.dcp), d.interleave), d.block_size) as u32
        }
    }
}

/// How many producers report their writes into decode rank `consumer`: every
/// (stage, tp) whose share reaches it (docs/design.md section 4). Decode knows this from
/// the topology alone, without planning pairs it never executes.
pub fn expected_reports(topo: &Topology, consumer: DecodeRank) -> u32 {
    let (p, d) = (topo.prefill(), topo.decode());
    let per_stage = (0..p.tp)
        .filter(|&tp| {
            let sh = crate::share::share(p.tp, d.tp, tp, consumer.tp);
            sh.rows || sh.state
        })
        .count() as u32;
    per_stage * p.pp
}

/// Gives waiting requests, oldest first, their blocks and slots on every local rank
/// and publishes each local decode rank's layout. Stops at the first that does not
/// fit, so a large request is not starved by later small ones.
#[allow(clippy::too_many_arguments)]
pub fn place_requests(
    mut commands: Commands,
    mut requests: Query<(Entity, &Request, &mut Status, &mut Deadline, &mut Holdings)>,
    topo: Res<TopologyRes>,
    local: Res<LocalRanks>,
    mut pools: ResMut<Pools>,
    regions: Query<&Region>,
    segments: Query<&Segment>,
    mut events: MessageWriter<EngineEvent>,
    mut waiting: Local<Vec<(u64, Entity)>>,
) {
    let topo = &topo.0;
    waiting.clear();
    waiting.extend(requests.iter().filter(|(_, _, s, _, _)| **s == Status::Waiting).map(|(e, r, ..)| (r.id, e)));
    if waiting.is_empty() {
        return;
    }
    waiting.sort_unstable();
    let ranks: Vec<RankId> = pools.0.keys().copied().collect();
    for &(_, e) in waiting.iter() {
        let Ok((e, req, mut status, mut deadline, mut holdings)) = requests.get_mut(e) else { continue };
        let fits = ranks.iter().all(|r| {
            let p = &pools.0[r];
            p.free_block_count() >= blocks_needed(topo, *r, req.tokens) as u64 && !p.free_slots.is_empty()
        });
        if !fits {
            break;
        }
        let mut consumers = Vec::new();
        for &rank in &ranks {
            let Some(pool) = pools.0.get_mut(&rank) else { continue };
            let (Some(blocks), Some(slot)) = (alloc_blocks(pool, blocks_needed(topo, rank, req.tokens)), pool.free_slots.pop()) else {
                continue; // checked above
            };
            let mut lease = commands.spawn(Lease { rank, blocks: blocks.clone(), slot });
            if let RankId::Decode(d) = rank {
                let dc = topo.decode();
                let layout = publish(rank, &regions, &segments);
                let published = ConsumerLayout { rank: d, tp: dc.tp, dcp: dc.dcp, interleave: dc.interleave, blocks, slot, layout };
                consumers.push(published.clone());
                lease.insert((Published(published), ConsumerProgress { expected: expected_reports(topo, d), reported: Vec::new() }));
            }
            holdings.leases.push(lease.id());
        }
        for &stage in &local.stages {
            holdings.entries.push(commands.spawn(ProducerEntry { request: e, stage, pending: 0 }).id());
        }
        if !consumers.is_empty() {
            events.write(EngineEvent::Published { request: req.id, nonce: req.nonce, consumers });
        }
        *status = Status::Placed;
        *deadline = Deadline { phase: PhaseName::Compute, at: Instant::now() + Duration::from_secs_f64(topo.config.timeouts.compute_s) };
    }
}

/// A rank's layout as it publishes it: its regions with their segments joined in.
pub fn publish(rank: RankId, regions: &Query<&Region>, segments: &Query<&Segment>) -> RankLayout {
    let mut out: Vec<RegionLayout> = regions.iter().filter(|r| r.rank == rank).map(|r| r.layout.clone()).collect();
    for s in segments.iter().filter(|s| s.rank == rank) {
        if let Some(r) = out.iter_mut().find(|r| r.kind == s.kind) {
            r.segment = Some(s.spec.clone());
        }
    }
    out.sort_by_key(|r| r.kind);
    RankLayout { rank, regions: out }
}
