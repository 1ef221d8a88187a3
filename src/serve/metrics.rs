//! The server's metrics in Prometheus' text format (`GET /metrics`), named after vLLM's
//! (`vllm:num_requests_running` is `candle_tp:num_requests_running` here) so that dashboards
//! written for vLLM need only the prefix changed:
//!
//! | metric | type | |
//! |---|---|---|
//! | `candle_tp:num_requests_running` | gauge | sequences in the batch |
//! | `candle_tp:num_requests_waiting` | gauge | requests queued for a slot |
//! | `candle_tp:kv_cache_usage_perc` | gauge | KV cache positions in use over `max_batch × max_seq_len` (0 to 1) |
//! | `candle_tp:prompt_tokens_total` | counter | prompt tokens of accepted requests |
//! | `candle_tp:generation_tokens_total` | counter | tokens generated |
//! | `candle_tp:request_success_total{finished_reason}` | counter | requests finished (`stop`, `length`) |
//! | `candle_tp:time_to_first_token_seconds` | histogram | from queueing to the first token |
//! | `candle_tp:time_per_output_token_seconds` | histogram | between a request's tokens |
//! | `candle_tp:e2e_request_latency_seconds` | histogram | from queueing to the last token |
//! | `candle_tp:comm_payload_bytes_total` | counter | rank 0's collective and point-to-point payload for the model ([`CausalLm::comm_stats`](crate::models::CausalLm::comm_stats)) |
//! | `candle_tp:comm_cross_host_bytes_total` | counter | of it, what rank 0 handed to the network (0 on one host) |
//! | `candle_tp:requests_rejected_total{reason}` | counter | requests refused by a limit of [`limits`](super::limits) or the queue ([`Limit`]) |
//! | `candle_tp:connections_closed_total{reason}` | counter | connections closed by `--header-timeout` or `--send-timeout` |
//!
//! Every sample carries `model_name`. The buckets are vLLM's.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bound (not cumulative), then the overflow; the sum of the observations.
    state: Mutex<(Vec<u64>, f64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            state: Mutex::new((vec![0; bounds.len() + 1], 0.0)),
        }
    }

    /// Records one observation (seconds).
    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0[i] += 1;
        s.1 += v;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let (counts, sum) = self.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&counts) {
            acc += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {acc}");
        }
        acc += counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {acc}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum:?}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {acc}");
    }
}

/// A limit that refuses a request or closes a connection, counted in [`Rejections`]: the
/// `reason` label, which is also the `code` of the error a refused request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// A connection past `--max-connections`, answered 503.
    TooManyConnections,
    /// A body larger than `--max-body-bytes` (400).
    RequestTooLarge,
    /// A body that did not arrive within `--body-timeout` (408).
    RequestTimeout,
    /// No tokenizing job free within `--tokenize-wait` (503).
    TokenizerBusy,
    /// `--max-queue` requests already waiting (503).
    QueueFull,
    /// A connection closed because no complete request headers came within
    /// `--header-timeout` (a slow client, or an idle keep-alive connection).
    HeaderTimeout,
    /// A connection closed because its client read nothing of its answer for
    /// `--send-timeout`.
    SendTimeout,
}

impl Limit {
    /// Every limit, in the order they are rendered.
    pub const ALL: [Limit; 7] = [
        Limit::TooManyConnections,
        Limit::RequestTooLarge,
        Limit::RequestTimeout,
        Limit::TokenizerBusy,
        Limit::QueueFull,
        Limit::HeaderTimeout,
        Limit::SendTimeout,
    ];

    /// The `reason` label (for a refused request, its error's `code`).
    pub fn reason(self) -> &'static str {
        match self {
            Limit::TooManyConnections => "too_many_connections",
            Limit::RequestTooLarge => "request_too_large",
            Limit::RequestTimeout => "request_timeout",
            Limit::TokenizerBusy => "tokenizer_busy",
            Limit::QueueFull => "queue_full",
            Limit::HeaderTimeout => "header_timeout",
            Limit::SendTimeout => "send_timeout",
        }
    }

    /// The limit whose refusals carry the error code `code`, if one does.
    pub fn of_code(code: &str) -> Option<Limit> {
        Limit::ALL
            .into_iter()
            .find(|l| !l.closes_connection() && l.reason() == code)
    }

    /// Whether the limit closes a connection (rather than answering a request).
    pub fn closes_connection(self) -> bool {
        matches!(self, Limit::HeaderTimeout | Limit::SendTimeout)
    }
}

/// How often each [`Limit`] acted: shared by the listener, the connections and the routes'
/// middleware (`limits::serve`), and rendered with the other metrics.
///
/// ```
/// use candle_tp::serve::metrics::{Limit, Rejections};
/// let r = Rejections::default();
/// r.count(Limit::QueueFull);
/// assert_eq!(r.get(Limit::QueueFull), 1);
/// assert_eq!(r.get(Limit::TokenizerBusy), 0);
/// ```
#[derive(Debug, Default)]
pub struct Rejections {
    counts: [AtomicU64; Limit::ALL.len()],
}

impl Rejections {
    /// Counts one action of `limit`.
    pub fn count(&self, limit: Limit) {
        self.counts[limit as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// How often `limit` acted.
    pub fn get(&self, limit: Limit) -> u64 {
        self.counts[limit as usize].load(Ordering::Relaxed)
    }

    /// Both counters' samples, with `labels` (`model_name="…"`) on each.
    pub(crate) fn render(&self, out: &mut String, labels: &str) {
        for (closes, name, help) in [
            (
                false,
                "candle_tp:requests_rejected_total",
                "Requests refused by a server limit or a full queue, by reason (the error's code).",
            ),
            (
                true,
                "candle_tp:connections_closed_total",
                "Connections closed by --header-timeout or --send-timeout, by reason.",
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for limit in Limit::ALL
                .into_iter()
                .filter(|l| l.closes_connection() == closes)
            {
                let _ = writeln!(
                    out,
                    "{name}{{{labels},reason=\"{}\"}} {}",
                    limit.reason(),
                    self.get(limit)
                );
            }
        }
    }
}

/// The server's counters, gauges and histograms (shared by the HTTP side and the loop).
#[derive(Debug)]
pub struct Metrics {
    /// Sequences in the batch (set by the loop after each step).
    pub running: AtomicUsize,
    /// Requests queued, not yet in the batch.
    pub waiting: AtomicUsize,
    /// KV cache positions in use (set by the loop after each step).
    pub kv_used: AtomicUsize,
    /// KV cache positions at most (`max_batch × max_seq_len`; 0 until the loop sets it).
    pub kv_capacity: AtomicUsize,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Requests finished by a stop (token or string).
    pub finished_stop: AtomicU64,
    /// Requests finished by their length limit.
    pub finished_length: AtomicU64,
    /// Rank 0's communication payload for the model (set by the loop after each step).
    pub comm_payload_bytes: AtomicU64,
    /// Of it, the bytes rank 0 handed to the network (set by the loop after each step).
    pub comm_cross_host_bytes: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens of a request.
    pub tpot: Histogram,
    /// Time from queueing to the last token.
    pub e2e: Histogram,
    /// Requests refused and connections closed by a limit (shared with `limits::serve`).
    pub rejected: Arc<Rejections>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            kv_used: AtomicUsize::new(0),
            kv_capacity: AtomicUsize::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished_stop: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            comm_payload_bytes: AtomicU64::new(0),
            comm_cross_host_bytes: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            rejected: Arc::default(),
        }
    }
}

/// A label value with `\`, `"` and newlines escaped.
pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Counts a finished request (`reason`: `stop` or `length`).
    pub fn finished(&self, reason: &str) {
        let c = if reason == "stop" {
            &self.finished_stop
        } else {
            &self.finished_length
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Everything in Prometheus' text format (version 0.0.4).
    pub fn render(&self, model_name: &str) -> String {
        let labels = format!("model_name=\"{}\"", escape(model_name));
        let mut out = String::new();
        let load = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        let cap = load(&self.kv_capacity);
        let usage = if cap == 0 {
            0.0
        } else {
            load(&self.kv_used) as f64 / cap as f64
        };
        for (name, help, v) in [
            (
                "num_requests_running",
                "Sequences in the batch.",
                load(&self.running) as f64,
            ),
            (
                "num_requests_waiting",
                "Requests waiting for a slot.",
                load(&self.waiting) as f64,
            ),
            (
                "kv_cache_usage_perc",
                "KV cache positions in use, as a fraction of max_batch x max_seq_len (1 = full).",
                usage,
            ),
        ] {
            let name = format!("candle_tp:{name}");
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v:?}"
            );
        }
        for (name, help, v) in [
            (
                "prompt_tokens_total",
                "Prompt tokens of accepted requests.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "generation_tokens_total",
                "Tokens generated.",
                self.generation_tokens.load(Ordering::Relaxed),
            ),
            (
                "comm_payload_bytes_total",
                "Rank 0's collective and point-to-point payload for the model.",
                self.comm_payload_bytes.load(Ordering::Relaxed),
            ),
            (
                "comm_cross_host_bytes_total",
                "Of rank 0's payload, the bytes handed to the network (0 on one host).",
                self.comm_cross_host_bytes.load(Ordering::Relaxed),
            ),
        ] {
            let name = format!("candle_tp:{name}");
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {v}"
            );
        }
        let name = "candle_tp:request_success_total";
        let _ = writeln!(
            out,
            "# HELP {name} Requests finished, by reason.\n# TYPE {name} counter"
        );
        for (reason, c) in [
            ("stop", &self.finished_stop),
            ("length", &self.finished_length),
        ] {
            let _ = writeln!(
                out,
                "{name}{{{labels},finished_reason=\"{reason}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        self.ttft.render(
            &mut out,
            "candle_tp:time_to_first_token_seconds",
            "Time from queueing to the first token.",
            &labels,
        );
        self.tpot.render(
            &mut out,
            "candle_tp:time_per_output_token_seconds",
            "Time between two tokens of a request.",
            &labels,
        );
        self.e2e.render(
            &mut out,
            "candle_tp:e2e_request_latency_seconds",
            "Time from queueing to the last token.",
            &labels,
        );
        self.rejected.render(&mut out, &labels);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let m = Metrics::default();
        for v in [0.0005, 0.003, 0.003, 3000.0] {
            m.ttft.observe(v);
        }
        let text = m.render("a\"b");
        assert!(text.contains(r#"model_name="a\"b""#), "{text}");
        let line = |le: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with("candle_tp:time_to_first_token_seconds_bucket")
                        && l.contains(&format!("le=\"{le}\""))
                })
                .unwrap_or_else(|| panic!("no bucket {le}: {text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(line("0.001"), "1");
        assert_eq!(line("0.005"), "3");
        assert_eq!(line("2560.0"), "3");
        assert_eq!(line("+Inf"), "4");
    }

    /// Every limit is rendered (0 until it acts) under the metric of its kind, with its error
    /// code as the reason; only codes of refusals map back to a limit.
    #[test]
    fn rejections_are_rendered_by_reason() {
        let m = Metrics::default();
        m.rejected.count(Limit::QueueFull);
        m.rejected.count(Limit::QueueFull);
        m.rejected.count(Limit::SendTimeout);
        let text = m.render("m");
        for (line, n) in [
            (
                r#"candle_tp:requests_rejected_total{model_name="m",reason="queue_full"}"#,
                "2",
            ),
            (
                r#"candle_tp:requests_rejected_total{model_name="m",reason="tokenizer_busy"}"#,
                "0",
            ),
            (
                r#"candle_tp:connections_closed_total{model_name="m",reason="send_timeout"}"#,
                "1",
            ),
            (
                r#"candle_tp:connections_closed_total{model_name="m",reason="header_timeout"}"#,
                "0",
            ),
        ] {
            assert!(
                text.contains(&format!("{line} {n}\n")),
                "{line} {n}: {text}"
            );
        }
        assert_eq!(text.matches(",reason=").count(), Limit::ALL.len());
        assert_eq!(Limit::of_code("queue_full"), Some(Limit::QueueFull));
        assert_eq!(
            Limit::of_code("send_timeout"),
            None,
            "closes, is not a code"
        );
        assert_eq!(Limit::of_code("model_not_found"), None);
    }
}
