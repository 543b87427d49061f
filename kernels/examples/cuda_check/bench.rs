//! Timings (`--bench`, `--bench-mla`, `--bench-matmul`).

use super::*;

// ------------------------------------------------------------------ bench

/// MLA DCP decode partial on K3's rows (f32 here, 576 wide), 8 heads per rank:
/// rows read per second against the read half of the device copy. The rows
/// are random (one request's block uploaded, copied to every request). The
/// kernel is the backend's (`--mla`, printed).
pub(crate) fn bench_mla(gpu: &CudaBackend, bw: f64, r: &mut SplitMix64, kernel: &str) -> R<()> {
    let shape = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 1.0 / 192f32.sqrt() };
    for &(b, n) in &[(88usize, 8192usize), (88, 32768), (8, 8192), (1, 32768), (88, 131072)] {
        let wd = shape.row_width();
        let q = gpu.upload(&uni(r, b * shape.heads * wd, -1.0, 1.0))?;
        let one = gpu.upload(&uni(r, n * wd, -1.0, 1.0))?;
        let mut rows = gpu.alloc(b * n * wd)?;
        for i in 0..b {
            gpu.copy(&one, 0, &mut rows, i * n * wd, n * wd)?;
        }
        #[allow(clippy::drop_non_drop)] // a device buffer in the cuda build
        drop(one);
        let mut p = gpu.alloc_f64(b * shape.heads * mla_partial_width(512))?;
        let counts = vec![n; b];
        gpu.mla_decode_partial_ragged(shape, &q, &rows, &counts, &mut p)?;
        let reps = if b * n >= 88 * 32768 { 3 } else { 10 };
        let us = gpu.time_us(reps, || gpu.mla_decode_partial_ragged(shape, &q, &rows, &counts, &mut p))?;
        let bytes = (b * n * wd * 4) as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        println!(
            "| mla_decode_partial_ragged f64 [{kernel}] | B={b} x {n} rows x 576 f32, H=8 | {us:.0} | {gbs:.0} (rows read) | {:.2} (vs copy/2) |",
            gbs / (bw / 2.0)
        );
    }
    Ok(())
}

/// KDA prefill, chunked (kda_chunk.hip; the workspace allocation included),
/// 12 heads of 128 x 128 at T = 8K and 32K, FLA `chunk_kda`'s bench shapes.
pub(crate) fn bench_kda_chunked(gpu: &CudaBackend, r: &mut SplitMix64) -> R<()> {
    for &t in &[8192usize, 32768] {
        let (h, dk, dv) = (12usize, 128usize, 128usize);
        let host = KdaHost::new(r, t, h, dk, dv);
        let d = KdaDev::new(gpu, &host)?;
        let mut state = gpu.alloc(h * dk * dv)?;
        let mut out = gpu.alloc(t * h * dv)?;
        let shape = KdaPrefillShape { tokens: t, heads: h, dk, dv };
        gpu.kda_prefill(shape, &mut state, d.inputs(), d.params(), &mut out, None)?;
        let us = gpu.time_us(3, || gpu.kda_prefill(shape, &mut state, d.inputs(), d.params(), &mut out, None))?;
        println!("| kda_prefill (chunked) | T={t} H={h} 128x128 | {us:.0} per call | {:.2} M tok/s | - |", t as f64 / us);
    }
    Ok(())
}

pub(crate) fn bench(gpu: &mut CudaBackend, seed: u64, mla_only: bool, matmul_only: bool, dense_only: bool, kda_only: bool, mla_kernel: &str) -> R<()> {
    if kda_only {
        println!("| kernel | shape | us | rate | - |");
        println!("|---|---|---|---|---|");
        return bench_kda_chunked(gpu, &mut SplitMix64::new(seed ^ 0x4da));
    }
    if dense_only {
        return bench_matmul_kernels(gpu, &mut SplitMix64::new(seed ^ 0xde5e));
    }
    println!();
    let copy_bytes = 1usize << 30;
    let bw = gpu.copy_bandwidth_gbs(copy_bytes, 20)?;
    println!("device copy (memcpy_dtod of 1 GiB, read + write counted): {bw:.0} GB/s");
    if matmul_only {
        let mut r = SplitMix64::new(seed ^ 0xbe7c);
        return bench_step_matmul(gpu, &mut r);
    }
    if mla_only {
        let mut r = SplitMix64::new(seed ^ 0x3a1a);
        println!();
        println!("| kernel | shape | us/call | GB/s | of copy bw |");
        println!("|---|---|---|---|---|");
        return bench_mla(gpu, bw, &mut r, mla_kernel);
    }
    println!();
    println!("| kernel | shape | us/step | state GB/s | of copy bw |");
    println!("|---|---|---|---|---|");
    let mut r = SplitMix64::new(seed ^ 0xbe7c);
    for &(b, h) in &[(88usize, 12usize), (32, 96), (88, 96)] {
        let (dk, dv) = (128usize, 128usize);
        let host = KdaHost::new(&mut r, b, h, dk, dv);
        let d = KdaDev::new(&*gpu, &host)?;
        let mut state = gpu.upload(&uni(&mut r, b * h * dk * dv, -0.5, 0.5))?;
        let mut out = gpu.alloc(b * h * dv)?;
        let mut rec = gpu.alloc(b * h * replay_record_width(dk, dv))?;
        let shape = KdaStepShape { batch: b, heads: h, dk, dv };
        let bytes = 2.0 * (b * h * dk * dv * 4) as f64;
        let default = gpu.kda_kernel();
        for k in KdaKernel::ALL {
            gpu.set_kda_kernel(k);
            for with_rec in [false, true] {
                // Warm-up, then the steps back to back between two events.
                for _ in 0..3 {
                    gpu.kda_step(shape, &mut state, d.inputs(), d.params(), &mut out, with_rec.then_some(&mut rec))?;
                }
                let reps = if b * h > 2000 { 30 } else { 100 };
                let g = &*gpu;
                let us = g.time_us(reps, || g.kda_step(shape, &mut state, d.inputs(), d.params(), &mut out, with_rec.then_some(&mut rec)))?;
                let gbs = bytes / (us * 1e-6) / 1e9;
                println!(
                    "| kda_step {k:?}{}{} | B={b} H={h} 128x128 f32 | {us:.1} | {gbs:.0} | {:.2} |",
                    if k == default { " (default)" } else { "" },
                    if with_rec { " +record" } else { "" },
                    gbs / bw
                );
            }
        }
        gpu.set_kda_kernel(default);
    }

    // KDA prefill, 8K tokens x 12 heads: the recurrent kernel, for
    // comparison. A 128x128 prefill of 64 tokens or more now runs chunked, so
    // the recurrent figure is taken from calls of 63 tokens each (inputs
    // uploaded per piece beforehand; one launch per 63 tokens, whose launch
    // cost is small against the 63 dependent steps it runs).
    {
        let (t, h, dk, dv) = (8192usize, 12usize, 128usize, 128usize);
        let piece = handoff_kernels::KDA_CHUNK - 1;
        let host = KdaHost::new(&mut r, t, h, dk, dv);
        type Buf = <CudaBackend as Backend>::Buf;
        let mut pieces: Vec<(usize, KdaDev<CudaBackend>, Buf)> = (0..t)
            .step_by(piece)
            .map(|a| {
                let b = (a + piece).min(t);
                Ok((b - a, KdaDev::new(&*gpu, &host.rows(a, b))?, gpu.alloc((b - a) * h * dv)?))
            })
            .collect::<R<_>>()?;
        let mut state = gpu.alloc(h * dk * dv)?;
        let g = &*gpu;
        let mut run = || -> R<()> {
            for (n, d, o) in pieces.iter_mut() {
                let shape = KdaPrefillShape { tokens: *n, heads: h, dk, dv };
                g.kda_prefill(shape, &mut state, d.inputs(), d.params(), o, None)?;
            }
            Ok(())
        };
        run()?;
        let us = g.time_us(3, &mut run)?;
        println!("| kda_prefill (recurrent, 63-token calls) | T={t} H={h} 128x128 | {us:.0} per call | {:.2} M tok/s | - |", t as f64 / us);
    }
    bench_kda_chunked(gpu, &mut r)?;

    bench_mla(gpu, bw, &mut r, mla_kernel)?;

    // Dense: decode-sized products, gpu.toml's prefill products (1,024 and
    // 2,560 rows, hidden 2,048) and a square one.
    for &(rows, inner, cols) in
        &[(1usize, 2048usize, 2048usize), (88, 2048, 2048), (1, 7168, 7168), (88, 7168, 7168), (1024, 2048, 2048), (2560, 2048, 8192), (4096, 4096, 4096)]
    {
        let x = gpu.upload(&uni(&mut r, rows * inner, -1.0, 1.0))?;
        let w = gpu.upload(&uni(&mut r, inner * cols, -1.0, 1.0))?;
        let mut o = gpu.alloc(rows * cols)?;
        let shape = MatmulShape { rows, inner, cols };
        gpu.matmul(shape, &x, &w, &mut o)?;
        let g = &*gpu;
        let reps = if rows > 1000 { 5 } else { 20 };
        let us = g.time_us(reps, || g.matmul(shape, &x, &w, &mut o))?;
        let tflops = 2.0 * (rows * inner * cols) as f64 / (us * 1e-6) / 1e12;
        let wgbs = (inner * cols * 4) as f64 / (us * 1e-6) / 1e9;
        println!("| matmul | {rows}x{inner} . {inner}x{cols} | {us:.0} | w read {wgbs:.0} | {tflops:.1} TFLOP/s |");
    }
    bench_matmul_kernels(gpu, &mut r)?;
    bench_step_matmul(gpu, &mut r)
}

/// The fused step's tensor-core product (hip/step.hip st_mm_few / st_mm):
/// bf16 x bf16 (1 term, torch.matmul's bf16 semantics), the model's bf16
/// weights (2 terms: f32 activations) and f32 weights (3 terms).
pub(crate) fn bench_step_matmul(gpu: &CudaBackend, r: &mut SplitMix64) -> R<()> {
    {
        use handoff_kernels::step::{StepMat, WeightDtype};
        for &(rows, inner, cols) in &[(1usize, 7168usize, 7168usize), (88, 7168, 7168), (4096, 4096, 4096), (1, 2048, 2048), (88, 2048, 2048)] {
            let x = uni(r, rows * inner, -1.0, 1.0);
            let mat = StepMat::plain(inner, cols, uni(r, inner * cols, -1.0, 1.0));
            for (dtype, terms) in [(WeightDtype::Bf16, 1u32), (WeightDtype::Bf16, 2), (WeightDtype::F32, 3)] {
                let reps = if rows > 1000 { 5 } else { 30 };
                let (_, us) = gpu.step_matmul(&x, rows, &mat, dtype, terms, reps)?;
                let tflops = 2.0 * (rows * inner * cols) as f64 / (us * 1e-6) / 1e12;
                let wgbs = (inner * cols * 2 * dtype.planes()) as f64 / (us * 1e-6) / 1e9;
                println!(
                    "| step_matmul {} weights, {terms} term{} | {rows}x{inner} . {inner}x{cols} ({} segments) | {us:.1} | w read {wgbs:.0} | {tflops:.1} TFLOP/s |",
                    dtype.name(),
                    if terms > 1 { "s" } else { "" },
                    mat.segments
                );
            }
        }
    }
    Ok(())
}

/// The generic matmul's kernels at prefill shapes (`--bench-dense`, and the
/// end of `--bench`).
pub(crate) fn bench_matmul_kernels(gpu: &mut CudaBackend, r: &mut SplitMix64) -> R<()> {
    // The generic matmul's kernels at prefill shapes (gpu.toml's products, a
    // serving batch of 128 to 2,560 rows): over all of k (matmul_wg on Hopper,
    // matmul_tcb) or split over k (matmul_tc + chunk sums), to place the
    // switch between them.
    for &rows in &[128usize, 256, 512, 800, 1024, 2560] {
        for &(inner, cols) in &[(2048usize, 2048usize), (2048, 576), (512, 4096), (2048, 8192)] {
            let x = gpu.upload(&uni(r, rows * inner, -1.0, 1.0))?;
            let w = gpu.upload(&uni(r, inner * cols, -1.0, 1.0))?;
            let mut o = gpu.alloc(rows * cols)?;
            let shape = MatmulShape { rows, inner, cols };
            // matmul_wg (Hopper), matmul_tcb, split over k.
            let mut us = [0.0f64; 3];
            let default = gpu.tcb_min_tiles();
            for (i, (tiles, wg)) in [(0usize, true), (0, false), (usize::MAX, false)].into_iter().enumerate() {
                gpu.set_tcb_min_tiles(tiles);
                gpu.set_matmul_wg(wg);
                gpu.matmul(shape, &x, &w, &mut o)?;
                let g = &*gpu;
                us[i] = g.time_us(10, || g.matmul(shape, &x, &w, &mut o))?;
            }
            gpu.set_tcb_min_tiles(default);
            gpu.set_matmul_wg(true);
            let tiles = rows.div_ceil(64) * cols.div_ceil(128);
            let tf = |u: f64| 2.0 * (rows * inner * cols) as f64 / (u * 1e-6) / 1e12;
            let wg = if gpu.matmul_wg() { format!("wg {:.1} us ({:.1} TFLOP/s)", us[0], tf(us[0])) } else { "wg absent".to_string() };
            println!(
                "| matmul kernels | {rows}x{inner} . {inner}x{cols} ({tiles} tiles) | {wg} | tcb {:.1} us ({:.1} TFLOP/s) | split-k {:.1} us ({:.1} TFLOP/s) |",
                us[1],
                tf(us[1]),
                us[2],
                tf(us[2]),
            );
        }
    }
    Ok(())
}
