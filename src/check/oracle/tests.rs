use super::*;
use handoff_components::plan::{Descriptor, Plan};

const TINY: &str = r#"
[model]
name = "tiny"
pattern = "KM"
num_layers = 4
hidden_size = 16
dtype = "bf16"
[model.mla]
heads = 2
kv_lora_rank = 8
rope_dim = 4
nope_head_dim = 4
v_head_dim = 4
[model.kda]
heads = 2
head_k_dim = 4
head_v_dim = 4
conv_kernel = 4
[model.replay]
capacity = 3
[prefill]
pp = 1
tp = 1
block_size = 4
[decode]
tp = 1
dcp = 1
interleave = 1
block_size = 4
"#;

const P0: PrefillRank = PrefillRank { pp: 0, tp: 0 };
const D0: DecodeRank = DecodeRank { tp: 0 };
const UNITS: u32 = 4;

fn tiny() -> Topology {
    Topology::parse(TINY).unwrap()
}

/// Memory of every rank's regions, canary-filled, producers holding `req` at
/// (`pb`, slot `ps`).
fn setup(topo: &Topology, req: &OracleRequest, pb: &[u32], ps: u32) -> Memory {
    let mut mem = Memory::new();
    for kind in topo.region_kinds() {
        for pp in 0..topo.prefill().pp {
            for tp in 0..topo.prefill().tp {
                let r = PrefillRank { pp, tp };
                let rid = RankId::Prefill(r);
                let mut v = vec![0; region_len(topo, rid, kind, UNITS) as usize];
                fill_canary(rid, kind, &mut v);
                fill_producer(topo, r, kind, UNITS, req, &Placement { blocks: pb, slot: ps }, &mut v);
                mem.insert((rid, kind), v);
            }
        }
        for tp in 0..topo.decode().tp {
            let rid = RankId::Decode(DecodeRank { tp });
            let mut v = vec![0; region_len(topo, rid, kind, UNITS) as usize];
            fill_canary(rid, kind, &mut v);
            mem.insert((rid, kind), v);
        }
    }
    mem
}

fn check_all(topo: &Topology, mem: &Memory, req: &OracleRequest, tables: &[Vec<u32>], slot: u32) -> Result<OracleStats, OracleError> {
    let mut total = OracleStats::default();
    for kind in topo.region_kinds() {
        for tp in 0..topo.decode().tp {
            let r = DecodeRank { tp };
            let at = Placement { blocks: &tables[tp as usize], slot };
            total = total + check_consumer(topo, r, kind, UNITS, &[(*req, at)], &mem[&(RankId::Decode(r), kind)])?;
        }
    }
    Ok(total)
}

/// The tiny topology's hand-written copy: layouts are identical on both sides
/// (same rows, same head count, same block size), so a request moves as whole
/// token rows of its blocks and whole slot cells, with offsets written out from
/// docs/layout.md by hand. Layers: 0 K, 1 M, 2 K, 3 M.
fn tiny_plan(skip: Option<RegionKind>) -> Plan {
    // mla.kv: token 12 x 2 = 24 B, block 96 B, row (4 blocks) 384 B.
    // prefill blocks [2, 0], decode blocks [1, 3]; 6 tokens: block 0 whole, block 1 rows 0..2.
    let mut d = vec![];
    for row in 0..2u64 {
        d.push(Descriptor::copy(RegionKind::MlaKv, row * 384 + 2 * 96, row * 384 + 96, 96));
        d.push(Descriptor::copy(RegionKind::MlaKv, row * 384, row * 384 + 3 * 96, 48));
    }
    // Per slot, producer slot 1 -> decode slot 2, two KDA rows each.
    // kda.state: 2 heads x 4 x 4 x 4 = 128 B per layer, 256 per slot.
    d.push(Descriptor::copy(RegionKind::KdaState, 256, 512, 256));
    // kda.conv: 3 rows x (8 + 8 + 8 channels) x 2 B = 144 B per layer, 288 per slot.
    d.push(Descriptor::copy(RegionKind::KdaConv, 288, 576, 288));
    // replay.records: 3 entries x 2 heads x 12 x 4 = 288 B per layer.
    d.push(Descriptor::copy(RegionKind::ReplayRecords, 576, 1152, 576));
    // replay.cursor: 4 B per layer, 8 per slot.
    d.push(Descriptor::copy(RegionKind::ReplayCursor, 8, 16, 8));
    d.retain(|x| Some(x.kind) != skip);
    Plan { producer: P0, consumer: D0, descriptors: d, staged: vec![], uncoalesced: 0, chunks: vec![], layers: vec![] }
}

const REQ: OracleRequest = OracleRequest { id: 7, tokens: 6 };

#[test]
fn layout_offsets_by_hand() {
    let topo = tiny();
    let rid = RankId::Prefill(P0);
    assert_eq!(region_len(&topo, rid, RegionKind::MlaKv, UNITS), 2 * 4 * 96);
    assert_eq!(region_len(&topo, rid, RegionKind::KdaConv, UNITS), 4 * 288);
    let mem = setup(&topo, &REQ, &[2, 0], 1);
    let conv = &mem[&(rid, RegionKind::KdaConv)];
    // slot 1, layer 2 (row 1), conv row 1, v channel 2 of head 1, second byte:
    // 288 + 144 + (1 x 24 + 16 + 4 + 2) x 2 + 1
    let c = Coord::Head { req: 7, layer: 2, head: 1, group: 2, repeat: 1 };
    assert_eq!(conv[288 + 144 + (24 + 16 + 4 + 2) * 2 + 1], pattern_byte(RegionKind::KdaConv, &c, 5));
    // k channel 0 of head 0, conv row 2, layer 0.
    let c = Coord::Head { req: 7, layer: 0, head: 0, group: 1, repeat: 2 };
    assert_eq!(conv[288 + (48 + 8) * 2], pattern_byte(RegionKind::KdaConv, &c, 0));
    // slot 0 untouched
    assert_eq!(conv[5], canary_byte(rid, RegionKind::KdaConv, 5));
    // mla.kv: layer 3 (row 1), token 5 = block table index 1 -> block 0, slot 1.
    let kv = &mem[&(rid, RegionKind::MlaKv)];
    let c = Coord::Token { req: 7, layer: 3, token: 5 };
    assert_eq!(kv[384 + 24 + 3], pattern_byte(RegionKind::MlaKv, &c, 3));
    // records: layer 0, entry 2, head 1, u channel 1 byte 0: (2 x 2 + 1) x 48 + (4 + 1) x 4
    let rec = &mem[&(rid, RegionKind::ReplayRecords)];
    let c = Coord::Head { req: 7, layer: 0, head: 1, group: 0, repeat: 2 };
    assert_eq!(rec[576 + 5 * 48 + 20], pattern_byte(RegionKind::ReplayRecords, &c, 20));
    // pattern even, canary odd
    assert_eq!(pattern_byte(RegionKind::MlaKv, &c, 3) & 1, 0);
    assert_eq!(canary_byte(rid, RegionKind::MlaKv, 3) & 1, 1);
}

#[test]
fn tiny_copy_passes() {
    let topo = tiny();
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    let st = execute_counted(&[tiny_plan(None)], &mut mem).unwrap();
    let ok = check_all(&topo, &mem, &REQ, &[vec![1, 3]], 2).unwrap();
    assert_eq!(ok.pattern_bytes, st.bytes);
    let exp = expected_bytes(&topo, D0, REQ.tokens);
    for (kind, b) in &exp {
        assert_eq!(st.written[&(D0, *kind)], *b, "{kind}");
    }
    assert_eq!(exp[&RegionKind::MlaKv], 6 * 24 * 2);
    assert_eq!(exp[&RegionKind::ReplayCursor], 8);
    let total: u64 = topo.region_kinds().iter().map(|&k| region_len(&topo, RankId::Decode(D0), k, UNITS)).sum();
    assert_eq!(ok.pattern_bytes + ok.canary_bytes, total);
}

#[test]
fn flipped_byte_is_named() {
    let topo = tiny();
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    execute_counted(&[tiny_plan(None)], &mut mem).unwrap();
    let conv = mem.get_mut(&(RankId::Decode(D0), RegionKind::KdaConv)).unwrap();
    // decode slot 2, layer 2, conv row 1, k channel 3 of head 1, byte 0
    conv[576 + 144 + (24 + 8 + 4 + 3) * 2] ^= 0x02;
    let e = check_all(&topo, &mem, &REQ, &[vec![1, 3]], 2).unwrap_err();
    let s = e.to_string();
    assert!(s.contains("decode tp0: kda.conv request 7 layer 2 head 1 group k channel 3 row 1 byte 0"), "{s}");
    let OracleError::Mismatch(m) = e else { panic!() };
    assert_eq!(m.expected_coord, Some((Coord::Head { req: 7, layer: 2, head: 1, group: 1, repeat: 1 }, 6)));
}

#[test]
fn skipped_conv_is_untouched_canary() {
    let topo = tiny();
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    execute_counted(&[tiny_plan(Some(RegionKind::KdaConv))], &mut mem).unwrap();
    let s = check_all(&topo, &mem, &REQ, &[vec![1, 3]], 2).unwrap_err().to_string();
    assert!(s.contains("kda.conv request 7 layer 0 head 0 group q channel 0 row 0 byte 0"), "{s}");
    assert!(s.contains("canary: untouched"), "{s}");
}

#[test]
fn misplaced_and_overcopied_rows_are_caught() {
    let topo = tiny();
    // Whole last block copied: rows of tokens 6, 7 must stay canary.
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    let mut plan = tiny_plan(None);
    plan.descriptors[1].len = 96;
    execute_counted(&[plan], &mut mem).unwrap();
    let s = check_all(&topo, &mem, &REQ, &[vec![1, 3]], 2).unwrap_err().to_string();
    assert!(s.contains("token 6: past its 6 tokens"), "{s}");
    assert!(s.contains("the pattern of request 7 layer 1 token 6"), "{s}");
    // Layer rows swapped: layer 1's destination gets layer 3's rows.
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    let mut plan = tiny_plan(None);
    plan.descriptors[0].src_offset += 384;
    plan.descriptors[2].src_offset -= 384;
    execute_counted(&[plan], &mut mem).unwrap();
    let s = check_all(&topo, &mem, &REQ, &[vec![1, 3]], 2).unwrap_err().to_string();
    assert!(s.contains("mla.kv request 7 layer 1 token 0 latent channel 0 byte 0"), "{s}");
    assert!(s.contains("the pattern of request 7 layer 3 token 0"), "{s}");
    // The wrong request id fails everywhere.
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    execute_counted(&[tiny_plan(None)], &mut mem).unwrap();
    let other = OracleRequest { id: 8, tokens: 6 };
    assert!(check_all(&topo, &mem, &other, &[vec![1, 3]], 2).is_err());
}

#[test]
fn exec_rejects_double_write_oob_and_empty() {
    let topo = tiny();
    let mut mem = setup(&topo, &REQ, &[2, 0], 1);
    let mut plan = tiny_plan(None);
    plan.descriptors.push(Descriptor::copy(RegionKind::KdaState, 0, 520, 4));
    let e = execute_counted(&[plan], &mut mem).unwrap_err();
    assert!(matches!(e, ExecError::DoubleWrite { offset: 520, first: (0, 4), second: (0, 8), .. }), "{e}");
    // nothing was copied
    let st = &mem[&(RankId::Decode(D0), RegionKind::KdaState)];
    assert_eq!(st[520], canary_byte(RankId::Decode(D0), RegionKind::KdaState, 520));

    // A strided descriptor overlapping itself.
    let mut plan = tiny_plan(None);
    plan.descriptors.truncate(0);
    plan.descriptors.push(Descriptor { kind: RegionKind::KdaState, src_offset: 0, dst_offset: 0, len: 8, count: 2, src_stride: 8, dst_stride: 4 });
    let e = execute_counted(&[plan], &mut mem).unwrap_err();
    assert!(matches!(e, ExecError::DoubleWrite { offset: 4, first: (0, 0), second: (0, 0), .. }), "{e}");

    let len = region_len(&topo, RankId::Decode(D0), RegionKind::KdaConv, UNITS);
    for (src, dst, l, n, side) in [(0, len - 4, 8, 1, "destination"), (len - 4, 0, 8, 1, "source"), (0, u64::MAX - 2, 8, 1, "destination")] {
        let plan = Plan {
            producer: P0,
            consumer: D0,
            descriptors: vec![Descriptor { kind: RegionKind::KdaConv, src_offset: src, dst_offset: dst, len: l, count: n, src_stride: 0, dst_stride: 0 }],
            staged: vec![],
            uncoalesced: 0,
            chunks: vec![],
            layers: vec![],
        };
        let e = execute_counted(&[plan], &mut mem).unwrap_err();
        assert!(matches!(e, ExecError::OutOfBounds { side: s, .. } if s == side), "{e}");
    }
    let mut plan = tiny_plan(None);
    plan.descriptors[3].len = 0;
    assert!(matches!(execute_counted(&[plan], &mut mem), Err(ExecError::Empty { desc: 3, .. })));
    let mut plan = tiny_plan(None);
    plan.descriptors[3].count = 0;
    assert!(matches!(execute_counted(&[plan], &mut mem), Err(ExecError::Empty { desc: 3, .. })));
    // Two plans writing the same destination.
    let e = execute_counted(&[tiny_plan(None), tiny_plan(None)], &mut mem).unwrap_err();
    assert!(matches!(e, ExecError::DoubleWrite { first: (0, 0), second: (1, 0), .. }), "{e}");
}

/// A naive, per-token and per-head plan generator for any topology, written from the
/// rules (one descriptor per token row and per head span): checks that producer
/// fill, rules and consumer check agree on PP, TP ratios, DCP and interleave.
fn naive_plans(topo: &Topology, pblocks: &[u32], pslot: u32, dtables: &[Vec<u32>], dslot: u32, tokens: u64) -> Vec<Plan> {
    let (pc, dc) = (topo.prefill(), topo.decode());
    let k = dc.tp / pc.tp;
    let mut plans: BTreeMap<(PrefillRank, DecodeRank), Vec<Descriptor>> = BTreeMap::new();
    for r in 0..dc.tp {
        let dr = DecodeRank { tp: r };
        let drank = dr.dcp_rank(dc.dcp) as u64;
        for kind in topo.region_kinds() {
            let dg = Geom::new(topo, RankId::Decode(dr), kind);
            for (drow, &layer) in dg.layers.iter().enumerate() {
                let stage = topo.stage_layers.iter().position(|s| s.contains(&layer)).unwrap() as u32;
                let src = if kind.is_paged() { PrefillRank { pp: stage, tp: r % pc.tp } } else { PrefillRank { pp: stage, tp: r / k } };
                let pg = Geom::new(topo, RankId::Prefill(src), kind);
                let prow = pg.layers.iter().position(|&l| l == layer).unwrap() as u64;
                let v = plans.entry((src, dr)).or_default();
                if kind.is_paged() {
                    let (s, dcp) = (dc.interleave as u64, dc.dcp as u64);
                    for p in 0..tokens {
                        if (p / s) % dcp != drank {
                            continue;
                        }
                        let lp = (p / (s * dcp)) * s + p % s;
                        let so = (prow * UNITS as u64 + pblocks[(p / pg.bs) as usize] as u64) * pg.cell + (p % pg.bs) * pg.token_bytes;
                        let dt = &dtables[r as usize];
                        let doff = (drow as u64 * UNITS as u64 + dt[(lp / dg.bs) as usize] as u64) * dg.cell + (lp % dg.bs) * dg.token_bytes;
                        v.push(Descriptor::copy(kind, so, doff, pg.token_bytes));
                    }
                } else if kind == RegionKind::ReplayCursor {
                    let so = (pslot as u64 * pg.nrows() + prow) * 4;
                    let doff = (dslot as u64 * dg.nrows() + drow as u64) * 4;
                    v.push(Descriptor::copy(kind, so, doff, 4));
                } else {
                    let h = dg.hl;
                    for t in 0..dg.repeat {
                        for gi in 0..dg.groups.len() {
                            for j in 0..h {
                                let pj = (r % k) * h + j;
                                let so = (pslot as u64 * pg.nrows() + prow) * pg.cell + pg.head_off(t, gi, pj);
                                let doff = (dslot as u64 * dg.nrows() + drow as u64) * dg.cell + dg.head_off(t, gi, j);
                                v.push(Descriptor::copy(kind, so, doff, dg.groups[gi]));
                            }
                        }
                    }
                }
            }
        }
    }
    plans
        .into_iter()
        .map(|((producer, consumer), descriptors)| Plan { producer, consumer, descriptors, staged: vec![], uncoalesced: 0, chunks: vec![], layers: vec![] })
        .collect()
}

#[test]
fn naive_pp_tp_dcp_agrees() {
    let text = TINY
        .replace("pattern = \"KM\"", "pattern = \"KKM\"")
        .replace("num_layers = 4", "num_layers = 7")
        .replace("[model.kda]\nheads = 2", "[model.kda]\nheads = 8")
        .replace("[model.mla]\nheads = 2", "[model.mla]\nheads = 4")
        .replace("[prefill]\npp = 1\ntp = 1\nblock_size = 4", "[prefill]\npp = 2\ntp = 2\nblock_size = 8")
        .replace("[decode]\ntp = 1\ndcp = 1\ninterleave = 1\nblock_size = 4", "[decode]\ntp = 4\ndcp = 2\ninterleave = 2\nblock_size = 4");
    let topo = Topology::parse(&text).unwrap();
    assert_eq!(topo.decode().dcp, 2);
    let req = OracleRequest { id: 42, tokens: 11 };
    let pblocks = [3u32, 1];
    let mut mem = setup(&topo, &req, &pblocks, 2);
    // dcp rank 0 owns tokens 0,1,4,5,8,9 (6 -> 2 blocks); rank 1 owns 2,3,6,7,10 (5 -> 2 blocks).
    let tables = vec![vec![0, 2], vec![3, 1], vec![2, 0], vec![1, 3]];
    let plans = naive_plans(&topo, &pblocks, 2, &tables, 1, req.tokens);
    let st = execute_counted(&plans, &mut mem).unwrap();
    let ok = check_all(&topo, &mem, &req, &tables, 1).unwrap();
    assert_eq!(ok.pattern_bytes, st.bytes);
    for r in 0..4 {
        let dr = DecodeRank { tp: r };
        for (kind, b) in expected_bytes(&topo, dr, req.tokens) {
            assert_eq!(st.written[&(dr, kind)], b, "tp{r} {kind}");
        }
    }
    assert_eq!(expected_bytes(&topo, DecodeRank { tp: 0 }, 11)[&RegionKind::MlaKv], 6 * 24 * 2);
    assert_eq!(expected_bytes(&topo, DecodeRank { tp: 1 }, 11)[&RegionKind::MlaKv], 5 * 24 * 2);

    // A head-offset bug (producer-local head 0 instead of (r % k) x h) is caught.
    let mut mem = setup(&topo, &req, &pblocks, 2);
    let mut plans = naive_plans(&topo, &pblocks, 2, &tables, 1, req.tokens);
    let bad = plans.iter_mut().find(|p| p.consumer.tp == 1).unwrap();
    let pg = Geom::new(&topo, RankId::Prefill(bad.producer), RegionKind::KdaState);
    for d in bad.descriptors.iter_mut().filter(|d| d.kind == RegionKind::KdaState) {
        d.src_offset -= 2 * pg.groups[0];
    }
    execute_counted(&plans, &mut mem).unwrap();
    let s = check_all(&topo, &mem, &req, &tables, 1).unwrap_err().to_string();
    assert!(s.contains("decode tp1: kda.state request 42 layer 0 head 2 state [k 0][v 0] byte 0"), "{s}");
    assert!(s.contains("the pattern of request 42 layer 0 head 0 group 0 repeat 0"), "{s}");
}

#[test]
fn input_errors() {
    let topo = tiny();
    let mem = setup(&topo, &REQ, &[2, 0], 1);
    let buf = &mem[&(RankId::Decode(D0), RegionKind::MlaKv)];
    let at = Placement { blocks: &[1], slot: 0 };
    assert!(matches!(check_consumer(&topo, D0, RegionKind::MlaKv, UNITS, &[(REQ, at)], buf), Err(OracleError::Input(_))));
    let at = Placement { blocks: &[1, 1], slot: 0 };
    assert!(matches!(check_consumer(&topo, D0, RegionKind::MlaKv, UNITS, &[(REQ, at)], buf), Err(OracleError::Input(_))));
    // Untouched consumer with no requests: all canary.
    let st = check_consumer(&topo, D0, RegionKind::MlaKv, UNITS, &[], buf).unwrap();
    assert_eq!(st.canary_bytes, buf.len() as u64);
}
