//! Training with tensor, sequence and data parallelism (Megatron-LM's recipe).
//!
//! - [`init`]: seeded sharded initialisation ([`TrainInit`]) equal to one process, and saving
//!   the shards as one Hugging Face checkpoint.
//! - [`cross_entropy`]: [`vocab_parallel_cross_entropy`], never gathering the vocabulary.
//! - [`model`]: [`TrainLlama`], a Llama-style LM (dense, or Mixtral-style sparse MoE layers)
//!   with optional sequence and expert parallelism.
//! - [`dropout`]: shared seeds outside TP regions, per-rank seeds inside.
//! - [`grads`]: gradient all-reduce over the TP group (sequence-parallel parameters) and the
//!   DP group (averaging) before `candle_nn::AdamW::step`.
pub mod config;
pub mod cross_entropy;
pub mod dropout;
pub mod grads;
pub mod init;
pub mod model;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use dropout::{Dropout, Site};
pub use grads::{activation_bytes, all_reduce_grads};
pub use init::{Init, Param, SplitMix64, TrainInit};
pub use model::{TrainConfig, TrainLlama};
