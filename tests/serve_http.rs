//! `candle-tp-serve` as real processes under `tprun`, driven with real HTTP over TCP:
//! 16 concurrent greedy completions have the token ids examples/generate gives each prompt
//! alone, at worlds 1, 2 and 3 and on the Q4_1 GGUF file, chat and streaming, bad input answered in
//! OpenAI's error shape, a client that disconnects mid-stream, 200 connections on a 16-slot
//! server, and a SIGTERM that ends in-flight requests and every rank, leaving nothing in
//! /dev/shm. Needs `--features server`.
#![cfg(feature = "server")]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::serve::{health, http, model_dir, post, sse_data, Server, SERIAL};

const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Tensor parallelism splits a model across",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "To make a cup of tea, first",
    "In 1969, the first humans",
    "The quick brown fox",
];

/// `examples/generate`'s greedy ids for `prompt` decoded alone, at most `max_new` tokens, on
/// `nproc` ranks.
fn generate_alone(model: &Path, prompt: &str, max_new: usize, nproc: usize) -> Vec<u32> {
    let args = [
        "--model".to_string(),
        model.display().to_string(),
        "--prompt".into(),
        prompt.into(),
        "--max-new-tokens".into(),
        max_new.to_string(),
    ];
    let v = common::run_generate(nproc, &args);
    serde_json::from_value(v["token_ids"].clone()).expect("token_ids")
}

/// `n` requests over the prompts, with different lengths: (prompt, max_tokens).
fn greedy_cases(n: usize) -> Vec<(String, usize)> {
    (0..n)
        .map(|i| (PROMPTS[i % PROMPTS.len()].to_string(), 6 + (i * 5) % 19))
        .collect()
}

/// Each case's greedy ids decoded alone by examples/generate (one run per prompt, at the
/// longest length asked of it: greedy ids of a shorter run are a prefix).
fn references(cases: &[(String, usize)], model: &Path, nproc: usize) -> Vec<Vec<u32>> {
    let mut longest: HashMap<&str, usize> = HashMap::new();
    for (p, n) in cases {
        let e = longest.entry(p.as_str()).or_default();
        *e = (*e).max(*n);
    }
    let alone: HashMap<&str, Vec<u32>> = longest
        .iter()
        .map(|(p, n)| (*p, generate_alone(model, p, *n, nproc)))
        .collect();
    cases
        .iter()
        .map(|(p, n)| alone[p.as_str()].iter().take(*n).copied().collect())
        .collect()
}

/// Requests (prompt, max_tokens) and the token ids each should get.
type Cases = (Vec<(String, usize)>, Vec<Vec<u32>>);

/// The safetensors references (world 1), computed once for all the tests of this binary.
fn safetensors_references() -> &'static Cases {
    static REFS: OnceLock<Cases> = OnceLock::new();
    REFS.get_or_init(|| {
        let cases = greedy_cases(16);
        let refs = references(&cases, &model_dir(), 1);
        (cases, refs)
    })
}

/// All `cases` sent at once (temperature 0, `return_token_ids`): every completion's ids equal
/// `expected` (the prompt decoded alone), its usage and finish reason agree with them.
fn concurrent_greedy_matches_alone(port: u16, cases: &[(String, usize)], expected: &[Vec<u32>]) {
    let handles: Vec<_> = cases
        .iter()
        .cloned()
        .map(|(p, n)| {
            std::thread::spawn(move || {
                post(
                    port,
                    "/v1/completions",
                    &json!({"prompt": p, "max_tokens": n, "temperature": 0,
                            "return_token_ids": true}),
                )
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.join().expect("client thread");
        assert_eq!(status, 200, "request {i}: {v}");
        let ids: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone())
            .unwrap_or_else(|e| panic!("request {i}: token_ids: {e}: {v}"));
        assert_eq!(
            ids, expected[i],
            "request {i} ({:?}): the server's ids differ from examples/generate's alone: {v}",
            cases[i]
        );
        assert!(v["choices"][0]["text"].is_string(), "request {i}: {v}");
        assert!(!v["choices"][0]["prompt_token_ids"]
            .as_array()
            .unwrap()
            .is_empty());
        assert_eq!(
            v["usage"]["completion_tokens"],
            ids.len(),
            "request {i}: {v}"
        );
        assert_eq!(v["object"], "text_completion");
        let finish = if ids.len() == cases[i].1 {
            "length"
        } else {
            "stop"
        };
        assert_eq!(v["choices"][0]["finish_reason"], finish, "request {i}: {v}");
    }
}

fn chat_and_stream(port: u16) {
    let msg = json!([{"role": "user", "content": "What is 2 + 2?"}]);
    let (status, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": msg, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    assert!(!content.is_empty(), "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 5, "{v}");
    let body = json!({"messages": msg, "max_tokens": 12, "temperature": 0, "stream": true});
    let (status, text) = http(port, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let mut streamed = String::new();
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).expect("chunk JSON");
        assert_eq!(c["object"], "chat.completion.chunk");
        streamed.push_str(
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default(),
        );
    }
    assert_eq!(streamed, content, "streamed vs whole");
    // min_tokens (vLLM's extension): the end of the turn cannot come before it. The answer
    // to this question ends well before 40 tokens without it (checked, so the case can fail).
    let (_, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": msg, "max_tokens": 40, "temperature": 0}),
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() < 40,
        "{v}"
    );
    let (_, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": msg, "max_tokens": 40, "min_tokens": 40, "temperature": 0}),
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
    // A stop string ends the text before it.
    let (_, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0}),
    );
    let full = v["choices"][0]["text"].as_str().unwrap().to_string();
    let word: String = full
        .split_whitespace()
        .nth(2)
        .expect("three words")
        .to_string();
    let (_, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0, "stop": [word]}),
    );
    let cut = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(
        full.starts_with(cut) && cut.len() < full.len() && !cut.contains(&word),
        "{cut:?} vs {full:?}"
    );
}

fn bad_input(port: u16) {
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{not json".into(), 400, None),
        ("/v1/completions", "[1, 2]".into(), 400, None),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 3, "min_tokens": 4}).to_string(),
            400,
            Some("min_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "min_tokens": -1}).to_string(),
            400,
            Some("min_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": 5}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": "ten"}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "temperature": -1}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "model": "gpt-9"}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "word ".repeat(3000)}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": -3}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 1_000_000_000u64}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "n": 0}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 7}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        ("/v1/nothing", "{}".into(), 404, None),
    ];
    for (path, body, status, param) in cases {
        let (got, text) = http(port, "POST", path, &body);
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} {body}: {text}: {e}"));
        assert_eq!(got, status, "{path} {body:.80}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert!(v["error"]["type"].is_string(), "{v}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{body:.80}: {v}");
        }
    }
    // Unknown fields are ignored.
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2, "user": "x", "logprobs": null, "frequency_penalty": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let (status, text) = http(port, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["data"][0]["id"],
        "smollm2-135m-instruct"
    );
}

/// Requests the server finished (`stop` or `length`), from `/metrics`.
fn finished_requests(port: u16) -> f64 {
    let (status, text) = http(port, "GET", "/metrics", "");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter(|l| l.starts_with("candle_tp:request_success_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

fn disconnect_frees_the_slot(port: u16) {
    let finished_before = finished_requests(port);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // min_tokens: no end-of-sequence token can end it before the disconnect does.
    let body =
        json!({"prompt": PROMPTS[0], "max_tokens": 1000, "min_tokens": 1000, "stream": true})
            .to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap();
    assert!(
        n > 0 && String::from_utf8_lossy(&buf[..n]).contains("200"),
        "no answer"
    );
    // The answer's headers go out when the request is queued; it joins the batch at the
    // scheduler's next step.
    let t0 = Instant::now();
    while health(port)["active"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the streamed request never joined the batch"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s);
    let t0 = Instant::now();
    while health(port)["active"] != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the disconnected stream still holds its slot"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // It was dropped, not finished (neither a stop nor its length ended it).
    assert_eq!(
        finished_requests(port),
        finished_before,
        "the request finished instead of being dropped on disconnect"
    );
}

fn many_connections(port: u16) {
    let handles: Vec<_> = (0..200)
        .map(|i| {
            std::thread::spawn(move || {
                post(
                    port,
                    "/v1/completions",
                    &json!({"prompt": PROMPTS[i % 8], "max_tokens": 4, "temperature": 0}),
                )
            })
        })
        .collect();
    let (mut ok, mut busy) = (0, 0);
    for h in handles {
        let (status, v) = h.join().expect("client");
        match status {
            200 => ok += 1,
            503 => {
                assert_eq!(v["error"]["code"], "queue_full", "{v}");
                busy += 1
            }
            s => panic!("status {s}: {v}"),
        }
    }
    assert!(ok >= 16 && ok + busy == 200, "{ok} answered, {busy} busy");
    eprintln!("200 connections: {ok} answered, {busy} refused with 503");
}

#[test]
fn server_two_ranks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(2, &["--max-batch", "16", "--max-queue", "32"]);
    let port = server.port;
    let (cases, expected) = safetensors_references();
    bad_input(port);
    concurrent_greedy_matches_alone(port, cases, expected);
    chat_and_stream(port);
    disconnect_frees_the_slot(port);
    many_connections(port);
    // Still in lockstep after all that: greedy answers are unchanged.
    concurrent_greedy_matches_alone(port, cases, expected);
    drop(server);
}

/// At worlds 1 and 3, and at 3 ranks as 3 pipeline stages (`--pp 3`: the batch's tokens drawn
/// on the last stage and handed to the first, which answers HTTP).
#[test]
fn greedy_ids_equal_generate_alone_at_worlds_1_and_3() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (cases, expected) = safetensors_references();
    for (nproc, pp) in [(1, "1"), (3, "1"), (3, "3")] {
        let server = Server::start(nproc, &["--max-batch", "16", "--pp", pp]);
        concurrent_greedy_matches_alone(server.port, cases, expected);
        drop(server);
    }
}

/// The Q4_1 GGUF file through the server at 2 ranks against examples/generate on the same file
/// at 2 ranks (the quantized kernels round each matmul input to 8 bits, so the reference is
/// taken at the same world size; see docs/PERFORMANCE.md on quantized agreement).
#[test]
fn gguf_greedy_ids_equal_generate_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gguf = model_dir().with_file_name("smollm2-135m-instruct.Q4_1.gguf");
    assert!(
        gguf.is_file(),
        "{} is missing: run scripts/fetch-models.sh",
        gguf.display()
    );
    let cases = greedy_cases(8);
    let expected = references(&cases, &gguf, 2);
    let server = Server::start_model(2, &gguf, &["--max-batch", "8"]);
    concurrent_greedy_matches_alone(server.port, &cases, &expected);
    drop(server);
}

#[test]
fn sigterm_ends_requests_and_ranks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = common::ours_in_dev_shm();
    let mut server = Server::start(2, &[]);
    let port = server.port;
    let client = std::thread::spawn(move || {
        let body = json!({"prompt": PROMPTS[1], "max_tokens": 1500, "stream": true});
        http(port, "POST", "/v1/completions", &body.to_string())
    });
    let t0 = Instant::now();
    while health(port)["active"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the request never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: signalling our own child (tprun forwards it to the ranks).
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the job did not end within 10 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let (code, body) = client.join().expect("client");
    assert_eq!(code, 200);
    let data = sse_data(&body);
    assert!(
        data.iter().any(|d| d.contains("shutting down")),
        "the in-flight stream did not end with an error: {body:.400}"
    );
    // tprun exits 128 + 15 when it was itself stopped by SIGTERM (after its ranks ended).
    assert!(
        status.success() || status.code() == Some(143),
        "tprun: {status}"
    );
    let leaked: Vec<_> = common::ours_in_dev_shm()
        .into_iter()
        .filter(|n| !before.contains(n))
        .collect();
    assert!(leaked.is_empty(), "left in /dev/shm: {leaked:?}");
}

/// `--kv-cache-dtype f16` (issue 47, item 8): a server keeping its KV cache in f16 answers
/// concurrent greedy requests (batched) with the tokens each gets alone on the same server;
/// a value it does not know stops it with the choices named.
#[test]
fn an_f16_kv_cache_serves_batched_as_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(2, &["--max-batch", "4", "--kv-cache-dtype", "f16"]);
    let port = server.port;
    let request =
        |p: &str| json!({"prompt": p, "max_tokens": 12, "min_tokens": 12, "temperature": 0});
    let text = |v: &Value| {
        v["choices"][0]["text"]
            .as_str()
            .expect("a text")
            .to_string()
    };
    let alone: Vec<String> = PROMPTS[..4]
        .iter()
        .map(|p| {
            let (status, v) = post(port, "/v1/completions", &request(p));
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
            text(&v)
        })
        .collect();
    let together: Vec<String> = PROMPTS[..4]
        .iter()
        .map(|p| {
            let body = request(p);
            std::thread::spawn(move || post(port, "/v1/completions", &body))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| {
            let (status, v) = t.join().expect("client");
            assert_eq!(status, 200, "{v}");
            text(&v)
        })
        .collect();
    assert_eq!(together, alone, "batched against alone, f16 cache");
    drop(server);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_candle-tp-serve"))
        .args(["--kv-cache-dtype", "fp8"])
        .output()
        .expect("run candle-tp-serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("auto, f32, f16 or bf16"),
        "{err}"
    );
}
