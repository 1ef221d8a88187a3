//! An OpenAI-compatible HTTP server over the tensor-parallel ranks, with continuous batching
//! (cargo feature `server`; the `candle-tp-serve` binary runs it under `tprun`).
//!
//! - [`step`]: the per-step decision rank 0 broadcasts to every rank.
//! - [`scheduler`]: the replicated loop over a
//!   [`BatchDecoder`](crate::generate::BatchDecoder) (rank 0 plans, every rank steps).
//! - [`embeddings`]: `POST /v1/embeddings` over the tensor-parallel BERT encoder (a server
//!   started on a sentence-embedding checkpoint).
//! - [`error`], [`fields`], [`api`] and [`http`]: OpenAI's error answer, the request fields
//!   (each one honoured or refused), the request read from them, and the axum routes (rank 0).
//! - [`limits`]: connections, request and answer deadlines, and the text work off the async
//!   thread, bounded.
//! - [`grammar`]: llguidance grammars (structured outputs, forced tool calls) as the batch
//!   decoder's token filters; `response_format`, [`tools`] and [`tool_calls`]: the fields and
//!   the model's tool-call formats.
pub mod api;
mod connection;
pub mod embeddings;
pub mod endpoints;
pub mod error;
pub mod fields;
pub mod grammar;
pub mod http;
pub mod job;
pub mod limits;
pub mod logprobs;
mod messages;
pub mod metrics;
mod options;
mod reply;
mod response_format;
pub mod scheduler;
mod stamp;
pub mod state;
pub mod step;
pub mod tool_calls;
pub mod tools;

pub use crate::text::{ChatMessage, ModelText, TextStream};
pub use api::{ApiError, GenRequest, Prompt};
pub use http::{
    default_model_name, router, COMPLETIONS_DEFAULT_MAX_TOKENS, DEFAULT_MAX_BODY_BYTES,
};
pub use limits::{ConnLimits, RequestLimits, TextJobs};
pub use scheduler::{
    idle_heartbeat, longest_step, queue, run_follower, run_leader, Event, Inbox, Queue, Submission,
    SubmitError,
};
pub use state::AppState;
pub use step::StepPlan;
