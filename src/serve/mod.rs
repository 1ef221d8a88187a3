//! An OpenAI-compatible HTTP server over the tensor-parallel ranks, with continuous batching
//! (cargo feature `server`; the `candle-tp-serve` binary runs it under `tprun`).
//!
//! - [`step`]: the per-step decision rank 0 broadcasts to every rank.
//! - [`scheduler`]: the replicated loop over a
//!   [`BatchDecoder`](crate::generate::BatchDecoder) (rank 0 plans, every rank steps).
//! - [`embeddings`]: `POST /v1/embeddings` over the tensor-parallel BERT encoder (a server
//!   started on a sentence-embedding checkpoint).
//! - [`api`], [`fields`] and [`http`]: the OpenAI request fields (each one honoured or
//!   refused) and errors, and the axum routes (rank 0).
pub mod api;
pub mod embeddings;
pub mod endpoints;
pub mod fields;
pub mod http;
pub mod job;
pub mod logprobs;
mod messages;
pub mod metrics;
mod options;
pub mod scheduler;
pub mod step;

pub use crate::text::{ChatMessage, ModelText, TextStream};
pub use api::{ApiError, GenRequest, Prompt};
pub use http::{
    default_model_name, router, AppState, COMPLETIONS_DEFAULT_MAX_TOKENS, DEFAULT_MAX_BODY_BYTES,
};
pub use scheduler::{
    queue, run_follower, run_leader, Event, Inbox, Queue, Submission, SubmitError,
};
pub use step::StepPlan;
