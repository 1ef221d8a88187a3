#!/usr/bin/env bash
# Throughput and latency of candle-tp-serve under continuous batching: starts the server
# under tprun (2 ranks by default) on the SmolLM2 checkpoint (or MODEL=path, a directory or a
# .gguf), runs scripts/bench_serve.py at 1, 4, 8 and 16 concurrent streams and prints its JSON
# (total generated tokens/s per level, its ratio to one stream, p50/p99 time to first token and
# inter-token latency). One run; on a shared machine the figures are noisy.
#
#   scripts/bench-serve.sh                   # 2 ranks, SmolLM2 f32, 64 tokens per request
#   NPROC=1 MODEL=~/.cache/candle-tp/models/smollm2-135m-instruct.Q4_1.gguf scripts/bench-serve.sh
#   PROFILE=debug scripts/bench-serve.sh     # the test build (dependencies optimised, the crate not)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
HOME_DIR="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
MODEL="${MODEL:-$HOME_DIR/models/smollm2-135m-instruct}"
MAX_TOKENS="${MAX_TOKENS:-64}"
LEVELS="${LEVELS:-1,4,8,16}"
PROFILE="${PROFILE:-release}"
target_dir="${CARGO_TARGET_DIR:-target}"
# shellcheck source=scripts/lib/start-server.sh
. scripts/lib/start-server.sh
start_server "$PROFILE" --max-batch 16
echo "server on port $port ($NPROC ranks, $MODEL)" >&2
python3 scripts/bench_serve.py "$port" --levels "$LEVELS" --max-tokens "$MAX_TOKENS" | python3 -c '
import json, sys
v = json.load(sys.stdin)
v.update({"world_size": int(sys.argv[1]), "model": sys.argv[2], "profile": sys.argv[3],
          "cores": __import__("os").cpu_count()})
print(json.dumps(v, indent=1))' "$NPROC" "$MODEL" "$PROFILE"
