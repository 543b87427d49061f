//! Transfer benchmark, for `handoff bench transfer --transport local|shm|tcp`.
//!
//! Reports, never asserts (benchmarks measure; tests assert). Every report carries this machine's
//! memcpy bandwidth measured in the same run (one thread and two threads), so a
//! transfer figure always comes with the limit it is compared to.

use super::{BatchId, RegionHandle, RemoteRegion, Result, Transport, TransportExt, loopback_pair};
use handoff_components::config::TransportKind;
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use serde::Serialize;
use std::time::{Duration, Instant};

/// One (source region, destination region, descriptors) transfer of the benchmark.
#[derive(Debug, Clone)]
pub struct TransferJob {
    pub src: RegionHandle,
    pub dst: RemoteRegion,
    pub descriptors: Vec<Descriptor>,
}

impl TransferJob {
    pub fn bytes(&self) -> u64 {
        self.descriptors.iter().map(Descriptor::bytes).sum()
    }
}

/// How long and how hard to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Timed passes over all jobs (each pass submits every job, then waits for all).
    pub iterations: u32,
    pub warmup: u32,
    /// Descriptors per submitted batch (a job is split into batches of this size).
    pub batch: usize,
    /// Buffer size of the memcpy reference copy.
    pub memcpy_bytes: usize,
    pub timeout: Duration,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions { iterations: 10, warmup: 2, batch: 128, memcpy_bytes: 256 << 20, timeout: Duration::from_secs(60) }
    }
}

/// What one benchmark run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub transport: String,
    pub iterations: u32,
    /// Bytes and descriptors moved in the timed passes.
    pub bytes: u64,
    pub descriptors: u64,
    pub seconds: f64,
    /// 1e9 bytes per second.
    pub gb_per_s: f64,
    pub descriptors_per_s: f64,
    pub memcpy_1t_gb_per_s: f64,
    pub memcpy_2t_gb_per_s: f64,
    /// `gb_per_s` over the better of the two memcpy figures (this machine's limit).
    pub ratio_to_memcpy: f64,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {:.2} GB/s, {:.0} descriptors/s ({} B in {} descriptors x {} passes, {:.3} s); memcpy {:.2} GB/s (1 thread), {:.2} GB/s (2 threads); ratio {:.3}",
            self.transport,
            self.gb_per_s,
            self.descriptors_per_s,
            self.bytes / self.iterations.max(1) as u64,
            self.descriptors / self.iterations.max(1) as u64,
            self.iterations,
            self.seconds,
            self.memcpy_1t_gb_per_s,
            self.memcpy_2t_gb_per_s,
            self.ratio_to_memcpy,
        )
    }
}

/// This machine's memcpy bandwidth in GB/s over `bytes`, split over `threads`
/// (best of a few repetitions, after touching the pages).
pub fn memcpy_bandwidth(bytes: usize, threads: usize) -> f64 {
    let mut limits = CopyLimits::new(bytes);
    (0..5).map(|_| limits.memcpy(threads)).fold(0.0, f64::max)
}

/// This machine's copy limits over one pair of buffers that stays allocated
/// (pages touched once), so that a bench can take them between its passes and
/// set each pass beside a limit taken at the same moment: on a shared machine
/// the memory bandwidth drifts by tens of percent within seconds.
pub struct CopyLimits {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl CopyLimits {
    pub fn new(bytes: usize) -> Self {
        let bytes = bytes.max(1 << 20);
        let src = vec![0x5au8; bytes];
        let mut dst = vec![0u8; bytes];
        dst.copy_from_slice(&src);
        CopyLimits { src, dst }
    }

    /// One memcpy (`copy_from_slice`) of the buffer split over `threads`, GB/s.
    pub fn memcpy(&mut self, threads: usize) -> f64 {
        self.timed(threads, |d, s| d.copy_from_slice(s))
    }

    /// One copy of the buffer with the in-host transports' own piece copy
    /// (streaming stores where the CPU has AVX2), split over `threads`, GB/s:
    /// the limit of a copy that skips reading the destination for ownership,
    /// which glibc's memcpy does not skip at these sizes on this VM.
    pub fn streaming(&mut self, threads: usize) -> f64 {
        self.timed(threads, |d, s| super::copy::copy_slice(s, d))
    }

    fn timed(&mut self, threads: usize, copy: impl Fn(&mut [u8], &[u8]) + Sync) -> f64 {
        let per = self.src.len().div_ceil(threads.max(1));
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in self.dst.chunks_mut(per).zip(self.src.chunks(per)) {
                let copy = &copy;
                s.spawn(move || copy(d, c));
            }
        });
        let seconds = t.elapsed().as_secs_f64().max(1e-9);
        std::hint::black_box(&self.dst);
        self.src.len() as f64 / seconds / 1e9
    }
}

fn pass(transport: &dyn Transport, jobs: &[TransferJob], batch: usize, timeout: Duration) -> Result<()> {
    let mut ids: Vec<BatchId> = Vec::new();
    for job in jobs {
        for chunk in job.descriptors.chunks(batch.max(1)) {
            ids.push(transport.submit(&job.src, job.dst, chunk)?);
        }
    }
    for id in ids {
        transport.wait(id, timeout)?;
    }
    Ok(())
}

/// Times `jobs` on `transport` and measures memcpy in the same run.
pub fn bench_transfer(transport: &dyn Transport, jobs: &[TransferJob], opts: &BenchOptions) -> Result<BenchReport> {
    for _ in 0..opts.warmup {
        pass(transport, jobs, opts.batch, opts.timeout)?;
    }
    let t = Instant::now();
    for _ in 0..opts.iterations {
        pass(transport, jobs, opts.batch, opts.timeout)?;
    }
    let seconds = t.elapsed().as_secs_f64().max(1e-9);
    let bytes = jobs.iter().map(TransferJob::bytes).sum::<u64>() * opts.iterations as u64;
    let descriptors = jobs.iter().map(|j| j.descriptors.len() as u64).sum::<u64>() * opts.iterations as u64;
    let memcpy_1t = memcpy_bandwidth(opts.memcpy_bytes, 1);
    let memcpy_2t = memcpy_bandwidth(opts.memcpy_bytes, 2);
    let gb_per_s = bytes as f64 / seconds / 1e9;
    Ok(BenchReport {
        transport: transport.name().to_string(),
        iterations: opts.iterations,
        bytes,
        descriptors,
        seconds,
        gb_per_s,
        descriptors_per_s: descriptors as f64 / seconds,
        memcpy_1t_gb_per_s: memcpy_1t,
        memcpy_2t_gb_per_s: memcpy_2t,
        ratio_to_memcpy: gb_per_s / memcpy_1t.max(memcpy_2t).max(1e-9),
    })
}

/// The layout of a synthetic benchmark transfer.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SyntheticSpec {
    /// Bytes of one contiguous piece (a block, or one token row when strided).
    pub block_bytes: u64,
    /// Total bytes moved per pass.
    pub total_bytes: u64,
    /// `Some(k)`: pieces are taken every k-th slot at the source and packed at the
    /// destination (a DCP-like gather, one strided descriptor per block); `None`:
    /// contiguous, one descriptor per block.
    pub src_interleave: Option<u32>,
}

/// Runs a synthetic benchmark between two transports of `kind` in this process
/// (two shm prefixes, or two TCP endpoints on loopback).
pub fn bench_loopback(kind: TransportKind, spec: SyntheticSpec, opts: &BenchOptions) -> Result<BenchReport> {
    let (producer, consumer) = loopback_pair(kind)?;
    let block = spec.block_bytes.max(1);
    let blocks = (spec.total_bytes / block).max(1);
    let k = spec.src_interleave.unwrap_or(1).max(1) as u64;
    let src_rank = RankId::Prefill(PrefillRank { pp: 0, tp: 0 });
    let dst_rank = RankId::Decode(DecodeRank { tp: 0 });
    let src = producer.register(src_rank, RegionKind::MlaKv, blocks * block * k)?;
    let dst_handle = consumer.register(dst_rank, RegionKind::MlaKv, blocks * block)?;
    producer.write_region(&src, |b| {
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31);
        }
    })?;
    let dst = producer.attach(&dst_handle)?;
    let descriptors: Vec<Descriptor> = match spec.src_interleave {
        None => (0..blocks).map(|i| Descriptor::copy(RegionKind::MlaKv, i * block, i * block, block)).collect(),
        Some(_) => {
            // 128 rows per descriptor, like a 128-token page gathered from k-way interleave.
            let rows_per = 128u64;
            (0..blocks.div_ceil(rows_per))
                .map(|j| {
                    let first = j * rows_per;
                    let count = rows_per.min(blocks - first) as u32;
                    Descriptor {
                        kind: RegionKind::MlaKv,
                        src_offset: first * k * block,
                        dst_offset: first * block,
                        len: block,
                        count,
                        src_stride: k * block,
                        dst_stride: block,
                    }
                })
                .collect()
        }
    };
    let report = bench_transfer(producer.as_ref(), &[TransferJob { src, dst, descriptors }], opts)?;
    drop(consumer);
    Ok(report)
}
