#!/usr/bin/env bash
# Idle check of candle-tp-serve: starts the server under tprun (2 ranks by default, the
# SmolLM2 checkpoint or MODEL=path), serves one request, then measures each rank's CPU use
# (utime + stime from /proc/<pid>/stat) over IDLE_S seconds (default 60) with no request, and
# serves one more request after the pause. Prints one JSON object: each rank's CPU % over the
# pause, whether every rank stayed under 2 %, and the status of the request after it.
# Exit code 0 when every rank was under 2 % and the request after the pause succeeded.
#
#   scripts/serve-idle.sh                      # 2 ranks, 60 s, release build
#   NPROC=3 IDLE_S=30 PROFILE=debug scripts/serve-idle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
HOME_DIR="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
MODEL="${MODEL:-$HOME_DIR/models/smollm2-135m-instruct}"
IDLE_S="${IDLE_S:-60}"
PROFILE="${PROFILE:-release}"
target_dir="${CARGO_TARGET_DIR:-target}"
# shellcheck source=scripts/lib/start-server.sh
. scripts/lib/start-server.sh
start_server "$PROFILE"
echo "server on port $port ($NPROC ranks, $MODEL); idle for $IDLE_S s" >&2

complete() {
  curl -s -o /dev/null -w '%{http_code}' --max-time 120 "http://127.0.0.1:$port/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
}

# The ranks: tprun's child processes.
mapfile -t ranks < <(pgrep -P "$pid")
if [ "${#ranks[@]}" -ne "$NPROC" ]; then
  echo "expected $NPROC rank processes under tprun ($pid), found ${#ranks[@]}" >&2
  exit 1
fi
first=$(complete)
# CPU ticks (utime + stime) of a process: fields 14 and 15 of /proc/<pid>/stat, counted after
# the command name's closing parenthesis.
ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
before=()
for p in "${ranks[@]}"; do before+=("$(ticks "$p")"); done
t0=$(date +%s.%N)
sleep "$IDLE_S"
t1=$(date +%s.%N)
after=()
for p in "${ranks[@]}"; do after+=("$(ticks "$p")"); done
second=$(complete)
python3 - "$(getconf CLK_TCK)" "$t0" "$t1" "$first" "$second" "$NPROC" "$MODEL" \
  "${before[*]}" "${after[*]}" <<'EOF'
import json, sys
hz, t0, t1 = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
first, second, nproc, model = sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7]
before = [int(x) for x in sys.argv[8].split()]
after = [int(x) for x in sys.argv[9].split()]
wall = t1 - t0
cpu = [round(100 * (a - b) / hz / wall, 2) for a, b in zip(after, before)]
ok = all(c < 2.0 for c in cpu) and first == "200" and second == "200"
print(json.dumps({"world_size": nproc, "model": model, "idle_s": round(wall, 1),
                  "cpu_percent_per_rank": cpu, "all_under_2_percent": all(c < 2.0 for c in cpu),
                  "status_before_pause": int(first), "status_after_pause": int(second),
                  "ok": ok}))
sys.exit(0 if ok else 1)
EOF
