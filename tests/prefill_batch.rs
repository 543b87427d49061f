//! A batched prefill (several prompts laid end to end in one forward pass, as a
//! prefill stage runs the requests ready in one tick) gives every prompt the
//! bits it gets alone: the hidden states of its rows, every cache a rank leaves
//! for it (KDA state, conv state, ReplaySSM records, MLA rows), and the logits
//! of its last position. Prompts on both sides of the 64-token KDA prefill
//! chunk, one-token prompts, TP1 and TP2, with and without ReplaySSM.

mod common;

use handoff::model::forward::{self, PrefillCache, PrefillSeq};
use handoff::model::{Model, ShardGroup};
use handoff_kernels::{Backend, CpuBackend};
use std::collections::BTreeMap;

const BE: CpuBackend = CpuBackend;

/// (prompt, tp rank, layer) -> every buffer the rank cached, downloaded.
type Caches = BTreeMap<(usize, usize, usize), Vec<Vec<f32>>>;

fn keep(caches: &mut Caches, seq: usize, tp: usize, layer: usize, cache: PrefillCache<'_, CpuBackend>) {
    let bufs = match cache {
        PrefillCache::Kda(c) => {
            vec![BE.download(&c.state).unwrap(), BE.download(&c.conv).unwrap(), BE.download(&c.records).unwrap(), vec![c.record_tokens as f32]]
        }
        PrefillCache::Mla(rows) => vec![BE.download(rows).unwrap()],
    };
    assert!(caches.insert((seq, tp, layer), bufs).is_none(), "prompt {seq} tp {tp} layer {layer} cached twice");
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn prompt(len: usize, salt: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i * 37 + salt * 11 + 3) as u8).collect()
}

fn check(group: &ShardGroup<CpuBackend>, lens: &[usize]) {
    let dims = &group.dims;
    let (n, d) = (dims.num_layers(), dims.hidden);
    let prompts: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &l)| prompt(l, i as u32)).collect();
    let seqs = PrefillSeq::packed(lens, |t| dims.record_tail(t));

    let mut batched = Caches::new();
    let mut h = forward::embed(&BE, group, &prompts.concat()).unwrap();
    forward::prefill_batch(&BE, group, 0..n, &mut h, &seqs, &mut |i, tp, layer, c| {
        keep(&mut batched, i, tp, layer, c);
        Ok(())
    })
    .unwrap();
    let lasts = forward::logits_of_lasts(&BE, group, &h, &seqs).unwrap();
    let h = BE.download(&h).unwrap();

    for (i, (p, s)) in prompts.iter().zip(&seqs).enumerate() {
        let mut alone = Caches::new();
        let mut ha = forward::embed(&BE, group, p).unwrap();
        forward::prefill_layers(&BE, group, 0..n, &mut ha, p.len(), dims.record_tail(p.len()), &mut |tp, layer, c| {
            keep(&mut alone, i, tp, layer, c);
            Ok(())
        })
        .unwrap();
        let (logits, tok) = forward::logits_of_last(&BE, group, &ha, p.len()).unwrap();
        let ha = BE.download(&ha).unwrap();
        assert_eq!(bits(&h[s.start * d..(s.start + s.len) * d]), bits(&ha), "prompt {i} of {lens:?}: hidden states differ from the prompt alone");
        assert_eq!((bits(&lasts[i].0), lasts[i].1), (bits(&logits), tok), "prompt {i} of {lens:?}: last logits differ");
        let mine: Caches = batched.iter().filter(|((q, ..), _)| *q == i).map(|(k, v)| (*k, v.clone())).collect();
        assert_eq!(mine.len(), n * group.tp(), "prompt {i}: a cache per rank and layer");
        for (k, v) in &alone {
            let got = &mine[k];
            assert_eq!(got.len(), v.len());
            for (a, b) in got.iter().zip(v) {
                assert_eq!(bits(a), bits(b), "prompt {i} of {lens:?}, (prompt, tp, layer) {k:?}: cache differs from the prompt alone");
            }
        }
    }
}

#[test]
fn a_batched_prefill_gives_each_prompt_its_own_bits() {
    for (replay, tp) in [(None, 1), (Some(8), 2), (Some(8), 1)] {
        let topo = common::ComputeShape { hidden: 48, seed: 31, replay, ptp: tp, dtp: tp, ..common::COMPUTE }.topology();
        let model = Model::new(&topo).unwrap();
        let group = model.upload_group(&BE, tp as usize).unwrap();
        for lens in [&[70usize, 5, 130, 1][..], &[1, 1], &[64, 64, 3]] {
            check(&group, lens);
        }
    }
}

#[test]
fn a_batch_whose_prompts_do_not_tile_the_rows_is_refused() {
    let topo = common::COMPUTE.topology();
    let model = Model::new(&topo).unwrap();
    let group = model.upload_group(&BE, 1).unwrap();
    let n = group.dims.num_layers();
    let mut h = forward::embed(&BE, &group, &prompt(10, 0)).unwrap();
    for seqs in [
        vec![PrefillSeq { start: 0, len: 4, record_tail: 0 }, PrefillSeq { start: 5, len: 5, record_tail: 0 }],
        vec![PrefillSeq { start: 0, len: 0, record_tail: 0 }],
        vec![],
    ] {
        let e = forward::prefill_batch(&BE, &group, 0..n, &mut h, &seqs, &mut |_, _, _, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("prefill batch"), "{e}");
    }
}
