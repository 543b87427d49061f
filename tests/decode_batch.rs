//! The batched decode step computes, for every request of a batch, the bits that
//! request gets alone: through the colocated reference's caches (prompts of
//! different lengths, requests joining and leaving the batch, replay, 16-bit
//! caches, TP > 1), through the decode ranks' regions (TP x DCP, interleave,
//! scattered block tables, slots out of order), and at the KDA layer with
//! ReplaySSM rings of which only some are full. And any TP degree that divides
//! the head counts runs, with logits equal bit for bit at every degree.

mod common;

use handoff::model::forward::{self, KdaBatch, ReplayBatch};
use handoff::model::ranks::{DecodeRanks, Layouts};
use handoff::model::reference::{LocalCaches, LocalRequest, prefill_local};
use handoff::model::weights::MixerShard;
use handoff::model::{Model, ShardGroup, Trace, run_colocated_on};
use handoff_components::Topology;
use handoff_components::ecs::Lease;
use handoff_components::vocab::{DecodeRank, RankId};
use handoff_kernels::{Backend, CpuBackend, SplitMix64};
use handoff_systems::placement::{blocks_for, owned_tokens, place_rank};
use std::collections::BTreeMap;
use std::sync::Mutex;

const BE: CpuBackend = CpuBackend;

/// Region bytes by (rank, kind): what verify and the tests hand the model as a RegionView.
type HostRegions = Mutex<BTreeMap<(RankId, handoff_components::vocab::RegionKind), Vec<u8>>>;

type Cfg = common::ComputeShape;

const BASE: Cfg = Cfg { seed: 13, pbs: 8, dbs: 4, ..common::COMPUTE };

fn topo(c: &Cfg) -> Topology {
    c.topology()
}

fn prompt(len: usize, salt: u32) -> Vec<u8> {
    (0..len).map(|i| (i as u32 * 37 + 11 + salt * 101) as u8).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Asserts two logit vectors are equal bit for bit, naming the first different entry.
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: logit of token {i} differs: batched {} vs alone {}", got[i], want[i]);
    }
}

/// Prefills `prompts` and decodes them `steps` times in batches whose membership
/// changes (request b joins at step `join[b]` and leaves after `steps` of its own
/// steps); each request's trace must equal its run alone, bit for bit.
fn check_batched_equals_alone(name: &str, c: &Cfg, tp: usize, prompts: &[Vec<u8>], join: &[usize], steps: usize) {
    let t = topo(c);
    let model = Model::new(&t).expect("model");
    let group = model.upload_group(&BE, tp).expect("upload");
    let alone: Vec<Trace> = prompts.iter().map(|p| run_colocated_on(&BE, &group, p, steps as u32).expect("alone")).collect();
    let n = prompts.len();
    let mut reqs: Vec<Option<LocalRequest>> = Vec::new();
    let mut traces = Vec::new();
    for p in prompts {
        let (req, logits, tok) = prefill_local(&BE, &group, p).expect("prefill");
        reqs.push(Some(req));
        traces.push(Trace { tokens: vec![tok], logits: vec![logits] });
    }
    let mut max_batch = 0;
    for round in 0.. {
        let active: Vec<usize> = (0..n).filter(|&b| round >= join[b] && traces[b].tokens.len() <= steps).collect();
        if active.is_empty() {
            if (0..n).all(|b| traces[b].tokens.len() > steps) {
                break;
            }
            continue;
        }
        max_batch = max_batch.max(active.len());
        let batch: Vec<LocalRequest> = active.iter().map(|&b| reqs[b].take().expect("request")).collect();
        let mut caches = LocalCaches::new(&group.dims, tp, batch);
        let tokens: Vec<u8> = active.iter().map(|&b| *traces[b].tokens.last().expect("token")).collect();
        let positions: Vec<usize> = active.iter().map(|&b| prompts[b].len() + traces[b].tokens.len() - 1).collect();
        let out = forward::decode_batch(&BE, &group, &tokens, &positions, &mut caches).expect("decode batch");
        for ((&b, req), (logits, tok)) in active.iter().zip(caches.requests).zip(out) {
            reqs[b] = Some(req);
            traces[b].tokens.push(tok);
            traces[b].logits.push(logits);
        }
    }
    assert!(max_batch >= n.min(3), "{name}: the batch never held several requests");
    for b in 0..n {
        assert_eq!(traces[b].tokens, alone[b].tokens, "{name}: request {b} (prompt {}) tokens", prompts[b].len());
        assert_eq!(traces[b].logits.len(), steps + 1, "{name}: request {b} steps");
        for (i, (g, w)) in traces[b].logits.iter().zip(&alone[b].logits).enumerate() {
            assert_same(&format!("{name}: request {b} (prompt {}) step {i}", prompts[b].len()), g, w);
        }
    }
}

#[test]
fn batched_decode_equals_each_request_alone_bit_for_bit() {
    let prompts: Vec<Vec<u8>> = [1usize, 5, 17, 40, 64, 65, 3].iter().enumerate().map(|(i, &l)| prompt(l, i as u32)).collect();
    let together = vec![0; prompts.len()];
    let staggered = [0usize, 2, 2, 5, 9, 9, 11];
    check_batched_equals_alone("f32", &BASE, 1, &prompts, &together, 12);
    check_batched_equals_alone("f32, staggered joins", &BASE, 1, &prompts, &staggered, 12);
    // ReplaySSM: rings of 8, so slots commit at different steps.
    let replay = Cfg { replay: Some(8), ..BASE };
    check_batched_equals_alone("replay", &replay, 1, &prompts, &staggered, 20);
    let bf16 = Cfg { dtype: "bf16", replay: Some(6), ..BASE };
    check_batched_equals_alone("bf16 + replay, tp 2", &bf16, 2, &prompts, &staggered, 16);
    // Hidden 160: every projection from the hidden state spans three K_CHUNK
    // chunks (the MLP down four), the case where a matmul's summation order
    // would otherwise depend on the row count.
    // Twelve requests, so that the batch crosses the row counts at which a CPU
    // matmul switches loops (4 rows per thread).
    let wide = Cfg { hidden: 160, replay: Some(8), ..BASE };
    let many: Vec<Vec<u8>> = (0..12).map(|i| prompt(3 + 7 * i, i as u32)).collect();
    let join: Vec<usize> = (0..12).map(|i| i / 4).collect();
    check_batched_equals_alone("hidden 160, 12 requests", &wide, 1, &many, &join, 8);
    let mla_first = Cfg { pattern: "MKKK", dtype: "f16", ..BASE };
    check_batched_equals_alone("f16, MLA first, tp 4", &mla_first, 4, &prompts, &together, 10);
}

/// Decode ranks' region bytes for `requests` requests of up to `tokens` tokens,
/// zeroed (a request at position 0: zero state, empty rings, no rows), and each
/// request's leases: scattered blocks (request b's i-th block is `i * n + (n-1-b)`)
/// and slots in reverse order.
fn decode_regions(t: &Topology, requests: usize, tokens: usize) -> (Layouts, HostRegions, Vec<Vec<Lease>>) {
    let d = t.decode();
    let per = blocks_for(owned_tokens(tokens as u64, d.dcp, 0, d.interleave), d.block_size) as usize;
    let mut layouts = Layouts::new();
    let mut mem = BTreeMap::new();
    for tp in 0..d.tp {
        let rank = RankId::Decode(DecodeRank { tp });
        for r in place_rank(t, rank, (per * requests) as u32, requests as u32).regions {
            mem.insert((rank, r.kind), vec![0u8; r.len as usize]);
            layouts.insert((rank, r.kind), r);
        }
    }
    let leases = (0..requests)
        .map(|b| {
            (0..d.tp)
                .map(|tp| Lease {
                    rank: RankId::Decode(DecodeRank { tp }),
                    blocks: (0..per).map(|i| (i * requests + (requests - 1 - b)) as u32).collect(),
                    slot: (requests - 1 - b) as u32,
                })
                .collect()
        })
        .collect();
    (layouts, Mutex::new(mem), leases)
}

/// Feeds every request its own forced token sequence from position 0, through
/// the decode ranks' regions in batches of changing membership, and through the
/// colocated caches (TP1) one request at a time: the logits must be equal bit for
/// bit at every step.
fn check_decode_ranks(name: &str, c: &Cfg, steps: usize, join: &[usize]) {
    let t = topo(c);
    let model = Model::new(&t).expect("model");
    let d = t.decode();
    let dgroup: ShardGroup<CpuBackend> = model.upload_group(&BE, d.tp as usize).expect("upload");
    let solo = model.upload_group(&BE, 1).expect("upload tp1");
    let n = join.len();
    let forced: Vec<Vec<u8>> = (0..n).map(|b| prompt(steps, 7 + b as u32)).collect();
    // Alone, colocated.
    let mut want: Vec<Vec<Vec<f32>>> = Vec::new();
    for f in &forced {
        let mut caches = LocalCaches::new(&solo.dims, 1, vec![LocalRequest::empty(&solo.dims, 1)]);
        let mut logits = Vec::new();
        for (pos, &tok) in f.iter().enumerate() {
            logits.push(forward::decode_batch(&BE, &solo, &[tok], &[pos], &mut caches).expect("alone").remove(0).0);
        }
        want.push(logits);
    }
    // Batched, through the decode ranks.
    let (layouts, mem, leases) = decode_regions(&t, n, steps);
    let mut done = vec![0usize; n];
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n];
    for round in 0.. {
        let active: Vec<usize> = (0..n).filter(|&b| round >= join[b] && done[b] < steps).collect();
        if (0..n).all(|b| done[b] == steps) {
            break;
        }
        if active.is_empty() {
            continue;
        }
        let mut caches = DecodeRanks::new(&t, &layouts, &mem, active.iter().map(|&b| leases[b].clone()).collect());
        let tokens: Vec<u8> = active.iter().map(|&b| forced[b][done[b]]).collect();
        let positions: Vec<usize> = active.iter().map(|&b| done[b]).collect();
        let out = forward::decode_batch(&BE, &dgroup, &tokens, &positions, &mut caches).expect("decode ranks batch");
        for (&b, (logits, _)) in active.iter().zip(out) {
            got[b].push(logits);
            done[b] += 1;
        }
    }
    for b in 0..n {
        assert_eq!((got[b].len(), want[b].len()), (steps, steps), "{name}: request {b} steps");
        for (i, (g, w)) in got[b].iter().zip(&want[b]).enumerate() {
            assert_same(&format!("{name}: request {b} position {i}"), g, w);
        }
    }
}

#[test]
fn decode_ranks_batch_equals_colocated_alone_bit_for_bit() {
    let join = [0usize, 0, 3, 4, 4];
    check_decode_ranks("tp1", &BASE, 14, &join);
    check_decode_ranks("tp2 dcp2", &Cfg { dtp: 2, dcp: 2, ..BASE }, 14, &join);
    check_decode_ranks("tp4 dcp2 interleave 2, replay, bf16", &Cfg { dtp: 4, dcp: 2, interleave: 2, replay: Some(6), dtype: "bf16", ..BASE }, 18, &join);
    check_decode_ranks("tp4 dcp4, f16, MLA first", &Cfg { dtp: 4, dcp: 4, pattern: "MKKM", dtype: "f16", ..BASE }, 12, &join);
}

/// ReplaySSM over a batch whose rings are at different fill levels: the slots
/// whose ring becomes full this step commit (state rebuilt from the ring, cursor
/// 0), the others keep their committed state bit for bit and advance their
/// cursor; every slot's outputs and caches equal its step alone.
#[test]
fn replay_batch_commits_only_full_rings_and_equals_each_slot_alone() {
    let cap = 8usize;
    let c = Cfg { replay: Some(cap as u32), ..BASE };
    let t = topo(&c);
    let model = Model::new(&t).expect("model");
    let group = model.upload_group(&BE, 1).expect("upload");
    let dims = &group.dims;
    let MixerShard::Kda(sh) = &group.ranks[0].layers[0].mixer else { panic!("layer 0 is KDA") };
    let (hl, dk, dv) = (sh.heads, dims.dk, dims.dv);
    let (per, conv_per, ring_per) = (hl * dk * dv, (dims.conv - 1) * dims.conv_channels(hl), cap * hl * dims.record_width());
    let cursors = [7i32, 0, 3, 7, 5, 6];
    let nb = cursors.len();
    let mut r = SplitMix64::new(99);
    let xn = r.vec_normal(nb * dims.hidden, 1.0);
    let state = r.vec_normal(nb * per, 0.3);
    let conv = r.vec_normal(nb * conv_per, 1.0);
    // Records (k^, u, g): g is a log decay, so negative.
    let mut ring = r.vec_normal(nb * ring_per, 0.5);
    let w = dims.record_width();
    for rec in ring.chunks_exact_mut(w) {
        for g in &mut rec[dk + dv..] {
            *g = -g.abs();
        }
    }
    let run = |which: &[usize]| {
        let pick = |x: &[f32], per: usize| which.iter().flat_map(|&b| x[b * per..(b + 1) * per].to_vec()).collect::<Vec<f32>>();
        let mut kb = KdaBatch::<CpuBackend> {
            state: BE.upload(&pick(&state, per)).unwrap(),
            conv: BE.upload(&pick(&conv, conv_per)).unwrap(),
            replay: Some(ReplayBatch {
                ring: BE.upload(&pick(&ring, ring_per)).unwrap(),
                cursor: BE.upload_i32(&which.iter().map(|&b| cursors[b]).collect::<Vec<_>>()).unwrap(),
            }),
        };
        let x = BE.upload(&pick(&xn, dims.hidden)).unwrap();
        let (parts, changed) = forward::kda_decode_batch(&BE, dims, sh, &x, which.len(), &mut kb).expect("kda step");
        let per_head = which.len() * dims.hidden;
        let parts: Vec<Vec<f32>> = BE.download(&parts.buf).unwrap().chunks(per_head.max(1)).map(<[f32]>::to_vec).collect();
        let rb = kb.replay.as_ref().unwrap();
        (parts, changed, BE.download(&kb.state).unwrap(), BE.download(&kb.conv).unwrap(), BE.download(&rb.ring).unwrap(), BE.download_i32(&rb.cursor).unwrap())
    };
    let all: Vec<usize> = (0..nb).collect();
    let (parts, changed, st, cv, rg, cur) = run(&all);
    for b in 0..nb {
        let full = cursors[b] as usize + 1 == cap;
        assert_eq!(changed[b], full, "slot {b} (cursor {}) commit flag", cursors[b]);
        assert_eq!(cur[b], if full { 0 } else { cursors[b] + 1 }, "slot {b} cursor");
        if !full {
            assert_eq!(
                bits(&st[b * per..(b + 1) * per]),
                bits(&state[b * per..(b + 1) * per]),
                "slot {b}: a slot that did not commit keeps its committed state"
            );
        } else {
            assert_ne!(bits(&st[b * per..(b + 1) * per]), bits(&state[b * per..(b + 1) * per]), "slot {b}: a full ring commits");
        }
        let (p1, c1, s1, v1, r1, k1) = run(&[b]);
        assert_eq!(c1, vec![changed[b]], "slot {b} alone: commit flag");
        assert_eq!(k1[0], cur[b], "slot {b} alone: cursor");
        assert_eq!(bits(&s1), bits(&st[b * per..(b + 1) * per]), "slot {b} alone: state");
        assert_eq!(bits(&v1), bits(&cv[b * conv_per..(b + 1) * conv_per]), "slot {b} alone: conv");
        assert_eq!(bits(&r1), bits(&rg[b * ring_per..(b + 1) * ring_per]), "slot {b} alone: ring");
        for (h, (pb, pa)) in parts.iter().zip(&p1).enumerate() {
            assert_eq!(bits(&pb[b * dims.hidden..(b + 1) * dims.hidden]), bits(pa), "slot {b} alone: o_proj partial of head {h}");
        }
    }
}

/// Runs `steps` decode steps of a prompt at each TP degree and asserts the traces
/// are equal bit for bit.
fn check_tp_invariant(name: &str, c: &Cfg, tps: &[usize]) {
    let t = topo(c);
    let model = Model::new(&t).expect("model");
    let p = prompt(23, 3);
    let mut first: Option<Trace> = None;
    for &tp in tps {
        let group = model.upload_group(&BE, tp).unwrap_or_else(|e| panic!("{name}: tp {tp} refused: {e}"));
        let trace = run_colocated_on(&BE, &group, &p, 12).expect("run");
        match &first {
            None => first = Some(trace),
            Some(want) => {
                assert_eq!(trace.tokens, want.tokens, "{name}: tokens at tp {tp}");
                for (i, (g, w)) in trace.logits.iter().zip(&want.logits).enumerate() {
                    assert_same(&format!("{name}: tp {tp} step {i}"), g, w);
                }
            }
        }
    }
}

#[test]
fn every_tp_dividing_the_head_counts_runs_with_equal_logits() {
    // 24 KDA and 8 MLA heads at the default intermediate size (2 x hidden = 64):
    // 8 MLP units (the gcd) of 8 channels.
    let c = Cfg { kda_heads: 24, mla_heads: 8, ..BASE };
    check_tp_invariant("24 KDA + 8 MLA heads", &c, &[1, 2, 4, 8]);
    // Units of unequal width: 100 channels over 8 units (12 and 13 wide).
    check_tp_invariant("intermediate 100", &Cfg { intermediate: Some(100), ..c }, &[1, 2, 4, 8]);
    // KDA only: 24 units of 2 or 3 channels, TP degrees that are not powers of two.
    check_tp_invariant("KDA only, 24 heads", &Cfg { pattern: "K", layers: 3, ..c }, &[1, 3, 6, 24]);
    // Fewer channels than units: the empty units contribute nothing.
    check_tp_invariant("intermediate 5", &Cfg { intermediate: Some(5), ..c }, &[1, 2, 8]);
    // A TP degree the heads cannot split over is refused, naming the heads.
    let model = Model::new(&topo(&c)).expect("model");
    let e = model.upload_group(&BE, 3).err().expect("tp 3 must be refused").to_string();
    assert!(e.contains("model.mla.heads = 8 cannot be split over tp 3"), "{e}");
}

#[test]
fn disaggregated_24_kda_8_mla_heads_at_tp8_dcp2_match_colocated_exactly() {
    let c = Cfg { kda_heads: 24, mla_heads: 8, dtp: 8, dcp: 2, replay: Some(8), ..BASE };
    let t = topo(&c);
    let r = handoff::check::compute_verify::verify_compute(&t, &prompt(30, 1), 16, |_| {}).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.max_rel_err, 0.0, "logits differ at step {}", r.worst_step);
}

/// A RegionView that counts its calls per (rank, kind), over host regions.
struct Counting {
    inner: HostRegions,
    calls: Mutex<BTreeMap<(RankId, handoff_components::vocab::RegionKind), usize>>,
}

impl handoff::model::RegionView for Counting {
    fn with(&self, rank: RankId, kind: handoff_components::vocab::RegionKind, f: &mut dyn FnMut(&[u8])) -> Result<(), handoff::model::ModelError> {
        *self.calls.lock().unwrap().entry((rank, kind)).or_default() += 1;
        self.inner.with(rank, kind, f)
    }
    fn with_mut(&self, rank: RankId, kind: handoff_components::vocab::RegionKind, f: &mut dyn FnMut(&mut [u8])) -> Result<(), handoff::model::ModelError> {
        *self.calls.lock().unwrap().entry((rank, kind)).or_default() += 1;
        self.inner.with_mut(rank, kind, f)
    }
}

/// The decode ranks take each region view once to read and once to write per
/// layer per step (a transport-backed view locks per call), whatever the batch
/// size and however many rows the requests hold.
#[test]
fn decode_ranks_take_each_region_a_bounded_number_of_times_per_step() {
    use handoff_components::vocab::{LayerKind, RegionKind};
    let c = Cfg { dtp: 2, dcp: 2, replay: Some(6), ..BASE };
    let t = topo(&c);
    let model = Model::new(&t).expect("model");
    let group = model.upload_group(&BE, 2).expect("upload");
    let n = 5;
    let (layouts, mem, leases) = decode_regions(&t, n, 40);
    let view = Counting { inner: mem, calls: Mutex::new(BTreeMap::new()) };
    // Request b of the batch feeds position positions[b].
    let per_step = |positions: &[usize]| {
        view.calls.lock().unwrap().clear();
        let mut caches = DecodeRanks::new(&t, &layouts, &view, leases[..positions.len()].to_vec());
        forward::decode_batch(&BE, &group, &vec![7; positions.len()], positions, &mut caches).expect("step");
        view.calls.lock().unwrap().clone()
    };
    for pos in 0..30 {
        per_step(&vec![pos; n]);
    }
    let one = per_step(&[30]);
    let all = per_step(&[31, 30, 30, 30, 30]);
    assert_eq!(one, all, "view calls depend on the batch size");
    let kda = t.layer_kinds.iter().filter(|k| **k == LayerKind::Kda).count();
    let mla = t.layer_kinds.len() - kda;
    for ((rank, kind), calls) in &all {
        let layers = if *kind == RegionKind::MlaKv { mla } else { kda };
        let bound = if *kind == RegionKind::MlaKv { 1 } else { 2 };
        assert!(*calls <= bound * layers, "{rank} {kind}: {calls} view calls in one step over {layers} layers");
    }
}
