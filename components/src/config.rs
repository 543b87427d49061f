//! The topology file (TOML) and its validated form.
//!
//! `Config` mirrors the file; every table refuses unknown fields. `Topology` is a
//! config that passed every startup check of docs/design.md section 3, with the derived
//! facts (layer kinds, the layers of each stage, bytes per row and per head) that the
//! rest of the engine reads.

use crate::vocab::{Dtype, LayerKind, ModuleLayer, RegionKind};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use thiserror::Error;

mod error;
mod transport;
pub use error::ConfigError;
pub use transport::{RdmaConfig, TransportConfig, TransportKind, UcxConfig};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub prefill: PrefillConfig,
    pub decode: DecodeConfig,
    #[serde(default)]
    pub transport: TransportConfig,
    #[serde(default)]
    pub timeouts: TimeoutConfig,
    #[serde(default)]
    pub serve: ServeConfig,
    /// Where the model's compute runs (`[device]`); the CPU when absent. The
    /// `--device` flag of the commands that compute overrides it.
    #[serde(default)]
    pub device: DeviceConfig,
    /// Where each role listens and what it advertises (`[cluster]`); empty:
    /// every listener on loopback.
    #[serde(default)]
    pub cluster: crate::cluster::ClusterConfig,
}

/// The `[device]` table: the compute backend, its device ordinal, and how a
/// GPU runs the decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    #[serde(default)]
    pub kind: DeviceKind,
    /// Which GPU of the host (0 = the first); ignored for the CPU.
    #[serde(default)]
    pub ordinal: u32,
    /// On a GPU, capture the decode step once per batch bucket as a CUDA graph
    /// and replay it (the default); `false` launches the same kernels one by
    /// one, for profiling. The bits are the same either way.
    #[serde(default = "default_graphs")]
    pub graphs: bool,
    /// On a CUDA device of compute capability 9.0 or later, launch each
    /// kernel of the decode step as a programmatic dependent of the one
    /// before: the next kernel is launched while the last blocks of the one
    /// before run, and waits for it on the device. On by default: on an H100
    /// (session 24, the ways timed in turns) it took 2.3 / 1.6 / 0.6 / 2.5%
    /// off the step at B = 1 / 8 / 32 / 88 (`bench compute` prints both). A
    /// device without it launches in plain stream order. The bits are the
    /// same either way (`verify` runs the colocated reference with it off).
    #[serde(default = "default_dependent_launch")]
    pub dependent_launch: bool,
    /// On a CUDA device, `handoff up` runs its roles under an MPS server of its
    /// own (started with it, stopped with it), so that roles sharing one GPU run
    /// their kernels side by side instead of taking turns in time slices. For
    /// a cluster on one GPU; off by default.
    #[serde(default)]
    pub mps: bool,
}

fn default_graphs() -> bool {
    true
}

fn default_dependent_launch() -> bool {
    true
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig { kind: DeviceKind::Cpu, ordinal: 0, graphs: true, dependent_launch: true, mps: false }
    }
}

/// A compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    /// NVIDIA, through the CUDA driver and NVRTC (cargo feature `cuda`).
    Cuda,
    /// AMD, through HIP (cargo feature `hip`).
    Hip,
}

/// A `--device` value that names no device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceParseError {
    #[error("device {0:?}: the ordinal after ':' must be a number")]
    Ordinal(String),
    #[error("device {0:?}: expected cpu, cuda, cuda:N, hip or hip:N")]
    Kind(String),
}

impl DeviceConfig {
    /// Parses `cpu`, `cuda`, `cuda:N`, `hip` or `hip:N`.
    pub fn parse(s: &str) -> Result<DeviceConfig, DeviceParseError> {
        let (kind, ordinal) = match s.split_once(':') {
            Some((k, n)) => (k, n.parse::<u32>().map_err(|_| DeviceParseError::Ordinal(s.to_string()))?),
            None => (s, 0),
        };
        let kind = match kind {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            "hip" => DeviceKind::Hip,
            _ => return Err(DeviceParseError::Kind(s.to_string())),
        };
        Ok(DeviceConfig { kind, ordinal, ..DeviceConfig::default() })
    }
}

impl std::fmt::Display for DeviceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda => write!(f, "cuda:{}", self.ordinal),
            DeviceKind::Hip => write!(f, "hip:{}", self.ordinal),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    /// `K` = KDA layer, `M` = MLA layer; repeated, then cut to `num_layers`.
    pub pattern: String,
    pub num_layers: u32,
    pub hidden_size: u32,
    pub dtype: Dtype,
    pub mla: MlaConfig,
    pub kda: KdaConfig,
    #[serde(default)]
    pub replay: Option<ReplayConfig>,
    /// Feed-forward width of the compute model (SwiGLU); defaults to 2 x hidden.
    #[serde(default)]
    pub intermediate_size: Option<u32>,
    /// Weight seed of the compute model.
    #[serde(default)]
    pub seed: u64,
    /// A `safetensors` file of trained weights (docs/weights.md), relative to the
    /// topology file; without it the compute model draws seeded random weights.
    #[serde(default)]
    pub weights: Option<String>,
    /// How the dense products hold their weights: `f32` (the default; on a GPU a
    /// bf16 pair per weight, 16 significant bits) or `bf16`. The CPU reference
    /// rounds its weights the same way, so every backend multiplies by the same
    /// numbers.
    #[serde(default = "default_weight_dtype")]
    pub weight_dtype: Dtype,
}

fn default_weight_dtype() -> Dtype {
    Dtype::F32
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaConfig {
    pub heads: u32,
    pub kv_lora_rank: u32,
    pub rope_dim: u32,
    pub nope_head_dim: u32,
    pub v_head_dim: u32,
    /// > 0: sparse MLA, one indexer row of this width per token per MLA layer.
    #[serde(default)]
    pub indexer_dim: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KdaConfig {
    pub heads: u32,
    pub head_k_dim: u32,
    pub head_v_dim: u32,
    pub conv_kernel: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayConfig {
    /// Ring length in tokens.
    pub capacity: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillConfig {
    pub pp: u32,
    pub tp: u32,
    pub block_size: u32,
    /// Layers per stage, in order; must sum to `num_layers`. Empty: even split.
    #[serde(default)]
    pub layer_split: Vec<u32>,
    /// Chunked transfer: each pair's MLA rows move in token chunks of about
    /// `chunk_tokens`, in token order, and the KDA state, conv, replay records and
    /// cursor go with the last chunk (docs/design.md section 4).
    #[serde(default)]
    pub chunked: bool,
    /// Tokens a chunk of a chunked transfer, rounded down to whole token groups of
    /// the consumer's DCP (decode interleave x dcp; at least one group).
    #[serde(default = "default_chunk_tokens")]
    pub chunk_tokens: u32,
    /// Layer-wise streaming (on by default): a stage issues each layer's writes
    /// (MLA rows, KDA state and conv, replay) as soon as that layer is computed,
    /// while the next layers compute; its write-done report still waits for
    /// every layer. A chunked transfer keeps its token order instead
    /// ([`PrefillConfig::streams_layers`]; docs/design.md section 4).
    #[serde(default = "default_layer_streaming")]
    pub layer_streaming: bool,
}

fn default_chunk_tokens() -> u32 {
    512
}

fn default_layer_streaming() -> bool {
    true
}

impl PrefillConfig {
    /// Whether the stages stream their writes layer by layer: `layer_streaming`,
    /// unless the transfer is chunked (its chunks go in token order, after the
    /// whole prompt is computed).
    pub fn streams_layers(&self) -> bool {
        self.layer_streaming && !self.chunked
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeConfig {
    pub tp: u32,
    pub dcp: u32,
    pub interleave: u32,
    pub block_size: u32,
}

/// Per-phase timeouts, in seconds (default 300 each).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutConfig {
    #[serde(default = "default_timeout")]
    pub admission_s: f64,
    #[serde(default = "default_timeout")]
    pub compute_s: f64,
    #[serde(default = "default_timeout")]
    pub transfer_s: f64,
}

fn default_timeout() -> f64 {
    300.0
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig { admission_s: 300.0, compute_s: 300.0, transfer_s: 300.0 }
    }
}

/// Serving limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Longest prompt plus generated tokens of one request.
    #[serde(default = "default_max_context")]
    pub max_context: u32,
    /// Requests that hold decode blocks and slots at once (slots per rank).
    #[serde(default = "default_max_requests")]
    pub max_requests: u32,
    /// Requests that may wait for blocks and slots; past it, 429.
    #[serde(default = "default_queue")]
    pub queue: u32,
    /// Most requests in one decode step (one batch through the kernels). Defaults to
    /// `max_requests`: every live request steps every tick. A smaller bound caps the
    /// step's latency; requests past it take turns, oldest first.
    #[serde(default)]
    pub max_batch: Option<u32>,
    /// Most prompt tokens a prefill stage computes in one pass: the oldest
    /// ready request and those ready after it at the same stage run as one
    /// batch while their prompts fit (a longer prompt still runs, alone).
    #[serde(default = "default_prefill_batch_tokens")]
    pub prefill_batch_tokens: u32,
    /// Compute threads of each role process (default: the host's cores shared
    /// among the PP stages and decode, at least one each).
    #[serde(default)]
    pub threads: Option<u32>,
    /// Seconds a stopping proxy (SIGINT/SIGTERM) lets requests in flight finish
    /// while it refuses new ones with 503; 0 stops at once.
    #[serde(default = "default_drain_s")]
    pub drain_s: f64,
    /// Seconds a client of the public listener has to send a request's headers
    /// (the whole head, from its first byte or from the end of the previous
    /// request); past it the connection is closed. Bounds what a slow client holds.
    #[serde(default = "default_header_timeout_s")]
    pub header_timeout_s: f64,
    /// Seconds a client has to send a request's whole body once its headers
    /// arrived; past it the proxy answers 408 and closes the connection.
    #[serde(default = "default_body_timeout_s")]
    pub body_timeout_s: f64,
    /// Connections the public listener holds open at once; a connection beyond
    /// it is answered 503 (`too_many_connections`) and closed at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
}

impl ServeConfig {
    /// The decode batch bound in force.
    pub fn batch(&self) -> u32 {
        self.max_batch.unwrap_or(self.max_requests).min(self.max_requests).max(1)
    }
}

fn default_max_context() -> u32 {
    4096
}
fn default_max_requests() -> u32 {
    8
}
fn default_prefill_batch_tokens() -> u32 {
    8192
}
fn default_queue() -> u32 {
    64
}
fn default_drain_s() -> f64 {
    30.0
}
fn default_header_timeout_s() -> f64 {
    10.0
}
fn default_body_timeout_s() -> f64 {
    30.0
}
fn default_max_connections() -> u32 {
    1024
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_context: default_max_context(),
            max_requests: default_max_requests(),
            queue: default_queue(),
            max_batch: None,
            prefill_batch_tokens: default_prefill_batch_tokens(),
            threads: None,
            drain_s: default_drain_s(),
            header_timeout_s: default_header_timeout_s(),
            body_timeout_s: default_body_timeout_s(),
            max_connections: default_max_connections(),
        }
    }
}

/// The largest value each count of a topology file may take. They are far above any
/// real deployment (the flagship K3-like file is 92 layers, 96 heads, a 1.1M-token
/// context) and exist so that every size derived from a file (rank counts, region
/// bytes, block counts) fits its integer type and a typo cannot make a role allocate
/// without bound: a file past one is refused by name, not left to overflow later.
pub mod limits {
    pub const LAYERS: u64 = 4096;
    pub const HIDDEN: u64 = 1 << 20;
    pub const HEADS: u64 = 4096;
    /// Any per-head or latent width (kv_lora_rank, rope_dim, head dims, indexer).
    pub const WIDTH: u64 = 1 << 16;
    pub const CONV_KERNEL: u64 = 64;
    pub const REPLAY_CAPACITY: u64 = 1 << 20;
    /// Prefill stages, and TP ranks of either side.
    pub const RANKS: u64 = 1024;
    pub const BLOCK_SIZE: u64 = 1 << 16;
    pub const MAX_CONTEXT: u64 = 1 << 26;
    pub const MAX_REQUESTS: u64 = 1 << 16;
    pub const QUEUE: u64 = 1 << 20;
    pub const THREADS: u64 = 4096;
    pub const TRANSPORT_BATCH: u64 = 1 << 22;
    pub const STAGING_BUFFERS: u64 = 4096;
    pub const STAGING_BYTES: u64 = 1 << 36;
    /// Seconds of any timeout or drain (a year): `Duration`s and `Instant`s built
    /// from them cannot overflow.
    pub const SECONDS: f64 = 365.0 * 86_400.0;
    /// Bytes of all registered regions of one rank at serving capacity (1 PiB).
    pub const RANK_BYTES: u128 = 1 << 50;
    /// Bytes of one rank's staging pool (1 TiB).
    pub const STAGING_POOL_BYTES: u128 = 1 << 40;
}

/// Refuses any count past its [`limits`], naming the field.
fn check_limits(c: &Config) -> Result<(), ConfigError> {
    use limits::*;
    let (m, p, d, s, t) = (&c.model, &c.prefill, &c.decode, &c.serve, &c.transport);
    let opt = |v: Option<u32>| u64::from(v.unwrap_or(0));
    for (field, value, max) in [
        ("model.num_layers", u64::from(m.num_layers), LAYERS),
        ("model.hidden_size", u64::from(m.hidden_size), HIDDEN),
        ("model.intermediate_size", opt(m.intermediate_size), HIDDEN * 4),
        ("model.mla.heads", u64::from(m.mla.heads), HEADS),
        ("model.mla.kv_lora_rank", u64::from(m.mla.kv_lora_rank), WIDTH),
        ("model.mla.rope_dim", u64::from(m.mla.rope_dim), WIDTH),
        ("model.mla.nope_head_dim", u64::from(m.mla.nope_head_dim), WIDTH),
        ("model.mla.v_head_dim", u64::from(m.mla.v_head_dim), WIDTH),
        ("model.mla.indexer_dim", u64::from(m.mla.indexer_dim), WIDTH),
        ("model.kda.heads", u64::from(m.kda.heads), HEADS),
        ("model.kda.head_k_dim", u64::from(m.kda.head_k_dim), WIDTH),
        ("model.kda.head_v_dim", u64::from(m.kda.head_v_dim), WIDTH),
        ("model.kda.conv_kernel", u64::from(m.kda.conv_kernel), CONV_KERNEL),
        ("model.replay.capacity", opt(m.replay.as_ref().map(|r| r.capacity)), REPLAY_CAPACITY),
        ("prefill.pp", u64::from(p.pp), RANKS),
        ("prefill.tp", u64::from(p.tp), RANKS),
        ("prefill.block_size", u64::from(p.block_size), BLOCK_SIZE),
        ("decode.tp", u64::from(d.tp), RANKS),
        ("decode.dcp", u64::from(d.dcp), RANKS),
        ("decode.interleave", u64::from(d.interleave), BLOCK_SIZE),
        ("decode.block_size", u64::from(d.block_size), BLOCK_SIZE),
        ("serve.max_context", u64::from(s.max_context), MAX_CONTEXT),
        ("serve.max_requests", u64::from(s.max_requests), MAX_REQUESTS),
        ("serve.queue", u64::from(s.queue), QUEUE),
        ("serve.max_batch", opt(s.max_batch), MAX_REQUESTS),
        ("serve.threads", opt(s.threads), THREADS),
        ("transport.max_batch", u64::from(t.max_batch), TRANSPORT_BATCH),
        ("transport.staging_buffers", u64::from(t.staging_buffers), STAGING_BUFFERS),
        ("transport.staging_bytes", t.staging_bytes, STAGING_BYTES),
    ] {
        if value > max {
            return Err(ConfigError::TooLarge { field, value, max });
        }
    }
    let prefill_ranks = u64::from(p.pp) * u64::from(p.tp);
    if prefill_ranks > RANKS {
        return Err(ConfigError::TooLarge { field: "prefill.pp x prefill.tp (prefill ranks)", value: prefill_ranks, max: RANKS });
    }
    Ok(())
}

/// A validated config plus derived facts.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    pub config: Config,
    /// Kind of each module layer, `num_layers` long.
    pub layer_kinds: Vec<LayerKind>,
    /// The module layers of each PP stage.
    pub stage_layers: Vec<Range<u32>>,
}

impl Config {
    /// Parses a topology file's text. `path` only labels messages.
    pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.to_string(), reason: e.to_string().trim_end().to_string() })
    }

    pub fn load(path: &str) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io { path: path.to_string(), reason: e.to_string() })?;
        let mut config = Config::parse(&text, path)?;
        // A relative weights path names a file beside the topology file, so a
        // config means the same wherever the command runs.
        if let Some(w) = &config.model.weights {
            let w = std::path::Path::new(w);
            if w.is_relative()
                && let Some(dir) = std::path::Path::new(path).parent()
            {
                config.model.weights = Some(dir.join(w).to_string_lossy().into_owned());
            }
        }
        Ok(config)
    }

    /// Runs every startup check and derives the topology.
    pub fn validate(self) -> Result<Topology, ConfigError> {
        Topology::new(self)
    }
}

impl Topology {
    pub fn load(path: &str) -> Result<Topology, ConfigError> {
        Config::load(path)?.validate()
    }

    pub fn parse(text: &str) -> Result<Topology, ConfigError> {
        Config::parse(text, "<config>")?.validate()
    }

    pub fn new(config: Config) -> Result<Topology, ConfigError> {
        let m = &config.model;
        let p = &config.prefill;
        let d = &config.decode;
        for (field, v) in [
            ("model.num_layers", m.num_layers),
            ("model.hidden_size", m.hidden_size),
            ("model.mla.heads", m.mla.heads),
            ("model.mla.kv_lora_rank", m.mla.kv_lora_rank),
            ("model.kda.heads", m.kda.heads),
            ("model.kda.head_k_dim", m.kda.head_k_dim),
            ("model.kda.head_v_dim", m.kda.head_v_dim),
            ("model.kda.conv_kernel", m.kda.conv_kernel),
            ("prefill.pp", p.pp),
            ("prefill.tp", p.tp),
            ("prefill.block_size", p.block_size),
            ("prefill.chunk_tokens", p.chunk_tokens),
            ("decode.tp", d.tp),
            ("decode.dcp", d.dcp),
            ("decode.interleave", d.interleave),
            ("decode.block_size", d.block_size),
            ("serve.max_requests", config.serve.max_requests),
            ("serve.max_connections", config.serve.max_connections),
            ("serve.max_batch", config.serve.max_batch.unwrap_or(1)),
            ("serve.prefill_batch_tokens", config.serve.prefill_batch_tokens),
            ("serve.threads", config.serve.threads.unwrap_or(1)),
            ("transport.max_batch", config.transport.max_batch),
            ("transport.staging_buffers", config.transport.staging_buffers),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if let Some(r) = &m.replay
            && r.capacity == 0
        {
            return Err(ConfigError::Zero { field: "model.replay.capacity" });
        }
        if config.transport.staging_bytes == 0 {
            return Err(ConfigError::Zero { field: "transport.staging_bytes" });
        }
        config.transport.rdma.check()?;
        check_limits(&config)?;
        let listed = config.cluster.prefill.len();
        if listed != 0 && listed != p.pp as usize {
            return Err(ConfigError::ClusterStages { len: listed, pp: p.pp });
        }
        if m.pattern.is_empty() || !m.pattern.chars().all(|c| c == 'K' || c == 'M') {
            return Err(ConfigError::Pattern { pattern: m.pattern.clone() });
        }
        if !d.tp.is_multiple_of(p.tp) {
            return Err(ConfigError::DecodeTpNotMultiple { decode_tp: d.tp, prefill_tp: p.tp });
        }
        let has_kda = m.pattern.contains('K');
        if has_kda {
            let mut regions = vec![RegionKind::KdaState, RegionKind::KdaConv];
            if m.replay.is_some() {
                regions.push(RegionKind::ReplayRecords);
            }
            for region in regions {
                for (side, tp) in [("prefill", p.tp), ("decode", d.tp)] {
                    if !m.kda.heads.is_multiple_of(tp) {
                        return Err(ConfigError::HeadsNotSplit { region: region.name(), heads: m.kda.heads, side, tp });
                    }
                }
            }
        }
        // MLA heads are split over TP by the compute; the latent KV is replicated.
        for (side, tp) in [("prefill", p.tp), ("decode", d.tp)] {
            if m.pattern.contains('M') && !m.mla.heads.is_multiple_of(tp) {
                return Err(ConfigError::HeadsNotSplit { region: "mla.q (attention heads)", heads: m.mla.heads, side, tp });
            }
        }
        if m.mla.indexer_dim > 0 && p.pp > 1 {
            return Err(ConfigError::IndexerUnderPp { indexer_dim: m.mla.indexer_dim, pp: p.pp });
        }
        if p.pp > 1 && !config.transport.kind.serves_pp() {
            return Err(ConfigError::TransportNoPp { kind: config.transport.kind.name(), pp: p.pp });
        }
        if !d.tp.is_multiple_of(d.dcp) {
            return Err(ConfigError::DcpNotDividingTp { dcp: d.dcp, tp: d.tp });
        }
        if !d.block_size.is_multiple_of(d.interleave) {
            return Err(ConfigError::InterleaveNotDividingBlock { interleave: d.interleave, block_size: d.block_size });
        }
        if m.weight_dtype == Dtype::F16 {
            return Err(ConfigError::WeightDtype { dtype: m.weight_dtype.name() });
        }
        if config.serve.max_context < 2 {
            return Err(ConfigError::Context { max_context: config.serve.max_context });
        }
        for (field, value) in [
            ("timeouts.admission_s", config.timeouts.admission_s),
            ("timeouts.compute_s", config.timeouts.compute_s),
            ("timeouts.transfer_s", config.timeouts.transfer_s),
            ("serve.header_timeout_s", config.serve.header_timeout_s),
            ("serve.body_timeout_s", config.serve.body_timeout_s),
        ] {
            if !(value > 0.0 && value.is_finite()) {
                return Err(ConfigError::Timeout { field, value });
            }
            if value > limits::SECONDS {
                return Err(ConfigError::TimeoutTooLong { field, value, max: limits::SECONDS });
            }
        }
        if !(config.serve.drain_s >= 0.0 && config.serve.drain_s.is_finite()) {
            return Err(ConfigError::Drain { value: config.serve.drain_s });
        }
        if config.serve.drain_s > limits::SECONDS {
            return Err(ConfigError::TimeoutTooLong { field: "serve.drain_s", value: config.serve.drain_s, max: limits::SECONDS });
        }
        let stage_layers = split_layers(m.num_layers, p.pp, &p.layer_split)?;
        let pattern: Vec<char> = m.pattern.chars().collect();
        let layer_kinds = (0..m.num_layers as usize).map(|i| if pattern[i % pattern.len()] == 'K' { LayerKind::Kda } else { LayerKind::Mla }).collect();
        let topo = Topology { config, layer_kinds, stage_layers };
        topo.check_footprint()?;
        Ok(topo)
    }

    /// Refuses a topology whose ranks would need more than [`limits::RANK_BYTES`]
    /// of regions at serving capacity, or more blocks than a pool counts (u32).
    /// Computed in u128 over every layer, an upper bound of any one rank's share.
    fn check_footprint(&self) -> Result<(), ConfigError> {
        let c = &self.config;
        let (p, d, s) = (&c.prefill, &c.decode, &c.serve);
        let ctx = u128::from(s.max_context);
        let reqs = u128::from(s.max_requests);
        for (what, block_size) in [("prefill blocks per rank", p.block_size), ("decode blocks per rank", d.block_size)] {
            let blocks = reqs * ctx.div_ceil(u128::from(block_size));
            if blocks > u128::from(u32::MAX) {
                return Err(ConfigError::Footprint { what, value: blocks, max: u128::from(u32::MAX) });
            }
        }
        let layers = u128::from(c.model.num_layers);
        let token = u128::from(self.token_bytes(RegionKind::MlaKv)) + u128::from(self.token_bytes(RegionKind::MlaIndexer));
        // Blocks hold whole blocks of tokens: round the context up to the larger block.
        let block = u128::from(p.block_size.max(d.block_size));
        let paged = reqs * ctx.div_ceil(block) * block * token;
        let heads = u128::from(self.prefill_heads().max(self.decode_heads()));
        let slot: u128 = [RegionKind::KdaState, RegionKind::KdaConv, RegionKind::ReplayRecords]
            .into_iter()
            .flat_map(|k| self.head_groups(k))
            .map(|g| u128::from(g.head_bytes) * u128::from(g.repeat) * heads)
            .sum::<u128>()
            + 4;
        let bytes = layers * (paged + reqs * slot);
        if bytes > limits::RANK_BYTES {
            return Err(ConfigError::Footprint { what: "bytes of one rank's regions", value: bytes, max: limits::RANK_BYTES });
        }
        let staging = u128::from(c.transport.staging_buffers) * u128::from(c.transport.staging_bytes);
        if staging > limits::STAGING_POOL_BYTES {
            return Err(ConfigError::Footprint { what: "bytes of one rank's staging pool", value: staging, max: limits::STAGING_POOL_BYTES });
        }
        Ok(())
    }

    pub fn model(&self) -> &ModelConfig {
        &self.config.model
    }
    pub fn prefill(&self) -> &PrefillConfig {
        &self.config.prefill
    }
    pub fn decode(&self) -> &DecodeConfig {
        &self.config.decode
    }

    pub fn num_layers(&self) -> u32 {
        self.config.model.num_layers
    }

    pub fn kind_of(&self, layer: ModuleLayer) -> LayerKind {
        self.layer_kinds[layer.0 as usize]
    }

    /// The PP stage that holds a module layer.
    pub fn stage_of(&self, layer: ModuleLayer) -> u32 {
        self.stage_layers.iter().position(|r| r.contains(&layer.0)).unwrap_or(0) as u32
    }

    /// Module layers of a kind, in order, restricted to a range of layer ids.
    pub fn layers_of(&self, kind: LayerKind, range: Range<u32>) -> Vec<ModuleLayer> {
        range.filter(|&l| self.layer_kinds[l as usize] == kind).map(ModuleLayer).collect()
    }

    /// Module layers of a kind over the whole model.
    pub fn all_layers_of(&self, kind: LayerKind) -> Vec<ModuleLayer> {
        self.layers_of(kind, 0..self.num_layers())
    }

    /// The region kinds this model has, in a fixed order.
    pub fn region_kinds(&self) -> Vec<RegionKind> {
        let m = &self.config.model;
        let has_kda = self.layer_kinds.contains(&LayerKind::Kda);
        let has_mla = self.layer_kinds.contains(&LayerKind::Mla);
        RegionKind::ALL
            .into_iter()
            .filter(|k| match k {
                RegionKind::MlaKv => has_mla,
                RegionKind::MlaIndexer => has_mla && m.mla.indexer_dim > 0,
                RegionKind::KdaState | RegionKind::KdaConv => has_kda,
                RegionKind::ReplayRecords | RegionKind::ReplayCursor => has_kda && m.replay.is_some(),
            })
            .collect()
    }

    /// Bytes of one token of one paged row (MLA KV or indexer).
    pub fn token_bytes(&self, kind: RegionKind) -> u64 {
        let m = &self.config.model;
        match kind {
            RegionKind::MlaKv => (u64::from(m.mla.kv_lora_rank) + u64::from(m.mla.rope_dim)) * m.dtype.bytes(),
            RegionKind::MlaIndexer => m.mla.indexer_dim as u64 * m.dtype.bytes(),
            _ => 0,
        }
    }

    /// Per-head geometry of a head-split region: the byte width of one head in each
    /// channel group, and how many times the group repeats (rows of the conv window,
    /// entries of the replay ring). Conv has three groups (q, k, v); the others one.
    pub fn head_groups(&self, kind: RegionKind) -> Vec<HeadGroupShape> {
        let m = &self.config.model;
        let (dk, dv) = (m.kda.head_k_dim as u64, m.kda.head_v_dim as u64);
        match kind {
            RegionKind::KdaState => vec![HeadGroupShape { head_bytes: dk * dv * 4, repeat: 1 }],
            RegionKind::KdaConv => {
                let rows = m.kda.conv_kernel.saturating_sub(1);
                let e = m.dtype.bytes();
                vec![
                    HeadGroupShape { head_bytes: dk * e, repeat: rows },
                    HeadGroupShape { head_bytes: dk * e, repeat: rows },
                    HeadGroupShape { head_bytes: dv * e, repeat: rows },
                ]
            }
            RegionKind::ReplayRecords => {
                let cap = m.replay.as_ref().map_or(0, |r| r.capacity);
                vec![HeadGroupShape { head_bytes: (2 * dk + dv) * 4, repeat: cap }]
            }
            _ => vec![],
        }
    }

    /// Bytes of one slot of one layer of a per-slot region on a rank holding `heads`.
    pub fn slot_layer_bytes(&self, kind: RegionKind, heads: u32) -> u64 {
        match kind {
            RegionKind::ReplayCursor => 4,
            _ => self.head_groups(kind).iter().map(|g| g.head_bytes * heads as u64 * g.repeat as u64).sum(),
        }
    }

    /// KDA heads per prefill rank and per decode rank.
    pub fn prefill_heads(&self) -> u32 {
        self.config.model.kda.heads / self.config.prefill.tp
    }
    pub fn decode_heads(&self) -> u32 {
        self.config.model.kda.heads / self.config.decode.tp
    }

    /// Whether decode can take a request of this transfer mode; `Err` carries the
    /// reason admission returns (HTTP 400). Every mode is served today: chunked
    /// transfer of a stateful model to a DCP decode sends the KDA state, conv,
    /// replay records and cursor with the last chunk to every DCP rank (issue 21,
    /// item 4). The check stays, so a mode decode cannot take is refused at
    /// admission, per request, and not at startup.
    pub fn admits_transfer_mode(&self) -> Result<(), TransferModeError> {
        Ok(())
    }
}

/// A transfer mode decode cannot serve (refused at admission, HTTP 400). None is
/// refused today (see [`Topology::admits_transfer_mode`]).
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum TransferModeError {}

/// One channel group of a head-split region, per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadGroupShape {
    /// Contiguous bytes of one head within one repeat.
    pub head_bytes: u64,
    /// How many times the group repeats, at a stride of the rank's full group row.
    pub repeat: u32,
}

/// Splits `num_layers` over `pp` stages: the explicit list, or even with the first
/// `num_layers % pp` stages one layer longer.
pub fn split_layers(num_layers: u32, pp: u32, split: &[u32]) -> Result<Vec<Range<u32>>, ConfigError> {
    let counts: Vec<u32> = if split.is_empty() {
        if pp > num_layers {
            return Err(ConfigError::PpExceedsLayers { pp, num_layers });
        }
        (0..pp).map(|s| num_layers / pp + u32::from(s < num_layers % pp)).collect()
    } else {
        if split.len() != pp as usize {
            return Err(ConfigError::SplitLen { split: split.to_vec(), len: split.len(), pp });
        }
        let sum: u64 = split.iter().map(|&x| x as u64).sum();
        if sum != num_layers as u64 {
            return Err(ConfigError::SplitSum { split: split.to_vec(), sum, num_layers });
        }
        if let Some(stage) = split.iter().position(|&x| x == 0) {
            return Err(ConfigError::SplitEmptyStage { split: split.to_vec(), stage });
        }
        split.to_vec()
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect())
}
