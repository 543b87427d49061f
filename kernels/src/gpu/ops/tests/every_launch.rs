//! Every op, on shapes that take each of its paths, through the recorder; each
//! launch against its kernel's signature in the sources.

use super::*;

/// A KDA op over a state, inputs, parameters, out and an optional record.
type RBuf = DeviceBuf<f32, Recorder>;
type KdaRun<'a> = dyn Fn(&GpuBackend<Recorder>, &mut RBuf, KdaInputs<'_, RBuf>, KdaParams<'_, RBuf>, &mut RBuf, Option<&mut RBuf>) -> Result<()> + 'a;

/// Runs every op of the backend over shapes that take every path: each KDA
/// kernel, the wide, recurrent and chunked prefills, replay, conv, norms, MLA
/// attention and partials (scalar, tc4, tc8, tc8_deep, ragged), every matmul
/// kernel (tc16, tc32, tcb or wg, the chunk and units sums), fused and
/// unfused units, the element-wise ops and the region kernels.
pub(super) fn exercise(be: &mut GpuBackend<Recorder>) {
    let ok = |r: Result<()>, what: &str| r.unwrap_or_else(|e| panic!("{what}: {e}"));
    // Copies and element-wise ops.
    let mut a = buf(be, 1000, 1.0);
    ok(be.fill(&mut a, 2.0), "fill");
    let mut c = be.alloc(1000).unwrap();
    ok(be.copy_cols(ColsCopy { rows: 10, src_cols: 100, src_col: 5, dst_cols: 100, dst_col: 0, width: 50 }, &a, &mut c), "copy_cols");
    for d in [StorageDtype::Bf16, StorageDtype::F16, StorageDtype::F32] {
        ok(be.round_to(&mut c, d), "round_to");
    }
    let w100 = buf(be, 100, 1.0);
    let norm = NormShape { rows: 10, dim: 100, eps: 1e-6 };
    ok(be.rms_norm(norm, &a, &w100, &mut c), "rms_norm");
    ok(be.gated_rms_norm(norm, &a, &a, &w100, &mut c), "gated_rms_norm");
    ok(be.silu_mul(&a, &a, &mut c), "silu_mul");
    ok(be.add_inplace(&mut c, &a), "add_inplace");
    let mut acc = be.alloc(100).unwrap();
    for fused in [true, false] {
        be.set_fused(fused);
        ok(be.add_units(&mut acc, &buf(be, 400, 1.0), 1..3), "add_units");
    }
    be.set_fused(true);
    // Conv.
    let conv = ConvShape { channels: 64, width: 4 };
    let (wc, mut sc) = (buf(be, 64 * 4, 0.1), be.alloc(3 * 64).unwrap());
    ok(be.conv_prefill(conv, 5, &buf(be, 5 * 64, 1.0), &wc, &mut sc, &mut be.alloc(5 * 64).unwrap()), "conv_prefill");
    let mut sb = be.alloc(3 * 3 * 64).unwrap();
    ok(be.conv_step(conv, 3, &buf(be, 3 * 64, 1.0), &wc, &mut sb, &mut be.alloc(3 * 64).unwrap()), "conv_step");
    // KDA.
    let kda_in = |be: &GpuBackend<Recorder>, n: usize, h: usize, dk: usize, dv: usize| {
        [buf(be, n * h * dk, 0.1), buf(be, n * h * dk, 0.1), buf(be, n * h * dv, 0.1), buf(be, n * h * dk, 0.1), buf(be, n * h, 0.1)]
    };
    let kda = |be: &GpuBackend<Recorder>, n: usize, states: usize, h: usize, dk: usize, dv: usize, record: bool, run: &KdaRun<'_>| {
        let [q, k, v, g, b] = kda_in(be, n, h, dk, dv);
        let (al, dt) = (buf(be, h, 0.1), buf(be, h * dk, 0.1));
        let mut st = be.alloc(states * h * dk * dv).unwrap();
        let mut out = be.alloc(n * h * dv).unwrap();
        let mut rec = be.alloc(n * h * (2 * dk + dv)).unwrap();
        let x = KdaInputs { q: &q, k: &k, v: &v, g_raw: &g, b_raw: &b };
        let p = KdaParams { a_log: &al, dt_bias: &dt };
        run(be, &mut st, x, p, &mut out, record.then_some(&mut rec)).unwrap_or_else(|e| panic!("kda n={n} dk={dk}: {e}"));
    };
    for kk in KdaKernel::ALL {
        be.set_kda_kernel(kk);
        for record in [false, true] {
            kda(be, 3, 3, 2, 128, 128, record, &|be, s, x, p, o, r| be.kda_step(KdaStepShape { batch: 3, heads: 2, dk: 128, dv: 128 }, s, x, p, o, r));
        }
    }
    be.set_kda_kernel(KdaKernel::C2);
    kda(be, 1, 1, 2, 200, 64, false, &|be, s, x, p, o, r| be.kda_step(KdaStepShape { batch: 1, heads: 2, dk: 200, dv: 64 }, s, x, p, o, r));
    for tokens in [10, 130] {
        kda(be, tokens, 1, 2, 128, 128, true, &|be, s, x, p, o, r| be.kda_prefill(KdaPrefillShape { tokens, heads: 2, dk: 128, dv: 128 }, s, x, p, o, r));
    }
    let seqs = [0..10, 10..150, 150..150];
    kda(be, 150, 3, 2, 128, 128, false, &|be, s, x, p, o, r| {
        be.kda_prefill_ragged(KdaRaggedShape { rows: 150, heads: 2, dk: 128, dv: 128 }, &seqs, s, x, p, o, r)
    });
    // Replay.
    let rs = ReplayShape { batch: 2, heads: 2, dk: 16, dv: 16, capacity: 8 };
    let mut ring = be.alloc(2 * 8 * 2 * 48).unwrap();
    let mut cursor = be.upload_i32(&[0, 1]).unwrap();
    ok(be.replay_append(rs, 3, &mut ring, &mut cursor, &buf(be, 2 * 3 * 2 * 48, 0.5)), "replay_append");
    ok(be.replay_commit(rs, &mut be.alloc(2 * 2 * 16 * 16).unwrap(), &ring, &mut cursor), "replay_commit");
    // MLA: a small shape (scalar kernels) and K3's (the tensor-core ones).
    let small = MlaShape { heads: 2, kv_lora_rank: 64, rope_dim: 16, scale: 0.1 };
    let k3 = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 0.1 };
    let rows = buf(be, 5 * 80, 0.1);
    let mut lse3 = be.alloc(3 * 2).unwrap();
    for lse in [true, false] {
        let r =
            be.mla_prefill(small, 3, &buf(be, 3 * 2 * 80, 0.1), RowSet { buf: &rows, count: 5 }, &mut be.alloc(3 * 2 * 64).unwrap(), lse.then_some(&mut lse3));
        ok(r, "mla_prefill");
    }
    let (mut o2, mut l2) = (be.alloc(2 * 64).unwrap(), be.alloc(2).unwrap());
    ok(be.mla_decode(small, &buf(be, 2 * 80, 0.1), RowSet { buf: &rows, count: 5 }, &mut o2, &mut l2), "mla_decode small");
    let k3rows = buf(be, 320 * 576, 0.1);
    let (mut o8, mut l8) = (be.alloc(8 * 512).unwrap(), be.alloc(8).unwrap());
    ok(be.mla_decode(k3, &buf(be, 8 * 576, 0.1), RowSet { buf: &k3rows, count: 300 }, &mut o8, &mut l8), "mla_decode k3");
    let mut p1 = be.alloc_f64(2 * 66).unwrap();
    ok(be.mla_decode_partial(small, &buf(be, 2 * 80, 0.1), RowSet { buf: &rows, count: 5 }, &mut p1), "mla_decode_partial");
    ok(be.mla_decode_partial_ragged(small, &buf(be, 3 * 2 * 80, 0.1), &rows, &[3, 0, 2], &mut be.alloc_f64(3 * 2 * 66).unwrap()), "ragged small");
    for kernel in ["tc8", "tc4", "tc8x2", "tc8x4", "tc8:128", "scalar"] {
        be.set_mla_kernel(kernel).unwrap();
        let mut p = be.alloc_f64(2 * 8 * 514).unwrap();
        ok(be.mla_decode_partial_ragged(k3, &buf(be, 2 * 8 * 576, 0.1), &k3rows, &[300, 20], &mut p), "ragged k3");
    }
    be.set_mla_kernel("tc8").unwrap();
    ok(be.dcp_merge(MergeShape { shards: 2, heads: 2, width: 64 }, &buf(be, 2 * 2 * 64, 0.1), &buf(be, 4, 0.1), &mut o2, &mut l2), "dcp_merge");
    ok(be.dcp_merge_partials(MergeShape { shards: 1, heads: 2, width: 64 }, &p1, &mut o2, &mut l2), "dcp_merge_partials");
    // Dense: every matmul kernel by its row count and tiles, and an empty k.
    for (rows, inner, cols) in [(4, 130, 200), (40, 130, 200), (256, 256, 4096), (256, 256, 1024), (3, 0, 8)] {
        let (x, w) = (buf(be, rows * inner, 0.1), buf(be, inner * cols, 0.1));
        ok(be.matmul(MatmulShape { rows, inner, cols }, &x, &w, &mut be.alloc(rows * cols).unwrap()), "matmul");
    }
    for intermediate in [96, 0] {
        let w = MlpWeights { gate: &buf(be, 64 * intermediate, 0.1), up: &buf(be, 64 * intermediate, 0.1), down: &buf(be, intermediate * 64, 0.1) };
        ok(be.swiglu(MlpShape { tokens: 4, hidden: 64, intermediate }, &buf(be, 4 * 64, 0.1), w, &mut be.alloc(4 * 64).unwrap()), "swiglu");
    }
    let table = buf(be, 10 * 64, 0.1);
    let ids = be.upload_i32(&[1, 2, 3]).unwrap();
    ok(be.embedding(EmbeddingShape { tokens: 3, vocab: 10, dim: 64 }, &table, &ids, &mut be.alloc(3 * 64).unwrap()), "embedding");
    let mut picks = be.alloc_i32(3).unwrap();
    ok(be.argmax(3, 10, &buf(be, 30, 0.1), &mut picks), "argmax");
    // Units: stacked and side by side, fused and one by one, more than one
    // table, and tiled.
    let ws: Vec<_> = (0..33).map(|_| buf(be, 64 * 32, 0.1)).collect();
    let x = buf(be, 4 * 192, 0.1);
    for fused in [true, false] {
        be.set_fused(fused);
        let stacked: Vec<_> = (0..3).map(|i| UnitProduct { w: &ws[i], inner: 64, cols: 32, x_col: 64 * i, out_col: 0 }).collect();
        ok(be.matmul_units(UnitsShape { rows: 4, x_width: 192, out: UnitsOut::Stacked }, &x, &stacked, &mut be.alloc(3 * 4 * 32).unwrap()), "units stacked");
        let cols: Vec<_> = (0..3).map(|i| UnitProduct { w: &ws[i], inner: 64, cols: 32, x_col: 64 * i, out_col: 32 * i }).collect();
        let shape = UnitsShape { rows: 4, x_width: 192, out: UnitsOut::Columns { width: 96 } };
        ok(be.matmul_units(shape, &x, &cols, &mut be.alloc(4 * 96).unwrap()), "units columns");
    }
    be.set_fused(true);
    let many: Vec<_> = ws.iter().map(|w| UnitProduct { w, inner: 64, cols: 32, x_col: 0, out_col: 0 }).collect();
    ok(
        be.matmul_units(UnitsShape { rows: 4, x_width: 64, out: UnitsOut::Stacked }, &buf(be, 4 * 64, 0.1), &many, &mut be.alloc(33 * 4 * 32).unwrap()),
        "units x33",
    );
    let wide: Vec<_> = (0..4).map(|_| buf(be, 64 * 1024, 0.1)).collect();
    let tiled: Vec<_> = wide.iter().map(|w| UnitProduct { w, inner: 64, cols: 1024, x_col: 0, out_col: 0 }).collect();
    ok(
        be.matmul_units(UnitsShape { rows: 256, x_width: 64, out: UnitsOut::Stacked }, &buf(be, 256 * 64, 0.1), &tiled, &mut be.alloc(4 * 256 * 1024).unwrap()),
        "units tiled",
    );
    // Regions (the kernels take any aligned device address: nothing runs).
    let region = DeviceRegion { addr: 0x7000_0000, len: 1 << 20 };
    for dtype in [StorageDtype::F32, StorageDtype::Bf16] {
        let items = RegionItems { offsets: &[0, 1024], values: 16, dtype };
        let g = be.region_gather(region, items).unwrap();
        ok(be.region_scatter(&g, region, items), "region_scatter");
    }
    let gi = be.region_gather_i32(region, &[0, 4]).unwrap();
    ok(be.region_scatter_i32(&gi, region, &[0, 4]), "region_scatter_i32");
}

/// Every launch of every op passes as many arguments as its kernel declares,
/// each of the kind the kernel reads (the units table first where the kernel
/// takes one by value), with a non-empty grid, at most 1,024 threads, and
/// no more dynamic shared memory than the default 48 KB or what the kernel
/// was given at open; and the ops between them name every kernel the backend
/// loads: on CUDA's rule with and without the warpgroup products, and on a
/// 64 KiB device under HIP's.
#[test]
fn every_launch_of_every_op_matches_its_kernels_signature() {
    let program = crate::gpu::device_program();
    let mut used = BTreeSet::new();
    for (lds, wg) in [(None, false), (None, true), (Some(64 * 1024), false)] {
        let (mut be, rec) = backend(lds, wg);
        exercise(&mut be);
        let given = rec.state().smem.clone();
        let launches = rec.take();
        assert!(launches.len() > 80, "{} launches", launches.len());
        for (i, l) in launches.iter().enumerate() {
            used.insert(l.f);
            let at = format!("launch {i} ({}, lds {lds:?}, wg {wg})", l.f);
            let want = signature(&program, l.f).unwrap_or_else(|| panic!("{at}: kernel not declared in the sources"));
            let got = kinds(l);
            assert_eq!(got.len(), want.len(), "{at}: {} arguments, the kernel takes {}", got.len(), want.len());
            if let Some(j) = (0..got.len()).find(|&j| got[j] != want[j]) {
                panic!("{at}: argument {j} is {:?}, the kernel declares {:?}", got[j], want[j]);
            }
            if let Some(h) = &l.head {
                assert_eq!(h.len(), 32 * 6 * 8, "{at}: the units table is 32 x 6 i64");
            }
            assert!(l.grid.0 > 0 && l.grid.1 > 0 && l.grid.2 > 0 && l.grid.1 <= 65535 && l.grid.2 <= 65535, "{at}: grid {:?}", l.grid);
            assert!(l.block > 0 && l.block <= 1024, "{at}: block {}", l.block);
            let limit = given.get(l.f).copied().unwrap_or(48 * 1024);
            assert!(l.smem <= limit, "{at}: {} bytes of shared memory, the kernel may take {limit}", l.smem);
            if let Some(max) = lds {
                assert!(l.smem <= max, "{at}: {} bytes past the device's {max}", l.smem);
            }
        }
    }
    let all: BTreeSet<&str> = OP_KERNELS.iter().chain(WG_KERNELS).copied().collect();
    assert_eq!(used, all, "the ops between them take every kernel");
}

/// Every kernel a generic op names is a kernel of the gfx90a code objects
/// that HipBackend::new loads (its symbol and its kernel descriptor), and the
/// warpgroup products are not (sm_90a only): the ops' table fits HIP's build.
#[cfg(feature = "hip")]
#[test]
fn every_op_kernel_is_in_the_gfx90a_code_objects() {
    let mut symbols = BTreeSet::new();
    for (_, co) in crate::gpu::HIP_CODE_OBJECTS {
        symbols.extend(crate::gpu::step_gpu::tests::bundle_symbols(co));
    }
    for k in OP_KERNELS {
        assert!(symbols.contains(*k) && symbols.contains(&format!("{k}.kd")), "{k}: not a kernel of the gfx90a code objects");
    }
    for k in WG_KERNELS {
        assert!(!symbols.contains(&format!("{k}.kd")), "{k} is sm_90a-only, yet a gfx90a kernel of that name exists");
    }
}
