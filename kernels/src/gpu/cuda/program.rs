//! NVRTC: the device program compiled to a cubin, and whether the CUDA
//! libraries load at all.

use super::*;

/// Why the CUDA libraries cannot be used on this machine, if they cannot. Asks
/// with cudarc's own candidate names (libloading, which returns an error where
/// cudarc's loaders would panic).
pub(super) fn runtime_missing() -> Option<String> {
    // SAFETY: these only try to open the libraries by name and close them again.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("cuda: no CUDA driver: libcuda.so.1 not found on the loader path (no NVIDIA driver on this machine)".to_string());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Some(
            "cuda: no NVRTC: libnvrtc.so.13 (or libnvrtc.so) not found on the loader path; \
             add the CUDA toolkit's lib directory to LD_LIBRARY_PATH"
                .to_string(),
        );
    }
    None
}

/// The NVRTC target of a device of compute capability `cc`: `sm_90a` on 9.0,
/// so that Hopper's warpgroup products (step_mm.hip's st_mm_wg) are built;
/// plain `sm_<major><minor>` elsewhere, where they are left out.
pub(crate) fn nvrtc_arch(cc: (i32, i32)) -> String {
    if cc == (9, 0) { "90a".to_string() } else { format!("{}{}", cc.0, cc.1) }
}

/// Compiles the device program with NVRTC for `sm_<arch>` and returns the cubin.
pub(crate) fn nvrtc_cubin(arch: &str) -> Result<Vec<u8>> {
    nvrtc_cubin_of(&crate::gpu::device_program(), arch)
}

/// Compiles `program` (prelude and sources) with NVRTC for `sm_<arch>`.
pub(crate) fn nvrtc_cubin_of(program: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as nr, sys as ns};
    let nvrtc_err = |what: &str, e: nr::NvrtcError| KernelError::BackendUnavailable(format!("cuda: NVRTC {what}: {e:?}"));
    let src = CString::new(program).expect("kernel sources contain no NUL");
    let name = CString::new("handoff_kernels.cu").expect("no NUL");
    let prog = nr::create_program(&src, Some(&name)).map_err(|e| nvrtc_err("create", e))?;
    let gpu_arch = format!("--gpu-architecture=sm_{arch}");
    // Line information only maps the SASS back to the sources (ncu's source
    // page, `tools/sass.py`); it changes no instruction.
    let opts = [gpu_arch.as_str(), "--std=c++17", "--generate-line-info"];
    // SAFETY: prog is a live program; the options are NUL-free strings.
    let compiled = unsafe { nr::compile_program(prog, &opts) };
    let result = match compiled {
        Err(e) => {
            // SAFETY: prog is live; the log is a NUL-terminated byte string.
            let log = unsafe { nr::get_program_log(prog) }
                .map(|l| l.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(KernelError::BackendUnavailable(format!("cuda: NVRTC failed to compile kernels/hip for sm_{arch} ({e:?}):\n{log}")))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: prog compiled; size and the buffer are valid for writes.
            unsafe { ns::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| nvrtc_err("cubin size", e)).and_then(|()| {
                let mut cubin = vec![0u8; size];
                unsafe { ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }.result().map_err(|e| nvrtc_err("cubin", e)).map(|()| cubin)
            })
        }
    };
    // SAFETY: prog is live and not used after this.
    let _ = unsafe { nr::destroy_program(prog) };
    result
}

/// NVRTC present on this machine (no driver needed): lets the tests compile
/// the sources where only libnvrtc is installed.
#[cfg(test)]
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
