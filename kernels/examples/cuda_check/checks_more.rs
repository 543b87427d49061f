//! The launch-saving paths, KDA kernel variants, region ops and the fused step's products.

use super::*;

/// The launch-saving paths (`CudaBackend::set_fused`, on by default) against
/// the paths they replace, bit for bit.
pub(crate) fn check_fused(gpu: &mut CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let cpu = CpuBackend::new();
    let mut r = SplitMix64::new(seed ^ 0x0F05_ED00);
    let fused_default = true;
    {
        // Several products in one call (matmul_units): every product's bits are
        // those of matmul on its block alone (the one-by-one default); heads side
        // by side and stacked, unequal widths ending mid-chunk, 40 products (two
        // launches), 1, 88, 200 and 600 rows (600: the first launch's 32
        // products tiled (matmul_wg or matmul_tcb), 10 x 32 tiles; the rest
        // split over k).
        for stacked in [false, true] {
            for &rows in &[1usize, 88, 200, 600] {
                let n = 40;
                let dims: Vec<(usize, usize)> = (0..n).map(|i| (120 + 5 * (i % 3), if stacked { 96 } else { 64 + i % 2 })).collect();
                let x_width: usize = dims.iter().map(|d| d.0).sum::<usize>() + 3;
                let width: usize = dims.iter().map(|d| d.1).sum::<usize>() + 5;
                let out = if stacked { UnitsOut::Stacked } else { UnitsOut::Columns { width } };
                let shape = UnitsShape { rows, x_width, out };
                let x = uni(&mut r, rows * x_width, -1.0, 1.0);
                let ws: Vec<Vec<f32>> = dims.iter().map(|&(k, c)| uni(&mut r, k * c, -1.0, 1.0)).collect();
                gpu.set_fused(true);
                let fused = run_units(gpu, shape, &x, &dims, &ws, false)?;
                gpu.set_fused(false);
                let unfused = run_units(gpu, shape, &x, &dims, &ws, false)?;
                let each = run_units(gpu, shape, &x, &dims, &ws, true)?;
                let case = format!("{n} products of {rows} rows, {}", if stacked { "stacked" } else { "side by side" });
                rep.exact_f32("matmul_units fused vs each", &case, &fused, &each);
                rep.exact_f32("matmul_units unfused vs each", &case, &unfused, &each);
                rep.close("matmul_units", &case, &fused, &run_units(&cpu, shape, &x, &dims, &ws, true)?, 3e-5);
            }
        }
        // The all-reduce's sum of stacked partials: the bits of add_inplace in order.
        let (n, units) = (5000usize, 9usize);
        let stacked = uni(&mut r, n * units, -1.0, 1.0);
        let acc0 = uni(&mut r, n, -1.0, 1.0);
        let mut want = gpu.upload(&acc0)?;
        for u in 2..units {
            gpu.add_inplace(&mut want, &gpu.upload(&stacked[u * n..(u + 1) * n])?)?;
        }
        let want = gpu.download(&want)?;
        for fused in [true, false] {
            gpu.set_fused(fused);
            let mut acc = gpu.upload(&acc0)?;
            gpu.add_units(&mut acc, &gpu.upload(&stacked)?, 2..units)?;
            let case = format!("units 2..9 of 5000 values, fused {fused}");
            rep.exact_f32("add_units vs add_inplace", &case, &gpu.download(&acc)?, &want);
        }
        // i32 downloads answered from what the host knows: after an upload, after
        // replay ops set the cursors, and after argmax (which the host does not know).
        gpu.set_fused(true);
        let ids = gpu.upload_i32(&[3, 1, 4])?;
        rep.exact_i32("download_i32 known", "after upload", &gpu.download_i32(&ids)?, &[3, 1, 4]);
        let logits = uni(&mut r, 3 * 50, -1.0, 1.0);
        let mut picks = gpu.upload_i32(&[0, 0, 0])?;
        gpu.argmax(3, 50, &gpu.upload(&logits)?, &mut picks)?;
        let want_picks = run_argmax(&cpu, 3, 50, &logits)?;
        rep.exact_i32("download_i32 known", "after argmax (device values)", &gpu.download_i32(&picks)?, &want_picks);
        let (b, h, dk, dv, cap) = (3usize, 2usize, 16usize, 16usize, 4usize);
        let cursor0 = [0i32, 2, 3];
        let state = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
        let recs = uni(&mut r, b * h * replay_record_width(dk, dv), -0.5, 0.5);
        let mut got = Vec::new();
        for fused in [true, false] {
            gpu.set_fused(fused);
            let shape = ReplayShape { batch: b, heads: h, dk, dv, capacity: cap };
            let mut ring = gpu.alloc(b * cap * h * replay_record_width(dk, dv))?;
            let mut cur = gpu.upload_i32(&cursor0)?;
            gpu.replay_append(shape, 1, &mut ring, &mut cur, &gpu.upload(&recs)?)?;
            let after_append = gpu.download_i32(&cur)?;
            let mut st = gpu.upload(&state)?;
            gpu.replay_commit(shape, &mut st, &ring, &mut cur)?;
            got.push((after_append, gpu.download_i32(&cur)?, gpu.download(&st)?));
        }
        rep.exact_i32("download_i32 known", "cursors after replay_append", &got[0].0, &got[1].0);
        rep.exact_i32("download_i32 known", "cursors after replay_commit", &got[0].1, &got[1].1);
        rep.exact_f32("download_i32 known", "state after replay_commit", &got[0].2, &got[1].2);
        gpu.set_fused(fused_default);
    }
    Ok(())
}

/// Every KDA step kernel variant (tile width, blocks per multiprocessor)
/// gives the same bits; the prefill kernel does not depend on the choice.
pub(crate) fn check_kda_variants(gpu: &mut CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let mut r = SplitMix64::new(seed ^ 0x5eed);
    let (b, h, dk, dv) = (8usize, 3usize, 128usize, 200usize);
    let steps: Vec<KdaHost> = (0..2).map(|_| KdaHost::new(&mut r, b, h, dk, dv)).collect();
    let s0 = uni(&mut r, b * h * dk * dv, -0.5, 0.5);
    let pre = KdaHost::new(&mut r, 40, h, dk, dv);
    let p0 = uni(&mut r, h * dk * dv, -0.5, 0.5);
    let default = gpu.kda_kernel();
    let flat = |x: (Vec<f32>, Vec<f32>, Vec<f32>)| [x.0, x.1, x.2].concat();
    let want_step = flat(run_kda_steps(gpu, b, &steps, &s0)?);
    let want_pre = flat(run_kda_prefill(gpu, 40, &pre, &p0)?);
    for k in KdaKernel::ALL {
        gpu.set_kda_kernel(k);
        let got = flat(run_kda_steps(gpu, b, &steps, &s0)?);
        rep.exact_f32(&format!("kda {k:?} = {default:?} kernel"), "step B=8 H=3 128x200, 2 steps", &got, &want_step);
        let got = flat(run_kda_prefill(gpu, 40, &pre, &p0)?);
        rep.exact_f32(&format!("kda {k:?} = {default:?} kernel"), "prefill T=40 H=3 128x200", &got, &want_pre);
    }
    gpu.set_kda_kernel(default);
    Ok(())
}

/// Device regions: the backend's region ops against the host's byte encoding
/// (exact), and the device memory's 2D copies against a host loop (exact).
pub(crate) fn check_regions(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let mut r = SplitMix64::new(seed ^ 0x4e61);
    let mem = gpu.device_memory()?;
    let len = 8u64 << 20;
    let addr = mem.alloc(len)?;
    let region = DeviceRegion { addr, len };
    let mut zero = vec![1u8; len as usize];
    unsafe { mem.read(addr, &mut zero)? };
    rep.flag("region alloc", "8 MiB, zeroed", zero.iter().all(|&b| b == 0), "all 0");
    // Items at scattered, aligned offsets, each dtype: scatter then gather.
    for (dt, vb) in [(StorageDtype::F32, 4u64), (StorageDtype::Bf16, 2), (StorageDtype::F16, 2)] {
        let values = 576usize;
        let offsets: Vec<u64> = (0..37u64).map(|i| (i * 7919 * vb * 3) % (len - values as u64 * vb) / vb * vb).collect();
        // Distinct items (no overlap): keep the first of overlapping ones.
        let mut items: Vec<u64> = Vec::new();
        for o in offsets {
            if items.iter().all(|&p| o + values as u64 * vb <= p || p + values as u64 * vb <= o) {
                items.push(o);
            }
        }
        let xs = uni(&mut r, items.len() * values, -3.0, 3.0);
        let it = RegionItems { offsets: &items, values, dtype: dt };
        gpu.region_scatter(&gpu.upload(&xs)?, region, it)?;
        let mut host = vec![0u8; len as usize];
        unsafe { mem.read(addr, &mut host)? };
        let mut want_bytes = Vec::new();
        let mut got_bytes = Vec::new();
        let mut want_vals = Vec::new();
        for (i, &o) in items.iter().enumerate() {
            for j in 0..values {
                let x = xs[i * values + j];
                let at = (o + j as u64 * vb) as usize;
                got_bytes.extend_from_slice(&host[at..at + vb as usize]);
                match dt {
                    StorageDtype::F32 => {
                        want_bytes.extend_from_slice(&x.to_le_bytes());
                        want_vals.push(x);
                    }
                    StorageDtype::Bf16 => {
                        want_bytes.extend_from_slice(&f32_to_bf16(x).to_le_bytes());
                        want_vals.push(bf16_to_f32(f32_to_bf16(x)));
                    }
                    StorageDtype::F16 => {
                        want_bytes.extend_from_slice(&f32_to_f16(x).to_le_bytes());
                        want_vals.push(f16_to_f32(f32_to_f16(x)));
                    }
                }
            }
        }
        rep.flag("region_scatter", &format!("{} items x {values} {dt:?}: bytes = host encoding", items.len()), got_bytes == want_bytes, "bytes");
        let back = gpu.download(&gpu.region_gather(region, it)?)?;
        rep.exact_f32("region_gather", &format!("{} items x {values} {dt:?}", items.len()), &back, &want_vals);
    }
    let offs = [8u64, 4000, 123_456 * 4];
    gpu.region_scatter_i32(&gpu.upload_i32(&[7, -3, 1 << 30])?, region, &offs)?;
    let got = gpu.download_i32(&gpu.region_gather_i32(region, &offs)?)?;
    rep.exact_i32("region_gather_i32", "3 cursors", &got, &[7, -3, 1 << 30]);
    let past = gpu.region_gather(region, RegionItems { offsets: &[len - 8], values: 4, dtype: StorageDtype::F32 });
    rep.flag("region_gather", "an item past the region's end", past.is_err(), "refused");
    // 2D copies between two allocations, against the same copies on the host.
    let dst = mem.alloc(len)?;
    let mut src_host = vec![0u8; len as usize];
    for b in src_host.iter_mut() {
        *b = (r.next_u64() & 0xff) as u8;
    }
    unsafe { mem.write(addr, &src_host)? };
    let mut copies = vec![
        Copy2d { src: addr + 64, src_pitch: 1152, dst: dst + 128, dst_pitch: 4608, width: 1152, height: 100 },
        Copy2d { src: addr + 300_000, src_pitch: 0, dst: dst + 700_000, dst_pitch: 0, width: 65_536, height: 1 },
        Copy2d { src: addr, src_pitch: 16, dst: dst + 128, dst_pitch: 16, width: 16, height: 1 },
        // Narrow rows on 4-byte and on byte alignment (the kernel's other
        // paths), two overlapping narrow copies (must stay in order), and wide
        // strided rows (the copy engines' 2D copy).
        Copy2d { src: addr + 4, src_pitch: 1004, dst: dst + 800_004, dst_pitch: 1008, width: 1000, height: 9 },
        Copy2d { src: addr + 3, src_pitch: 1001, dst: dst + 820_001, dst_pitch: 1003, width: 999, height: 7 },
        Copy2d { src: addr + 9_000, src_pitch: 64, dst: dst + 820_500, dst_pitch: 64, width: 48, height: 40 },
        Copy2d { src: addr + 100_000, src_pitch: 70_000, dst: dst + 850_000, dst_pitch: 66_000, width: 65_600, height: 2 },
        // A large contiguous copy (the table kernel: below the copy-engine
        // size), then a small copy over part of what it wrote (must come after it).
        Copy2d { src: addr + (2 << 20), src_pitch: 4 << 20, dst: dst + (2 << 20), dst_pitch: 4 << 20, width: 4 << 20, height: 1 },
        Copy2d { src: addr + 100, src_pitch: 500, dst: dst + (2 << 20) + 1000, dst_pitch: 500, width: 500, height: 1 },
    ];
    // More copies than one table holds (CUDA's holds 500, HIP's 48).
    copies.extend((0..600u64).map(|i| Copy2d {
        src: addr + 1_000_000 + i * 256,
        src_pitch: 200,
        dst: dst + 1_000_000 + i * 208,
        dst_pitch: 200,
        width: 200,
        height: 1,
    }));
    let t = unsafe { mem.copy(&copies)? };
    let mut spins = 0u64;
    while !mem.done(t)? {
        spins += 1;
        std::hint::spin_loop();
    }
    let mut want = vec![0u8; len as usize];
    for c in &copies {
        for row in 0..c.height {
            let s = (c.src - addr + row * c.src_pitch) as usize;
            let d = (c.dst - dst + row * c.dst_pitch) as usize;
            want[d..d + c.width as usize].copy_from_slice(&src_host[s..s + c.width as usize]);
        }
    }
    let mut got = vec![0u8; len as usize];
    unsafe { mem.read(dst, &mut got)? };
    rep.flag(
        "device copy",
        &format!("{} copies: 2D narrow (16/4/1-byte words) and wide, contiguous up to 4 MiB, overlapping, in order ({spins} polls)", copies.len()),
        got == want,
        "bytes",
    );
    rep.flag("device copy", "a ticket is forgotten once done", mem.done(t).is_err(), "refused");
    let handle = mem.export(addr)?;
    rep.flag("ipc export", "a region's handle", handle.len() == 64, "64 bytes");
    unsafe {
        mem.free(dst);
        mem.free(addr);
    }
    Ok(())
}

/// The fused step's tensor-core product: against an f64 reference for each
/// weight dtype and term count, and batch invariant (row 0's bits, and the
/// first rows', the same at M = 1, 7, 17, 88, 130 and 4096, for plain and unit-segment
/// weights).
pub(crate) fn check_step_matmul(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    use handoff_kernels::step::{StepMat, WeightDtype};
    let mut r = SplitMix64::new(seed ^ 0x7c3);
    let op = "step matmul (tensor cores)";
    for &(m, k, n) in &[(1usize, 64usize, 40usize), (37, 256, 200), (130, 512, 96)] {
        let x = uni(&mut r, m * k, -1.0, 1.0);
        let w = uni(&mut r, k * n, -1.0, 1.0);
        for (dtype, terms, tol) in [(WeightDtype::F32, 3u32, 3e-5), (WeightDtype::Bf16, 2, 3e-5), (WeightDtype::Bf16, 1, 1e-5)] {
            let mat = StepMat::plain(k, n, w.clone());
            let (got, _) = gpu.step_matmul(&x, m, &mat, dtype, terms, 1)?;
            // The f64 product of the numbers the device multiplies by: the
            // rounded weights, and x itself (x rounded to bf16 with one term).
            let wr: Vec<f64> = w.iter().map(|&v| dtype.round(v) as f64).collect();
            let xr: Vec<f64> = x.iter().map(|&v| if terms == 1 { WeightDtype::Bf16.round(v) as f64 } else { v as f64 }).collect();
            let want: Vec<f32> = (0..m * n)
                .map(|e| {
                    let (i, j) = (e / n, e % n);
                    (0..k).map(|kk| xr[i * k + kk] * wr[kk * n + j]).sum::<f64>() as f32
                })
                .collect();
            rep.close(op, &format!("{m}x{k}.{k}x{n} {} weights, {terms} terms", dtype.name()), &got, &want, tol);
        }
    }
    // Batch invariance: one tiling and one reduction order for every M.
    let (k, n) = (1024usize, 320usize);
    let x = uni(&mut r, 4096 * k, -1.0, 1.0);
    let w = uni(&mut r, k * n, -1.0, 1.0);
    for (name, mat) in [("auto segments", StepMat::plain(k, n, w.clone())), ("16 unit segments", StepMat::units(k, n, 16, w.clone()))] {
        // Each kernel variant: bf16 weights (one plane, 1 or 2 terms) and f32 (two planes, 3 terms).
        for (dtype, terms) in [(WeightDtype::Bf16, 2u32), (WeightDtype::Bf16, 1), (WeightDtype::F32, 3)] {
            let (full, _) = gpu.step_matmul(&x, 4096, &mat, dtype, terms, 1)?;
            for m in [1usize, 7, 17, 88, 130] {
                let (part, _) = gpu.step_matmul(&x[..m * k], m, &mat, dtype, terms, 1)?;
                rep.exact_f32(op, &format!("rows of M = {m} vs M = 4096, {name}, {} weights, {terms} terms", dtype.name()), &part, &full[..m * n]);
            }
        }
    }
    Ok(())
}

/// The tensor-core MLA partial's two rings of row tiles (`tc8x2`: two tiles,
/// two blocks a multiprocessor; `tc8x4`: four, for launches of about one
/// block a multiprocessor) give the same bits, and the default picks either
/// by the launch's block count: a batch above the multiprocessor count and
/// one below it, each against both rings, and the small one against the CPU.
pub(crate) fn check_mla_rings(gpu: &CudaBackend, rep: &mut Report, seed: u64) -> R<()> {
    let mut r = SplitMix64::new(seed ^ 0x41a6);
    let k3 = MlaShape { heads: 8, kv_lora_rank: 512, rope_dim: 64, scale: 1.0 / 192f32.sqrt() };
    let with = |kernel: &str| -> R<CudaBackend> {
        let mut g = gpu.clone();
        g.set_mla_kernel(kernel)?;
        Ok(g)
    };
    let (two, four) = (with("tc8x2")?, with("tc8x4")?);
    for &(heads, ref counts) in &[(8usize, vec![2049usize, 17, 255, 256, 511, 0, 16]), (8, vec![20000usize]), (16, vec![30000usize, 300, 9000])] {
        let shape = MlaShape { heads, ..k3 };
        let wd = shape.row_width();
        let total: usize = counts.iter().sum();
        let blocks: usize = counts.iter().map(|n| n.div_ceil(256)).sum::<usize>() * (heads / 8);
        let q = uni(&mut r, counts.len() * heads * wd, -1.0, 1.0);
        let rows = uni(&mut r, total * wd, -1.0, 1.0);
        let case = format!("H={heads} counts={counts:?} ({blocks} blocks)");
        let d = run_ragged(gpu, shape, &q, &rows, counts)?;
        let a = run_ragged(&two, shape, &q, &rows, counts)?;
        let b = run_ragged(&four, shape, &q, &rows, counts)?;
        rep.exact_f64("MLA partial ring of 4 = of 2", &case, &b, &a);
        rep.exact_f64("MLA partial default ring = of 2", &case, &d, &a);
        if total < 4096 {
            let c = run_ragged(&CpuBackend::new(), shape, &q, &rows, counts)?;
            rep.close64("MLA partial ring of 4 vs CPU", &case, &b, &c, 1e-12);
        }
    }
    Ok(())
}
