//! The CI variant of `handoff bench soak`: a load through a `handoff up` process
//! while prefill stage 0 is killed (and restarted by `up`) and decode is stopped
//! (SIGSTOP) and continued. Every request completes or fails naming its role (and
//! phase), none is lost, every role's counts come back to their baseline with the
//! producer entries at 0, and requests after the faults succeed.

use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_handoff");

#[test]
fn a_killed_stage_and_a_stopped_decode_lose_nothing_and_leak_nothing() {
    let small = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config/small.toml"));
    let mut o = handoff::bench::SoakOptions::new(600, 16);
    o.idle = Duration::from_secs(2);
    o.kill_stage = Some(0);
    o.stop_decode = Duration::from_secs(3);
    o.program = Some(BIN.into());
    let r = handoff::bench::bench_soak(Some(small), &o).expect("soak");
    assert!(r.problems(true).is_empty(), "{:?}\nfaults: {:?}", r.problems(true), r.faults);
    assert_eq!(r.faults.len(), 2, "{:?}", r.faults);
    assert!(r.faults[0].contains("restarted by up"), "{}", r.faults[0]);
    assert!(r.faults[1].contains("named it down") && r.faults[1].contains("healthy"), "{}", r.faults[1]);
    let failed: u32 = r.failed.values().sum();
    assert_eq!(r.ok + failed + r.lost, 600);
    assert_eq!(r.lost, 0);
    for (role, f) in &r.after {
        assert_eq!(f.producer_entries, 0, "{role}");
        assert_eq!(f.requests, 0, "{role}");
        // Sampling state goes with its request, on every role.
        assert_eq!(f.sampling, 0, "{role}: sampling state left behind");
    }
    // A request the killed stage's successor settled before its job came is
    // remembered for 120 s, so it may still be counted; never more of them than
    // requests failed, and none on roles that settle nothing.
    let failed_total: u32 = r.failed.values().sum();
    assert!(r.after["prefill1"].settled <= failed_total as u64, "prefill1 settled {} > {failed_total} failed", r.after["prefill1"].settled);
    assert_eq!(r.after["decode"].settled, 0);
    assert_eq!(r.after["prefill0"].settled, 0, "stage 0 has no earlier stage to settle for");
    for role in ["decode", "prefill0", "prefill1"] {
        let (b, a) = (&r.before[role], &r.after[role]);
        assert_eq!((a.entities, a.free_blocks, a.free_slots), (b.entities, b.free_blocks, b.free_slots), "{role}");
    }
    assert_eq!(r.after_faults.0, r.after_faults.1);
}
