//! The CI variant of `handoff bench soak`: a load through a `handoff up` process
//! while prefill stage 0, the last stage and decode are each SIGKILLed once (and
//! restarted by `up`). No request fails or is lost: the proxy sends the requests
//! a killed role held again once it is back, counted in
//! `handoff_request_retries_total`; every completion equals its prompt's
//! completion in the unfaulted reference pass, token for token; every role's
//! counts come back to their baseline with the producer entries at 0, and
//! requests after the faults succeed.

use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_handoff");

#[test]
fn killed_stages_and_a_killed_decode_lose_no_request_and_change_no_token() {
    let small = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml"));
    let mut o = handoff::bench::SoakOptions::new(600, 16);
    o.idle = Duration::from_secs(2);
    o.prompts = 48;
    o.program = Some(BIN.into());
    assert_eq!(o.kills, [handoff::bench::soak::Victim::Stage(0), handoff::bench::soak::Victim::LastStage, handoff::bench::soak::Victim::Decode]);
    assert!(o.stop_decode.is_zero());
    let r = handoff::bench::bench_soak(Some(small), &o).expect("soak");
    assert!(r.problems(true).is_empty(), "{:?}\nfaults: {:?}", r.problems(true), r.faults);
    assert_eq!(r.faults.len(), 3, "{:?}", r.faults);
    for (f, role) in r.faults.iter().zip(["prefill stage 0", "prefill stage 1", "decode"]) {
        assert!(f.contains(&format!("SIGKILL {role}")) && f.contains("restarted by up"), "{f}");
    }
    assert_eq!((r.ok, r.lost), (600, 0), "failed: {:?}", r.reasons);
    assert!(r.failed.is_empty(), "{:?}", r.reasons);
    assert_eq!(r.mismatched, 0, "{:?}", r.mismatches);
    assert_eq!(r.reference, 48);
    // Decode always holds requests under this load: its death costs retries.
    let retried = |role: &str| r.retries.iter().filter(|(l, _)| l.contains(&format!("role=\"{role}\""))).map(|(_, n)| *n).sum::<u64>();
    assert!(retried("decode") > 0, "no request was retried for decode's death: {:?}", r.retries);
    eprintln!("retries: {:?}; 503s sent again: {}", r.retries, r.resent);
    for (role, f) in &r.after {
        assert_eq!(f.producer_entries, 0, "{role}");
        assert_eq!(f.requests, 0, "{role}");
        // Sampling state goes with its request, on every role.
        assert_eq!(f.sampling, 0, "{role}: sampling state left behind");
    }
    assert_eq!(r.after["decode"].settled, 0);
    assert_eq!(r.after["prefill0"].settled, 0, "stage 0 has no earlier stage to settle for");
    for role in ["decode", "prefill0", "prefill1"] {
        let (b, a) = (&r.before[role], &r.after[role]);
        assert_eq!((a.entities, a.free_blocks, a.free_slots), (b.entities, b.free_blocks, b.free_slots), "{role}");
    }
    assert_eq!(r.after_faults.0, r.after_faults.1);
}
