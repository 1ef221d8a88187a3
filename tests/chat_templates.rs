//! Real chat templates (Qwen3, Gemma 2, Phi-3.5, Llama 3.1, Mistral Nemo, and one exercising
//! the environment construct by construct) rendered by `candle_tp::chat_template` must equal,
//! byte for byte, what Python jinja2 configured as Hugging Face transformers configures it
//! renders: `tests/data/chat_templates/expected.json`, written by
//! `scripts/render-chat-templates.py` (see the README beside it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_tp::chat_template::{ChatInput, ChatTemplate, Value};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates")
}

fn expected() -> Value {
    let path = data_dir().join("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // minijinja's Value keeps the maps' order (the `preserve_order` feature), as Python does:
    // it shows in `tojson` and `items()`.
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn field(v: &Value, key: &str) -> Value {
    v.get_attr(key).unwrap()
}

fn list(v: &Value) -> Vec<Value> {
    v.try_iter().unwrap().collect()
}

fn string(v: &Value) -> String {
    v.as_str().unwrap().to_string()
}

/// The case's arguments as `apply_chat_template` got them.
fn input(case: &Value) -> ChatInput {
    let tools = field(case, "tools");
    let kwargs = field(case, "kwargs");
    ChatInput {
        messages: list(&field(case, "messages")),
        tools: (!tools.is_none()).then(|| list(&tools)),
        documents: None,
        add_generation_prompt: field(case, "add_generation_prompt").is_true(),
        kwargs: list(&kwargs)
            .into_iter()
            .map(|k| (string(&k), kwargs.get_item(&k).unwrap()))
            .collect(),
    }
}

/// Where `got` and `want` part, for the failure message.
fn first_difference(got: &str, want: &str) -> String {
    let (g, w): (Vec<char>, Vec<char>) = (got.chars().collect(), want.chars().collect());
    let at = g
        .iter()
        .zip(&w)
        .position(|(a, b)| a != b)
        .unwrap_or(g.len().min(w.len()));
    let window = |s: &[char]| -> String {
        s[at.saturating_sub(40).min(s.len())..(at + 40).min(s.len())]
            .iter()
            .collect()
    };
    format!(
        "first difference at character {at}:\n  got:  {:?}\n  want: {:?}",
        window(&g),
        window(&w)
    )
}

#[test]
fn renderings_equal_transformers() {
    let doc = expected();
    let tokens = field(&doc, "special_tokens");
    let mut templates: HashMap<String, ChatTemplate> = HashMap::new();
    let mut failures = Vec::new();
    let cases = list(&field(&doc, "cases"));
    for case in &cases {
        let name = string(&field(case, "name"));
        let t = string(&field(case, "template"));
        // Each template is compiled once and rendered for all its cases.
        let template = templates.entry(t.clone()).or_insert_with(|| {
            let path = data_dir().join(format!("{t}.jinja"));
            let source = std::fs::read_to_string(&path).unwrap();
            let special = field(&tokens, &t);
            let special = list(&special)
                .into_iter()
                .map(|k| (string(&k), string(&special.get_item(&k).unwrap())));
            ChatTemplate::new(path.display().to_string(), &source)
                .unwrap_or_else(|e| panic!("{t}: {e}"))
                .with_special_tokens(special)
        });
        let got = template.render(&input(case));
        let output = field(case, "output");
        if !output.is_undefined() {
            let want = string(&output);
            match got {
                Ok(got) if got == want => {}
                Ok(got) => failures.push(format!("{name}: {}", first_difference(&got, &want))),
                Err(e) => failures.push(format!("{name}: fails: {e}")),
            }
            continue;
        }
        // jinja2 failed. The template's own raise_exception: the same words; an error of
        // jinja2's own (an undefined attribute): minijinja words it differently, it must fail.
        let error = string(&field(case, "error"));
        match got {
            Ok(got) => failures.push(format!("{name}: renders {got:?}; jinja2 fails: {error}")),
            Err(e) => {
                let e = e.to_string();
                let raised = field(case, "raised").is_true();
                if raised && !e.contains(&format!("raise_exception: {error}")) {
                    failures.push(format!("{name}: fails with {e:?}, jinja2 with {error:?}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from transformers:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn errors_name_the_template_and_the_construct() {
    let t = ChatTemplate::new(
        "bad.jinja",
        "line one\n{{ messages[0].content.nosuchmethod() }}",
    )
    .unwrap();
    let user = Value::from_serialize(serde_json::json!({"role": "user", "content": "hi"}));
    let e = t
        .render(&ChatInput::new(vec![user]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.jinja, line 2") && e.contains("nosuchmethod"),
        "{e}"
    );
    let e = ChatTemplate::new("broken.jinja", "{% for %}")
        .unwrap_err()
        .to_string();
    assert!(e.contains("parsing the chat template broken.jinja"), "{e}");
}
