//! The picture of `bench compute --plot`: each op the bench reports against its
//! roofline, the least time its bytes take at the copy bandwidth measured in
//! the same run (host memcpy on the CPU, a device copy on a GPU).

use super::plot::{ComputeChart, RooflineOp};
use crate::model::Dims;
use crate::model::bench::{ComputeFigures, FUSED_CONTEXT};
use handoff_components::Topology;
use handoff_components::config::{DeviceConfig, DeviceKind};
use handoff_components::vocab::LayerKind;

/// Bytes one step of the generic pass's batched decode must move at least:
/// the f32 weights once, and for each of `batch` requests its KDA state read
/// and written and its `context` MLA rows read. The same floor as the fused
/// step's (`FusedFigure::floor_bytes`), with the generic pass's f32 weights.
pub fn batched_floor_bytes(dims: &Dims, batch: usize, context: usize) -> u64 {
    let kda_layers = dims.layer_kinds.iter().filter(|k| **k == LayerKind::Kda).count() as u64;
    let mla_layers = dims.num_layers() as u64 - kda_layers;
    let state = (dims.kda_heads * dims.dk * dims.dv * 4) as u64 * kda_layers;
    let rows = context as u64 * dims.row_width() as u64 * dims.dtype.bytes() * mla_layers;
    dims.weight_bytes() as u64 + batch as u64 * (2 * state + rows)
}

/// The ops of `f` against their rooflines: the fused step at each batch (its
/// peer in the same run: the same step with graphs off) or, without one, the
/// generic batched step; then the KDA and MLA decode kernels.
pub fn compute_chart(f: &ComputeFigures, topo: &Topology, device: &DeviceConfig, config: &str) -> ComputeChart {
    let bw = f.memcpy_bytes_per_s.max(1.0);
    let us = |bytes: u64| bytes as f64 / bw * 1e6;
    let mut ops = Vec::new();
    for x in &f.fused {
        ops.push(RooflineOp {
            op: format!("fused step B={}", x.batch),
            floor_us: x.floor_us,
            runs: vec![
                // The default way first ([device] dependent_launch = true).
                ("handoff".into(), x.graph_dependent_us),
                ("same graph, plain stream order".into(), x.graph_us),
                ("same step, graphs off".into(), x.launched_us),
            ],
        });
    }
    let dims = Dims::from_topology(topo);
    for b in &f.batched {
        ops.push(RooflineOp {
            op: format!("decode step B={}", b.batch),
            floor_us: us(batched_floor_bytes(&dims, b.batch, f.batch_prompt_tokens)),
            runs: vec![("handoff".into(), b.step_us)],
        });
    }
    ops.push(RooflineOp { op: "KDA decode kernel".into(), floor_us: us(f.kda_step_bytes), runs: vec![("handoff".into(), f.kda_step_us)] });
    ops.push(RooflineOp { op: "MLA decode kernel".into(), floor_us: us(f.mla_step_bytes), runs: vec![("handoff".into(), f.mla_step_us)] });
    let copy = if device.kind == DeviceKind::Cpu { "host memcpy" } else { "device copy" };
    // The batched steps run after prompts of batch_prompt_tokens, the fused
    // step at FUSED_CONTEXT; the floor counts that many MLA rows a request.
    let context = if f.fused.is_empty() { f.batch_prompt_tokens } else { FUSED_CONTEXT };
    ComputeChart {
        title: format!("bench compute on {device}: each op against its roofline"),
        subtitle: format!(
            "{config}, {} threads, {} host cores; floor = bytes the op must move / {copy} of this run; decode steps at context {context}",
            f.threads,
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        ),
        roofline: format!("roofline: {copy} {:.2} GB/s", bw / 1e9),
        ops,
    }
}
