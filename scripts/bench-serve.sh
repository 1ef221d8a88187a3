#!/usr/bin/env bash
# Throughput and latency of candle-tp-serve under continuous batching: starts the server
# under tprun (2 ranks by default) on the SmolLM2 checkpoint (or MODEL=path, a directory or a
# .gguf, or such a name in $CANDLE_TP_HOME/models), runs scripts/bench_serve.py at 1, 4, 8
# and 16 concurrent streams (greedy, MAX_TOKENS per request, REQUESTS per stream) and prints
# one JSON object on stdout (total generated tokens/s per level, its ratio to one stream,
# p50/p99 time to first token and inter-token latency, the load average around each run) and
# a Markdown table on stderr. One run; on a shared machine the figures are noisy.
#
# With --llama-cpp: the same benchmark, in the same run and on the same GGUF file (default
# $CANDLE_TP_HOME/models/smollm2-135m-instruct.Q4_1.gguf), against llama.cpp's server
# (`python -m llama_cpp.server` from llama-cpp-python[server] 0.3.36, PyPI, in
# $CANDLE_TP_HOME/venv-llama-cpp) with as many threads as candle-tp's ranks use in all (the
# same cores), one server at a time; the table puts both side by side with the tokens/s ratio.
# Every request carries `min_tokens` = max_tokens and `repeat_penalty` 1.0: llama.cpp then
# decodes exactly max_tokens greedily, without its default repeat penalty (candle-tp honours
# min_tokens and accepts repeat_penalty only as 1.0; a request that ends early shows in
# `short_requests`). --rounds N
# alternates the servers N times (candle-tp, llama.cpp, candle-tp, ...); the table shows medians.
#
# With --llama-server instead: llama.cpp's own C++ `llama-server` (built once from the same
# pinned llama.cpp by scripts/lib/llama-cpp.sh's install_llama_cpp_tools, into
# $CANDLE_TP_HOME/llama-cpp-0.3.36) with PARALLEL slots (8) and continuous batching, N_CTX
# tokens of context per slot, the same threads; its requests also carry `ignore_eos` (it has
# no `min_tokens`), so both servers decode exactly max_tokens.
#
# With --pp-vs-tp instead: candle-tp on the same NPROC ranks twice per round, as NPROC
# tensor-parallel ranks and as NPROC pipeline stages (`--pp NPROC`), side by side.
# With --ep-vs-tp: the same for a mixture-of-experts MODEL, every expert split across the
# ranks against whole experts per rank (`--ep`).
#
#   scripts/bench-serve.sh                   # 2 ranks, SmolLM2 f32, 64 tokens per request
#   scripts/bench-serve.sh --pp-vs-tp        # tp 2 against pp 2 on the same 2 ranks
#   MODEL=moe.gguf scripts/bench-serve.sh --ep-vs-tp   # experts split against whole experts
#   scripts/bench-serve.sh --llama-cpp       # 2 ranks against llama.cpp with 2 threads, Q4_1 GGUF
#   scripts/bench-serve.sh --llama-server --rounds 2   # against llama-server --parallel 8
#   NPROC=1 MODEL=~/.cache/candle-tp/models/smollm2-135m-instruct.Q4_1.gguf scripts/bench-serve.sh
#   PROFILE=debug scripts/bench-serve.sh     # the test build (dependencies optimised, the crate not)
#
# Environment: NPROC (2), MODEL, MAX_TOKENS (64), LEVELS (1,4,8,16), REQUESTS (2 per stream),
# PROFILE (release), LLAMA_THREADS (the threads candle-tp's ranks use in all), N_CTX (2048),
# PARALLEL (llama-server's slots, 8).
set -euo pipefail
cd "$(dirname "$0")/.."
llama_cpp=0
llama_server=0
pp_vs_tp=0
ep_vs_tp=0
rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-cpp) llama_cpp=1; shift ;;
    --llama-server) llama_cpp=1; llama_server=1; shift ;;
    --pp-vs-tp) pp_vs_tp=1; shift ;;
    --ep-vs-tp) ep_vs_tp=1; shift ;;
    --rounds) rounds="$2"; shift 2 ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
NPROC="${NPROC:-2}"
HOME_DIR="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
if [ "$llama_cpp" = 1 ]; then
  MODEL="${MODEL:-$HOME_DIR/models/smollm2-135m-instruct.Q4_1.gguf}"
  case "$MODEL" in
    *.gguf) ;;
    *) echo "--llama-cpp needs a .gguf MODEL, not $MODEL" >&2; exit 2 ;;
  esac
else
  MODEL="${MODEL:-$HOME_DIR/models/smollm2-135m-instruct}"
fi
# A bare name is one of the models the scripts fetch or make ($CANDLE_TP_HOME/models).
if [ ! -e "$MODEL" ] && [ -e "$HOME_DIR/models/$MODEL" ]; then
  MODEL="$HOME_DIR/models/$MODEL"
fi
if [ ! -e "$MODEL" ]; then
  echo "bench-serve.sh: no model at $MODEL (nor in $HOME_DIR/models)" >&2
  exit 2
fi
MAX_TOKENS="${MAX_TOKENS:-64}"
LEVELS="${LEVELS:-1,4,8,16}"
REQUESTS="${REQUESTS:-2}"
PROFILE="${PROFILE:-release}"
N_CTX="${N_CTX:-2048}"
PARALLEL="${PARALLEL:-8}"
cores=$(nproc)
# tprun gives each rank max(cores / NPROC, 1) threads.
per_rank=$((cores / NPROC > 0 ? cores / NPROC : 1))
LLAMA_THREADS="${LLAMA_THREADS:-$((NPROC * per_rank))}"
target_dir="${CARGO_TARGET_DIR:-target}"
# shellcheck source=scripts/lib/start-server.sh
. scripts/lib/start-server.sh
# shellcheck source=scripts/lib/llama-cpp.sh
. scripts/lib/llama-cpp.sh

tmp=$(mktemp -d)
cleanup() { stop_server; stop_llama_cpp_server; rm -rf "$tmp"; }
trap cleanup EXIT
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
load_start=$(loadavg)

py=""
lbin=""
if [ "$llama_server" = 1 ]; then
  lbin=$(install_llama_cpp_tools)
elif [ "$llama_cpp" = 1 ]; then
  py=$(install_llama_cpp_server)
fi
extra=$(printf '{"min_tokens": %d, "repeat_penalty": 1.0}' "$MAX_TOKENS")
# llama-server has no min_tokens: `ignore_eos` makes it decode max_tokens (candle-tp, which
# refuses fields it does not read, gets min_tokens only).
llama_extra=$(printf '{"min_tokens": %d, "repeat_penalty": 1.0, "ignore_eos": true}' "$MAX_TOKENS")

# bench SERVER ROUND PORT [EXTRA]: one bench_serve.py run, appended to $tmp/runs.jsonl.
bench() {
  local before after
  before=$(loadavg)
  python3 scripts/bench_serve.py "$3" --levels "$LEVELS" --max-tokens "$MAX_TOKENS" \
    --requests-per-stream "$REQUESTS" --extra "${4:-$extra}" >"$tmp/one.json"
  after=$(loadavg)
  python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
print(json.dumps({"server": sys.argv[2], "round": int(sys.argv[3]), "load_before": sys.argv[4],
                  "load_after": sys.argv[5], **v}))' "$tmp/one.json" "$1" "$2" "$before" "$after" >>"$tmp/runs.jsonl"
  python3 -c '
import json, sys
for lv in json.load(open(sys.argv[1]))["levels"]:
    print("    %2d streams: %7.1f tok/s, %d tokens, %d short, %d errors" % (lv["streams"],
          lv["tokens_per_s"], lv["generated_tokens"], lv["short_requests"], len(lv["errors"])))' "$tmp/one.json" >&2
}

for r in $(seq "$rounds"); do
  start_server "$PROFILE" --max-batch 16 --max-seq-len "$N_CTX"
  trap cleanup EXIT
  echo "==> round $r: candle-tp-serve on port $port ($NPROC ranks x $per_rank threads, $MODEL)" >&2
  if [ "$pp_vs_tp" = 1 ]; then
    bench "candle-tp tp $NPROC" "$r" "$port"
    stop_server
    start_server "$PROFILE" --max-batch 16 --max-seq-len "$N_CTX" --pp "$NPROC"
    echo "==> round $r: candle-tp-serve --pp $NPROC on port $port" >&2
    bench "candle-tp pp $NPROC" "$r" "$port"
  elif [ "$ep_vs_tp" = 1 ]; then
    bench "candle-tp tp $NPROC" "$r" "$port"
    stop_server
    start_server "$PROFILE" --max-batch 16 --max-seq-len "$N_CTX" --ep
    echo "==> round $r: candle-tp-serve --ep on port $port" >&2
    bench "candle-tp ep $NPROC" "$r" "$port"
  else
    bench candle-tp "$r" "$port"
  fi
  stop_server
  if [ "$llama_server" = 1 ]; then
    start_llama_server "$lbin" "$MODEL" "$LLAMA_THREADS" "$PARALLEL" "$N_CTX"
    echo "==> round $r: llama-server on port $llama_port ($LLAMA_THREADS threads, $PARALLEL slots, $MODEL)" >&2
    bench llama.cpp "$r" "$llama_port" "$llama_extra"
    stop_llama_cpp_server
  elif [ "$llama_cpp" = 1 ]; then
    start_llama_cpp_server "$py" "$MODEL" "$LLAMA_THREADS" --n_ctx "$N_CTX" --logits_all False
    echo "==> round $r: llama.cpp server on port $llama_port ($LLAMA_THREADS threads, $MODEL)" >&2
    bench llama.cpp "$r" "$llama_port"
    stop_llama_cpp_server
  fi
done

load_end=$(loadavg)
llama_version=""
[ -n "$py" ] && llama_version=$("$py" -c 'import llama_cpp; print(llama_cpp.__version__)')
python3 - "$tmp/meta.json" <<PY
import json, os, platform, sys, time
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
meta = {
    "date": time.strftime("%Y-%m-%d"),
    "cpu": cpu, "cores": os.cpu_count(),
    "load_average_before": "$load_start", "load_average_after": "$load_end",
    "model": "$MODEL", "max_tokens": $MAX_TOKENS, "levels": [int(x) for x in "$LEVELS".split(",")],
    "requests_per_stream": $REQUESTS, "rounds": $rounds,
    "request_fields": {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **json.loads('$extra')},
    "candle-tp": {"world_size": $NPROC, "threads_per_rank": $per_rank, "profile": "$PROFILE",
                  "options": "--max-batch 16 --max-seq-len $N_CTX", "token_count": "usage (stream_options.include_usage)"},
}
if "$lbin":
    meta["llama.cpp"] = {
        "server": "llama-server from llama-cpp-python 0.3.36's vendored llama.cpp ($lbin)",
        "request_fields": json.loads('$llama_extra'),
        "options": "-t $LLAMA_THREADS -tb $LLAMA_THREADS --parallel $PARALLEL --cont-batching -c $((N_CTX * PARALLEL)) (N_CTX per slot)",
        "concurrency": "$PARALLEL slots, continuous batching",
        "token_count": "usage (llama-server sends it in the last chunk of a stream)",
    }
elif "$llama_version":
    meta["llama.cpp"] = {
        "server": "llama-cpp-python[server] $llama_version (python -m llama_cpp.server)",
        "options": "--n_threads $LLAMA_THREADS --n_threads_batch $LLAMA_THREADS --n_ctx $N_CTX --logits_all False --interrupt_requests False --verbose False",
        "concurrency": "one request at a time: one llama context behind a lock, no n_parallel or batching in this server; concurrent requests wait in turn",
        "token_count": "content chunks (no usage in its streams; one chunk per token)",
    }
json.dump(meta, open(sys.argv[1], "w"))
PY
python3 scripts/bench_serve_table.py "$tmp/runs.jsonl" "$tmp/meta.json"
