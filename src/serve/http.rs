//! The HTTP side (rank 0 only): axum routes for `POST /v1/chat/completions` and `POST
//! /v1/completions` (answers as JSON or, with `stream: true`, as server-sent events), and
//! those of [`endpoints`] (`/v1/models`, `/health`, `/metrics`,
//! `/tokenize`, `/detokenize`, the API key); every error in OpenAI's shape.
//!
//! The top of the text server: it imports the request ([`api`](super::api)), the other
//! endpoints, the answers ([`job`], `reply`) and the shared [`AppState`] (defined in
//! [`state`](super::state), re-exported here so that `serve::http::AppState` stays); no file
//! of the crate imports this one (`serve` re-exports its public items).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::mpsc::unbounded_channel;

use crate::generate::{SamplingParams, SeqOptions, SeqRequest};
use crate::serve::api::{GenRequest, Prompt};
use crate::serve::endpoints;
use crate::serve::error::{client_message, ApiError};
use crate::serve::grammar::{GrammarFilter, GrammarSpec, Grammars};
use crate::serve::job::{self, server_error, Head, Job};
use crate::serve::limits::read_body;
use crate::serve::logprobs::LogprobsOut;
use crate::serve::reply::method_not_allowed;
use crate::serve::scheduler::{Submission, SubmitError};
use crate::serve::stamp::{unique_id, unix_now};
pub use crate::serve::state::AppState;
use crate::serve::tool_calls::ToolStream;
use crate::serve::tools::ToolFormat;
use crate::text::{ModelText, TextStream};

/// `--max-body-bytes`'s default: 2 MiB (axum's own default limit).
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 << 20;

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

/// A completion id (`chatcmpl-...`, `cmpl-...`): [`unique_id`].
fn completion_id(chat: bool) -> String {
    unique_id(if chat { "chatcmpl" } else { "cmpl" })
}

/// The router over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(endpoints::health))
        .route("/metrics", get(endpoints::metrics))
        .route("/v1/models", get(endpoints::models))
        // A catch-all: Hugging Face ids hold slashes (`org/name`).
        .route("/v1/models/{*id}", get(endpoints::model))
        .route("/tokenize", post(endpoints::tokenize))
        .route("/detokenize", post(endpoints::detokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route(
            "/v1/embeddings",
            post(crate::serve::embeddings::no_embeddings),
        )
        // On the routes only: a path the server does not have is a 404, key or not.
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            endpoints::require_key,
        ))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(404, "invalid_request_error", Some("not_found"), "no such endpoint: the server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /health, GET /metrics")
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve(s, headers, body, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve(s, headers, body, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn serve(
    s: AppState,
    headers: HeaderMap,
    body: Body,
    chat: bool,
) -> Result<Response, ApiError> {
    let body = read_body(s.max_body_bytes, s.limits.body_timeout, &headers, body).await?;
    let req = GenRequest::parse(&body, chat)?;
    if let Some((id, _)) = req
        .penalties
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= s.vocab_size)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "'logit_bias' names token {id}, outside the model's vocabulary of {} ids",
                s.vocab_size
            ),
        ));
    }
    if let Some(m) = &req.model {
        if m != &s.model_name {
            return Err(endpoints::model_not_found(&s, m));
        }
    }
    let text = s.text.clone();
    let param = if chat { "messages" } else { "prompt" };
    // Each prompt's ids (chat: the one rendered conversation) and the grammar, off the async
    // thread (at most --max-tokenize-jobs at once).
    let (req, prompts, grammar) = {
        let text = text.clone();
        let (grammars, format) = (s.grammars.clone(), s.tool_format);
        s.limits
            .text_jobs
            .run(move || {
                let prompts = prompt_ids(&text, &req);
                let grammar = compile_grammar(&grammars, format, &req);
                (req, prompts, grammar)
            })
            .await?
    };
    let prompts = prompts?;
    let grammar = grammar?;
    let batch = prompts.len() > 1;
    let mut limits = Vec::with_capacity(prompts.len());
    for (k, ids) in prompts.iter().enumerate() {
        let which = if batch {
            format!("prompt {k}")
        } else {
            "the prompt".to_string()
        };
        limits.push(check_prompt(&s, &req, ids, param, &which, chat)?);
    }
    if prompts.len() * req.n > s.queue.capacity().max(1) {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts x n = {} make {} choices; this server queues at most {} (--max-queue)",
                prompts.len(),
                req.n,
                prompts.len() * req.n,
                s.queue.capacity()
            ),
        ));
    }
    let seed = req.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let queued = Instant::now();
    let mut jobs = Vec::with_capacity(prompts.len() * req.n);
    let mut subs = Vec::with_capacity(prompts.len() * req.n);
    let mut total_prompt_tokens = 0u64;
    for (k, (ids, max_tokens)) in prompts.into_iter().zip(limits).enumerate() {
        for j in 0..req.n {
            let index = k * req.n + j;
            let (tx, rx) = unbounded_channel();
            let prompt_tokens = if j == 0 { ids.len() } else { 0 };
            let prompt_ids = req.return_token_ids.then(|| ids.clone());
            subs.push(Submission {
                seq: SeqRequest {
                    id: 0, // set by the loop
                    prompt: ids.clone(),
                    max_tokens,
                    // Capped where the context has no room for it (max_tokens absent).
                    min_tokens: req.min_tokens.min(max_tokens),
                    params: SamplingParams {
                        temperature: req.temperature,
                        top_k: req.top_k,
                        top_p: req.top_p,
                        // Choices differ; the first has the request's seed (n = 1 as before).
                        seed: seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    },
                    stop_ids: s.eos.clone(),
                    options: SeqOptions {
                        logprobs: req.logprobs,
                        penalties: req.penalties.clone(),
                        constrained: grammar.is_some(),
                    },
                },
                filter: grammar
                    .clone()
                    .map(|g| Box::new(g) as Box<dyn crate::generate::TokenFilter>),
                events: tx,
            });
            total_prompt_tokens += prompt_tokens as u64;
            jobs.push(Job {
                index,
                prompt_tokens,
                text: text.clone(),
                // Stop strings wait for min_tokens, as the stop ids do.
                stream: TextStream::new(req.stop.clone()).with_min_tokens(req.min_tokens),
                rx,
                completion_tokens: 0,
                prompt_ids,
                pending_ids: Vec::new(),
                logprobs: req.logprobs.map(|_| LogprobsOut::default()),
                metrics: s.queue.metrics().clone(),
                queued,
                last_token: None,
                tools: req
                    .tools
                    .as_ref()
                    .filter(|t| t.reads_calls())
                    .map(|t| ToolStream::new(s.tool_format, t.parallel)),
                calls: Vec::new(),
            });
        }
    }
    // Every choice queued, or none (a 503 then leaves nothing behind).
    s.queue.submit_all(subs).map_err(|e| submit_error(&s, e))?;
    s.queue
        .metrics()
        .prompt_tokens
        .fetch_add(total_prompt_tokens, Ordering::Relaxed);
    let head = Head {
        chat,
        id: completion_id(chat),
        created: unix_now(),
        model: s.model_name.clone(),
        include_usage: req.include_usage,
    };
    if req.stream {
        return Ok(job::streamed(head, jobs, s.limits.sse_keep_alive));
    }
    job::whole(head, jobs, &s.limits.text_jobs).await
}

/// The token ids of each of `req`'s prompts (chat: the one rendered conversation).
fn prompt_ids(text: &ModelText, req: &GenRequest) -> Result<Vec<Vec<u32>>, ApiError> {
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    if let Some(msgs) = &req.messages {
        let tools = req.tools.as_ref().map(|t| t.definitions.as_slice());
        let rendered = text
            .render_chat_with(msgs, tools, &req.template_kwargs)
            .map_err(|e| ApiError::invalid("messages", client_message(&e)))?;
        if rendered.is_empty() {
            return Err(ApiError::invalid("messages", "the prompt is empty"));
        }
        prompts.push(text.encode(&rendered, false).map_err(server_error)?);
    }
    for p in &req.prompts {
        prompts.push(match p {
            Prompt::Text(t) if t.is_empty() => {
                return Err(ApiError::invalid("prompt", "the prompt is empty"))
            }
            Prompt::Text(t) => text.encode(t, true).map_err(server_error)?,
            Prompt::Ids(ids) => ids.clone(),
        });
    }
    Ok(prompts)
}

/// The grammar `req` is generated under (`response_format`, or the tool call that
/// `tool_choice` forces), compiled; a grammar llguidance refuses is a 400 naming the field.
fn compile_grammar(
    grammars: &Result<Grammars, String>,
    format: ToolFormat,
    req: &GenRequest,
) -> Result<Option<GrammarFilter>, ApiError> {
    let (spec, param): (GrammarSpec, &str) = match (&req.response_format, &req.tools) {
        (Some(spec), _) => (spec.clone(), "response_format"),
        (None, Some(t)) => match t.forcing_grammar(format) {
            Some(spec) => (spec, "tools"),
            None => return Ok(None),
        },
        (None, None) => return Ok(None),
    };
    let grammars = grammars.as_ref().map_err(|why| {
        ApiError::invalid(
            param,
            format!("'{param}' needs a grammar over the model's tokens, which this server could not build: {why}"),
        )
    })?;
    grammars.compile(&spec).map(Some).map_err(|e| {
        ApiError::invalid(
            param,
            format!("'{param}': the grammar does not compile: {e}"),
        )
    })
}

/// The 503 of a refused submission.
fn submit_error(s: &AppState, e: SubmitError) -> ApiError {
    match e {
        SubmitError::Full => ApiError::new(
            503,
            "server_error",
            Some("queue_full"),
            format!(
                "the server is busy: {} requests are already waiting (--max-queue); retry later",
                s.queue.capacity()
            ),
        ),
        SubmitError::ShuttingDown => ApiError::new(
            503,
            "server_error",
            Some("shutting_down"),
            "the server is shutting down",
        ),
    }
}

/// Checks one prompt's ids (not empty, inside the vocabulary, shorter than the longest
/// sequence) and returns its `max_tokens`.
fn check_prompt(
    s: &AppState,
    req: &GenRequest,
    ids: &[u32],
    param: &str,
    which: &str,
    chat: bool,
) -> Result<usize, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid(param, format!("{which} has no tokens")));
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
                "token {i} of {which} has id {id}, outside the model's vocabulary of {} ids (the tokenizer knows more tokens than the model)",
                s.vocab_size
            ),
        ));
    }
    if ids.len() >= s.max_seq_len {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                param,
                format!(
                "{which} has {} tokens; the longest sequence is {} tokens (prompt and completion)",
                ids.len(), s.max_seq_len),
            )
        });
    }
    let room = s.max_seq_len - ids.len();
    match req.max_tokens {
        None if chat => Ok(room),
        // At least min_tokens, which the client asked for explicitly.
        None => Ok(COMPLETIONS_DEFAULT_MAX_TOKENS.max(req.min_tokens).min(room)),
        Some(n) if n > room => Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid("max_tokens", format!(
                "max_tokens = {n} with {which} of {} tokens exceeds the longest sequence of {} tokens (at most {room})",
                ids.len(), s.max_seq_len))
        }),
        Some(n) => Ok(n),
    }
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
