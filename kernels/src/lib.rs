//! The CPU inner loops of candle-tp (`candle_tp::quant` drives them), in a crate of their own
//! so that they are compiled with optimisations in every profile: candle-tp's own debug builds
//! (what `cargo test` runs) would otherwise run SIMD intrinsics as unoptimised function calls,
//! 10-20× slower, and its model tests would spend their time here.
//!
//! - [`q8_1`]: ggml's Q8_1 activation blocks and their quantization;
//! - [`q4_1`]: the Q4_1 × Q8_1 dot product (scalar and AVX2 + FMA + F16C);
//! - [`small_m`]: `x · Wᵀ` for a few activation rows (decode batches), batch-invariant.

pub mod q4_1;
pub mod q8_1;
pub mod small_m;
