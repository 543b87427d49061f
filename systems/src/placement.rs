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
    let regions = topo
        .region_kinds()
        .into_iter()
        .map(|kind| place_region(topo, rank, kind, blocks, slots))
        .collect();
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
    layers
        .iter()
        .enumerate()
        .map(|(i, &layer)| Row { layer, offset: i as u64 * row_bytes })
        .collect()
}

/// Decode pages a dcp rank needs for `tokens` prompt tokens: the tokens it owns over
/// the decode block size.
pub fn owned_tokens(tokens: u64, dcp: u32, dcp_rank: u32, interleave: u32) -> u64 {
    let (s, dcp, d) = (interleave as u64, dcp as u64, dcp_rank as u64);
    let round = s * dcp;
    let full = tokens / round;
    let rem = tokens % round;
    full * s + rem.saturating_sub(d * s).min(s)
}

pub fn blocks_for(tokens: u64, block_size: u32) -> u64 {
    tokens.div_ceil(block_size as u64)
}
