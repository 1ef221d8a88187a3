//! The CPU inner loops of candle-tp (`candle_tp::quant` drives them), in a crate of their own
//! so that they are compiled with optimisations in every profile: candle-tp's own debug builds
//! (what `cargo test` runs) would otherwise run SIMD intrinsics as unoptimised function calls,
//! 10-20× slower, and its model tests would spend their time here.
//!
//! - [`q8_1`]: ggml's Q8_1 activation blocks and their quantization;
//! - [`q4_1`]: the Q4_1 × Q8_1 dot product (scalar and AVX2 + FMA + F16C);
//! - [`q4_0`]: the Q4_0 × Q8_0 dot product in f64 (below), one row at a time;
//! - [`repack`]: weights repacked four rows at a time and their matmul, summed in f64: what
//!   every Q4_0 ([`q4_0x4`]), Q4_1 ([`q4_1x4`]), Q5_0 ([`q5_0x4`]), Q5_1 ([`q5_1x4`]), Q8_0
//!   ([`q8_0x4`]), Q4_K ([`q4_kx4`]), Q5_K ([`q5_kx4`]) and Q6_K ([`q6_kx4`]) product runs;
//! - [`q5_0`], [`q5_1`]: the Q5_0 × Q8_0 and Q5_1 × Q8_1 dot products (scalar and AVX2 + FMA +
//!   F16C), in f32 for whole rows and in f64 (below);
//! - [`f64_dot`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K dot products accumulated in f64,
//!   whose sums do not depend on how a row's blocks are split between ranks ([`q4_0`],
//!   [`q5_0`], [`q5_1`], [`q8_0`], [`q8_k`], [`q4_k`], [`q5_k`], [`q6_k`]: the block types), and
//!   [`f64_matmul`], their matmul over rayon;
//! - [`kernel`]: which implementation runs ([`kernel::Kernel`]: scalar, AVX2 or AVX-512 VNNI,
//!   detected at run time, forced with `CANDLE_TP_KERNEL=scalar|avx2|avx512vnni`);
//! - [`small_m`]: `x · Wᵀ` for a few activation rows (decode batches), batch-invariant;
//! - [`swiglu`]: `silu(gate) · up` in one pass, with an AVX2 exponential;
//! - [`attention`]: causal attention (a decode step's query rows against the KV cache, a
//!   prompt's rows against theirs) in one pass.

pub mod attention;
pub mod f64_dot;
pub mod f64_matmul;
pub mod kernel;
pub mod q4_0;
pub mod q4_0x4;
pub mod q4_1;
pub mod q4_1x4;
pub mod q4_k;
pub mod q4_kx4;
pub mod q5_0;
pub mod q5_0x4;
pub mod q5_1;
pub mod q5_1x4;
pub mod q5_k;
pub mod q5_kx4;
pub mod q6_k;
pub mod q6_kx4;
pub mod q8_0;
pub mod q8_0x4;
pub mod q8_1;
pub mod q8_k;
pub mod repack;
pub(crate) mod row_dot;
pub mod small_m;
pub mod swiglu;
