//! `POST /v1/embeddings` of `candle-tp-serve` started on the all-MiniLM-L6-v2 checkpoint at 2
//! ranks, over real HTTP: the embeddings equal the library's `BertModel::embed` computed here
//! in-process at world 1 from the `tokenizers` crate's ids (within 1e-5: two ranks sum in
//! another order), for a batch of texts, one text alone, token-id inputs and base64 (the same
//! bits as the floats); bad inputs are 400s naming the field; the completions endpoints answer
//! 400 on an embedding model, and `/v1/embeddings` answers 400 on a text-generation model.
//! The embedding server's router, as the generative one's: a model name with slashes is found by
//! `/v1/models/{id}`, and a path the server does not have is a 404 with or without the key.
//! Needs `--features server` and `scripts/fetch-models.sh`.
#![cfg(feature = "server")]

use std::path::PathBuf;

use candle_core::{DType, Device};
use candle_tp::models::bert::BertModel;
use candle_tp::models::FromCheckpoint;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

mod common;

use common::serve::{http_with, post, Server, SERIAL};

const TEXTS: [&str; 3] = [
    "The cat sits on the mat.",
    "Sharded inference splits the twelve attention heads across processes.",
    "Héllo, wörld!",
];

fn minilm_dir() -> PathBuf {
    let dir = candle_tp::models::models_dir()
        .expect("models directory")
        .join("all-minilm-l6-v2");
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} is missing: run scripts/fetch-models.sh",
        dir.display()
    );
    dir
}

/// The reference: the `tokenizers` crate's ids (special tokens added, no padding or
/// truncation) and the library's `embed` at world 1, normalised (the checkpoint's modules.json
/// ends with `Normalize`).
fn reference(dir: &std::path::Path) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut tok = Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer");
    tok.with_padding(None);
    tok.with_truncation(None).unwrap();
    let ids: Vec<Vec<u32>> = TEXTS
        .iter()
        .map(|t| tok.encode(*t, true).unwrap().get_ids().to_vec())
        .collect();
    let model = BertModel::from_dir(
        dir,
        DType::F32,
        &Device::Cpu,
        candle_tp::ProcessGroup::single(),
    )
    .expect("load MiniLM");
    let want = model.embed(&ids, true).unwrap().to_vec2::<f32>().unwrap();
    for (t, v) in TEXTS.iter().zip(&want) {
        assert!(v.iter().all(|x| x.is_finite()), "{t}: non-finite reference");
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{t}: reference norm {norm}");
    }
    (ids, want)
}

/// The embeddings of an answer, checked finite and indexed in order.
fn vectors(v: &Value) -> Vec<Vec<f32>> {
    let data = v["data"]
        .as_array()
        .unwrap_or_else(|| panic!("no data: {v}"));
    data.iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i, "{d}");
            assert_eq!(d["object"], "embedding", "{d}");
            let e: Vec<f32> = d["embedding"]
                .as_array()
                .unwrap_or_else(|| panic!("embedding {i} is not an array"))
                .iter()
                .map(|x| x.as_f64().expect("a number") as f32)
                .collect();
            assert!(e.iter().all(|x| x.is_finite()), "embedding {i}: non-finite");
            e
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Standard base64 decoding (the test's own, not the server's encoder).
fn unbase64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a') as u32 + 26,
            b'0'..=b'9' => (c - b'0') as u32 + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (k, &c) in chunk.iter().enumerate() {
            n |= val(c) << (18 - 6 * k);
        }
        for k in 0..chunk.len() - 1 {
            out.push((n >> (16 - 8 * k)) as u8);
        }
    }
    out
}

#[test]
fn embeddings_equal_the_library() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = minilm_dir();
    let (ids, want) = reference(&dir);
    assert!(
        max_diff(&want[0], &want[1]) > 0.05,
        "the reference texts must differ"
    );
    let server = Server::start_model(2, &dir, &[]);
    let port = server.port;

    // A batch of texts.
    let (status, v) = post(
        port,
        "/v1/embeddings",
        &json!({"input": TEXTS, "model": "all-minilm-l6-v2", "encoding_format": "float"}),
    );
    assert_eq!(status, 200, "{v}");
    let got = vectors(&v);
    assert_eq!(got.len(), 3);
    for ((t, g), w) in TEXTS.iter().zip(&got).zip(&want) {
        assert_eq!(g.len(), 384, "{t}");
        let d = max_diff(g, w);
        assert!(
            d <= 1e-5,
            "{t}: the server's embedding differs from embed's by {d}"
        );
    }
    let tokens: usize = ids.iter().map(Vec::len).sum();
    assert_eq!(v["usage"]["prompt_tokens"], tokens, "{v}");
    assert_eq!(v["usage"]["total_tokens"], tokens, "{v}");
    assert_eq!(v["model"], "all-minilm-l6-v2");

    // One text alone (no padding beside it), and token ids: the same embeddings.
    let (status, v) = post(port, "/v1/embeddings", &json!({"input": TEXTS[1]}));
    assert_eq!(status, 200, "{v}");
    let alone = vectors(&v);
    assert!(max_diff(&alone[0], &want[1]) <= 1e-5);
    let (status, v) = post(port, "/v1/embeddings", &json!({"input": ids}));
    assert_eq!(status, 200, "{v}");
    for (g, w) in vectors(&v).iter().zip(&got) {
        assert_eq!(g, w, "token-id inputs give the texts' embeddings");
    }

    // base64: the little-endian f32 bytes of the same floats.
    let (status, v) = post(
        port,
        "/v1/embeddings",
        &json!({"input": TEXTS, "encoding_format": "base64"}),
    );
    assert_eq!(status, 200, "{v}");
    for (i, g) in got.iter().enumerate() {
        let b64 = v["data"][i]["embedding"].as_str().expect("a base64 string");
        let floats: Vec<f32> = unbase64(b64)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(&floats, g, "base64 embedding {i}");
    }

    // Refusals.
    let long = "word ".repeat(300);
    for (body, param, code) in [
        (
            json!({"input": long}),
            "input",
            Some("context_length_exceeded"),
        ),
        (json!({"input": ""}), "input", None),
        (json!({"input": [[1, 2], [999_999]]}), "input", None),
        (
            json!({"input": "a", "dimensions": 64}),
            "dimensions",
            Some("unsupported_parameter"),
        ),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
            None,
        ),
        (
            json!({"input": "a", "truncate_prompt_tokens": 8}),
            "truncate_prompt_tokens",
            Some("unknown_parameter"),
        ),
    ] {
        let (status, v) = post(port, "/v1/embeddings", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        if let Some(code) = code {
            assert_eq!(v["error"]["code"], code, "{body}: {v}");
        }
    }
    let (status, v) = post(
        port,
        "/v1/embeddings",
        &json!({"input": "a", "model": "gpt-4"}),
    );
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    let (status, v) = post(port, "/v1/completions", &json!({"prompt": "a"}));
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (400, Some("model_not_supported")),
        "{v}"
    );
    drop(server);

    // A text-generation server refuses embeddings with a 400 saying why.
    let server = Server::start(1, &["--max-seq-len", "64"]);
    let (status, v) = post(server.port, "/v1/embeddings", &json!({"input": "a"}));
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (400, Some("model_not_supported")),
        "{v}"
    );
}

/// With `--api-key` and a Hugging Face id as `--model-name`: the key guards the endpoints
/// (401 without it), `/v1/models/{id}` finds the id with its slash, another id is a 404
/// `model_not_found`, and a path the server does not have is a 404 with or without the key
/// (the key guards the endpoints, not their absence), and a wrong method is a 405.
#[test]
fn embedding_router_keys_slashes_and_unknown_paths() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = "sentence-transformers/all-MiniLM-L6-v2";
    let key = "emb-key-3";
    let server = Server::start_model(1, &minilm_dir(), &["--api-key", key, "--model-name", name]);
    let port = server.port;
    let auth = format!("Bearer {key}");
    let auth = [("Authorization", auth.as_str())];
    let body = json!({"input": "a", "model": name}).to_string();

    let (status, text) = http_with(port, "POST", "/v1/embeddings", &body, &[]);
    assert_eq!(status, 401, "without the key: {text}");
    let (status, text) = http_with(port, "POST", "/v1/embeddings", &body, &auth);
    assert_eq!(status, 200, "with the key and the model's id: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], name, "{v}");

    let (status, text) = http_with(port, "GET", &format!("/v1/models/{name}"), "", &auth);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["id"], name, "{v}");
    let (status, text) = http_with(
        port,
        "GET",
        "/v1/models/sentence-transformers/other",
        "",
        &auth,
    );
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("model_not_found"), "{text}");

    for headers in [&auth[..], &[]] {
        let (status, text) = http_with(port, "GET", "/v1/no-such-endpoint", "", headers);
        assert_eq!(status, 404, "{headers:?}: {text}");
        assert!(text.contains("not_found"), "{headers:?}: {text}");
        let (status, text) = http_with(port, "POST", "/v2/embeddings", "{}", headers);
        assert_eq!(status, 404, "{headers:?}: {text}");
    }
    let (status, text) = http_with(port, "GET", "/v1/embeddings", "", &auth);
    assert_eq!(status, 405, "{text}");
    assert!(text.contains("method_not_allowed"), "{text}");
}

/// The value of the one sample of `metric` (with any labels after it, `extra` among them) in
/// a Prometheus text page.
fn sample(page: &str, metric: &str, extra: &str) -> f64 {
    let found: Vec<f64> = page
        .lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) && l.contains(extra))
        .map(|l| l.rsplit(' ').next().unwrap().parse().expect("a number"))
        .collect();
    assert_eq!(found.len(), 1, "{metric} {extra} in:\n{page}");
    found[0]
}

/// `GET /metrics` of the embedding server counts what its clients saw: the requests answered,
/// their inputs' tokens (the responses' `usage`), a body over `--max-body-bytes` as
/// `requests_rejected_total{reason="request_too_large"}`, and nothing running afterwards;
/// open without the key, as the text server's.
#[test]
fn embedding_metrics_count_what_the_clients_saw() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let key = "emb-metrics";
    let server = Server::start_model(
        2,
        &minilm_dir(),
        &["--api-key", key, "--max-body-bytes", "4000"],
    );
    let port = server.port;
    let auth = format!("Bearer {key}");
    let auth = [("Authorization", auth.as_str())];
    let mut tokens = 0;
    for input in [
        json!("one short text"),
        json!(TEXTS),
        json!([[101, 2023, 102]]),
    ] {
        let body = json!({ "input": input }).to_string();
        let (status, text) = http_with(port, "POST", "/v1/embeddings", &body, &auth);
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        tokens += v["usage"]["prompt_tokens"].as_u64().expect("usage");
    }
    let big = json!({ "input": "word ".repeat(1000) }).to_string();
    let (status, text) = http_with(port, "POST", "/v1/embeddings", &big, &auth);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("request_too_large"), "{text}");

    let (status, page) = http_with(port, "GET", "/metrics", "", &[]);
    assert_eq!(status, 200, "{page}");
    let name = "model_name=\"all-minilm-l6-v2\"";
    assert_eq!(sample(&page, "candle_tp:request_success_total", name), 3.0);
    assert_eq!(
        sample(&page, "candle_tp:prompt_tokens_total", name),
        tokens as f64
    );
    assert!(tokens > 3, "the texts have tokens: {tokens}");
    assert_eq!(
        sample(
            &page,
            "candle_tp:requests_rejected_total",
            "reason=\"request_too_large\""
        ),
        1.0
    );
    assert_eq!(
        sample(
            &page,
            "candle_tp:requests_rejected_total",
            "reason=\"queue_full\""
        ),
        0.0
    );
    assert_eq!(sample(&page, "candle_tp:num_requests_running", name), 0.0);
    assert_eq!(sample(&page, "candle_tp:num_requests_waiting", name), 0.0);
}
