//! Shared helpers of the transport tests: a seeded generator, random strided
//! batches with disjoint destinations, the naive reference copy, and a byte diff.
//! (Each test binary that includes it allows the helpers it does not use.)

use handoff::transport::device::DeviceTransport;
use handoff::transport::{MemoryKind, RegionHandle, Transport, TransportExt};
use handoff_components::plan::Descriptor;
use handoff_components::vocab::{DecodeRank, PrefillRank, RankId, RegionKind};
use handoff_kernels::{Copy2d, CopyTicket, DeviceMemory};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const WAIT: Duration = Duration::from_secs(20);

pub fn producer_rank() -> RankId {
    RankId::Prefill(PrefillRank { pp: 0, tp: 0 })
}
pub fn consumer_rank() -> RankId {
    RankId::Decode(DecodeRank { tp: 0 })
}

/// xorshift64*: deterministic across processes (parent and child agree on bytes).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn fill(&mut self, b: &mut [u8]) {
        for chunk in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.fill(&mut v);
        v
    }
}

/// A random batch of up to `n` strided descriptors of `kind` whose destination
/// pieces are pairwise disjoint (placed at random offsets, so descriptors
/// interleave as DCP plans do) within `dst_len`; sources within `src_len` may
/// overlap (reading twice is fine). `max_piece` bounds `len`.
pub fn random_batch(rng: &mut Rng, kind: RegionKind, n: usize, max_piece: u64, src_len: u64, dst_len: u64) -> Vec<Descriptor> {
    let mut used = vec![false; dst_len as usize];
    let mut out = Vec::with_capacity(n);
    let mut tries = 0;
    while out.len() < n && tries < 20 * n {
        tries += 1;
        let len = 1 + rng.below(max_piece);
        let count = 1 + rng.below(8) as u32;
        let dst_stride = if count == 1 { 0 } else { len + rng.below(4) * len };
        let src_stride = rng.below(2 * len + 1);
        let dst_span = (count as u64 - 1) * dst_stride + len;
        let src_span = (count as u64 - 1) * src_stride + len;
        if dst_span > dst_len || src_span > src_len {
            continue;
        }
        let d = Descriptor {
            kind,
            src_offset: rng.below(src_len - src_span + 1),
            dst_offset: rng.below(dst_len - dst_span + 1),
            len,
            count,
            src_stride,
            dst_stride,
        };
        let free = d.pieces().all(|(_, t)| !used[t as usize..(t + len) as usize].iter().any(|&u| u));
        if free {
            for (_, t) in d.pieces() {
                used[t as usize..(t + len) as usize].iter_mut().for_each(|u| *u = true);
            }
            out.push(d);
        }
    }
    out
}

/// Whether any two destination pieces of the batch intersect.
pub fn dst_overlap(descs: &[Descriptor]) -> bool {
    let mut r: Vec<(u64, u64)> = descs.iter().flat_map(|d| d.pieces().map(move |(_, t)| (t, t + d.len)).collect::<Vec<_>>()).collect();
    r.sort_unstable();
    r.windows(2).any(|w| w[1].0 < w[0].1)
}

/// The reference: a plain loop, descriptor by descriptor, piece by piece.
pub fn naive_copy(src: &[u8], dst: &mut [u8], descs: &[Descriptor]) {
    for d in descs {
        for i in 0..d.count as u64 {
            let s = (d.src_offset + i * d.src_stride) as usize;
            let t = (d.dst_offset + i * d.dst_stride) as usize;
            let n = d.len as usize;
            dst[t..t + n].copy_from_slice(&src[s..s + n]);
        }
    }
}

/// Panics naming the first differing byte and the descriptor piece that wrote it.
pub fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8], descs: &[Descriptor]) {
    assert_eq!(got.len(), want.len(), "{what}: region length");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        let owner = descs
            .iter()
            .enumerate()
            .find_map(|(i, d)| d.pieces().position(|(_, t)| (t..t + d.len).contains(&(at as u64))).map(|p| format!("descriptor {i} piece {p} ({d:?})")));
        panic!(
            "{what}: first wrong byte at offset {at}: got {:#04x}, want {:#04x}; written by {}",
            got[at],
            want[at],
            owner.unwrap_or_else(|| "no descriptor (a stray write)".into())
        );
    }
}

/// Registers a random source on `producer` and a random-filled destination on
/// `consumer`, writes `descs`, and checks the destination against the reference.
pub fn check_transfer(producer: &dyn Transport, consumer: &dyn Transport, seed: u64, src_len: u64, dst_len: u64, descs: &[Descriptor], what: &str) {
    let kind = descs.first().map(|d| d.kind).unwrap_or(RegionKind::MlaKv);
    let mut rng = Rng(seed);
    let src = register(producer, producer_rank(), kind, src_len).expect("register src");
    let dst = register(consumer, consumer_rank(), kind, dst_len).expect("register dst");
    let src_bytes = rng.bytes(src_len as usize);
    let dst_before = rng.bytes(dst_len as usize);
    producer.write_region(&src, |b| b.copy_from_slice(&src_bytes)).expect("fill src");
    consumer.write_region(&dst, |b| b.copy_from_slice(&dst_before)).expect("fill dst");
    let mut want = dst_before.clone();
    naive_copy(&src_bytes, &mut want, descs);

    let remote = producer.attach(&dst).expect("attach");
    let batch = producer.submit(&src, remote, descs).expect("submit");
    producer.wait(batch, WAIT).expect("batch completes");
    let got = consumer.region_bytes(&dst).expect("read dst");
    assert_bytes_eq(what, &got, &want, descs);
    // The source is untouched.
    assert_bytes_eq(&format!("{what} (source)"), &producer.region_bytes(&src).expect("read src"), &src_bytes, descs);
    consumer.unregister(&dst).expect("unregister dst");
    producer.unregister(&src).expect("unregister src");
}

/// Registers a region in the memory the transport keeps: device memory on the
/// cuda-ipc transport, host memory on the others.
pub fn register(t: &dyn Transport, rank: RankId, kind: RegionKind, len: u64) -> handoff::transport::Result<RegionHandle> {
    let memory = if t.name() == "cuda-ipc" { MemoryKind::Device { ordinal: 0 } } else { MemoryKind::Host };
    t.register_memory(rank, kind, len, memory)
}

/// A stand-in for GPU memory on machines without one: allocations are host
/// buffers at their own addresses, copies run at once in queue order, and a
/// ticket reports done after `lag` queries (so completion by query is
/// exercised). It cannot open another process's memory.
pub struct HostDeviceMemory {
    allocs: Mutex<HashMap<u64, Box<[u8]>>>,
    tickets: Mutex<HashMap<u64, u32>>,
    next: Mutex<u64>,
    pub lag: u32,
    /// Calls of `copy` (one per submission the transport queued).
    pub submissions: std::sync::atomic::AtomicUsize,
}

impl HostDeviceMemory {
    pub fn new(lag: u32) -> Arc<Self> {
        Arc::new(HostDeviceMemory { allocs: Mutex::default(), tickets: Mutex::default(), next: Mutex::new(1), lag, submissions: Default::default() })
    }
}

impl DeviceMemory for HostDeviceMemory {
    fn label(&self) -> String {
        "host-as-device:0".into()
    }
    fn alloc(&self, len: u64) -> handoff_kernels::Result<u64> {
        let b = vec![0u8; len.max(1) as usize].into_boxed_slice();
        let addr = b.as_ptr() as u64;
        self.allocs.lock().unwrap().insert(addr, b);
        Ok(addr)
    }
    unsafe fn free(&self, addr: u64) {
        self.allocs.lock().unwrap().remove(&addr);
    }
    fn export(&self, addr: u64) -> handoff_kernels::Result<Vec<u8>> {
        Ok(addr.to_le_bytes().iter().copied().cycle().take(64).collect())
    }
    fn open(&self, _: &[u8]) -> handoff_kernels::Result<u64> {
        Err(handoff_kernels::KernelError::BackendUnavailable("host-as-device memory cannot open another process's memory".into()))
    }
    unsafe fn close(&self, _: u64) {}
    unsafe fn copy(&self, copies: &[Copy2d]) -> handoff_kernels::Result<CopyTicket> {
        self.submissions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for c in copies {
            for r in 0..c.height {
                // SAFETY: the transport checked every range against live allocations.
                unsafe { std::ptr::copy((c.src + r * c.src_pitch) as *const u8, (c.dst + r * c.dst_pitch) as *mut u8, c.width as usize) };
            }
        }
        let mut n = self.next.lock().unwrap();
        *n += 1;
        self.tickets.lock().unwrap().insert(*n, self.lag);
        Ok(CopyTicket(*n))
    }
    fn done(&self, t: CopyTicket) -> handoff_kernels::Result<bool> {
        let mut ts = self.tickets.lock().unwrap();
        match ts.get_mut(&t.0) {
            None => Err(handoff_kernels::KernelError::BackendUnavailable(format!("unknown ticket {}", t.0))),
            Some(0) => {
                ts.remove(&t.0);
                Ok(true)
            }
            Some(n) => {
                *n -= 1;
                Ok(false)
            }
        }
    }
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> handoff_kernels::Result<()> {
        // SAFETY: the transport reads whole live regions.
        unsafe { std::ptr::copy(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    unsafe fn write(&self, addr: u64, data: &[u8]) -> handoff_kernels::Result<()> {
        // SAFETY: as above.
        unsafe { std::ptr::copy(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }
}

/// A cuda-ipc transport over [`HostDeviceMemory`].
pub fn host_device_transport(lag: u32) -> Arc<DeviceTransport> {
    host_device_transport_on(HostDeviceMemory::new(lag))
}

/// A cuda-ipc transport over the given stand-in memory.
pub fn host_device_transport_on(mem: Arc<HostDeviceMemory>) -> Arc<DeviceTransport> {
    let mem: Arc<dyn DeviceMemory> = mem;
    Arc::new(
        DeviceTransport::new(mem, 0, handoff::transport::shm::default_dir(), handoff::transport::auth::ClusterSecret::process()).expect("device transport"),
    )
}

pub fn handle_json(h: &RegionHandle) -> String {
    serde_json::to_string(h).expect("handle serializes")
}

/// Waits for a child to exit, killing it past `limit` (a test must not hang).
pub fn wait_child(child: &mut std::process::Child, what: &str, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            panic!("{what}: child did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
