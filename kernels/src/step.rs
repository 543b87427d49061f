//! The fused decode step, described as plain data: the model's weights (whole,
//! not sharded), where every decode rank's registered regions lie, and the
//! per-step tick the host uploads. A backend that can run a decode step
//! without the host in the loop ([`crate::Backend::decode_step`]) builds a
//! [`DecodeStep`] from a [`StepSpec`]; the CUDA and HIP backends do, through
//! one launch table (`gpu/step_gpu/` and `hip/step.hip`), the CPU runs the
//! generic forward pass instead.
//!
//! What a step is: one fixed sequence of launches over a whole batch bucket
//! (the batch padded to the next of [`StepSpec::buckets`]), every op one
//! launch for every request, the KV cache and the KDA state read and written
//! in place through slot and block tables on the device, and one upload (the
//! tick) and one download (the picks) per step. The decode group's TP ranks
//! run as one launch per op: each rank's state stays in its own regions (a
//! head's state is read from the region of the rank that holds the head), the
//! products use the whole weights, and the reductions that a TP all-reduce
//! splits (o_proj over heads, the MLP's down projection over its units) sum
//! those units in the same global order at every TP degree, so a request's
//! bits do not depend on TP, DCP or its batch (MLA attention merges its DCP
//! partials in f64, as the generic path does).
//!
//! Dense products: tensor-core bf16 operands with f32 accumulation, the inner
//! dimension in fixed segments summed in order (see `hip/step_mm.hip`). Weights are
//! held as [`WeightDtype`] says; activations are split into a bf16 pair
//! (x_hi + x_lo, 16 significant bits) so that a bf16 model multiplies f32
//! activations by its bf16 weights, and an f32 model's weights are a bf16 pair
//! too. [`WeightDtype::round`] is what the CPU reference applies to the weights
//! so that both sides multiply by the same numbers.

use crate::dtype::{StorageDtype, bf16_to_f32, f32_to_bf16};
use crate::error::{KernelError, Result};

/// How the dense products hold their weights on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// A bf16 pair per weight (w_hi + w_lo, 16 significant bits: 4 bytes, as
    /// f32), three tensor-core products per k-step.
    #[default]
    F32,
    /// One bf16 per weight (2 bytes), two products per k-step.
    Bf16,
}

impl WeightDtype {
    /// bf16 planes a weight takes on the device.
    pub fn planes(self) -> usize {
        match self {
            WeightDtype::F32 => 2,
            WeightDtype::Bf16 => 1,
        }
    }

    /// Tensor-core products per k-step (x_hi w_hi, x_lo w_hi, x_hi w_lo).
    pub fn terms(self) -> u32 {
        match self {
            WeightDtype::F32 => 3,
            WeightDtype::Bf16 => 2,
        }
    }

    /// The bf16 planes of `w`: (hi, lo), lo 0 for a bf16 weight.
    pub fn split(self, w: f32) -> (u16, u16) {
        let hi = f32_to_bf16(w);
        match self {
            WeightDtype::Bf16 => (hi, 0),
            WeightDtype::F32 => (hi, f32_to_bf16(w - bf16_to_f32(hi))),
        }
    }

    /// The value the device multiplies by in place of `w` (hi + lo, exact in
    /// f32): what the CPU reference rounds its weights to.
    pub fn round(self, w: f32) -> f32 {
        let (hi, lo) = self.split(w);
        bf16_to_f32(hi) + bf16_to_f32(lo)
    }

    /// The name in the topology file (`[model] weight_dtype`).
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
        }
    }
}

/// A dense weight of the step: `groups` matrices `[inner, cols]` (row-major, in
/// `data` one after the other), each product's inner dimension cut into
/// `segments` equal ranges summed in order.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMat {
    pub groups: usize,
    pub inner: usize,
    pub cols: usize,
    pub segments: usize,
    pub data: Vec<f32>,
}

impl StepMat {
    /// One matrix, segments chosen from its shape ([`auto_segments`]).
    pub fn plain(inner: usize, cols: usize, data: Vec<f32>) -> StepMat {
        StepMat { groups: 1, inner, cols, segments: auto_segments(1, inner, cols), data }
    }

    /// One matrix whose inner dimension is `units` reduction units (heads, MLP
    /// units): one segment a unit, summed in unit order like the all-reduce.
    pub fn units(inner: usize, cols: usize, units: usize, data: Vec<f32>) -> StepMat {
        StepMat { groups: 1, inner, cols, segments: units.max(1), data }
    }

    /// `groups` matrices of one shape (the per-head W_UK, W_UV).
    pub fn grouped(groups: usize, inner: usize, cols: usize, data: Vec<f32>) -> StepMat {
        StepMat { groups, inner, cols, segments: auto_segments(groups, inner, cols), data }
    }

    /// Inner rows of one segment.
    pub fn unit(&self) -> usize {
        self.inner / self.segments.max(1)
    }

    /// A segment's inner rows padded to whole 16-row k-steps.
    pub fn unit_padded(&self) -> usize {
        self.unit().next_multiple_of(16)
    }

    /// 16-row k tiles of the packed operand: every segment padded on its own,
    /// so that a k-step never spans two reduction units.
    pub fn kt(&self) -> usize {
        self.segments * self.unit_padded() / 16
    }

    /// Packed inner row of logical inner row `k` (see [`padded_k`]).
    pub fn kp(&self, k: usize) -> usize {
        padded_k(k, self.unit(), self.unit_padded())
    }

    /// 16-column tiles.
    pub fn nt(&self) -> usize {
        self.cols.div_ceil(16)
    }

    fn check(&self, what: &str) -> Result<()> {
        let bad = |reason: String| Err(KernelError::InvalidShape { op: "decode_step", reason: format!("{what}: {reason}") });
        if self.inner == 0 || self.cols == 0 || self.groups == 0 {
            return bad(format!("empty product [{} x {}] x {}", self.inner, self.cols, self.groups));
        }
        if self.data.len() != self.groups * self.inner * self.cols {
            return bad(format!("{} values for {} x [{} x {}]", self.data.len(), self.groups, self.inner, self.cols));
        }
        if self.segments == 0 || !self.inner.is_multiple_of(self.segments) {
            return bad(format!("{} reduction units do not cut an inner dimension of {} into equal ranges", self.segments, self.inner));
        }
        Ok(())
    }
}

/// Segments of a product from its shape alone (never from the batch): split
/// the inner dimension in halves while each segment keeps at least 8 k-steps
/// and the product has fewer than 2048 warp tiles, so that a decode step's few
/// rows still spread the weight reads over the whole device.
pub fn auto_segments(groups: usize, inner: usize, cols: usize) -> usize {
    if !inner.is_multiple_of(16) {
        return 1;
    }
    let kt = inner / 16;
    let tiles = groups * cols.div_ceil(16);
    let mut s = 1;
    while kt.is_multiple_of(s * 2) && kt / (s * 2) >= 8 && tiles * s < 2048 {
        s *= 2;
    }
    s
}

/// Where logical inner row `k` sits in an operand whose inner dimension is cut
/// into units of `unit` rows, each padded to `padded` (a multiple of 16): the
/// padding rows are zero weights, so whatever the activation holds there adds
/// nothing.
pub fn padded_k(k: usize, unit: usize, padded: usize) -> usize {
    (k / unit.max(1)) * padded + k % unit.max(1)
}

/// bf16 element index of `A[m][k]` in one plane of a packed activation
/// operand with `kt` 16-wide k tiles (hip/prelude.h's `st_a_at`): tile (m / 16,
/// k / 16) of 256 values, then its four 8 x 8 core matrices (rows 0-7 then
/// 8-15, each k 0-7 then 8-15), a row's 8 k contiguous: wgmma's K-major layout,
/// from which the mma.sync kernels gather their fragments ([`a_frag_word`]).
pub fn a_index(m: usize, k: usize, kt: usize) -> usize {
    let (mt, r, ktile, c) = (m >> 4, m & 15, k >> 4, k & 15);
    (mt * kt + ktile) * 256 + (r >> 3) * 128 + (c >> 3) * 64 + (r & 7) * 8 + (c & 7)
}

/// The 32-bit word of a packed A tile that holds register `reg` of lane
/// `lane`'s mma.sync A fragment (prelude.h's `st_a_frag`).
pub fn a_frag_word(lane: usize, reg: usize) -> usize {
    lane + [0, 64, 32, 96][reg]
}

/// bf16 element index of `W[k][n]` in one plane of a packed weight with `kt` k
/// tiles: tile (n / 16, k / 16) (a warp walking k reads consecutive tiles),
/// then the lane and register of the two n8 B fragments.
pub fn b_index(k: usize, n: usize, kt: usize) -> usize {
    let (nt, nn, ktile, kk) = (n >> 4, n & 15, k >> 4, k & 15);
    let (half, g, kh, kc) = (nn >> 3, nn & 7, kk >> 3, kk & 7);
    let lane = g * 4 + (kc >> 1);
    let reg = half * 2 + kh;
    (((nt * kt + ktile) * 32 + lane) * 4 + reg) * 2 + (kc & 1)
}

/// bf16 values of one plane of one group of a packed weight.
pub fn plane_len(m: &StepMat) -> usize {
    m.nt() * m.kt() * 256
}

/// The device image of a weight: per group, `dtype.planes()` planes of
/// [`plane_len`] bf16 values (columns past `cols` are zeros).
pub fn pack_weight(m: &StepMat, dtype: WeightDtype) -> Vec<u16> {
    let (kt, pl, planes) = (m.kt(), plane_len(m), dtype.planes());
    let mut out = vec![0u16; m.groups * planes * pl];
    for g in 0..m.groups {
        let w = &m.data[g * m.inner * m.cols..(g + 1) * m.inner * m.cols];
        let base = g * planes * pl;
        for k in 0..m.inner {
            let kp = m.kp(k);
            for n in 0..m.cols {
                let (hi, lo) = dtype.split(w[k * m.cols + n]);
                let at = b_index(kp, n, kt);
                out[base + at] = hi;
                if planes > 1 {
                    out[base + pl + at] = lo;
                }
            }
        }
    }
    out
}

/// One KDA layer of the step (weights of the whole model, every head).
#[derive(Debug, Clone, PartialEq)]
pub struct StepKda {
    /// `[hidden, C + H*Dk + H + H*Dv]`: wqkv (C = H * (2 Dk + Dv), q | k | v of
    /// every head), then the decay logits wg, the beta logits wb, the output
    /// gate wgate: one product for everything the layer's input feeds.
    pub in_proj: StepMat,
    /// Depthwise conv `[C, W]`, the columns of wqkv.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    /// `[H * Dk]`.
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight `[Dv]`.
    pub onorm: Vec<f32>,
    /// `[H*Dv, hidden]`, one reduction unit a head.
    pub wo: StepMat,
}

/// One MLA layer of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMla {
    /// `[hidden, L + R + Hm (Dn + R)]`: wkva, then wq.
    pub in_proj: StepMat,
    /// `[L]`.
    pub kv_norm: Vec<f32>,
    /// Hm groups of `[Dn, L]`.
    pub wuk: StepMat,
    /// Hm groups of `[L, Dvh]`.
    pub wuv: StepMat,
    /// `[Hm*Dvh, hidden]`, one unit a head.
    pub wo: StepMat,
}

/// The mixer of one layer.
#[derive(Debug, Clone, PartialEq)]
pub enum StepMixer {
    Kda(StepKda),
    Mla(StepMla),
}

/// One layer: norms, mixer, SwiGLU MLP.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLayer {
    pub attn_norm: Vec<f32>,
    pub mlp_norm: Vec<f32>,
    pub mixer: StepMixer,
    /// `[hidden, 16 ceil(I / 8)]`: gate and up interleaved in blocks of 8
    /// channels (columns 16q .. 16q + 7 the gate of channels 8q .., the next 8
    /// their up), so one 16-column tile holds what SwiGLU combines.
    pub gate_up: StepMat,
    /// `[I, hidden]`, one unit per MLP reduction unit.
    pub down: StepMat,
}

/// The whole model as the step computes it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepModel {
    pub hidden: usize,
    pub vocab: usize,
    pub intermediate: usize,
    pub kda_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub conv: usize,
    pub mla_heads: usize,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    pub nope_dim: usize,
    pub v_head_dim: usize,
    /// ReplaySSM ring capacity (0: no replay).
    pub replay: usize,
    pub eps: f32,
    /// Absorbed MLA softmax scale.
    pub mla_scale: f32,
    pub weights: WeightDtype,
    /// Storage dtype of the MLA rows and the conv state.
    pub cache: StorageDtype,
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    pub final_norm: Vec<f32>,
    /// `[hidden, vocab]`.
    pub lm_head: StepMat,
    pub layers: Vec<StepLayer>,
}

/// One registered region of a decode rank as the step reaches it: the device
/// address, its length, the bytes between units (slots or blocks) and the row
/// offset of each module layer (None where the region has no row for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRegion {
    pub addr: u64,
    pub len: u64,
    pub unit_stride: u64,
    pub units: u32,
    pub rows: Vec<Option<u64>>,
}

impl StepRegion {
    /// Device address of module layer `layer`'s row.
    pub fn row(&self, layer: usize) -> Result<u64> {
        match self.rows.get(layer).copied().flatten() {
            Some(off) => Ok(self.addr + off),
            None => Err(KernelError::InvalidShape { op: "decode_step", reason: format!("a region has no row for module layer {layer}") }),
        }
    }
}

/// The regions of one decode rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRank {
    pub state: StepRegion,
    pub conv: StepRegion,
    /// ReplaySSM ring and cursor (with `[model.replay]`).
    pub ring: Option<StepRegion>,
    pub cursor: Option<StepRegion>,
    pub mla: StepRegion,
}

/// Where the decode ranks keep what the step reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlacement {
    pub tp: usize,
    pub dcp: usize,
    pub interleave: usize,
    /// Decode block size (tokens).
    pub block_size: usize,
    /// Bytes of one MLA row (L + R values of the cache dtype).
    pub token_bytes: usize,
    /// Longest prompt + generated tokens of one request.
    pub max_context: usize,
    pub ranks: Vec<StepRank>,
}

/// Choices of the step that change its speed, never its bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepOptions {
    /// Most requests in one step.
    pub max_batch: usize,
    /// Capture each batch bucket as a CUDA graph and replay it.
    pub graphs: bool,
    /// Launch each kernel of the step as a programmatic dependent of the one
    /// before, where the device has it (CUDA, sm_90 and later): the next
    /// kernel's launch overlaps the last blocks of the one before.
    pub dependent_launch: bool,
}

/// Everything a backend needs to build a decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSpec {
    pub model: StepModel,
    pub place: StepPlacement,
    pub options: StepOptions,
}

/// One request of a step: feed `token` at position `pos`; its slot and block
/// table on each decode TP rank (in rank order; the blocks cover `pos`).
#[derive(Debug, Clone, Copy)]
pub struct StepRequest<'a> {
    pub token: u32,
    pub pos: u64,
    pub slots: &'a [u32],
    pub blocks: &'a [&'a [u32]],
}

/// The batch buckets of a step of at most `max_batch` requests: powers of two
/// up to it, and `max_batch` itself. A batch runs padded to the smallest
/// bucket that holds it.
pub fn buckets(max_batch: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..).map(|i| 1usize << i).take_while(|&b| b < max_batch).collect();
    v.push(max_batch.max(1));
    v
}

/// The bucket a batch of `n` runs in.
pub fn bucket_of(buckets: &[usize], n: usize) -> Option<usize> {
    buckets.iter().copied().find(|&b| b >= n)
}

/// Offsets of the tick table (hip/step.hip's header comment), for `bmax`
/// requests on `tp` ranks with at most `maxblk` blocks each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickLayout {
    pub bmax: usize,
    pub tp: usize,
    pub maxblk: usize,
}

impl TickLayout {
    pub fn tok(&self) -> usize {
        1
    }
    pub fn pos(&self) -> usize {
        1 + self.bmax
    }
    pub fn slot(&self) -> usize {
        1 + 2 * self.bmax
    }
    pub fn blk(&self) -> usize {
        self.slot() + self.bmax * self.tp
    }
    pub fn len(&self) -> usize {
        self.blk() + self.tp * self.bmax * self.maxblk
    }
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Writes `batch` into `out` (length [`TickLayout::len`]), checking every
    /// index against `bounds`: tokens in the vocabulary, positions within the
    /// context, slots and blocks within the regions. Padding rows get token 0,
    /// position 0, slot 0 and block 0 (they touch no region: every kernel that
    /// reaches one stops at the live count).
    pub fn fill(&self, batch: &[StepRequest<'_>], bounds: TickBounds, out: &mut [i32]) -> Result<()> {
        let TickBounds { vocab, max_context, slots, blocks } = bounds;
        let op = "decode_step";
        if out.len() != self.len() {
            return Err(KernelError::ShapeMismatch { op, name: "tick", expected: self.len(), got: out.len() });
        }
        if batch.len() > self.bmax {
            return Err(KernelError::InvalidShape { op, reason: format!("a batch of {} requests, more than the step's {}", batch.len(), self.bmax) });
        }
        out.fill(0);
        out[0] = batch.len() as i32;
        for (b, q) in batch.iter().enumerate() {
            if q.token as usize >= vocab {
                return Err(KernelError::IndexOutOfRange { op, what: "token id", index: q.token as i64, position: b, bound: vocab });
            }
            if q.pos as usize >= max_context {
                return Err(KernelError::IndexOutOfRange { op, what: "position", index: q.pos as i64, position: b, bound: max_context });
            }
            if q.slots.len() != self.tp || q.blocks.len() != self.tp {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: format!("request {b}: {} slots and {} block tables for {} ranks", q.slots.len(), q.blocks.len(), self.tp),
                });
            }
            out[self.tok() + b] = q.token as i32;
            out[self.pos() + b] = q.pos as i32;
            for r in 0..self.tp {
                let s = q.slots[r];
                if s >= slots {
                    return Err(KernelError::IndexOutOfRange { op, what: "slot", index: s as i64, position: b, bound: slots as usize });
                }
                out[self.slot() + b * self.tp + r] = s as i32;
                let table = q.blocks[r];
                if table.len() > self.maxblk {
                    return Err(KernelError::InvalidShape {
                        op,
                        reason: format!("request {b} holds {} blocks on rank {r}, more than {}", table.len(), self.maxblk),
                    });
                }
                for (i, &blk) in table.iter().enumerate() {
                    if blk >= blocks {
                        return Err(KernelError::IndexOutOfRange { op, what: "block", index: blk as i64, position: b, bound: blocks as usize });
                    }
                    out[self.blk() + (r * self.bmax + b) * self.maxblk + i] = blk as i32;
                }
            }
        }
        Ok(())
    }
}

/// What every index of a tick must stay below: the vocabulary, the context,
/// the slots and the blocks of the decode regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickBounds {
    pub vocab: usize,
    pub max_context: usize,
    pub slots: u32,
    pub blocks: u32,
}

impl StepSpec {
    /// Rows of a chunk of the MLA partials (each chunk one block per head).
    pub const MLA_CHUNK: usize = 64;

    /// The batch buckets of this step.
    pub fn buckets(&self) -> Vec<usize> {
        buckets(self.options.max_batch)
    }

    /// Blocks one request holds on one rank at most.
    pub fn max_blocks(&self) -> usize {
        let p = &self.place;
        let local = p.max_context.div_ceil(p.dcp.max(1) * p.interleave.max(1)) * p.interleave.max(1);
        local.div_ceil(p.block_size.max(1)) + 1
    }

    /// Chunks of the MLA partials one request's DCP member has at most.
    pub fn max_chunks(&self) -> usize {
        self.max_blocks() * self.place.block_size / Self::MLA_CHUNK + 1
    }

    /// The tick table of this step.
    pub fn tick_layout(&self) -> TickLayout {
        TickLayout { bmax: self.options.max_batch, tp: self.place.tp, maxblk: self.max_blocks() }
    }

    /// KDA heads per decode rank.
    pub fn heads_per_rank(&self) -> usize {
        self.model.kda_heads / self.place.tp.max(1)
    }

    /// Refuses what the fused step cannot run, naming the values: product
    /// shapes the tensor cores cannot tile, a key width past one block of the
    /// KDA kernel, ranks whose layouts differ, regions that miss a layer.
    pub fn check(&self) -> Result<()> {
        let bad = |reason: String| Err(KernelError::InvalidShape { op: "decode_step", reason });
        let m = &self.model;
        let p = &self.place;
        if p.tp == 0 || p.dcp == 0 || !p.tp.is_multiple_of(p.dcp) || p.ranks.len() != p.tp {
            return bad(format!("tp {} with dcp {} over {} ranks", p.tp, p.dcp, p.ranks.len()));
        }
        if !m.kda_heads.is_multiple_of(p.tp) || !m.mla_heads.is_multiple_of(p.tp) {
            return bad(format!("{} KDA and {} MLA heads over tp {}", m.kda_heads, m.mla_heads, p.tp));
        }
        if m.dk == 0 || m.dk > 128 || m.dv == 0 {
            return bad(format!("KDA heads of {} x {}: the fused step keeps at most 128 key rows a head", m.dk, m.dv));
        }
        if m.conv == 0 {
            return bad("conv kernel 0".into());
        }
        if m.kv_lora_rank == 0 || m.kv_lora_rank > 512 {
            return bad(format!("kv_lora_rank {}: the fused step's MLA merge holds a latent of at most 512", m.kv_lora_rank));
        }
        if self.options.max_batch == 0 {
            return bad("max_batch 0".into());
        }
        m.lm_head.check("lm_head")?;
        for (i, l) in m.layers.iter().enumerate() {
            l.gate_up.check(&format!("layer {i} gate|up"))?;
            l.down.check(&format!("layer {i} down"))?;
            match &l.mixer {
                StepMixer::Kda(k) => {
                    k.in_proj.check(&format!("layer {i} KDA input projections"))?;
                    k.wo.check(&format!("layer {i} KDA o_proj"))?;
                }
                StepMixer::Mla(a) => {
                    a.in_proj.check(&format!("layer {i} MLA input projections"))?;
                    a.wuk.check(&format!("layer {i} W_UK"))?;
                    a.wuv.check(&format!("layer {i} W_UV"))?;
                    a.wo.check(&format!("layer {i} MLA o_proj"))?;
                }
            }
        }
        let first = &p.ranks[0];
        let same = |a: &StepRegion, b: &StepRegion| a.unit_stride == b.unit_stride && a.units == b.units && a.rows == b.rows;
        for (r, rk) in p.ranks.iter().enumerate() {
            let ok = same(&rk.state, &first.state)
                && same(&rk.conv, &first.conv)
                && same(&rk.mla, &first.mla)
                && rk.ring.is_some() == (m.replay > 0)
                && rk.cursor.is_some() == (m.replay > 0)
                && match (&rk.ring, &first.ring) {
                    (Some(a), Some(b)) => same(a, b),
                    _ => true,
                }
                && match (&rk.cursor, &first.cursor) {
                    (Some(a), Some(b)) => same(a, b),
                    _ => true,
                };
            if !ok {
                return bad(format!("decode rank {r}'s regions are laid out unlike rank 0's (the fused step addresses every rank alike)"));
            }
        }
        for (i, l) in m.layers.iter().enumerate() {
            let region = match l.mixer {
                StepMixer::Kda(_) => &first.state,
                StepMixer::Mla(_) => &first.mla,
            };
            region.row(i)?;
        }
        Ok(())
    }
}

/// A decode step a backend built from a [`StepSpec`]: it owns its weights on
/// the device, its workspace (sized once for the largest bucket) and, on CUDA,
/// one captured graph per bucket.
pub trait DecodeStep: Send {
    /// One step for `batch` (at most `max_batch` requests): each request's
    /// greedy pick, in batch order. `logits`, when given, receives the batch's
    /// logits `[B, vocab]` (one more download).
    fn run(&mut self, batch: &[StepRequest<'_>], logits: Option<&mut Vec<f32>>) -> Result<Vec<u32>>;

    /// One line for logs and `check`: launches a step, buckets, graphs.
    fn describe(&self) -> String;

    /// Turns graph replay on or off (the launches and their bits are the same).
    fn set_graphs(&mut self, on: bool);

    /// Turns programmatic dependent launches on or off where the device has
    /// them (the launches and their bits are the same; graphs are captured
    /// again).
    fn set_dependent_launch(&mut self, on: bool);

    /// Kernel launches of one step.
    fn launches(&self) -> usize;

    /// Runs one step for `batch` with every launch timed on its own (device
    /// events around each), and returns the time per kernel: where a step's
    /// microseconds go. The launches are those of the step (the bits are too).
    fn profile(&mut self, batch: &[StepRequest<'_>]) -> Result<Vec<KernelTime>>;
}

/// One kernel's share of a profiled step: its launches and their device time.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: &'static str,
    pub launches: usize,
    pub us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// The A operand register of lane `lane` for (row-half, col-half) as the
    /// PTX ISA lays out mma.m16n8k16's A fragment: a0..a3 = (g, 2t..), (g + 8,
    /// 2t..), (g, 2t + 8..), (g + 8, 2t + 8..).
    fn a_elem(lane: usize, reg: usize, half: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        let row = g + 8 * (reg & 1);
        let col = 2 * t + half + 8 * (reg >> 1);
        (row, col)
    }

    /// B fragment: b0 = (k 2t.., n g), b1 = (k 2t + 8.., n g).
    fn b_elem(lane: usize, reg: usize, half: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        (2 * t + half + 8 * reg, g)
    }

    /// The packed operands, read back lane by lane in the fragment layout of
    /// the PTX ISA and multiplied as the tensor cores would (C fragment:
    /// (g, 2t..), (g + 8, 2t..)), give A . W: the index functions the kernels
    /// and the packer share agree with the hardware's fragments.
    #[test]
    #[allow(clippy::needless_range_loop)] // indices of fragment rows and columns
    fn packed_fragments_multiply_to_the_matrix_product() {
        let (m, k, n) = (37usize, 48usize, 40usize);
        let mut rng = SplitMix64::new(3);
        let a: Vec<f32> = (0..m * k).map(|_| bf16_to_f32(f32_to_bf16(rng.next_f32() - 0.5))).collect();
        let w: Vec<f32> = (0..k * n).map(|_| bf16_to_f32(f32_to_bf16(rng.next_f32() - 0.5))).collect();
        let kt = k / 16;
        let mut pa = vec![0u16; m.div_ceil(16) * kt * 256];
        for i in 0..m {
            for j in 0..k {
                pa[a_index(i, j, kt)] = f32_to_bf16(a[i * k + j]);
            }
        }
        let mat = StepMat::plain(k, n, w.clone());
        let pw = pack_weight(&mat, WeightDtype::Bf16);
        let mut got = vec![0.0f64; m * n];
        for mt in 0..m.div_ceil(16) {
            for nt in 0..n.div_ceil(16) {
                for ktile in 0..kt {
                    let ta = (mt * kt + ktile) * 256;
                    let tb = (nt * kt + ktile) * 256;
                    for half_n in 0..2 {
                        // One m16n8k16: D[row][col] = sum over k.
                        let mut afull = [[0.0f64; 16]; 16];
                        let mut bfull = [[0.0f64; 8]; 16];
                        for lane in 0..32 {
                            for reg in 0..4 {
                                for h in 0..2 {
                                    let (r, c) = a_elem(lane, reg, h);
                                    afull[r][c] = bf16_to_f32(pa[ta + a_frag_word(lane, reg) * 2 + h]) as f64;
                                }
                            }
                            for reg in 0..2 {
                                for h in 0..2 {
                                    let (kk, nn) = b_elem(lane, reg, h);
                                    bfull[kk][nn] = bf16_to_f32(pw[tb + (lane * 4 + half_n * 2 + reg) * 2 + h]) as f64;
                                }
                            }
                        }
                        for r in 0..16 {
                            for c in 0..8 {
                                let (gi, gj) = (mt * 16 + r, nt * 16 + half_n * 8 + c);
                                if gi < m && gj < n {
                                    got[gi * n + gj] += (0..16).map(|x| afull[r][x] * bfull[x][c]).sum::<f64>();
                                }
                            }
                        }
                    }
                }
            }
        }
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|x| a[i * k + x] as f64 * w[x * n + j] as f64).sum();
                assert!((got[i * n + j] - want).abs() < 1e-9, "({i}, {j}): {} vs {want}", got[i * n + j]);
            }
        }
    }

    /// Every element of a packed operand has its own place (the index maps are
    /// one to one over the padded tiles).
    #[test]
    fn the_index_maps_are_one_to_one() {
        let kt = 3;
        let mut seen = vec![false; 2 * kt * 256];
        for m in 0..32 {
            for k in 0..48 {
                let i = a_index(m, k, kt);
                assert!(!seen[i], "A ({m}, {k}) collides");
                seen[i] = true;
            }
        }
        let mut seen = vec![false; 2 * kt * 256];
        for k in 0..48 {
            for n in 0..32 {
                let i = b_index(k, n, kt);
                assert!(!seen[i], "B ({k}, {n}) collides");
                seen[i] = true;
            }
        }
    }

    /// An f32 weight's pair is exact in f32 and within 2^-16 of the weight;
    /// a bf16 weight is its rounding.
    #[test]
    fn weight_pairs_round_as_the_device_multiplies() {
        let mut rng = SplitMix64::new(9);
        for _ in 0..1000 {
            let w = (rng.next_f32() - 0.5) * 3.0;
            let r = WeightDtype::F32.round(w);
            assert!(((r - w) / w).abs() < 1.0 / 65536.0, "{w} -> {r}");
            let (hi, lo) = WeightDtype::F32.split(w);
            assert_eq!(bf16_to_f32(hi) + bf16_to_f32(lo), r);
            assert_eq!(WeightDtype::Bf16.round(w), bf16_to_f32(f32_to_bf16(w)));
        }
    }

    /// Segments depend on the shape only; units keep their count.
    #[test]
    fn segments_follow_the_shape() {
        assert_eq!(auto_segments(1, 2048, 10256), 4);
        assert_eq!(auto_segments(1, 2048, 256), 16);
        assert_eq!(auto_segments(16, 128, 512), 1);
        assert_eq!(auto_segments(1, 40, 512), 1);
        let units = StepMat::units(32, 8, 4, vec![0.0; 32 * 8]);
        assert_eq!((units.unit(), units.unit_padded(), units.kt()), (8, 16, 4));
        assert_eq!((units.kp(7), units.kp(8), units.kp(31)), (7, 16, 55));
        assert_eq!(StepMat::units(2048, 2048, 16, vec![0.0; 2048 * 2048]).segments, 16);
        assert_eq!(buckets(96), vec![1, 2, 4, 8, 16, 32, 64, 96]);
        assert_eq!(buckets(1), vec![1]);
        assert_eq!(bucket_of(&buckets(96), 33), Some(64));
        assert_eq!(bucket_of(&buckets(96), 97), None);
    }

    /// The tick refuses what no region holds, naming it.
    #[test]
    fn the_tick_refuses_out_of_range_indices() {
        let lay = TickLayout { bmax: 4, tp: 2, maxblk: 3 };
        let mut out = vec![0; lay.len()];
        let blocks: [&[u32]; 2] = [&[0, 1], &[2]];
        let ok = StepRequest { token: 7, pos: 5, slots: &[1, 0], blocks: &blocks };
        let bounds = TickBounds { vocab: 256, max_context: 64, slots: 2, blocks: 4 };
        lay.fill(&[ok], bounds, &mut out).unwrap();
        assert_eq!((out[0], out[lay.tok()], out[lay.pos()], out[lay.slot() + 1]), (1, 7, 5, 0));
        assert_eq!(out[lay.blk() + 1], 1);
        assert_eq!(out[lay.blk() + lay.bmax * lay.maxblk], 2);
        let bad_slot = StepRequest { slots: &[2, 0], ..ok };
        let e = lay.fill(&[bad_slot], bounds, &mut out).unwrap_err();
        assert!(e.to_string().contains("slot 2"), "{e}");
        let bad_pos = StepRequest { pos: 64, ..ok };
        assert!(lay.fill(&[bad_pos], bounds, &mut out).unwrap_err().to_string().contains("position 64"));
    }
}
