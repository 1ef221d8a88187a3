#!/usr/bin/env python3
"""The reference renderings of tests/data/chat_templates/*.jinja: renders every case below
with Python jinja2 configured as Hugging Face transformers configures it for
`apply_chat_template`, and writes tests/data/chat_templates/expected.json, which
tests/chat_templates.rs compares candle-tp's renderer with, byte for byte.

usage:
    pip install jinja2==3.1.6
    python3 scripts/render-chat-templates.py           # rewrites expected.json
    python3 scripts/render-chat-templates.py --check   # exits 1 if expected.json differs
    python3 scripts/render-chat-templates.py --transformers
        # also renders every case with transformers' own render_jinja_template (needs
        # `pip install transformers`) and exits 1 if any output differs from this script's

The environment is the one of transformers 5.24.0's
transformers/utils/chat_template_utils.py (`_cached_compile_jinja_template`):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension and the `{% generation %}` tag, a `tojson` filter that is json.dumps with
ensure_ascii=False (indent, separators and sort_keys optional), and the globals
raise_exception, strftime_now, dict and namespace. The template variables are those of
`PreTrainedTokenizerBase.apply_chat_template`: messages (None-valued keys dropped, reasoning
fields aliased), tools, documents, add_generation_prompt, the tokenizer's special tokens and
any extra keyword arguments.
"""
import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

JINJA2_VERSION = "3.1.6"
TRANSFORMERS_VERSION = "5.24.0"  # whose chat_template_utils.py the environment follows
DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "chat_templates"

# The special tokens of each model's tokenizer_config.json (transformers passes the named ones
# that are set: bos, eos, unk, sep, pad, cls, mask).
SPECIAL_TOKENS = {
    "Qwen-Qwen3-0.6B": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "google-gemma-2-2b-it": {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    },
    "microsoft-Phi-3.5-mini-instruct": {
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "pad_token": "<|endoftext|>",
    },
    "meta-llama-Llama-3.1-8B-Instruct": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    },
    "mistralai-Mistral-Nemo-Instruct-2407": {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    },
    "candle-tp-environment": {"bos_token": "<s>", "eos_token": "</s>"},
}


def environment():
    """The jinja2 environment of transformers' `_cached_compile_jinja_template`."""

    class Generation(jinja2.ext.Extension):
        # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` renders its
        # body (and records where, when return_assistant_tokens_mask asks for it).
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_generation_support")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def normalize(messages):
    """transformers' `_normalize_chat_messages` (None-valued keys dropped) and
    `_alias_reasoning_fields` (the reasoning also under `thinking` and `reasoning_content`)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(env, template, case):
    kwargs = {**SPECIAL_TOKENS[case["template"]], **case.get("kwargs", {})}
    return env.from_string(template).render(
        messages=normalize(case["messages"]),
        tools=case.get("tools"),
        documents=None,
        add_generation_prompt=case["add_generation_prompt"],
        **kwargs,
    )


# ---- the conversations ------------------------------------------------------------------

def msg(role, content, **extra):
    return {"role": role, "content": content, **extra}


USER = [msg("user", "Hello! What is tensor parallelism?")]
SYSTEM_USER = [msg("system", "You are a concise assistant."), *USER]
MULTI_TURN = [
    msg("system", "You are a concise assistant."),
    msg("user", "Name a prime number."),
    msg("assistant", "7"),
    msg("user", "And another one?"),
]
ENDS_WITH_ASSISTANT = [
    msg("user", "Name a prime number."),
    msg("assistant", "7"),
    msg("user", "And another one?"),
    msg("assistant", "11"),
]
UNICODE = [
    msg("system", "Tu es un assistant — réponds en français. 日本語も話せます。"),
    msg("user", "  Ça va ? 🚀 \"quotes\" 'single' \\backslash\\ <tags> & {braces}\n\ttab  "),
    msg("assistant", "Très bien ! ✓ Ünïcödé ∑ 终于\n\n"),
    msg("user", "Ελληνικά, русский, עברית, العربية, हिन्दी 👩‍👩‍👧"),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city, with \"quotes\" and ünïcödé.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1},
                "threshold": {"type": "number", "default": 0.5, "maximum": 1e16},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": []},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CALL_ARGS = {"city": "Zürich", "unit": "celsius", "days": 2, "threshold": 2.0}
TOOL_RESULT = '{"temperature": 21.5, "sky": "sunny ☀"}'


def tool_call(name, arguments, call_id="call00001"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Qwen3: parallel calls (arguments as an object and as a JSON string), two tool results in a row,
# the answer after them.
QWEN_TOOL_CHAT = [
    msg("system", "You are a weather bot."),
    msg("user", "Weather and time in Zürich?"),
    msg(
        "assistant",
        "",
        tool_calls=[
            tool_call("get_weather", CALL_ARGS),
            tool_call("get_time", '{"tz": "Europe/Zurich"}', "call00002"),
        ],
    ),
    msg("tool", TOOL_RESULT, tool_call_id="call00001"),
    msg("tool", "14:05", tool_call_id="call00002"),
    msg("assistant", "It is 21.5 °C and sunny; the time is 14:05."),
    msg("user", "Thanks!"),
]
QWEN_THINKING = [
    msg("user", "What is 2+2?"),
    msg("assistant", "<think>\nThe user asks for a sum.\n</think>\n\n2+2 is 4."),
    msg("user", "And 3+3?"),
    msg("assistant", "6", reasoning_content="Another sum; 3+3=6."),
]

# Llama 3.1: one call per assistant turn; the tool result as a string.
LLAMA_TOOL_CHAT = [
    msg("system", "You are a weather bot."),
    msg("user", "Weather in Zürich?"),
    msg("assistant", None, tool_calls=[tool_call("get_weather", CALL_ARGS)]),
    msg("tool", TOOL_RESULT, tool_call_id="call00001"),
    msg("assistant", "It is 21.5 °C and sunny."),
]
LLAMA_BUILTIN_CHAT = [
    msg("user", "Search the news about Zürich."),
    msg("assistant", None, tool_calls=[tool_call("brave_search", {"query": "Zürich news"})]),
    msg("ipython", "Nothing new."),
]

# Mistral Nemo: tool-call ids of exactly 9 characters.
MISTRAL_TOOL_CHAT = [
    msg("system", "You are a weather bot."),
    msg("user", "Weather in Zürich?"),
    msg("assistant", None, tool_calls=[tool_call("get_weather", CALL_ARGS, "abc123XYZ")]),
    msg("tool", TOOL_RESULT, tool_call_id="abc123XYZ"),
    msg("assistant", "It is 21.5 °C and sunny."),
    msg("user", "Thanks!"),
]

MODEL_TEMPLATES = [
    "Qwen-Qwen3-0.6B",
    "google-gemma-2-2b-it",
    "microsoft-Phi-3.5-mini-instruct",
    "meta-llama-Llama-3.1-8B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407",
]


def cases():
    out = []

    def add(template, name, messages, agp, **extra):
        out.append({
            "name": f"{template}/{name}",
            "template": template,
            "messages": messages,
            "add_generation_prompt": agp,
            **extra,
        })

    # Every template: the plain conversations, with and without the generation prompt.
    for t in MODEL_TEMPLATES:
        add(t, "user", USER, True)
        add(t, "user-no-prompt", USER, False)
        add(t, "system-user", SYSTEM_USER, True)
        add(t, "multi-turn", MULTI_TURN, True)
        add(t, "multi-turn-no-prompt", MULTI_TURN, False)
        add(t, "ends-with-assistant", ENDS_WITH_ASSISTANT, False)
        add(t, "unicode", UNICODE, True)
    # Gemma 2 has no system role: its template raises; the alternation check too.
    add("google-gemma-2-2b-it", "unicode-no-system", UNICODE[1:], True)
    add("google-gemma-2-2b-it", "not-alternating", [USER[0], USER[0]], True)

    q = "Qwen-Qwen3-0.6B"
    add(q, "tools", QWEN_TOOL_CHAT, True, tools=TOOLS)
    add(q, "tools-no-prompt", QWEN_TOOL_CHAT[:-1], False, tools=TOOLS)
    add(q, "tools-without-system", QWEN_TOOL_CHAT[1:4], True, tools=[TIME_TOOL])
    # OpenAI's `content: null` beside tool calls: transformers drops the key, and the template
    # fails on the missing content (`'</think>' in message.content`) in jinja2 too.
    null_content = [*QWEN_TOOL_CHAT[:2], {**QWEN_TOOL_CHAT[2], "content": None}]
    add(q, "tool-call-null-content", null_content, True, tools=TOOLS)
    add(q, "thinking", QWEN_THINKING, False)
    add(q, "enable-thinking-false", MULTI_TURN, True, kwargs={"enable_thinking": False})
    add(q, "enable-thinking-true", MULTI_TURN, True, kwargs={"enable_thinking": True})

    ll = "meta-llama-Llama-3.1-8B-Instruct"
    add(ll, "tools", LLAMA_TOOL_CHAT, True, tools=TOOLS)
    add(ll, "tools-in-system", LLAMA_TOOL_CHAT, True, tools=TOOLS,
        kwargs={"tools_in_user_message": False, "date_string": "01 Jan 2026"})
    add(ll, "builtin-tools", LLAMA_BUILTIN_CHAT, True,
        kwargs={"builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]})
    add(ll, "two-calls", [USER[0], msg("assistant", None, tool_calls=[
        tool_call("get_time", {}), tool_call("get_time", {}, "call00002")])], False, tools=TOOLS)

    m = "mistralai-Mistral-Nemo-Instruct-2407"
    add(m, "tools", MISTRAL_TOOL_CHAT, True, tools=TOOLS)
    add(m, "bad-tool-call-id", MISTRAL_TOOL_CHAT[:3] + [msg("tool", "x", tool_call_id="short")], True,
        tools=TOOLS)

    # The environment itself: tojson's options, the string methods, loop controls, the
    # generation tag, dict and namespace (tests/data/chat_templates/candle-tp-environment.jinja).
    add("candle-tp-environment", "all", UNICODE, True, tools=TOOLS,
        kwargs={"numbers": [0.0, -0.0, 1.0, 2.5, 1e16, 1.5e-7, 0.0001, 123456789.125, 1e300, 3],
                "nested": {"b": [1, {"z": None, "a": True}], "a": "x\u0001\u007f\u2028"}})
    add("candle-tp-environment", "raise", USER, True, kwargs={"fail": "custom failure ✗"})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with expected.json, write nothing")
    ap.add_argument("--transformers", action="store_true",
                    help="also render with transformers' render_jinja_template and compare")
    args = ap.parse_args()
    if jinja2.__version__ != JINJA2_VERSION:
        sys.exit(f"jinja2 {jinja2.__version__} is installed; run `pip install jinja2=={JINJA2_VERSION}`")

    env = environment()
    templates = {}
    results = []
    for case in cases():
        t = case["template"]
        if t not in templates:
            templates[t] = (DATA / f"{t}.jinja").read_text(encoding="utf-8")
        entry = {
            "name": case["name"],
            "template": t,
            "messages": case["messages"],
            "tools": case.get("tools"),
            "add_generation_prompt": case["add_generation_prompt"],
            "kwargs": case.get("kwargs", {}),
        }
        try:
            entry["output"] = render(env, templates[t], case)
        except jinja2.exceptions.TemplateError as e:
            entry["error"] = str(e)
            # raise_exception's own message (the template's words), or jinja2's (which
            # minijinja words differently)
            entry["raised"] = type(e) is jinja2.exceptions.TemplateError
        results.append(entry)

    if args.transformers:
        check_with_transformers(templates, results)

    doc = {
        "generator": "scripts/render-chat-templates.py",
        "jinja2": jinja2.__version__,
        "transformers_environment": TRANSFORMERS_VERSION,
        "special_tokens": SPECIAL_TOKENS,
        "cases": results,
    }
    text = json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
    path = DATA / "expected.json"
    if args.check:
        if path.read_text(encoding="utf-8") != text:
            sys.exit(f"{path} differs from what this script renders")
        print(f"{path}: {len(results)} cases, unchanged")
    else:
        path.write_text(text, encoding="utf-8")
        errors = sum("error" in r for r in results)
        print(f"wrote {path}: {len(results)} cases ({errors} expected errors)")


def check_with_transformers(templates, results):
    """Every case rendered by transformers itself must equal this script's rendering."""
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    bad = 0
    for r in results:
        kwargs = {**SPECIAL_TOKENS[r["template"]], **r["kwargs"]}
        try:
            out = render_jinja_template(
                conversations=[_normalize_chat_messages(r["messages"])],
                tools=r["tools"],
                chat_template=templates[r["template"]],
                add_generation_prompt=r["add_generation_prompt"],
                **kwargs,
            )[0][0]
            got = {"output": out}
        except jinja2.exceptions.TemplateError as e:
            got = {"error": str(e), "raised": type(e) is jinja2.exceptions.TemplateError}
        want = {k: r[k] for k in ("output", "error", "raised") if k in r}
        if got != want:
            bad += 1
            print(f"{r['name']}: transformers renders {got!r}, this script {want!r}", file=sys.stderr)
    if bad:
        sys.exit(f"{bad} cases differ from transformers")
    print(f"transformers renders all {len(results)} cases identically")


if __name__ == "__main__":
    main()
