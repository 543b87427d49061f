//! Opening a backend on a driver: every kernel of the generic ops resolved by
//! name, and the ones that take more than the default shared memory given it.

use super::*;

/// matmul_wg and its two packing kernels (dense.hip), present together in an
/// sm_90a build.
#[derive(Clone, Copy)]
pub(crate) struct MatmulWg<F> {
    pub(crate) product: F,
    pub(crate) pack_x: F,
    pub(crate) pack_w: F,
}

/// The tensor-core MLA partials (mla.hip), present together.
#[derive(Clone, Copy)]
pub(crate) struct MlaTcFuncs<F> {
    pub(crate) tc4: F,
    pub(crate) tc8: F,
    pub(crate) tc8_deep: F,
}

/// The kernels of the loaded program.
pub(crate) struct Funcs<F> {
    /// The decode-step kernels, indexed like `KdaKernel::ALL`.
    pub(crate) kda_step: Vec<F>,
    pub(crate) kda_prefill: F,
    pub(crate) kda_recurrent_wide: F,
    /// The chunked prefill's three phases (kda_chunk_prep, kda_chunk_state,
    /// kda_chunk_out of kda_chunk.hip); None on a device that cannot give
    /// their blocks the shared memory they take (the prefill stays recurrent
    /// there).
    pub(crate) kda_chunk: Option<(F, F, F)>,
    pub(crate) replay_append: F,
    pub(crate) replay_commit: F,
    pub(crate) conv_prefill_out: F,
    pub(crate) conv_prefill_state: F,
    pub(crate) conv_step: F,
    pub(crate) rms_norm: F,
    pub(crate) gated_rms_norm: F,
    pub(crate) mla_attend_f32: F,
    pub(crate) mla_partial_f64: F,
    /// None only under [`SmemPolicy::FallBack`] on a device whose blocks
    /// cannot take their shared memory: the scalar partial runs instead.
    pub(crate) mla_tc: Option<MlaTcFuncs<F>>,
    pub(crate) mla_chunk_merge_f64: F,
    pub(crate) dcp_merge_f32: F,
    pub(crate) dcp_merge_f64: F,
    /// None only under [`SmemPolicy::FallBack`] (its 75 KB of shared
    /// memory): few rows then take matmul_tc32, the same bits.
    pub(crate) matmul_tc16: Option<F>,
    pub(crate) matmul_tc32: F,
    /// None only under [`SmemPolicy::FallBack`] (102 KB): every product
    /// then goes split over k, the same bits.
    pub(crate) matmul_tcb: Option<F>,
    /// matmul_tcb's bits on Hopper's warpgroup products; only in an sm_90a
    /// build (dense.hip), None elsewhere.
    pub(crate) matmul_wg: Option<MatmulWg<F>>,
    pub(crate) matmul_chunk_sum: F,
    pub(crate) matmul_units_sum: F,
    pub(crate) add_units: F,
    pub(crate) silu_mul: F,
    pub(crate) add_inplace: F,
    pub(crate) embedding: F,
    pub(crate) argmax_rows: F,
    pub(crate) fill_f32: F,
    pub(crate) copy_cols: F,
    pub(crate) round_to: F,
    pub(crate) region_gather_b32: F,
    pub(crate) region_scatter_b32: F,
    pub(crate) region_gather_b16: F,
    pub(crate) region_scatter_b16: F,
}

// SAFETY: a kernel handle (CUfunction, hipFunction_t) is an immutable
// reference into a loaded module, valid on any thread while the module is
// loaded (the backend's driver keeps it loaded); it is only passed to
// launches.
unsafe impl<F> Send for Funcs<F> {}
// SAFETY: as above; nothing is written through it.
unsafe impl<F> Sync for Funcs<F> {}

/// What opening does when a kernel cannot be given the shared memory it asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SmemPolicy {
    /// Refuse the backend, naming the kernel (CUDA: every NVIDIA device the
    /// backend targets gives them; the chunked KDA prefill alone falls back).
    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
    Refuse,
    /// Leave the kernel out and take the same-bits alternative (HIP: gfx90a
    /// blocks take 64 KiB, less than the Hopper-sized tiles of the tensor-core
    /// MLA partial, matmul_tc16 and matmul_tcb).
    #[cfg_attr(not(any(feature = "hip", test)), allow(dead_code))]
    FallBack,
}

impl<D: Driver> GpuBackend<D> {
    /// The backend on an opened driver: resolves every kernel of the generic
    /// ops (a missing one is `BackendUnavailable`) and opts the large-tile
    /// kernels into their shared memory (`policy` says what a refusal does).
    pub(crate) fn on_driver(drv: D, device_name: String, ordinal: usize, arch: String, policy: SmemPolicy, memory: MemoryOf<D>) -> Result<Self> {
        let unavailable = |what: &str, e: crate::gpu::launch::DriverFault| KernelError::BackendUnavailable(format!("{}: {what}: {e}", D::NAME));
        let sms = drv.multiprocessors().map_err(|e| unavailable("multiprocessor count", e))?;
        let get = |name: &str| drv.function(name).map_err(|e| unavailable(&format!("kernel {name} missing from the module"), e));
        let mut f = Funcs {
            kda_step: KdaKernel::ALL.iter().map(|k| get(k.kernel_name())).collect::<Result<_>>()?,
            kda_prefill: get("kda_prefill")?,
            kda_recurrent_wide: get("kda_recurrent_wide")?,
            kda_chunk: Some((get("kda_chunk_prep")?, get("kda_chunk_state")?, get("kda_chunk_out")?)),
            replay_append: get("replay_append")?,
            replay_commit: get("replay_commit")?,
            conv_prefill_out: get("conv_prefill_out")?,
            conv_prefill_state: get("conv_prefill_state")?,
            conv_step: get("conv_step")?,
            rms_norm: get("rms_norm")?,
            gated_rms_norm: get("gated_rms_norm")?,
            mla_attend_f32: get("mla_attend_f32")?,
            mla_partial_f64: get("mla_partial_f64")?,
            mla_tc: Some(MlaTcFuncs { tc4: get("mla_partial_tc4")?, tc8: get("mla_partial_tc8")?, tc8_deep: get("mla_partial_tc8_deep")? }),
            mla_chunk_merge_f64: get("mla_chunk_merge_f64")?,
            dcp_merge_f32: get("dcp_merge_f32")?,
            dcp_merge_f64: get("dcp_merge_f64")?,
            matmul_tc16: Some(get("matmul_tc16")?),
            matmul_tc32: get("matmul_tc32")?,
            matmul_tcb: Some(get("matmul_tcb")?),
            matmul_wg: match (drv.function("matmul_wg"), drv.function("mwg_pack_x"), drv.function("mwg_pack_w")) {
                (Ok(product), Ok(pack_x), Ok(pack_w)) => Some(MatmulWg { product, pack_x, pack_w }),
                _ => None,
            },
            matmul_chunk_sum: get("matmul_chunk_sum")?,
            matmul_units_sum: get("matmul_units_sum")?,
            add_units: get("add_units")?,
            silu_mul: get("silu_mul")?,
            add_inplace: get("add_inplace")?,
            embedding: get("embedding")?,
            argmax_rows: get("argmax_rows")?,
            fill_f32: get("fill_f32")?,
            copy_cols: get("copy_cols")?,
            round_to: get("round_to")?,
            region_gather_b32: get("region_gather_b32")?,
            region_scatter_b32: get("region_scatter_b32")?,
            region_gather_b16: get("region_gather_b16")?,
            region_scatter_b16: get("region_scatter_b16")?,
        };
        drv.bind().map_err(|e| unavailable("cannot bind the device", e))?;
        // What a refused opt-in does: Ok(false) leaves the kernel out.
        let keep = |r: Result<()>| -> Result<bool> {
            match (r, policy) {
                (Ok(()), _) => Ok(true),
                (Err(e), SmemPolicy::Refuse) => Err(e),
                (Err(_), SmemPolicy::FallBack) => Ok(false),
            }
        };
        // The tensor-core MLA partials take more than 48 KB of shared memory
        // (two 16-row tiles): opt in, and ask for the largest carveout so two
        // blocks share a multiprocessor.
        if let Some(tc) = f.mla_tc {
            let opt_in = || -> Result<()> {
                for (func, bytes) in [(tc.tc4, mla_tc_smem(4)), (tc.tc8, mla_tc_smem(8)), (tc.tc8_deep, mla_tc_smem_ring(8, MLA_TC_DEEP_RING))] {
                    drv.set_max_dynamic_smem(func, bytes as u32).map_err(|e| unavailable("cannot give the MLA kernel its shared memory", e))?;
                    drv.prefer_shared_carveout(func).map_err(|e| unavailable("cannot set the MLA kernel's shared memory carveout", e))?;
                }
                Ok(())
            };
            if !keep(opt_in())? {
                f.mla_tc = None;
            }
        }
        // The tensor-core matmul stages a whole k chunk of x and w (52 and 75
        // KB, dense.hip): opt in. matmul_tc32 is the one product every device
        // must run, whatever the policy.
        let matmul_smem = |k: D::Func, bytes: u32| drv.set_max_dynamic_smem(k, bytes).map_err(|e| unavailable("cannot give the matmul its shared memory", e));
        if let Some(k) = f.matmul_tc16
            && !keep(matmul_smem(k, dense::tc_smem(16, 128)))?
        {
            f.matmul_tc16 = None;
        }
        matmul_smem(f.matmul_tc32, dense::tc_smem(32, 64))?;
        if let Some(k) = f.matmul_tcb
            && !keep(matmul_smem(k, dense::TCB_SMEM))?
        {
            f.matmul_tcb = None;
        }
        if let Some(wg) = f.matmul_wg
            && !keep(drv.set_max_dynamic_smem(wg.product, dense::MWG_SMEM).map_err(|e| unavailable("cannot give matmul_wg its shared memory", e)))?
        {
            f.matmul_wg = None;
        }
        // The chunked KDA prefill's blocks hold a chunk's 64 x 128 operands in
        // shared memory (97, 145 and 100 KB, kda_chunk.hip): opt in likewise; a
        // device with less per block keeps the recurrent prefill.
        let chunk_ok = f.kda_chunk.is_some_and(|(prep, state, out)| {
            [(prep, KDA_CHUNK_PREP_SMEM), (state, KDA_CHUNK_STATE_SMEM), (out, KDA_CHUNK_OUT_SMEM)]
                .iter()
                .all(|&(func, bytes)| drv.set_max_dynamic_smem(func, bytes).is_ok())
        });
        if !chunk_ok {
            f.kda_chunk = None;
        }
        Ok(GpuBackend {
            drv,
            f: Arc::new(f),
            device_name,
            ordinal,
            arch,
            kda_kernel: DEFAULT_KDA_KERNEL,
            mla_tc: DEFAULT_MLA_TC,
            sms,
            mla_scratch: Arc::new(std::sync::Mutex::new(None)),
            fused: true,
            tcb_min_tiles: None,
            matmul_wg: true,
            memory,
            marker: None,
        })
    }
}
