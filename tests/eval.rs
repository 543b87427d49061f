//! `handoff eval`: teacher-forced scoring through the disaggregated path equals the
//! colocated run's; dropping a state kind from the hand-off moves the logits; the
//! score itself is the textbook one (uniform logits give 8 bits per byte).

mod common;

use handoff::check::eval::{eval, score, windows};
use handoff::model::Trace;
use handoff_components::vocab::RegionKind;

const CASE: common::ComputeShape = common::ComputeShape { pp: 2, ptp: 2, dtp: 4, dcp: 2, interleave: 2, replay: Some(8), ..common::COMPUTE };

fn text() -> Vec<u8> {
    b"The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. ".repeat(8)
}

#[test]
fn disaggregated_scores_equal_colocated_under_teacher_forcing() {
    let r = eval(&CASE.topology(), &text(), 4, 24, 20, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.disaggregated.bytes, 4 * 20);
    assert_eq!(r.disaggregated, r.colocated, "bits per byte and accuracy must be equal");
    assert_eq!(r.max_rel_err, 0.0);
    assert!(r.equal());
}

#[test]
fn dropping_the_kda_state_from_the_hand_off_moves_the_logits() {
    let t = CASE.topology();
    for kind in [RegionKind::KdaState, RegionKind::MlaKv] {
        let r = eval(&t, &text(), 4, 24, 20, Some(kind)).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.max_rel_err > 1e-2, "{kind}: dropping it must change the logits, got {:.2e}", r.max_rel_err);
        assert!(!r.equal(), "{kind}");
        assert_ne!(r.disaggregated.bits_per_byte, r.colocated.bits_per_byte, "{kind}");
    }
}

#[test]
fn uniform_logits_score_eight_bits_and_a_sure_pick_scores_zero() {
    let w: &[u8] = b"abcd";
    let uniform = Trace { tokens: vec![0, 0], logits: vec![vec![0.0; 256]; 2] };
    let s = score(&[uniform], &[w], 2);
    assert_eq!(s.bytes, 2);
    assert!((s.bits_per_byte - 8.0).abs() < 1e-9, "{}", s.bits_per_byte);
    let mut sure = vec![vec![-100.0f32; 256]; 2];
    sure[0][b'c' as usize] = 100.0;
    sure[1][b'd' as usize] = 100.0;
    let s = score(&[Trace { tokens: vec![b'c', b'd'], logits: sure }], &[w], 2);
    assert!(s.bits_per_byte < 1e-9 && s.accuracy == 1.0, "{s:?}");
}

#[test]
fn windows_are_refused_when_the_data_is_too_short() {
    let e = windows(b"short", 2, 4, 4).unwrap_err();
    assert!(matches!(e, handoff::check::CheckError::Input(_)) && e.to_string().contains("5 bytes"), "{e}");
    assert_eq!(windows(b"0123456789", 2, 3, 2).unwrap(), vec![&b"01234"[..], &b"56789"[..]]);
}
