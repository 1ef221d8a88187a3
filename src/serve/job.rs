//! One answer of the completions endpoints: the [`Job`] of each choice (a sequence in the
//! scheduler: its tokens, text, log-probabilities and timings) and the answer they make
//! together, whole (every choice awaited) or streamed as server-sent events (the choices'
//! chunks interleaved as their tokens come, each chunk naming its choice's `index`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::generate::FinishReason;
use crate::serve::error::{client_message, ApiError};
use crate::serve::limits::TextJobs;
use crate::serve::logprobs::LogprobsOut;
use crate::serve::metrics::Metrics;
use crate::serve::reply::json_text_response;
use crate::serve::scheduler::Event;
use crate::serve::stamp::unique_id;
use crate::serve::tool_calls::{ToolCall, ToolStream};
use crate::text::{ModelText, TextStream};

/// What every chunk and answer of one request carries.
#[derive(Debug, Clone)]
pub struct Head {
    /// Chat (`chat.completion`) or text completion.
    pub chat: bool,
    /// The answer's id (`chatcmpl-...`, `cmpl-...`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

impl Head {
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

/// One choice: a sequence queued in the scheduler, and what its answer needs besides the tokens.
pub struct Job {
    /// The choice's `index` in the answer.
    pub index: usize,
    /// Its prompt's tokens, counted in `usage` (0 for the second and later choices of one
    /// prompt: a prompt is counted once, as OpenAI's `n`).
    pub prompt_tokens: usize,
    /// Tokenizer (the text pieces, the log-probabilities' tokens).
    pub text: Arc<ModelText>,
    /// The text so far, with the stop strings.
    pub stream: TextStream,
    /// The scheduler's events for this sequence.
    pub rx: UnboundedReceiver<Event>,
    /// Tokens generated so far.
    pub completion_tokens: usize,
    /// The prompt's ids when the request asked for `return_token_ids`.
    pub prompt_ids: Option<Vec<u32>>,
    /// Generated ids not yet sent (kept only for `return_token_ids`).
    pub pending_ids: Vec<u32>,
    /// Log-probabilities not yet sent (when the request asked for them).
    pub logprobs: Option<LogprobsOut>,
    /// Where the timings and token counts go.
    pub metrics: Arc<Metrics>,
    /// When the request was queued.
    pub queued: Instant,
    /// When its last token came.
    pub last_token: Option<Instant>,
    /// Reads the tool calls out of the text (chat with tools, `tool_choice` not `none`).
    pub tools: Option<ToolStream>,
    /// The calls read at the end, with their ids.
    pub calls: Vec<(String, ToolCall)>,
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

/// A 500 from a library error.
pub fn server_error(e: candle_core::Error) -> ApiError {
    ApiError::new(500, "server_error", None, client_message(&e))
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

impl Job {
    /// Waits for the next piece of content: `Ok((text, Some(finish)))` at the end, where the
    /// tool calls (if any) are in `calls` and the finish reason is `tool_calls`.
    async fn next(&mut self) -> Result<(String, Option<&'static str>), ApiError> {
        let (mut piece, finish) = self.next_text().await?;
        let Some(tools) = self.tools.as_mut() else {
            return Ok((piece, finish));
        };
        piece = tools.push(&piece);
        let Some(mut finish) = finish else {
            return Ok((piece, None));
        };
        let (rest, calls) = tools.finish();
        piece.push_str(&rest);
        if !calls.is_empty() {
            finish = "tool_calls";
        }
        self.calls = calls.into_iter().map(|c| (unique_id("call"), c)).collect();
        Ok((piece, Some(finish)))
    }

    /// Waits for the next piece of text: `Ok((text, Some(finish)))` at the end.
    async fn next_text(&mut self) -> Result<(String, Option<&'static str>), ApiError> {
        match self.rx.recv().await {
            Some(Event::Token {
                token,
                finish,
                logprobs,
            }) => {
                self.completion_tokens += 1;
                self.observe_token(finish.map(finish_name));
                if self.prompt_ids.is_some() {
                    self.pending_ids.push(token);
                }
                if let (Some(out), Some(lp)) = (self.logprobs.as_mut(), logprobs.as_ref()) {
                    out.push(&self.text, lp).map_err(server_error)?;
                }
                let mut piece = self.stream.push(&self.text, token).map_err(server_error)?;
                if self.stream.stopped() {
                    self.rx.close(); // the scheduler drops the sequence
                    if finish.is_none() {
                        self.observe_end("stop");
                    }
                    return Ok((piece, Some("stop")));
                }
                if let Some(f) = finish {
                    piece.push_str(&self.stream.finish(&self.text).map_err(server_error)?);
                    // The text held back completed a stop string.
                    let reason = if self.stream.stopped() {
                        "stop"
                    } else {
                        finish_name(f)
                    };
                    return Ok((piece, Some(reason)));
                }
                Ok((piece, None))
            }
            Some(Event::Error(e)) => Err(event_error(e)),
            None => Err(event_error("the server is shutting down".into())),
        }
    }

    /// A token's timings (and the request's end when `finish` is set).
    fn observe_token(&mut self, finish: Option<&str>) {
        let now = Instant::now();
        let m = &self.metrics;
        m.generation_tokens.fetch_add(1, Ordering::Relaxed);
        match self.last_token {
            None => m.ttft.observe((now - self.queued).as_secs_f64()),
            Some(t) => m.tpot.observe((now - t).as_secs_f64()),
        }
        self.last_token = Some(now);
        if let Some(f) = finish {
            self.observe_end(f);
        }
    }

    fn observe_end(&self, reason: &str) {
        self.metrics.finished(reason);
        self.metrics
            .e2e
            .observe(self.queued.elapsed().as_secs_f64());
    }

    /// A choice; with `return_token_ids` it also takes the ids generated since the last one,
    /// with `logprobs` the log-probabilities.
    fn choice(&mut self, chat: bool, text: &str, finish: Option<&str>, delta: bool) -> Value {
        let i = self.index;
        let mut c = match (chat, delta) {
            (true, true) => {
                json!({"index": i, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
            }
            (true, false) if !self.calls.is_empty() => {
                let calls: Vec<Value> = self
                    .calls
                    .iter()
                    .map(|(id, c)| c.to_json(id, None))
                    .collect();
                let content = if text.is_empty() {
                    Value::Null
                } else {
                    json!(text)
                };
                json!({"index": i, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                       "logprobs": null, "finish_reason": finish})
            }
            (true, false) => {
                json!({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
            }
            (false, _) => {
                json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        if let Some(out) = self.logprobs.as_mut() {
            c["logprobs"] = out.take(chat);
        }
        if let Some(prompt) = &self.prompt_ids {
            c["token_ids"] = json!(std::mem::take(&mut self.pending_ids));
            if !delta {
                c["prompt_token_ids"] = json!(prompt);
            }
        }
        c
    }

    /// Every piece until the end: the whole text and the finish reason.
    async fn run(&mut self) -> Result<(String, &'static str), ApiError> {
        let mut out = String::new();
        loop {
            let (piece, finish) = self.next().await?;
            out.push_str(&piece);
            if let Some(f) = finish {
                return Ok((out, f));
            }
        }
    }
}

/// Answers with more generated tokens than this (all choices together), or with
/// log-probabilities, are built on a blocking thread ([`whole`]).
pub const BUILD_OFF_THE_WORKER_TOKENS: usize = 1024;

/// The whole answer: every choice awaited, in `index` order, `usage` over all of them. A large
/// answer (log-probabilities: up to 21 entries per token, each with its bytes; or more than
/// [`BUILD_OFF_THE_WORKER_TOKENS`] tokens) is built and serialised by `text_jobs` on a
/// blocking thread, so that the async thread keeps serving the other connections meanwhile.
pub async fn whole(
    head: Head,
    mut jobs: Vec<Job>,
    text_jobs: &TextJobs,
) -> Result<Response, ApiError> {
    let ends =
        futures_util::future::try_join_all(jobs.iter_mut().map(|j| async move { j.run().await }))
            .await?;
    let large = jobs.iter().any(|j| j.logprobs.is_some())
        || jobs.iter().map(|j| j.completion_tokens).sum::<usize>() > BUILD_OFF_THE_WORKER_TOKENS;
    let build = move || {
        let mut choices = Vec::with_capacity(jobs.len());
        for (j, (text, finish)) in jobs.iter_mut().zip(ends) {
            choices.push(j.choice(head.chat, &text, Some(finish), false));
        }
        let mut v = head.envelope(json!(choices), false);
        v["usage"] = usage(
            jobs.iter().map(|j| j.prompt_tokens).sum(),
            jobs.iter().map(|j| j.completion_tokens).sum(),
        );
        v.to_string()
    };
    let json = if large {
        text_jobs.run_waiting(build).await?
    } else {
        build()
    };
    Ok(json_text_response(StatusCode::OK, json))
}

/// What one choice's stream yields.
enum Out {
    /// A chunk's JSON.
    Data(String),
    /// The choice ended: its prompt and completion tokens.
    Done(usize, usize),
    /// The choice failed: the answer ends with this error.
    Fail(ApiError),
}

/// One choice's chunks. With `usage_in_last` (one choice, no `include_usage`) the last chunk
/// carries the usage too.
fn choice_stream(head: Head, job: Job, usage_in_last: bool) -> BoxStream<'static, Out> {
    stream::unfold(Some(job), move |job| {
        let head = head.clone();
        async move {
            let mut job = job?;
            loop {
                match job.next().await {
                    Ok((piece, None)) if piece.is_empty() => continue,
                    Ok((piece, None)) => {
                        let c = job.choice(head.chat, &piece, None, true);
                        let data = head.envelope(json!([c]), true).to_string();
                        return Some((vec![Out::Data(data)], Some(job)));
                    }
                    Ok((piece, Some(f))) => {
                        let mut out = Vec::new();
                        if !job.calls.is_empty() {
                            // The content before the calls, then the calls, then the end.
                            if !piece.is_empty() {
                                let c = job.choice(head.chat, &piece, None, true);
                                out.push(Out::Data(head.envelope(json!([c]), true).to_string()));
                            }
                            let calls: Vec<Value> = (job.calls.iter().enumerate())
                                .map(|(k, (id, c))| c.to_json(id, Some(k)))
                                .collect();
                            let c = json!({"index": job.index, "delta": {"tool_calls": calls},
                                           "logprobs": null, "finish_reason": null});
                            out.push(Out::Data(head.envelope(json!([c]), true).to_string()));
                        }
                        let piece = if job.calls.is_empty() {
                            piece
                        } else {
                            String::new()
                        };
                        let c = job.choice(head.chat, &piece, Some(f), true);
                        let mut last = head.envelope(json!([c]), true);
                        if usage_in_last {
                            last["usage"] = usage(job.prompt_tokens, job.completion_tokens);
                        }
                        out.push(Out::Data(last.to_string()));
                        out.push(Out::Done(job.prompt_tokens, job.completion_tokens));
                        return Some((out, None));
                    }
                    Err(e) => return Some((vec![Out::Fail(e)], None)),
                }
            }
        }
    })
    .flat_map(stream::iter)
    .boxed()
}

/// The streamed answer: the choices' chunks as they come, then (with `include_usage`) a chunk
/// of the total usage, then `[DONE]`; a failed choice ends the answer with its error. With
/// `keep_alive`, a comment line (`: keep-alive`) goes out whenever nothing else has for that
/// long (a request queued behind others, a long prompt being read), as SSE clients ignore.
pub fn streamed(head: Head, jobs: Vec<Job>, keep_alive: Option<Duration>) -> Response {
    let mut first = VecDeque::new();
    if head.chat {
        for j in &jobs {
            let c = json!({"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            first.push_back(head.envelope(json!([c]), true).to_string());
        }
    }
    let usage_in_last = jobs.len() == 1 && !head.include_usage;
    let all = stream::select_all(
        jobs.into_iter()
            .map(|j| choice_stream(head.clone(), j, usage_in_last)),
    );
    struct State {
        head: Head,
        first: VecDeque<String>,
        all: stream::SelectAll<BoxStream<'static, Out>>,
        tokens: (usize, usize),
        done: bool,
    }
    let state = State {
        head,
        first,
        all,
        tokens: (0, 0),
        done: false,
    };
    let events = stream::unfold(state, |mut st| async move {
        if let Some(d) = st.first.pop_front() {
            return Some((vec![d], st));
        }
        if st.done {
            return None;
        }
        loop {
            match st.all.next().await {
                Some(Out::Data(d)) => return Some((vec![d], st)),
                Some(Out::Done(p, c)) => {
                    st.tokens.0 += p;
                    st.tokens.1 += c;
                }
                Some(Out::Fail(e)) => {
                    st.done = true;
                    return Some((vec![e.body().to_string(), "[DONE]".into()], st));
                }
                None => {
                    st.done = true;
                    let mut out = Vec::new();
                    if st.head.include_usage {
                        let mut u = st.head.envelope(json!([]), true);
                        u["usage"] = usage(st.tokens.0, st.tokens.1);
                        out.push(u.to_string());
                    }
                    out.push("[DONE]".into());
                    return Some((out, st));
                }
            }
        }
    })
    .flat_map(|v| {
        stream::iter(
            v.into_iter()
                .map(|d| Ok::<_, Infallible>(SseEvent::default().data(d))),
        )
    });
    let sse = Sse::new(events);
    match keep_alive {
        Some(every) => sse
            .keep_alive(KeepAlive::new().interval(every).text("keep-alive"))
            .into_response(),
        None => sse.into_response(),
    }
}
