//! Helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// A tensor of deterministic pseudo-random values in [-1, 1), the same on every rank and
/// every run.
pub fn seeded(shape: &[usize], seed: u64) -> Tensor {
    candle_tp::rng::seeded_uniform(shape, seed, 1.0, &Device::Cpu).expect("shape matches data")
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

/// Path of a built example binary next to this test binary
/// (`target/<profile>/deps/<test>-<hash>` → `target/<profile>/examples/<name>`).
/// `cargo test` builds the examples; a test run alone may need `cargo build --example NAME`.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let path = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("profile dir")
        .join("examples")
        .join(name);
    assert!(
        path.is_file(),
        "{} is not built: run `cargo test` (which builds the examples) or `cargo build --example {name}`",
        path.display()
    );
    path
}
