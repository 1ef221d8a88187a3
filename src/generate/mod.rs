//! Decoding helpers: sampling from vocabulary-parallel logits.
pub mod sampling;

pub use sampling::{DistributedSampler, SamplingParams};
