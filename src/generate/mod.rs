//! Decoding helpers: sampling from vocabulary-parallel logits, log-probabilities, penalties and
//! grammar masks (constrained decoding) on the same shards, and continuous batching.
pub mod batch;
mod candidates;
pub mod constraint;
pub mod logprobs;
mod noise;
pub mod penalties;
mod pipelined;
mod race;
pub mod sampling;

pub use batch::{BatchDecoder, FinishReason, SeqOptions, SeqRequest, TokenEvent};
pub use constraint::{mask_shard, share_masks, MaskRequest, RowMask, TokenFilter};
pub use logprobs::{shard_logprobs, LogprobRow, TokenLogprobs, MAX_TOP_LOGPROBS};
pub use penalties::{apply_penalties, History, Penalties};
pub use sampling::{sample_batch, DistributedSampler, SamplingParams, GREEDY_BELOW};
