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

use crate::serve::metrics::{escape, Rejections};

/// The embedding loop's counts at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopCounts {
    /// Requests being embedded (0 or 1).
    pub running: u64,
    /// Requests queued.
    pub waiting: u64,
    /// The inputs' tokens of the answered requests.
    pub prompt_tokens: u64,
    /// Requests answered with their embeddings.
    pub finished: u64,
    /// Requests dropped unrun, their client gone before their turn.
    pub cancelled: u64,
}

/// The page of a server of `model_name` with these counts and refusals.
///
/// ```
/// use candle_tp::serve::embeddings::metrics::{render, LoopCounts};
/// let counts = LoopCounts { finished: 2, prompt_tokens: 9, ..Default::default() };
/// let page = render("m", counts, &Default::default());
/// assert!(page.contains("candle_tp:request_success_total{model_name=\"m\"} 2"));
/// assert!(page.contains("candle_tp:prompt_tokens_total{model_name=\"m\"} 9"));
/// ```
pub fn render(model_name: &str, c: LoopCounts, rejected: &Rejections) -> String {
    let labels = format!("model_name=\"{}\"", escape(model_name));
    let mut out = String::new();
    for (kind, name, help, v) in [
        (
            "gauge",
            "num_requests_running",
            "Requests being embedded (0 or 1).",
            c.running,
        ),
        (
            "gauge",
            "num_requests_waiting",
            "Requests queued.",
            c.waiting,
        ),
        (
            "counter",
            "prompt_tokens_total",
            "Input tokens of the answered requests.",
            c.prompt_tokens,
        ),
        (
            "counter",
            "request_success_total",
            "Requests answered with their embeddings.",
            c.finished,
        ),
        (
            "counter",
            "requests_cancelled_total",
            "Requests dropped unrun, their client gone before their turn.",
            c.cancelled,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP candle_tp:{name} {help}\n# TYPE candle_tp:{name} {kind}\ncandle_tp:{name}{{{labels}}} {v}"
        );
    }
    rejected.render(&mut out, &labels);
    out
}
