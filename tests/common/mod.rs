//! Helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// A tensor of deterministic pseudo-random values in [-1, 1) (splitmix64), the same on every
/// rank and every run.
pub fn seeded(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x1234_5678;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("shape matches data")
}

/// Largest absolute difference of two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    a.to_dtype(DType::F32)?
        .sub(&b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}

/// A trainable copy of `t`.
pub fn var(t: &Tensor) -> Var {
    Var::from_tensor(t).expect("var")
}
