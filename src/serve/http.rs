//! The HTTP side (rank 0 only): axum routes for `POST /v1/chat/completions`, `POST
//! /v1/completions`, `GET /v1/models` and `GET /health`, answers as JSON or, with `stream:
//! true`, as server-sent events; every error in OpenAI's shape.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::generate::{FinishReason, SamplingParams};
use crate::serve::api::{ApiError, GenRequest};
use crate::serve::scheduler::{Event, Queue, Submission, SubmitError};
use crate::serve::text::{ModelText, TextStream};

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
}

/// `max_tokens` of a `/v1/completions` request that gives none (OpenAI's default; chat
/// completions default to the rest of the context).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// The API name of the model at `path` when `--model-name` is not given: the directory or
/// file name, less a `.gguf` or `.safetensors` extension (`Qwen3-0.6B` stays `Qwen3-0.6B`,
/// `smollm2.Q4_1.gguf` is `smollm2.Q4_1`); `model` when the path has no name.
pub fn default_model_name(path: &Path) -> String {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return "model".into();
    };
    for ext in [".gguf", ".safetensors"] {
        let cut = name.len().saturating_sub(ext.len());
        if cut > 0 && name.is_char_boundary(cut) && name[cut..].eq_ignore_ascii_case(ext) {
            return name[..cut].to_string();
        }
    }
    name
}

/// A completion id unique in this process and unlikely to repeat across processes: a
/// random 64-bit prefix drawn once and a counter (`seed` and time play no part, so equal
/// seeds in the same second still get different ids).
fn completion_id(chat: bool) -> String {
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| {
        // std's hash keys are random per process; mix in the time and pid for good measure.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        h.finish()
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let kind = if chat { "chatcmpl" } else { "cmpl" };
    format!("{kind}-{prefix:016x}{n:08x}")
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json_response(status, &self.body())
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// The router over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(404, "invalid_request_error", Some("not_found"), "no such endpoint: the server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        405,
        "invalid_request_error",
        Some("method_not_allowed"),
        "method not allowed on this endpoint",
    )
}

async fn health(State(s): State<AppState>) -> Response {
    if s.queue.is_shutting_down() {
        return ApiError::new(
            503,
            "server_error",
            Some("shutting_down"),
            "the server is shutting down",
        )
        .into_response();
    }
    json_response(
        StatusCode::OK,
        &json!({"status": "ok", "active": s.queue.active()}),
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(s): State<AppState>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": unix_now(), "owned_by": "candle-tp"
        }]}),
    )
}

async fn completions(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    serve(s, body, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(s, body, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// One accepted request: what the answer needs besides the tokens.
struct Job {
    chat: bool,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    include_usage: bool,
    text: Arc<ModelText>,
    stream: TextStream,
    rx: UnboundedReceiver<Event>,
    completion_tokens: usize,
    /// The prompt's ids when the request asked for `return_token_ids`.
    prompt_ids: Option<Vec<u32>>,
    /// Generated ids not yet sent (kept only for `return_token_ids`).
    pending_ids: Vec<u32>,
}

fn finish_name(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn event_error(msg: String) -> ApiError {
    ApiError::new(503, "server_error", Some("unavailable"), msg)
}

impl Job {
    /// Waits for the next piece of text: `Ok((text, Some(finish)))` at the end.
    async fn next(&mut self) -> Result<(String, Option<&'static str>), ApiError> {
        match self.rx.recv().await {
            Some(Event::Token { token, finish }) => {
                self.completion_tokens += 1;
                if self.prompt_ids.is_some() {
                    self.pending_ids.push(token);
                }
                let mut piece = self.stream.push(&self.text, token).map_err(server_error)?;
                if self.stream.stopped() {
                    self.rx.close(); // the scheduler drops the sequence
                    return Ok((piece, Some("stop")));
                }
                if let Some(f) = finish {
                    piece.push_str(&self.stream.finish(&self.text).map_err(server_error)?);
                    return Ok((piece, Some(finish_name(f))));
                }
                Ok((piece, None))
            }
            Some(Event::Error(e)) => Err(event_error(e)),
            None => Err(event_error("the server is shutting down".into())),
        }
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    /// A choice; with `return_token_ids` it also takes the ids generated since the last one.
    fn choice(&mut self, text: &str, finish: Option<&str>, delta: bool) -> Value {
        let mut c = self.choice_text(text, finish, delta);
        if let Some(prompt) = &self.prompt_ids {
            c["token_ids"] = json!(std::mem::take(&mut self.pending_ids));
            if !delta {
                c["prompt_token_ids"] = json!(prompt);
            }
        }
        c
    }

    fn choice_text(&self, text: &str, finish: Option<&str>, delta: bool) -> Value {
        match (self.chat, delta) {
            (true, true) => {
                json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
            }
            (true, false) => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
            }
            (false, _) => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    fn envelope(&self, choices: Value, chunk: bool) -> Value {
        json!({
            "id": self.id, "object": self.object(chunk), "created": self.created,
            "model": self.model, "choices": choices,
        })
    }
}

fn server_error(e: candle_core::Error) -> ApiError {
    ApiError::new(
        500,
        "server_error",
        None,
        crate::serve::api::client_message(&e),
    )
}

async fn serve(
    s: AppState,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| {
        ApiError::new(
            e.status().as_u16(),
            "invalid_request_error",
            None,
            format!("reading the body: {e}"),
        )
    })?;
    let req = GenRequest::parse(&body, chat)?;
    if let Some(m) = &req.model {
        if m != &s.model_name {
            return Err(ApiError {
                param: Some("model".into()),
                ..ApiError::new(
                    404,
                    "invalid_request_error",
                    Some("model_not_found"),
                    format!(
                        "the model '{m}' does not exist: this server serves '{}'",
                        s.model_name
                    ),
                )
            });
        }
    }
    let text = s.text.clone();
    let (prompt_text, add_special) = match &req.messages {
        Some(msgs) => (
            text.render_chat(msgs).map_err(|e| {
                ApiError::invalid("messages", crate::serve::api::client_message(&e))
            })?,
            false,
        ),
        None => (req.prompt.clone().unwrap_or_default(), true),
    };
    if prompt_text.is_empty() {
        return Err(ApiError::invalid(
            if chat { "messages" } else { "prompt" },
            "the prompt is empty",
        ));
    }
    let ids = text
        .encode(&prompt_text, add_special)
        .map_err(server_error)?;
    let param = if chat { "messages" } else { "prompt" };
    if ids.is_empty() {
        return Err(ApiError::invalid(param, "the prompt has no tokens"));
    }
    // An id the model has no embedding for (an added token of the tokenizer) would fail the
    // whole batch's step.
    if let Some((i, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= s.vocab_size)
    {
        return Err(ApiError::invalid(
            param,
            format!(
                "token {i} of the prompt has id {id}, outside the model's vocabulary of {} ids (the tokenizer knows more tokens than the model)",
                s.vocab_size
            ),
        ));
    }
    if ids.len() >= s.max_seq_len {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(param, format!(
                "the prompt has {} tokens; the longest sequence is {} tokens (prompt and completion)",
                ids.len(), s.max_seq_len))
        });
    }
    let room = s.max_seq_len - ids.len();
    let max_tokens = match req.max_tokens {
        None if chat => room,
        // At least min_tokens, which the client asked for explicitly.
        None => COMPLETIONS_DEFAULT_MAX_TOKENS
            .max(req.min_tokens)
            .min(room),
        Some(n) if n > room => {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid("max_tokens", format!(
                    "max_tokens = {n} with a prompt of {} tokens exceeds the longest sequence of {} tokens (at most {room})",
                    ids.len(), s.max_seq_len))
            })
        }
        Some(n) => n,
    };
    let (tx, rx) = unbounded_channel();
    let seed = req.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let prompt_tokens = ids.len();
    let prompt_ids = req.return_token_ids.then(|| ids.clone());
    s.queue
        .submit(Submission {
            prompt: ids,
            max_tokens,
            // Capped where the context has no room for it (max_tokens absent).
            min_tokens: req.min_tokens.min(max_tokens),
            params: SamplingParams {
                temperature: req.temperature,
                top_k: req.top_k,
                top_p: req.top_p,
                seed,
            },
            stop_ids: s.eos.clone(),
            events: tx,
        })
        .map_err(|e| match e {
            SubmitError::Full => ApiError::new(
                503,
                "server_error",
                Some("queue_full"),
                format!(
                "the server is busy: {} requests are already waiting (--max-queue); retry later",
                s.queue.capacity()),
            ),
            SubmitError::ShuttingDown => ApiError::new(
                503,
                "server_error",
                Some("shutting_down"),
                "the server is shutting down",
            ),
        })?;
    let created = unix_now();
    let mut job = Job {
        chat,
        id: completion_id(chat),
        created,
        model: s.model_name.clone(),
        prompt_tokens,
        include_usage: req.include_usage,
        text,
        stream: TextStream::new(req.stop.clone()),
        rx,
        completion_tokens: 0,
        prompt_ids,
        pending_ids: Vec::new(),
    };
    if req.stream {
        return Ok(stream_response(job));
    }
    let mut out = String::new();
    let finish = loop {
        let (piece, finish) = job.next().await?;
        out.push_str(&piece);
        if let Some(f) = finish {
            break f;
        }
    };
    let choice = job.choice(&out, Some(finish), false);
    let mut v = job.envelope(json!([choice]), false);
    v["usage"] = job.usage();
    Ok(json_response(StatusCode::OK, &v))
}

/// State of one SSE answer.
struct Sending {
    job: Job,
    queued: VecDeque<String>,
    done: bool,
}

fn stream_response(job: Job) -> Response {
    let mut queued = VecDeque::new();
    if job.chat {
        let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
        queued.push_back(job.envelope(json!([first]), true).to_string());
    }
    let state = Sending {
        job,
        queued,
        done: false,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queued.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            match st.job.next().await {
                Ok((piece, None)) => {
                    if !piece.is_empty() {
                        let c = st.job.choice(&piece, None, true);
                        st.queued
                            .push_back(st.job.envelope(json!([c]), true).to_string());
                    }
                }
                Ok((piece, Some(f))) => {
                    let c = st.job.choice(&piece, Some(f), true);
                    let mut last = st.job.envelope(json!([c]), true);
                    if !st.job.include_usage {
                        last["usage"] = st.job.usage();
                    }
                    st.queued.push_back(last.to_string());
                    if st.job.include_usage {
                        let mut u = st.job.envelope(json!([]), true);
                        u["usage"] = st.job.usage();
                        st.queued.push_back(u.to_string());
                    }
                    st.queued.push_back("[DONE]".into());
                    st.done = true;
                }
                Err(e) => {
                    st.queued.push_back(e.body().to_string());
                    st.queued.push_back("[DONE]".into());
                    st.done = true;
                }
            }
        }
    });
    Sse::new(events).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_keep_dots() {
        let name = |p: &str| default_model_name(Path::new(p));
        assert_eq!(name("/m/Qwen3-0.6B"), "Qwen3-0.6B");
        assert_eq!(name("/m/Qwen3-0.6B/"), "Qwen3-0.6B");
        assert_eq!(
            name("/m/smollm2-135m-instruct.Q4_1.gguf"),
            "smollm2-135m-instruct.Q4_1"
        );
        assert_eq!(name("/m/Llama-3.2-1B.GGUF"), "Llama-3.2-1B");
        assert_eq!(name("model.safetensors"), "model");
        assert_eq!(name("/m/.gguf"), ".gguf");
        assert_eq!(name("/"), "model");
    }

    #[test]
    fn ids_differ() {
        let a = completion_id(false);
        let b = completion_id(false);
        assert_ne!(a, b);
        assert!(a.starts_with("cmpl-") && completion_id(true).starts_with("chatcmpl-"));
    }
}
