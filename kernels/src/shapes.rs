//! Shape structs and argument bundles of the backend ops. Plain data: every
//! backend checks the buffers it is given against them.

/// Batched KDA decode step: `batch` requests (slots) of `heads` heads each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdaStepShape {
    /// Requests (slots) in the batch.
    pub batch: usize,
    /// KDA heads per request on this rank.
    pub heads: usize,
    /// Key width per head (Dk).
    pub dk: usize,
    /// Value width per head (Dv).
    pub dv: usize,
}

/// KDA prefill of one sequence of `tokens` tokens over `heads` heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdaPrefillShape {
    /// Tokens in the sequence (T).
    pub tokens: usize,
    /// KDA heads on this rank.
    pub heads: usize,
    /// Key width per head (Dk).
    pub dk: usize,
    /// Value width per head (Dv).
    pub dv: usize,
}

/// KDA prefill of several independent sequences in one call (the prompts of a
/// prefill batch): inputs of `rows` rows over `heads` heads, each sequence a
/// range of those rows with its own state (see `Backend::kda_prefill_ragged`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdaRaggedShape {
    /// Rows of the inputs, `out` and `record`.
    pub rows: usize,
    /// KDA heads on this rank.
    pub heads: usize,
    /// Key width per head (Dk).
    pub dk: usize,
    /// Value width per head (Dv).
    pub dv: usize,
}

/// Checks the sequences of a ragged prefill: each inside `rows`, no two
/// sharing a row (they write the same output rows otherwise). Empty ones are
/// allowed (their state is left as it is).
pub fn check_ragged_seqs(op: &'static str, rows: usize, seqs: &[std::ops::Range<usize>]) -> crate::Result<()> {
    let mut sorted: Vec<&std::ops::Range<usize>> = seqs.iter().filter(|r| !r.is_empty()).collect();
    sorted.sort_by_key(|r| r.start);
    for r in &sorted {
        if r.end > rows {
            return Err(crate::KernelError::InvalidShape { op, reason: format!("sequence rows {r:?} run past the {rows} rows of the inputs") });
        }
    }
    for pair in sorted.windows(2) {
        if pair[1].start < pair[0].end {
            return Err(crate::KernelError::InvalidShape { op, reason: format!("sequences {:?} and {:?} share rows", pair[0], pair[1]) });
        }
    }
    Ok(())
}

/// Width of one ReplaySSM record of one head: k^ (Dk), u (Dv), g (Dk).
pub fn replay_record_width(dk: usize, dv: usize) -> usize {
    dk.saturating_mul(2).saturating_add(dv)
}

/// The per-token inputs of a KDA op, each a backend buffer. Layouts, with `N` the
/// batch (step) or the token count (prefill): `q`, `k`, `g_raw` `[N, H, Dk]`;
/// `v` `[N, H, Dv]`; `b_raw` `[N, H]`. `q`, `k`, `v` are the short-conv outputs.
#[derive(Debug)]
pub struct KdaInputs<'a, T> {
    /// Queries.
    pub q: &'a T,
    /// Keys.
    pub k: &'a T,
    /// Values.
    pub v: &'a T,
    /// Raw per-channel decay logits, before `dt_bias` and softplus.
    pub g_raw: &'a T,
    /// Raw beta logits, one per head, before the sigmoid.
    pub b_raw: &'a T,
}

impl<T> Clone for KdaInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for KdaInputs<'_, T> {}

/// Per-layer KDA parameters: `a_log` `[H]`, `dt_bias` `[H, Dk]`.
#[derive(Debug)]
pub struct KdaParams<'a, T> {
    /// Log of the decay rate magnitude, one per head.
    pub a_log: &'a T,
    /// Bias added to `g_raw` before the softplus, per head and key channel.
    pub dt_bias: &'a T,
}

impl<T> Clone for KdaParams<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for KdaParams<'_, T> {}

/// ReplaySSM rings of `batch` slots: ring `[batch, capacity, H, 2*Dk+Dv]`,
/// cursor `[batch]` (i32, tokens recorded since the last commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayShape {
    /// Slots.
    pub batch: usize,
    /// KDA heads per slot on this rank.
    pub heads: usize,
    /// Key width per head.
    pub dk: usize,
    /// Value width per head.
    pub dv: usize,
    /// Ring capacity in tokens.
    pub capacity: usize,
}

/// Depthwise causal conv1d over `channels` channels with kernel `width`.
/// Weight `[channels, width]` (the last tap multiplies the newest token); conv
/// state `[width - 1, channels]`, oldest row first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Channels (conv_dim on this rank).
    pub channels: usize,
    /// Kernel width (conv_kernel, 4 typical).
    pub width: usize,
}

/// Row-wise RMSNorm over `rows` rows of `dim` elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormShape {
    /// Rows normalized independently (tokens, or tokens x heads).
    pub rows: usize,
    /// Elements per row; the weight has this many.
    pub dim: usize,
    /// Added to the mean square before the square root.
    pub eps: f32,
}

/// Absorbed MLA attention geometry: one latent KV head of rows
/// `kv_lora_rank + rope_dim` wide, `heads` query heads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaShape {
    /// Query heads on this rank.
    pub heads: usize,
    /// Latent width L (512 in Kimi/DeepSeek).
    pub kv_lora_rank: usize,
    /// Rope (here NoPE) width R (64).
    pub rope_dim: usize,
    /// Softmax scale applied to the dot products.
    pub scale: f32,
}

impl MlaShape {
    /// Width of one KV row and of one absorbed query: L + R.
    pub fn row_width(&self) -> usize {
        self.kv_lora_rank.saturating_add(self.rope_dim)
    }
}

/// The first `count` rows of a latent KV buffer [>= count, L + R].
#[derive(Debug)]
pub struct RowSet<'a, T> {
    /// The buffer holding the rows.
    pub buf: &'a T,
    /// Rows in use, from the start of the buffer.
    pub count: usize,
}

impl<T> Clone for RowSet<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RowSet<'_, T> {}

/// DCP merge of `shards` partial attention results, each o `[heads, width]` and
/// lse `[heads]`, stacked shard-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeShape {
    /// Partial results (DCP ranks).
    pub shards: usize,
    /// Heads.
    pub heads: usize,
    /// Output width per head (kv_lora_rank).
    pub width: usize,
}

/// Width of one head's f64 attention partial of [`crate::Backend::mla_decode_partial`]:
/// the running max m, the sum l, then the accumulator (`kv_lora_rank` values).
pub fn mla_partial_width(kv_lora_rank: usize) -> usize {
    kv_lora_rank.saturating_add(2)
}

/// x `[rows, inner]` . w `[inner, cols]` = out `[rows, cols]`, all row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulShape {
    /// Rows of x and out (tokens).
    pub rows: usize,
    /// Columns of x, rows of w.
    pub inner: usize,
    /// Columns of w and out.
    pub cols: usize,
}

/// SwiGLU MLP over `tokens` tokens: hidden -> intermediate -> hidden.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpShape {
    /// Tokens (rows of x).
    pub tokens: usize,
    /// Model width.
    pub hidden: usize,
    /// Intermediate width.
    pub intermediate: usize,
}

/// SwiGLU weights: `gate`, `up` `[hidden, intermediate]`; `down` `[intermediate, hidden]`.
#[derive(Debug)]
pub struct MlpWeights<'a, T> {
    /// Gate projection.
    pub gate: &'a T,
    /// Up projection.
    pub up: &'a T,
    /// Down projection.
    pub down: &'a T,
}

impl<T> Clone for MlpWeights<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for MlpWeights<'_, T> {}

/// Embedding lookup: table `[vocab, dim]`, ids `[tokens]` -> out `[tokens, dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingShape {
    /// Tokens looked up.
    pub tokens: usize,
    /// Rows of the table; ids must lie in 0..vocab.
    pub vocab: usize,
    /// Width of a row.
    pub dim: usize,
}

/// Strided copy of a column block: for each of `rows` rows, `width` elements
/// from column `src_col` of a `[rows, src_cols]` buffer to column `dst_col` of a
/// `[rows, dst_cols]` buffer. Splits the conv output into q, k, v, or gathers heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColsCopy {
    /// Rows copied.
    pub rows: usize,
    /// Row length of the source.
    pub src_cols: usize,
    /// First source column.
    pub src_col: usize,
    /// Row length of the destination.
    pub dst_cols: usize,
    /// First destination column.
    pub dst_col: usize,
    /// Columns copied per row.
    pub width: usize,
}

/// Where [`crate::Backend::matmul_units`] writes its products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitsOut {
    /// out `[rows, width]`: a unit's `cols` columns start at its `out_col`
    /// (heads side by side, as attention lays them out).
    Columns { width: usize },
    /// out `[units, rows, cols]`, unit by unit (the partials an all-reduce
    /// sums); every unit has the same `cols`, and `out_col` is unused.
    Stacked,
}

/// The geometry [`crate::Backend::matmul_units`]'s products share: x is `[rows,
/// x_width]`, and each product reads a column block of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitsShape {
    pub rows: usize,
    pub x_width: usize,
    pub out: UnitsOut,
}

/// One product of [`crate::Backend::matmul_units`]: x's columns `x_col ..
/// x_col + inner` times `w` `[inner, cols]`.
#[derive(Debug, Clone, Copy)]
pub struct UnitProduct<'a, Buf> {
    pub w: &'a Buf,
    pub inner: usize,
    pub cols: usize,
    pub x_col: usize,
    pub out_col: usize,
}

impl UnitsShape {
    /// Elements of the output of `units` products (checked against the
    /// layout: column blocks inside x and out, equal widths when stacked).
    pub fn out_len<Buf>(&self, op: &'static str, units: &[UnitProduct<'_, Buf>]) -> crate::Result<usize> {
        let bad = |reason: String| crate::KernelError::InvalidShape { op, reason };
        for (i, u) in units.iter().enumerate() {
            if u.x_col.checked_add(u.inner).is_none_or(|e| e > self.x_width) {
                return Err(bad(format!("unit {i}: x columns {}..+{} outside a row of {}", u.x_col, u.inner, self.x_width)));
            }
            match self.out {
                UnitsOut::Columns { width } if u.out_col.checked_add(u.cols).is_none_or(|e| e > width) => {
                    return Err(bad(format!("unit {i}: out columns {}..+{} outside a row of {width}", u.out_col, u.cols)));
                }
                UnitsOut::Stacked if u.cols != units[0].cols => {
                    return Err(bad(format!("unit {i}: {} columns, stacked with units of {}", u.cols, units[0].cols)));
                }
                _ => {}
            }
        }
        match self.out {
            UnitsOut::Columns { width } => crate::error::elems(op, &[self.rows, width]),
            UnitsOut::Stacked => crate::error::elems(op, &[units.len(), self.rows, units.first().map_or(0, |u| u.cols)]),
        }
    }

    /// Element offset of unit `i`'s row 0 in the output, and its row pitch.
    pub fn out_at<Buf>(&self, i: usize, u: &UnitProduct<'_, Buf>) -> (usize, usize) {
        match self.out {
            UnitsOut::Columns { width } => (u.out_col, width),
            UnitsOut::Stacked => (i * self.rows * u.cols, u.cols),
        }
    }
}
