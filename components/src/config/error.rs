//! Why a topology file is refused: one typed reason per check, each naming
//! the values (a seam of its own, so that the config's parts share it
//! without importing each other).

use thiserror::Error;

/// Every reason a topology file is refused at startup. Each message names the values.
#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("model.weight_dtype = {dtype:?}: the dense products hold their weights as \"f32\" or \"bf16\"")]
    WeightDtype { dtype: &'static str },
    #[error("cannot read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("{field} must be at least 1, got 0")]
    Zero { field: &'static str },
    #[error("model.pattern {pattern:?} must be a non-empty string of 'K' (KDA) and 'M' (MLA)")]
    Pattern { pattern: String },
    #[error("decode tp {decode_tp} is not a multiple of prefill tp {prefill_tp}: each decode rank must take its heads from one prefill rank")]
    DecodeTpNotMultiple { decode_tp: u32, prefill_tp: u32 },
    #[error("region {region}: {heads} heads cannot be split over {side} tp {tp}")]
    HeadsNotSplit { region: &'static str, heads: u32, side: &'static str, tp: u32 },
    #[error(
        "region mla.indexer (sparse MLA, model.mla.indexer_dim = {indexer_dim}) cannot be placed under prefill pp {pp}: no stage places indexer rows; use pp = 1"
    )]
    IndexerUnderPp { indexer_dim: u32, pp: u32 },
    #[error("[cluster] lists {len} prefill stages but prefill pp is {pp}: list none or one [[cluster.prefill]] per stage")]
    ClusterStages { len: usize, pp: u32 },
    #[error("transport {kind} cannot serve prefill pp {pp}")]
    TransportNoPp { kind: &'static str, pp: u32 },
    #[error("decode dcp {dcp} does not divide decode tp {tp}")]
    DcpNotDividingTp { dcp: u32, tp: u32 },
    #[error("decode interleave {interleave} does not divide decode block_size {block_size}")]
    InterleaveNotDividingBlock { interleave: u32, block_size: u32 },
    #[error("prefill layer_split {split:?} has {len} stages but prefill pp is {pp}")]
    SplitLen { split: Vec<u32>, len: usize, pp: u32 },
    #[error("prefill layer_split {split:?} sums to {sum} but model.num_layers is {num_layers}")]
    SplitSum { split: Vec<u32>, sum: u64, num_layers: u32 },
    #[error("prefill layer_split {split:?} gives stage {stage} no layers")]
    SplitEmptyStage { split: Vec<u32>, stage: usize },
    #[error("prefill pp {pp} exceeds model.num_layers {num_layers}: a stage would hold no layer")]
    PpExceedsLayers { pp: u32, num_layers: u32 },
    #[error("serve.max_context {max_context} must be at least 2")]
    Context { max_context: u32 },
    #[error("{field} = {value} must be a positive number of seconds")]
    Timeout { field: &'static str, value: f64 },
    #[error("serve.drain_s = {value} must be 0 or a positive number of seconds")]
    Drain { value: f64 },
    #[error("{field} = {value} is larger than the most handoff accepts, {max}")]
    TooLarge { field: &'static str, value: u64, max: u64 },
    #[error("timeouts.{field} = {value} s is longer than the most handoff accepts, {max} s")]
    TimeoutTooLong { field: &'static str, value: f64, max: f64 },
    #[error("[transport.rdma] {field} = {value}: {reason}")]
    Rdma { field: &'static str, value: String, reason: &'static str },
    #[error("{what} would be {value} at serving capacity (serve.max_requests x serve.max_context), more than the most handoff accepts, {max}")]
    Footprint { what: &'static str, value: u128, max: u128 },
}
