//! Transport bandwidth on synthetic jobs (contiguous blocks, and 1152-byte MLA rows
//! from an 8-way token interleave), against memcpy measured in the same run. Reports,
//! never asserts. `cargo bench --bench transport_blocks`
//! Env: HANDOFF_BENCH_BLOCK (bytes, default 65536), HANDOFF_BENCH_TOTAL (default 256 MiB).

use handoff::transport::bench::{BenchOptions, SyntheticSpec, bench_loopback};
use handoff_components::config::TransportKind;

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn main() {
    let block = env_u64("HANDOFF_BENCH_BLOCK", 65536);
    let total = env_u64("HANDOFF_BENCH_TOTAL", 256 << 20);
    let opts = BenchOptions { iterations: 5, warmup: 1, ..BenchOptions::default() };
    for kind in [TransportKind::Local, TransportKind::Shm, TransportKind::Tcp] {
        for interleave in [None, Some(8)] {
            let spec = SyntheticSpec { block_bytes: if interleave.is_some() { 1152 } else { block }, total_bytes: total, src_interleave: interleave };
            match bench_loopback(kind, spec, &opts) {
                Ok(r) => println!("{} {:?}: {r}", kind.name(), spec),
                Err(e) => println!("{}: error {e}", kind.name()),
            }
        }
    }
}
