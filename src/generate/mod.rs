//! Decoding helpers: sampling from vocabulary-parallel logits, and continuous batching.
pub mod batch;
pub mod sampling;

pub use batch::{BatchDecoder, FinishReason, SeqRequest, TokenEvent};
pub use sampling::{DistributedSampler, SamplingParams};
