//! Decoding helpers: sampling from vocabulary-parallel logits, and continuous batching.
pub mod batch;
mod candidates;
mod noise;
mod race;
pub mod sampling;

pub use batch::{BatchDecoder, FinishReason, SeqRequest, TokenEvent};
pub use sampling::{sample_batch, DistributedSampler, SamplingParams};
