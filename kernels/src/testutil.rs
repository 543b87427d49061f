//! Test helpers: closeness checks that name the first wrong element.

use crate::rng::SplitMix64;

/// Asserts |got - want| <= atol + rtol * |want| element-wise; on failure names
/// the first wrong element through `coord` (its semantic coordinate).
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64, coord: impl Fn(usize) -> String) {
    assert_eq!(got.len(), want.len(), "{what}: length {} != {}", got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        let tol = atol + rtol * w.abs();
        let diff = (g - w).abs();
        let ok = diff <= tol || (g == w); // g == w covers matching infinities
        assert!(ok, "{what}: first mismatch at {} (flat index {i}): got {g}, want {w}, |diff| {diff:e} > tol {tol:e}", coord(i));
    }
}

/// f32 slice to f64.
pub(crate) fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Coordinates of a flat index into a row-major shape, named: "t=3 h=1 j=5".
pub(crate) fn coord(names: &[&str], dims: &[usize], mut flat: usize) -> String {
    let mut idx = vec![0usize; dims.len()];
    for a in (0..dims.len()).rev() {
        idx[a] = flat % dims[a].max(1);
        flat /= dims[a].max(1);
    }
    names.iter().zip(&idx).map(|(n, i)| format!("{n}={i}")).collect::<Vec<_>>().join(" ")
}

/// `n` uniform values in [lo, hi) from a seeded generator.
pub(crate) fn rand(rng: &mut SplitMix64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    rng.vec_uniform(n, lo, hi)
}
