//! Trained weights from a `safetensors` file (the contract is docs/weights.md).
//!
//! The file holds the whole, unsharded model; [`super::Model::upload_group`]
//! shards it over TP exactly as it shards seeded weights. Every tensor is
//! checked against the dimensions the topology's `[model]` table gives: a
//! missing tensor, an unexpected one, a wrong shape or an unsupported dtype is
//! refused with the tensor's name, so a checkpoint that does not fit the
//! topology never runs.

use super::ModelError;
use super::weights::{Dims, KdaWeights, LayerWeights, Mixer, MlaWeights, Model, VOCAB};
use handoff_components::vocab::LayerKind;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeSet;

/// Reads the model of `dims` from the safetensors file at `path`.
pub fn load(dims: Dims, path: &str) -> Result<Model, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::Config(format!("model.weights {path}: {e}")))?;
    from_bytes(dims, &bytes, path)
}

/// [`load`] from the file's bytes; `path` only labels messages.
pub fn from_bytes(dims: Dims, bytes: &[u8], path: &str) -> Result<Model, ModelError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Config(format!("model.weights {path}: not a safetensors file: {e}")))?;
    let mut r = Reader { st: &st, path, taken: BTreeSet::new() };
    let d = dims.hidden;
    let (h, dk, dv, w) = (dims.kda_heads, dims.dk, dims.dv, dims.conv);
    let (hm, l, ro, dn, dvh) = (dims.mla_heads, dims.kv_lora_rank, dims.rope_dim, dims.nope_dim, dims.v_head_dim);
    let i_ = dims.intermediate;
    let mut layers = Vec::with_capacity(dims.num_layers());
    for (i, kind) in dims.layer_kinds.iter().enumerate() {
        let p = |t: &str| format!("layers.{i}.{t}");
        let mixer = match kind {
            LayerKind::Kda => {
                let c = h * (2 * dk + dv);
                Mixer::Kda(KdaWeights {
                    wqkv: r.take(&p("kda.wqkv"), &[d, c])?,
                    conv: r.take(&p("kda.conv"), &[c, w])?,
                    wg: r.take(&p("kda.wg"), &[d, h * dk])?,
                    wb: r.take(&p("kda.wb"), &[d, h])?,
                    a_log: r.take(&p("kda.a_log"), &[h])?,
                    dt_bias: r.take(&p("kda.dt_bias"), &[h * dk])?,
                    wgate: r.take(&p("kda.wgate"), &[d, h * dv])?,
                    onorm: r.take(&p("kda.onorm"), &[dv])?,
                    wo: r.take(&p("kda.wo"), &[h * dv, d])?,
                })
            }
            LayerKind::Mla => Mixer::Mla(MlaWeights {
                wkva: r.take(&p("mla.wkva"), &[d, l + ro])?,
                kv_norm: r.take(&p("mla.kv_norm"), &[l])?,
                wq: r.take(&p("mla.wq"), &[d, hm * (dn + ro)])?,
                wuk: r.take(&p("mla.wuk"), &[hm, dn, l])?,
                wuv: r.take(&p("mla.wuv"), &[hm, l, dvh])?,
                wo: r.take(&p("mla.wo"), &[hm * dvh, d])?,
            }),
        };
        layers.push(LayerWeights {
            attn_norm: r.take(&p("attn_norm"), &[d])?,
            mlp_norm: r.take(&p("mlp_norm"), &[d])?,
            gate: r.take(&p("mlp.gate"), &[d, i_])?,
            up: r.take(&p("mlp.up"), &[d, i_])?,
            down: r.take(&p("mlp.down"), &[i_, d])?,
            mixer,
        });
    }
    let embed = r.take("embed", &[VOCAB, d])?;
    let final_norm = r.take("final_norm", &[d])?;
    let lm_head = r.take("lm_head", &[d, VOCAB])?;
    let extra: Vec<String> = st.names().into_iter().filter(|n| !r.taken.contains(*n)).map(str::to_string).collect();
    if !extra.is_empty() {
        return Err(ModelError::Config(format!(
            "model.weights {path}: tensors the topology's [model] does not use: {} (a checkpoint of another shape?)",
            extra.join(", ")
        )));
    }
    Ok(Model { dims, embed, layers, final_norm, lm_head })
}

struct Reader<'a> {
    st: &'a SafeTensors<'a>,
    path: &'a str,
    taken: BTreeSet<String>,
}

impl Reader<'_> {
    /// The tensor `name`, which must have `shape`, widened to f32.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let path = self.path;
        let t = self.st.tensor(name).map_err(|_| ModelError::Config(format!("model.weights {path}: tensor {name} is missing (expected shape {shape:?})")))?;
        if t.shape() != shape {
            return Err(ModelError::Config(format!("model.weights {path}: tensor {name} has shape {:?}, the topology's [model] needs {shape:?}", t.shape())));
        }
        let data = t.data();
        let out = match t.dtype() {
            Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            // bf16 is the top half of an f32: widening is exact.
            Dtype::BF16 => data.chunks_exact(2).map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)).collect(),
            other => {
                return Err(ModelError::Config(format!("model.weights {path}: tensor {name} is {other:?}; F32 or BF16 expected")));
            }
        };
        self.taken.insert(name.to_string());
        Ok(out)
    }
}

/// The model as a safetensors file of F32 tensors, with the names and shapes of
/// docs/weights.md: what [`load`] reads back (tests write seeded weights with it).
pub fn to_bytes(model: &Model) -> Result<Vec<u8>, ModelError> {
    let d = &model.dims;
    let (h, dk, dv) = (d.kda_heads, d.dk, d.dv);
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> = vec![
        ("embed".into(), vec![VOCAB, d.hidden], &model.embed),
        ("final_norm".into(), vec![d.hidden], &model.final_norm),
        ("lm_head".into(), vec![d.hidden, VOCAB], &model.lm_head),
    ];
    for (i, lw) in model.layers.iter().enumerate() {
        let p = |t: &str| format!("layers.{i}.{t}");
        tensors.push((p("attn_norm"), vec![d.hidden], &lw.attn_norm));
        tensors.push((p("mlp_norm"), vec![d.hidden], &lw.mlp_norm));
        tensors.push((p("mlp.gate"), vec![d.hidden, d.intermediate], &lw.gate));
        tensors.push((p("mlp.up"), vec![d.hidden, d.intermediate], &lw.up));
        tensors.push((p("mlp.down"), vec![d.intermediate, d.hidden], &lw.down));
        match &lw.mixer {
            Mixer::Kda(k) => {
                let c = h * (2 * dk + dv);
                tensors.push((p("kda.wqkv"), vec![d.hidden, c], &k.wqkv));
                tensors.push((p("kda.conv"), vec![c, d.conv], &k.conv));
                tensors.push((p("kda.wg"), vec![d.hidden, h * dk], &k.wg));
                tensors.push((p("kda.wb"), vec![d.hidden, h], &k.wb));
                tensors.push((p("kda.a_log"), vec![h], &k.a_log));
                tensors.push((p("kda.dt_bias"), vec![h * dk], &k.dt_bias));
                tensors.push((p("kda.wgate"), vec![d.hidden, h * dv], &k.wgate));
                tensors.push((p("kda.onorm"), vec![dv], &k.onorm));
                tensors.push((p("kda.wo"), vec![h * dv, d.hidden], &k.wo));
            }
            Mixer::Mla(m) => {
                let (hm, l, r, dn, dvh) = (d.mla_heads, d.kv_lora_rank, d.rope_dim, d.nope_dim, d.v_head_dim);
                tensors.push((p("mla.wkva"), vec![d.hidden, l + r], &m.wkva));
                tensors.push((p("mla.kv_norm"), vec![l], &m.kv_norm));
                tensors.push((p("mla.wq"), vec![d.hidden, hm * (dn + r)], &m.wq));
                tensors.push((p("mla.wuk"), vec![hm, dn, l], &m.wuk));
                tensors.push((p("mla.wuv"), vec![hm, l, dvh], &m.wuv));
                tensors.push((p("mla.wo"), vec![hm * dvh, d.hidden], &m.wo));
            }
        }
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors.into_iter().map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)).map_err(|e| ModelError::Config(format!("tensor {n}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None).map_err(|e| ModelError::Config(format!("serialize the weights: {e}")))
}
