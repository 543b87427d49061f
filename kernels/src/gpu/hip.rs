//! The HIP runtime probe behind feature `hip` (hip-sys against libamdhip64).
//!
//! There is no AMD GPU on any machine this project runs on, so the HIP path is
//! compile-checked: build.rs compiles every kernel source for gfx90a, and this
//! probe makes `HipBackend::new` say what the runtime reports (normally
//! `hipErrorNoDevice`). Op launches through `hipModuleLaunchKernel` on the
//! embedded code objects are the remaining step, for when a device exists.

use hip_sys::hiprt::{hipError_t, hipGetDeviceCount, hipGetErrorString};

/// Why `HipBackend::new(device)` refuses.
pub(crate) fn unavailable_reason(device: usize) -> String {
    let mut count: std::os::raw::c_int = 0;
    // SAFETY: hipGetDeviceCount writes one int through a valid pointer.
    let err = unsafe { hipGetDeviceCount(&mut count) };
    if err != hipError_t::hipSuccess || count <= 0 {
        let what = describe(err);
        return format!("hip: no device: hipGetDeviceCount reported {what} with a count of {count} (no AMD GPU here)");
    }
    if device >= count as usize {
        return format!("hip: no device {device}: the HIP runtime sees {count} device(s)");
    }
    format!(
        "hip: the HIP runtime sees {count} device(s), but op launches are not wired yet \
         (the kernels are compiled for gfx90a at build time: HIP_CODE_OBJECTS)"
    )
}

fn describe(err: hipError_t) -> String {
    // SAFETY: hipGetErrorString returns a static NUL-terminated string (or null).
    let p = unsafe { hipGetErrorString(err) };
    if p.is_null() {
        format!("{err:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy();
        let name = format!("{err:?}");
        if s == name { name } else { format!("{name} ({s})") }
    }
}
