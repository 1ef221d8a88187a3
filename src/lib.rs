//! # candle-tp: tensor parallelism for Candle
//!
//! Split a model across processes (or GPUs) with layers that replace candle-nn's with a
//! one-word change, collectives that are Candle ops with autograd, and a torchrun-style
//! launcher (`tprun`).
//!
//! ```no_run
//! use candle_core::{DType, Device, Module, Tensor};
//! # fn main() -> candle_core::Result<()> {
//! # let (d, dir) = (256, "model-dir");
//! let device = Device::Cpu;
//! // Under `tprun --nproc-per-node 2 ...` (or torchrun): RANK, WORLD_SIZE, MASTER_ADDR, ...
//! let pg = candle_tp::init_from_env(&device)?;
//! let vb = candle_tp::ShardedVarBuilder::from_safetensors_dir(dir, DType::F32, &device, pg)?;
//! let up = candle_tp::column_linear(d, 4 * d, vb.pp("up_proj"))?; // was candle_nn::linear
//! let down = candle_tp::row_linear(4 * d, d, vb.pp("down_proj"))?; // all-reduce inside
//! let x = Tensor::zeros((1, 8, d), DType::F32, &device)?;
//! let y = down.forward(&up.forward(&x)?.gelu()?)?;
//! # Ok(()) }
//! ```
//!
//! - [`comm`]: [`ProcessGroup`] and its backends (the shared-memory engine for `threads` and
//!   `shm`; `mpi` and `hierarchical` across hosts with the `mpi` feature; `nccl`), sub-groups,
//!   point-to-point, [`init_from_env`], [`run_threads`].
//! - [`ops`]: Megatron's mappings (`copy_to_tp`, `reduce_from_tp`, …) with backward.
//! - [`nn`]: [`ColumnParallelLinear`], [`RowParallelLinear`], [`Mlp`], [`GatedMlp`],
//!   [`VocabParallelEmbedding`], [`ParallelLmHead`].
//! - [`loader`]: [`ShardedVarBuilder`] over memory-mapped safetensors (each rank reads only
//!   its slice) or tensors in memory.
//! - [`generate`]: sampling from vocabulary-parallel logits without gathering them.
//! - [`chat_template`]: a checkpoint's chat template, rendered as Hugging Face transformers
//!   renders it (used by the server and `examples/generate.rs`).
//! - [`text`]: a checkpoint's tokenizer, chat template and end-of-sequence tokens
//!   ([`text::ModelText`]) and incremental detokenisation with stop strings
//!   ([`text::TextStream`]), used by `examples/generate.rs` and the server.
//! - [`convert`]: GGUF → Hugging Face checkpoint and tokenizer, for the demo models.
//! - [`pipeline`]: pipeline-parallel schedules (GPipe, 1F1B) as data, and their replay.
//! - [`Partition`]: uneven splits (9 heads on 2 ranks is 5 + 4).
//! - [`quant`]: quantized CPU kernels ([`quant::QuantMatMul`]: SIMD Q4_1, Q8_0 and Q4_K
//!   matmuls, f64-summed products for row-parallel layers, candle's `QMatMul` for the other
//!   types).
//! - GPUs: cargo features `cuda` and `nccl` (one process per GPU, NCCL collectives on the
//!   tensors' stream), [`device_from_arg`] for `--device cpu|cuda`; see `docs/GPU.md`.
#![warn(missing_docs)]

pub mod chat_template;
pub mod comm;
pub mod convert;
mod device;
pub mod generate;
pub mod loader;
pub mod models;
pub mod nn;
pub mod ops;
pub mod partition;
pub mod pipeline;
pub mod quant;
pub mod rng;
#[cfg(feature = "server")]
pub mod serve;
pub mod text;
pub mod train;

pub use comm::{init_from_env, run_threads, DeviceMesh, ProcessGroup, ReduceOp};
pub use device::{device_from_arg, dtype_from_arg};
pub use loader::ShardedVarBuilder;
pub use nn::*;
pub use partition::{Partition, PartitionError};
