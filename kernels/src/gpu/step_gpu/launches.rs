//! The products' launches (st_mm_few, st_mm, st_mm_wg, st_reduce), as rows
//! of the launch table.

use super::*;

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
pub(super) struct MmFuncs<F> {
    pub(super) few: F,
    pub(super) one: F,
    pub(super) two: F,
    pub(super) two_p2: F,
    pub(super) reduce: F,
    /// Hopper's warpgroup products (st_mm_wg<NB>_<WP>, 17 to 128 rows), in
    /// [`WG_ROWS`] order, one plane then two; absent where the module was not
    /// built for sm_90a.
    pub(super) wg: Option<Vec<F>>,
}

/// The row blocks of st_mm_wg's instances (a product takes the smallest that
/// holds its rows).
const WG_ROWS: [usize; 4] = [32, 64, 96, 128];

/// st_mm_wg's ring for `wp` weight planes: k-steps a chunk and chunks in
/// flight (step_mm.hip's ST_WG_KC(WP) and ST_WG_D(WP)).
fn wg_ring(wp: usize) -> (usize, usize) {
    if wp == 1 { (8, 1) } else { (2, 2) }
}

/// st_mm_wg's dynamic shared memory for `nb` rows, `wp` weight planes and
/// `terms`: ST_WG_D + 1 buffers of ST_WG_KC k-steps.
fn wg_smem(nb: usize, wp: usize, terms: i32) -> u32 {
    let ((kc, d), planes) = (wg_ring(wp), if terms >= 2 { 2 } else { 1 });
    ((d + 1) * kc * (8 * wp * 512 + planes * nb * 32)) as u32
}

impl<F: Copy> MmFuncs<F> {
    pub(super) fn load<D: Driver<Func = F>>(drv: &D) -> Result<MmFuncs<F>> {
        let get = |name: &str| drv.function(name).map_err(|e| KernelError::BackendUnavailable(format!("{}: kernel {name} missing: {e}", D::NAME)));
        // Either every warpgroup instance is in the module or none is.
        let wg = [1, 2]
            .iter()
            .flat_map(|wp| WG_ROWS.iter().map(move |nb| format!("st_mm_wg{nb}_{wp}")))
            .map(|name| drv.function(&name).ok())
            .collect::<Option<Vec<_>>>();
        if let Some(list) = &wg {
            for (i, &func) in list.iter().enumerate() {
                // The most it takes: activations in two planes.
                let (wp, nb) = (1 + i / WG_ROWS.len(), WG_ROWS[i % WG_ROWS.len()]);
                drv.set_max_dynamic_smem(func, wg_smem(nb, wp, 2))
                    .map_err(|e| KernelError::BackendUnavailable(format!("{}: cannot give st_mm_wg its shared memory: {e}", D::NAME)))?;
            }
        }
        let f = MmFuncs { few: get("st_mm_few")?, one: get("st_mm")?, two: get("st_mm_w2")?, two_p2: get("st_mm_w2p2")?, reduce: get("st_reduce")?, wg };
        for (func, what) in [(f.one, "st_mm"), (f.two, "st_mm_w2"), (f.two_p2, "st_mm_w2p2")] {
            drv.set_max_dynamic_smem(func, MM_SMEM_MAX)
                .map_err(|e| KernelError::BackendUnavailable(format!("{}: cannot give {what} {MM_SMEM_MAX} bytes of shared memory: {e}", D::NAME)))?;
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
    pub(super) fn launches(&self, name: &'static str, m: usize, nt: usize, segments: usize, groups: usize, terms: i32, args: Vec<Arg>) -> Vec<Launch<F>> {
        let gy = (segments * groups) as u32;
        if m <= 16 {
            return vec![Launch { f: self.few, name, grid: (nt.div_ceil(4) as u32, gy, 1), block: 128, smem: 0, args }];
        }
        let (wp, p, smem) = mm_shape(m, terms);
        // 17 to 128 rows on Hopper: the warpgroup product (the same bits,
        // cuda_check holds them against st_mm's), else st_mm.
        let wg = self.wg.as_ref().and_then(|list| {
            let at = WG_ROWS.iter().position(|&nb| m <= nb)?;
            Some((list[(wp - 1) * WG_ROWS.len() + at], WG_ROWS[at]))
        });
        let (f, grid, block, smem) = match (wg, wp, p) {
            (Some((f, nb)), _, _) => (f, (nt.div_ceil(8) as u32, gy, m.div_ceil(nb) as u32), ST_WG_THREADS, wg_smem(nb, wp, terms)),
            (None, 1, _) => (self.one, (nt.div_ceil(8) as u32, gy, m.div_ceil(128) as u32), ST_MM_THREADS, smem),
            (None, _, 3) => (self.two, (nt.div_ceil(8) as u32, gy, m.div_ceil(128) as u32), ST_MM_THREADS, smem),
            _ => (self.two_p2, (nt.div_ceil(8) as u32, gy, m.div_ceil(128) as u32), ST_MM_THREADS, smem),
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
            Launch { f, name, grid, block, smem, args },
            // One block row a (group, row); past the y limit the kernel strides.
            Launch {
                f: self.reduce,
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

#[cfg(test)]
mod ring_tests {
    use super::wg_ring;

    /// The value step_mm.hip's `#define NAME(WP) ((WP) == 1 ? A : B)` gives
    /// for `wp`.
    fn per_plane(name: &str, wp: usize) -> usize {
        let src = crate::gpu::HIP_SOURCES.iter().find(|(n, _)| *n == "step_mm.hip").expect("step_mm.hip").1;
        let line = src.lines().find_map(|l| l.trim().strip_prefix(&format!("#define {name}(WP) "))).unwrap_or_else(|| panic!("#define {name}(WP)"));
        let body = line.trim().trim_start_matches("((WP) == 1 ? ").trim_end_matches(')');
        let (one, two) = body.split_once(" : ").unwrap_or_else(|| panic!("{name}: {line}"));
        let v = if wp == 1 { one } else { two };
        v.trim().parse().unwrap_or_else(|_| panic!("{name}: {line}"))
    }

    /// The shared memory the Rust side gives st_mm_wg is the ring the kernel
    /// was compiled with: too little faults, too much keeps a second block
    /// off a multiprocessor.
    #[test]
    fn the_warpgroup_ring_is_the_kernels() {
        for wp in [1, 2] {
            assert_eq!(wg_ring(wp), (per_plane("ST_WG_KC", wp), per_plane("ST_WG_D", wp)), "wp = {wp}");
        }
    }
}
