//! `candle-tp-serve` against requests and signals that once stopped or misled it. Needs
//! `--features server` and `scripts/fetch-models.sh`.
//!
//! - A prompt token id beyond the model's vocabulary (an added token of the tokenizer) is
//!   refused with a 400 while the requests around it go on; the scheduler itself ends a
//!   request the model cannot run (an id outside the vocabulary, a prompt longer than the
//!   model's context) without stopping.
//! - SIGTERM to a rank other than 0 alone ends that rank within seconds.
//! - OpenAI's defaults:
//!   the model's name is its directory's whole name;
//!   `/v1/completions` without `max_tokens` gives 16 tokens;
//!   completion ids differ for equal seeds;
//!   an assistant message may have `content: null`.
//! - Bounds (issue 24 defect 4): a body over `--max-body-bytes` and a stop string over 256
//!   bytes are 400s naming the limit and the size; a large prompt is tokenized off the async
//!   threads (the server answers `/health` while it works).
#![cfg(feature = "server")]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use candle_tp::generate::{BatchDecoder, FinishReason, SamplingParams, SeqRequest, TokenFilter};
use candle_tp::models::CausalLm;
use candle_tp::serve::{self, Submission};
use serde_json::{json, Value};

mod common;

use common::serve::{
    alone, collect, http, is_running, made_up_words, model_dir, post, wait_active, Server, SERIAL,
};

/// A prompt id beyond SmolLM2's vocabulary of 49152 (and different from it, so that a
/// message naming both can be told apart).
const OOV_ID: u32 = 50_000;

/// The checkpoint's `vocab_size`, read from its config.json (not from the code under test).
fn vocab_size(dir: &Path) -> u64 {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let v: Value = serde_json::from_str(&text).expect("config JSON");
    v["vocab_size"].as_u64().expect("vocab_size")
}

/// A rewrite of one JSON file of a model directory: its name and what changes.
type Patch<'a> = (&'a str, &'a dyn Fn(&mut Value));

/// A copy of SmolLM2's directory in `root/name`: every file linked, except those `patch`
/// rewrites.
fn patched_model(root: &Path, name: &str, patch: &[Patch<'_>]) -> PathBuf {
    let src = model_dir();
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("model copy");
    for entry in std::fs::read_dir(&src).expect("model dir").flatten() {
        let file = entry.file_name();
        let target = dir.join(&file);
        match patch.iter().find(|(n, _)| file.to_str() == Some(n)) {
            Some((_, f)) => {
                let text = std::fs::read_to_string(entry.path()).expect("read");
                let mut v: Value = serde_json::from_str(&text).expect("JSON");
                f(&mut v);
                std::fs::write(&target, v.to_string()).expect("write");
            }
            None => std::os::unix::fs::symlink(entry.path(), &target).expect("symlink"),
        }
    }
    dir
}

/// Adds eight tokens to a tokenizer.json, the last `<|oov|>`: the tokenizer numbers them
/// after its vocabulary, so they are ids the model has no embedding for.
fn add_oov_tokens(tok: &mut Value) {
    let added = tok["added_tokens"].as_array_mut().expect("added_tokens");
    for i in 0..8 {
        let content = if i == 7 {
            "<|oov|>".to_string()
        } else {
            format!("<|extra_{i}|>")
        };
        added.push(
            json!({"id": 60_000 + i, "content": content, "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": false,
                          "special": false}),
        );
    }
}

/// `examples/generate`'s greedy ids for `prompt` alone (world 1).
fn generate_alone(prompt: &str, max_new: usize) -> Vec<u32> {
    let args = [
        "--model".to_string(),
        model_dir().display().to_string(),
        "--prompt".into(),
        prompt.into(),
        "--max-new-tokens".into(),
        max_new.to_string(),
    ];
    let v = common::run_generate(1, &args);
    serde_json::from_value(v["token_ids"].clone()).expect("token_ids")
}

fn greedy(port: u16, prompt: &str, max_tokens: usize) -> (u16, Value) {
    post(
        port,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": true}),
    )
}

fn ids_of(v: &Value) -> Vec<u32> {
    serde_json::from_value(v["choices"][0]["token_ids"].clone())
        .unwrap_or_else(|e| panic!("token_ids: {e}: {v}"))
}

/// A prompt with an id beyond the vocabulary (an added token of the tokenizer) is a 400 naming
/// the id and the vocabulary size; the request decoding at the same time and the next one are
/// answered as if it had never come (their ids are those of examples/generate alone).
#[test]
fn out_of_vocabulary_prompt_id_ends_only_its_request() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let root = tempfile::tempdir().expect("tempdir");
    let dir = patched_model(
        root.path(),
        "smollm2-oov",
        &[("tokenizer.json", &add_oov_tokens)],
    );
    let vocab = vocab_size(&dir);
    // The id the tokenizer gives `<|oov|>` (the tokenizers library's, not the server's
    // answer): beyond the vocabulary, else this test could not fail.
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer");
    let oov = tok
        .token_to_id("<|oov|>")
        .expect("<|oov|> in the tokenizer");
    assert!(
        u64::from(oov) > vocab,
        "<|oov|> is id {oov}, the vocabulary {vocab}"
    );
    let enc = tok.encode("Say <|oov|> now", false).expect("encode");
    assert!(enc.get_ids().contains(&oov), "{:?}", enc.get_ids());

    let (first, second) = ("The quick brown fox", "The capital of France is");
    let (expect_first, expect_second) = (generate_alone(first, 40), generate_alone(second, 12));
    let server = Server::start_model(2, &dir, &["--max-batch", "4"]);
    let port = server.port;
    let running = std::thread::spawn(move || greedy(port, first, 40));
    wait_active(port, 1, Duration::from_secs(60));
    let bad = [
        (
            "/v1/completions",
            json!({"prompt": "Say <|oov|> now", "max_tokens": 4}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Say <|oov|> now"}], "max_tokens": 4}),
            "messages",
        ),
    ];
    for (path, body, param) in bad {
        let (status, v) = post(port, path, &body);
        assert_eq!(status, 400, "{path}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let msg = v["error"]["message"].as_str().expect("message");
        assert!(
            msg.contains(&oov.to_string()) && msg.contains(&vocab.to_string()),
            "the message does not name the id {oov} and the vocabulary of {vocab}: {msg}"
        );
    }
    let (status, v) = running.join().expect("client");
    assert_eq!(status, 200, "the request in flight: {v}");
    assert_eq!(ids_of(&v), expect_first, "the request in flight: {v}");
    let (status, v) = greedy(port, second, 12);
    assert_eq!(status, 200, "the request after: {v}");
    assert_eq!(ids_of(&v), expect_second, "the request after: {v}");
    drop(server);
}

/// A grammar that allows every id for `left` draws, then fails (or, with `empty`, allows no
/// id).
#[derive(Debug)]
struct FailingGrammar {
    left: usize,
    empty: bool,
}

impl TokenFilter for FailingGrammar {
    fn allowed(&mut self, bits: &mut [u32]) -> candle_core::Result<()> {
        if self.left == 0 {
            if self.empty {
                return Ok(());
            }
            candle_core::bail!("the test grammar gives up");
        }
        self.left -= 1;
        bits.fill(u32::MAX);
        Ok(())
    }

    fn commit(&mut self, _token: u32) -> candle_core::Result<()> {
        Ok(())
    }
}

/// The scheduler (world 1, in this process) on a model of 32 positions behind a decoder of
/// 2048: a prompt id outside the vocabulary and a prompt of 40 tokens end with an error each,
/// and so do a request whose grammar fails after two tokens and one whose grammar allows no
/// token; the request submitted with them runs to the model's last position (then ends as
/// `length`, with the ids the model gives it alone), and the loop goes on until shut down.
#[test]
fn scheduler_ends_only_the_request_the_model_cannot_run() {
    const MAX_POS: usize = 32;
    candle_tp::set_batch_invariant_matmul(true);
    let root = tempfile::tempdir().expect("tempdir");
    let set_context = |c: &mut Value| c["max_position_embeddings"] = json!(MAX_POS);
    let dir = patched_model(root.path(), "short", &[("config.json", &set_context)]);
    let vocab = vocab_size(&dir);
    let mut model = CausalLm::from_path(
        &dir,
        DType::F32,
        &Device::Cpu,
        candle_tp::ProcessGroup::single(),
    )
    .expect("model");
    let good: Vec<u32> = vec![504, 3575, 282, 4649, 314];
    // Positions 0..MAX_POS: the prompt, then one fed token per generated one but the last.
    let expected = alone(&mut model, &good, MAX_POS - good.len() + 1);
    let mut dec = BatchDecoder::new(4, 2048, 16).expect("decoder");
    let (queue, inbox) = serve::queue(8);
    let submit = |prompt: Vec<u32>, filter: Option<Box<dyn TokenFilter>>| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        queue
            .submit(Submission {
                seq: SeqRequest {
                    id: 0,
                    prompt,
                    max_tokens: 100,
                    min_tokens: 0,
                    params: SamplingParams::greedy(),
                    stop_ids: Vec::new(),
                    options: Default::default(),
                },
                filter,
                events: tx,
            })
            .expect("queued");
        rx
    };
    let bad_id = submit(vec![1, OOV_ID, 2], None);
    let ok = submit(good.clone(), None);
    let too_long = submit(vec![504; 40], None);
    let gives_up = submit(
        good.clone(),
        Some(Box::new(FailingGrammar {
            left: 2,
            empty: false,
        })),
    );
    let allows_none = submit(
        good.clone(),
        Some(Box::new(FailingGrammar {
            left: 0,
            empty: true,
        })),
    );
    let client = {
        let queue = queue.clone();
        std::thread::spawn(move || {
            let got = (collect(bad_id), collect(ok), collect(too_long));
            let grammars = (collect(gives_up), collect(allows_none));
            queue.shutdown();
            (got, grammars)
        })
    };
    serve::run_leader(&mut model, &mut dec, inbox, Duration::from_millis(200))
        .expect("the loop ends by the shutdown, not by a failed step");
    let ((bad_id, ok, too_long), (gives_up, allows_none)) = client.join().expect("client");
    assert_eq!(
        gives_up.0,
        expected[..2],
        "two tokens before the grammar failed"
    );
    let msg = gives_up.1.expect_err("a failed grammar");
    assert!(msg.contains("the test grammar gives up"), "{msg}");
    assert!(allows_none.0.is_empty(), "{:?}", allows_none.0);
    let msg = allows_none.1.expect_err("a grammar that allows nothing");
    assert!(msg.contains("allows no token"), "{msg}");
    let msg = bad_id.1.expect_err("an id outside the vocabulary");
    assert!(
        msg.contains(&OOV_ID.to_string()) && msg.contains(&vocab.to_string()),
        "{msg}"
    );
    let msg = too_long
        .1
        .expect_err("a prompt longer than the model's context");
    assert!(
        msg.contains("40") && msg.contains(&MAX_POS.to_string()),
        "{msg}"
    );
    assert_eq!(ok.1, Ok(FinishReason::Length), "{:?}", ok.0);
    assert_eq!(ok.0, expected);
}

/// SIGTERM sent to rank 1 alone (not through tprun, so rank 0 never hears of it): rank 1 exits
/// within 5 s, and the job then ends (tprun tears it down when a rank is gone).
#[test]
fn sigterm_to_a_follower_rank_ends_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut server = Server::start(2, &[]);
    let pids = server.rank_pids();
    assert_eq!(pids.len(), 2, "the ranks of the job: {pids:?}");
    let follower = pids[&1];
    // SAFETY: signalling a process of this test's own job.
    unsafe { libc::kill(follower, libc::SIGTERM) };
    let t0 = Instant::now();
    while is_running(follower) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "rank 1 (pid {follower}) still runs 5 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "rank 1 exited {:.2} s after SIGTERM",
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    while server.child.try_wait().expect("tprun").is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the job still runs 20 s after rank 1 exited"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!is_running(pids[&0]), "rank 0 outlived the job");
}

/// The API name of a directory with dots in its name is that whole name.
fn name_keeps_dots(port: u16, name: &str) {
    let (status, text) = http(port, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["data"][0]["id"], name, "{v}");
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1, "model": name}),
    );
    assert_eq!(status, 200, "{v}");
}

/// `/v1/completions` without `max_tokens` stops at 16 tokens, or at `min_tokens` when that is
/// more. Counting never ends by itself within the server's 128 tokens: only the default can
/// stop it there.
fn completions_default_to_16_tokens(port: u16) {
    let counting = "1, 2, 3, 4, 5, 6,";
    for (body, n) in [
        (json!({"prompt": counting, "temperature": 0}), 16),
        (
            json!({"prompt": counting, "temperature": 0, "min_tokens": 20}),
            20,
        ),
    ] {
        let (status, v) = post(port, "/v1/completions", &body);
        assert_eq!(status, 200, "{body}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], n, "{body}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{body}: {v}");
    }
}

/// Two answers with the same seed, at the same time, have different ids.
fn ids_differ_for_equal_seeds(port: u16) {
    for (path, prefix, body) in [
        (
            "/v1/completions",
            "cmpl-",
            json!({"prompt": "Hello", "max_tokens": 2, "seed": 7}),
        ),
        (
            "/v1/chat/completions",
            "chatcmpl-",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 7}),
        ),
    ] {
        let clients: Vec<_> = (0..2)
            .map(|_| {
                let body = body.clone();
                std::thread::spawn(move || post(port, path, &body))
            })
            .collect();
        let answers: Vec<_> = clients
            .into_iter()
            .map(|h| h.join().expect("client"))
            .collect();
        for (status, v) in &answers {
            assert_eq!(*status, 200, "{v}");
            assert!(
                v["id"].as_str().is_some_and(|id| id.starts_with(prefix)),
                "{v}"
            );
        }
        let (a, b) = (&answers[0].1, &answers[1].1);
        assert_ne!(a["id"], b["id"], "two answers, one id: {a} {b}");
    }
}

/// An assistant message with `content: null` and `tool_calls` is accepted; a user message's
/// null content is still refused, naming the field.
fn assistant_content_may_be_null(port: u16) {
    let tool_call = json!([{"id": "call_1", "type": "function",
                            "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]);
    let (status, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"max_tokens": 4, "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": null, "tool_calls": tool_call},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            {"role": "user", "content": "So?"},
        ]}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    let (status, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"max_tokens": 4, "messages": [{"role": "user", "content": null}]}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages[0].content", "{v}");
}

/// A body above the limit (2 MiB by default) is refused from its `Content-Length`, before a
/// byte of it is read: 400 naming the limit and the size. A stop string above 256 bytes: 400
/// naming both.
fn bodies_and_stop_strings_are_bounded(port: u16) {
    let limit = 2 * 1024 * 1024;
    // The headers alone: the answer must not wait for the body.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        limit + 1
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let (status, text) = common::serve::parse_response(&raw);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status} {text}: {e}"));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&format!("has {} bytes", limit + 1))
            && msg.contains(&format!("at most {limit}")),
        "{msg}"
    );
    // Just below the limit: read and parsed (here a 400 for the unknown field, not the size).
    let pad = "x".repeat(limit - 100);
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "pad": pad}),
    );
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("pad")));
    let long = "ab".repeat(129);
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1, "stop": ["x", long]}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("stop")),
        "{v}"
    );
    assert_eq!(
        v["error"]["message"], "'stop' string 1 has 258 bytes, at most 256",
        "{v}"
    );
}

/// A prompt of ~1.5 MB takes the tokenizer a while; meanwhile the server (one async worker
/// thread) still answers `/health` at once: tokenizing runs on tokio's blocking threads.
fn tokenizing_leaves_the_server_responsive(port: u16) {
    // 1.5 MB (under the 2 MiB body limit) of distinct made-up words: the tokenizer's word cache
    // cannot shortcut them, so it stays at work long after the request arrived, on any host.
    let body = json!({"prompt": made_up_words(1_500_000)}).to_string();
    let worker = std::thread::spawn(move || {
        let (status, text) = http(port, "POST", "/tokenize", &body);
        (status, text.len())
    });
    std::thread::sleep(Duration::from_millis(100));
    // Health checks while the prompt is tokenized; one that ends after the tokenizer did is
    // not counted (it may have waited for nothing).
    let mut took = Vec::new();
    while !worker.is_finished() {
        let a = Instant::now();
        let _ = common::serve::health(port);
        let d = a.elapsed();
        if worker.is_finished() {
            break;
        }
        took.push(d);
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, len) = worker.join().unwrap();
    assert_eq!(status, 200, "{len} bytes");
    println!(
        "tokenizing 1.5 MB: {} health checks meanwhile, the slowest {:?}",
        took.len(),
        took.iter().max()
    );
    // The check means something only if the tokenizer was still at work during the checks.
    assert!(
        took.len() >= 2,
        "the prompt was tokenized after {} health check(s): make it longer",
        took.len()
    );
    assert!(
        took.iter().all(|d| *d < Duration::from_millis(500)),
        "health checks took {took:?} while the prompt was tokenized"
    );
}

/// OpenAI's defaults, on one server (each check runs even when another fails; the test fails
/// naming every check that did).
#[test]
fn openai_defaults() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let root = tempfile::tempdir().expect("tempdir");
    let name = "SmolLM2-0.135B";
    let link = root.path().join(name);
    std::os::unix::fs::symlink(model_dir(), &link).expect("symlink");
    let server = Server::start_model(2, &link, &["--max-seq-len", "128"]);
    let port = server.port;
    let checks: &[(&str, &dyn Fn())] = &[
        ("name_keeps_dots", &|| name_keeps_dots(port, name)),
        ("completions_default_to_16_tokens", &|| {
            completions_default_to_16_tokens(port)
        }),
        ("ids_differ_for_equal_seeds", &|| {
            ids_differ_for_equal_seeds(port)
        }),
        ("assistant_content_may_be_null", &|| {
            assistant_content_may_be_null(port)
        }),
        ("bodies_and_stop_strings_are_bounded", &|| {
            bodies_and_stop_strings_are_bounded(port)
        }),
        ("tokenizing_leaves_the_server_responsive", &|| {
            tokenizing_leaves_the_server_responsive(port)
        }),
    ];
    let failed = common::serve::failed_checks(checks);
    drop(server);
    assert!(failed.is_empty(), "failed: {failed:?}");
}
