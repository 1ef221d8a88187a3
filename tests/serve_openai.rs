//! `candle-tp-serve` (2 ranks, SmolLM2, `--api-key`) against OpenAI's generation fields, over
//! real HTTP: every refused field (and bad tools or response formats) is a 400 naming it (neutral values accepted, unknown fields
//! refused); log-probabilities in OpenAI's shapes, streamed too; penalties and `logit_bias`;
//! `n` over a batch of prompts, one of them as token ids. Needs `--features server` and
//! `scripts/fetch-models.sh`. The operational endpoints: tests/serve_operations.rs.
#![cfg(feature = "server")]

use serde_json::{json, Value};

mod common;

use common::serve::{chat, http_with, post_with_key as post, sse_data, Server, KEY, SERIAL};

/// Each refused field with a value that asks for something is a 400 naming it; the neutral
/// values and the fields without effect are accepted; unknown fields are refused.
fn refused_fields(port: u16) {
    let msgs = chat("Hi");
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "/v1/chat/completions",
            json!({"tools": [{"type": "retrieval"}]}),
            "tools[0].type",
        ),
        (
            "/v1/chat/completions",
            json!({"tool_choice": "required"}),
            "tool_choice",
        ),
        ("/v1/completions", json!({"tools": []}), "tools"),
        (
            "/v1/chat/completions",
            json!({"response_format": {"type": "xml"}}),
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            json!({"functions": [{"name": "f"}]}),
            "functions",
        ),
        (
            "/v1/chat/completions",
            json!({"function_call": "auto"}),
            "function_call",
        ),
        ("/v1/chat/completions", json!({"n": 0}), "n"),
        ("/v1/chat/completions", json!({"store": true}), "store"),
        (
            "/v1/chat/completions",
            json!({"service_tier": "flex"}),
            "service_tier",
        ),
        (
            "/v1/chat/completions",
            json!({"modalities": ["text", "audio"]}),
            "modalities",
        ),
        (
            "/v1/chat/completions",
            json!({"audio": {"voice": "alloy", "format": "wav"}}),
            "audio",
        ),
        (
            "/v1/chat/completions",
            json!({"prediction": {"type": "content", "content": "x"}}),
            "prediction",
        ),
        (
            "/v1/chat/completions",
            json!({"reasoning_effort": "low"}),
            "reasoning_effort",
        ),
        (
            "/v1/chat/completions",
            json!({"verbosity": "low"}),
            "verbosity",
        ),
        (
            "/v1/chat/completions",
            json!({"web_search_options": {}}),
            "web_search_options",
        ),
        ("/v1/chat/completions", json!({"min_p": 0.05}), "min_p"),
        ("/v1/chat/completions", json!({"echo": true}), "echo"),
        ("/v1/completions", json!({"echo": true}), "echo"),
        ("/v1/completions", json!({"best_of": 2}), "best_of"),
        ("/v1/completions", json!({"suffix": " end."}), "suffix"),
        (
            "/v1/completions",
            json!({"repeat_penalty": 1.1}),
            "repeat_penalty",
        ),
        ("/v1/completions", json!({"n": 65}), "n"),
        (
            "/v1/completions",
            json!({"prompt": [[1, 2], "x", 3]}),
            "prompt",
        ),
        ("/v1/completions", json!({"prompt": [[]]}), "prompt"),
        ("/v1/completions", json!({"prompt": [49152]}), "prompt"),
        (
            "/v1/completions",
            json!({"top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"logit_bias": {"49152": 5}}),
            "logit_bias",
        ),
        ("/v1/completions", json!({"logprobs": 21}), "logprobs"),
    ];
    for (path, extra, param) in cases {
        let mut body = if path.contains("chat") {
            json!({"messages": msgs, "max_tokens": 2})
        } else {
            json!({"prompt": "Hi", "max_tokens": 2})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(port, path, &body);
        assert_eq!(status, 400, "{path} {extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(param), "{path} {extra}: {msg}");
    }
    let (status, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi", "images": ["x"]}], "max_tokens": 2}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages[0].images", "{v}");
    // What a client sends by default, or echoes back, is accepted.
    let (status, v) = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi", "name": "ann"},
                             {"role": "assistant", "content": "Hello", "refusal": null, "tool_calls": null},
                             {"role": "user", "content": "Bye"}],
                "max_tokens": 2, "n": 1, "tools": [], "tool_choice": "none", "store": false,
                "response_format": {"type": "text"}, "user": "u-1", "metadata": {"k": "v"},
                "parallel_tool_calls": true, "presence_penalty": 0, "frequency_penalty": 0,
                "logprobs": false, "service_tier": "auto", "stream_options": null}),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2, "echo": false, "best_of": 1, "suffix": null,
                "logprobs": null, "user": "u", "repeat_penalty": 1.0}),
    );
    assert_eq!(status, 200, "{v}");
}

/// The chat `logprobs` of a greedy answer: one entry per token, each the most likely of its
/// top list, log-probabilities ≤ 0 in descending order whose probabilities sum to at most 1,
/// the tokens' texts adding up to the answer; streamed, the same entries.
fn logprobs_chat(port: u16) {
    let body = json!({"messages": chat("Name a fruit."), "max_tokens": 8, "temperature": 0,
                      "logprobs": true, "top_logprobs": 4});
    let (status, v) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.content: {v}"));
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    let mut text = String::new();
    for e in content {
        let lp = e["logprob"].as_f64().expect("logprob");
        assert!(lp.is_finite() && lp <= 0.0, "{e}");
        let top = e["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 4, "{e}");
        assert_eq!(
            top[0]["token"], e["token"],
            "greedy takes the most likely: {e}"
        );
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-9,
            "{e}"
        );
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(
            lps.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-9,
            "{e}"
        );
        let token = e["token"].as_str().unwrap();
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        assert_eq!(bytes, token.as_bytes(), "{e}");
        text.push_str(token);
    }
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.starts_with(answer),
        "tokens {text:?} vs answer {answer:?}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, text) = http_with(
        port,
        "POST",
        "/v1/chat/completions",
        &streamed.to_string(),
        &[("Authorization", &format!("Bearer {KEY}"))],
    );
    assert_eq!(status, 200, "{text}");
    let mut entries = Vec::new();
    for d in sse_data(&text) {
        if d == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(&d).unwrap();
        if let Some(list) = c["choices"][0]["logprobs"]["content"].as_array() {
            entries.extend(list.iter().cloned());
        }
    }
    assert_eq!(&entries, content, "streamed logprobs differ");
}

/// Completions' `logprobs`: tokens, token_logprobs, top_logprobs maps and text offsets.
fn logprobs_completions(port: u16) {
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3}),
    );
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).expect("tokens");
    let values: Vec<f64> = serde_json::from_value(lp["token_logprobs"].clone()).expect("values");
    let offsets: Vec<usize> = serde_json::from_value(lp["text_offset"].clone()).expect("offsets");
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    assert_eq!(tokens.len(), 6, "{v}");
    assert_eq!((values.len(), offsets.len(), tops.len()), (6, 6, 6), "{v}");
    let mut at = 0;
    for i in 0..6 {
        assert!(values[i].is_finite() && values[i] <= 0.0, "{v}");
        assert_eq!(offsets[i], at, "{v}");
        at += tokens[i].chars().count();
        let top = tops[i].as_object().expect("a map");
        assert!(!top.is_empty() && top.len() <= 3, "{v}");
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (best - values[i]).abs() < 1e-9,
            "greedy takes the most likely: {v}"
        );
    }
    assert_eq!(
        tokens.concat(),
        v["choices"][0]["text"].as_str().unwrap(),
        "{v}"
    );
}

fn first_ids(port: u16, extra: Value) -> Vec<u32> {
    // Greedy repeats "I'm" at its 10th token: a presence penalty of 2 changes it (measured).
    let mut body = json!({"prompt": "I like apples and", "max_tokens": 12, "temperature": 0,
                          "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = post(port, "/v1/completions", &body);
    assert_eq!(status, 200, "{body}: {v}");
    serde_json::from_value(v["choices"][0]["token_ids"].clone()).expect("token_ids")
}

/// `logit_bias` forces or forbids a token; the repetition penalties change a repetitive
/// greedy answer; bad values are 400s naming the field.
fn penalties(port: u16) {
    let plain = first_ids(port, json!({}));
    let banned = first_ids(port, json!({"logit_bias": {plain[0].to_string(): -100}}));
    assert!(!banned.contains(&plain[0]), "{plain:?} {banned:?}");
    let forced = first_ids(port, json!({"logit_bias": {"28": 100}}));
    assert_eq!(forced, vec![28; 12], "a +100 bias");
    for p in [
        json!({"presence_penalty": 2}),
        json!({"frequency_penalty": 2}),
        json!({"repetition_penalty": 3}),
    ] {
        assert_ne!(first_ids(port, p.clone()), plain, "{p} changed nothing");
    }
    for (body, param) in [
        (
            json!({"prompt": "a", "presence_penalty": 3}),
            "presence_penalty",
        ),
        (
            json!({"prompt": "a", "frequency_penalty": -2.5}),
            "frequency_penalty",
        ),
        (
            json!({"prompt": "a", "repetition_penalty": -1}),
            "repetition_penalty",
        ),
        (
            json!({"prompt": "a", "logit_bias": {"1": 500}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "a", "logit_bias": {"9999999": 1}}),
            "logit_bias",
        ),
    ] {
        let (status, v) = post(port, "/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
}

fn texts(v: &Value) -> Vec<String> {
    let choices = v["choices"].as_array().unwrap_or_else(|| panic!("{v}"));
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "choices in index order: {v}");
    }
    choices
        .iter()
        .map(|c| {
            c["text"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .expect("text")
                .to_string()
        })
        .collect()
}

/// `n` choices per prompt; prompts as a batch and as token ids (equal to the same text's);
/// seeded choices differ from each other but not between equal requests; streamed, each
/// choice's chunks carry its index and add up to the whole answer's text.
fn n_and_batches(port: u16) {
    let text = "The three primary colors are";
    let (_, t) = post(port, "/tokenize", &json!({"prompt": text}));
    let ids = t["tokens"].clone();
    let body = json!({"prompt": [text, ids, "def fibonacci(n):"], "n": 2, "max_tokens": 6,
                      "temperature": 0});
    let (status, v) = post(port, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let got = texts(&v);
    assert_eq!(got.len(), 6, "{v}");
    assert!(
        got[0] == got[1] && got[1] == got[2] && got[2] == got[3],
        "{got:?}"
    );
    assert_ne!(got[0], got[4], "{got:?}");
    let (_, alone) = post(
        port,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(texts(&alone)[0], got[0], "batched and alone");
    let (_, other) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": 0}),
    );
    let prompt_tokens =
        2 * t["count"].as_u64().unwrap() + other["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"], prompt_tokens,
        "each prompt counted once: {v}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 36, "{v}");

    let sampled = json!({"messages": chat("Tell me a story."), "n": 3, "max_tokens": 12,
                         "temperature": 1.0, "seed": 11});
    let (status, a) = post(port, "/v1/chat/completions", &sampled);
    assert_eq!(status, 200, "{a}");
    let (_, b) = post(port, "/v1/chat/completions", &sampled);
    let (ta, tb) = (texts(&a), texts(&b));
    assert_eq!(ta.len(), 3, "{a}");
    assert_eq!(ta, tb, "the same seed, different choices");
    assert!(
        ta[0] != ta[1] || ta[1] != ta[2],
        "three equal sampled choices: {ta:?}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, raw) = http_with(
        port,
        "POST",
        "/v1/completions",
        &streamed.to_string(),
        &[("Authorization", &format!("Bearer {KEY}"))],
    );
    assert_eq!(status, 200, "{raw}");
    let mut per = vec![String::new(); 6];
    let mut finished = [false; 6];
    let mut usage_chunks = 0;
    let data = sse_data(&raw);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{raw}");
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).expect("chunk");
        if !c["usage"].is_null() {
            assert_eq!(c["usage"], v["usage"], "the streamed usage: {raw}");
            usage_chunks += 1;
        }
        for ch in c["choices"].as_array().expect("choices") {
            let i = ch["index"].as_u64().expect("index") as usize;
            per[i].push_str(ch["text"].as_str().unwrap_or_default());
            finished[i] |= ch["finish_reason"].is_string();
        }
    }
    assert_eq!(per, got, "streamed choices");
    assert_eq!(usage_chunks, 1, "one usage chunk: {raw}");
    assert!(finished.iter().all(|&f| f), "{raw}");
}

#[test]
fn openai_generation_fields() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(2, &["--api-key", KEY, "--max-seq-len", "256"]);
    let port = server.port;
    let checks: &[(&str, &dyn Fn())] = &[
        ("refused_fields", &|| refused_fields(port)),
        ("logprobs_chat", &|| logprobs_chat(port)),
        ("logprobs_completions", &|| logprobs_completions(port)),
        ("penalties", &|| penalties(port)),
        ("n_and_batches", &|| n_and_batches(port)),
    ];
    let failed = common::serve::failed_checks(checks);
    drop(server);
    assert!(failed.is_empty(), "failed: {failed:?}");
}
