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
