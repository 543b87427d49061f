//! Unit tests of the CPU backend against direct naive versions in f64.

use super::*;
use crate::error::KernelError;
use crate::rng::SplitMix64;
use crate::shapes::replay_record_width;
use crate::testutil::{assert_close, coord, f64s, rand};

const BE: CpuBackend = CpuBackend;

fn up(x: &[f32]) -> CpuBuf {
    BE.upload(x).unwrap()
}

// ---------------------------------------------------------------- naive f64

fn softplus64(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}
fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}
fn silu64(x: f64) -> f64 {
    x * sigmoid64(x)
}

mod attention;
mod conv_norm;
mod dense_copy;
mod kda_replay;
