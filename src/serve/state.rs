//! [`AppState`]: what the text server's handlers share (the model's text side and limits,
//! the scheduler's queue, the grammar compiler, the API key).
//!
//! Below the routes: [`http`](super::http) (the router) and [`endpoints`](super::endpoints)
//! take it; it imports neither. `serve::http::AppState`, its path before this file, is a
//! re-export of it.

use std::sync::Arc;

use crate::serve::grammar::Grammars;
use crate::serve::limits::RequestLimits;
use crate::serve::scheduler::Queue;
use crate::serve::tools::ToolFormat;
use crate::text::ModelText;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The served model's name (`/v1/models`, the `model` field).
    pub model_name: String,
    /// Tokenizer and chat template.
    pub text: Arc<ModelText>,
    /// End-of-sequence ids.
    pub eos: Vec<u32>,
    /// The longest sequence (prompt and generated tokens).
    pub max_seq_len: usize,
    /// The model's vocabulary size: a prompt id at or above it is refused (400).
    pub vocab_size: usize,
    /// The scheduler's queue.
    pub queue: Queue,
    /// The key clients must send as `Authorization: Bearer KEY` (`None`: no check).
    pub api_key: Option<String>,
    /// The largest request body read, in bytes (`--max-body-bytes`); a larger one is a 400
    /// before any of it is parsed or tokenized.
    pub max_body_bytes: usize,
    /// The grammar compiler (structured outputs, forced tool calls), or why there is none
    /// (a tokenizer whose vocabulary llguidance cannot read: such requests get a 400).
    pub grammars: Result<Grammars, String>,
    /// How the model writes tool calls (from its chat template).
    pub tool_format: ToolFormat,
    /// The body deadline, the text work off the async thread and the streams' keep-alives.
    pub limits: RequestLimits,
}
