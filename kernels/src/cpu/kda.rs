//! KDA on the CPU: the recurrent step, the chunked prefill and ReplaySSM.

use rayon::prelude::*;

use super::math::{L2_EPS, axpy, sigmoid, softplus};
use crate::error::{KernelError, Result, check_len, check_nonzero, elems};
use crate::shapes::{KdaPrefillShape, KdaRaggedShape, KdaStepShape, ReplayShape, check_ragged_seqs, replay_record_width};
use std::ops::Range;

/// Chunk length of the chunked prefill.
pub const KDA_CHUNK: usize = 64;

/// Host views of the per-token inputs, `[N, H, *]`.
#[derive(Clone, Copy)]
pub(crate) struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g_raw: &'a [f32],
    pub b_raw: &'a [f32],
}

/// Host views of the per-layer parameters.
#[derive(Clone, Copy)]
pub(crate) struct Params<'a> {
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// Checks a KDA call over `n` rows (batch or tokens) of `heads` heads.
#[allow(clippy::too_many_arguments)]
fn check_kda(
    op: &'static str,
    n: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    state_len: usize,
    state_n: usize,
    x: &Inputs<'_>,
    p: &Params<'_>,
    out_len: usize,
    record_len: Option<usize>,
) -> Result<()> {
    check_nonzero(op, "heads", heads)?;
    check_nonzero(op, "dk", dk)?;
    check_nonzero(op, "dv", dv)?;
    check_len(op, "state", state_len, elems(op, &[state_n, heads, dk, dv])?)?;
    check_len(op, "q", x.q.len(), elems(op, &[n, heads, dk])?)?;
    check_len(op, "k", x.k.len(), elems(op, &[n, heads, dk])?)?;
    check_len(op, "v", x.v.len(), elems(op, &[n, heads, dv])?)?;
    check_len(op, "g_raw", x.g_raw.len(), elems(op, &[n, heads, dk])?)?;
    check_len(op, "b_raw", x.b_raw.len(), elems(op, &[n, heads])?)?;
    check_len(op, "a_log", p.a_log.len(), heads)?;
    check_len(op, "dt_bias", p.dt_bias.len(), elems(op, &[heads, dk])?)?;
    check_len(op, "out", out_len, elems(op, &[n, heads, dv])?)?;
    if let Some(len) = record_len {
        let w = dk.checked_add(dk).and_then(|x| x.checked_add(dv)).ok_or(KernelError::SizeOverflow { op, dims: vec![dk, dv] })?;
        check_len(op, "record", len, elems(op, &[n, heads, w])?)?;
    }
    Ok(())
}

/// Step 1-3 of the math for one head and token: writes q^ (scaled), k^ and
/// the log decay g; returns beta.
#[allow(clippy::too_many_arguments)]
#[inline]
fn prepare(q: &[f32], k: &[f32], g_raw: &[f32], b_raw: f32, a_log: f32, dt_bias: &[f32], qh: &mut [f32], kh: &mut [f32], g: &mut [f32]) -> f32 {
    let dk = q.len();
    let qs = 1.0 / (q.iter().map(|x| x * x).sum::<f32>() + L2_EPS).sqrt() / (dk as f32).sqrt();
    let ks = 1.0 / (k.iter().map(|x| x * x).sum::<f32>() + L2_EPS).sqrt();
    for i in 0..dk {
        qh[i] = q[i] * qs;
        kh[i] = k[i] * ks;
    }
    let rate = -a_log.exp();
    for i in 0..dk {
        g[i] = rate * softplus(g_raw[i] + dt_bias[i]);
    }
    sigmoid(b_raw)
}

/// Scratch of one head step.
struct StepScratch {
    qh: Vec<f32>,
    kh: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
}

impl StepScratch {
    fn new(dk: usize, dv: usize) -> Self {
        Self { qh: vec![0.0; dk], kh: vec![0.0; dk], g: vec![0.0; dk], u: vec![0.0; dv] }
    }
}

/// Recurrent step, see [`crate::Backend::kda_step`].
pub(crate) fn step(shape: KdaStepShape, state: &mut [f32], x: Inputs<'_>, p: Params<'_>, out: &mut [f32], record: Option<&mut [f32]>) -> Result<()> {
    let KdaStepShape { batch, heads, dk, dv } = shape;
    let op = "kda_step";
    check_kda(op, batch, heads, dk, dv, state.len(), batch, &x, &p, out.len(), record.as_ref().map(|r| r.len()))?;
    let w = replay_record_width(dk, dv);
    let run = |bh: usize, s: &mut [f32], o: &mut [f32], rec: Option<&mut [f32]>, sc: &mut StepScratch| {
        let h = bh % heads;
        let beta = prepare(
            &x.q[bh * dk..(bh + 1) * dk],
            &x.k[bh * dk..(bh + 1) * dk],
            &x.g_raw[bh * dk..(bh + 1) * dk],
            x.b_raw[bh],
            p.a_log[h],
            &p.dt_bias[h * dk..(h + 1) * dk],
            &mut sc.qh,
            &mut sc.kh,
            &mut sc.g,
        );
        let v = &x.v[bh * dv..(bh + 1) * dv];
        // Pass 1: S' = Diag(alpha) S and kv = S'^T k^, u = beta (v - kv).
        sc.u.fill(0.0);
        for i in 0..dk {
            let a = sc.g[i].exp();
            let ki = sc.kh[i];
            let row = &mut s[i * dv..(i + 1) * dv];
            for (sj, uj) in row.iter_mut().zip(sc.u.iter_mut()) {
                *sj *= a;
                *uj += *sj * ki;
            }
        }
        for (uj, vj) in sc.u.iter_mut().zip(v) {
            *uj = beta * (vj - *uj);
        }
        // Pass 2: S = S' + k^ u^T and o = S^T q^.
        o.fill(0.0);
        for i in 0..dk {
            let ki = sc.kh[i];
            let qi = sc.qh[i];
            let row = &mut s[i * dv..(i + 1) * dv];
            for ((sj, uj), oj) in row.iter_mut().zip(&sc.u).zip(o.iter_mut()) {
                *sj += ki * uj;
                *oj += *sj * qi;
            }
        }
        if let Some(rec) = rec {
            rec[..dk].copy_from_slice(&sc.kh);
            rec[dk..dk + dv].copy_from_slice(&sc.u);
            rec[dk + dv..].copy_from_slice(&sc.g);
        }
    };
    let per = dk * dv;
    match record {
        Some(rec) => state
            .par_chunks_mut(per)
            .zip(out.par_chunks_mut(dv))
            .zip(rec.par_chunks_mut(w))
            .enumerate()
            .with_min_len(super::grain(6 * per))
            .for_each_init(|| StepScratch::new(dk, dv), |sc, (bh, ((s, o), r))| run(bh, s, o, Some(r), sc)),
        None => state
            .par_chunks_mut(per)
            .zip(out.par_chunks_mut(dv))
            .enumerate()
            .with_min_len(super::grain(6 * per))
            .for_each_init(|| StepScratch::new(dk, dv), |sc, (bh, (s, o))| run(bh, s, o, None, sc)),
    }
    Ok(())
}

/// Prefill, see [`crate::Backend::kda_prefill`]: the chunked form, or the
/// recurrent one where that costs less.
///
/// Per token and head, the chunked form pays about C/2 pairs x Dk exponentials and
/// multiply-adds inside its chunk of C = min(T, 64) tokens, the recurrent form
/// about 4 x Dk x Dv multiply-adds and Dk exponentials. On a CPU with small heads
/// (Dv well under 1.5 C) the recurrent form is several times cheaper, and it
/// computes exactly what decode steps compute; the chunked form wins on wide heads
/// (K3's 128 x 128) and is what a device backend parallelises.
pub(crate) fn prefill(shape: KdaPrefillShape, state: &mut [f32], x: Inputs<'_>, p: Params<'_>, out: &mut [f32], record: Option<&mut [f32]>) -> Result<()> {
    let c = shape.tokens.min(KDA_CHUNK);
    if 2 * shape.dv < 3 * c { prefill_recurrent(shape, state, x, p, out, record) } else { prefill_chunked(shape, KDA_CHUNK, state, x, p, out, record) }
}

/// Prefill of several sequences, see [`crate::Backend::kda_prefill_ragged`]:
/// [`prefill`] on each one's rows, in place (no copies).
pub(crate) fn prefill_ragged(
    shape: KdaRaggedShape,
    seqs: &[Range<usize>],
    states: &mut [f32],
    x: Inputs<'_>,
    p: Params<'_>,
    out: &mut [f32],
    mut record: Option<&mut [f32]>,
) -> Result<()> {
    let op = "kda_prefill_ragged";
    let KdaRaggedShape { rows, heads, dk, dv } = shape;
    check_ragged_seqs(op, rows, seqs)?;
    check_kda(op, rows, heads, dk, dv, states.len(), seqs.len(), &x, &p, out.len(), record.as_ref().map(|r| r.len()))?;
    let (hk, hv, hw, per) = (heads * dk, heads * dv, heads * replay_record_width(dk, dv), heads * dk * dv);
    for (i, r) in seqs.iter().enumerate() {
        if r.is_empty() {
            continue;
        }
        let xi = Inputs {
            q: &x.q[r.start * hk..r.end * hk],
            k: &x.k[r.start * hk..r.end * hk],
            v: &x.v[r.start * hv..r.end * hv],
            g_raw: &x.g_raw[r.start * hk..r.end * hk],
            b_raw: &x.b_raw[r.start * heads..r.end * heads],
        };
        let rec = record.as_deref_mut().map(|rr| &mut rr[r.start * hw..r.end * hw]);
        let one = KdaPrefillShape { tokens: r.len(), heads, dk, dv };
        prefill(one, &mut states[i * per..(i + 1) * per], xi, p, &mut out[r.start * hv..r.end * hv], rec)?;
    }
    Ok(())
}

/// Prefill as `tokens` recurrent steps of the sequence (batch of one per step).
pub(crate) fn prefill_recurrent(
    shape: KdaPrefillShape,
    state: &mut [f32],
    x: Inputs<'_>,
    p: Params<'_>,
    out: &mut [f32],
    mut record: Option<&mut [f32]>,
) -> Result<()> {
    let KdaPrefillShape { tokens, heads, dk, dv } = shape;
    check_kda("kda_prefill", tokens, heads, dk, dv, state.len(), 1, &x, &p, out.len(), record.as_ref().map(|r| r.len()))?;
    let w = replay_record_width(dk, dv);
    let one = KdaStepShape { batch: 1, heads, dk, dv };
    for t in 0..tokens {
        let (hk, hv) = (heads * dk, heads * dv);
        let xt = Inputs {
            q: &x.q[t * hk..(t + 1) * hk],
            k: &x.k[t * hk..(t + 1) * hk],
            v: &x.v[t * hv..(t + 1) * hv],
            g_raw: &x.g_raw[t * hk..(t + 1) * hk],
            b_raw: &x.b_raw[t * heads..(t + 1) * heads],
        };
        let rec = record.as_deref_mut().map(|r| &mut r[t * heads * w..(t + 1) * heads * w]);
        step(one, state, xt, p, &mut out[t * hv..(t + 1) * hv], rec)?;
    }
    Ok(())
}

/// Per-head results of the prefill, scattered into `[T, H, *]` afterwards.
struct HeadOut {
    o: Vec<f32>,
    rec: Option<Vec<f32>>,
}

/// The chunked prefill with an explicit chunk length (tests vary it).
///
/// Within a chunk of C tokens with cumulative log decay Gam_t (per key
/// channel, inclusive), the recurrence unrolls to
///   S_t = Diag(e^{Gam_t}) S_0 + sum_{s<=t} Diag(e^{Gam_t - Gam_s}) k^_s u_s^T,
/// so the u_t solve a unit lower-triangular system (the UT transform):
///   u_t + sum_{s<t} A_ts u_s = beta_t (v_t - S_0^T (e^{Gam_t} k^_t)),
///   `A_ts = beta_t sum_i k^_t[i] k^_s[i] e^{Gam_t[i] - Gam_s[i]}`.
/// Outputs are o_t = S_0^T (e^{Gam_t} q^_t) + sum_{s<=t} P_ts u_s with
/// `P_ts = sum_i q^_t[i] k^_s[i] e^{Gam_t[i] - Gam_s[i]}`, and the state passes
/// to the next chunk as S_C = Diag(e^{Gam_C}) S_0 + sum_s (e^{Gam_C - Gam_s} k^_s) u_s^T.
/// Decays are formed as differences Gam_t - Gam_s <= 0, never as a product of
/// e^{Gam_t} and e^{-Gam_s}, so nothing overflows however strong the decay.
pub(crate) fn prefill_chunked(
    shape: KdaPrefillShape,
    chunk: usize,
    state: &mut [f32],
    x: Inputs<'_>,
    p: Params<'_>,
    out: &mut [f32],
    record: Option<&mut [f32]>,
) -> Result<()> {
    let KdaPrefillShape { tokens, heads, dk, dv } = shape;
    let op = "kda_prefill";
    check_nonzero(op, "chunk", chunk)?;
    check_kda(op, tokens, heads, dk, dv, state.len(), 1, &x, &p, out.len(), record.as_ref().map(|r| r.len()))?;
    let want_rec = record.is_some();
    let w = replay_record_width(dk, dv);
    let per_head: Vec<HeadOut> =
        state.par_chunks_mut(dk * dv).enumerate().map(|(h, s)| prefill_head(h, heads, dk, dv, tokens, chunk, s, &x, &p, want_rec)).collect();
    out.par_chunks_mut(heads * dv).enumerate().for_each(|(t, orow)| {
        for (h, ho) in per_head.iter().enumerate() {
            orow[h * dv..(h + 1) * dv].copy_from_slice(&ho.o[t * dv..(t + 1) * dv]);
        }
    });
    if let Some(rec) = record {
        rec.par_chunks_mut(heads * w).enumerate().for_each(|(t, rrow)| {
            for (h, ho) in per_head.iter().enumerate() {
                if let Some(r) = &ho.rec {
                    rrow[h * w..(h + 1) * w].copy_from_slice(&r[t * w..(t + 1) * w]);
                }
            }
        });
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn prefill_head(
    h: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    tokens: usize,
    chunk: usize,
    s0: &mut [f32],
    x: &Inputs<'_>,
    p: &Params<'_>,
    want_rec: bool,
) -> HeadOut {
    let c = chunk.min(tokens.max(1));
    let w = replay_record_width(dk, dv);
    let mut o_all = vec![0.0f32; tokens * dv];
    let mut rec_all = if want_rec { Some(vec![0.0f32; tokens * w]) } else { None };
    let mut qh = vec![0.0f32; c * dk];
    let mut kh = vec![0.0f32; c * dk];
    let mut gam = vec![0.0f32; c * dk];
    let mut g = vec![0.0f32; dk];
    let mut beta = vec![0.0f32; c];
    let mut a = vec![0.0f32; c * c];
    let mut pm = vec![0.0f32; c * c];
    let mut u = vec![0.0f32; c * dv];
    let mut tmp = vec![0.0f32; dk];
    let dt_bias = &p.dt_bias[h * dk..(h + 1) * dk];
    let a_log = p.a_log[h];

    let mut c0 = 0;
    while c0 < tokens {
        let n = c.min(tokens - c0);
        // Per-token prep and the cumulative log decay.
        for t in 0..n {
            let th = (c0 + t) * heads + h;
            beta[t] = prepare(
                &x.q[th * dk..(th + 1) * dk],
                &x.k[th * dk..(th + 1) * dk],
                &x.g_raw[th * dk..(th + 1) * dk],
                x.b_raw[th],
                a_log,
                dt_bias,
                &mut qh[t * dk..(t + 1) * dk],
                &mut kh[t * dk..(t + 1) * dk],
                &mut g,
            );
            for i in 0..dk {
                let prev = if t == 0 { 0.0 } else { gam[(t - 1) * dk + i] };
                gam[t * dk + i] = prev + g[i];
            }
            if let Some(rec) = rec_all.as_mut() {
                let r = &mut rec[(c0 + t) * w..(c0 + t + 1) * w];
                r[..dk].copy_from_slice(&kh[t * dk..(t + 1) * dk]);
                r[dk + dv..].copy_from_slice(&g);
            }
        }
        // Intra-chunk matrices A (strictly lower) and P (lower, inclusive).
        for t in 0..n {
            let gt = &gam[t * dk..(t + 1) * dk];
            let qt = &qh[t * dk..(t + 1) * dk];
            let kt = &kh[t * dk..(t + 1) * dk];
            for s in 0..=t {
                let gs = &gam[s * dk..(s + 1) * dk];
                let ks = &kh[s * dk..(s + 1) * dk];
                let (mut akk, mut aqk) = (0.0f32, 0.0f32);
                for i in 0..dk {
                    let d = (gt[i] - gs[i]).exp() * ks[i];
                    akk += kt[i] * d;
                    aqk += qt[i] * d;
                }
                a[t * c + s] = if s < t { beta[t] * akk } else { 0.0 };
                pm[t * c + s] = aqk;
            }
        }
        // Right-hand side: beta_t (v_t - S_0^T (e^{Gam_t} k^_t)).
        for t in 0..n {
            let th = (c0 + t) * heads + h;
            let ut = &mut u[t * dv..(t + 1) * dv];
            ut.fill(0.0);
            for i in 0..dk {
                let coef = gam[t * dk + i].exp() * kh[t * dk + i];
                axpy(ut, coef, &s0[i * dv..(i + 1) * dv]);
            }
            let v = &x.v[th * dv..(th + 1) * dv];
            for (uj, vj) in ut.iter_mut().zip(v) {
                *uj = beta[t] * (vj - *uj);
            }
        }
        // Forward substitution through (I + A): the UT transform applied to the rhs.
        for t in 1..n {
            let (done, rest) = u.split_at_mut(t * dv);
            let ut = &mut rest[..dv];
            for s in 0..t {
                let coef = a[t * c + s];
                if coef != 0.0 {
                    axpy(ut, -coef, &done[s * dv..(s + 1) * dv]);
                }
            }
        }
        // Outputs: inter-chunk part from S_0 plus intra-chunk part from u.
        for t in 0..n {
            let ot = &mut o_all[(c0 + t) * dv..(c0 + t + 1) * dv];
            for i in 0..dk {
                let coef = gam[t * dk + i].exp() * qh[t * dk + i];
                axpy(ot, coef, &s0[i * dv..(i + 1) * dv]);
            }
            for s in 0..=t {
                axpy(ot, pm[t * c + s], &u[s * dv..(s + 1) * dv]);
            }
            if let Some(rec) = rec_all.as_mut() {
                rec[(c0 + t) * w + dk..(c0 + t) * w + dk + dv].copy_from_slice(&u[t * dv..(t + 1) * dv]);
            }
        }
        // State to the next chunk.
        let last = &gam[(n - 1) * dk..n * dk];
        for i in 0..dk {
            tmp[i] = last[i].exp();
        }
        for i in 0..dk {
            let row = &mut s0[i * dv..(i + 1) * dv];
            let decay = tmp[i];
            for sj in row.iter_mut() {
                *sj *= decay;
            }
            for s in 0..n {
                let coef = (last[i] - gam[s * dk + i]).exp() * kh[s * dk + i];
                axpy(row, coef, &u[s * dv..(s + 1) * dv]);
            }
        }
        c0 += n;
    }
    HeadOut { o: o_all, rec: rec_all }
}

/// Reads and validates the cursors of a replay call.
pub(crate) fn read_cursors(op: &'static str, cursor: &[i32], capacity: usize) -> Result<Vec<usize>> {
    cursor
        .iter()
        .enumerate()
        .map(|(b, &c)| {
            if c < 0 || c as usize > capacity {
                Err(KernelError::IndexOutOfRange { op, what: "replay cursor", index: c as i64, position: b, bound: capacity + 1 })
            } else {
                Ok(c as usize)
            }
        })
        .collect()
}

pub(crate) fn check_replay(op: &'static str, shape: &ReplayShape, ring_len: usize, cursor_len: usize) -> Result<usize> {
    let ReplayShape { batch, heads, dk, dv, capacity } = *shape;
    check_nonzero(op, "heads", heads)?;
    check_nonzero(op, "dk", dk)?;
    check_nonzero(op, "dv", dv)?;
    let w = replay_record_width(dk, dv);
    check_len(op, "ring", ring_len, elems(op, &[batch, capacity, heads, w])?)?;
    check_len(op, "cursor", cursor_len, batch)?;
    Ok(w)
}

/// See [`crate::Backend::replay_append`].
pub(crate) fn replay_append(shape: ReplayShape, tokens: usize, ring: &mut [f32], cursor: &mut [i32], records: &[f32]) -> Result<()> {
    let op = "replay_append";
    let w = check_replay(op, &shape, ring.len(), cursor.len())?;
    let ReplayShape { batch, heads, capacity, .. } = shape;
    check_len(op, "records", records.len(), elems(op, &[batch, tokens, heads, w])?)?;
    let cur = read_cursors(op, cursor, capacity)?;
    for (b, &c) in cur.iter().enumerate() {
        if c + tokens > capacity {
            return Err(KernelError::ReplayFull { slot: b, cursor: c, tokens, capacity });
        }
    }
    let tok = heads * w;
    for (b, &c) in cur.iter().enumerate() {
        let dst = (b * capacity + c) * tok;
        let src = b * tokens * tok;
        ring[dst..dst + tokens * tok].copy_from_slice(&records[src..src + tokens * tok]);
        // c + tokens <= capacity, which the cursor range check bounds by i32.
        cursor[b] = (c + tokens) as i32;
    }
    Ok(())
}

/// See [`crate::Backend::replay_commit`].
pub(crate) fn replay_commit(shape: ReplayShape, state: &mut [f32], ring: &[f32], cursor: &mut [i32]) -> Result<()> {
    let op = "replay_commit";
    let w = check_replay(op, &shape, ring.len(), cursor.len())?;
    let ReplayShape { batch, heads, dk, dv, capacity } = shape;
    check_len(op, "state", state.len(), elems(op, &[batch, heads, dk, dv])?)?;
    let cur = read_cursors(op, cursor, capacity)?;
    let busiest = cur.iter().copied().max().unwrap_or(0);
    state.par_chunks_mut(dk * dv).enumerate().with_min_len(super::grain((2 * busiest + 1) * dk * dv)).for_each_init(
        || (vec![0.0f32; dk], vec![0.0f32; dk]),
        |(total, suffix), (bh, s)| {
            let (b, h) = (bh / heads, bh % heads);
            let n = cur[b];
            let rec = |j: usize| {
                let at = ((b * capacity + j) * heads + h) * w;
                &ring[at..at + w]
            };
            // G_n per key channel, then S_0 scaled by exp(G_n).
            total.fill(0.0);
            for j in 0..n {
                for (ti, gi) in total.iter_mut().zip(&rec(j)[dk + dv..]) {
                    *ti += gi;
                }
            }
            for i in 0..dk {
                let e = total[i].exp();
                for sj in &mut s[i * dv..(i + 1) * dv] {
                    *sj *= e;
                }
            }
            // Newest first, so that G_n - G_j is a suffix sum of g (never a
            // difference of two large sums).
            suffix.fill(0.0);
            for j in (0..n).rev() {
                let r = rec(j);
                let (kh, u, g) = (&r[..dk], &r[dk..dk + dv], &r[dk + dv..]);
                for i in 0..dk {
                    axpy(&mut s[i * dv..(i + 1) * dv], suffix[i].exp() * kh[i], u);
                }
                for (si, gi) in suffix.iter_mut().zip(g) {
                    *si += gi;
                }
            }
        },
    );
    cursor.fill(0);
    Ok(())
}
