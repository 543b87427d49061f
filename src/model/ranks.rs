//! The disaggregated dispatch: prefill ranks write what they cache into their own
//! producer regions, decode ranks run from their own decode regions only. Byte
//! addresses follow docs/layout.md through the layouts the engine registered.
//!
//! Decode token placement: decode appends the KV row of position p (prompt or
//! generated alike) to the rank(s) whose dcp rank owns p under the design's rule,
//! `(p / S) % dcp`, at local position `(p / (S*dcp)) * S + p % S`: one owner per
//! DCP group, so generated tokens continue the interleave the transfer started.
//! Block tables grow from the rank's pool as positions pass the lease.
//!
//! ReplaySSM (when configured): prefill caches the state before the prompt's last
//! r = min(T, capacity / 2) tokens and their records, cursor r. A decode step is
//! [`forward::replay_step`]: it rebuilds the current state from the committed
//! state and the records (`replay_commit` on a copy), steps it, appends the
//! step's record, and when the ring is full commits in place (state region :=
//! rebuilt state, cursor 0). The colocated reference runs the same schedule.
//!
//! MLA attention under DCP: each member of a DCP group computes the f64 partial
//! (max, sum, accumulator) of the group's all-gathered queries over its own
//! tokens, and the partials are merged in f64 ([`forward::mla_merge`]); the
//! colocated reference merges its one shard the same way.

use super::ModelError;
use super::dtype;
use super::forward::{self, DecodeCaches, KdaCache, PrefillCache};
use crate::oracle::Memory;
use handoff_components::Topology;
use handoff_components::layout::RegionLayout;
use handoff_components::vocab::{DecodeRank, ModuleLayer, PrefillRank, RankId, RegionKind};
use handoff_kernels::{Backend, CpuBackend, CpuBuf, ReplayShape};
use handoff_systems::placement::owned_tokens;
use std::collections::BTreeMap;

type R<T> = Result<T, ModelError>;

/// The layout every rank registered, by (rank, kind).
pub type Layouts = BTreeMap<(RankId, RegionKind), RegionLayout>;

/// Where one request lives on one rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lease {
    pub blocks: Vec<u32>,
    pub slot: u32,
}

fn region(layouts: &Layouts, rank: RankId, kind: RegionKind) -> R<&RegionLayout> {
    layouts.get(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} has no {kind} region")))
}

fn unit(layouts: &Layouts, rank: RankId, kind: RegionKind, layer: usize, unit: u32) -> R<(u64, &RegionLayout)> {
    let l = region(layouts, rank, kind)?;
    let off = l
        .unit_offset(ModuleLayer(layer as u32), unit)
        .ok_or_else(|| ModelError::Region(format!("{rank} {kind} has no row for module layer {layer}")))?;
    Ok((off, l))
}

fn bytes_mut(mem: &mut Memory, rank: RankId, kind: RegionKind, off: u64, len: usize) -> R<&mut [u8]> {
    let buf = mem.get_mut(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} {kind}: no memory")))?;
    let off = off as usize;
    let total = buf.len();
    buf.get_mut(off..off + len)
        .ok_or_else(|| ModelError::Region(format!("{rank} {kind}: {off}+{len} outside {total} bytes")))
}

fn bytes(mem: &Memory, rank: RankId, kind: RegionKind, off: u64, len: usize) -> R<&[u8]> {
    let buf = mem.get(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} {kind}: no memory")))?;
    let off = off as usize;
    buf.get(off..off + len)
        .ok_or_else(|| ModelError::Region(format!("{rank} {kind}: {off}+{len} outside {} bytes", buf.len())))
}

fn put_f32(out: &mut [u8], xs: &[f32]) {
    dtype::encode(handoff_components::vocab::Dtype::F32, xs, out)
}

fn get_f32(b: &[u8]) -> Vec<f32> {
    dtype::decode(handoff_components::vocab::Dtype::F32, b)
}

/// Writes one prefill rank's cache of one layer into its producer regions.
pub fn store_prefill(
    topo: &Topology,
    layouts: &Layouts,
    mem: &mut Memory,
    rank: PrefillRank,
    lease: &Lease,
    layer: usize,
    cache: PrefillCache<'_>,
) -> R<()> {
    let id = RankId::Prefill(rank);
    let dt = topo.model().dtype;
    match cache {
        PrefillCache::Mla(rows) => {
            let (_, l) = unit(layouts, id, RegionKind::MlaKv, layer, 0)?;
            let (bs, tb) = (l.block_size as usize, l.token_bytes as usize);
            let e = dt.bytes() as usize;
            let width = tb / e;
            for (p, row) in rows.chunks_exact(width).enumerate() {
                let block = *lease.blocks.get(p / bs).ok_or_else(|| {
                    ModelError::Region(format!("{id}: position {p} past its {} blocks", lease.blocks.len()))
                })?;
                let (off, _) = unit(layouts, id, RegionKind::MlaKv, layer, block)?;
                let off = off + ((p % bs) * tb) as u64;
                dtype::encode(dt, row, bytes_mut(mem, id, RegionKind::MlaKv, off, tb)?);
            }
        }
        PrefillCache::Kda(c) => store_kda(topo, layouts, mem, id, lease.slot, layer, c)?,
    }
    Ok(())
}

fn store_kda(topo: &Topology, layouts: &Layouts, mem: &mut Memory, id: RankId, slot: u32, layer: usize, c: &KdaCache) -> R<()> {
    let dt = topo.model().dtype;
    let (off, _) = unit(layouts, id, RegionKind::KdaState, layer, slot)?;
    put_f32(bytes_mut(mem, id, RegionKind::KdaState, off, c.state.len() * 4)?, &c.state);
    let (off, _) = unit(layouts, id, RegionKind::KdaConv, layer, slot)?;
    let n = c.conv.len() * dt.bytes() as usize;
    dtype::encode(dt, &c.conv, bytes_mut(mem, id, RegionKind::KdaConv, off, n)?);
    if topo.model().replay.is_some() {
        let (off, l) = unit(layouts, id, RegionKind::ReplayRecords, layer, slot)?;
        let ring = bytes_mut(mem, id, RegionKind::ReplayRecords, off, l.unit_bytes as usize)?;
        ring.fill(0);
        put_f32(&mut ring[..c.records.len() * 4], &c.records);
        let (off, _) = unit(layouts, id, RegionKind::ReplayCursor, layer, slot)?;
        bytes_mut(mem, id, RegionKind::ReplayCursor, off, 4)?.copy_from_slice(&(c.record_tokens as i32).to_le_bytes());
    }
    Ok(())
}

/// The records prefill leaves for decode to replay: half the ring, at most the prompt.
pub fn prefill_record_tail(topo: &Topology, tokens: usize) -> usize {
    super::weights::Dims::from_topology(topo).record_tail(tokens)
}

/// The decode TP group's caches: every read and write goes to a decode rank's own
/// regions in `mem`.
pub struct DecodeRanks<'a> {
    pub topo: &'a Topology,
    pub layouts: &'a Layouts,
    pub mem: &'a mut Memory,
    /// Per decode TP rank: its block table (lease plus growth) and slot.
    pub leases: Vec<Lease>,
    be: CpuBackend,
}

impl<'a> DecodeRanks<'a> {
    pub fn new(topo: &'a Topology, layouts: &'a Layouts, mem: &'a mut Memory, leases: Vec<Lease>) -> Self {
        DecodeRanks { topo, layouts, mem, leases, be: CpuBackend::new() }
    }

    fn local(&self, pos: usize) -> (u32, usize) {
        let d = self.topo.decode();
        let (s, dcp) = (d.interleave as usize, d.dcp as usize);
        (((pos / s) % dcp) as u32, (pos / (s * dcp)) * s + pos % s)
    }

    fn row_addr(&self, rank: usize, layer: usize, lp: usize) -> R<(u64, usize)> {
        let id = RankId::Decode(DecodeRank { tp: rank as u32 });
        let (_, l) = unit(self.layouts, id, RegionKind::MlaKv, layer, 0)?;
        let (bs, tb) = (l.block_size as usize, l.token_bytes as usize);
        let block = *self.leases[rank].blocks.get(lp / bs).ok_or_else(|| {
            ModelError::Region(format!("{id}: local position {lp} past its {} blocks", self.leases[rank].blocks.len()))
        })?;
        let (off, _) = unit(self.layouts, id, RegionKind::MlaKv, layer, block)?;
        Ok((off + ((lp % bs) * tb) as u64, tb))
    }

    /// The rows rank `rank` holds of positions `0..tokens` of `layer`, `[n, L+R]`.
    fn local_rows(&self, rank: usize, layer: usize, tokens: usize) -> R<(CpuBuf, usize)> {
        let d = self.topo.decode();
        let id = RankId::Decode(DecodeRank { tp: rank as u32 });
        let n = owned_tokens(tokens as u64, d.dcp, DecodeRank { tp: rank as u32 }.dcp_rank(d.dcp), d.interleave) as usize;
        let dt = self.topo.model().dtype;
        let mut rows = Vec::new();
        for lp in 0..n {
            let (off, tb) = self.row_addr(rank, layer, lp)?;
            rows.extend(dtype::decode(dt, bytes(self.mem, id, RegionKind::MlaKv, off, tb)?));
        }
        Ok((CpuBuf::from_vec(rows), n))
    }
}

impl DecodeCaches for DecodeRanks<'_> {
    fn kda(
        &mut self,
        rank: usize,
        layer: usize,
        step: &mut forward::KdaStepFn<'_>,
    ) -> R<()> {
        let be = self.be;
        let id = RankId::Decode(DecodeRank { tp: rank as u32 });
        let slot = self.leases[rank].slot;
        let m = self.topo.model();
        let dt = m.dtype;
        let (hl, dk, dv) = (self.topo.decode_heads() as usize, m.kda.head_k_dim as usize, m.kda.head_v_dim as usize);
        let (s_off, _) = unit(self.layouts, id, RegionKind::KdaState, layer, slot)?;
        let mut state = CpuBuf::from_vec(get_f32(bytes(self.mem, id, RegionKind::KdaState, s_off, hl * dk * dv * 4)?));
        let (c_off, cl) = unit(self.layouts, id, RegionKind::KdaConv, layer, slot)?;
        let c_len = cl.unit_bytes as usize;
        let mut conv = CpuBuf::from_vec(dtype::decode(dt, bytes(self.mem, id, RegionKind::KdaConv, c_off, c_len)?));
        match m.replay.as_ref().map(|r| r.capacity as usize) {
            None => {
                step(&mut state, &mut conv, None)?;
                put_f32(bytes_mut(self.mem, id, RegionKind::KdaState, s_off, hl * dk * dv * 4)?, state.as_slice());
            }
            Some(capacity) => {
                let shape = ReplayShape { batch: 1, heads: hl, dk, dv, capacity };
                let (r_off, rl) = unit(self.layouts, id, RegionKind::ReplayRecords, layer, slot)?;
                let r_len = rl.unit_bytes as usize;
                let mut ring = CpuBuf::from_vec(get_f32(bytes(self.mem, id, RegionKind::ReplayRecords, r_off, r_len)?));
                let (k_off, _) = unit(self.layouts, id, RegionKind::ReplayCursor, layer, slot)?;
                let cb = bytes(self.mem, id, RegionKind::ReplayCursor, k_off, 4)?;
                let mut cursor = be.upload_i32(&[i32::from_le_bytes([cb[0], cb[1], cb[2], cb[3]])])?;
                if forward::replay_step(&be, shape, &mut state, &mut ring, &mut cursor, &mut conv, step)? {
                    put_f32(bytes_mut(self.mem, id, RegionKind::KdaState, s_off, hl * dk * dv * 4)?, state.as_slice());
                }
                put_f32(bytes_mut(self.mem, id, RegionKind::ReplayRecords, r_off, r_len)?, ring.as_slice());
                let c = be.download_i32(&cursor)?[0];
                bytes_mut(self.mem, id, RegionKind::ReplayCursor, k_off, 4)?.copy_from_slice(&c.to_le_bytes());
            }
        }
        dtype::encode(dt, conv.as_slice(), bytes_mut(self.mem, id, RegionKind::KdaConv, c_off, c_len)?);
        Ok(())
    }

    fn mla_append(&mut self, layer: usize, pos: usize, row: &[f32]) -> R<()> {
        let dcp = self.topo.decode().dcp as usize;
        let (owner, lp) = self.local(pos);
        let dt = self.topo.model().dtype;
        for rank in (owner as usize..self.leases.len()).step_by(dcp) {
            let id = RankId::Decode(DecodeRank { tp: rank as u32 });
            let (off, tb) = self.row_addr(rank, layer, lp)?;
            dtype::encode(dt, row, bytes_mut(self.mem, id, RegionKind::MlaKv, off, tb)?);
        }
        Ok(())
    }

    fn mla_attend(&mut self, layer: usize, pos: usize, q_lat: &[CpuBuf]) -> R<Vec<CpuBuf>> {
        let be = self.be;
        let m = self.topo.model();
        let dcp = self.topo.decode().dcp as usize;
        let (l, w) = (m.mla.kv_lora_rank as usize, (m.mla.kv_lora_rank + m.mla.rope_dim) as usize);
        let hl = m.mla.heads as usize / q_lat.len();
        let hg = hl * dcp;
        let dims = super::weights::Dims::from_topology(self.topo);
        let shape = forward::mla_shape(&dims, hg);
        let mut out = Vec::with_capacity(q_lat.len());
        for group in 0..q_lat.len() / dcp {
            let members = group * dcp..(group + 1) * dcp;
            // All-gather of the group's queries: [dcp * hl, L+R], member-major.
            let mut q = Vec::with_capacity(hg * w);
            for r in members.clone() {
                q.extend_from_slice(q_lat[r].as_slice());
            }
            let q = CpuBuf::from_vec(q);
            // Each member's f64 partial over its own tokens, gathered rank-major.
            let mut partials = Vec::new();
            for r in members.clone() {
                let (rows, n) = self.local_rows(r, layer, pos + 1)?;
                partials.extend(forward::mla_partial(&be, shape, &q, &rows, n)?);
            }
            let o = forward::mla_merge(&be, shape, dcp, &partials)?;
            // Each member keeps its own heads.
            for j in 0..dcp {
                out.push(CpuBuf::from_vec(o.as_slice()[j * hl * l..(j + 1) * hl * l].to_vec()));
            }
        }
        Ok(out)
    }
}
