//! Every op against the CPU, batch invariance and determinism.

use super::*;

// ------------------------------------------------------------------ checks

pub(crate) fn checks(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let cpu = CpuBackend::new();
    let mut r = SplitMix64::new(seed);

    // Buffers, copies and storage rounding (with the values that test rounding).
    {
        let mut a = uni(&mut r, 4000, -3.0, 3.0);
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            65504.0,
            65520.0,
            70000.0,
            6.1035156e-5,
            5.9604645e-8,
            2.9802322e-8,
            1e-40,
            -1e-45,
            3.4e38,
            1.0 + 1.0 / 2048.0,
            -2.5,
        ];
        a[..special.len()].copy_from_slice(&special);
        let cols = ColsCopy { rows: 40, src_cols: 100, src_col: 13, dst_cols: 50, dst_col: 7, width: 31 };
        let p: Vec<f64> = (0..100).map(|i| i as f64 * 0.37 - 5.0).collect();
        let g = run_buffers(gpu, &a, cols, &p)?;
        let c = run_buffers(&cpu, &a, cols, &p)?;
        let names = ["fill", "copy", "copy_cols", "upload_into", "copy_f64", "round_to bf16", "round_to f16", "round_to f32"];
        for ((n, gv), cv) in names.iter().zip(&g).zip(&c) {
            rep.exact_f32(n, "4000 values incl. NaN, inf, subnormal, ties", gv, cv);
        }
    }

    // KDA step: K3's 128x128 heads, small heads, ragged widths (several column
    // tiles, rows not a multiple of 16), the widest dk; three steps, records.
    for &(b, h, dk, dv) in &[(4usize, 3usize, 128usize, 128usize), (5, 4, 16, 16), (3, 2, 40, 200), (2, 2, 256, 64), (1, 1, 7, 300)] {
        let steps: Vec<KdaHost> = (0..3).map(|_| KdaHost::new(&mut r, b, h, dk, dv)).collect();
        let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let (go, gs, gr) = run_kda_steps(gpu, b, &steps, &s0)?;
        let (co, cs, cr) = run_kda_steps(&cpu, b, &steps, &s0)?;
        let case = format!("B={b} H={h} dk={dk} dv={dv}, 3 steps");
        rep.close("kda_step out", &case, &go, &co, 1e-5);
        rep.close("kda_step state", &case, &gs, &cs, 1e-5);
        rep.close("kda_step record", &case, &gr, &cr, 1e-5);
    }

    // KDA prefill: CPU chunked (wide heads) and recurrent (small heads) forms;
    // where the GPU runs the recurrent prefill too (under a chunk of tokens,
    // narrow heads) it must equal its own steps bit for bit; its chunked
    // prefill (T = 65 and up here, and the 40x200 heads) agrees with the CPU
    // to 1e-4.
    for &(t, h, dk, dv) in &[(1usize, 2usize, 128usize, 128usize), (63, 2, 128, 128), (65, 2, 128, 128), (200, 2, 128, 128), (100, 4, 16, 16), (70, 3, 40, 200)]
    {
        let c = KdaHost::new(&mut r, t, h, dk, dv);
        let s0 = uni(&mut r, h * dk * dv, -0.5, 0.5);
        let (go, gs, gr) = run_kda_prefill(gpu, t, &c, &s0)?;
        let (co, cs, cr) = run_kda_prefill(&cpu, t, &c, &s0)?;
        let case = format!("T={t} H={h} dk={dk} dv={dv}");
        rep.close("kda_prefill out", &case, &go, &co, 1e-4);
        rep.close("kda_prefill state", &case, &gs, &cs, 1e-4);
        rep.close("kda_prefill record", &case, &gr, &cr, 1e-4);
        if t <= 65 && !device_prefill_chunked(t, dk, dv) {
            // T steps of batch one on the device.
            let steps: Vec<KdaHost> = (0..t).map(|i| c.rows(i, i + 1)).collect();
            let shape = KdaStepShape { batch: 1, heads: h, dk, dv };
            let mut state = gpu.upload(&s0)?;
            let mut outs = Vec::new();
            let mut o = gpu.alloc(h * dv)?;
            for s in &steps {
                let d = KdaDev::new(gpu, s)?;
                gpu.kda_step(shape, &mut state, d.inputs(), d.params(), &mut o, None)?;
                outs.extend(gpu.download(&o)?);
            }
            rep.exact_f32("kda_prefill = T gpu steps", &format!("{case}: out"), &go, &outs);
            rep.exact_f32("kda_prefill = T gpu steps", &format!("{case}: state"), &gs, &gpu.download(&state)?);
        }
    }

    // Chunked KDA prefill on the device against the CPU's chunked form: K3's
    // 128x128 heads, one chunk exactly, one token past it, a short last
    // chunk, many chunks; a nonzero initial state; with and without the
    // record (the output must not depend on it); two runs bit-equal.
    for &(t, h) in &[(64usize, 2usize), (65, 3), (200, 2), (1000, 3)] {
        let (dk, dv) = (128usize, 128usize);
        let c = KdaHost::new(&mut r, t, h, dk, dv);
        let s0 = uni(&mut r, h * dk * dv, -0.5, 0.5);
        let case = format!("T={t} H={h} dk={dk} dv={dv}");
        let (go, gs, gr) = run_kda_prefill(gpu, t, &c, &s0)?;
        let (co, cs, cr) = run_kda_prefill(&cpu, t, &c, &s0)?;
        rep.close("kda_prefill chunked out", &case, &go, &co, 1e-4);
        rep.close("kda_prefill chunked state", &case, &gs, &cs, 1e-4);
        rep.close("kda_prefill chunked record", &case, &gr, &cr, 1e-4);
        let (no, ns) = run_kda_prefill_norec(gpu, t, &c, &s0)?;
        let (cno, cns) = run_kda_prefill_norec(&cpu, t, &c, &s0)?;
        rep.close("kda_prefill chunked no rec", &format!("{case}: out"), &no, &cno, 1e-4);
        rep.close("kda_prefill chunked no rec", &format!("{case}: state"), &ns, &cns, 1e-4);
        rep.exact_f32("kda_prefill chunked rec = no rec", &case, &[no, ns].concat(), &[go.clone(), gs.clone()].concat());
        let (go2, gs2, gr2) = run_kda_prefill(gpu, t, &c, &s0)?;
        rep.exact_f32("determinism kda_prefill chunk", &format!("{case}, two runs"), &[go2, gs2, gr2].concat(), &[go, gs, gr].concat());
    }

    // Ragged prefill (a batch of prompts, one launch per phase): chunked
    // prompts (64, 65 and 1000 tokens), recurrent ones (1 and 20 tokens) and
    // an empty one mixed, with records. Each prompt equals its own
    // kda_prefill on the device bit for bit, rows in no prompt keep what
    // they held, and the empty prompt's state is left as it was.
    {
        let (h, dk, dv) = (3usize, 128usize, 128usize);
        let seqs = [0..1, 1..65, 65..65, 66..131, 131..151, 151..1151];
        let rows = 1153;
        let c = KdaHost::new(&mut r, rows, h, dk, dv);
        let (per, w) = (h * dk * dv, replay_record_width(dk, dv));
        let s0 = uni(&mut r, seqs.len() * per, -0.5, 0.5);
        let d = KdaDev::new(gpu, &c)?;
        let mut states = gpu.upload(&s0)?;
        let mut out = gpu.upload(&vec![7.0; rows * h * dv])?;
        let mut rec = gpu.upload(&vec![-3.0; rows * h * w])?;
        let shape = KdaRaggedShape { rows, heads: h, dk, dv };
        gpu.kda_prefill_ragged(shape, &seqs, &mut states, d.inputs(), d.params(), &mut out, Some(&mut rec))?;
        let (mut want_o, mut want_r, mut want_s) = (vec![7.0; rows * h * dv], vec![-3.0; rows * h * w], s0.clone());
        for (i, q) in seqs.iter().enumerate().filter(|(_, q)| !q.is_empty()) {
            let (go, gs, gr) = run_kda_prefill(gpu, q.len(), &c.rows(q.start, q.end), &s0[i * per..(i + 1) * per])?;
            want_o[q.start * h * dv..q.end * h * dv].copy_from_slice(&go);
            want_r[q.start * h * w..q.end * h * w].copy_from_slice(&gr);
            want_s[i * per..(i + 1) * per].copy_from_slice(&gs);
        }
        let case = "6 prompts of 1 / 64 / 0 / 65 / 20 / 1000 tokens, H=3 128x128";
        rep.exact_f32("kda_prefill_ragged = each prompt alone", &format!("{case}: out"), &gpu.download(&out)?, &want_o);
        rep.exact_f32("kda_prefill_ragged = each prompt alone", &format!("{case}: record"), &gpu.download(&rec)?, &want_r);
        rep.exact_f32("kda_prefill_ragged = each prompt alone", &format!("{case}: states"), &gpu.download(&states)?, &want_s);
    }

    // ReplaySSM: records from real steps, two appends of 3 tokens, commit.
    {
        let (b, h, dk, dv, cap, tokens) = (3usize, 2usize, 32usize, 48usize, 8usize, 3usize);
        let shape = ReplayShape { batch: b, heads: h, dk, dv, capacity: cap };
        let w = replay_record_width(dk, dv);
        let mut recs = [Vec::new(), Vec::new()];
        for rr in recs.iter_mut() {
            // [B, tokens, H, w]: plausible records (k^ unit-ish, g negative).
            let mut v = Vec::with_capacity(b * tokens * h * w);
            for _ in 0..b * tokens * h {
                v.extend(uni(&mut r, dk, -0.3, 0.3));
                v.extend(uni(&mut r, dv, -1.0, 1.0));
                v.extend(uni(&mut r, dk, -0.5, -0.01));
            }
            *rr = v;
        }
        let cursor0 = vec![0, 1, 2];
        let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let g = run_replay(gpu, shape, tokens, &recs, &cursor0, &s0)?;
        let c = run_replay(&cpu, shape, tokens, &recs, &cursor0, &s0)?;
        let case = format!("B={b} H={h} dk={dk} dv={dv} cap={cap}, 2 x {tokens} tokens");
        rep.exact_f32("replay_append ring", &case, &g.0, &c.0);
        rep.exact_i32("replay_append cursor", &case, &g.1, &c.1);
        rep.close("replay_commit state", &case, &g.2, &c.2, 1e-5);
        rep.exact_i32("replay_commit cursor", &case, &g.3, &c.3);
        // A third append overflows slot 2 (2 + 6 + 3 > 8): both refuse the same way.
        let full = |be: &dyn Fn() -> R<()>| be();
        let ge = full(&|| {
            let mut ring = gpu.alloc(b * cap * h * w)?;
            let mut cur = gpu.upload_i32(&[0, 1, 6])?;
            let rb = gpu.upload(&recs[0])?;
            gpu.replay_append(shape, tokens, &mut ring, &mut cur, &rb)
        });
        let ce = full(&|| {
            let mut ring = cpu.alloc(b * cap * h * w)?;
            let mut cur = cpu.upload_i32(&[0, 1, 6])?;
            let rb = cpu.upload(&recs[0])?;
            cpu.replay_append(shape, tokens, &mut ring, &mut cur, &rb)
        });
        rep.flag("replay_append refuses full", "cursor 6 + 3 > 8", ge.is_err() && ge == ce, "same error");
    }

    // Short conv.
    for &(t, ch, width) in &[(1usize, 96usize, 4usize), (2, 96, 4), (37, 200, 4), (5, 33, 1)] {
        let shape = ConvShape { channels: ch, width };
        let x = uni(&mut r, t * ch, -2.0, 2.0);
        let w = uni(&mut r, ch * width, -1.0, 1.0);
        let st = uni(&mut r, (width - 1) * ch, -2.0, 2.0);
        let g = run_conv_prefill(gpu, shape, t, &x, &w, &st)?;
        let c = run_conv_prefill(&cpu, shape, t, &x, &w, &st)?;
        let case = format!("T={t} C={ch} W={width}");
        rep.close("conv_prefill out", &case, &g.0, &c.0, 1e-5);
        rep.exact_f32("conv_prefill state", &case, &g.1, &c.1);
    }
    for &(b, ch, width) in &[(5usize, 96usize, 4usize), (88, 64, 4), (3, 10, 1)] {
        let shape = ConvShape { channels: ch, width };
        let x = uni(&mut r, b * ch, -2.0, 2.0);
        let w = uni(&mut r, ch * width, -1.0, 1.0);
        let st = uni(&mut r, b * (width - 1) * ch, -2.0, 2.0);
        let g = run_conv_step(gpu, shape, b, &x, &w, &st)?;
        let c = run_conv_step(&cpu, shape, b, &x, &w, &st)?;
        let case = format!("B={b} C={ch} W={width}");
        rep.close("conv_step out", &case, &g.0, &c.0, 1e-5);
        rep.exact_f32("conv_step state", &case, &g.1, &c.1);
    }

    // Norms.
    for &(rows, dim) in &[(7usize, 33usize), (88, 7168), (3, 1)] {
        let shape = NormShape { rows, dim, eps: 1e-5 };
        let x = uni(&mut r, rows * dim, -3.0, 3.0);
        let gt = uni(&mut r, rows * dim, -3.0, 3.0);
        let w = uni(&mut r, dim, 0.5, 1.5);
        let g = run_norms(gpu, shape, &x, &gt, &w)?;
        let c = run_norms(&cpu, shape, &x, &gt, &w)?;
        let case = format!("rows={rows} dim={dim}");
        rep.close("rms_norm", &case, &g.0, &c.0, 1e-5);
        rep.close("gated_rms_norm", &case, &g.1, &c.1, 1e-5);
    }

    // MLA prefill (with a cached prefix) and decode; f64 partials.
    let small = MlaShape { heads: 4, kv_lora_rank: 32, rope_dim: 8, scale: 1.0 / 24f32.sqrt() };
    let k3 = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 1.0 / 192f32.sqrt() };
    for &(shape, t, n) in &[(small, 12usize, 40usize), (small, 1, 1), (k3, 100, 300)] {
        let wd = shape.row_width();
        let q = uni(&mut r, t * shape.heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, (n + 3) * wd, -1.0, 1.0); // 3 rows past N: must be ignored
        let g = run_mla_prefill(gpu, shape, t, &q, &rows, n)?;
        let c = run_mla_prefill(&cpu, shape, t, &q, &rows, n)?;
        let case = format!("H={} L={} R={} T={t} N={n}", shape.heads, shape.kv_lora_rank, shape.rope_dim);
        rep.close("mla_prefill out", &case, &g.0, &c.0, 1e-5);
        rep.close("mla_prefill lse", &case, &g.1, &c.1, 1e-5);
    }
    for &(shape, n) in &[(small, 0usize), (small, 1), (small, 77), (k3, 777), (k3, 4096)] {
        let wd = shape.row_width();
        let q = uni(&mut r, shape.heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, (n + 2) * wd, -1.0, 1.0);
        let g = run_mla_decode(gpu, shape, &q, &rows, n)?;
        let c = run_mla_decode(&cpu, shape, &q, &rows, n)?;
        let case = format!("H={} L={} N={n}", shape.heads, shape.kv_lora_rank);
        rep.close("mla_decode out", &case, &g.0, &c.0, 1e-5);
        rep.close("mla_decode lse", &case, &g.1, &c.1, 1e-5);
        rep.close64("mla_decode_partial (f64)", &case, &g.2, &c.2, 1e-12);
    }

    // Ragged partials: against the CPU, against each request alone (batch
    // invariance), and twice (determinism).
    // K3's rows run the tensor-core kernel (chunks of 256 rows by default,
    // tiles of 16, heads in groups of 8): counts across chunk and tile edges,
    // 16 heads.
    let k3h16 = MlaShape { heads: 16, ..k3 };
    for &(shape, ref counts) in &[
        (small, vec![3usize, 0, 17, 1]),
        (k3, vec![0usize, 5, 300, 1, 1024, 64]),
        (k3, vec![2049usize, 17, 255, 256, 511, 0, 16]),
        (k3h16, vec![257usize, 0, 15, 600]),
    ] {
        let wd = shape.row_width();
        let b = counts.len();
        let total: usize = counts.iter().sum();
        let q = uni(&mut r, b * shape.heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, total * wd, -1.0, 1.0);
        let g = run_ragged(gpu, shape, &q, &rows, counts)?;
        let c = run_ragged(&cpu, shape, &q, &rows, counts)?;
        let case = format!("H={} L={} counts={counts:?}", shape.heads, shape.kv_lora_rank);
        rep.close64("mla_partial_ragged (f64)", &case, &g, &c, 1e-12);
        let mut alone = Vec::new();
        let mut r0 = 0;
        let per_q = shape.heads * wd;
        for (i, &n) in counts.iter().enumerate() {
            alone.extend(run_ragged(gpu, shape, &q[i * per_q..(i + 1) * per_q], &rows[r0 * wd..(r0 + n) * wd], &[n])?);
            r0 += n;
        }
        rep.exact_f64("batch-invariance ragged MLA", &format!("{case}: batch vs each alone"), &g, &alone);
        let again = run_ragged(gpu, shape, &q, &rows, counts)?;
        rep.exact_f64("determinism ragged MLA", &case, &again, &g);
    }

    // DCP merges (a head with all shards empty).
    {
        let shape = MergeShape { shards: 4, heads: 8, width: 512 };
        let o = uni(&mut r, 4 * 8 * 512, -1.0, 1.0);
        let mut lse = uni(&mut r, 4 * 8, -5.0, 5.0);
        for s in 0..4 {
            lse[s * 8 + 3] = f32::NEG_INFINITY;
        }
        lse[8 + 5] = f32::NEG_INFINITY;
        let g = run_dcp_merge(gpu, shape, &o, &lse)?;
        let c = run_dcp_merge(&cpu, shape, &o, &lse)?;
        rep.close("dcp_merge out", "S=4 H=8 W=512, one head empty", &g.0, &c.0, 1e-5);
        rep.close("dcp_merge lse", "S=4 H=8 W=512, one head empty", &g.1, &c.1, 1e-5);
    }
    {
        let (s, h, l) = (3usize, 8usize, 512usize);
        let shape = MergeShape { shards: s, heads: h, width: l };
        let pw = mla_partial_width(l);
        let mut p = Vec::with_capacity(s * h * pw);
        for sh in 0..s {
            for hd in 0..h {
                if hd == 2 || (sh == 1 && hd == 6) {
                    p.push(f64::NEG_INFINITY);
                    p.push(0.0);
                    p.extend(std::iter::repeat_n(0.0, l));
                } else {
                    p.push(r.next_f64() * 10.0 - 5.0);
                    p.push(r.next_f64() * 100.0 + 1.0);
                    p.extend((0..l).map(|_| r.next_f64() * 50.0 - 25.0));
                }
            }
        }
        let g = run_merge_partials(gpu, shape, &p)?;
        let c = run_merge_partials(&cpu, shape, &p)?;
        rep.close("dcp_merge_partials out", "S=3 H=8 L=512, empty shards", &g.0, &c.0, 1e-6);
        rep.close("dcp_merge_partials lse", "S=3 H=8 L=512, empty shards", &g.1, &c.1, 1e-6);
    }

    // Dense.
    for &(rows, inner, cols) in &[(1usize, 1000usize, 777usize), (130, 333, 65), (88, 512, 1024), (3, 7, 5), (64, 0, 8)] {
        let shape = MatmulShape { rows, inner, cols };
        let x = uni(&mut r, rows * inner, -1.0, 1.0);
        let w = uni(&mut r, inner * cols, -1.0, 1.0);
        let g = run_matmul(gpu, shape, &x, &w)?;
        let c = run_matmul(&cpu, shape, &x, &w)?;
        rep.close("matmul", &format!("{rows}x{inner} . {inner}x{cols}"), &g, &c, 3e-5);
    }
    {
        let shape = MlpShape { tokens: 5, hidden: 64, intermediate: 136 };
        let x = uni(&mut r, 5 * 64, -1.0, 1.0);
        let gw = uni(&mut r, 64 * 136, -0.3, 0.3);
        let uw = uni(&mut r, 64 * 136, -0.3, 0.3);
        let dw = uni(&mut r, 136 * 64, -0.3, 0.3);
        let g = run_swiglu(gpu, shape, &x, &gw, &uw, &dw)?;
        let c = run_swiglu(&cpu, shape, &x, &gw, &uw, &dw)?;
        rep.close("swiglu", "T=5 hidden=64 inter=136", &g, &c, 3e-5);
    }
    {
        let a = uni(&mut r, 100_003, -8.0, 8.0);
        let b = uni(&mut r, 100_003, -2.0, 2.0);
        let g = run_elementwise(gpu, &a, &b)?;
        let c = run_elementwise(&cpu, &a, &b)?;
        rep.close("silu_mul", "n=100003", &g.0, &c.0, 1e-5);
        rep.exact_f32("add_inplace", "n=100003", &g.1, &c.1);
    }
    {
        let shape = EmbeddingShape { tokens: 9, vocab: 1000, dim: 65 };
        let table = uni(&mut r, 1000 * 65, -1.0, 1.0);
        let ids = [0, 999, 5, 5, 17, 500, 1, 998, 42];
        let g = run_embedding(gpu, shape, &table, &ids)?;
        let c = run_embedding(&cpu, shape, &table, &ids)?;
        rep.exact_f32("embedding", "9 ids of vocab 1000, dim 65", &g, &c);
        let bad = [0, 1000, 2, 3, 4, 5, 6, 7, 8];
        let ge = run_embedding(gpu, shape, &table, &bad).err();
        let ce = run_embedding(&cpu, shape, &table, &bad).err();
        rep.flag("embedding refuses bad id", "id 1000 of vocab 1000", ge.is_some() && ge == ce, "same error");
    }
    {
        let (rows, cols) = (6usize, 5000usize);
        let mut l = uni(&mut r, rows * cols, -10.0, 10.0);
        l[cols + 100] = 50.0; // row 1: a tie, lowest index wins
        l[cols + 4000] = 50.0;
        for v in &mut l[2 * cols..3 * cols] {
            *v = f32::NAN; // row 2: all NaN -> 0
        }
        for (i, v) in l[3 * cols..4 * cols].iter_mut().enumerate() {
            *v = if i % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY }; // row 3: NaNs and -inf -> 1
        }
        l[4 * cols + 4999] = 11.0; // row 4: max at the end, NaN before it
        l[4 * cols + 4998] = f32::NAN;
        l[5 * cols] = f32::INFINITY; // row 5: +inf first
        let g = run_argmax(gpu, rows, cols, &l)?;
        let c = run_argmax(&cpu, rows, cols, &l)?;
        rep.exact_i32("argmax", "ties, NaNs, all-NaN row, -inf, +inf", &g, &c);
        let (rows, cols) = (88usize, 163_840usize);
        let l = uni(&mut r, rows * cols, -10.0, 10.0);
        rep.exact_i32("argmax", "88 rows x vocab 163840", &run_argmax(gpu, rows, cols, &l)?, &run_argmax(&cpu, rows, cols, &l)?);
    }

    // Batch invariance and determinism on the GPU.
    {
        let (rows, inner, cols) = (88usize, 1024usize, 520usize);
        let shape = MatmulShape { rows, inner, cols };
        let x = uni(&mut r, rows * inner, -1.0, 1.0);
        let w = uni(&mut r, inner * cols, -1.0, 1.0);
        let all = run_matmul(gpu, shape, &x, &w)?;
        let mut alone = Vec::new();
        for i in 0..rows {
            alone.extend(run_matmul(gpu, MatmulShape { rows: 1, inner, cols }, &x[i * inner..(i + 1) * inner], &w)?);
        }
        rep.exact_f32("batch-invariance matmul", "88 rows vs each row alone (1024x520)", &all, &alone);
        let some = run_matmul(gpu, MatmulShape { rows: 7, inner, cols }, &x[40 * inner..47 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 40..47 as a batch of 7", &some, &all[40 * cols..47 * cols]);
        rep.exact_f32("determinism matmul", "88x1024 . 1024x520, two runs", &run_matmul(gpu, shape, &x, &w)?, &all);
    }
    {
        // Across the kernels: a product of enough 64 x 128 tiles runs tiled
        // (matmul_wg on Hopper, else matmul_tcb: all of k in a block): 2100 x
        // 1000 columns (33 x 8 tiles); 7 and 1 rows of it take matmul_tc16 and
        // the chunk sums, 300 (5 x 8 tiles) either, and forced split matmul_tc32. Inner 1000 ends mid-chunk and mid-stage, 1000 columns
        // mid-tile. Every row has the same bits whichever kernel ran it.
        let (rows, inner, cols) = (2100usize, 1000usize, 1000usize);
        let x = uni(&mut r, rows * inner, -1.0, 1.0);
        let w = uni(&mut r, inner * cols, -1.0, 1.0);
        let all = run_matmul(gpu, MatmulShape { rows, inner, cols }, &x, &w)?;
        // The tiled kernel on Hopper (matmul_wg, wgmma) and elsewhere
        // (matmul_tcb, mma.sync): the same bits, edges of rows, k and columns.
        let mut plain = gpu.clone();
        plain.set_matmul_wg(false);
        let tcb_all = run_matmul(&plain, MatmulShape { rows, inner, cols }, &x, &w)?;
        rep.exact_f32("matmul_wg vs matmul_tcb", &format!("2100 x 1000 . 1000 x 1000 (matmul_wg in this build: {})", gpu.matmul_wg()), &all, &tcb_all);
        let mut alone = Vec::new();
        let picks = [0usize, 17, 1050, 2099];
        for &i in &picks {
            alone.extend(run_matmul(gpu, MatmulShape { rows: 1, inner, cols }, &x[i * inner..(i + 1) * inner], &w)?);
        }
        let picked: Vec<f32> = picks.iter().flat_map(|&i| all[i * cols..(i + 1) * cols].iter().copied()).collect();
        rep.exact_f32("batch-invariance matmul", "rows of a 2100-row call (tiled) vs each alone (matmul_tc16 + chunk sums)", &picked, &alone);
        let seven = run_matmul(gpu, MatmulShape { rows: 7, inner, cols }, &x[100 * inner..107 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 100..107 of 2100 as a batch of 7 (matmul_tc16)", &seven, &all[100 * cols..107 * cols]);
        let mid = run_matmul(gpu, MatmulShape { rows: 300, inner, cols }, &x[..300 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 0..300 of 2100 as a batch of 300 (40 tiles: tiled on Hopper)", &mid, &all[..300 * cols]);
        let mut split = gpu.clone();
        split.set_tcb_min_tiles(usize::MAX);
        let mid = run_matmul(&split, MatmulShape { rows: 300, inner, cols }, &x[..300 * inner], &w)?;
        rep.exact_f32("batch-invariance matmul", "rows 0..300 of 2100 as a batch of 300, split over k (matmul_tc32)", &mid, &all[..300 * cols]);
        let cpu_rows = run_matmul(&cpu, MatmulShape { rows: 64, inner, cols }, &x[2036 * inner..], &w)?;
        rep.close("matmul (tiled)", "rows 2036..2100 of 2100 x 1000 . 1000 x 1000", &all[2036 * cols..], &cpu_rows, 3e-5);
    }
    {
        let (b, h, dk, dv) = (16usize, 2usize, 128usize, 128usize);
        let step = KdaHost::new(&mut r, b, h, dk, dv);
        let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let (ao, as_, ar) = run_kda_steps(gpu, b, std::slice::from_ref(&step), &s0)?;
        let (mut lo, mut ls, mut lr) = (Vec::new(), Vec::new(), Vec::new());
        let per = h * dk * dv;
        for i in 0..b {
            let (o, s, rr) = run_kda_steps(gpu, 1, std::slice::from_ref(&step.rows(i, i + 1)), &s0[i * per..(i + 1) * per])?;
            lo.extend(o);
            ls.extend(s);
            lr.extend(rr);
        }
        let case = "B=16 H=2 128x128 vs each slot alone";
        rep.exact_f32("batch-invariance kda_step", &format!("{case}: out"), &ao, &lo);
        rep.exact_f32("batch-invariance kda_step", &format!("{case}: state"), &as_, &ls);
        rep.exact_f32("batch-invariance kda_step", &format!("{case}: record"), &ar, &lr);
        let (bo, bs, _) = run_kda_steps(gpu, b, std::slice::from_ref(&step), &s0)?;
        rep.exact_f32("determinism kda_step", "B=16 H=2 128x128, two runs", &[bo, bs].concat(), &[ao.clone(), as_.clone()].concat());
    }
    Ok(())
}
