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
//! # The layers, top to bottom
//!
//! Data flows down; nothing calls up. A newcomer reads them in this order:
//!
//! ```text
//! tprun, candle-tp-serve, serve, examples      launch a job, serve a model over HTTP
//!   generate | train | pipeline                decode and sample | train | pipeline stages
//!     models                                   CausalLm (Llama, Qwen3, Gemma, Phi-3, Mixtral), BERT
//!       nn            quant -> kernels/        parallel layers | quantized matmuls
//!         ops         loader -> gguf           collectives as Candle ops | sharded weights
//!           comm                               process groups and their backends
//! ```
//!
//! - [`models`]: one decoder for every causal-LM family ([`models::CausalLm`]; a family is a
//!   `config.json` parser, [`models::family`]), [`models::Llama`] and BERT; every model loads a
//!   Hugging Face directory or a GGUF file through [`models::FromCheckpoint`].
//! - [`generate`]: sampling from vocabulary-parallel logits without gathering them, batched
//!   decoding. [`train`]: sharded initialisation, vocabulary-parallel cross-entropy, training
//!   with TP, SP and DP × TP. [`pipeline`]: pipeline parallelism: a rank's stage
//!   ([`pipeline::PipelineStage`]: the decoders and the training model load only its layers),
//!   the schedules (GPipe, 1F1B) as data with their replay, and [`pipeline::train_step`].
//! - `serve` (feature `server`): the OpenAI-compatible server (binary `candle-tp-serve`).
//!   [`chat_template`]: a checkpoint's chat template, rendered as Hugging Face transformers
//!   renders it (used by the server and `examples/generate.rs`).
//! - [`nn`]: [`ColumnParallelLinear`], [`RowParallelLinear`], [`Mlp`], [`GatedMlp`],
//!   [`VocabParallelEmbedding`], [`ParallelLmHead`], [`ParallelAttention`], [`SparseMoe`];
//!   2D and 3D layers ([`Linear2d`], [`Linear3d`], …).
//! - [`text`]: a checkpoint's tokenizer, chat template and end-of-sequence tokens
//!   ([`text::ModelText`]) and incremental detokenisation with stop strings
//!   ([`text::TextStream`]), used by `examples/generate.rs` and the server.
//! - [`quant`]: quantized CPU kernels ([`quant::QuantMatMul`]: SIMD Q4_0, Q4_1, Q5_0, Q5_1,
//!   Q8_0 and Q4_K matmuls, f64-summed products for row-parallel layers, candle's `QMatMul`
//!   for the other types; [`quant::QuantType`] describes each type once).
//! - [`ops`]: Megatron's mappings (`copy_to_tp`, `reduce_from_tp`, …) with backward.
//! - [`loader`]: [`ShardedVarBuilder`] over memory-mapped safetensors or GGUF files (each
//!   rank reads only its slice) or tensors in memory. [`gguf`]: reading GGUF files (header,
//!   metadata, configuration, tokenizer, tensor names), for the loader and [`convert`] (GGUF →
//!   Hugging Face checkpoint and tokenizer, for the demo models).
//! - [`comm`]: [`ProcessGroup`] and its backends (the shared-memory engine for `threads` and
//!   `shm`; `mpi` and `hierarchical` across hosts with the `mpi` feature; `nccl`), sub-groups,
//!   [`DeviceMesh`], point-to-point, [`init_from_env`], [`run_threads`].
//! - [`Partition`]: uneven splits (9 heads on 2 ranks is 5 + 4); [`rng`]: the same random
//!   stream on every rank.
//! - GPUs: cargo features `cuda` and `nccl` (one process per GPU, NCCL collectives on the
//!   tensors' stream), [`device_from_arg`] for `--device cpu|cuda`; see `docs/GPU.md`.
//!
//! `docs/ARCHITECTURE.md` describes each layer and the invariants it relies on.
#![warn(missing_docs)]

pub mod chat_template;
pub mod comm;
pub mod convert;
mod device;
pub mod generate;
pub mod gguf;
pub mod loader;
mod memory;
pub mod models;
pub mod nn;
pub mod ops;
pub mod partition;
pub mod pipeline;
mod pool;
pub mod quant;
pub mod rng;
#[cfg(feature = "server")]
pub mod serve;
mod stage;
pub mod text;
pub mod train;

pub use comm::{init_from_env, run_threads, DeviceMesh, ProcessGroup, ReduceOp};
pub use device::{device_from_arg, dtype_from_arg};
pub use loader::ShardedVarBuilder;
pub use memory::{retain_freed_memory, trim_freed_memory};
pub use nn::*;
pub use partition::{Partition, PartitionError};
