//! Launch records worked out by hand from the CUDA backend before its ops
//! moved onto the seam (`gpu/cuda/{backend,copy,dense,kda,mla}.rs` at
//! 327a68b: each `LaunchConfig` and `launch_builder(..).arg(..)` chain), for
//! one shape of each op family. The numbers here are written out, not
//! computed from the constants the ops use, so a changed grid, block,
//! shared-memory size, argument or argument order fails.

use super::*;

/// One expected argument: a value, or any pointer (a scratch buffer the op
/// allocates itself).
#[derive(Debug, Clone, Copy)]
enum W {
    A(Arg),
    AnyP,
}

fn p(b: u64) -> W {
    W::A(Arg::P(b))
}
fn i(v: i32) -> W {
    W::A(Arg::I(v))
}
fn l(v: i64) -> W {
    W::A(Arg::L(v))
}

/// Holds launch `got` against (kernel, grid, block, smem, whether a table
/// comes first, arguments).
fn check(got: &Rec, f: &str, grid: (u32, u32, u32), block: u32, smem: u32, table: bool, args: &[W]) {
    let at = format!("{f} (got {})", got.f);
    assert_eq!(got.f, f, "{at}: kernel");
    assert_eq!((got.grid, got.block, got.smem), (grid, block, smem), "{at}: grid, block, shared memory");
    assert_eq!(got.head.is_some(), table, "{at}: by-value table");
    assert_eq!(got.args.len(), args.len(), "{at}: {:?}", got.args);
    for (j, (g, w)) in got.args.iter().zip(args).enumerate() {
        match w {
            W::A(a) => assert_eq!(g, a, "{at}: argument {j}"),
            W::AnyP => assert!(matches!(g, Arg::P(x) if *x != 0), "{at}: argument {j} is {g:?}, want a pointer"),
        }
    }
}

/// The units table a launch passed, as 32 rows of 6 i64.
fn table(r: &Rec) -> Vec<[i64; 6]> {
    let h = r.head.as_ref().expect("a table");
    h.chunks_exact(48).map(|row| std::array::from_fn(|k| i64::from_le_bytes(row[k * 8..k * 8 + 8].try_into().unwrap()))).collect()
}

#[test]
fn copies_norms_and_conv_launch_as_before() {
    let (be, rec) = backend(None, false);
    let mut a = buf(&be, 1000, 1.0);
    let mut c = be.alloc(600).unwrap();
    rec.take();
    be.fill(&mut a, 2.5).unwrap();
    be.copy_cols(ColsCopy { rows: 10, src_cols: 100, src_col: 5, dst_cols: 60, dst_col: 10, width: 50 }, &a, &mut c).unwrap();
    be.round_to(&mut a, StorageDtype::Bf16).unwrap();
    be.round_to(&mut a, StorageDtype::F32).unwrap();
    let w = buf(&be, 100, 1.0);
    let mut o = be.alloc(1000).unwrap();
    rec.take();
    be.rms_norm(NormShape { rows: 10, dim: 100, eps: 1e-6 }, &a, &w, &mut o).unwrap();
    be.gated_rms_norm(NormShape { rows: 10, dim: 100, eps: 1e-6 }, &a, &c, &w, &mut o).unwrap_err();
    let l1 = rec.take();
    assert_eq!(l1.len(), 1, "gated_rms_norm refuses a gate of another length before launching");
    check(&l1[0], "rms_norm", (10, 1, 1), 256, 32, false, &[p(a.ptr), p(w.ptr), p(o.ptr), i(100), W::A(Arg::F(1e-6))]);
    let (x, wc, mut st, mut out) = (buf(&be, 5 * 64, 1.0), buf(&be, 64 * 4, 0.1), be.alloc(3 * 64).unwrap(), be.alloc(5 * 64).unwrap());
    rec.take();
    be.conv_prefill(ConvShape { channels: 64, width: 4 }, 5, &x, &wc, &mut st, &mut out).unwrap();
    let l2 = rec.take();
    check(&l2[0], "conv_prefill_out", (2, 1, 1), 256, 0, false, &[p(x.ptr), p(wc.ptr), p(st.ptr), p(out.ptr), i(5), i(64), i(4)]);
    check(&l2[1], "conv_prefill_state", (1, 1, 1), 256, 0, false, &[p(x.ptr), p(st.ptr), i(5), i(64), i(4)]);
    assert_eq!(l2.len(), 2);
}

#[test]
fn fill_copy_cols_and_round_launch_as_before() {
    let (be, rec) = backend(None, false);
    let mut a = buf(&be, 1000, 1.0);
    let mut c = be.alloc(600).unwrap();
    rec.take();
    be.fill(&mut a, 2.5).unwrap();
    be.copy_cols(ColsCopy { rows: 10, src_cols: 100, src_col: 5, dst_cols: 60, dst_col: 10, width: 50 }, &a, &mut c).unwrap();
    be.round_to(&mut a, StorageDtype::Bf16).unwrap();
    be.round_to(&mut a, StorageDtype::F32).unwrap();
    let got = rec.take();
    assert_eq!(got.len(), 3, "round_to f32 launches nothing");
    check(&got[0], "fill_f32", (4, 1, 1), 256, 0, false, &[p(a.ptr), W::A(Arg::F(2.5)), l(1000)]);
    check(&got[1], "copy_cols", (2, 1, 1), 256, 0, false, &[p(a.ptr), p(c.ptr), l(10), l(100), l(5), l(60), l(10), l(50)]);
    check(&got[2], "round_to", (4, 1, 1), 256, 0, false, &[p(a.ptr), i(1), l(1000)]);
}

#[test]
fn kda_launches_as_before() {
    let (be, rec) = backend(None, false);
    let (h, dk, dv) = (2, 128, 128);
    let n = 130;
    let ins: Vec<_> = [n * h * dk, n * h * dk, n * h * dv, n * h * dk, n * h, h, h * dk].iter().map(|&m| buf(&be, m, 0.1)).collect();
    let (mut st, mut st2) = (be.alloc(h * dk * dv).unwrap(), be.alloc(2 * h * dk * dv).unwrap());
    let mut out = be.alloc(n * h * dv).unwrap();
    let x = KdaInputs { q: &ins[0], k: &ins[1], v: &ins[2], g_raw: &ins[3], b_raw: &ins[4] };
    let pr = KdaParams { a_log: &ins[5], dt_bias: &ins[6] };
    let inp: Vec<W> = ins.iter().map(|b| p(b.ptr)).collect();
    rec.take();
    // The decode step, default kernel C2: (slots x heads, dv / 64) blocks of 8 warps.
    let mut st3 = be.alloc(3 * h * dk * dv).unwrap();
    let q3: Vec<_> = [3 * h * dk, 3 * h * dk, 3 * h * dv, 3 * h * dk, 3 * h].iter().map(|&m| buf(&be, m, 0.1)).collect();
    let mut o3 = be.alloc(3 * h * dv).unwrap();
    rec.take();
    let x3 = KdaInputs { q: &q3[0], k: &q3[1], v: &q3[2], g_raw: &q3[3], b_raw: &q3[4] };
    be.kda_step(KdaStepShape { batch: 3, heads: h, dk, dv }, &mut st3, x3, pr, &mut o3, None).unwrap();
    let got = rec.take();
    let mut want = vec![p(st3.ptr)];
    want.extend(q3.iter().map(|b| p(b.ptr)));
    want.extend([p(ins[5].ptr), p(ins[6].ptr), p(o3.ptr), p(0), p(0), i(1), i(2), i(128), i(128)]);
    check(&got[0], "kda_step_c2", (6, 2, 1), 256, 6208, false, &want);
    // A 130-token prompt at 128 x 128: the chunked form (3 chunks).
    be.kda_prefill(KdaPrefillShape { tokens: n, heads: h, dk, dv }, &mut st, x, pr, &mut out, None).unwrap();
    let got = rec.take();
    assert_eq!(got.len(), 3);
    let mut want = inp.clone();
    want.extend([p(0), W::AnyP, W::AnyP, i(1), i(2), i(128), i(128)]);
    check(&got[0], "kda_chunk_prep", (3, 2, 1), 256, 104704, false, &want);
    let (ws, seg) = (got[0].args[8], got[0].args[9]);
    check(&got[1], "kda_chunk_state", (2, 8, 1), 256, 161024, false, &[p(st.ptr), W::A(ws), W::A(seg), i(3), i(2), i(128), i(128)]);
    check(&got[2], "kda_chunk_out", (3, 2, 2), 256, 102400, false, &[p(out.ptr), p(0), W::A(ws), W::A(seg), i(1), i(2), i(128), i(128)]);
    // The ragged prefill of a 10-token prompt: the recurrent kernel over a
    // sequence table (first row, rows, state).
    be.kda_prefill_ragged(KdaRaggedShape { rows: n, heads: h, dk, dv }, &[0..0, 3..13], &mut st2, x, pr, &mut out, None).unwrap();
    let got = rec.take();
    assert_eq!(got.len(), 1);
    let Arg::P(seg) = got[0].args[10] else { panic!("{:?}", got[0].args) };
    assert_eq!(rec.read::<i32>(seg, 3), vec![3, 10, 1], "the sequence table");
    let mut want = vec![p(st2.ptr)];
    want.extend(inp.iter().copied());
    want.extend([p(out.ptr), p(0), p(seg), i(0), i(2), i(128), i(128)]);
    check(&got[0], "kda_prefill", (2, 4, 1), 256, 4 * (4 * 128 + 2 * 8 * 32 + 16), false, &want);
}

#[test]
fn replay_launches_and_cursor_writes_as_before() {
    let (be, rec) = backend(None, false);
    let rs = ReplayShape { batch: 2, heads: 2, dk: 16, dv: 16, capacity: 8 };
    let mut ring = be.alloc(2 * 8 * 2 * 48).unwrap();
    let mut cursor = be.upload_i32(&[0, 1]).unwrap();
    let records = buf(&be, 2 * 3 * 2 * 48, 0.5);
    let mut state = be.alloc(2 * 2 * 16 * 16).unwrap();
    rec.take();
    be.replay_append(rs, 3, &mut ring, &mut cursor, &records).unwrap();
    let writes = rec.state().writes.clone();
    let got = rec.take();
    check(&got[0], "replay_append", (2, 2, 1), 256, 0, false, &[p(ring.ptr), p(cursor.data.ptr), p(records.ptr), i(8), i(3), l(96)]);
    assert_eq!(writes, vec![(b'u', cursor.data.ptr, 8)], "the new cursors, one copy of batch x 4 bytes after the launch");
    assert_eq!(rec.read::<i32>(cursor.data.ptr, 2), vec![3, 4]);
    be.replay_commit(rs, &mut state, &ring, &mut cursor).unwrap();
    let writes = rec.state().writes.clone();
    let got = rec.take();
    check(&got[0], "replay_commit", (4, 1, 1), 32, 0, false, &[p(state.ptr), p(ring.ptr), p(cursor.data.ptr), i(8), i(2), i(16), i(16)]);
    assert_eq!(writes, vec![(b'z', cursor.data.ptr, 8)], "the cursors zeroed after the launch");
    assert_eq!(*cursor.known(), Some(vec![0, 0]));
    // A full ring is the CPU's error, before any launch.
    let mut full = be.upload_i32(&[6, 0]).unwrap();
    let e = be.replay_append(rs, 3, &mut ring, &mut full, &records).unwrap_err();
    assert!(matches!(e, KernelError::ReplayFull { slot: 0, cursor: 6, tokens: 3, capacity: 8 }), "{e:?}");
    assert!(rec.take().is_empty());
}

#[test]
fn mla_launches_as_before() {
    let (be, rec) = backend(None, false);
    let small = MlaShape { heads: 2, kv_lora_rank: 64, rope_dim: 16, scale: 0.1 };
    let (q, rows, mut out, mut lse) = (buf(&be, 2 * 80, 0.1), buf(&be, 5 * 80, 0.1), be.alloc(2 * 64).unwrap(), be.alloc(2).unwrap());
    rec.take();
    be.mla_decode(small, &q, RowSet { buf: &rows, count: 5 }, &mut out, &mut lse).unwrap();
    let got = rec.take();
    let want = [p(q.ptr), p(rows.ptr), p(out.ptr), p(lse.ptr), i(2), i(64), i(80), l(5), W::A(Arg::F(0.1))];
    check(&got[0], "mla_attend_f32", (2, 1, 1), 256, 2432, false, &want);
    // K3's rows, two requests of 300 and 20 rows: tc8 in 256-row chunks,
    // three blocks (at most one a multiprocessor: the deep ring), then the merge.
    let k3 = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 0.1 };
    let (q8, r8, mut part) = (buf(&be, 2 * 8 * 576, 0.1), buf(&be, 320 * 576, 0.1), be.alloc_f64(2 * 8 * 514).unwrap());
    rec.take();
    be.mla_decode_partial_ragged(k3, &q8, &r8, &[300, 20], &mut part).unwrap();
    let got = rec.take();
    assert_eq!(got.len(), 2);
    let (Arg::P(work), Arg::P(parts)) = (got[0].args[2], got[0].args[3]) else { panic!("{:?}", got[0].args) };
    let Arg::P(tbl) = got[1].args[1] else { panic!("{:?}", got[1].args) };
    assert_eq!(work, tbl + 3 * 8, "the work rows follow the B + 1 chunk starts");
    assert_eq!(rec.read::<i64>(tbl, 12), vec![0, 2, 3, 0, 256, 0, 256, 44, 0, 300, 20, 1], "the work table");
    check(&got[0], "mla_partial_tc8_deep", (3, 1, 1), 256, 159040, false, &[p(q8.ptr), p(r8.ptr), p(work), p(parts), i(8), W::A(Arg::D(0.1f32 as f64))]);
    check(&got[1], "mla_chunk_merge_f64", (16, 16, 1), 256, 0, false, &[p(parts), p(tbl), p(part.ptr), i(8), i(512)]);
    // The same counts again: the table and scratch are kept, nothing uploaded.
    be.mla_decode_partial_ragged(k3, &q8, &r8, &[300, 20], &mut part).unwrap();
    assert!(rec.state().writes.is_empty(), "a repeated call uploads nothing");
    assert_eq!(rec.take()[1].args[1], Arg::P(tbl));
    // The scalar kernel over a ragged batch: row starts uploaded as u64.
    let (q3, mut p3) = (buf(&be, 3 * 2 * 80, 0.1), be.alloc_f64(3 * 2 * 66).unwrap());
    rec.take();
    be.mla_decode_partial_ragged(small, &q3, &rows, &[3, 0, 2], &mut p3).unwrap();
    let got = rec.take();
    let Arg::P(starts) = got[0].args[2] else { panic!() };
    assert_eq!(rec.read::<u64>(starts, 4), vec![0, 3, 3, 5]);
    let want = [p(q3.ptr), p(rows.ptr), p(starts), p(p3.ptr), i(2), i(64), i(80), l(0), W::A(Arg::D(0.1f32 as f64))];
    check(&got[0], "mla_partial_f64", (6, 1, 1), 256, 4 * 2 * (80 + 8 * 64 + 16), false, &want);
}

#[test]
fn matmuls_launch_as_before() {
    let (be, rec) = backend(None, false);
    // 4 rows: matmul_tc16 (16 x 128 tiles) over 2 chunks of k, then the chunk sum.
    let (x, w, mut o) = (buf(&be, 4 * 130, 0.1), buf(&be, 130 * 200, 0.1), be.alloc(4 * 200).unwrap());
    rec.take();
    be.matmul(MatmulShape { rows: 4, inner: 130, cols: 200 }, &x, &w, &mut o).unwrap();
    let got = rec.take();
    check(&got[0], "matmul_tc16", (2, 2, 1), 128, 76288, true, &[p(x.ptr), W::AnyP, i(4), l(130)]);
    assert_eq!(table(&got[0])[0], [w.ptr as i64, 0, 0, 0, 130, 200]);
    assert!(table(&got[0])[1..].iter().all(|r| *r == [0; 6]));
    let part = got[0].args[1];
    check(&got[1], "matmul_chunk_sum", (4, 1, 1), 256, 0, false, &[W::A(part), p(o.ptr), l(800), i(2)]);
    // 256 x 4096 (128 tiles of 64 x 128): matmul_tcb, in place.
    let (x, w, mut o) = (buf(&be, 256 * 256, 0.1), buf(&be, 256 * 4096, 0.1), be.alloc(256 * 4096).unwrap());
    rec.take();
    be.matmul(MatmulShape { rows: 256, inner: 256, cols: 4096 }, &x, &w, &mut o).unwrap();
    let got = rec.take();
    check(&got[0], "matmul_tcb", (32, 4, 1), 256, 104448, true, &[p(x.ptr), p(o.ptr), i(256), l(256), l(4096)]);
    // An empty k zeroes the whole of out's allocation.
    let mut z = be.alloc(24).unwrap();
    rec.take();
    be.matmul(MatmulShape { rows: 3, inner: 0, cols: 8 }, &buf(&be, 0, 0.0), &buf(&be, 0, 0.0), &mut z).unwrap();
    let writes = rec.state().writes.clone();
    assert_eq!(writes.last(), Some(&(b'z', z.ptr, 24 * 4)));
    assert!(rec.take().is_empty());
}

#[test]
fn the_warpgroup_matmul_launches_as_before() {
    let (be, rec) = backend(None, true);
    let (x, w, mut o) = (buf(&be, 256 * 256, 0.1), buf(&be, 256 * 4096, 0.1), be.alloc(256 * 4096).unwrap());
    rec.take();
    be.matmul(MatmulShape { rows: 256, inner: 256, cols: 4096 }, &x, &w, &mut o).unwrap();
    let got = rec.take();
    assert_eq!(got.len(), 3);
    check(&got[0], "mwg_pack_x", (16, 2, 1), 256, 0, true, &[p(x.ptr), l(256), i(256), i(1), W::AnyP]);
    check(&got[1], "mwg_pack_w", (16, 32, 1), 256, 0, true, &[W::AnyP]);
    let (xp, wp) = (got[0].args[4], got[1].args[0]);
    check(&got[2], "matmul_wg", (32, 2, 1), 256, 196608, true, &[W::A(xp), W::A(wp), i(1), p(o.ptr), i(256), l(4096)]);
}

#[test]
fn units_swiglu_and_small_ops_launch_as_before() {
    let (mut be, rec) = backend(None, false);
    let ws: Vec<_> = (0..3).map(|_| buf(&be, 64 * 32, 0.1)).collect();
    let x = buf(&be, 4 * 192, 0.1);
    let mut out = be.alloc(3 * 4 * 32).unwrap();
    let units: Vec<_> = (0..3).map(|i| UnitProduct { w: &ws[i], inner: 64, cols: 32, x_col: 64 * i, out_col: 0 }).collect();
    rec.take();
    be.matmul_units(UnitsShape { rows: 4, x_width: 192, out: UnitsOut::Stacked }, &x, &units, &mut out).unwrap();
    let got = rec.take();
    assert_eq!(got.len(), 2);
    check(&got[0], "matmul_tc16", (1, 1, 3), 128, 76288, true, &[p(x.ptr), W::AnyP, i(4), l(192)]);
    let t = table(&got[0]);
    for (k, w) in ws.iter().enumerate() {
        let k64 = k as i64;
        assert_eq!(t[k], [w.ptr as i64, 64 * k64, 128 * k64, 128 * k64, 64, 32], "unit {k}");
    }
    check(&got[1], "matmul_units_sum", (1, 3, 1), 256, 0, true, &[W::A(got[0].args[1]), p(out.ptr), i(4), l(32)]);
    // add_units: one launch fused, one add_inplace a unit (reading it in place) unfused.
    let (mut acc, st) = (be.alloc(100).unwrap(), buf(&be, 400, 1.0));
    rec.take();
    be.add_units(&mut acc, &st, 1..3).unwrap();
    be.set_fused(false);
    be.add_units(&mut acc, &st, 1..3).unwrap();
    be.set_fused(true);
    let got = rec.take();
    check(&got[0], "add_units", (1, 1, 1), 256, 0, false, &[p(acc.ptr), p(st.ptr), l(100), i(1), i(3)]);
    check(&got[1], "add_inplace", (1, 1, 1), 256, 0, false, &[p(acc.ptr), p(st.ptr + 400), l(100)]);
    check(&got[2], "add_inplace", (1, 1, 1), 256, 0, false, &[p(acc.ptr), p(st.ptr + 800), l(100)]);
    // swiglu: gate and up products, SiLU . up, the down product.
    let (g, u, d) = (buf(&be, 64 * 96, 0.1), buf(&be, 64 * 96, 0.1), buf(&be, 96 * 64, 0.1));
    let (xs, mut os) = (buf(&be, 4 * 64, 0.1), be.alloc(4 * 64).unwrap());
    rec.take();
    be.swiglu(MlpShape { tokens: 4, hidden: 64, intermediate: 96 }, &xs, MlpWeights { gate: &g, up: &u, down: &d }, &mut os).unwrap();
    let got = rec.take();
    let names: Vec<&str> = got.iter().map(|r| r.f).collect();
    assert_eq!(names, ["matmul_tc16", "matmul_chunk_sum", "matmul_tc16", "matmul_chunk_sum", "silu_mul", "matmul_tc16", "matmul_chunk_sum"]);
    let (ga, ua) = (got[1].args[1], got[3].args[1]);
    check(&got[4], "silu_mul", (2, 1, 1), 256, 0, false, &[W::A(ga), W::A(ua), W::AnyP, l(384)]);
    check(&got[6], "matmul_chunk_sum", (1, 1, 1), 256, 0, false, &[W::AnyP, p(os.ptr), l(256), i(1)]);
    // embedding (ids checked on the host first) and argmax.
    let (table_, ids, mut e) = (buf(&be, 10 * 64, 0.1), be.upload_i32(&[1, 2, 3]).unwrap(), be.alloc(3 * 64).unwrap());
    let (logits, mut picks) = (buf(&be, 30, 0.1), be.alloc_i32(3).unwrap());
    rec.take();
    be.embedding(EmbeddingShape { tokens: 3, vocab: 10, dim: 64 }, &table_, &ids, &mut e).unwrap();
    be.argmax(3, 10, &logits, &mut picks).unwrap();
    let bad = be.upload_i32(&[1, 10, 3]).unwrap();
    let err = be.embedding(EmbeddingShape { tokens: 3, vocab: 10, dim: 64 }, &table_, &bad, &mut e).unwrap_err();
    assert!(matches!(err, KernelError::IndexOutOfRange { op: "embedding", index: 10, position: 1, bound: 10, .. }), "{err:?}");
    let got = rec.take();
    assert_eq!(got.len(), 2);
    check(&got[0], "embedding", (1, 1, 1), 256, 0, false, &[p(table_.ptr), p(ids.data.ptr), p(e.ptr), i(3), i(64)]);
    check(&got[1], "argmax_rows", (3, 1, 1), 256, 0, false, &[p(logits.ptr), p(picks.data.ptr), i(10)]);
    assert_eq!(*picks.known(), None, "argmax's ids are device data");
}

#[test]
fn merges_and_regions_launch_as_before() {
    let (be, rec) = backend(None, false);
    let (o, ls, mut out, mut lse) = (buf(&be, 2 * 2 * 64, 0.1), buf(&be, 4, 0.1), be.alloc(2 * 64).unwrap(), be.alloc(2).unwrap());
    rec.take();
    be.dcp_merge(MergeShape { shards: 2, heads: 2, width: 64 }, &o, &ls, &mut out, &mut lse).unwrap();
    let got = rec.take();
    check(&got[0], "dcp_merge_f32", (2, 1, 1), 128, 0, false, &[p(o.ptr), p(ls.ptr), p(out.ptr), p(lse.ptr), i(2), i(2), i(64)]);
    let region = DeviceRegion { addr: 0x7000_0000, len: 1 << 20 };
    let g = be.region_gather(region, RegionItems { offsets: &[0, 1024], values: 16, dtype: StorageDtype::F32 }).unwrap();
    let got = rec.take();
    let Arg::P(offs) = got[0].args[1] else { panic!() };
    check(&got[0], "region_gather_b32", (1, 1, 1), 256, 0, false, &[p(region.addr), p(offs), l(2), l(16), p(g.ptr)]);
    be.region_scatter(&g, region, RegionItems { offsets: &[0, 1024], values: 16, dtype: StorageDtype::Bf16 }).unwrap();
    let got = rec.take();
    let Arg::P(offs) = got[0].args[1] else { panic!() };
    check(&got[0], "region_scatter_b16", (1, 1, 1), 256, 0, false, &[p(region.addr), p(offs), l(2), l(16), i(1), p(g.ptr)]);
}
