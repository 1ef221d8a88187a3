//! Chat templates, rendered as Hugging Face transformers renders them.
//!
//! transformers' `apply_chat_template` renders a checkpoint's Jinja chat template with
//! jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`, the
//! `loopcontrols` extension and a `{% generation %}` tag, a `tojson` filter that is Python's
//! `json.dumps(ensure_ascii=False)` (with optional `indent`, `separators`, `sort_keys`), and
//! the globals `raise_exception`, `strftime_now`, `dict` and `namespace`
//! (`transformers/utils/chat_template_utils.py`). [`ChatTemplate`] is that environment in
//! minijinja: the same settings; minijinja-contrib's `pycompat` for the Python string and dict
//! methods templates call (`startswith`, `split`, `strip`, `items`, ...), with `find` and
//! `rfind` counting characters as Python does; jinja2's `sequence` and `iterable` tests; and
//! this module's [`tojson`], `strftime_now` and `raise_exception`. A template is compiled once,
//! when the [`ChatTemplate`] is made, and rendered any number of times.
//!
//! - [`ChatTemplate`], [`ChatInput`]: compile, render.
//! - [`checkpoint`]: which template and special tokens a checkpoint has.
//! - `messages`: transformers' normalisation of the messages (None-valued keys dropped,
//!   reasoning fields aliased).
//! - `pycompat`, [`tojson`], `strftime`, `generation_tag`: the pieces of the environment
//!   minijinja has not (or has otherwise than Python).
//!
//! `tests/chat_templates.rs` compares the renderings of real templates (Qwen3, Gemma 2,
//! Phi-3.5, Llama 3.1, Mistral Nemo) with jinja2's, byte for byte; `docs/SERVE.md` lists what
//! minijinja still renders differently from jinja2.

pub mod checkpoint;
mod generation_tag;
mod messages;
mod pycompat;
mod strftime;
pub mod tojson;

use candle_core::Result;
use minijinja::{AutoEscape, Environment, ErrorKind};

pub use checkpoint::special_token;
/// A template value (minijinja's): build one with `Value::from_serialize`, or deserialize one
/// (maps keep their order, as Python dicts do).
pub use minijinja::Value;

fn err(what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(what.to_string())
}

/// What a chat template is rendered with: the arguments of transformers'
/// `apply_chat_template` (the special tokens come from the [`ChatTemplate`]).
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    /// The conversation: maps with `role` and `content` (and `tool_calls`, `tool_call_id`,
    /// `reasoning_content`, ... as the template reads them).
    pub messages: Vec<Value>,
    /// Tool definitions (JSON schemas), `tools`; `None` renders as Python's `None`.
    pub tools: Option<Vec<Value>>,
    /// Documents for retrieval-augmented templates, `documents`.
    pub documents: Option<Vec<Value>>,
    /// Whether to end with the header of an assistant turn, `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// Further template variables (`enable_thinking`, `date_string`, ...); they override the
    /// special tokens of the same name.
    pub kwargs: Vec<(String, Value)>,
}

impl ChatInput {
    /// A conversation with the generation prompt, no tools and no extra variables.
    pub fn new(messages: Vec<Value>) -> Self {
        Self {
            messages,
            add_generation_prompt: true,
            ..Self::default()
        }
    }
}

/// The variables transformers passes itself: a keyword argument of the same name is a
/// `TypeError` there, an error here.
pub(crate) const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A compiled chat template with the special tokens it is rendered with.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    name: String,
    source: String,
    special_tokens: Vec<(String, String)>,
}

impl ChatTemplate {
    /// Compiles `source`; `name` says where it came from (a file, a model) in error messages.
    pub fn new(name: impl Into<String>, source: &str) -> Result<Self> {
        let name = name.into();
        let env = environment(&name, source)?;
        Ok(Self {
            env,
            name,
            source: source.to_string(),
            special_tokens: Vec::new(),
        })
    }

    /// The special tokens (`bos_token`, `eos_token`, ...) the template sees, as transformers
    /// passes the tokenizer's `special_tokens_map`.
    pub fn with_special_tokens(
        mut self,
        tokens: impl IntoIterator<Item = (String, String)>,
    ) -> Self {
        self.special_tokens = tokens.into_iter().collect();
        self
    }

    /// Where the template came from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The template's source, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special tokens the template sees.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// The template rendered with `input`. An error names the template and the construct that
    /// failed (with its line), or quotes the template's own `raise_exception` message.
    pub fn render(&self, input: &ChatInput) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        for (k, v) in &input.kwargs {
            if RESERVED.contains(&k.as_str()) {
                return Err(err(format!(
                    "chat template {}: the variable '{k}' cannot be passed as an extra argument",
                    self.name
                )));
            }
            ctx.retain(|(key, _)| key != k);
            ctx.push((k.clone(), v.clone()));
        }
        let list = |v: &Option<Vec<Value>>| match v {
            Some(items) => Value::from(items.clone()),
            None => Value::from(()),
        };
        ctx.push(("messages".into(), messages::normalize(&input.messages)));
        ctx.push(("tools".into(), list(&input.tools)));
        ctx.push(("documents".into(), list(&input.documents)));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        ));
        let ctx: Value = ctx.into_iter().collect();
        self.env
            .get_template(&self.name)
            .and_then(|t| t.render(ctx))
            .map_err(|e| err(describe(&self.name, "rendering", &e)))
    }
}

/// The error message for `e`: the template's own words for `raise_exception`, else minijinja's
/// description of the construct, with the template's name and the line.
fn describe(name: &str, doing: &str, e: &minijinja::Error) -> String {
    let at = match (e.name(), e.line()) {
        (Some(_), Some(line)) => format!("{name}, line {line}"),
        _ => name.to_string(),
    };
    if let Some(Raised(msg)) = std::error::Error::source(e).and_then(|s| s.downcast_ref()) {
        return format!("chat template {at}: raise_exception: {msg}");
    }
    let mut out = format!("{doing} the chat template {at}: {}", e.kind());
    if let Some(detail) = e.detail() {
        out.push_str(&format!(": {detail}"));
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(&format!(": {s}"));
        source = s.source();
    }
    out
}

/// The message of a template's `raise_exception`, the source of its minijinja error.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// transformers' `raise_exception(message)`: ends the rendering with the template's message.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, "raise_exception")
            .with_source(Raised(message)),
    )
}

/// The minijinja environment transformers' jinja2 environment corresponds to, with `source`
/// compiled as `name`.
fn environment(name: &str, source: &str) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // minijinja picks escaping by the template's file extension (`.json`: JSON-escaped
    // output); transformers never escapes.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(pycompat::unknown_method);
    env.add_test("sequence", pycompat::is_sequence);
    env.add_test("iterable", pycompat::is_iterable);
    env.add_filter("tojson", tojson::filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime::strftime_now);
    let source = generation_tag::rewrite(source);
    env.add_template_owned(name.to_string(), source.into_owned())
        .map_err(|e| err(describe(name, "parsing", &e)))?;
    Ok(env)
}
