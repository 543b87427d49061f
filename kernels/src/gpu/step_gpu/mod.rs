//! The fused decode step on a GPU ([`crate::step`], kernels in `hip/step.hip`,
//! `hip/step_mm.hip` and `hip/mla.hip`), written once over the launch seam
//! ([`Driver`]): CUDA (cudarc) and HIP (hip-sys) run the same launch table.
//!
//! Built once per decode process: the weights are packed into the tensor-core
//! layout and uploaded, one workspace is allocated for the largest bucket (the
//! buckets never run at once, so every bucket's graph shares it), and the
//! regions' row addresses go into one table on the device. A step is then the
//! tick upload, one graph replay (or the same launches one by one) and the
//! download of the picks.
//!
//! The launch list is plain data ([`Launch`]): the graph of a bucket is that
//! list captured on the backend's stream, and a step without graphs launches
//! the same list, so the two give the same bits by construction. The kernels
//! it names are [`STEP_KERNELS`] (and the optional st_mm_wg instances of an
//! sm_90a build).

use std::collections::HashMap;

use crate::dtype::StorageDtype;
use crate::error::{KernelError, Result};
use crate::step::{DecodeStep, KernelTime, StepMat, StepMixer, StepRequest, StepSpec, TickBounds, TickLayout, bucket_of, pack_weight, plane_len};

mod graph;
mod launches;
#[cfg(feature = "cuda")]
mod matmul;

#[cfg(test)]
pub(crate) mod tests;

use crate::gpu::launch::{Arena, Arg, Driver, Launch, dev, launch_all};
use launches::*;
#[cfg(feature = "cuda")]
pub(crate) use matmul::tc_matmul;

/// Every kernel the step's launch table can name, but for the st_mm_wg
/// instances that only an sm_90a build has (taken when present). A backend
/// resolves all of them when it opens, so a missing one is a refusal at start.
/// (CUDA resolves them as the step is built, from the program it compiled.)
#[cfg_attr(not(any(feature = "hip", test)), allow(dead_code))]
pub(crate) const STEP_KERNELS: [&str; 17] = [
    "st_embed",
    "st_rms_pack",
    "st_reduce_rms",
    "st_gnorm_pack",
    "st_argmax",
    "st_conv",
    "st_kda",
    "st_cursor",
    "st_mla_prep",
    "st_mla_part",
    "st_mla_part_tc",
    "st_mla_merge",
    "st_mm_few",
    "st_mm",
    "st_mm_w2",
    "st_mm_w2p2",
    "st_reduce",
];

struct Funcs<F> {
    mm: MmFuncs<F>,
    embed: F,
    rms_pack: F,
    reduce_rms: F,
    gnorm_pack: F,
    argmax: F,
    conv: F,
    kda: F,
    cursor: F,
    mla_prep: F,
    mla_part: F,
    mla_part_tc: F,
    mla_merge: F,
}

/// `st_mm`'s kernel for a product over `m` (> 16) rows with `terms` products a
/// k-step: (weight planes, chunks in flight, dynamic shared memory). A buffer
/// holds one chunk of ST_KC (4) k-steps: the A tiles of up to 8 row tiles
/// (two planes when `terms` >= 2) and 8 column tiles' weight tiles; chunks in flight
/// + 1 buffers, three in flight unless four buffers would not fit.
fn mm_shape(m: usize, terms: i32) -> (usize, usize, u32) {
    let (planes_a, wp) = (if terms >= 2 { 2 } else { 1 }, if terms == 3 { 2 } else { 1 });
    let buf = (planes_a * m.div_ceil(16).min(8) + 8 * wp) * 4 * 512;
    let p = if 4 * buf <= MM_SMEM_MAX as usize { 3 } else { 2 };
    (wp, p, ((p + 1) * buf) as u32)
}

/// st_mm's block (ST_MM_THREADS of step_mm.hip): 16 warps, two a column tile.
const ST_MM_THREADS: u32 = 512;
/// st_mm_wg's block (ST_WG_THREADS of step_mm.hip): two warpgroups.
const ST_WG_THREADS: u32 = 256;
/// The dynamic shared memory st_mm's kernels may use, opted in at build: an
/// sm_90 block may have 227 KiB in all, static (st_last_finish's flag) and
/// dynamic together, so 1 KiB stays free of the dynamic part.
const MM_SMEM_MAX: u32 = 226 * 1024;
/// MLA_TC_SMEM_RING(8, 2, MLA_PG_RING) of mla.hip: the shared memory of
/// st_mla_part_tc, the scores' scratch and a ring of MLA_PG_RING (4) tiles of
/// 16 16-bit rows (85,312 bytes: two blocks a multiprocessor).
const MLA_TC_SMEM8: u32 = (((8 * 8 + 8) * 20 + 8) * 8 + 4 * 16 * 576 * 2) as u32;

/// The fused decode step on one GPU, through driver `D`.
pub(crate) struct GpuStep<D: Driver> {
    /// The device, its stream and modules (the launch lists' kernel handles
    /// stay valid while it lives).
    drv: D,
    _arena: Arena<D>,
    lists: HashMap<usize, Vec<Launch<D::Func>>>,
    graphs: HashMap<usize, D::Graph>,
    graphs_on: bool,
    /// Each launch but a list's first as a programmatic dependent of the one
    /// before ([`Driver::launch_dependent`]), where the device has it.
    dependent: bool,
    /// Why graphs are off after a failed capture (said once in the log).
    graph_failure: Option<String>,
    buckets: Vec<usize>,
    lay: TickLayout,
    tick_host: Vec<i32>,
    tick_dev: u64,
    ids_dev: u64,
    logits_dev: u64,
    ids_host: Vec<i32>,
    vocab: usize,
    bounds: TickBounds,
    weight_bytes: u64,
}

// SAFETY: the raw kernel handles in the launch lists belong to the modules the
// step's driver keeps loaded, and its graphs (cudarc's are not Send) are only
// touched through `&mut GpuStep`: the step is used by one thread at a time.
unsafe impl<D: Driver> Send for GpuStep<D> {}

fn dt_code(d: StorageDtype) -> i32 {
    match d {
        StorageDtype::F32 => 0,
        StorageDtype::Bf16 => 1,
        StorageDtype::F16 => 2,
    }
}

/// st_kda's dynamic shared memory in floats for `nw` warps and a ring of
/// `cap` records (hip/step.hip's layout): two sets of an item's inputs (the
/// item computed and the next one in flight: its S_0 tile, its ring records,
/// q, k, g, dt_bias and value columns), then E, the warps' partial sums, the
/// norms, the rebuild's decay and the table of the block's items.
fn kda_smem_floats(nw: usize, cap: usize) -> usize {
    const TILE: usize = 64;
    const RC: usize = 16; // ST_KDA_RC
    const META: usize = 32; // ST_KDA_META
    let kpad = 16 * nw;
    let rcp = if cap > 0 { (cap - 1).min(RC) } else { 0 };
    let per_set = kpad * TILE + rcp * (2 * kpad + TILE) + 4 * kpad + TILE;
    // al, part1 + part2, red, stot; then S and rec0 (two u64 each), n, beta, rate.
    2 * per_set + kpad + 2 * nw * TILE + 2 * nw + kpad + META * (4 + 3)
}

fn r16(x: usize) -> usize {
    x.next_multiple_of(16)
}

impl<D: Driver> GpuStep<D> {
    pub(crate) fn new(drv: D, spec: &StepSpec) -> Result<GpuStep<D>> {
        spec.check()?;
        let op = "decode_step";
        let get = |name: &str| drv.function(name).map_err(|e| KernelError::BackendUnavailable(format!("{}: kernel {name} missing: {e}", D::NAME)));
        let f = Funcs {
            mm: MmFuncs::load(&drv)?,
            embed: get("st_embed")?,
            rms_pack: get("st_rms_pack")?,
            reduce_rms: get("st_reduce_rms")?,
            gnorm_pack: get("st_gnorm_pack")?,
            argmax: get("st_argmax")?,
            conv: get("st_conv")?,
            kda: get("st_kda")?,
            cursor: get("st_cursor")?,
            mla_prep: get("st_mla_prep")?,
            mla_part: get("st_mla_part")?,
            mla_part_tc: get("st_mla_part_tc")?,
            mla_merge: get("st_mla_merge")?,
        };
        drv.set_max_dynamic_smem(f.mla_part_tc, MLA_TC_SMEM8)
            .map_err(|e| KernelError::BackendUnavailable(format!("{}: cannot give st_mla_part_tc {MLA_TC_SMEM8} bytes of shared memory: {e}", D::NAME)))?;
        let m = &spec.model;
        let p = &spec.place;
        let bmax = spec.options.max_batch;
        let mp = r16(bmax);
        let wd = m.weights;
        let mut arena = Arena::new(drv.clone());

        // ---- weights ------------------------------------------------------
        let pack = |arena: &mut Arena<D>, mat: &StepMat| -> Result<DevMat> {
            let data = pack_weight(mat, wd);
            let addr = arena.upload(&data)?;
            Ok(DevMat {
                addr,
                groups: mat.groups,
                kt: mat.kt(),
                nt: mat.nt(),
                cols: mat.cols,
                segments: mat.segments,
                unit: mat.unit(),
                unit_padded: mat.unit_padded(),
                plane: plane_len(mat),
                planes: wd.planes(),
            })
        };
        let embed = arena.upload(&m.embed)?;
        let final_norm = arena.upload(&m.final_norm)?;
        let lm_head = pack(&mut arena, &m.lm_head)?;
        enum LayerDev {
            Kda { in_proj: DevMat, conv: u64, a_log: u64, dt_bias: u64, onorm: u64, wo: DevMat },
            Mla { in_proj: DevMat, kv_norm: u64, wuk: DevMat, wuv: DevMat, wo: DevMat },
        }
        struct Layer {
            attn_norm: u64,
            mlp_norm: u64,
            mixer: LayerDev,
            gate_up: DevMat,
            down: DevMat,
        }
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in &m.layers {
            let mixer = match &l.mixer {
                StepMixer::Kda(k) => LayerDev::Kda {
                    in_proj: pack(&mut arena, &k.in_proj)?,
                    conv: arena.upload(&k.conv)?,
                    a_log: arena.upload(&k.a_log)?,
                    dt_bias: arena.upload(&k.dt_bias)?,
                    onorm: arena.upload(&k.onorm)?,
                    wo: pack(&mut arena, &k.wo)?,
                },
                StepMixer::Mla(a) => LayerDev::Mla {
                    in_proj: pack(&mut arena, &a.in_proj)?,
                    kv_norm: arena.upload(&a.kv_norm)?,
                    wuk: pack(&mut arena, &a.wuk)?,
                    wuv: pack(&mut arena, &a.wuv)?,
                    wo: pack(&mut arena, &a.wo)?,
                },
            };
            layers.push(Layer {
                attn_norm: arena.upload(&l.attn_norm)?,
                mlp_norm: arena.upload(&l.mlp_norm)?,
                mixer,
                gate_up: pack(&mut arena, &l.gate_up)?,
                down: pack(&mut arena, &l.down)?,
            });
        }
        let weight_bytes = arena.bytes;

        // ---- the regions' row addresses, one table ------------------------
        let tp = p.tp;
        let mut table: Vec<u64> = Vec::new();
        let mut kda_rows = Vec::new(); // per layer: offset of [3][tp] and of conv [tp]
        let mut mla_rows = Vec::new();
        let mut cursor_rows: Vec<u64> = Vec::new();
        for (i, l) in m.layers.iter().enumerate() {
            match l.mixer {
                StepMixer::Kda(_) => {
                    let at = table.len();
                    for rk in &p.ranks {
                        table.push(rk.state.row(i)?);
                    }
                    for rk in &p.ranks {
                        table.push(rk.ring.as_ref().map(|x| x.row(i)).transpose()?.unwrap_or(0));
                    }
                    for rk in &p.ranks {
                        let c = rk.cursor.as_ref().map(|x| x.row(i)).transpose()?.unwrap_or(0);
                        table.push(c);
                        if m.replay > 0 {
                            cursor_rows.push(c);
                        }
                    }
                    let conv_at = table.len();
                    for rk in &p.ranks {
                        table.push(rk.conv.row(i)?);
                    }
                    kda_rows.push((i, at, conv_at));
                }
                StepMixer::Mla(_) => {
                    let at = table.len();
                    for rk in &p.ranks {
                        table.push(rk.mla.row(i)?);
                    }
                    mla_rows.push((i, at));
                }
            }
        }
        let cursor_at = table.len();
        table.extend_from_slice(&cursor_rows);
        let table_dev = arena.upload(&table)?;
        let tab = |at: usize| table_dev + 8 * at as u64;

        // ---- workspace (largest bucket) ------------------------------------
        let (d, v, inter) = (m.hidden, m.vocab, m.intermediate);
        let (h, dk, dv) = (m.kda_heads, m.dk, m.dv);
        let c = h * (2 * dk + dv);
        let (hm, ll, rr, dn) = (m.mla_heads, m.kv_lora_rank, m.rope_dim, m.nope_dim);
        let w_row = ll + rr;
        let has_mla = m.layers.iter().any(|l| matches!(l.mixer, StepMixer::Mla(_)));
        let planes_a = 2usize; // activations: x_hi, x_lo
        let mut all_mats: Vec<DevMat> = vec![lm_head];
        let mut proj_n = 0usize;
        for l in &layers {
            all_mats.push(l.gate_up);
            all_mats.push(l.down);
            match &l.mixer {
                LayerDev::Kda { in_proj, wo, .. } => {
                    all_mats.extend([*in_proj, *wo]);
                    proj_n = proj_n.max(in_proj.cols);
                }
                LayerDev::Mla { in_proj, wuk, wuv, wo, .. } => {
                    all_mats.extend([*in_proj, *wuk, *wuv, *wo]);
                    proj_n = proj_n.max(in_proj.cols);
                }
            }
        }
        let part_len = all_mats.iter().map(|w| w.segments * w.groups * mp * w.nt * 16).max().unwrap_or(0);
        // One counter a (group, column block) of the widest few-row product.
        let counters_len = all_mats.iter().map(|w| mm_counters(w.nt, w.groups)).max().unwrap_or(1);
        // The widest A operand any product reads (inner dimensions padded).
        let k_max = all_mats.iter().filter(|w| w.groups == 1).map(|w| w.kt * 16).max().unwrap_or(16);
        let dkt = lm_head.kt; // every product of a normed hidden state: [hidden, *]
        let (mut qkt, mut okt) = (1usize, 1usize); // W_UK, W_UV inner tiles
        for l in &layers {
            if let LayerDev::Mla { wuk, wuv, .. } = &l.mixer {
                qkt = wuk.kt;
                okt = wuv.kt;
            }
        }
        let h_buf = arena.alloc(mp * d * 4)?;
        let a_in = arena.alloc(planes_a * mp * k_max * 2)?;
        let a_mid = arena.alloc(planes_a * mp * k_max * 2)?;
        let proj = arena.alloc(mp * proj_n.max(1) * 4)?;
        let part = arena.alloc(part_len * 4)?;
        let counters = arena.alloc(counters_len * 4)?;
        let cv = arena.alloc(mp * c.max(1) * 4)?;
        let o_buf = arena.alloc(mp * (h * dv).max(1) * 4)?;
        let q_lat = arena.alloc(mp * (hm * w_row).max(1) * 4)?;
        let aq = arena.alloc(hm.max(1) * planes_a * mp * qkt * 16 * 2)?;
        let ao = arena.alloc(hm.max(1) * planes_a * mp * okt * 16 * 2)?;
        let maxc = spec.max_chunks();
        let chunk = StepSpec::MLA_CHUNK;
        let parts = if has_mla { arena.alloc(bmax * hm * p.dcp * maxc * (ll + 2) * 8)? } else { 0 };
        let logits_dev = arena.alloc(mp * v * 4)?;
        let ids_dev = arena.alloc(mp * 4)?;
        let lay = spec.tick_layout();
        let tick_dev = arena.alloc(lay.len() * 4)?;
        drv.synchronize().map_err(dev(op))?;

        // ---- kernel attributes ----------------------------------------------
        let kda_nw = dk.div_ceil(16);
        let kda_threads = (kda_nw * 32) as u32;
        let kda_smem = (kda_smem_floats(kda_nw, m.replay) * 4) as u32;
        // st_kda is persistent: two blocks a multiprocessor (its launch bounds)
        // walk the items.
        let sms = drv.multiprocessors().map_err(dev(op))?;
        if kda_smem > 48 * 1024 {
            drv.set_max_dynamic_smem(f.kda, kda_smem)
                .map_err(|e| KernelError::InvalidShape { op, reason: format!("the KDA step needs {kda_smem} bytes of shared memory: {e}") })?;
            // The largest carveout, so that two blocks share a multiprocessor.
            drv.prefer_shared_carveout(f.kda)
                .map_err(|e| KernelError::InvalidShape { op, reason: format!("cannot set the KDA step's shared memory carveout: {e}") })?;
        }
        // The tensor-core MLA partial: K3's rows in 16-bit, 8 heads of one TP group a block.
        let mla_tc = ll == 512 && rr == 64 && ((hm / tp.max(1)) * p.dcp).is_multiple_of(8) && m.cache != StorageDtype::F32;
        let mla_nw = 8usize;
        let mla_smem = ((w_row + mla_nw * ll + 2 * mla_nw) * 8) as u32;
        if mla_smem > 48 * 1024 {
            drv.set_max_dynamic_smem(f.mla_part, mla_smem)
                .map_err(|e| KernelError::InvalidShape { op, reason: format!("MLA rows of {w_row} need {mla_smem} bytes of shared memory: {e}") })?;
        }

        // ---- the launch list of each bucket ------------------------------------
        let eps = m.eps;
        let terms = wd.terms() as i32;
        let dt = dt_code(m.cache);
        let hl = h / tp.max(1);
        let hg = (hm / tp.max(1)) * p.dcp;
        let state_stride = p.ranks[0].state.unit_stride as i64;
        let conv_stride = p.ranks[0].conv.unit_stride as i64;
        let ring_stride = p.ranks[0].ring.as_ref().map_or(0, |r| r.unit_stride) as i64;
        let cursor_stride = p.ranks[0].cursor.as_ref().map_or(0, |r| r.unit_stride) as i64;
        let mla_stride = p.ranks[0].mla.unit_stride as i64;
        let ew = |n: usize| -> (u32, u32, u32) { (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1) };
        let buckets = spec.buckets();
        let mut lists = HashMap::new();
        for &bp in &buckets {
            let mut list: Vec<Launch<D::Func>> = Vec::new();
            // One product over bp rows: A (packed, k tiles w.kt) times w, the
            // segment sum and what `epi` says, in one launch (the last block
            // of a column group sums the segments, in the same order for any
            // number of rows).
            let gemm = |list: &mut Vec<Launch<D::Func>>, name: &'static str, a: u64, w: &DevMat, epi: Epi| {
                let a_plane = (mp * w.kt * 16 / 8) as i64; // uint4 units
                let a_group = planes_a as i64 * a_plane;
                let w_plane = (w.plane / 8) as i64;
                let w_group = w.planes as i64 * w_plane;
                let ldp = w.nt * 16;
                let part_group = (mp * ldp) as i64;
                let part_seg = w.groups as i64 * part_group;
                let (mode, ncols, out, ldo, gcol, apack, akt, uw, uwp) = match epi {
                    Epi::Store { out, ldo, gcol } => (0, w.cols, out, ldo, gcol, 0, 1, 1, 1),
                    Epi::Resid { out, ldo } => (1, w.cols, out, ldo, 0, 0, 1, 1, 1),
                    Epi::Swiglu { a, akt, uw, uwp, n } => (2, n, 0, 0, 0, a, akt, uw, uwp),
                    Epi::Pack { a, akt, gcol } => (3, w.cols, 0, 0, gcol, a, akt, 1, 1),
                };
                let operands = [
                    Arg::P(a),
                    Arg::L(a_plane),
                    Arg::L(a_group),
                    Arg::P(w.addr),
                    Arg::L(w_plane),
                    Arg::L(w_group),
                    Arg::P(part),
                    Arg::L(part_seg),
                    Arg::L(part_group),
                    Arg::I(ldp as i32),
                ];
                let shape = [Arg::I(bp as i32), Arg::I(w.nt as i32), Arg::I(w.kt as i32), Arg::I(w.segments as i32), Arg::I(terms)];
                let epilogue = [
                    Arg::I(mode),
                    Arg::I(ncols as i32),
                    Arg::P(out),
                    Arg::I(ldo as i32),
                    Arg::I(gcol as i32),
                    Arg::P(apack),
                    Arg::L((mp * akt * 16) as i64),
                    Arg::I(akt as i32),
                    Arg::I(uw as i32),
                    Arg::I(uwp as i32),
                ];
                let mut args = operands.to_vec();
                args.push(Arg::P(counters));
                args.extend(shape);
                args.extend(epilogue);
                list.extend(f.mm.launches(name, bp, w.nt, w.segments, w.groups, terms, args));
            };
            // The norm's arguments after the row source, as st_rms_pack and
            // st_reduce_rms both take them: weight, packed operand and its
            // plane, planes, width, k tiles, eps.
            let norm = |w: u64, a: u64| {
                [Arg::P(w), Arg::P(a), Arg::L((mp * dkt * 16) as i64), Arg::I(planes_a as i32), Arg::I(d as i32), Arg::I(dkt as i32), Arg::F(eps)]
            };
            let rms_pack = |list: &mut Vec<Launch<D::Func>>, w: u64, a: u64| {
                // After a product into the residual (o_proj, down) whose
                // segments st_reduce adds (more than 16 rows): that sum and
                // this norm as one launch, st_reduce_rms (the same bits).
                if let Some(last) = list.last().filter(|l| l.name == "st_reduce") {
                    // st_reduce's arguments (launches.rs): part, part_seg,
                    // part_group, ldp, M, ncols, S, G, mode, out, ldo, ...
                    let r = &last.args;
                    if r[7] == Arg::I(1) && r[8] == Arg::I(1) && r[9] == Arg::P(h_buf) && r[10] == Arg::I(d as i32) && r[5] == Arg::I(d as i32) {
                        let mut args = vec![r[0], r[1], r[3], r[5], r[6], Arg::P(h_buf)];
                        args.extend(norm(w, a));
                        list.pop();
                        list.push(Launch { f: f.reduce_rms, name: "st_reduce_rms", grid: (bp as u32, 1, 1), block: 256, smem: 0, args });
                        return;
                    }
                }
                list.push(Launch {
                    f: f.rms_pack,
                    name: "st_rms_pack",
                    grid: (bp as u32, 1, 1),
                    block: 256,
                    smem: 0,
                    args: [Arg::P(h_buf)].into_iter().chain(norm(w, a)).collect(),
                });
            };
            list.push(Launch {
                f: f.embed,
                name: "st_embed",
                grid: (bp as u32, 1, 1),
                block: 256,
                smem: 0,
                args: vec![Arg::P(embed), Arg::P(tick_dev), Arg::I(lay.tok() as i32), Arg::P(h_buf), Arg::I(d as i32), Arg::I(v as i32)],
            });
            let (mut ki, mut mi) = (0usize, 0usize);
            for l in layers.iter() {
                rms_pack(&mut list, l.attn_norm, a_in);
                match &l.mixer {
                    LayerDev::Kda { in_proj, conv, a_log, dt_bias, onorm, wo } => {
                        let (_, at, conv_at) = kda_rows[ki];
                        ki += 1;
                        let n_in = in_proj.cols;
                        gemm(&mut list, "mm kda.in", a_in, in_proj, Epi::Store { out: proj, ldo: n_in, gcol: 0 });
                        list.push(Launch {
                            f: f.conv,
                            name: "st_conv",
                            grid: (c.div_ceil(256) as u32, bp as u32, 1),
                            block: 256,
                            smem: 0,
                            args: vec![
                                Arg::P(proj),
                                Arg::I(n_in as i32),
                                Arg::P(*conv),
                                Arg::P(tick_dev),
                                Arg::I(lay.slot() as i32),
                                Arg::I(tp as i32),
                                Arg::P(tab(conv_at)),
                                Arg::L(conv_stride),
                                Arg::I(dt),
                                Arg::P(cv),
                                Arg::I(bmax as i32),
                                Arg::I(h as i32),
                                Arg::I(hl as i32),
                                Arg::I(dk as i32),
                                Arg::I(dv as i32),
                                Arg::I(m.conv as i32),
                            ],
                        });
                        list.push(Launch {
                            f: f.kda,
                            name: "st_kda",
                            grid: ((bp * h * dv.div_ceil(64)).min(2 * sms) as u32, 1, 1),
                            block: kda_threads,
                            smem: kda_smem,
                            args: vec![
                                Arg::P(cv),
                                Arg::P(proj),
                                Arg::I(n_in as i32),
                                Arg::I(c as i32),
                                Arg::I((c + h * dk) as i32),
                                Arg::P(*a_log),
                                Arg::P(*dt_bias),
                                Arg::P(o_buf),
                                Arg::P(tick_dev),
                                Arg::I(lay.slot() as i32),
                                Arg::I(tp as i32),
                                Arg::P(tab(at)),
                                Arg::L(state_stride),
                                Arg::L(ring_stride),
                                Arg::L(cursor_stride),
                                Arg::I(h as i32),
                                Arg::I(hl as i32),
                                Arg::I(dk as i32),
                                Arg::I(dv as i32),
                                Arg::I(m.replay as i32),
                            ],
                        });
                        list.push(Launch {
                            f: f.gnorm_pack,
                            name: "st_gnorm_pack",
                            grid: ((bp * h) as u32, 1, 1),
                            block: 128,
                            smem: 0,
                            args: vec![
                                Arg::P(o_buf),
                                Arg::P(proj),
                                Arg::I(n_in as i32),
                                Arg::I((c + h * dk + h) as i32),
                                Arg::P(*onorm),
                                Arg::P(a_mid),
                                Arg::L((mp * wo.kt * 16) as i64),
                                Arg::I(planes_a as i32),
                                Arg::I(h as i32),
                                Arg::I(dv as i32),
                                Arg::I(wo.unit_padded as i32),
                                Arg::F(eps),
                            ],
                        });
                        gemm(&mut list, "mm kda.o", a_mid, wo, Epi::Resid { out: h_buf, ldo: d });
                    }
                    LayerDev::Mla { in_proj, kv_norm, wuk, wuv, wo } => {
                        let (_, at) = mla_rows[mi];
                        mi += 1;
                        let n_in = in_proj.cols;
                        gemm(&mut list, "mm mla.in", a_in, in_proj, Epi::Store { out: proj, ldo: n_in, gcol: 0 });
                        list.push(Launch {
                            f: f.mla_prep,
                            name: "st_mla_prep",
                            grid: (bp as u32, 1, 1),
                            block: 256,
                            smem: 0,
                            args: vec![
                                Arg::P(proj),
                                Arg::I(n_in as i32),
                                Arg::P(*kv_norm),
                                Arg::I(ll as i32),
                                Arg::I(rr as i32),
                                Arg::I(hm as i32),
                                Arg::I(dn as i32),
                                Arg::F(eps),
                                Arg::I(dt),
                                Arg::P(tick_dev),
                                Arg::I(lay.pos() as i32),
                                Arg::I(lay.blk() as i32),
                                Arg::I(lay.maxblk as i32),
                                Arg::I(bmax as i32),
                                Arg::I(tp as i32),
                                Arg::I(p.dcp as i32),
                                Arg::I(p.interleave as i32),
                                Arg::I(p.block_size as i32),
                                Arg::P(tab(at)),
                                Arg::L(mla_stride),
                                Arg::I(p.token_bytes as i32),
                                Arg::P(q_lat),
                                Arg::P(aq),
                                Arg::L((mp * wuk.kt * 16) as i64),
                                Arg::L((planes_a * mp * wuk.kt * 16) as i64),
                                Arg::I(planes_a as i32),
                                Arg::I(wuk.kt as i32),
                            ],
                        });
                        // q_lat[:, h, :L] = q_nope_h . W_UK[h]
                        gemm(&mut list, "mm mla.wuk", aq, wuk, Epi::Store { out: q_lat, ldo: hm * w_row, gcol: w_row });
                        let tick_args = [
                            Arg::P(q_lat),
                            Arg::P(tick_dev),
                            Arg::I(lay.pos() as i32),
                            Arg::I(lay.blk() as i32),
                            Arg::I(lay.maxblk as i32),
                            Arg::I(bmax as i32),
                            Arg::I(p.dcp as i32),
                            Arg::I(p.interleave as i32),
                            Arg::I(p.block_size as i32),
                            Arg::I(hg as i32),
                            Arg::P(tab(at)),
                            Arg::L(mla_stride),
                            Arg::I(p.token_bytes as i32),
                            Arg::I(dt),
                            Arg::P(parts),
                            Arg::I(maxc as i32),
                            Arg::I(chunk as i32),
                            Arg::I(hm as i32),
                        ];
                        if mla_tc {
                            let mut args = tick_args.to_vec();
                            args.push(Arg::D(m.mla_scale as f64));
                            list.push(Launch {
                                f: f.mla_part_tc,
                                name: "st_mla_part_tc",
                                // Grid-stride over the possible chunks (st_mla_part_tc): two
                                // blocks a multiprocessor's worth, both resident.
                                grid: ((bp * p.dcp * maxc).min((2 * sms).div_ceil(hm / 8)) as u32, (hm / 8) as u32, 1),
                                block: 256,
                                smem: MLA_TC_SMEM8,
                                args,
                            });
                        } else {
                            let mut args = tick_args.to_vec();
                            args.extend([Arg::I(ll as i32), Arg::I(w_row as i32), Arg::D(m.mla_scale as f64)]);
                            list.push(Launch {
                                f: f.mla_part,
                                name: "st_mla_part",
                                grid: ((bp * p.dcp * maxc) as u32, hm as u32, 1),
                                block: (mla_nw * 32) as u32,
                                smem: mla_smem,
                                args,
                            });
                        }
                        list.push(Launch {
                            f: f.mla_merge,
                            name: "st_mla_merge",
                            grid: ((bp * hm) as u32, 1, 1),
                            block: 128,
                            smem: 0,
                            args: vec![
                                Arg::P(parts),
                                Arg::P(tick_dev),
                                Arg::I(lay.pos() as i32),
                                Arg::I(p.dcp as i32),
                                Arg::I(p.interleave as i32),
                                Arg::I(maxc as i32),
                                Arg::I(chunk as i32),
                                Arg::I(hm as i32),
                                Arg::I(ll as i32),
                                Arg::P(ao),
                                Arg::L((mp * wuv.kt * 16) as i64),
                                Arg::L((planes_a * mp * wuv.kt * 16) as i64),
                                Arg::I(planes_a as i32),
                                Arg::I(wuv.kt as i32),
                            ],
                        });
                        // y[:, h * dvh ..] = o_lat_h . W_UV[h], packed for o_proj (a head a unit).
                        gemm(&mut list, "mm mla.wuv", ao, wuv, Epi::Pack { a: a_mid, akt: wo.kt, gcol: wo.unit_padded });
                        gemm(&mut list, "mm mla.o", a_mid, wo, Epi::Resid { out: h_buf, ldo: d });
                    }
                }
                rms_pack(&mut list, l.mlp_norm, a_in);
                let dn_ = &l.down;
                gemm(&mut list, "mm mlp.gate_up", a_in, &l.gate_up, Epi::Swiglu { a: a_mid, akt: dn_.kt, uw: dn_.unit, uwp: dn_.unit_padded, n: inter });
                gemm(&mut list, "mm mlp.down", a_mid, &l.down, Epi::Resid { out: h_buf, ldo: d });
            }
            rms_pack(&mut list, final_norm, a_in);
            gemm(&mut list, "mm lm_head", a_in, &lm_head, Epi::Store { out: logits_dev, ldo: v, gcol: 0 });
            list.push(Launch {
                f: f.argmax,
                name: "st_argmax",
                grid: (bp as u32, 1, 1),
                block: 256,
                smem: 0,
                args: vec![Arg::P(logits_dev), Arg::I(v as i32), Arg::P(ids_dev)],
            });
            if m.replay > 0 {
                let nk = cursor_rows.len() / tp.max(1);
                list.push(Launch {
                    f: f.cursor,
                    name: "st_cursor",
                    grid: ew(bp * tp * nk),
                    block: 256,
                    smem: 0,
                    args: vec![
                        Arg::P(tick_dev),
                        Arg::I(lay.slot() as i32),
                        Arg::I(tp as i32),
                        Arg::P(tab(cursor_at)),
                        Arg::I(nk as i32),
                        Arg::L(cursor_stride),
                        Arg::I(m.replay as i32),
                    ],
                });
            }
            lists.insert(bp, list);
        }
        let slots = p.ranks[0].state.units;
        let blocks = p.ranks[0].mla.units;
        let drv_dependent = drv.dependent_launch();
        Ok(GpuStep {
            drv,
            _arena: arena,
            lists,
            graphs: HashMap::new(),
            graphs_on: spec.options.graphs,
            dependent: spec.options.dependent_launch && drv_dependent,
            graph_failure: None,
            buckets,
            lay,
            tick_host: vec![0; lay.len()],
            tick_dev,
            ids_dev,
            logits_dev,
            ids_host: vec![0; mp],
            vocab: v,
            bounds: TickBounds { vocab: v, max_context: p.max_context, slots, blocks },
            weight_bytes,
        })
    }
}
