//! Every topology of the matrix hands off byte-exact: placement, splitting and an
//! in-process transfer through the engine, checked by the oracle (written from the
//! rules, not from the planner), with two requests in flight.

mod common;
use common::Shape;
use handoff::check::verify::verify;

fn check(shape: &Shape, tokens: u64) {
    let topo = shape.topology();
    if let Err(e) = verify(&topo, tokens, 2, |_| {}) {
        panic!(
            "tokens {tokens}, pp {} x tp {} (split {:?}, block {}) -> tp {} x dcp {} (interleave {}, block {}), replay {:?}: {e}",
            shape.pp, shape.ptp, shape.split, shape.pbs, shape.dtp, shape.dcp, shape.interleave, shape.dbs, shape.replay
        );
    }
}

/// PP 1, 2, 3, 8 x prefill TP 1, 2, 4 x decode TP 1, 2, 4, 8 x DCP 1, 2, 4, 8 x
/// interleave 1 and = block size x replay on and off x three prompt lengths
/// (1, a multiple of the block size, neither).
#[test]
fn every_parallel_shape_hands_off_byte_exact() {
    let mut checked = 0;
    for pp in [1, 2, 3, 8] {
        for ptp in [1, 2, 4] {
            for dtp in [1, 2, 4, 8] {
                if dtp % ptp != 0 {
                    continue;
                }
                for dcp in [1, 2, 4, 8] {
                    if dtp % dcp != 0 {
                        continue;
                    }
                    for interleave in [1, 4] {
                        for replay in [None, Some(3)] {
                            let shape = Shape { pp, ptp, dtp, dcp, interleave, replay, ..Default::default() };
                            for tokens in [1, 16, 23] {
                                check(&shape, tokens);
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 500, "matrix shrank to {checked} cases");
}

/// Explicit uneven layer splits, including stages that hold only KDA or only MLA layers.
#[test]
fn uneven_layer_splits_hand_off_byte_exact() {
    for split in [vec![1, 7], vec![5, 2, 1], vec![3, 1, 4], vec![4, 4], vec![1, 1, 1, 1, 1, 1, 1, 1]] {
        for dcp in [1, 2] {
            let shape = Shape { pp: split.len() as u32, split: split.clone(), ptp: 2, dtp: 4, dcp, replay: Some(2), ..Default::default() };
            for tokens in [1, 8, 13] {
                check(&shape, tokens);
            }
        }
    }
}

/// Source and destination block sizes differ (both ways), with token interleave.
#[test]
fn different_block_sizes_hand_off_byte_exact() {
    for (pbs, dbs) in [(4, 8), (8, 4), (16, 2), (3, 6), (5, 4)] {
        for (dtp, dcp, interleave) in [(1, 1, 1), (2, 2, 1), (4, 4, 2), (8, 8, 1), (4, 2, dbs)] {
            if dbs % interleave != 0 {
                continue;
            }
            let shape = Shape { pp: 2, pbs, dbs, dtp, dcp, interleave, ..Default::default() };
            for tokens in [1, 24, 37] {
                check(&shape, tokens);
            }
        }
    }
}

/// Sparse MLA (indexer rows) under PP 1, and f32 / f16 model dtypes.
#[test]
fn indexer_rows_and_other_dtypes_hand_off_byte_exact() {
    for dtype in ["f32", "f16", "bf16"] {
        let shape = Shape { indexer: 6, dtype, dtp: 4, dcp: 2, interleave: 2, replay: Some(2), ..Default::default() };
        for tokens in [1, 12, 19] {
            check(&shape, tokens);
        }
    }
}

/// Models of one kind only: all KDA (no MLA rows) and all MLA (no state).
#[test]
fn single_kind_models_hand_off_byte_exact() {
    for pattern in ["K", "M", "MK", "KKKKKKKM"] {
        let shape = Shape { pattern, pp: 2, dtp: 4, dcp: 4, ..Default::default() };
        check(&shape, 9);
    }
}
