#!/usr/bin/env bash
# Drives candle-tp-serve with the official `openai` Python client (installed from PyPI into a
# venv under $CANDLE_TP_HOME, with prometheus_client and pydantic) and with curl: chat and
# completions, streaming and not, at temperature 0 (the streamed text must equal the whole
# answer); log-probabilities (chat and completions, streamed too), penalties and logit_bias,
# refused fields and values (the client's typed BadRequestError naming the field); structured
# outputs (the client's parse() with a pydantic model, 20 of 20 at temperature 1; json_object)
# and tools (required and named calls parsed, streamed too; auto; a tool result); n and
# batched prompts (text and token ids), the
# API key (the client without it gets AuthenticationError), models.retrieve, /tokenize and
# /detokenize, and /metrics parsed by prometheus_client; then a second server on
# all-MiniLM-L6-v2: embeddings (float and the client's default base64, the same bits), refusals.
# Prints what it got; exits non-zero
# on a mismatch.
#
#   scripts/test-openai.sh            # 2 ranks, SmolLM2 (MODEL=... for another, e.g. a .gguf),
#                                     # debug binaries (what `cargo test --features server` built)
#   scripts/test-openai.sh --release  # release binaries
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
HOME_DIR="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
MODEL="${MODEL:-$HOME_DIR/models/smollm2-135m-instruct}"
VENV="$HOME_DIR/venv-openai"
target_dir="${CARGO_TARGET_DIR:-target}"
profile=debug
[ "${1:-}" = --release ] && profile=release
if [ ! -f "$VENV/.complete" ] || ! "$VENV/bin/python" -c 'import openai, prometheus_client, pydantic' 2>/dev/null; then
  echo "==> installing the openai client, pydantic and prometheus_client into $VENV" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # pydantic: the structured-output models (openai depends on it already; named for clarity).
  "$VENV/bin/pip" install --quiet 'openai>=1.40,<3' 'pydantic>=2,<3' 'prometheus_client>=0.20,<1'
  touch "$VENV/.complete"
fi
KEY="sk-candle-tp-$$"
# shellcheck source=scripts/lib/start-server.sh
. scripts/lib/start-server.sh
start_server "$profile" --api-key "$KEY"
auth=(-H "Authorization: Bearer $KEY")
model=$(curl -sf "${auth[@]}" "localhost:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "==> curl, non-streaming"
curl -sf "${auth[@]}" "localhost:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}'
echo
echo "==> curl, streaming"
curl -sfN "${auth[@]}" "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": true}'
echo "==> curl, without the API key: 401"
[ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/v1/models")" = 401 ]
echo "==> the openai client"
"$VENV/bin/python" - "$port" "$model" "$KEY" <<'PY'
import json
import math
import sys
import urllib.request
import openai
from prometheus_client.parser import text_string_to_metric_families
port, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
msgs = [{"role": "user", "content": "Name three colors."}]
whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0)
print("chat:", repr(whole.choices[0].message.content), whole.usage)
parts = []
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
print("chat, streamed:", repr("".join(parts)))
assert "".join(parts) == whole.choices[0].message.content, "streamed text differs"
comp = client.completions.create(model=model, prompt="Tensor parallelism splits", max_tokens=16, temperature=0)
print("completion:", repr(comp.choices[0].text), comp.usage)
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="Tensor parallelism splits", max_tokens=16, temperature=0, stream=True) if c.choices)
assert streamed == comp.choices[0].text, (streamed, comp.choices[0].text)
sampled = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16,
                                    temperature=0.8, top_p=0.9, seed=7)
again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16,
                                  temperature=0.8, top_p=0.9, seed=7)
print("sampled (seed 7):", repr(sampled.choices[0].text))
assert sampled.choices[0].text == again.choices[0].text, "the same seed gave different text"
try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    print("unknown model:", e.status_code, e.body)
try:
    client.completions.create(model=model, prompt="x", max_tokens=0)
    raise SystemExit("max_tokens = 0 was accepted")
except openai.BadRequestError as e:
    print("max_tokens = 0:", e.status_code, e.body)

# Log-probabilities: chat (top_logprobs) and completions (an integer), streamed too.
lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=3)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens, (len(content), lp.usage)
for e in content:
    assert e.logprob <= 0 and len(e.top_logprobs) == 3, e
    assert e.top_logprobs[0].token == e.token, e  # greedy takes the most likely
    assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-9, e
print("chat logprobs:", [(e.token, round(e.logprob, 4)) for e in content])
streamed = []
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True):
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        streamed.extend(chunk.choices[0].logprobs.content)
assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content], "streamed logprobs differ"
clp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                temperature=0, logprobs=2)
print("completion logprobs:", clp.choices[0].logprobs.tokens, clp.choices[0].logprobs.token_logprobs)
assert "".join(clp.choices[0].logprobs.tokens) == clp.choices[0].text
assert all(len(t) <= 2 for t in clp.choices[0].logprobs.top_logprobs)

# Penalties and logit_bias (repetition_penalty is vLLM's: through extra_body).
count = "I like apples and"  # greedy repeats "I'm" at its 10th token
plain = client.completions.create(model=model, prompt=count, max_tokens=12, temperature=0)
for kw in [dict(presence_penalty=2), dict(frequency_penalty=2),
           dict(extra_body={"repetition_penalty": 3.0})]:
    p = client.completions.create(model=model, prompt=count, max_tokens=12, temperature=0, **kw)
    print("penalty", kw, repr(p.choices[0].text))
    assert p.choices[0].text != plain.choices[0].text, ("no effect", kw)
forced = client.completions.create(model=model, prompt=count, max_tokens=3, temperature=0,
                                   logit_bias={"28": 100}, extra_body={"return_token_ids": True})
print("logit_bias +100 on 28:", forced.choices[0].model_extra.get("token_ids"))
assert forced.choices[0].model_extra.get("token_ids") == [28, 28, 28]

# Refused fields and values: the typed error names the field.
for kw, param in [(dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
                  (dict(response_format={"type": "xml"}), "response_format.type"),
                  (dict(tool_choice="required"), "tool_choice"),
                  (dict(n=0), "n"),
                  (dict(extra_body={"min_p": 0.1}), "min_p")]:
    try:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=2, **kw)
        raise SystemExit(f"{param} was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == param, e.body
        print(f"{param}: 400 {e.body['message']}")

# Structured outputs: the client's parse() with a pydantic model, 20 of 20 at temperature 1.
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, List, Literal
from pydantic import BaseModel, Field
class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    landmarks: List[Annotated[str, Field(max_length=24)]] = Field(max_length=3)
    climate: Literal["oceanic", "continental", "mediterranean", "tropical", "arid"]
parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
def city(seed):  # 20 requests at once: the server batches them
    got = parse(model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                response_format=City, temperature=1, seed=seed, max_tokens=200)
    return got.choices[0].message
with ThreadPoolExecutor(20) as pool:
    parsed = list(pool.map(city, range(20)))
bad = [m.content for m in parsed if not isinstance(m.parsed, City)]
assert not bad, bad
print(f"parse(): 20 of 20 City objects at temperature 1, e.g. {parsed[0].parsed!r}")
obj = client.chat.completions.create(model=model, messages=msgs, max_tokens=48, temperature=0,
                                     response_format={"type": "json_object"})
print("json_object:", repr(obj.choices[0].message.content), obj.choices[0].finish_reason)
assert obj.choices[0].message.content.startswith("{")

# Tools: forced calls (required, a named function) come back parsed, streamed too.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                         "required": ["city", "unit"], "additionalProperties": False}, "strict": True}},
         {"type": "function", "function": {"name": "add", "description": "Adds two integers",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"], "additionalProperties": False}}}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
    r = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=choice,
                                       max_tokens=100, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls, r
    call = m.tool_calls[0]
    args = json.loads(call.function.arguments)
    print("tool_choice", choice, "->", call.function.name, args)
    assert call.type == "function" and call.id
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), args
    else:
        assert call.function.name == "add" and set(args) == {"a", "b"}, args
forced = r
stream = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=100, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        stream=True)
calls, finish = {}, None
for chunk in stream:
    if not chunk.choices:
        continue
    for t in chunk.choices[0].delta.tool_calls or []:
        c = calls.setdefault(t.index, {"name": "", "arguments": ""})
        c["name"] += t.function.name or ""
        c["arguments"] += t.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
print("streamed tool calls:", calls, finish)
assert finish == "tool_calls"
assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
    [(t.function.name, json.loads(t.function.arguments)) for t in forced.choices[0].message.tool_calls]
auto = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=32, temperature=0)
print("tool_choice auto:", auto.choices[0].finish_reason, repr(auto.choices[0].message.content),
      auto.choices[0].message.tool_calls)
follow = client.chat.completions.create(model=model, max_tokens=16, temperature=0, tools=tools, messages=ask + [
    {"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in forced.choices[0].message.tool_calls]},
    {"role": "tool", "tool_call_id": forced.choices[0].message.tool_calls[0].id, "content": "18 degrees, sunny"}])
print("after the tool result:", repr(follow.choices[0].message.content))

# n and batched prompts (text and token ids).
two = client.completions.create(model=model, prompt=["Tensor parallelism splits", [504, 3575, 282]],
                                n=2, max_tokens=4, temperature=0)
print("n = 2 over 2 prompts:", [(c.index, c.text) for c in two.choices])
assert [c.index for c in two.choices] == [0, 1, 2, 3]
assert two.choices[0].text == two.choices[1].text == comp.choices[0].text[:len(two.choices[0].text)]
many = client.chat.completions.create(model=model, messages=msgs, n=3, max_tokens=8, temperature=1, seed=3)
assert len(many.choices) == 3, many

# The API key.
try:
    openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()
    raise SystemExit("a wrong API key was accepted")
except openai.AuthenticationError as e:
    print("wrong key:", e.status_code, e.body)
print("models.retrieve:", client.models.retrieve(model).id)
assert client.models.retrieve(model).id == model

def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return json.load(urllib.request.urlopen(req))

tok = post("/tokenize", {"prompt": "Tensor parallelism"})
back = post("/detokenize", {"tokens": tok["tokens"]})
print("tokenize:", tok["tokens"], "detokenize:", repr(back["prompt"]))
assert back["prompt"].endswith("Tensor parallelism")

# /metrics, parsed by prometheus_client.
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if "le" not in s.labels and "finished_reason" not in s.labels}
print("metrics:", {k: samples[k] for k in ["candle_tp:generation_tokens_total",
                                            "candle_tp:prompt_tokens_total",
                                            "candle_tp:time_to_first_token_seconds_count"]})
assert samples["candle_tp:generation_tokens_total"] > 0
assert samples["candle_tp:time_to_first_token_seconds_count"] >= 10
print("OK")
PY

echo "==> embeddings: a second server on all-MiniLM-L6-v2 (BERT, tensor-parallel)"
stop_server
MODEL="$HOME_DIR/models/all-minilm-l6-v2"
start_server "$profile" --api-key "$KEY"
curl -sf "${auth[@]}" "localhost:$port/v1/embeddings" -H 'Content-Type: application/json' \
  -d '{"input": "The cat sits on the mat."}' | python3 -c 'import json,sys; v=json.load(sys.stdin); print("curl:", len(v["data"][0]["embedding"]), "dimensions,", v["usage"])'
"$VENV/bin/python" - "$port" "$KEY" <<'PY'
import array
import math
import sys
import openai
port, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
model = client.models.list().data[0].id
texts = ["The cat sits on the mat.", "A dog plays in the garden.",
         "Tensor parallelism splits every layer's weights across ranks."]
floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
# Without encoding_format the client asks for base64 and decodes it (little-endian f32).
decoded = client.embeddings.create(model=model, input=texts)
assert [d.index for d in floats.data] == [0, 1, 2], floats.data
vecs = []
for f, b in zip(floats.data, decoded.data):
    assert len(f.embedding) == 384 and all(math.isfinite(x) for x in f.embedding)
    # The JSON floats rounded to f32 are the base64 floats, bit for bit.
    assert list(array.array("f", f.embedding)) == list(b.embedding), "base64 differs from float"
    norm = math.sqrt(sum(x * x for x in f.embedding))
    assert abs(norm - 1) < 1e-5, norm
    vecs.append(f.embedding)
cos = lambda a, b: sum(x * y for x, y in zip(a, b))
sims = [round(cos(vecs[0], vecs[1]), 4), round(cos(vecs[0], vecs[2]), 4)]
print("embeddings: 3 x 384, unit norm; cos(cat, dog), cos(cat, tensor):", sims, floats.usage)
assert sims[0] > sims[1]
for bad in [dict(dimensions=64), dict(extra_body={"truncate_prompt_tokens": 8})]:
    try:
        client.embeddings.create(model=model, input="x", encoding_format="float", **bad)
        raise SystemExit(f"{bad} was accepted")
    except openai.BadRequestError as e:
        print("refused:", bad, e.status_code, e.body["param"])
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    raise SystemExit("chat on an embedding model was accepted")
except openai.BadRequestError as e:
    print("chat on the embedding model:", e.status_code, e.body["code"])
print("OK")
PY
