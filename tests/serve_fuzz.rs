//! Property-based fuzzing of request bodies (issue 44): bodies built from the API's own fields
//! with hostile values (extreme and tiny numbers, wrong types, nulls, huge ids and counts,
//! nested junk, unicode) must never crash a rank or stop the server.
//!
//! - 100 000 bodies through the request parser in this process (`GenRequest::parse`, chat and
//!   completions): every one is parsed or refused with a 400 that names a parameter, never a
//!   panic.
//! - 2 000 of them through a 2-rank `candle-tp-serve` (SmolLM2, `--max-seq-len 48`, so that the
//!   ones that generate stay short): every answer is a 200 or a 4xx (a 503 only for a full
//!   queue), both ranks are alive at the end, and a greedy request after them gets the ids it
//!   gets from a fresh server's first request.
//!
//! The bodies come from a seeded generator (SplitMix64), so a failure names the seed and the
//! case that reproduces it. Needs `--features server` and `scripts/fetch-models.sh`.
#![cfg(feature = "server")]

use candle_tp::serve::GenRequest;
use serde_json::{json, Map, Value};

mod common;

use common::serve::{http, is_running, post, Server, SERIAL};

/// A small seeded generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// A number from the edges: zero, signs, tiny and huge magnitudes, the boundaries of the API's
/// ranges and just past them, integers past 2^53 and 2^63.
fn number(r: &mut Rng) -> Value {
    let edges = [
        json!(0),
        json!(-0.0),
        json!(1),
        json!(-1),
        json!(2),
        json!(2.000_000_1),
        json!(0.5),
        json!(1e-308),
        json!(5e-324),
        json!(1e-50),
        json!(1e308),
        json!(-1e308),
        json!(100),
        json!(101),
        json!(-100),
        json!(-101),
        json!(9_007_199_254_740_993u64),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(49_151),
        json!(49_152),
        json!(4_294_967_296u64),
        json!(20),
        json!(21),
        json!(3),
    ];
    if r.chance(4) {
        json!((r.next() as i64) >> r.below(64))
    } else {
        r.pick(&edges).clone()
    }
}

fn string(r: &mut Rng) -> String {
    let pool = [
        "",
        "x",
        "Hello",
        " ",
        "\u{0}",
        "\u{FFFF}",
        "é漢字🙂",
        "<|im_start|>",
        "</s>",
        "{\"a\": 1}",
        "auto",
        "none",
        "required",
        "json_object",
        "json_schema",
        "text",
        "user",
        "system",
        "assistant",
        "developer",
        "tool",
        "function",
    ];
    if r.chance(10) {
        let n = r.below(3000);
        "ab ".repeat(n)
    } else {
        r.pick(&pool).to_string()
    }
}

/// Any JSON value, nested at most `depth` levels.
fn any(r: &mut Rng, depth: usize) -> Value {
    match r.below(if depth == 0 { 5 } else { 8 }) {
        0 => Value::Null,
        1 => json!(r.chance(2)),
        2 | 3 => number(r),
        4 => json!(string(r)),
        5 => Value::Array((0..r.below(4)).map(|_| any(r, depth - 1)).collect()),
        _ => {
            let mut m = Map::new();
            for _ in 0..r.below(4) {
                let k = string(r);
                m.insert(k, any(r, depth - 1));
            }
            Value::Object(m)
        }
    }
}

fn message(r: &mut Rng) -> Value {
    let roles = [
        "user",
        "user",
        "user",
        "system",
        "assistant",
        "developer",
        "tool",
        "bot",
    ];
    let mut m = Map::new();
    if !r.chance(20) {
        m.insert("role".into(), json!(r.pick(&roles)));
    }
    let content = match r.below(8) {
        0 => Value::Null,
        1 => json!([{"type": "text", "text": string(r)}, {"type": "text", "text": string(r)}]),
        2 => any(r, 2),
        _ => json!(string(r)),
    };
    m.insert("content".into(), content);
    if r.chance(8) {
        m.insert("tool_calls".into(), any(r, 2));
    }
    if r.chance(10) {
        m.insert("name".into(), any(r, 1));
    }
    Value::Object(m)
}

/// A request body: some of the API's fields with values that are often valid and often not.
fn body(r: &mut Rng, chat: bool) -> Value {
    let mut o = Map::new();
    if chat {
        let msgs: Vec<Value> = (0..1 + r.below(3)).map(|_| message(r)).collect();
        o.insert("messages".into(), json!(msgs));
    } else {
        let prompt = match r.below(8) {
            0 => json!([1, 2, 3]),
            1 => json!([[1, 2], [49_999, 5]]),
            2 => json!([string(r), string(r)]),
            3 => any(r, 2),
            _ => json!(string(r)),
        };
        o.insert("prompt".into(), prompt);
    }
    // Each field: mostly a value the API takes (its edges included: a temperature of
    // 1e-308, a logit bias of -100, top_k past the vocabulary), else anything.
    let fields: [(&str, Vec<Value>); 17] = [
        (
            "max_tokens",
            vec![json!(1), json!(4), json!(16), json!(1_000_000_000)],
        ),
        (
            "max_completion_tokens",
            vec![Value::Null, json!(2), json!(9)],
        ),
        ("min_tokens", vec![json!(0), json!(2), json!(40)]),
        (
            "temperature",
            vec![json!(0), json!(0.7), json!(2), json!(1e-308), json!(1e-6)],
        ),
        ("top_p", vec![json!(1e-9), json!(0.5), json!(1)]),
        (
            "top_k",
            vec![json!(-1), json!(0), json!(1), json!(50), json!(1_000_000)],
        ),
        ("n", vec![json!(1), json!(2), json!(3)]),
        ("seed", vec![json!(0), json!(-5), json!(u64::MAX)]),
        ("presence_penalty", vec![json!(-2), json!(0.5), json!(2)]),
        ("frequency_penalty", vec![json!(-2), json!(2)]),
        (
            "repetition_penalty",
            vec![json!(1e-30), json!(0.5), json!(1.3), json!(100)],
        ),
        (
            "logprobs",
            if chat {
                vec![json!(true), json!(false)]
            } else {
                vec![json!(0), json!(5)]
            },
        ),
        ("top_logprobs", vec![json!(0), json!(20)]),
        ("stream", vec![json!(true), json!(false)]),
        ("return_token_ids", vec![json!(true)]),
        ("model", vec![json!("smollm2"), Value::Null]),
        ("user", vec![json!("u-1")]),
    ];
    for (f, valid) in fields {
        if r.chance(3) {
            let v = if r.chance(5) {
                any(r, 1)
            } else {
                r.pick(&valid).clone()
            };
            o.insert(f.into(), v);
        }
    }
    if r.chance(5) {
        let mut bias = Map::new();
        for _ in 0..r.below(6) {
            let id = match r.below(4) {
                0 => string(r),
                1 => format!("-{}", r.below(10)),
                _ => (r.below(60_000)).to_string(),
            };
            let b = if r.chance(3) { number(r) } else { json!(-100) };
            bias.insert(id, b);
        }
        o.insert("logit_bias".into(), Value::Object(bias));
    }
    if r.chance(4) {
        let stop = match r.below(4) {
            0 | 1 => json!(string(r)),
            2 => json!([string(r), string(r), string(r), string(r), string(r)]),
            _ => any(r, 2),
        };
        o.insert("stop".into(), stop);
    }
    if r.chance(5) {
        let rf = match r.below(4) {
            0 => json!({"type": "json_object"}),
            1 => json!({"type": "json_schema", "json_schema": {"name": "x", "schema":
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
            2 => json!({"type": string(r)}),
            _ => any(r, 3),
        };
        o.insert("response_format".into(), rf);
    }
    if chat && r.chance(6) {
        o.insert(
            "tools".into(),
            json!([{"type": "function", "function": {"name": "f", "parameters":
                {"type": "object", "properties": {"q": {"type": "string"}}}}}]),
        );
        o.insert("tool_choice".into(), any(r, 2));
    }
    if r.chance(8) {
        o.insert("stream_options".into(), any(r, 2));
    }
    if r.chance(12) {
        o.insert(string(r), any(r, 2));
    }
    Value::Object(o)
}

/// 100 000 bodies through the parser: parsed, or a 400 naming a parameter; never a panic.
#[test]
fn the_parser_takes_any_body() {
    let mut r = Rng(0x5eed_0044);
    let (mut parsed, mut refused) = (0usize, 0usize);
    for case in 0..100_000 {
        let chat = case % 2 == 0;
        let b = body(&mut r, chat).to_string();
        let got = std::panic::catch_unwind(|| GenRequest::parse(b.as_bytes(), chat));
        match got {
            Ok(Ok(_)) => parsed += 1,
            Ok(Err(e)) => {
                assert_eq!(e.status, 400, "case {case}: {e:?}\n{b}");
                assert!(!e.message.is_empty(), "case {case}: {e:?}");
                refused += 1;
            }
            Err(_) => panic!("case {case} panicked the parser:\n{b}"),
        }
    }
    eprintln!("the parser: {parsed} parsed, {refused} refused with a 400");
    // The generator must reach both sides, or it tests only one of them.
    assert!(parsed > 5_000 && refused > 5_000, "{parsed} {refused}");
}

/// Bodies sent to the live server (about 15 ms each there: most are refused at parsing).
const CASES_LIVE: usize = 2_000;

/// The greedy ids of a fixed completion on `port`.
fn greedy_ids(port: u16) -> Vec<u64> {
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

/// [`CASES_LIVE`] fuzzed bodies against a 2-rank server: every answer a 200 or a 4xx (or a 503 for a
/// full queue), both ranks alive after them, and a greedy request's ids unchanged.
#[test]
fn the_server_survives_fuzzed_bodies() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(2, &["--max-seq-len", "48", "--max-batch", "8"]);
    let port = server.port;
    let want = greedy_ids(port);
    let pids = server.rank_pids();
    assert_eq!(pids.len(), 2, "{pids:?}");
    // Issue 44, defect 10, over HTTP: a temperature of 1e-308 and a bias of -100 on every id
    // made every logit -inf and ended every rank's loop; now a greedy draw (the same bias on
    // every id changes no ranking).
    let bias: Map<String, Value> = (0..49_152)
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 1e-308,
                "logit_bias": bias, "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u64> = v["choices"][0]["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect();
    assert_eq!(ids, want, "1e-308 with every id biased alike is greedy");
    let mut r = Rng(0xf022_0044);
    let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
    for case in 0..CASES_LIVE {
        let chat = case % 2 == 0;
        let b = body(&mut r, chat).to_string();
        let path = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (status, text) = http(port, "POST", path, &b);
        *by_status.entry(status).or_default() += 1;
        assert!(
            status == 200 || (400..500).contains(&status) || status == 503,
            "case {case}: {status} {text}\n{b}"
        );
        if status == 503 {
            assert!(
                text.contains("queue"),
                "case {case}: a 503 that is not a full queue: {text}"
            );
        }
        for (rank, pid) in &pids {
            assert!(is_running(*pid), "case {case} ended rank {rank}:\n{b}");
        }
    }
    eprintln!("fuzzed bodies by status: {by_status:?}");
    assert_eq!(greedy_ids(port), want, "a greedy request after the fuzzing");
    for (rank, pid) in &pids {
        assert!(is_running(*pid), "rank {rank} is gone");
    }
}
