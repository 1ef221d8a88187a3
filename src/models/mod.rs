//! Tensor-parallel models built from the parallel layers, read from Hugging Face checkpoints.
pub mod bert;
