//! What one client may hold of the server (issue 44, defects 12 and 15). Needs `--features
//! server` and `scripts/fetch-models.sh`. Each deadline is set by its flag to a second or two
//! and checked against a client that stalls far longer; no check times the server closer than
//! "it ended within" a generous bound.
//!
//! - Connections past `--max-connections` get a 503 `too_many_connections`; places come back
//!   when connections close.
//! - A body sent byte by byte gets a 408 after `--body-timeout`; headers sent byte by byte,
//!   an idle connection and an idle keep-alive connection are closed after
//!   `--header-timeout`; a request that runs longer than both is answered.
//! - Tokenizing runs at most `--max-tokenize-jobs` at once; a request that waits longer than
//!   `--tokenize-wait` for one gets a 503 `tokenizer_busy`.
//! - A streamed request queued behind another gets SSE keep-alive comments; queued requests
//!   whose clients left give their queue places back at once; a streaming client that stops
//!   reading loses its decode slot after `--send-timeout` (dropped, not finished).
//! - An embedding request whose client left before its turn is not run.
//! - A non-streamed answer with many log-probabilities is built off the async thread: the
//!   server's one async worker keeps running other tasks meanwhile.
//! - Every refusal and closed connection above is counted in `/metrics`
//!   (`candle_tp:requests_rejected_total{reason}`, `candle_tp:connections_closed_total{reason}`),
//!   as many as the test saw.
#![cfg(feature = "server")]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::serve::{
    closed_for, connect_with_receive_buffer, failed_checks, health, http, made_up_words, metric,
    model_dir, post, rejected, wait_active, Server, SERIAL,
};

/// Writes a request to a new connection (kept alive) and returns the connection.
fn send(port: u16, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write the request");
    s
}

/// Reads one response of known length from `s` (within `within`): its status and body.
fn read_response(s: &mut TcpStream, within: Duration) -> (u16, String) {
    s.set_read_timeout(Some(within)).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no content-length in {head}"));
            if raw.len() >= end + 4 + len {
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse().ok())
                    .expect("status");
                let body = String::from_utf8_lossy(&raw[end + 4..end + 4 + len]).into_owned();
                return (status, body);
            }
        }
        match s.read(&mut buf) {
            Ok(0) => panic!(
                "the connection closed before a whole response: {:?}",
                String::from_utf8_lossy(&raw)
            ),
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) => panic!(
                "no whole response within {within:?} ({e}): {:?}",
                String::from_utf8_lossy(&raw)
            ),
        }
    }
}

/// How [`read_for`] ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ended {
    /// The server closed (or reset) the connection.
    Closed,
    /// What was read satisfied the caller.
    Enough,
    /// The time ran out.
    Deadline,
}

/// Reads `s` for at most `within`, until the server closes it or `enough(what was read)`;
/// returns how it ended and what was read.
fn read_for(
    s: &mut TcpStream,
    within: Duration,
    enough: impl Fn(&[u8]) -> bool,
) -> (Ended, Vec<u8>) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < within {
        s.set_read_timeout(Some(
            within
                .saturating_sub(t0.elapsed())
                .max(Duration::from_millis(1)),
        ))
        .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (Ended::Closed, got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(_) => return (Ended::Closed, got), // reset: closed
        }
        if enough(&got) {
            return (Ended::Enough, got);
        }
    }
    (Ended::Deadline, got)
}

/// Whether the server closes `s` within `within` (anything it sends meanwhile is returned).
fn closed_within(s: &mut TcpStream, within: Duration) -> (bool, Vec<u8>) {
    let (ended, got) = read_for(s, within, |_| false);
    (ended == Ended::Closed, got)
}

/// Writes `bytes` to `s` one at a time, `every` apart, on a thread, until they are all sent,
/// a write fails (the server closed) or the returned flag is set.
fn trickle(s: &TcpStream, bytes: Vec<u8>, every: Duration) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut w = s.try_clone().expect("clone");
    let flag = stop.clone();
    std::thread::spawn(move || {
        for b in bytes {
            std::thread::sleep(every);
            if flag.load(Ordering::SeqCst) || w.write_all(&[b]).is_err() {
                return;
            }
        }
    });
    stop
}

fn error_of(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["error"].clone()
}

fn message_names(err: &Value, parts: &[&str]) {
    let m = err["message"].as_str().unwrap_or_else(|| panic!("{err}"));
    for p in parts {
        assert!(m.contains(p), "the message does not name {p:?}: {err}");
    }
}

/// Issue 44, defect 12: the fifth connection of a server with `--max-connections 4` is
/// answered 503 `too_many_connections` (OpenAI's error shape) while four connections are
/// open; the four are served; once they close, requests are served again.
#[test]
fn connections_past_the_limit_get_a_503() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(1, &["--max-connections", "4", "--max-seq-len", "64"]);
    let port = server.port;
    assert_eq!(health(port)["status"], "ok");
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).expect("connect"))
        .collect();
    // The server takes connections in order: the fifth is past the limit.
    let (status, text) = http(port, "GET", "/health", "");
    assert_eq!(status, 503, "the fifth connection was served: {text}");
    let mut refused = 1.0;
    let err = error_of(&text);
    assert_eq!(err["code"], "too_many_connections", "{err}");
    assert_eq!(err["type"], "server_error", "{err}");
    message_names(&err, &["4", "--max-connections"]);
    // A connection that holds a place is served.
    write!(
        held[0],
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let (status, text) = read_response(&mut held[0], Duration::from_secs(30));
    assert_eq!(status, 200, "{text}");
    drop(held);
    // Their places come back.
    let t0 = Instant::now();
    loop {
        let (status, text) = http(port, "GET", "/health", "");
        if status == 200 {
            break;
        }
        refused += 1.0;
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "still refused 20 s after the connections closed: {status} {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        rejected(port, "too_many_connections"),
        refused,
        "the 503s the test got are not what /metrics counts"
    );
}

/// A body sent a byte every 300 ms is cut off with a 408 naming `--body-timeout`, and the
/// connection is closed.
fn a_slow_body_gets_408(port: u16) {
    let body = json!({"prompt": "Hello there, how are you?", "max_tokens": 1}).to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let t0 = Instant::now();
    // 57 bytes at 300 ms: the whole body would take 17 s.
    let stop = trickle(&s, body.into_bytes(), Duration::from_millis(300));
    let (status, text) = read_response(&mut s, Duration::from_secs(30));
    stop.store(true, Ordering::SeqCst);
    assert_eq!(status, 408, "{text}");
    let err = error_of(&text);
    assert_eq!(err["code"], "request_timeout", "{err}");
    message_names(&err, &["1 s", "--body-timeout"]);
    assert!(
        t0.elapsed() < Duration::from_secs(12),
        "the 408 came {:?} after the headers",
        t0.elapsed()
    );
    let (closed, _) = closed_within(&mut s, Duration::from_secs(10));
    assert!(closed, "the connection stayed open after the 408");
}

/// Headers sent a byte every 300 ms never make a request: the connection is closed, without
/// an answer, within `--header-timeout` (2 s) and a margin.
fn slow_headers_are_closed(port: u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(s, "GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let stop = trickle(
        &s,
        format!("X-Slow: {}\r\n\r\n", "a".repeat(200)).into_bytes(),
        Duration::from_millis(300),
    );
    let (closed, got) = closed_within(&mut s, Duration::from_secs(15));
    stop.store(true, Ordering::SeqCst);
    assert!(closed, "headers trickling for 15 s kept their connection");
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
}

/// A connection that sends nothing is closed within `--header-timeout` and a margin.
fn an_idle_connection_is_closed(port: u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let (closed, _) = closed_within(&mut s, Duration::from_secs(15));
    assert!(closed, "a silent connection was kept for 15 s");
}

/// A keep-alive connection is closed `--header-timeout` after its answer when no request
/// follows.
fn an_idle_keep_alive_connection_is_closed(port: u16) {
    let mut s = send(port, "GET", "/health", "");
    let (status, text) = read_response(&mut s, Duration::from_secs(30));
    assert_eq!(status, 200, "{text}");
    let (closed, _) = closed_within(&mut s, Duration::from_secs(15));
    assert!(closed, "an idle keep-alive connection was kept for 15 s");
}

/// A request whose answer takes longer than both deadlines (240 tokens) is answered: the
/// deadlines are on the client's sending, not on the server's work.
fn a_long_request_is_answered(port: u16) {
    let t0 = Instant::now();
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 240, "min_tokens": 240}),
    );
    eprintln!("a request of 240 tokens: {:?}", t0.elapsed());
    assert_eq!(status, 200, "{v}");
    assert!(
        t0.elapsed() > Duration::from_secs(3),
        "the request took {:?}, less than --header-timeout and a margin: make it longer",
        t0.elapsed()
    );
}

/// Issue 44, defect 12: slowloris clients (a body or headers sent byte by byte, connections
/// that send nothing) are cut off by `--body-timeout` (1 s) and `--header-timeout` (2 s).
#[test]
fn slow_clients_are_cut_off() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(
        1,
        &[
            "--body-timeout",
            "1",
            "--header-timeout",
            "2",
            "--max-seq-len",
            "256",
        ],
    );
    let port = server.port;
    assert_eq!(closed_for(port, "header_timeout"), 0.0);
    let failed = failed_checks(&[
        ("a_slow_body_gets_408", &|| a_slow_body_gets_408(port)),
        ("slow_headers_are_closed", &|| slow_headers_are_closed(port)),
        ("an_idle_connection_is_closed", &|| {
            an_idle_connection_is_closed(port)
        }),
        ("an_idle_keep_alive_connection_is_closed", &|| {
            an_idle_keep_alive_connection_is_closed(port)
        }),
        ("a_long_request_is_answered", &|| {
            a_long_request_is_answered(port)
        }),
    ]);
    assert!(failed.is_empty(), "failed: {failed:?}");
    assert_eq!(health(port)["status"], "ok");
    assert_eq!(rejected(port, "request_timeout"), 1.0, "the one 408");
    // Slow headers, a silent connection and an idle keep-alive one (and any of the test's
    // own keep-alive connections left idle).
    let closed = closed_for(port, "header_timeout");
    assert!(
        closed >= 3.0,
        "{closed} connections closed by --header-timeout, 3 at least"
    );
}

/// A `/tokenize` body of `bytes` made-up words (the tokenizer's word cache cannot shortcut
/// them).
fn big_tokenize_body(bytes: usize) -> String {
    json!({"prompt": made_up_words(bytes)}).to_string()
}

/// Issue 44, defect 12: with `--max-tokenize-jobs 1 --tokenize-wait 1`, a burst of large
/// `/tokenize` requests that would take one job at least 4 s is served one at a time: those
/// that waited past a second get a 503 `tokenizer_busy` naming both flags, the others their
/// tokens; the server then serves as before.
#[test]
fn tokenizing_is_bounded() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(
        1,
        &[
            "--max-tokenize-jobs",
            "1",
            "--tokenize-wait",
            "1",
            "--max-seq-len",
            "64",
        ],
    );
    let port = server.port;
    let body = Arc::new(big_tokenize_body(1_900_000));
    let t0 = Instant::now();
    let (status, text) = http(port, "POST", "/tokenize", &body);
    assert_eq!(status, 200, "{}", &text[..text.len().min(300)]);
    let one = t0.elapsed();
    // Enough that one job at a time needs 4 s for them all.
    let k = ((4.0 / one.as_secs_f64()).ceil() as usize + 2).clamp(4, 48);
    eprintln!("one request: {one:?}; {k} at once");
    let clients: Vec<_> = (0..k)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || http(port, "POST", "/tokenize", &body))
        })
        .collect();
    let (mut ok, mut busy) = (0, 0);
    for c in clients {
        let (status, text) = c.join().expect("client");
        match status {
            200 => ok += 1,
            503 => {
                let err = error_of(&text);
                assert_eq!(err["code"], "tokenizer_busy", "{err}");
                message_names(&err, &["--max-tokenize-jobs", "--tokenize-wait", "1 s"]);
                busy += 1;
            }
            s => panic!("status {s}: {}", &text[..text.len().min(300)]),
        }
    }
    eprintln!("{ok} tokenized, {busy} refused");
    assert_eq!(
        rejected(port, "tokenizer_busy"),
        busy as f64,
        "/metrics against the 503s"
    );
    assert!(ok >= 1, "none of {k} was tokenized");
    assert!(
        busy >= 1,
        "all {k} requests were tokenized at once: nothing bounds the tokenizing jobs"
    );
    let (status, v) = post(port, "/tokenize", &json!({"prompt": "Hello"}));
    assert_eq!(status, 200, "{v}");
}

/// A streamed completion of 1500 tokens that no end-of-sequence can end early.
fn long_stream() -> String {
    json!({"prompt": "Tell me a long story.", "max_tokens": 1500, "min_tokens": 1500,
           "stream": true})
    .to_string()
}

/// A connection whose answer a thread reads and throws away; shut down when dropped.
struct Drained {
    sock: TcpStream,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Drained {
    fn new(sock: TcpStream) -> Self {
        let mut r = sock.try_clone().expect("clone");
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while matches!(r.read(&mut buf), Ok(n) if n > 0) {}
        });
        Self {
            sock,
            reader: Some(reader),
        }
    }
}

impl Drop for Drained {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Reads `s` until `want` appears (true) or `stop` does first, or `within` passes (false);
/// returns what was read.
fn read_until(s: &mut TcpStream, want: &str, stop: &str, within: Duration) -> (bool, String) {
    let (_, got) = read_for(s, within, |got| {
        let text = String::from_utf8_lossy(got);
        text.contains(want) || text.contains(stop)
    });
    let text = String::from_utf8_lossy(&got).into_owned();
    let seen = match (text.find(want), text.find(stop)) {
        (Some(w), Some(s)) => w < s,
        (Some(_), None) => true,
        _ => false,
    };
    (seen, text)
}

/// Waits until no sequence runs and none waits (the streams of a check were dropped; also
/// after a check that failed half-way).
fn settle(port: u16) {
    let t0 = Instant::now();
    while metric(port, "candle_tp:num_requests_running") != 0.0
        || metric(port, "candle_tp:num_requests_waiting") != 0.0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the server did not settle"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A streamed request queued behind another (one slot) gets `: keep-alive` comments (every
/// second) before its first token.
fn keep_alive_while_queued(port: u16) {
    settle(port);
    let a = Drained::new(send(port, "POST", "/v1/completions", &long_stream()));
    wait_active(port, 1, Duration::from_secs(30));
    let body = json!({"prompt": "Hi", "max_tokens": 2, "stream": true}).to_string();
    let mut b = send(port, "POST", "/v1/completions", &body);
    let (seen, text) = read_until(&mut b, ": keep-alive", "data:", Duration::from_secs(20));
    drop(b);
    drop(a);
    settle(port);
    assert!(seen, "no keep-alive comment while queued: {text:?}");
    assert!(text.starts_with("HTTP/1.1 200"), "{text:?}");
}

/// With the slot taken and the queue (2 places) full, another request is refused; once the
/// two queued clients leave, a request is queued again, before the running one ends.
fn gone_clients_leave_the_queue(port: u16) {
    settle(port);
    let a = Drained::new(send(port, "POST", "/v1/completions", &long_stream()));
    wait_active(port, 1, Duration::from_secs(30));
    let b = send(port, "POST", "/v1/completions", &long_stream());
    let c = send(port, "POST", "/v1/completions", &long_stream());
    let t0 = Instant::now();
    while metric(port, "candle_tp:num_requests_waiting") != 2.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the two requests were not queued"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1}),
    );
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "queue_full", "{v}");
    let full = rejected(port, "queue_full");
    assert!(full >= 1.0, "the 503 queue_full is not counted in /metrics");
    drop((b, c));
    let t0 = Instant::now();
    let e = loop {
        let mut e = send(port, "POST", "/v1/completions", &long_stream());
        let mut head = [0u8; 12];
        e.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        e.read_exact(&mut head).expect("a status line");
        if &head == b"HTTP/1.1 200" {
            break e;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the queue stayed full 20 s after its two clients left: {}",
            String::from_utf8_lossy(&head)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(metric(port, "candle_tp:num_requests_running"), 1.0);
    drop(e);
    drop(a);
    settle(port);
}

/// A streaming client that stops reading (its receive buffer a few kilobytes) loses its
/// decode slot within a minute (`--send-timeout 2`): the request is dropped, not finished.
fn a_stalled_reader_loses_its_slot(port: u16) {
    settle(port);
    let finished = metric(port, "candle_tp:request_success_total");
    let cut = closed_for(port, "send_timeout");
    let mut s = connect_with_receive_buffer(port, 4096);
    let body = long_stream();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).expect("a status line");
    assert_eq!(&head, b"HTTP/1.1 200");
    // It reads no more.
    wait_active(port, 1, Duration::from_secs(30));
    let t0 = Instant::now();
    while metric(port, "candle_tp:num_requests_running") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "a client that reads nothing still holds its slot after 90 s ({} tokens generated)",
            metric(port, "candle_tp:generation_tokens_total")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "the stalled reader's slot was freed after {:?}",
        t0.elapsed()
    );
    assert_eq!(
        metric(port, "candle_tp:request_success_total"),
        finished,
        "the request finished instead of being dropped"
    );
    assert_eq!(
        closed_for(port, "send_timeout"),
        cut + 1.0,
        "the stalled reader's connection is not counted as closed by --send-timeout"
    );
    drop(s);
}

/// Issue 44, defect 15: SSE keep-alives while queued, queue places freed by clients that
/// left, and the decode slot of a client that stopped reading (2 ranks, one slot, a queue of
/// two).
#[test]
fn streams_are_kept_alive_and_released() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(
        2,
        &[
            "--max-batch",
            "1",
            "--max-queue",
            "2",
            "--sse-keep-alive",
            "1",
            "--send-timeout",
            "2",
        ],
    );
    let port = server.port;
    let failed = failed_checks(&[
        ("keep_alive_while_queued", &|| keep_alive_while_queued(port)),
        ("gone_clients_leave_the_queue", &|| {
            gone_clients_leave_the_queue(port)
        }),
        ("a_stalled_reader_loses_its_slot", &|| {
            a_stalled_reader_loses_its_slot(port)
        }),
    ]);
    assert!(failed.is_empty(), "failed: {failed:?}");
    for (rank, pid) in server.rank_pids() {
        assert!(common::serve::is_running(pid), "rank {rank} is gone");
    }
}

fn minilm_dir() -> PathBuf {
    candle_tp::models::models_dir()
        .expect("models dir")
        .join("all-minilm-l6-v2")
}

/// Issue 44, defect 15: embedding requests whose clients left while a long one ran are not
/// run (`cancelled` in `/health`); the long one is answered, and so is the next.
#[test]
fn embeddings_of_gone_clients_are_not_run() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start_model(1, &minilm_dir(), &["--max-queue", "8"]);
    let port = server.port;
    // 128 inputs of 123 tokens: about 8 s at one rank here.
    let text: String = (0..60).map(|i| format!("word{i} ")).collect::<String>();
    let inputs: Vec<String> = (0..128).map(|i| format!("{i} {text}")).collect();
    let long = std::thread::spawn(move || post(port, "/v1/embeddings", &json!({"input": inputs})));
    let t0 = Instant::now();
    while health(port)["active"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the long request never ran: {}",
            health(port)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let body = json!({"input": "a short one"}).to_string();
    let gone: Vec<TcpStream> = (0..3)
        .map(|_| send(port, "POST", "/v1/embeddings", &body))
        .collect();
    let t0 = Instant::now();
    loop {
        let h = health(port);
        if h["waiting"] == 3 {
            assert_eq!(
                h["active"], 1,
                "the long request ended before the others were queued: make it longer"
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "three requests never waited: {h}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(gone);
    let (status, v) = long.join().expect("client");
    assert_eq!(status, 200, "{v}");
    let t0 = Instant::now();
    loop {
        let h = health(port);
        if h["waiting"] == 0 && h["active"] == 0 {
            assert_eq!(h["cancelled"], 3, "{h}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{h}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, v) = post(port, "/v1/embeddings", &json!({"input": "after"}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["data"][0]["embedding"].as_array().map(Vec::len),
        Some(384)
    );
}

/// Issue 44, defect 12: a non-streamed answer of 12 000 tokens with 20 top log-probabilities
/// each is built off the async thread. On a runtime of one worker (as the server's) a task
/// that ticks every 5 ms runs while `job::whole` builds it: the worker is never held for half
/// the time that building that JSON takes in one piece (measured here, over a second).
#[test]
fn a_large_logprobs_answer_is_built_off_the_async_thread() {
    use candle_tp::generate::{FinishReason, TokenLogprobs};
    use candle_tp::serve::job::{self, Head, Job};
    use candle_tp::serve::logprobs::LogprobsOut;
    use candle_tp::serve::{Event, ModelText, TextJobs, TextStream};

    const TOKENS: usize = 12_000;
    const TOP: usize = 20;
    // Alone: a server test beside it would take the cores the ticker needs.
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let text = Arc::new(ModelText::load(&model_dir()).expect("tokenizer"));
    let lp = |i: usize| TokenLogprobs {
        token: (1000 + i % 3000) as u32,
        logprob: -0.5,
        top: (0..TOP)
            .map(|j| ((1000 + (i * 7 + j * 13) % 40_000) as u32, -(j as f64) - 0.5))
            .collect(),
    };
    // Building that JSON in one piece, as the worker did.
    let mut out = LogprobsOut::default();
    for i in 0..TOKENS {
        out.push(&text, &lp(i)).expect("push");
    }
    let t0 = Instant::now();
    let json = out.take(true).to_string();
    let build = t0.elapsed();
    eprintln!(
        "{TOKENS} tokens' log-probabilities: {} bytes of JSON, built in {build:?}",
        json.len()
    );
    assert!(
        build > Duration::from_millis(600),
        "the answer builds in {build:?}: too fast to tell, make it larger"
    );

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..TOKENS {
        let l = lp(i);
        tx.send(Event::Token {
            token: l.token,
            finish: (i + 1 == TOKENS).then_some(FinishReason::Length),
            logprobs: Some(l),
        })
        .unwrap();
    }
    drop(tx);
    let job = Job {
        index: 0,
        prompt_tokens: 3,
        text: text.clone(),
        stream: TextStream::new(Vec::new()),
        rx,
        completion_tokens: 0,
        prompt_ids: None,
        pending_ids: Vec::new(),
        logprobs: Some(LogprobsOut::default()),
        metrics: Arc::new(candle_tp::serve::metrics::Metrics::default()),
        queued: Instant::now(),
        last_token: None,
        tools: None,
        calls: Vec::new(),
    };
    let head = Head {
        chat: true,
        id: "chatcmpl-test".into(),
        created: 0,
        model: "m".into(),
        include_usage: false,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let ticks = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let ticker = {
        let (ticks, done) = (ticks.clone(), done.clone());
        rt.spawn(async move {
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
                ticks.lock().unwrap().push(Instant::now());
            }
        })
    };
    let jobs = TextJobs::new(2, Duration::from_secs(60));
    let t0 = Instant::now();
    let answer = rt
        .block_on(rt.spawn(async move { job::whole(head, vec![job], &jobs).await }))
        .expect("task")
        .expect("answer");
    let took = t0.elapsed();
    done.store(true, Ordering::SeqCst);
    rt.block_on(ticker).unwrap();
    assert_eq!(answer.status(), 200);
    let ticks = ticks.lock().unwrap();
    let mut last = t0;
    let mut longest = Duration::ZERO;
    for &t in ticks.iter().filter(|&&t| t > t0) {
        longest = longest.max(t - last);
        last = t;
    }
    longest = longest.max(t0 + took - last.min(t0 + took));
    eprintln!(
        "whole: {took:?}; the ticker's longest wait {longest:?} ({} ticks)",
        ticks.len()
    );
    assert!(
        longest < build / 2,
        "the async worker was held {longest:?} while the answer was built (building it takes {build:?})"
    );
}
