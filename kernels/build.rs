//! With feature `hip`: compiles every `hip/*.hip` kernel source with hipcc for
//! gfx90a (`hipcc --genco --offload-arch=gfx90a -include hip/prelude.h`) into
//! OUT_DIR and writes the list `hip_code_objects.rs` that `src/gpu/mod.rs`
//! embeds. A source hipcc refuses fails the build with hipcc's message. Without
//! the feature this does nothing, so the default build needs only cargo.
//!
//! hipcc is `$HIPCC`, else `$HIP_PATH/bin/hipcc`, else `hipcc` on the PATH
//! (Debian: `apt-get install hipcc libamdhip64-dev`, with `HIP_PATH=/usr` for hip-sys).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=hip");
    println!("cargo:rerun-if-env-changed=HIPCC");
    println!("cargo:rerun-if-env-changed=HIP_PATH");
    if std::env::var_os("CARGO_FEATURE_HIP").is_none() {
        return;
    }
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("hip");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let prelude = dir.join("prelude.h");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "hip"))
        .collect();
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    println!("cargo:rerun-if-changed={}", prelude.display());
    let hipcc = hipcc();
    let mut list = String::from("&[\n");
    for src in &sources {
        let name = src.file_name().unwrap().to_string_lossy().into_owned();
        let obj = out.join(format!("{name}.gfx90a.co"));
        compile(&hipcc, &prelude, src, &obj);
        list.push_str(&format!("    ({name:?}, include_bytes!({:?}) as &[u8]),\n", obj.display().to_string()));
    }
    list.push(']');
    std::fs::write(out.join("hip_code_objects.rs"), list).unwrap();
}

fn hipcc() -> PathBuf {
    if let Some(p) = std::env::var_os("HIPCC") {
        return p.into();
    }
    if let Some(root) = std::env::var_os("HIP_PATH") {
        let p = Path::new(&root).join("bin/hipcc");
        if p.is_file() {
            return p;
        }
    }
    "hipcc".into()
}

fn compile(hipcc: &Path, prelude: &Path, src: &Path, obj: &Path) {
    let mut cmd = Command::new(hipcc);
    cmd.args(["--genco", "--offload-arch=gfx90a", "-O3", "-include"]).arg(prelude).arg(src).arg("-o").arg(obj);
    let res = cmd.output().unwrap_or_else(|e| {
        panic!("feature `hip`: cannot run {} ({e}); install hipcc (Debian: apt-get install hipcc libamdhip64-dev) or set HIPCC", hipcc.display())
    });
    if !res.status.success() || !obj.is_file() {
        panic!(
            "feature `hip`: hipcc failed on {} ({}):\n{}{}",
            src.display(),
            res.status,
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        );
    }
}
