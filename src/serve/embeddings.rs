//! `POST /v1/embeddings`, served by the tensor-parallel BERT encoder
//! ([`BertModel::embed`]: mean pooling, L2-normalised when the checkpoint's `modules.json` has
//! sentence-transformers' `Normalize`), when `--model` is a sentence-embedding checkpoint.
//!
//! Rank 0's HTTP side tokenizes the inputs (off the async threads) and queues them; its main
//! thread takes one request at a time, broadcasts the token ids to every rank through the
//! process group (a tag, the count, the lengths, the ids), and every rank runs the same
//! [`BertModel::embed`] calls (batches of at most [`EMBED_BATCH`] inputs); rank 0 answers.
//! With nothing to do it broadcasts an idle tag every heartbeat, so that the other ranks'
//! wait stays below the collectives' deadline. A request whose client has gone by the time
//! its turn comes is dropped unrun (`cancelled` in `/health`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use candle_core::{DType, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::models::bert::BertModel;
use crate::serve::endpoints::key_refusal;
use crate::serve::error::ApiError;
use crate::serve::limits::{read_body, RequestLimits};
use crate::serve::metrics::Rejections;
use crate::serve::reply::{json_response, json_text_response, method_not_allowed};
use crate::serve::stamp::unix_now;
use crate::ProcessGroup;

pub mod metrics;
mod request;

use request::{parse, tokenize, Encoder};
pub use request::{EMBEDDING_FIELDS, MAX_INPUTS};

/// Inputs per [`BertModel::embed`] call at most (a batch is padded to its longest input).
pub const EMBED_BATCH: usize = 32;

/// Answers with more numbers than this are built on a blocking thread.
const LARGE_ANSWER_FLOATS: usize = 1 << 16;

const TAG_IDLE: u32 = 0;
const TAG_WORK: u32 = 1;
const TAG_SHUTDOWN: u32 = 2;

/// One request's inputs for rank 0's loop, and where its embeddings go.
#[derive(Debug)]
pub struct EmbedJob {
    /// Token ids of each input.
    pub inputs: Vec<Vec<u32>>,
    /// The embeddings `[inputs, hidden]`, or why there are none.
    pub reply: tokio::sync::oneshot::Sender<std::result::Result<Vec<Vec<f32>>, String>>,
}

/// What rank 0's loop receives.
#[derive(Debug)]
pub enum EmbedMsg {
    /// A request.
    Job(EmbedJob),
    /// The server is going down.
    Shutdown,
}

/// The HTTP side's end of rank 0's queue (bounded: a full queue is a 503).
#[derive(Debug, Clone)]
pub struct EmbedQueue {
    tx: SyncSender<EmbedMsg>,
    shutting_down: Arc<AtomicBool>,
    capacity: usize,
    counts: Arc<EmbedCounts>,
}

/// What `/health` and `/metrics` report of the embedding loop.
#[derive(Debug, Default)]
struct EmbedCounts {
    /// Requests queued, not yet taken by the loop.
    waiting: AtomicUsize,
    /// Requests being embedded (0 or 1).
    active: AtomicUsize,
    /// Requests dropped unrun because their client had gone.
    cancelled: AtomicU64,
    /// Requests answered with their embeddings.
    finished: AtomicU64,
    /// The inputs' tokens of the answered requests.
    prompt_tokens: AtomicU64,
}

/// A queue of at most `capacity` waiting requests, and the receiver [`run_embed_leader`] takes.
pub fn embed_queue(capacity: usize) -> (EmbedQueue, Receiver<EmbedMsg>) {
    let (tx, rx) = sync_channel(capacity.max(1));
    let q = EmbedQueue {
        tx,
        shutting_down: Arc::new(AtomicBool::new(false)),
        capacity: capacity.max(1),
        counts: Arc::default(),
    };
    (q, rx)
}

impl EmbedQueue {
    /// Starts the shutdown: no new request is taken, the loop broadcasts the end.
    pub fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let _ = self.tx.try_send(EmbedMsg::Shutdown);
    }

    /// Whether the server is going down.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Requests queued, not yet taken by the loop.
    pub fn waiting(&self) -> usize {
        self.counts.waiting.load(Ordering::SeqCst)
    }

    /// Requests being embedded now (0 or 1).
    pub fn active(&self) -> usize {
        self.counts.active.load(Ordering::SeqCst)
    }

    /// Requests dropped unrun since the start, their client gone before their turn.
    pub fn cancelled(&self) -> u64 {
        self.counts.cancelled.load(Ordering::SeqCst)
    }

    fn submit(&self, job: EmbedJob) -> std::result::Result<(), ApiError> {
        if self.is_shutting_down() {
            return Err(unavailable("the server is shutting down"));
        }
        self.counts.waiting.fetch_add(1, Ordering::SeqCst);
        self.tx.try_send(EmbedMsg::Job(job)).map_err(|e| {
            self.counts.waiting.fetch_sub(1, Ordering::SeqCst);
            match e {
            TrySendError::Full(_) => ApiError::new(
                503,
                "server_error",
                Some("queue_full"),
                format!(
                    "the server is busy: {} requests are already waiting (--max-queue); retry later",
                    self.capacity
                ),
            ),
            TrySendError::Disconnected(_) => unavailable("the server is shutting down"),
            }
        })
    }
}

fn unavailable(msg: &str) -> ApiError {
    ApiError::new(503, "server_error", Some("unavailable"), msg)
}

/// Sends rank 0's `tag` and `inputs` to every rank (others pass `None` and get them).
fn share(pg: &ProcessGroup, send: Option<(u32, &[Vec<u32>])>) -> Result<(u32, Vec<Vec<u32>>)> {
    let mut head = match send {
        Some((tag, inputs)) => [tag, inputs.len() as u32],
        None => [0, 0],
    };
    pg.broadcast_slice(&mut head, 0)?;
    let [tag, n] = head;
    if n == 0 {
        return Ok((tag, Vec::new()));
    }
    let mut lens: Vec<u32> = match send {
        Some((_, inputs)) => inputs.iter().map(|s| s.len() as u32).collect(),
        None => vec![0; n as usize],
    };
    pg.broadcast_slice(&mut lens, 0)?;
    let total = lens.iter().map(|&l| l as usize).sum();
    let mut flat: Vec<u32> = match send {
        Some((_, inputs)) => inputs.concat(),
        None => vec![0; total],
    };
    pg.broadcast_slice(&mut flat, 0)?;
    let mut out = Vec::with_capacity(lens.len());
    let mut at = 0;
    for l in lens {
        out.push(flat[at..at + l as usize].to_vec());
        at += l as usize;
    }
    Ok((tag, out))
}

/// The embeddings of `inputs` (every rank, the same calls): [`BertModel::embed`] over batches of
/// at most [`EMBED_BATCH`] inputs, as f32.
pub fn embed_inputs(
    model: &BertModel,
    inputs: &[Vec<u32>],
    normalize: bool,
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(inputs.len());
    for batch in inputs.chunks(EMBED_BATCH) {
        out.extend(
            model
                .embed(batch, normalize)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?,
        );
    }
    Ok(out)
}

/// Rank 0's loop: one request at a time, broadcast to every rank, embedded, answered; an idle
/// broadcast every `heartbeat`; returns after broadcasting the shutdown. A request whose
/// client has gone (its answer's receiver dropped) is skipped, not run. A failed step (a dead
/// rank) fails the request and every waiting one and returns the error.
pub fn run_embed_leader(
    model: &BertModel,
    normalize: bool,
    rx: Receiver<EmbedMsg>,
    queue: &EmbedQueue,
    heartbeat: Duration,
) -> Result<()> {
    let pg = model.pg().clone();
    loop {
        let msg = match rx.recv_timeout(heartbeat) {
            _ if queue.is_shutting_down() => EmbedMsg::Shutdown,
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                share(&pg, Some((TAG_IDLE, &[])))?;
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => EmbedMsg::Shutdown,
        };
        match msg {
            EmbedMsg::Shutdown => {
                queue.shutting_down.store(true, Ordering::SeqCst);
                let result = share(&pg, Some((TAG_SHUTDOWN, &[])));
                fail_waiting(&rx, queue, "the server is shutting down");
                return result.map(|_| ());
            }
            EmbedMsg::Job(job) => {
                let counts = &queue.counts;
                counts.waiting.fetch_sub(1, Ordering::SeqCst);
                if job.reply.is_closed() {
                    // The client left while the request waited: nobody takes the answer.
                    counts.cancelled.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                counts.active.store(1, Ordering::SeqCst);
                let result = share(&pg, Some((TAG_WORK, &job.inputs)))
                    .and_then(|_| embed_inputs(model, &job.inputs, normalize));
                counts.active.store(0, Ordering::SeqCst);
                match result {
                    Ok(v) => {
                        let tokens: usize = job.inputs.iter().map(Vec::len).sum();
                        counts
                            .prompt_tokens
                            .fetch_add(tokens as u64, Ordering::SeqCst);
                        counts.finished.fetch_add(1, Ordering::SeqCst);
                        let _ = job.reply.send(Ok(v));
                    }
                    Err(e) => {
                        queue.shutting_down.store(true, Ordering::SeqCst);
                        let why = format!(
                            "the model step failed: {}",
                            crate::serve::error::client_message(&e)
                        );
                        let _ = job.reply.send(Err(why.clone()));
                        fail_waiting(&rx, queue, &why);
                        return Err(e);
                    }
                }
            }
        }
    }
}

fn fail_waiting(rx: &Receiver<EmbedMsg>, queue: &EmbedQueue, why: &str) {
    while let Ok(m) = rx.try_recv() {
        if let EmbedMsg::Job(job) = m {
            queue.counts.waiting.fetch_sub(1, Ordering::SeqCst);
            let _ = job.reply.send(Err(why.to_string()));
        }
    }
}

/// The loop of every rank but 0: rank 0's inputs, embedded, until its shutdown.
pub fn run_embed_follower(model: &BertModel, normalize: bool) -> Result<()> {
    let pg = model.pg().clone();
    loop {
        let (tag, inputs) = share(&pg, None)?;
        match tag {
            TAG_SHUTDOWN => return Ok(()),
            TAG_WORK => {
                embed_inputs(model, &inputs, normalize)?;
            }
            _ => {}
        }
    }
}

/// What the embeddings handlers share.
#[derive(Debug, Clone)]
pub struct EmbedState {
    /// The served model's name.
    pub model_name: String,
    /// The checkpoint's tokenizer (no padding, no truncation).
    pub tokenizer: Arc<Tokenizer>,
    /// Tokens per input at most (sentence-transformers' `max_seq_length`, capped by the
    /// position table); a longer input is a 400.
    pub max_tokens: usize,
    /// The model's vocabulary size (token-id inputs must be below it).
    pub vocab_size: usize,
    /// The embedding width.
    pub hidden_size: usize,
    /// Rank 0's queue.
    pub queue: EmbedQueue,
    /// The key clients must send as `Authorization: Bearer KEY` (`None`: no check).
    pub api_key: Option<String>,
    /// The largest request body read, in bytes.
    pub max_body_bytes: usize,
    /// The body deadline and the text work off the async thread.
    pub limits: RequestLimits,
    /// The refusals of the server's limits and queue, which `/metrics` shows: the same
    /// counters as the listener's and the limits' middleware (`limits::serve`).
    pub rejected: Arc<Rejections>,
}

/// The router of an embedding server: `POST /v1/embeddings`, `GET /v1/models[/{id}]`,
/// `GET /health`, `GET /metrics` (Prometheus, [`metrics::render`]); the completions endpoints
/// answer 400 (no text generation). As the text server's router: ids may hold slashes
/// (`org/name`), the key guards the routes only (a path the server does not have is a 404,
/// key or not; `/health` and `/metrics` stay open), and a wrong method is a 405.
pub fn router(state: EmbedState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_page))
        .route("/v1/models", get(models))
        // A catch-all: Hugging Face ids hold slashes (`org/name`).
        .route("/v1/models/{*id}", get(model))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/completions", post(not_generative))
        .route("/v1/chat/completions", post(not_generative))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn require_key(State(s): State<EmbedState>, req: Request, next: Next) -> Response {
    match key_refusal(s.api_key.as_deref(), &req) {
        Some(refused) => refused,
        None => next.run(req).await,
    }
}

async fn not_found() -> ApiError {
    ApiError::new(404, "invalid_request_error", Some("not_found"), "no such endpoint: this embedding server has POST /v1/embeddings, GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics")
}

async fn not_generative(State(s): State<EmbedState>) -> ApiError {
    ApiError::new(
        400,
        "invalid_request_error",
        Some("model_not_supported"),
        format!(
            "'{}' is a sentence-embedding model: this server answers POST /v1/embeddings, not text generation",
            s.model_name
        ),
    )
}

/// For a server of a generative model: `POST /v1/embeddings` is a 400 saying why.
pub(crate) async fn no_embeddings() -> ApiError {
    ApiError::new(
        400,
        "invalid_request_error",
        Some("model_not_supported"),
        "this server serves a text-generation model; /v1/embeddings needs a sentence-embedding checkpoint as --model (e.g. all-minilm-l6-v2)",
    )
}

/// `GET /metrics` ([`metrics::render`]).
async fn metrics_page(State(s): State<EmbedState>) -> Response {
    let (q, load) = (&s.queue, |a: &AtomicU64| a.load(Ordering::SeqCst));
    let counts = metrics::LoopCounts {
        running: q.active() as u64,
        waiting: q.waiting() as u64,
        prompt_tokens: load(&q.counts.prompt_tokens),
        finished: load(&q.counts.finished),
        cancelled: q.cancelled(),
    };
    (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(&s.model_name, counts, &s.rejected),
    )
        .into_response()
}

async fn health(State(s): State<EmbedState>) -> Response {
    if s.queue.is_shutting_down() {
        return unavailable("the server is shutting down").into_response();
    }
    let q = &s.queue;
    json_response(
        StatusCode::OK,
        &json!({"status": "ok", "active": q.active(), "waiting": q.waiting(), "cancelled": q.cancelled()}),
    )
}

fn card(s: &EmbedState) -> Value {
    json!({"id": s.model_name, "object": "model", "created": unix_now(), "owned_by": "candle-tp",
           "max_model_len": s.max_tokens})
}

async fn models(State(s): State<EmbedState>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [card(&s)]}),
    )
}

async fn model(State(s): State<EmbedState>, Path(id): Path<String>) -> Response {
    if id != s.model_name {
        return model_not_found(&s, &id).into_response();
    }
    json_response(StatusCode::OK, &card(&s))
}

fn model_not_found(s: &EmbedState, m: &str) -> ApiError {
    ApiError {
        code: Some("model_not_found"),
        param: Some("model".into()),
        ..ApiError::new(
            404,
            "invalid_request_error",
            None,
            format!(
                "the model '{m}' does not exist: this server serves '{}'",
                s.model_name
            ),
        )
    }
}

/// Standard base64 (RFC 4648, with padding) of `bytes`.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `POST /v1/embeddings`.
async fn embeddings(State(s): State<EmbedState>, headers: HeaderMap, body: Body) -> Response {
    answer(s, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn answer(
    s: EmbedState,
    headers: HeaderMap,
    body: Body,
) -> std::result::Result<Response, ApiError> {
    let body = read_body(s.max_body_bytes, s.limits.body_timeout, &headers, body).await?;
    let req = parse(&body, s.hidden_size)?;
    if let Some(m) = &req.model {
        if m != &s.model_name {
            return Err(model_not_found(&s, m));
        }
    }
    let ids = {
        let s = s.clone();
        let inputs = req.inputs.clone();
        let jobs = s.limits.text_jobs.clone();
        jobs.run(move || {
            let encoder = Encoder {
                tokenizer: &s.tokenizer,
                max_tokens: s.max_tokens,
                vocab_size: s.vocab_size,
            };
            tokenize(&encoder, &inputs)
        })
        .await??
    };
    let tokens: usize = ids.iter().map(Vec::len).sum();
    let (tx, rx) = tokio::sync::oneshot::channel();
    s.queue.submit(EmbedJob {
        inputs: ids,
        reply: tx,
    })?;
    let vectors = match rx.await {
        Ok(Ok(v)) => v,
        Ok(Err(why)) => return Err(unavailable(&why)),
        Err(_) => return Err(unavailable("the server is shutting down")),
    };
    let large = vectors.iter().map(Vec::len).sum::<usize>() > LARGE_ANSWER_FLOATS;
    let model = s.model_name.clone();
    let build = move || {
        let data: Vec<Value> = vectors
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let embedding = if req.base64 {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64(&bytes))
                } else {
                    json!(v)
                };
                json!({"object": "embedding", "index": i, "embedding": embedding})
            })
            .collect();
        json!({"object": "list", "data": data, "model": model,
               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        .to_string()
    };
    // Thousands of vectors make megabytes of JSON: built off the async thread.
    let json = if large {
        s.limits.text_jobs.run_waiting(build).await?
    } else {
        build()
    };
    Ok(json_text_response(StatusCode::OK, json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_rfc_4648() {
        // RFC 4648's test vectors.
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain:?}");
        }
        assert_eq!(base64(&1.0f32.to_le_bytes()), "AACAPw==");
    }
}
