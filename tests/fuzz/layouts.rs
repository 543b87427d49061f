//! The consumer layouts a prefill stage plans from: valid ones and edits of them.

use super::*;
use handoff::roles::wire::{self, Admitted, Msg, WirePrefillJob};
use handoff::transport::PeerAddr;
use handoff_components::Topology;
use handoff_components::layout::ConsumerLayout;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId};
use handoff_systems::placement::place_rank;
use std::fmt::Debug;
use std::io::Cursor;

// ---- published consumer layouts ----

/// One edit of a consumer layout as decode publishes it (indices modulo what exists).
#[derive(Debug, Clone)]
pub enum LayoutEdit {
    /// tp, dcp, interleave, rank, slot.
    Instance {
        field: usize,
        value: u32,
    },
    /// A block id, or the block list's length.
    Block {
        at: usize,
        value: u32,
    },
    Blocks {
        len: usize,
    },
    /// A numeric field of a region: unit_stride, units, block_size, token_bytes, unit_bytes, len.
    Region {
        region: usize,
        field: usize,
        value: u64,
    },
    /// A row's layer or offset, or a row dropped.
    Row {
        region: usize,
        row: usize,
        layer: Option<u32>,
        offset: Option<u64>,
    },
    DropRow {
        region: usize,
        row: usize,
    },
    /// A segment's head range, or one of its groups' fields.
    Heads {
        region: usize,
        start: u32,
        end: u32,
    },
    Group {
        region: usize,
        group: usize,
        field: usize,
        value: u64,
    },
    DropRegion {
        region: usize,
    },
}

/// A request to plan: its tokens, the consumer rank, and the edits of its layout.
#[derive(Debug, Clone)]
pub struct LayoutCase {
    pub tokens: u64,
    pub consumer: u32,
    pub edits: Vec<LayoutEdit>,
}

pub fn small_topology() -> Topology {
    Topology::parse(SHIPPED_CONFIGS[3].1).expect("small.toml is valid")
}

/// Blocks and slots of the fuzzed pools: room for the longest case.
const LAYOUT_BLOCKS: u32 = 8;
const LAYOUT_SLOTS: u32 = 4;

fn layout_edit() -> impl Strategy<Value = LayoutEdit> {
    prop_oneof![
        2 => (0usize..5, u32_edge()).prop_map(|(field, value)| LayoutEdit::Instance { field, value }),
        2 => (any::<usize>(), u32_edge()).prop_map(|(at, value)| LayoutEdit::Block { at, value }),
        1 => (0usize..12).prop_map(|len| LayoutEdit::Blocks { len }),
        4 => (any::<usize>(), 0usize..6, u64_edge()).prop_map(|(region, field, value)| LayoutEdit::Region { region, field, value }),
        2 => (any::<usize>(), any::<usize>(), prop::option::of(u32_edge()), prop::option::of(u64_edge()))
            .prop_map(|(region, row, layer, offset)| LayoutEdit::Row { region, row, layer, offset }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(region, row)| LayoutEdit::DropRow { region, row }),
        2 => (any::<usize>(), u32_edge(), u32_edge()).prop_map(|(region, start, end)| LayoutEdit::Heads { region, start, end }),
        3 => (any::<usize>(), any::<usize>(), 0usize..4, u64_edge()).prop_map(|(region, group, field, value)| LayoutEdit::Group { region, group, field, value }),
        1 => any::<usize>().prop_map(|region| LayoutEdit::DropRegion { region }),
    ]
}

pub fn layout_case() -> impl Strategy<Value = LayoutCase> {
    (1u64..=LAYOUT_BLOCKS as u64 * 16, 0u32..2, prop::collection::vec(layout_edit(), 0..4)).prop_map(|(tokens, consumer, edits)| LayoutCase {
        tokens,
        consumer,
        edits,
    })
}

fn apply_layout_edit(c: &mut ConsumerLayout, e: &LayoutEdit) {
    let regions = c.layout.regions.len();
    match e {
        LayoutEdit::Instance { field, value } => match field {
            0 => c.tp = *value,
            1 => c.dcp = *value,
            2 => c.interleave = *value,
            3 => c.rank.tp = *value,
            _ => c.slot = *value,
        },
        LayoutEdit::Block { at, value } => {
            if !c.blocks.is_empty() {
                let n = c.blocks.len();
                c.blocks[at % n] = *value;
            }
        }
        LayoutEdit::Blocks { len } => c.blocks.resize(*len, 0),
        LayoutEdit::DropRegion { region } if regions > 0 => {
            c.layout.regions.remove(region % regions);
        }
        _ if regions == 0 => {}
        LayoutEdit::Region { region, field, value } => {
            let r = &mut c.layout.regions[region % regions];
            let v32 = u32::try_from(*value).unwrap_or(u32::MAX);
            match field {
                0 => r.unit_stride = *value,
                1 => r.units = v32,
                2 => r.block_size = v32,
                3 => r.token_bytes = *value,
                4 => r.unit_bytes = *value,
                _ => r.len = *value,
            }
        }
        LayoutEdit::Row { region, row, layer, offset } => {
            let r = &mut c.layout.regions[region % regions];
            if !r.rows.is_empty() {
                let n = r.rows.len();
                let row = &mut r.rows[row % n];
                if let Some(l) = layer {
                    row.layer = handoff_components::vocab::ModuleLayer(*l);
                }
                if let Some(o) = offset {
                    row.offset = *o;
                }
            }
        }
        LayoutEdit::DropRow { region, row } => {
            let r = &mut c.layout.regions[region % regions];
            if !r.rows.is_empty() {
                let n = r.rows.len();
                r.rows.remove(row % n);
            }
        }
        LayoutEdit::Heads { region, start, end } => {
            if let Some(seg) = &mut c.layout.regions[region % regions].segment {
                seg.heads = *start..*end;
            }
        }
        LayoutEdit::Group { region, group, field, value } => {
            if let Some(seg) = &mut c.layout.regions[region % regions].segment
                && !seg.groups.is_empty()
            {
                let n = seg.groups.len();
                let g = &mut seg.groups[group % n];
                match field {
                    0 => g.offset = *value,
                    1 => g.head_bytes = *value,
                    2 => g.stride = *value,
                    _ => g.repeat = u32::try_from(*value).unwrap_or(u32::MAX),
                }
            }
        }
        LayoutEdit::DropRegion { .. } => {}
    }
}

/// What a prefill stage does with a published layout: decode it from the job's
/// line and plan its copies. A plan is refused with a reason, or every copy lies
/// inside the region the consumer published (the transport then checks the real one).
pub fn check_layout(topo: &Topology, case: &LayoutCase) -> Verdict {
    use handoff_systems::splitting::{ProducerPlanner, share};
    let d = DecodeRank { tp: case.consumer % topo.decode().tp };
    let blocks_for = |bs: u32| (0..(case.tokens.div_ceil(u64::from(bs)) as u32)).collect::<Vec<u32>>();
    let mut consumer = ConsumerLayout {
        rank: d,
        tp: topo.decode().tp,
        dcp: topo.decode().dcp,
        interleave: topo.decode().interleave,
        // The blocks in reverse: not one contiguous run.
        blocks: blocks_for(topo.decode().block_size).into_iter().rev().collect(),
        slot: LAYOUT_SLOTS - 1,
        layout: place_rank(topo, RankId::Decode(d), LAYOUT_BLOCKS, LAYOUT_SLOTS),
    };
    for e in &case.edits {
        apply_layout_edit(&mut consumer, e);
    }
    let admitted = Admitted { id: 1, nonce: 1, consumers: vec![consumer], handles: vec![], endpoint: PeerAddr::Local { instance: 1 } };
    let job = WirePrefillJob { admitted, prompt: vec![b'x'; case.tokens as usize], stage: 0, stages: vec![], hidden: None, sampling: None };
    let mut line = Vec::new();
    wire::encode_into(&mut line, &Msg::Prefill(Box::new(job))).map_err(|e| format!("encode: {e}"))?;
    let Ok(Some(Msg::Prefill(job))) = wire::recv(&mut Cursor::new(&line)) else {
        return Err("a job line did not decode".into());
    };
    let consumer = &job.admitted.consumers[0];
    let p = topo.prefill();
    let mut outcome = "planned";
    for stage in 0..p.pp {
        for tp in 0..p.tp {
            let rank = PrefillRank { pp: stage, tp };
            let producer = handoff_components::layout::ProducerLayout {
                rank,
                blocks: blocks_for(p.block_size),
                slot: 0,
                layout: place_rank(topo, RankId::Prefill(rank), LAYOUT_BLOCKS, LAYOUT_SLOTS),
            };
            let sh = share(p.tp, consumer.tp, tp, consumer.rank.tp);
            if !sh.rows && !sh.state {
                continue;
            }
            match ProducerPlanner::new(&producer, case.tokens).plan(consumer, sh) {
                Err(e) if case.edits.is_empty() => return Err(format!("the layout placement publishes was refused: {e}")),
                Err(e) => {
                    if e.to_string().trim().is_empty() {
                        return Err(format!("a refusal without a message: {e:?}"));
                    }
                    outcome = "refused";
                }
                Ok(plan) => {
                    for (i, d) in plan.descriptors.iter().enumerate() {
                        let Some(r) = consumer.layout.region(d.kind) else {
                            return Err(format!("descriptor {i} writes {} that the consumer did not publish", d.kind.name()));
                        };
                        let end = if d.count == 0 || d.len == 0 {
                            Some(d.dst_offset)
                        } else {
                            u64::from(d.count - 1).checked_mul(d.dst_stride).and_then(|x| x.checked_add(d.dst_offset)?.checked_add(d.len))
                        };
                        if end.is_none_or(|e| e > r.len) {
                            return Err(format!("descriptor {i} {d:?} ends past the published {} B of {}", r.len, d.kind.name()));
                        }
                    }
                }
            }
        }
    }
    Ok(if case.edits.is_empty() { "valid, planned".into() } else { format!("edited, {outcome}") })
}
