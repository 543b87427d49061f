//! Trained weights load from a safetensors file (docs/weights.md): a file written
//! from seeded weights gives the seeded model's logits bit for bit, through the
//! colocated run and through the disaggregated one; a missing tensor, a wrong
//! shape, an unsupported dtype and an extra tensor are refused, naming the tensor.

mod common;

use handoff::check::compute_verify::verify_compute;
use handoff::model::{Model, checkpoint, run_colocated};
use handoff_components::Topology;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

const CASE: common::ComputeShape = common::ComputeShape { pp: 2, dtp: 2, dcp: 2, ..common::COMPUTE };

/// A topology file naming `weights.safetensors` beside it, in a fresh folder.
fn with_weights(bytes: &[u8], tag: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("handoff-ckpt-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("weights.safetensors"), bytes).expect("write weights");
    let toml = CASE.toml().replace("seed = 5\n", "seed = 5\nweights = \"weights.safetensors\"\n");
    assert!(toml.contains("weights = "), "the case's [model] table must take the weights line");
    let path = dir.join("topology.toml");
    std::fs::write(&path, toml).expect("write topology");
    (dir, path.to_string_lossy().into_owned())
}

fn seeded_bytes() -> Vec<u8> {
    checkpoint::to_bytes(&Model::new(&CASE.topology()).expect("seeded model")).expect("serialize")
}

/// The file's tensors, with `edit` applied: (name, dtype, shape, bytes) each.
fn rewrite(bytes: &[u8], edit: impl Fn(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) -> Vec<u8> {
    let st = SafeTensors::deserialize(bytes).expect("parse");
    let mut t: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    edit(&mut t);
    let views: Vec<(String, TensorView<'_>)> = t.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view"))).collect();
    safetensors::serialize(views, None).expect("serialize")
}

fn refusal(bytes: &[u8], tag: &str) -> String {
    let (dir, path) = with_weights(bytes, tag);
    let topo = Topology::load(&path).expect("topology");
    let e = Model::new(&topo).expect_err("a bad checkpoint must be refused").to_string();
    let _ = std::fs::remove_dir_all(dir);
    e
}

#[test]
fn a_checkpoint_of_the_seeded_weights_gives_the_seeded_logits() {
    let (dir, path) = with_weights(&seeded_bytes(), "same");
    let loaded = Topology::load(&path).expect("topology with weights");
    assert!(loaded.model().weights.as_deref().is_some_and(|w| w.ends_with("weights.safetensors") && w.starts_with(dir.to_str().unwrap())));
    let prompt = b"weights from a file";
    let want = run_colocated(&Model::new(&CASE.topology()).unwrap(), prompt, 8).unwrap();
    let got = run_colocated(&Model::new(&loaded).unwrap(), prompt, 8).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.logits, want.logits, "the loaded weights must be the same bits");
    // The disaggregated path (stages and decode each build the model) loads them too.
    let r = verify_compute(&loaded, prompt, 8, |_| {}).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.tokens, want.tokens);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bf16_tensors_are_widened_exactly() {
    // Round every tensor to bf16 (truncate the low half), store it as BF16: the
    // loaded f32 values are exactly the truncated ones.
    let bytes = rewrite(&seeded_bytes(), |t| {
        for (_, d, _, b) in t.iter_mut() {
            *d = Dtype::BF16;
            *b = b.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        }
    });
    let (dir, path) = with_weights(&bytes, "bf16");
    let m = Model::new(&Topology::load(&path).unwrap()).expect("bf16 checkpoint");
    let seeded = Model::new(&CASE.topology()).unwrap();
    let truncated: Vec<f32> = seeded.embed.iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000)).collect();
    assert_eq!(m.embed, truncated);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_missing_tensor_is_refused_by_name() {
    let bytes = rewrite(&seeded_bytes(), |t| t.retain(|(n, ..)| n != "layers.1.kda.dt_bias"));
    let e = refusal(&bytes, "missing");
    assert!(e.contains("layers.1.kda.dt_bias") && e.contains("missing"), "{e}");
}

#[test]
fn a_wrong_shape_is_refused_by_name() {
    let bytes = rewrite(&seeded_bytes(), |t| {
        let w = t.iter_mut().find(|(n, ..)| n == "layers.3.mla.wuk").expect("an MLA layer at 3");
        let n = w.2.iter().product::<usize>();
        w.2 = vec![n];
    });
    let e = refusal(&bytes, "shape");
    assert!(e.contains("layers.3.mla.wuk") && e.contains("shape"), "{e}");
}

#[test]
fn an_unsupported_dtype_is_refused_by_name() {
    let bytes = rewrite(&seeded_bytes(), |t| {
        let w = t.iter_mut().find(|(n, ..)| n == "lm_head").unwrap();
        w.1 = Dtype::F16;
        w.3 = w.3.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
    });
    let e = refusal(&bytes, "dtype");
    assert!(e.contains("lm_head") && e.contains("F16"), "{e}");
}

#[test]
fn an_extra_tensor_is_refused_by_name() {
    let bytes = rewrite(&seeded_bytes(), |t| t.push(("layers.9.kda.wqkv".into(), Dtype::F32, vec![1], vec![0; 4])));
    let e = refusal(&bytes, "extra");
    assert!(e.contains("layers.9.kda.wqkv"), "{e}");
}

#[test]
fn a_missing_file_is_refused_naming_the_path() {
    let dir = std::env::temp_dir().join(format!("handoff-ckpt-{}-nofile", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.toml");
    std::fs::write(&path, CASE.toml().replace("seed = 5\n", "seed = 5\nweights = \"absent.safetensors\"\n")).unwrap();
    let e = Model::new(&Topology::load(path.to_str().unwrap()).unwrap()).unwrap_err().to_string();
    assert!(e.contains("absent.safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
