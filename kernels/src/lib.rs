//! The CPU inner loops of candle-tp (`candle_tp::quant` drives them), in a crate of their own
//! so that they are compiled with optimisations in every profile: candle-tp's own debug builds
//! (what `cargo test` runs) would otherwise run SIMD intrinsics as unoptimised function calls,
//! 10-20× slower, and its model tests would spend their time here.
//!
//! - [`q8_1`], [`q8_k`], [`q8_0`]: the activation blocks and their quantization;
//! - the block types, each described once: [`q4_0`], [`q4_1`], [`q5_0`], [`q5_1`], [`q8_0`],
//!   [`q4_k`], [`q5_k`], [`q6_k`] (its layout and its exact block product in f64,
//!   [`f64_dot::F64Dot`], whose sums do not depend on how a row's blocks are split between
//!   ranks), and [`q4_0x4`], [`q4_1x4`], [`q5_0x4`], [`q5_1x4`], [`q8_0x4`], [`q4_kx4`],
//!   [`q5_kx4`], [`q6_kx4`] (how its blocks interleave four rows at a time and unpack for the
//!   engines);
//! - [`repack`]: the engines, one per instruction set (AVX2, AVX-512 VNNI), generic over those
//!   descriptions: weights repacked four rows at a time and their matmul, summed in f64, what
//!   every quantized product of candle-tp runs; [`f64_dot::dot_f64`] is their scalar
//!   reference, [`f64_matmul`] the rayon drivers;
//! - [`q4_1`], [`q5_0`], [`q5_1`] also keep f32 row kernels summed as ggml sums them (scalar
//!   and AVX2 + FMA + F16C), for `candle_tp::quant::matmul_q4_1` and its kin;
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
