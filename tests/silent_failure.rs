//! A plan that skips the KDA conv or recurrent state (the bug public engines shipped)
//! fails the oracle, naming the region and coordinate of the first wrong byte.

mod common;
use common::Shape;
use handoff::check::CheckError;
use handoff::check::verify::verify;
use handoff_components::RegionKind;

/// The oracle's finding, as its message: a wrong byte is the oracle's to find,
/// not a refusal of the plans or of the topology.
fn oracle_finding(e: CheckError) -> String {
    assert!(matches!(e, CheckError::Oracle(_)), "not the oracle's finding: {e:?}");
    e.to_string()
}

fn dropping(kind: RegionKind) -> String {
    let topo = Shape { pp: 2, ptp: 1, dtp: 4, dcp: 2, replay: Some(2), ..Default::default() }.topology();
    let r = verify(&topo, 10, 1, |plans| {
        for p in plans.iter_mut() {
            p.descriptors.retain(|d| d.kind != kind);
        }
    });
    oracle_finding(r.expect_err("a plan without this kind must fail the oracle"))
}

#[test]
fn plan_without_conv_state_fails_the_oracle() {
    let e = dropping(RegionKind::KdaConv);
    assert!(e.contains("kda.conv") && e.contains("canary: untouched"), "{e}");
}

#[test]
fn plan_without_recurrent_state_fails_the_oracle() {
    let e = dropping(RegionKind::KdaState);
    assert!(e.contains("kda.state") && e.contains("canary: untouched"), "{e}");
}

#[test]
fn plan_without_replay_cursor_fails_the_oracle() {
    let e = dropping(RegionKind::ReplayCursor);
    assert!(e.contains("replay.cursor"), "{e}");
}

#[test]
fn plan_that_takes_the_wrong_heads_fails_the_oracle() {
    let topo = Shape { pp: 1, ptp: 1, dtp: 2, dcp: 1, ..Default::default() }.topology();
    let r = verify(&topo, 5, 1, |plans| {
        // Consumer tp1 reads the heads of tp0: the per-kind-offset bug of a TP1 producer.
        for p in plans.iter_mut().filter(|p| p.consumer.tp == 1) {
            for d in p.descriptors.iter_mut().filter(|d| d.kind == RegionKind::KdaState) {
                d.src_offset -= 4 * 4 * 2 * 4; // one producer-local head group back (4 heads x Dk 4 x Dv 2 x f32)
            }
        }
    });
    let e = oracle_finding(r.expect_err("wrong heads must fail"));
    assert!(e.contains("kda.state"), "{e}");
}

#[test]
fn plan_that_misplaces_one_token_row_fails_the_oracle() {
    let topo = Shape { pp: 2, dtp: 2, dcp: 2, ..Default::default() }.topology();
    let r = verify(&topo, 12, 1, |plans| {
        let p = plans.iter_mut().find(|p| p.descriptors.iter().any(|d| d.kind == RegionKind::MlaKv)).unwrap();
        let d = p.descriptors.iter_mut().find(|d| d.kind == RegionKind::MlaKv).unwrap();
        d.src_offset += 2; // shifted by one bf16 element
    });
    let e = oracle_finding(r.expect_err("a shifted row must fail"));
    assert!(e.contains("mla.kv"), "{e}");
}
