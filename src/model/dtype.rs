//! Model-dtype storage: the bytes that MLA rows and conv state occupy in a region.
//!
//! Compute is f32 everywhere; values are rounded (round-to-nearest-even) to the
//! model dtype whenever they are cached, on every path, so that the colocated
//! reference and the disaggregated ranks attend over identical stored values.

use handoff_components::vocab::Dtype;
use handoff_kernels::StorageDtype;
pub use handoff_kernels::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// The kernels' name for a model dtype (what [`handoff_kernels::Backend::round_to`] rounds to).
pub fn storage(dtype: Dtype) -> StorageDtype {
    match dtype {
        Dtype::F32 => StorageDtype::F32,
        Dtype::Bf16 => StorageDtype::Bf16,
        Dtype::F16 => StorageDtype::F16,
    }
}

/// Rounds every value to what `dtype` can store (identity for f32).
pub fn round_to(dtype: Dtype, xs: &mut [f32]) {
    match dtype {
        Dtype::F32 => {}
        Dtype::Bf16 => xs.iter_mut().for_each(|x| *x = bf16_to_f32(f32_to_bf16(*x))),
        Dtype::F16 => xs.iter_mut().for_each(|x| *x = f16_to_f32(f32_to_f16(*x))),
    }
}

/// Writes `xs` as `dtype` little-endian bytes into `out` (`xs.len() * dtype.bytes()` long).
pub fn encode(dtype: Dtype, xs: &[f32], out: &mut [u8]) {
    match dtype {
        Dtype::F32 => {
            for (x, o) in xs.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (x, o) in xs.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (x, o) in xs.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_to_f16(*x).to_le_bytes());
            }
        }
    }
}

/// Reads `dtype` little-endian bytes as f32 values.
pub fn decode(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::Bf16 => bytes.chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_then_decode_is_rounding_for_every_dtype() {
        let xs = [0.0f32, 1.0 + 1.0 / 256.0, -2.5, 0.333_333_34, 70000.0, 1e-9];
        for dt in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let mut bytes = vec![0u8; xs.len() * dt.bytes() as usize];
            encode(dt, &xs, &mut bytes);
            let mut want = xs;
            round_to(dt, &mut want);
            let got = decode(dt, &bytes);
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{dt:?}");
            let rounded: Vec<f32> = xs.iter().map(|&x| storage(dt).round(x)).collect();
            assert_eq!(rounded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{dt:?}");
        }
    }
}
