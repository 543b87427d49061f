//! The disaggregated dispatch: prefill ranks write what they cache into their own
//! producer regions, decode ranks run from their own decode regions only. Byte
//! addresses follow docs/layout.md through the layouts the engine registered; bytes
//! are reached through a [`RegionView`], one call per (rank, kind) per layer.
//!
//! Decode token placement: decode appends the KV row of position p (prompt or
//! generated alike) to the rank(s) whose dcp rank owns p under the design's rule,
//! `(p / S) % dcp`, at local position `(p / (S*dcp)) * S + p % S`: one owner per
//! DCP group, so generated tokens continue the interleave the transfer started.
//! The caller grows each lease's block table to cover the positions it decodes.
//!
//! ReplaySSM (when configured): prefill caches the state before the prompt's last
//! r = min(T, capacity / 2) tokens and their records, cursor r. A decode step
//! ([`crate::model::forward::kda_decode_batch`]) rebuilds each slot's current state from the
//! committed state and the records, steps it, appends the step's record, and the
//! slots whose ring is full commit (state region := rebuilt state, cursor 0). The
//! colocated reference runs the same schedule.
//!
//! MLA attention under DCP: each member of a DCP group computes the f64 partials
//! (max, sum, accumulator) of the group's all-gathered queries over its own
//! tokens of each request, and the partials are merged in f64; the colocated
//! reference merges its one shard the same way.

use super::ModelError;
use super::dtype;
use super::dtype::storage;
use super::forward::{BatchCaches, KdaBatch, KdaCache, PrefillCache, ReplayBatch};
use super::regions::{self, RegionView, span, span_mut};
use super::weights::Dims;
use handoff_components::Topology;
use handoff_components::ecs::Lease;
use handoff_components::layout::RegionLayout;
use handoff_components::layout::owned_tokens;
use handoff_components::vocab::{DecodeRank, Dtype, ModuleLayer, PrefillRank, RankId, RegionKind};
use handoff_kernels::{Backend, RegionItems};
use std::collections::BTreeMap;

type R<T> = Result<T, ModelError>;

/// The layout every rank registered, by (rank, kind).
pub type Layouts = BTreeMap<(RankId, RegionKind), RegionLayout>;

fn region(layouts: &Layouts, rank: RankId, kind: RegionKind) -> R<&RegionLayout> {
    layouts.get(&(rank, kind)).ok_or_else(|| ModelError::Region(format!("{rank} has no {kind} region")))
}

/// Byte offset of (module layer `layer`, unit `unit`) of `rank`'s `kind` region.
fn unit(layouts: &Layouts, rank: RankId, kind: RegionKind, layer: usize, unit: u32) -> R<u64> {
    region(layouts, rank, kind)?
        .unit_offset(ModuleLayer(layer as u32), unit)
        .ok_or_else(|| ModelError::Region(format!("{rank} {kind} has no row for module layer {layer}")))
}

/// Byte offset of local position `lp` of `layer` in a paged region, through a
/// block table.
fn row_offset(l: &RegionLayout, rank: RankId, blocks: &[u32], layer: usize, lp: usize) -> R<u64> {
    let (bs, tb) = (l.block_size as usize, l.token_bytes);
    if bs == 0 {
        return Err(ModelError::Region(format!("{rank} {}: not a paged region", l.kind)));
    }
    let block = *blocks.get(lp / bs).ok_or_else(|| ModelError::Region(format!("{rank}: local position {lp} past its {} blocks", blocks.len())))?;
    let off =
        l.unit_offset(ModuleLayer(layer as u32), block).ok_or_else(|| ModelError::Region(format!("{rank} {} has no row for module layer {layer}", l.kind)))?;
    Ok(off + (lp % bs) as u64 * tb)
}

/// Writes one prefill rank's cache of one layer into its producer regions: its
/// MLA rows into `lease.blocks`, its KDA caches into slot `lease.slot`. The
/// addresses come from `rank`'s layouts (`lease.rank` is not consulted: a stage's
/// TP ranks share one block table and slot). Device regions are written in
/// place by the backend (`be`), host regions through their bytes.
#[allow(clippy::too_many_arguments)]
pub fn store_prefill<B: Backend>(
    be: &B,
    topo: &Topology,
    layouts: &Layouts,
    view: &dyn RegionView,
    rank: PrefillRank,
    lease: &Lease,
    layer: usize,
    cache: PrefillCache<'_, B>,
) -> R<()> {
    let id = RankId::Prefill(rank);
    let dt = topo.model().dtype;
    match cache {
        PrefillCache::Mla(rows) => {
            let kind = RegionKind::MlaKv;
            let l = region(layouts, id, kind)?;
            let tb = l.token_bytes as usize;
            let width = tb / dt.bytes() as usize;
            let n = be.buf_len(rows);
            if width == 0 || !n.is_multiple_of(width) {
                return Err(ModelError::Region(format!("{id}: {n} values are not rows of {width}")));
            }
            let offs = (0..n / width).map(|p| row_offset(l, id, &lease.blocks, layer, p)).collect::<R<Vec<_>>>()?;
            put_buf(be, view, id, kind, &offs, width, dt, rows)
        }
        PrefillCache::Kda(c) => store_kda(be, topo, layouts, view, id, lease.slot, layer, c),
    }
}

/// Writes `buf` (`offs.len()` items of `values` values) as `dt` at `offs` of a
/// region: scattered in place from the backend buffer on a device region,
/// downloaded and written through the bytes of a host one.
#[allow(clippy::too_many_arguments)]
fn put_buf<B: Backend>(be: &B, view: &dyn RegionView, id: RankId, kind: RegionKind, offs: &[u64], values: usize, dt: Dtype, buf: &B::Buf) -> R<()> {
    let n = be.buf_len(buf);
    if n != offs.len() * values {
        return Err(ModelError::Region(format!("{id} {kind}: {n} values for {} items of {values}", offs.len())));
    }
    if let Some(reg) = view.device(id, kind) {
        return Ok(be.region_scatter(buf, reg, RegionItems { offsets: offs, values, dtype: storage(dt) })?);
    }
    let xs = be.download(buf)?;
    let all = vec![true; offs.len()];
    write_items(view, id, kind, offs, values * dt.bytes() as usize, values, &xs, &all, |x, o| dtype::encode(dt, x, o))
}

/// Writes one i32 per offset of a region (replay cursors), on a device or host region.
fn put_i32s<B: Backend>(be: &B, view: &dyn RegionView, id: RankId, kind: RegionKind, offs: &[u64], xs: &[i32]) -> R<()> {
    if let Some(reg) = view.device(id, kind) {
        let buf = be.upload_i32(xs)?;
        return Ok(be.region_scatter_i32(&buf, reg, offs)?);
    }
    regions::write(view, id, kind, |bytes| {
        for (&off, c) in offs.iter().zip(xs) {
            span_mut(bytes, id, kind, off, 4)?.copy_from_slice(&c.to_le_bytes());
        }
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
fn store_kda<B: Backend>(be: &B, topo: &Topology, layouts: &Layouts, view: &dyn RegionView, id: RankId, slot: u32, layer: usize, c: &KdaCache<B>) -> R<()> {
    let dt = topo.model().dtype;
    let kind = RegionKind::KdaState;
    put_buf(be, view, id, kind, &[unit(layouts, id, kind, layer, slot)?], be.buf_len(&c.state), Dtype::F32, &c.state)?;
    let kind = RegionKind::KdaConv;
    put_buf(be, view, id, kind, &[unit(layouts, id, kind, layer, slot)?], be.buf_len(&c.conv), dt, &c.conv)?;
    if topo.model().replay.is_some() {
        let kind = RegionKind::ReplayRecords;
        let off = unit(layouts, id, kind, layer, slot)?;
        let len = region(layouts, id, kind)?.unit_bytes as usize / 4;
        let n = be.buf_len(&c.records);
        if n > len {
            return Err(ModelError::Region(format!("{id} layer {layer}: {} records overflow the ring", c.record_tokens)));
        }
        // The whole ring: the records, then zeros.
        let mut ring = be.alloc(len)?;
        be.copy(&c.records, 0, &mut ring, 0, n)?;
        put_buf(be, view, id, kind, &[off], len, Dtype::F32, &ring)?;
        let kind = RegionKind::ReplayCursor;
        put_i32s(be, view, id, kind, &[unit(layouts, id, kind, layer, slot)?], &[c.record_tokens as i32])?;
    }
    Ok(())
}

/// The records prefill leaves for decode to replay: half the ring, at most the prompt.
pub fn prefill_record_tail(topo: &Topology, tokens: usize) -> usize {
    Dims::from_topology(topo).record_tail(tokens)
}

/// The decode TP group's caches of one batch of requests: every read and write
/// goes to a decode rank's own regions through `view`, and only to the bytes of
/// the batch's requests (their slots and their blocks).
pub struct DecodeRanks<'a> {
    topo: &'a Topology,
    layouts: &'a Layouts,
    view: &'a dyn RegionView,
    /// `leases[b][tp]`: request b's block table (grown to cover its position) and
    /// slot on decode TP rank tp.
    leases: Vec<Vec<Lease>>,
    dims: Dims,
}

impl<'a> DecodeRanks<'a> {
    /// The caches of the batch whose request b holds `leases[b][tp]` on decode TP
    /// rank tp, each lease already grown to cover the position b decodes.
    pub fn new(topo: &'a Topology, layouts: &'a Layouts, view: &'a dyn RegionView, leases: Vec<Vec<Lease>>) -> Self {
        DecodeRanks { topo, layouts, view, leases, dims: Dims::from_topology(topo) }
    }

    /// The batch's leases, `[request][tp]`.
    pub fn leases(&self) -> &[Vec<Lease>] {
        &self.leases
    }

    fn id(&self, rank: usize) -> R<RankId> {
        let tp = self.topo.decode().tp as usize;
        if rank >= tp {
            return Err(ModelError::Region(format!("decode tp rank {rank} outside tp {tp}")));
        }
        Ok(RankId::Decode(DecodeRank { tp: rank as u32 }))
    }

    /// Request b's lease on TP rank `rank`, checked to be that rank's.
    fn lease(&self, b: usize, rank: usize) -> R<&Lease> {
        let id = self.id(rank)?;
        let l = self.leases.get(b).and_then(|ls| ls.get(rank)).ok_or_else(|| ModelError::Region(format!("request {b} of the batch has no lease on {id}")))?;
        if l.rank != id {
            return Err(ModelError::Region(format!("request {b}'s lease for {id} is a lease on {}", l.rank)));
        }
        Ok(l)
    }

    /// Offsets of the batch's slots in `kind` of `layer` on `rank`.
    fn slot_offsets(&self, rank: usize, kind: RegionKind, layer: usize) -> R<Vec<u64>> {
        let id = self.id(rank)?;
        (0..self.leases.len()).map(|b| unit(self.layouts, id, kind, layer, self.lease(b, rank)?.slot)).collect()
    }

    /// The dcp rank owning position `pos`, and its local position there.
    fn local(&self, pos: usize) -> (usize, usize) {
        let d = self.topo.decode();
        let (s, dcp) = (d.interleave as usize, d.dcp as usize);
        ((pos / s) % dcp, (pos / (s * dcp)) * s + pos % s)
    }

    fn hl(&self) -> usize {
        self.topo.decode_heads() as usize
    }
}

/// Reads one `len`-byte item at each offset of a region, in one view call.
fn read_items(view: &dyn RegionView, id: RankId, kind: RegionKind, offs: &[u64], len: usize, decode: impl Fn(&[u8]) -> Vec<f32>) -> R<Vec<f32>> {
    regions::read(view, id, kind, |bytes| {
        let mut out = Vec::new();
        for &off in offs {
            out.extend(decode(span(bytes, id, kind, off, len)?));
        }
        Ok(out)
    })
}

/// Writes item i of `xs` (`len`-byte items, `per` values each) at `offs[i]` for
/// the items `which` says, in one view call.
#[allow(clippy::too_many_arguments)]
fn write_items(
    view: &dyn RegionView,
    id: RankId,
    kind: RegionKind,
    offs: &[u64],
    len: usize,
    per: usize,
    xs: &[f32],
    which: &[bool],
    encode: impl Fn(&[f32], &mut [u8]),
) -> R<()> {
    if !which.iter().any(|&w| w) {
        return Ok(());
    }
    regions::write(view, id, kind, |bytes| {
        for (i, &off) in offs.iter().enumerate() {
            if which[i] {
                encode(&xs[i * per..(i + 1) * per], span_mut(bytes, id, kind, off, len)?);
            }
        }
        Ok(())
    })
}

/// Items `offs` of a region (`values` values of `dt` each) as a backend buffer
/// `[items, values]`: gathered in place from a device region, read and uploaded
/// from a host one.
#[allow(clippy::too_many_arguments)]
fn get_items<B: Backend>(be: &B, view: &dyn RegionView, id: RankId, kind: RegionKind, offs: &[u64], values: usize, dt: Dtype) -> R<B::Buf> {
    if let Some(reg) = view.device(id, kind) {
        return Ok(be.region_gather(reg, RegionItems { offsets: offs, values, dtype: storage(dt) })?);
    }
    Ok(be.upload(&read_items(view, id, kind, offs, values * dt.bytes() as usize, |b| dtype::decode(dt, b))?)?)
}

/// One i32 per offset of a region (replay cursors), as a backend buffer.
fn get_i32s<B: Backend>(be: &B, view: &dyn RegionView, id: RankId, kind: RegionKind, offs: &[u64]) -> R<B::IBuf> {
    if let Some(reg) = view.device(id, kind) {
        return Ok(be.region_gather_i32(reg, offs)?);
    }
    let cursor = regions::read(view, id, kind, |bytes| {
        offs.iter().map(|&off| span(bytes, id, kind, off, 4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect::<R<Vec<i32>>>()
    })?;
    Ok(be.upload_i32(&cursor)?)
}

/// Writes rows `which` of `buf` (`[items, values]`) as `dt` at their offsets
/// `offs[i]` of a region: scattered in place on a device region (the chosen
/// rows gathered first when not all are), downloaded and written on a host one.
#[allow(clippy::too_many_arguments)]
fn set_items<B: Backend>(
    be: &B,
    view: &dyn RegionView,
    id: RankId,
    kind: RegionKind,
    offs: &[u64],
    values: usize,
    dt: Dtype,
    buf: &B::Buf,
    which: &[bool],
) -> R<()> {
    if !which.iter().any(|&w| w) {
        return Ok(());
    }
    if let Some(reg) = view.device(id, kind) {
        let dtype = storage(dt);
        if which.iter().all(|&w| w) {
            return Ok(be.region_scatter(buf, reg, RegionItems { offsets: offs, values, dtype })?);
        }
        let rows: Vec<usize> = (0..offs.len()).filter(|&i| which[i]).collect();
        let mut sub = be.alloc(rows.len() * values)?;
        for (j, &i) in rows.iter().enumerate() {
            be.copy(buf, i * values, &mut sub, j * values, values)?;
        }
        let sub_offs: Vec<u64> = rows.iter().map(|&i| offs[i]).collect();
        return Ok(be.region_scatter(&sub, reg, RegionItems { offsets: &sub_offs, values, dtype })?);
    }
    let xs = be.download(buf)?;
    write_items(view, id, kind, offs, values * dt.bytes() as usize, values, &xs, which, |x, o| dtype::encode(dt, x, o))
}

impl<B: Backend> BatchCaches<B> for DecodeRanks<'_> {
    fn batch(&self) -> usize {
        self.leases.len()
    }

    fn dcp(&self) -> usize {
        self.topo.decode().dcp as usize
    }

    fn kda_load(&mut self, be: &B, rank: usize, layer: usize) -> R<KdaBatch<B>> {
        let id = self.id(rank)?;
        let d = &self.dims;
        let hl = self.hl();
        let view = self.view;
        let state = get_items(be, view, id, RegionKind::KdaState, &self.slot_offsets(rank, RegionKind::KdaState, layer)?, hl * d.dk * d.dv, Dtype::F32)?;
        let conv_values = (d.conv - 1) * d.conv_channels(hl);
        let conv = get_items(be, view, id, RegionKind::KdaConv, &self.slot_offsets(rank, RegionKind::KdaConv, layer)?, conv_values, d.dtype)?;
        let replay = match d.replay {
            None => None,
            Some(capacity) => {
                let ring_values = capacity * hl * d.record_width();
                let ring =
                    get_items(be, view, id, RegionKind::ReplayRecords, &self.slot_offsets(rank, RegionKind::ReplayRecords, layer)?, ring_values, Dtype::F32)?;
                let cursor = get_i32s(be, view, id, RegionKind::ReplayCursor, &self.slot_offsets(rank, RegionKind::ReplayCursor, layer)?)?;
                Some(ReplayBatch { ring, cursor })
            }
        };
        Ok(KdaBatch { state, conv, replay })
    }

    fn kda_store(&mut self, be: &B, rank: usize, layer: usize, kda: &KdaBatch<B>, state_changed: &[bool]) -> R<()> {
        let id = self.id(rank)?;
        let nb = self.leases.len();
        if state_changed.len() != nb {
            return Err(ModelError::Region(format!("{id}: {} state flags for a batch of {nb}", state_changed.len())));
        }
        let d = &self.dims;
        let hl = self.hl();
        let view = self.view;
        let all = vec![true; nb];
        let offs = self.slot_offsets(rank, RegionKind::KdaState, layer)?;
        set_items(be, view, id, RegionKind::KdaState, &offs, hl * d.dk * d.dv, Dtype::F32, &kda.state, state_changed)?;
        let offs = self.slot_offsets(rank, RegionKind::KdaConv, layer)?;
        set_items(be, view, id, RegionKind::KdaConv, &offs, (d.conv - 1) * d.conv_channels(hl), d.dtype, &kda.conv, &all)?;
        if let (Some(rb), Some(capacity)) = (&kda.replay, d.replay) {
            let offs = self.slot_offsets(rank, RegionKind::ReplayRecords, layer)?;
            set_items(be, view, id, RegionKind::ReplayRecords, &offs, capacity * hl * d.record_width(), Dtype::F32, &rb.ring, &all)?;
            let kind = RegionKind::ReplayCursor;
            let offs = self.slot_offsets(rank, kind, layer)?;
            match view.device(id, kind) {
                Some(reg) => be.region_scatter_i32(&rb.cursor, reg, &offs)?,
                None => put_i32s(be, view, id, kind, &offs, &be.download_i32(&rb.cursor)?)?,
            }
        }
        Ok(())
    }

    fn mla_rows(&mut self, be: &B, rank: usize, layer: usize, positions: &[usize], new_rows: &B::Buf) -> R<(B::Buf, Vec<usize>)> {
        let d = self.topo.decode();
        let id = self.id(rank)?;
        let kind = RegionKind::MlaKv;
        let l = region(self.layouts, id, kind)?;
        let tb = l.token_bytes as usize;
        let (dt, w) = (self.dims.dtype, self.dims.row_width());
        if be.buf_len(new_rows) != positions.len() * w || positions.len() != self.leases.len() {
            return Err(ModelError::Region(format!(
                "{id}: {} rows for {} positions of a batch of {}",
                be.buf_len(new_rows) / w.max(1),
                positions.len(),
                self.leases.len()
            )));
        }
        let dr = DecodeRank { tp: rank as u32 }.dcp_rank(d.dcp) as usize;
        // The new rows this rank owns, and where they go; then every row it holds.
        let mut mine = Vec::new();
        for (b, &pos) in positions.iter().enumerate() {
            let (owner, lp) = self.local(pos);
            if owner == dr {
                mine.push((b, row_offset(l, id, &self.lease(b, rank)?.blocks, layer, lp)?));
            }
        }
        let counts: Vec<usize> = positions.iter().map(|&p| owned_tokens(p as u64 + 1, d.dcp, dr as u32, d.interleave) as usize).collect();
        let mut offs = Vec::with_capacity(counts.iter().sum());
        for (b, &n) in counts.iter().enumerate() {
            let blocks = &self.lease(b, rank)?.blocks;
            for lp in 0..n {
                offs.push(row_offset(l, id, blocks, layer, lp)?);
            }
        }
        if self.view.device(id, kind).is_some() {
            // In place: scatter the owned new rows, then gather every held row
            // (one stream, so the gather sees the scatter).
            let mut which = vec![false; positions.len()];
            let mut at = vec![0u64; positions.len()];
            for &(b, off) in &mine {
                which[b] = true;
                at[b] = off;
            }
            set_items(be, self.view, id, kind, &at, w, dt, new_rows, &which)?;
            let rows = get_items(be, self.view, id, kind, &offs, w, dt)?;
            return Ok((rows, counts));
        }
        let new_rows = be.download(new_rows)?;
        let rows = regions::write(self.view, id, kind, |bytes| {
            for &(b, off) in &mine {
                dtype::encode(dt, &new_rows[b * w..(b + 1) * w], span_mut(bytes, id, kind, off, tb)?);
            }
            let mut rows = Vec::with_capacity(offs.len() * w);
            for &off in &offs {
                rows.extend(dtype::decode(dt, span(bytes, id, kind, off, tb)?));
            }
            Ok(rows)
        })?;
        Ok((be.upload(&rows)?, counts))
    }
}

/// The caches a single-rank decode (TP1 x DCP1) holds for one request before
/// the step at position `pos`, read back from its regions: per layer the KDA
/// state, conv state (decoded to f32) and ReplaySSM ring and cursor, or the
/// MLA rows of positions `0 .. pos`. The check of a device run against the CPU
/// (verify) re-runs the step on the CPU from exactly these bytes.
pub fn snapshot_single_rank(topo: &Topology, layouts: &Layouts, view: &dyn RegionView, lease: &Lease, pos: usize) -> R<super::reference::LocalRequest> {
    let d = topo.decode();
    if d.tp != 1 || d.dcp != 1 {
        return Err(ModelError::Region(format!("a single-rank snapshot of a decode of tp {} x dcp {}", d.tp, d.dcp)));
    }
    let dims = Dims::from_topology(topo);
    let id = RankId::Decode(DecodeRank { tp: 0 });
    let dt = dims.dtype;
    let f32s = |b: Vec<u8>| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
    let (mut kda, mut mla) = (Vec::new(), Vec::new());
    for (layer, kind) in dims.layer_kinds.iter().enumerate() {
        match kind {
            handoff_components::vocab::LayerKind::Kda => {
                let c = dims.conv_channels(dims.kda_heads);
                let state = f32s(view.read_bytes(
                    id,
                    RegionKind::KdaState,
                    unit(layouts, id, RegionKind::KdaState, layer, lease.slot)?,
                    dims.kda_heads * dims.dk * dims.dv * 4,
                )?);
                let conv_len = (dims.conv - 1) * c * dt.bytes() as usize;
                let conv = dtype::decode(dt, &view.read_bytes(id, RegionKind::KdaConv, unit(layouts, id, RegionKind::KdaConv, layer, lease.slot)?, conv_len)?);
                let replay = match dims.replay {
                    None => None,
                    Some(cap) => {
                        let ring_len = cap * dims.kda_heads * dims.record_width() * 4;
                        let ring =
                            f32s(view.read_bytes(id, RegionKind::ReplayRecords, unit(layouts, id, RegionKind::ReplayRecords, layer, lease.slot)?, ring_len)?);
                        let cur = view.read_bytes(id, RegionKind::ReplayCursor, unit(layouts, id, RegionKind::ReplayCursor, layer, lease.slot)?, 4)?;
                        Some((ring, i32::from_le_bytes([cur[0], cur[1], cur[2], cur[3]])))
                    }
                };
                kda.push(Some((state, conv, replay)));
                mla.push(Vec::new());
            }
            handoff_components::vocab::LayerKind::Mla => {
                let l = region(layouts, id, RegionKind::MlaKv)?;
                let mut rows = Vec::with_capacity(pos * dims.row_width());
                for lp in 0..pos {
                    let off = row_offset(l, id, &lease.blocks, layer, lp)?;
                    rows.extend(dtype::decode(dt, &view.read_bytes(id, RegionKind::MlaKv, off, l.token_bytes as usize)?));
                }
                kda.push(None);
                mla.push(rows);
            }
        }
    }
    Ok(super::reference::LocalRequest::from_parts(kda, mla))
}
