//! The planner's tests: runs, rows, heads and the phase system.

use super::*;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId};
use proptest::prelude::*;

/// The runs block by block, checked block by block: what `runs` computed before
/// it scanned runs of consecutive block numbers.
fn runs_by_block(blocks: &[u32], bs: u32, block_bytes: u64, tb: u64, limit: u64, units: Option<u32>) -> Result<Vec<(u64, u64, u64)>, u32> {
    let bs = bs as u64;
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (i, &b) in blocks.iter().enumerate() {
        let start = i as u64 * bs;
        if start >= limit {
            break;
        }
        if units.is_some_and(|u| b >= u) {
            return Err(b);
        }
        let (end, base) = ((start + bs).min(limit), b as u64 * block_bytes);
        match out.last_mut() {
            Some(r) if r.1 == start && r.2 + (start - r.0) * tb == base => r.1 = end,
            _ => out.push((start, end, base)),
        }
    }
    Ok(out)
}

fn triples(r: Result<Vec<BlockRun>, u32>) -> Result<Vec<(u64, u64, u64)>, u32> {
    r.map(|v| v.iter().map(|r| (r.start, r.end, r.base)).collect())
}

proptest! {
    // Runs of consecutive blocks, jumps, repeats and blocks near u32::MAX; tiling
    // and non-tiling block strides; limits inside, at and past the blocks.
    #[test]
    fn scanned_runs_equal_the_block_by_block_runs(
        pieces in proptest::collection::vec((0u32..40, 1usize..40), 1..12),
        high in any::<bool>(),
        bs in 1u32..5,
        tb in 1u64..4,
        pad in 0u64..3,
        limit_frac in 0u64..=110,
        units_cut in 0u32..50,
    ) {
        let mut blocks = Vec::new();
        for (first, n) in pieces {
            let first = if high { u32::MAX - first } else { first };
            blocks.extend((0..n as u32).map_while(|k| first.checked_add(k)));
        }
        let limit = blocks.len() as u64 * bs as u64 * limit_frac / 100;
        let block_bytes = bs as u64 * tb + pad;
        let units = if high { u32::MAX - units_cut } else { 40 - units_cut.min(40) };
        for units in [Some(units), None] {
            let want = runs_by_block(&blocks, bs, block_bytes, tb, limit, units);
            prop_assert_eq!(triples(runs(&blocks, bs, block_bytes, tb, limit, units)), want);
        }
    }
}

/// A tiny hybrid topology (config/small.toml's model) with the given parallel shape.
fn topology(pp: u32, ptp: u32, pbs: u32, dtp: u32, dcp: u32, interleave: u32, dbs: u32) -> Option<handoff_components::Topology> {
    let model = include_str!("../../../config/small.toml").split("[prefill]").next()?;
    let text = format!(
        "{model}[prefill]\npp = {pp}\ntp = {ptp}\nblock_size = {pbs}\n\n[decode]\ntp = {dtp}\ndcp = {dcp}\ninterleave = {interleave}\nblock_size = {dbs}\n"
    );
    handoff_components::Topology::parse(&text).ok()
}

/// A block table of `n` blocks of one of the shapes a pool hands out or a peer
/// publishes: consecutive from `start` (a fresh pool starts at 0, a used one
/// anywhere), reversed, scattered at random with repeats, runs of 3 with gaps,
/// or a run that keeps coming back to `start` (a table sharing blocks with itself).
fn table(shape: u8, n: usize, start: u32, scatter: &[u32], modulo: u32) -> Vec<u32> {
    let n32 = n as u32;
    match shape % 5 {
        0 => (start..start + n32).collect(),
        1 => (0..n32).rev().map(|k| start + k).collect(),
        2 => scatter.iter().cycle().take(n).map(|&b| start / 4 + b % modulo.max(1)).collect(),
        3 => (0..n32).map(|k| start + k + k / 3 * 2).collect(),
        _ => (0..n32).map(|k| if k % 4 == 3 { start } else { start + k }).collect(),
    }
}

/// The token rows a plan copies, as sorted (kind, destination, source) byte
/// offsets of each token's row piece: its token-sharded descriptors expanded.
fn planned_token_rows(plan: &Plan, token_bytes: impl Fn(RegionKind) -> u64) -> Vec<(RegionKind, u64, u64)> {
    let mut out = Vec::new();
    for d in plan.descriptors.iter().filter(|d| d.kind.distribution() == Distribution::TokenSharded) {
        let tb = token_bytes(d.kind);
        assert_eq!(d.len % tb, 0, "{d:?} copies a part of a token row of {tb} B");
        for k in 0..u64::from(d.count) {
            for j in 0..d.len / tb {
                out.push((d.kind, d.dst_offset + k * d.dst_stride + j * tb, d.src_offset + k * d.src_stride + j * tb));
            }
        }
    }
    out.sort_unstable();
    out
}

/// (region kind, producer row, consumer row) of every token row, or the
/// side and block that fell outside its region.
type TokenRows = Result<Vec<(RegionKind, u64, u64)>, (&'static str, u32)>;

/// The same, token by token from the two block tables (the DCP rule of
/// docs/design.md section 4: token p lives on dcp rank (p / S) % dcp, at local
/// position (p / (S dcp)) S + p % S), or the first block outside its region in
/// token order, producer side first.
fn expected_token_rows(producer: &ProducerLayout, consumer: &ConsumerLayout, tokens: u64) -> TokenRows {
    let (s, dcp, d) = (u64::from(consumer.interleave), u64::from(consumer.dcp), u64::from(consumer.dcp_rank()));
    let mut out = Vec::new();
    for src in producer.layout.regions.iter().filter(|r| r.kind.distribution() == Distribution::TokenSharded && !r.rows.is_empty()) {
        let dst = consumer.layout.region(src.kind).expect("consumer region");
        let (pbs, dbs) = (u64::from(src.block_size), u64::from(dst.block_size));
        let owned: Vec<(u64, u64)> = (0..tokens).filter(|p| (p / s) % dcp == d).map(|p| (p, p / (s * dcp) * s + p % s)).collect();
        if let Some(&b) = producer.blocks[..tokens.div_ceil(pbs) as usize].iter().find(|&&b| b >= src.units) {
            return Err(("producer", b));
        }
        let need = (owned.len() as u64).div_ceil(dbs) as usize;
        if let Some(&b) = consumer.blocks[..need].iter().find(|&&b| b >= dst.units) {
            return Err(("consumer", b));
        }
        for row in &src.rows {
            let drow = dst.row(row.layer).expect("consumer row");
            for &(p, lp) in &owned {
                let from = row.offset + u64::from(producer.blocks[(p / pbs) as usize]) * src.unit_stride + p % pbs * src.token_bytes;
                let to = drow.offset + u64::from(consumer.blocks[(lp / dbs) as usize]) * dst.unit_stride + lp % dbs * dst.token_bytes;
                out.push((src.kind, to, from));
            }
        }
    }
    out.sort_unstable();
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    // Invariant: for every (producer, consumer) pair of a random parallel shape
    // and random block tables on both sides (consecutive from any block,
    // reversed, scattered with repeats, gapped, self-sharing, and regions that
    // end inside a run), the plan copies exactly the token rows the two tables
    // name, each once; or, when a needed block lies outside its region, it is
    // refused naming the first such block (producer before consumer). This is
    // the block-by-block meaning of the tables, with no runs in it.
    #[test]
    fn planned_token_rows_are_the_block_tables_token_by_token(
        shape in (0usize..3, 0usize..2, 0usize..3, 0usize..4, 0usize..3, 0usize..3, 0usize..4),
        tokens in 1u64..200,
        (pshape, cshape) in (0u8..5, 0u8..5),
        (pstart, cstart) in (0u32..40, 0u32..40),
        scatter in proptest::collection::vec(0u32..1000, 1..20),
        spare in 0usize..3,
        (pcut, ccut) in (0u32..12, 0u32..12),
    ) {
        let (pp, ptp, pbs) = ([1, 2, 4][shape.0], [1, 2][shape.1], [2, 4, 16][shape.2]);
        let (dtp, interleave, dbs) = ([1, 2, 4, 4][shape.3], [1, 2, 4][shape.5], [1, 2, 4, 16][shape.6]);
        let dcp = [1, 2, 4][shape.4].min(dtp);
        let Some(topo) = topology(pp, ptp, pbs, dtp, dcp, interleave, dbs) else { return Ok(()) };
        let pn = tokens.div_ceil(u64::from(pbs)) as usize + spare;
        let pblocks = table(pshape, pn, pstart, &scatter, 2 * pn as u32);
        // Regions sized to the largest block named, or (a quarter of the time) cut
        // 1 to 3 blocks short of it, so that a run crosses the region's end.
        let units = |blocks: &[u32], cut: u32| (blocks.iter().max().map_or(0, |&b| b + 1)).saturating_sub(cut.saturating_sub(8)).max(1);
        let punits = units(&pblocks, pcut);
        for (stage, ptp_rank) in (0..pp).flat_map(|st| (0..ptp).map(move |t| (st, t))) {
            let prank = PrefillRank { pp: stage, tp: ptp_rank };
            let producer = ProducerLayout { rank: prank, blocks: pblocks.clone(), slot: 1, layout: crate::placement::place_rank(&topo, RankId::Prefill(prank), punits, 4) };
            let planner = ProducerPlanner::new(&producer, tokens);
            for ctp in 0..dtp {
                let crank = DecodeRank { tp: ctp };
                let owned = handoff_components::layout::owned_tokens(tokens, dcp, crank.dcp_rank(dcp), interleave);
                let cn = owned.div_ceil(u64::from(dbs)) as usize + spare;
                let cblocks = table(cshape, cn, cstart, &scatter, 2 * cn as u32);
                let cunits = units(&cblocks, ccut);
                let consumer = ConsumerLayout {
                    rank: crank, tp: dtp, dcp, interleave, blocks: cblocks.clone(), slot: 2,
                    layout: crate::placement::place_rank(&topo, RankId::Decode(crank), cunits, 4),
                };
                let sh = share(ptp, dtp, ptp_rank, ctp);
                if !sh.rows && !sh.state {
                    continue;
                }
                let want = if sh.rows { expected_token_rows(&producer, &consumer, tokens) } else { Ok(Vec::new()) };
                let at = format!("pp{stage} tp{ptp_rank} -> decode tp{ctp}, {tokens} tokens, producer blocks {pblocks:?} of {punits}, consumer blocks {cblocks:?} of {cunits}");
                match (planner.plan(&consumer, sh), want) {
                    (Ok(plan), Ok(want)) => {
                        let got = planned_token_rows(&plan, |k| topo.token_bytes(k));
                        if let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
                            prop_assert!(false, "{at}: token row {i} of {}: planned {:?}, the tables say {:?}", want.len(), got.get(i), want.get(i));
                        }
                    }
                    (Err(SplitError::OutOfRegion { side, index, .. }), Err((want_side, want_index))) => {
                        prop_assert_eq!(side, want_side, "{}", at);
                        if side == "consumer" {
                            prop_assert_eq!(index, want_index, "{}", at);
                        }
                    }
                    (got, want) => prop_assert!(false, "{at}: planned {:?}, the tables say {:?}", got.map(|p| p.descriptors.len()), want.map(|w| w.len())),
                }
            }
        }
    }

    // Invariant: the cursor finds, for each of the producer's layers, the row
    // `RegionLayout::row` finds, and refuses the first layer the consumer lacks.
    #[test]
    fn row_pairs_by_cursor_equal_the_row_lookups(
        dst_layers in proptest::collection::btree_set(0u32..64, 0..24),
        src_layers in proptest::collection::btree_set(0u32..64, 0..12),
    ) {
        let region = |layers: &std::collections::BTreeSet<u32>, row_bytes: u64| RegionLayout {
            kind: RegionKind::MlaKv,
            rows: layers.iter().enumerate().map(|(i, &l)| handoff_components::layout::Row { layer: ModuleLayer(l), offset: i as u64 * row_bytes }).collect(),
            unit_stride: 8, units: 4, block_size: 2, token_bytes: 4, unit_bytes: 8, segment: None,
            len: layers.len() as u64 * row_bytes,
        };
        // Half the time the producer's layers are a stage: a run of the consumer's.
        let src_layers = if src_layers.len() % 2 == 0 {
            let v: Vec<u32> = dst_layers.iter().copied().collect();
            let a = src_layers.len().min(v.len());
            v[a / 2..a].iter().copied().collect()
        } else {
            src_layers
        };
        let (src, dst) = (region(&src_layers, 100), region(&dst_layers, 1000));
        let consumer = ConsumerLayout {
            rank: DecodeRank { tp: 0 }, tp: 1, dcp: 1, interleave: 1, blocks: vec![], slot: 0,
            layout: handoff_components::layout::RankLayout { rank: RankId::Decode(DecodeRank { tp: 0 }), regions: vec![dst.clone()] },
        };
        let want: Result<Vec<(ModuleLayer, u64, u64)>, SplitError> = src
            .rows
            .iter()
            .map(|r| dst.row(r.layer).map(|d| (r.layer, r.offset, d.offset)).ok_or(SplitError::MissingRow { kind: src.kind, consumer: 0, layer: r.layer.0 }))
            .collect();
        let mut got = vec![(ModuleLayer(99), 1, 1)]; // stale pairs of a previous region
        let got = row_pairs(&src, &dst, &consumer, &mut got).map(|()| got);
        prop_assert_eq!(got, want);
    }

    // Invariant: a published region is refused exactly when one of its rows
    // ends past the region (checked row by row), and never for zero units.
    #[test]
    fn consumer_rows_are_refused_exactly_when_one_ends_past_the_region(
        offsets in proptest::collection::vec(0u64..1 << 20, 0..6),
        units in 0u32..8,
        stride in 1u64..4096,
        len in 0u64..1 << 21,
    ) {
        let rows = offsets.iter().enumerate().map(|(i, &o)| handoff_components::layout::Row { layer: ModuleLayer(i as u32), offset: o }).collect();
        let region = RegionLayout { kind: RegionKind::MlaKv, rows, unit_stride: stride, units, block_size: 4, token_bytes: 16, unit_bytes: 64, segment: None, len };
        let consumer = ConsumerLayout {
            rank: DecodeRank { tp: 0 }, tp: 1, dcp: 1, interleave: 1, blocks: vec![], slot: 0,
            layout: handoff_components::layout::RankLayout { rank: RankId::Decode(DecodeRank { tp: 0 }), regions: vec![region] },
        };
        let past = units > 0 && offsets.iter().any(|&o| o + u64::from(units - 1) * stride + 64 > len);
        prop_assert_eq!(check_consumer(&consumer).is_err(), past);
    }
}

#[test]
fn consecutive_counts_across_chunks_and_stops_at_the_first_gap() {
    let mut v: Vec<u32> = (7..7 + 100).collect();
    assert_eq!(consecutive(&v), 100);
    v[37] = 0;
    assert_eq!(consecutive(&v), 37);
    assert_eq!(consecutive(&[u32::MAX, 0, 1]), 1);
    assert_eq!(consecutive(&[u32::MAX - 1, u32::MAX, 0]), 2);
    assert_eq!(consecutive(&[5]), 1);
}
