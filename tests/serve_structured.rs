//! `candle-tp-serve` (2 ranks, SmolLM2) with structured outputs and tools, over real HTTP:
//! `response_format` `json_schema` at temperature 1 over 16 choices (every one parses and
//! validates, by the test's own validator) and `json_object`; `tool_choice` `required` and a
//! named function (the grammar forces calls whose arguments validate), streamed (the
//! `delta.tool_calls` add up to the same calls), `auto` and `none`; a conversation carrying
//! tool results; and the 400s of what cannot compile. Needs `--features server` and
//! `scripts/fetch-models.sh`.
#![cfg(feature = "server")]

use serde_json::{json, Value};

mod common;

use common::json_schema::validate;
use common::serve::{chat, http, post, sse_data, Server, SERIAL};

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}
        },
        "required": ["city", "country", "population_millions", "landmarks"],
        "additionalProperties": false
    })
}

fn json_schema_at_temperature_one(port: u16) {
    let body = json!({
        "messages": chat("Describe Paris as JSON."), "max_tokens": 160, "temperature": 1.0,
        "seed": 11, "n": 16,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": schema(), "strict": true}}
    });
    let (status, v) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 16);
    for c in choices {
        let content = c["message"]["content"].as_str().unwrap();
        assert_eq!(c["finish_reason"], "stop", "{content}");
        let got: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
        validate(&schema(), &got).unwrap_or_else(|e| panic!("{e}: {content}"));
    }
    // json_object: an object, streamed as the whole answer is.
    let body = json!({"messages": chat("Give me a JSON object about cats."), "max_tokens": 48,
                      "temperature": 0, "response_format": {"type": "json_object"}});
    let (status, whole) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with('{'), "{content}");
    if whole["choices"][0]["finish_reason"] == "stop" {
        let v: Value = serde_json::from_str(content).unwrap();
        assert!(v.is_object(), "{content}");
    }
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let (status, raw) = http(
        port,
        "POST",
        "/v1/chat/completions",
        &streamed_body.to_string(),
    );
    assert_eq!(status, 200, "{raw}");
    let text: String = sse_data(&raw)
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, content);
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "description": "Adds two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

/// Checks that `calls` name the tools and carry valid arguments; returns (name, arguments).
fn check_calls(calls: &Value) -> Vec<(String, Value)> {
    let defs = tools();
    let calls = calls.as_array().expect("tool_calls");
    assert!(!calls.is_empty());
    calls
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function", "{c}");
            assert!(c["id"].as_str().unwrap().starts_with("call"), "{c}");
            let name = c["function"]["name"].as_str().unwrap().to_string();
            let def = defs
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["function"]["name"] == name.as_str());
            let def = def.unwrap_or_else(|| panic!("unknown function: {c}"));
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            validate(&def["function"]["parameters"], &args).unwrap_or_else(|e| panic!("{e}: {c}"));
            (name, args)
        })
        .collect()
}

fn tool_calls(port: u16) {
    let msgs = chat("What is the weather in Paris? And what is 2 + 3?");
    let ask = |extra: Value| {
        let mut body =
            json!({"messages": msgs, "tools": tools(), "max_tokens": 120, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(port, "/v1/chat/completions", &body)
    };
    let (status, v) = ask(json!({"tool_choice": "required"}));
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert!(c["message"]["content"].is_null(), "{v}");
    let whole = check_calls(&c["message"]["tool_calls"]);
    let (status, v) =
        ask(json!({"tool_choice": {"type": "function", "function": {"name": "add"}}}));
    assert_eq!(status, 200, "{v}");
    let named = check_calls(&v["choices"][0]["message"]["tool_calls"]);
    assert_eq!(named.len(), 1, "{v}");
    assert_eq!(named[0].0, "add");
    // At temperature 1 too, over several choices.
    let (status, v) = ask(
        json!({"tool_choice": "required", "temperature": 1, "n": 6, "seed": 5,
                                 "parallel_tool_calls": false}),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        assert_eq!(check_calls(&c["message"]["tool_calls"]).len(), 1, "{c}");
    }
    // Streamed: the deltas' calls are the whole answer's.
    let mut body = json!({"messages": msgs, "tools": tools(), "max_tokens": 120, "temperature": 0,
                          "tool_choice": "required", "stream": true});
    let (status, raw) = http(port, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{raw}");
    let mut calls: Vec<Value> = Vec::new();
    let mut finish = Value::Null;
    for d in sse_data(&raw).iter().filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(d).unwrap();
        let c = &chunk["choices"][0];
        for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = t["index"].as_u64().unwrap() as usize;
            assert_eq!(i, calls.len(), "{raw}");
            calls.push(t.clone());
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "tool_calls", "{raw}");
    assert_eq!(check_calls(&Value::Array(calls)), whole);
    // auto: an answer either way; none: text, never calls.
    let (status, v) = ask(json!({"tool_choice": "auto"}));
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(
        m["content"].is_string() || m["tool_calls"].is_array(),
        "{v}"
    );
    let (status, v) = ask(json!({"tool_choice": "none"}));
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    assert_ne!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    // A conversation that carries a call and its result.
    body = json!({"messages": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}],
        "tools": tools(), "max_tokens": 8, "temperature": 0});
    let (status, v) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
}

fn refusals(port: u16) {
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}),
            "response_format",
        ),
        (
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let mut body = json!({"messages": chat("Hi"), "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(port, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
    }
    // response_format on completions (vLLM's extension): JSON from a plain prompt.
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "A JSON object:", "max_tokens": 100, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema()}}}),
    );
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        validate(&schema(), &serde_json::from_str(text).unwrap()).unwrap();
    }
}

#[test]
fn structured_outputs_and_tools() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(2, &["--max-seq-len", "512"]);
    let port = server.port;
    let checks: &[(&str, &dyn Fn())] = &[
        ("json_schema_at_temperature_one", &|| {
            json_schema_at_temperature_one(port)
        }),
        ("tool_calls", &|| tool_calls(port)),
        ("refusals", &|| refusals(port)),
    ];
    let failed = common::serve::failed_checks(checks);
    drop(server);
    assert!(failed.is_empty(), "failed: {failed:?}");
}
