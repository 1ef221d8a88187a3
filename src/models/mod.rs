//! Tensor-parallel models built from the parallel layers, read from Hugging Face checkpoints.
pub mod bert;
pub mod llama;
pub mod llama_config;

pub use llama::Llama;
pub use llama_config::{LlamaConfig, SUPPORTED_ARCHITECTURES};
