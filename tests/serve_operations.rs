//! `candle-tp-serve`'s operational side over real HTTP: `/metrics` parsed by Python's
//! `prometheus_client` around known requests, the API key (`--api-key`, and
//! `CANDLE_TP_API_KEY` from the environment), `/v1/models/{id}`, `/tokenize` and
//! `/detokenize` (checked against the `tokenizers` crate's own encoding). Needs `--features
//! server`, `scripts/fetch-models.sh`, and Python 3 with network access to PyPI the first
//! time (the parser is installed into `$CANDLE_TP_HOME/venv-openai`, as
//! scripts/test-openai.sh does).
#![cfg(feature = "server")]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

mod common;

use common::serve::{
    call_with_key as call, chat, http_with, model_dir, post_with_key as post, Server, KEY, SERIAL,
};

/// The venv's Python with `prometheus_client` (installed on first use).
fn prometheus_python() -> PathBuf {
    let home = candle_tp::models::models_dir()
        .expect("models dir")
        .parent()
        .expect("CANDLE_TP_HOME")
        .to_path_buf();
    let venv = home.join("venv-openai");
    let python = venv.join("bin/python");
    let ok = |py: &PathBuf| {
        Command::new(py)
            .args(["-c", "import prometheus_client"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ok(&python) {
        if !python.exists() {
            let s = Command::new("python3")
                .arg("-m")
                .arg("venv")
                .arg(&venv)
                .status();
            assert!(s.is_ok_and(|s| s.success()), "creating {}", venv.display());
        }
        let s = Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "prometheus_client>=0.20,<1"])
            .status();
        assert!(
            s.is_ok_and(|s| s.success()),
            "pip install prometheus_client"
        );
    }
    python
}

/// Samples of `/metrics` by name: `[(labels, value)]`.
type Samples = HashMap<String, Vec<(HashMap<String, String>, f64)>>;

/// `/metrics` parsed by prometheus_client: `{sample name: [(labels, value)]}`.
fn scrape(port: u16) -> Samples {
    // /metrics is open: no key.
    let (status, text) = http_with(port, "GET", "/metrics", "", &[]);
    assert_eq!(status, 200, "{text}");
    let script = "import json, sys\nfrom prometheus_client.parser import text_string_to_metric_families\nout = {}\nfor fam in text_string_to_metric_families(sys.stdin.read()):\n    for s in fam.samples:\n        out.setdefault(s.name, []).append([s.labels, s.value])\nprint(json.dumps(out))\n";
    let mut child = Command::new(prometheus_python())
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().expect("python");
    assert!(out.status.success(), "the parser refused:\n{text}");
    serde_json::from_slice(&out.stdout).expect("parser output")
}

fn value(m: &Samples, name: &str, label: Option<(&str, &str)>) -> f64 {
    let samples = m.get(name).unwrap_or_else(|| panic!("no {name} in {m:?}"));
    samples
        .iter()
        .find(|(l, _)| {
            l.get("model_name").map(String::as_str) == Some("smollm2-135m-instruct")
                && label.is_none_or(|(k, v)| l.get(k).map(String::as_str) == Some(v))
        })
        .unwrap_or_else(|| panic!("{name} {label:?}: {samples:?}"))
        .1
}

/// Counters and histograms move by what three known requests did.
fn metrics(port: u16) {
    let before = scrape(port);
    let mut prompt = 0.0;
    let mut generated = 0.0;
    for n in [3, 5, 7] {
        let (status, v) = post(
            port,
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": n, "min_tokens": n, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        prompt += v["usage"]["prompt_tokens"].as_f64().unwrap();
        generated += v["usage"]["completion_tokens"].as_f64().unwrap();
    }
    assert_eq!(generated, 15.0);
    let after = scrape(port);
    let delta = |name: &str, label| value(&after, name, label) - value(&before, name, label);
    assert_eq!(delta("candle_tp:prompt_tokens_total", None), prompt);
    assert_eq!(delta("candle_tp:generation_tokens_total", None), generated);
    assert_eq!(
        delta(
            "candle_tp:request_success_total",
            Some(("finished_reason", "length"))
        ),
        3.0
    );
    assert_eq!(
        delta("candle_tp:time_to_first_token_seconds_count", None),
        3.0
    );
    assert_eq!(
        delta("candle_tp:time_per_output_token_seconds_count", None),
        12.0
    );
    assert_eq!(
        delta("candle_tp:e2e_request_latency_seconds_count", None),
        3.0
    );
    assert_eq!(
        value(
            &after,
            "candle_tp:time_to_first_token_seconds_bucket",
            Some(("le", "+Inf"))
        ),
        value(&after, "candle_tp:time_to_first_token_seconds_count", None)
    );
    assert!(delta("candle_tp:e2e_request_latency_seconds_sum", None) > 0.0);
    assert_eq!(value(&after, "candle_tp:num_requests_running", None), 0.0);
    assert_eq!(value(&after, "candle_tp:num_requests_waiting", None), 0.0);
    let kv = value(&after, "candle_tp:kv_cache_usage_perc", None);
    assert!((0.0..=1.0).contains(&kv), "{kv}");
    // Communication: each of the 12 decode steps all-reduces SmolLM2's hidden state (576 f32)
    // twice per layer (30 layers) at least; on one host nothing reaches the network.
    let payload = delta("candle_tp:comm_payload_bytes_total", None);
    let at_least = 12.0 * 2.0 * 30.0 * 576.0 * 4.0;
    assert!(payload >= at_least, "{payload} bytes < {at_least}");
    assert_eq!(delta("candle_tp:comm_cross_host_bytes_total", None), 0.0);
}

/// 401 without the key or with a wrong one; `/health` and `/metrics` stay open.
fn api_key(port: u16) {
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    for headers in [
        vec![],
        vec![("Authorization", "Bearer wrong")],
        vec![("Authorization", KEY)],
    ] {
        for (method, path) in [
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("POST", "/tokenize"),
        ] {
            let (status, text) = http_with(port, method, path, &body, &headers);
            assert_eq!(status, 401, "{path} {headers:?}: {text}");
            let v: Value = serde_json::from_str(&text).expect("JSON");
            assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        }
    }
    assert_eq!(http_with(port, "GET", "/health", "", &[]).0, 200);
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{v}");
}

/// `/v1/models/{id}`; `/tokenize` as the tokenizers crate encodes; `/detokenize` back.
fn models_and_tokens(port: u16) {
    let (status, v) = call(
        port,
        "GET",
        "/v1/models/smollm2-135m-instruct",
        &Value::Null,
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["id"], "smollm2-135m-instruct", "{v}");
    let (status, v) = call(port, "GET", "/v1/models/gpt-4", &Value::Null);
    assert_eq!(
        (status, v["error"]["code"].clone()),
        (404, json!("model_not_found")),
        "{v}"
    );

    let tok =
        tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json")).expect("tokenizer");
    let text = "Tensor parallelism splits a model, café.";
    let want: Vec<u32> = tok.encode(text, true).unwrap().get_ids().to_vec();
    let (status, v) = post(
        port,
        "/tokenize",
        &json!({"prompt": text, "return_token_strs": true}),
    );
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, want, "{v}");
    assert_eq!(v["count"], want.len(), "{v}");
    assert_eq!(
        v["token_strs"].as_array().map(Vec::len),
        Some(want.len()),
        "{v}"
    );
    let (status, v) = post(port, "/detokenize", &json!({"tokens": ids}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["prompt"], tok.decode(&want, false).unwrap(), "{v}");
    // The chat's prompt tokens are what /tokenize counts for the same messages.
    let msgs = chat("What is 2 + 2?");
    let (_, v) = post(port, "/tokenize", &json!({"messages": msgs}));
    let (status, c) = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(v["count"], c["usage"]["prompt_tokens"], "{v} {c}");
    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [1, -2]}), "tokens"),
        ("/detokenize", json!({"tokens": "1 2"}), "tokens"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": msgs}),
            "prompt",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "truncate": 3}),
            "truncate",
        ),
    ] {
        let (status, v) = post(port, path, &body);
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
    }
}

/// `CANDLE_TP_API_KEY` in the environment is the key when `--api-key` is not given; a model
/// name with slashes (a Hugging Face id) is found by `/v1/models/{id}`; an unknown path is a
/// 404 with or without the key (the key guards the endpoints, not their absence).
#[test]
fn the_api_key_from_the_environment() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = "HuggingFaceTB/SmolLM2-135M-Instruct";
    let server = Server::start_env(
        1,
        &["--model-name", name],
        &[("CANDLE_TP_API_KEY", "env-key-5")],
    );
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    let (status, text) = http_with(server.port, "POST", "/v1/completions", &body, &[]);
    assert_eq!(status, 401, "{text}");
    let auth = [("Authorization", "Bearer env-key-5")];
    let (status, text) = http_with(server.port, "POST", "/v1/completions", &body, &auth);
    assert_eq!(status, 200, "{text}");
    // The scheme's name is case-insensitive (RFC 9110), as clients spell it differently.
    for scheme in ["bearer", "BEARER"] {
        let value = format!("{scheme} env-key-5");
        let lower = [("Authorization", value.as_str())];
        let (status, text) = http_with(server.port, "POST", "/v1/completions", &body, &lower);
        assert_eq!(status, 200, "{scheme}: {text}");
    }
    let (status, text) = http_with(server.port, "GET", &format!("/v1/models/{name}"), "", &auth);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["id"], name, "{v}");
    let (status, text) = http_with(
        server.port,
        "GET",
        "/v1/models/HuggingFaceTB/other",
        "",
        &auth,
    );
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("model_not_found"), "{text}");
    for headers in [&auth[..], &[]] {
        let (status, text) = http_with(server.port, "GET", "/v1/no-such-endpoint", "", headers);
        assert_eq!(status, 404, "{headers:?}: {text}");
        let (status, text) = http_with(server.port, "POST", "/v2/chat", "{}", headers);
        assert_eq!(status, 404, "{headers:?}: {text}");
    }
}

/// An API key that is set but empty (`--api-key ""`, or `CANDLE_TP_API_KEY=`) would let every
/// client in: the server refuses to start, naming where the key came from, before it loads
/// the model.
#[test]
fn an_empty_api_key_is_an_error() {
    let serve = env!("CARGO_BIN_EXE_candle-tp-serve");
    let model = model_dir();
    let model = model.to_str().expect("utf-8 path");
    for (args, env, names) in [
        (vec!["--api-key", ""], None, "--api-key"),
        (vec!["--api-key", "  "], None, "--api-key"),
        (vec![], Some(""), "CANDLE_TP_API_KEY"),
    ] {
        let mut cmd = std::process::Command::new(serve);
        cmd.args(["--model", model, "--port", "0"]).args(&args);
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            cmd.env_remove(v);
        }
        match env {
            Some(v) => cmd.env("CANDLE_TP_API_KEY", v),
            None => cmd.env_remove("CANDLE_TP_API_KEY"),
        };
        let out = cmd
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run candle-tp-serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} {env:?} started: {err}");
        assert!(
            err.contains(names) && err.contains("empty"),
            "{args:?} {env:?}: {err}"
        );
    }
}

#[test]
fn metrics_keys_models_and_tokens() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(2, &["--api-key", KEY, "--max-seq-len", "256"]);
    let port = server.port;
    let checks: &[(&str, &dyn Fn())] = &[
        ("metrics", &|| metrics(port)),
        ("api_key", &|| api_key(port)),
        ("models_and_tokens", &|| models_and_tokens(port)),
    ];
    let failed = common::serve::failed_checks(checks);
    drop(server);
    assert!(failed.is_empty(), "failed: {failed:?}");
}
