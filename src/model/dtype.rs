//! Model-dtype storage: the bytes that MLA rows and conv state occupy in a region.
//!
//! Compute is f32 everywhere; values are rounded (round-to-nearest-even) to the
//! model dtype whenever they are cached, on every path, so that the colocated
//! reference and the disaggregated ranks attend over identical stored values.

use handoff_components::vocab::Dtype;

/// f32 -> bf16 bits, round to nearest, ties to even; NaN stays a quiet NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb) >> 16) as u16
}

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 -> IEEE half bits, round to nearest, ties to even; overflow gives infinity.
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 112; // rebias 127 -> 15
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1u32 << shift) - 1);
        let mut r = m >> shift;
        if rem > half || (rem == half && r & 1 == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && r & 1 == 1) {
        r += 1;
    }
    sign | r as u16
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        let v = man as f32 * (1.0 / 16_777_216.0);
        return if sign != 0 { -v } else { v };
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
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
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 / 256.0)), 1.0 + 1.0 / 64.0);
        assert_eq!(bf16_to_f32(f32_to_bf16(-2.5)), -2.5);
    }

    #[test]
    fn f16_round_trips_and_rounds() {
        for v in [0.0f32, 1.0, -1.5, 65504.0, 6.1035156e-5, 5.9604645e-8, 0.333_333_34] {
            let r = f16_to_f32(f32_to_f16(v));
            assert!((r - v).abs() <= v.abs() * 1e-3 + 6e-8, "{v} -> {r}");
        }
        assert_eq!(f16_to_f32(f32_to_f16(1.0 + 1.0 / 2048.0)), 1.0);
        assert_eq!(f16_to_f32(f32_to_f16(70000.0)), f32::INFINITY);
        // Every f16 value survives decode -> encode.
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f32_to_f16(x), h, "f16 bits {h:#06x}");
            }
        }
    }
}
