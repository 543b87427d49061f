//! The launch list as plain data, the step's device memory, the products'
//! launches, and the launcher of a list.

use super::*;

/// Device memory owned by the step, freed with it.
pub(super) struct DevAlloc {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: u64,
}

impl Drop for DevAlloc {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from cuMemAlloc in `Arena::alloc` and is freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// The step's allocations: each zeroed at allocation.
pub(super) struct Arena {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) allocs: Vec<DevAlloc>,
    pub(super) bytes: u64,
}

impl Arena {
    pub(super) fn alloc(&mut self, bytes: usize) -> Result<u64> {
        let op = "decode_step alloc";
        self.ctx.bind_to_thread().map_err(dev(op))?;
        let n = bytes.max(16).next_multiple_of(256);
        // SAFETY: a plain device allocation, zeroed on the stream before any use.
        let ptr = unsafe { result::malloc_sync(n) }.map_err(dev(op))?;
        self.allocs.push(DevAlloc { ctx: self.ctx.clone(), ptr });
        unsafe { result::memset_d8_async(ptr, 0, n, self.stream.cu_stream()) }.map_err(dev(op))?;
        self.bytes += n as u64;
        Ok(ptr)
    }

    pub(super) fn upload<T: Copy>(&mut self, data: &[T]) -> Result<u64> {
        let ptr = self.alloc(std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: ptr holds at least size_of_val(data) bytes; the copy is
            // synchronous for pageable memory before the call returns the data.
            unsafe { result::memcpy_htod_async(ptr, data, self.stream.cu_stream()) }.map_err(dev("decode_step upload"))?;
        }
        Ok(ptr)
    }
}

/// One kernel argument, by value.
#[derive(Debug, Clone, Copy)]
pub(super) enum Arg {
    P(u64),
    L(i64),
    I(i32),
    F(f32),
    D(f64),
}

/// One launch of the step's fixed sequence.
pub(super) struct Launch {
    pub(super) f: sys::CUfunction,
    pub(super) name: &'static str,
    pub(super) grid: (u32, u32, u32),
    pub(super) block: u32,
    pub(super) smem: u32,
    pub(super) args: Vec<Arg>,
}

/// What a product's segment sum feeds (`st_mm`'s modes).
#[derive(Clone, Copy)]
pub(super) enum Epi {
    /// `out[m * ldo + g * gcol + n] = sum`.
    Store { out: u64, ldo: usize, gcol: usize },
    /// `out[m * ldo + n] += sum` (the residual add of an all-reduce).
    Resid { out: u64, ldo: usize },
    /// `silu(gate) * up` as the A operand of the down projection (`akt` k
    /// tiles, column n in unit n / uw padded to uwp).
    Swiglu { a: u64, akt: usize, uw: usize, uwp: usize, n: usize },
    /// The sum as the A operand of the next product, group g at column `g * gcol`.
    Pack { a: u64, akt: usize, gcol: usize },
}

/// A packed weight on the device.
#[derive(Clone, Copy)]
pub(super) struct DevMat {
    pub(super) addr: u64,
    pub(super) groups: usize,
    pub(super) kt: usize,
    pub(super) nt: usize,
    pub(super) cols: usize,
    pub(super) segments: usize,
    /// Logical and padded inner rows of a segment.
    pub(super) unit: usize,
    pub(super) unit_padded: usize,
    /// bf16 values of one plane of one group.
    pub(super) plane: usize,
    pub(super) planes: usize,
}

/// The kernels of one tensor-core product (hip/step_mm.hip).
pub(super) struct MmFuncs {
    pub(super) few: CudaFunction,
    pub(super) one: CudaFunction,
    pub(super) two: CudaFunction,
    pub(super) two_p2: CudaFunction,
    pub(super) reduce: CudaFunction,
    /// Hopper's warpgroup products (st_mm_wg<NB>_<WP>, 17 to 128 rows), in
    /// [`WG_ROWS`] order, one plane then two; absent where the module was not
    /// built for sm_90a.
    pub(super) wg: Option<Vec<CudaFunction>>,
}

/// The row blocks of st_mm_wg's instances (a product takes the smallest that
/// holds its rows).
const WG_ROWS: [usize; 4] = [32, 64, 96, 128];

/// st_mm_wg's dynamic shared memory for `nb` rows, `wp` weight planes and
/// `terms` (step_mm.hip: ST_WG_D + 1 = 2 buffers of ST_WG_KC(WP) k-steps).
fn wg_smem(nb: usize, wp: usize, terms: i32) -> u32 {
    let (kc, planes) = (if wp == 1 { 8 } else { 4 }, if terms >= 2 { 2 } else { 1 });
    (2 * kc * (8 * wp * 512 + planes * nb * 32)) as u32
}

impl MmFuncs {
    pub(super) fn load(module: &Arc<CudaModule>) -> Result<MmFuncs> {
        let get = |name: &str| module.load_function(name).map_err(|e| KernelError::BackendUnavailable(format!("cuda: kernel {name} missing: {e}")));
        // Either every warpgroup instance is in the module or none is.
        let wg = [1, 2]
            .iter()
            .flat_map(|wp| WG_ROWS.iter().map(move |nb| format!("st_mm_wg{nb}_{wp}")))
            .map(|name| module.load_function(&name).ok())
            .collect::<Option<Vec<_>>>();
        if let Some(list) = &wg {
            for (i, func) in list.iter().enumerate() {
                // The most it takes: activations in two planes.
                let (wp, nb) = (1 + i / WG_ROWS.len(), WG_ROWS[i % WG_ROWS.len()]);
                func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, wg_smem(nb, wp, 2) as i32)
                    .map_err(|e| KernelError::BackendUnavailable(format!("cuda: cannot give st_mm_wg its shared memory: {e}")))?;
            }
        }
        let f = MmFuncs { few: get("st_mm_few")?, one: get("st_mm")?, two: get("st_mm_w2")?, two_p2: get("st_mm_w2p2")?, reduce: get("st_reduce")?, wg };
        for (func, what) in [(&f.one, "st_mm"), (&f.two, "st_mm_w2"), (&f.two_p2, "st_mm_w2p2")] {
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, MM_SMEM_MAX as i32)
                .map_err(|e| KernelError::BackendUnavailable(format!("cuda: cannot give {what} {MM_SMEM_MAX} bytes of shared memory: {e}")))?;
        }
        Ok(f)
    }

    /// The launches of a product over `m` rows of a weight of `nt` column
    /// tiles, `segments` x `groups` blocks of inner rows, `terms` products a
    /// k-step; `args` in st_mm_few's order. Few rows: st_mm_few alone (its last
    /// blocks sum the segments); more: st_mm_wg on Hopper up to 128 rows, or
    /// st_mm (st_mm_w2(p2) when the weight has two planes), writes the
    /// partials and st_reduce sums them over the device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launches(&self, name: &'static str, m: usize, nt: usize, segments: usize, groups: usize, terms: i32, args: Vec<Arg>) -> Vec<Launch> {
        let gy = (segments * groups) as u32;
        if m <= 16 {
            return vec![Launch { f: self.few.cu_function(), name, grid: (nt.div_ceil(4) as u32, gy, 1), block: 128, smem: 0, args }];
        }
        let (wp, p, smem) = mm_shape(m, terms);
        // 17 to 128 rows on Hopper: the warpgroup product (the same bits,
        // cuda_check holds them against st_mm's), else st_mm.
        let wg = self.wg.as_ref().and_then(|list| {
            let at = WG_ROWS.iter().position(|&nb| m <= nb)?;
            Some((&list[(wp - 1) * WG_ROWS.len() + at], WG_ROWS[at]))
        });
        let (f, grid, block, smem) = match (wg, wp, p) {
            (Some((f, nb)), _, _) => (f, (nt.div_ceil(8) as u32, gy, m.div_ceil(nb) as u32), ST_WG_THREADS, wg_smem(nb, wp, terms)),
            (None, 1, _) => (&self.one, (nt.div_ceil(8) as u32, gy, m.div_ceil(128) as u32), ST_MM_THREADS, smem),
            (None, _, 3) => (&self.two, (nt.div_ceil(8) as u32, gy, m.div_ceil(128) as u32), ST_MM_THREADS, smem),
            _ => (&self.two_p2, (nt.div_ceil(8) as u32, gy, m.div_ceil(128) as u32), ST_MM_THREADS, smem),
        };
        // st_reduce's arguments, from st_mm_few's: the partials (6..10), M (11),
        // ncols (17), S (14), G, mode (16) and the rest of the epilogue (18..).
        let mut red = args[6..10].to_vec();
        red.extend([args[11], args[17], args[14], Arg::I(groups as i32), args[16]]);
        red.extend_from_slice(&args[18..]);
        let ncols = match args[17] {
            Arg::I(n) => n.max(0) as usize,
            _ => 1,
        };
        vec![
            Launch { f: f.cu_function(), name, grid, block, smem, args },
            // One block row a (group, row); past the y limit the kernel strides.
            Launch {
                f: self.reduce.cu_function(),
                name: "st_reduce",
                // Four elements a thread (st_reduce).
                grid: (ncols.div_ceil(1024).max(1) as u32, (groups * m).min(65535) as u32, 1),
                block: 256,
                smem: 0,
                args: red,
            },
        ]
    }
}

/// Counters a product's launch needs (st_mm_few's: one a column block of a group).
pub(super) fn mm_counters(nt: usize, groups: usize) -> usize {
    groups * nt.div_ceil(4)
}

/// Launches `list` in order on `stream`.
pub(super) fn launch_all(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, list: &[Launch]) -> Result<()> {
    let op = "decode_step launch";
    ctx.bind_to_thread().map_err(dev(op))?;
    let cu_stream = stream.cu_stream();
    let mut vals: Vec<u64> = Vec::with_capacity(32);
    let mut params: Vec<*mut c_void> = Vec::with_capacity(32);
    for l in list {
        vals.clear();
        params.clear();
        // Every argument as 8 bytes of storage, read by the driver at the
        // width the kernel declares (little-endian: an i32 or f32 is its
        // first 4 bytes).
        for a in &l.args {
            vals.push(match *a {
                Arg::P(x) => x,
                Arg::L(x) => x as u64,
                Arg::I(x) => x as u32 as u64,
                Arg::F(x) => x.to_bits() as u64,
                Arg::D(x) => x.to_bits(),
            });
        }
        for v in vals.iter_mut() {
            params.push(v as *mut u64 as *mut c_void);
        }
        // SAFETY: each argument list matches its kernel's signature in
        // hip/step.hip (built next to it); every address is an allocation of
        // the step or a registered region checked by StepSpec::check and the
        // tick's index checks.
        unsafe { result::launch_kernel(l.f, l.grid, (l.block, 1, 1), l.smem, cu_stream, &mut params) }
            .map_err(|e| KernelError::Device { op, message: format!("{}: {e}", l.name) })?;
    }
    Ok(())
}
