//! Device check of the CUDA backend against the CPU reference, runnable on a
//! GPU machine with no Rust toolchain (build here, strip, carry the binary):
//!
//! ```text
//! cargo build --release -p handoff-kernels --features cuda --example cuda_check
//! strip target/release/examples/cuda_check
//! ./cuda_check            # every op: CPU vs CUDA, batch invariance, determinism
//! ./cuda_check --bench    # timings: KDA step vs device copy bandwidth, and more
//! ./cuda_check --bench-mla   # the device copy and the MLA partial rows only
//! ./cuda_check --bench-matmul   # the device copy and the fused step's tensor-core products only
//! ./cuda_check --bench-dense    # the generic matmul's two kernels at prefill shapes
//! ./cuda_check --bench-kda      # the chunked KDA prefill only (T = 8K, 32K; FLA chunk_kda's shapes)
//! ./cuda_check --bench-mla --mla tc4:256   # another MLA partial kernel (scalar, tc4, tc8[:rows])
//! ```
//!
//! For every op it draws fresh random inputs (SplitMix64, `--seed`), runs
//! `CpuBackend` and `CudaBackend` on them and prints `op | case | max rel err |
//! tol | ok`. The error is max |gpu - cpu| over max |cpu| (relative to the
//! output's inf-norm); "exact" rows compare bits. Tolerances: f32 ops 1e-5;
//! the matmul and what is built on it 3e-5 (tensor cores on the bf16 split of
//! f32, dense.hip: the dropped lo x lo term is about 2^-16 of each product);
//! KDA prefill 1e-4 (the CPU runs the chunked form on wide heads, and so does
//! the GPU where dk <= 128; both agree to rounding only); f64 attention partials 1e-12; copies, rounding, embedding,
//! argmax, cursors exact. Batch invariance (matmul, KDA step, ragged MLA
//! partial: a batch of B against each row alone, bit-equal) and determinism
//! (two runs, bit-equal) are checked on the GPU. Exits 0 when all pass, 1 on a
//! failure, 2 when no CUDA device can be opened (the message says why).

use std::process::ExitCode;

use handoff_kernels::backend::matmul_units_each;
use handoff_kernels::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use handoff_kernels::{
    Backend, ColsCopy, ConvShape, Copy2d, CpuBackend, CudaBackend, DeviceRegion, EmbeddingShape, KdaInputs, KdaKernel, KdaParams, KdaPrefillShape,
    KdaRaggedShape, KdaStepShape, KernelError, MatmulShape, MergeShape, MlaShape, MlpShape, MlpWeights, NormShape, RegionItems, ReplayShape, RowSet,
    SplitMix64, StorageDtype, UnitProduct, UnitsOut, UnitsShape, mla_partial_width, replay_record_width,
};

type R<T> = Result<T, KernelError>;

mod bench;
mod checks_more;
mod checks_ops;
mod harness;
mod report;

use bench::*;
use checks_more::*;
use checks_ops::*;
use harness::*;
use report::*;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mla_only = args.iter().any(|a| a == "--bench-mla");
    let matmul_only = args.iter().any(|a| a == "--bench-matmul");
    let dense_only = args.iter().any(|a| a == "--bench-dense");
    let kda_only = args.iter().any(|a| a == "--bench-kda");
    let bench_mode = mla_only || matmul_only || dense_only || kda_only || args.iter().any(|a| a == "--bench");
    let seed = args.iter().position(|a| a == "--seed").and_then(|i| args.get(i + 1)).and_then(|s| s.parse().ok()).unwrap_or(0x00C0_FFEE_u64);
    let t0 = std::time::Instant::now();
    let mut gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let (maj, min) = gpu.compute_capability();
    println!("device 0: {} (sm_{maj}{min}), kernels compiled by NVRTC in {:.0} ms; seed {seed:#x}", gpu.device_name(), t0.elapsed().as_secs_f64() * 1e3);
    let mla_kernel = args.iter().position(|a| a == "--mla").and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| "default".to_string());
    if mla_kernel != "default"
        && let Err(e) = gpu.set_mla_kernel(&mla_kernel)
    {
        eprintln!("error: --mla {e}");
        return ExitCode::from(2);
    }
    if bench_mode {
        return match bench(&mut gpu, seed, mla_only, matmul_only, dense_only, kda_only, &mla_kernel) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        };
    }
    println!("| {:<28} | {:<44} | {:>11} | {:>6} | ok |", "op", "case", "max rel err", "tol");
    println!("|{}|{}|{}|{}|----|", "-".repeat(30), "-".repeat(46), "-".repeat(13), "-".repeat(8));
    let mut rep = Report::new();
    let res = checks(&gpu, &mut rep, seed)
        .and_then(|()| check_regions(&gpu, &mut rep, seed))
        .and_then(|()| check_kda_variants(&mut gpu, &mut rep, seed))
        .and_then(|()| check_mla_rings(&gpu, &mut rep, seed))
        .and_then(|()| check_fused(&mut gpu, &mut rep, seed))
        .and_then(|()| check_step_matmul(&gpu, &mut rep, seed));
    if let Err(e) = res {
        eprintln!("error: a check could not run: {e}");
        return ExitCode::from(1);
    }
    let fails = rep.failures();
    println!("{} checks, {} failed ({:.1} s)", rep.rows.len(), fails, t0.elapsed().as_secs_f64());
    if fails > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS }
}
