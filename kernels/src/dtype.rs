//! Storage dtypes of cached values (MLA rows, conv state).
//!
//! Compute is f32 everywhere; values are rounded to the storage dtype whenever
//! they are cached ([`crate::Backend::round_to`]), on every path, so that every
//! placement attends over identical stored values. The bit conversions live here
//! so that the backend's rounding and the host's byte encoding are one function.

/// What a cached value is stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageDtype {
    /// IEEE single: rounding is the identity.
    F32,
    /// bfloat16: the top 16 bits of an f32, round to nearest even.
    Bf16,
    /// IEEE half, round to nearest even; overflow gives infinity.
    F16,
}

impl StorageDtype {
    /// `x` rounded to what this dtype stores.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            StorageDtype::F32 => x,
            StorageDtype::Bf16 => bf16_to_f32(f32_to_bf16(x)),
            StorageDtype::F16 => f16_to_f32(f32_to_f16(x)),
        }
    }
}

/// f32 -> bf16 bits, round to nearest, ties to even; NaN stays a quiet NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
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

/// IEEE half bits -> f32 (exact).
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
