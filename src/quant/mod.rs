//! Quantized CPU kernels: what candle 0.11 runs in scalar code, made fast.
//!
//! Candle 0.11.1 has SIMD dot products for Q4_0, Q8_0 and the k-quants but multiplies Q4_1
//! (the type SmolLM2's GGUF package ships), Q5_0 and Q5_1 (most of llama.cpp's Q4_K_M and
//! Q5_K_M files of models whose rows are not multiples of 256) in scalar code, and its Q4_1
//! dot product asserts (in debug builds) an even block count per row, which a row-parallel
//! shard need not have. This module adds:
//!
//! - [`BlockQ8_1`] and [`quantize_row_q8_1`]: the activation format (ggml's `block_q8_1`);
//! - [`vec_dot_q4_1_q8_1`]: the Q4_1 × Q8_1 dot product, [`Kernel::Scalar`] or
//!   [`Kernel::Avx2`] (AVX2 + FMA + F16C, runtime-detected), any block count;
//! - [`matmul_q4_1`], [`matmul_q5_0`], [`matmul_q5_1`]: `x · Wᵀ` over rayon in f32 (Q4_1's bit
//!   for bit candle's), quantizing each activation row once, four weight rows sharing each
//!   activation load; [`matmul_q4_0`]: the same call through the repacked kernel;
//! - [`matmul_f64`] and [`QuantMatMul::forward_f64`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
//!   Q5_K and Q6_K products summed in f64, so that a row-parallel layer gives the same values at every
//!   world size;
//! - [`QuantMatMul`]: the one-call `Module` for a quantized weight, the crate's kernel where it
//!   has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights repacked four rows at a time
//!   when it is built, `candle_tp_kernels::repack`, every product summed in f64) and candle's
//!   `QMatMul` otherwise (other types, other devices);
//! - [`QuantType`]: each weight type described once (split unit, CPU product, f64 kernel);
//! - [`matmul_small_m`]: dense f32 / bf16 / f16 weights at decode sizes (≤ 16 rows), reading
//!   each weight row once for the whole batch, batch-invariant (candle 0.11 packs the weight
//!   for every f32 product of 2+ rows and widens a whole bf16 weight to f32 on every call).
//!
//! The inner loops (dot products, Q8_1 quantization) live in the `candle-tp-kernels` crate of
//! this repository (`kernels/`), compiled optimised in every profile.
//!
//! See "Quantized kernels" in `docs/PERFORMANCE.md` for which types are fast on which CPUs.

mod input_rows;
mod matmul;
mod shared;
mod small_m;
pub mod types;

pub use candle_tp_kernels::f64_dot::{dot_f64, F64Dot};
pub use candle_tp_kernels::q4_1::{vec_dot_q4_1_q8_1, BlockQ4_1, Kernel, QK4_1};
pub use candle_tp_kernels::q8_1::{quantize_row_q8_1, BlockQ8_1, QK8_1};
pub use candle_tp_kernels::repack::{matmul_f64, matmul_f64_bytes, F64MatMulFn};
pub use matmul::{matmul_q4_0, matmul_q4_1, matmul_q5_0, matmul_q5_1, QuantMatMul};
pub use shared::{prepared_in_scope, share_activations};
pub use small_m::{matmul_small_m, SMALL_M_MAX_ROWS};
pub use types::{has_f64_kernel, CpuProduct, QuantType};
