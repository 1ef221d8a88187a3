#!/usr/bin/env bash
# Drives candle-tp-serve with the official `openai` Python client (installed from PyPI into a
# venv under $CANDLE_TP_HOME) and with curl: chat and completions, streaming and not, at
# temperature 0 (the streamed text must equal the whole answer), plus a bad request (the
# client must raise its typed error). Prints what it got; exits non-zero on a mismatch.
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
if [ ! -f "$VENV/.complete" ] || ! "$VENV/bin/python" -c 'import openai' 2>/dev/null; then
  echo "==> installing the openai client into $VENV" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet 'openai>=1.40,<3'
  touch "$VENV/.complete"
fi
# shellcheck source=scripts/lib/start-server.sh
. scripts/lib/start-server.sh
start_server "$profile"
model=$(curl -sf "localhost:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "==> curl, non-streaming"
curl -sf "localhost:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}'
echo
echo "==> curl, streaming"
curl -sfN "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": true}'
echo "==> the openai client"
"$VENV/bin/python" - "$port" "$model" <<'PY'
import sys
import openai
port, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
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
print("OK")
PY
