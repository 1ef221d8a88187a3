//! The embedding server's `GET /metrics`, in Prometheus' text format and under the text
//! server's names ([`crate::serve::metrics`]) where they mean the same:
//!
//! | metric | type | |
//! |---|---|---|
//! | `candle_tp:num_requests_running` | gauge | requests being embedded (0 or 1) |
//! | `candle_tp:num_requests_waiting` | gauge | requests queued |
//! | `candle_tp:prompt_tokens_total` | counter | the inputs' tokens of answered requests |
//! | `candle_tp:request_success_total` | counter | requests answered with their embeddings |
//! | `candle_tp:requests_cancelled_total` | counter | requests dropped unrun, their client gone |
//! | `candle_tp:requests_rejected_total{reason}` | counter | requests refused by a limit or the queue |
//! | `candle_tp:connections_closed_total{reason}` | counter | connections closed by `--header-timeout` or `--send-timeout` |
//!
//! Every sample carries `model_name`.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::EmbedState;
use crate::serve::metrics::escape;

/// The metrics of the server whose state is `s`.
pub fn render(s: &EmbedState) -> String {
    let labels = format!("model_name=\"{}\"", escape(&s.model_name));
    let counts = &s.queue.counts;
    let mut out = String::new();
    for (name, help, v) in [
        (
            "num_requests_running",
            "Requests being embedded (0 or 1).",
            s.queue.active() as u64,
        ),
        (
            "num_requests_waiting",
            "Requests queued.",
            s.queue.waiting() as u64,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP candle_tp:{name} {help}\n# TYPE candle_tp:{name} gauge\ncandle_tp:{name}{{{labels}}} {v}"
        );
    }
    for (name, help, v) in [
        (
            "prompt_tokens_total",
            "Input tokens of the answered requests.",
            counts.prompt_tokens.load(Ordering::SeqCst),
        ),
        (
            "request_success_total",
            "Requests answered with their embeddings.",
            counts.finished.load(Ordering::SeqCst),
        ),
        (
            "requests_cancelled_total",
            "Requests dropped unrun, their client gone before their turn.",
            s.queue.cancelled(),
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP candle_tp:{name} {help}\n# TYPE candle_tp:{name} counter\ncandle_tp:{name}{{{labels}}} {v}"
        );
    }
    s.rejected.render(&mut out, &labels);
    out
}

/// `GET /metrics`.
pub(super) async fn serve(State(s): State<EmbedState>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(&s),
    )
        .into_response()
}
