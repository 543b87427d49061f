//! Topology builders shared by the integration tests.
#![allow(dead_code)]

use handoff_components::Topology;

/// A tiny hybrid model's topology, as TOML, with the given parallel shape.
#[derive(Debug, Clone)]
pub struct Shape {
    pub layers: u32,
    pub pattern: &'static str,
    pub pp: u32,
    pub ptp: u32,
    pub split: Vec<u32>,
    pub pbs: u32,
    pub dtp: u32,
    pub dcp: u32,
    pub interleave: u32,
    pub dbs: u32,
    pub replay: Option<u32>,
    pub kda_heads: u32,
    pub indexer: u32,
    pub dtype: &'static str,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            layers: 8,
            pattern: "KKKM",
            pp: 1,
            ptp: 1,
            split: vec![],
            pbs: 4,
            dtp: 1,
            dcp: 1,
            interleave: 1,
            dbs: 4,
            replay: None,
            kda_heads: 8,
            indexer: 0,
            dtype: "bf16",
        }
    }
}

impl Shape {
    pub fn toml(&self) -> String {
        let split = self.split.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
        let replay = self.replay.map_or(String::new(), |c| format!("[model.replay]\ncapacity = {c}\n"));
        format!(
            r#"[model]
name = "tiny"
pattern = "{pattern}"
num_layers = {layers}
hidden_size = 32
dtype = "{dtype}"

[model.mla]
heads = 8
kv_lora_rank = 8
rope_dim = 4
nope_head_dim = 4
v_head_dim = 4
indexer_dim = {indexer}

[model.kda]
heads = {kh}
head_k_dim = 4
head_v_dim = 2
conv_kernel = 4

{replay}
[prefill]
pp = {pp}
tp = {ptp}
block_size = {pbs}
layer_split = [{split}]

[decode]
tp = {dtp}
dcp = {dcp}
interleave = {il}
block_size = {dbs}
"#,
            pattern = self.pattern,
            layers = self.layers,
            dtype = self.dtype,
            indexer = self.indexer,
            kh = self.kda_heads,
            pp = self.pp,
            ptp = self.ptp,
            pbs = self.pbs,
            dtp = self.dtp,
            dcp = self.dcp,
            il = self.interleave,
            dbs = self.dbs,
        )
    }

    pub fn topology(&self) -> Topology {
        Topology::parse(&self.toml()).unwrap_or_else(|e| panic!("{e}\n{}", self.toml()))
    }
}

/// A tiny hybrid model for the compute tests: every knob the equivalence, batching
/// and prefill tests turn, with the model's weights drawn from `seed`.
#[derive(Debug, Clone, Copy)]
pub struct ComputeShape {
    pub pattern: &'static str,
    pub layers: u32,
    pub hidden: u32,
    pub dtype: &'static str,
    pub seed: u64,
    pub intermediate: Option<u32>,
    pub kda_heads: u32,
    pub mla_heads: u32,
    pub replay: Option<u32>,
    pub pp: u32,
    pub ptp: u32,
    pub pbs: u32,
    /// `layer_split` entries, comma-separated ("" for the even split).
    pub split: &'static str,
    pub dtp: u32,
    pub dcp: u32,
    pub interleave: u32,
    pub dbs: u32,
}

/// The compute tests' base: 4 KKKM layers, hidden 32, 4 KDA and 4 MLA heads, TP1 on both sides.
pub const COMPUTE: ComputeShape = ComputeShape {
    pattern: "KKKM",
    layers: 4,
    hidden: 32,
    dtype: "f32",
    seed: 5,
    intermediate: None,
    kda_heads: 4,
    mla_heads: 4,
    replay: None,
    pp: 1,
    ptp: 1,
    pbs: 8,
    split: "",
    dtp: 1,
    dcp: 1,
    interleave: 1,
    dbs: 8,
};

impl ComputeShape {
    pub fn toml(&self) -> String {
        let replay = self.replay.map_or(String::new(), |cap| format!("[model.replay]\ncapacity = {cap}\n"));
        let split = if self.split.is_empty() { String::new() } else { format!("layer_split = [{}]\n", self.split) };
        let inter = self.intermediate.map_or(String::new(), |i| format!("intermediate_size = {i}\n"));
        format!(
            r#"
[model]
name = "tiny"
pattern = "{pattern}"
num_layers = {layers}
hidden_size = {hidden}
dtype = "{dtype}"
seed = {seed}
{inter}
[model.mla]
heads = {mh}
kv_lora_rank = 16
rope_dim = 8
nope_head_dim = 8
v_head_dim = 8

[model.kda]
heads = {kh}
head_k_dim = 8
head_v_dim = 8
conv_kernel = 4

{replay}
[prefill]
pp = {pp}
tp = {ptp}
block_size = {pbs}
{split}
[decode]
tp = {dtp}
dcp = {dcp}
interleave = {il}
block_size = {dbs}

[serve]
max_context = 1024
"#,
            pattern = self.pattern,
            layers = self.layers,
            hidden = self.hidden,
            dtype = self.dtype,
            seed = self.seed,
            mh = self.mla_heads,
            kh = self.kda_heads,
            pp = self.pp,
            ptp = self.ptp,
            pbs = self.pbs,
            dtp = self.dtp,
            dcp = self.dcp,
            il = self.interleave,
            dbs = self.dbs,
        )
    }

    pub fn topology(&self) -> Topology {
        let text = self.toml();
        Topology::parse(&text).unwrap_or_else(|e| panic!("topology refused: {e}\n{text}"))
    }
}
