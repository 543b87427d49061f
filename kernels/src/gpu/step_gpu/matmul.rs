//! The step's tensor-core product alone (`cuda_check`).

use super::*;

/// The step's tensor-core product on its own, for checks and timings
/// (`cuda_check`): `x` `[m, w.inner]` (row-major f32) times `w` with `terms`
/// products a k-step (1: x rounded to bf16, as a plain bf16 matmul; 2 and 3 as
/// the model runs them), the segments summed in the same launch. Returns the
/// product `[m, w.cols]` and the mean device time of `reps` runs in
/// microseconds (partials and sum; events around back-to-back runs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tc_matmul<D: Driver>(
    drv: &D,
    x: &[f32],
    m: usize,
    w: &StepMat,
    dtype: crate::step::WeightDtype,
    terms: u32,
    reps: usize,
) -> Result<(Vec<f32>, f64)> {
    use crate::dtype::{bf16_to_f32, f32_to_bf16};
    let op = "step matmul";
    if x.len() != m * w.inner || w.groups != 1 || m == 0 || !(1..=3).contains(&terms) || (terms == 3 && dtype.planes() < 2) {
        return Err(KernelError::InvalidShape { op, reason: format!("x of {} values for [{m} x {}], {} groups, {terms} terms", x.len(), w.inner, w.groups) });
    }
    let mm = MmFuncs::load(drv)?;
    let mp = r16(m);
    let (kt, nt) = (w.kt(), w.nt());
    let plane = mp * kt * 16;
    let mut a = vec![0u16; 2 * plane];
    for i in 0..m {
        for k in 0..w.inner {
            let v = x[i * w.inner + k];
            let hi = f32_to_bf16(v);
            let at = crate::step::a_index(i, w.kp(k), kt);
            a[at] = hi;
            a[plane + at] = f32_to_bf16(v - bf16_to_f32(hi));
        }
    }
    let mut arena = Arena::new(drv.clone());
    let a_dev = arena.upload(&a)?;
    let w_dev = arena.upload(&pack_weight(w, dtype))?;
    let ldp = nt * 16;
    let part_group = mp * ldp;
    let part = arena.alloc(w.segments * part_group * 4)?;
    let counters = arena.alloc(mm_counters(nt, 1) * 4)?;
    let out = arena.alloc(m * w.cols * 4)?;
    let w_plane = plane_len(w) / 8;
    let n = m * w.cols;
    let operands = [
        Arg::P(a_dev),
        Arg::L((plane / 8) as i64),
        Arg::L((2 * plane / 8) as i64),
        Arg::P(w_dev),
        Arg::L(w_plane as i64),
        Arg::L((dtype.planes() * w_plane) as i64),
        Arg::P(part),
        Arg::L(part_group as i64),
        Arg::L(part_group as i64),
        Arg::I(ldp as i32),
    ];
    let shape = [Arg::I(m as i32), Arg::I(nt as i32), Arg::I(kt as i32), Arg::I(w.segments as i32), Arg::I(terms as i32)];
    // mode 0 (store), out [m, cols]
    let store = [Arg::I(0), Arg::P(out), Arg::I(w.cols as i32), Arg::I(0), Arg::P(0), Arg::L(0), Arg::I(1), Arg::I(1), Arg::I(1)];
    let mut args = operands.to_vec();
    args.push(Arg::P(counters));
    args.extend(shape);
    args.push(store[0]);
    args.push(Arg::I(w.cols as i32));
    args.extend_from_slice(&store[1..]);
    let list = mm.launches("step matmul", m, nt, w.segments, 1, terms as i32, args);
    let run = || launch_all(drv, &list, false);
    run()?;
    drv.synchronize().map_err(dev(op))?;
    let start = drv.record_event().map_err(dev(op))?;
    for _ in 0..reps.max(1) {
        run()?;
    }
    let end = drv.record_event().map_err(dev(op))?;
    let ms = drv.elapsed_ms(&start, &end).map_err(dev(op))?;
    let mut host = vec![0f32; n];
    // SAFETY: out holds n floats.
    unsafe { drv.download(&mut host[..], out) }.map_err(dev(op))?;
    drv.synchronize().map_err(dev(op))?;
    drop(arena);
    Ok((host, ms as f64 * 1e3 / reps.max(1) as f64))
}
