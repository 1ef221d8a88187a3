#!/usr/bin/env bash
# Expert parallelism against tensor parallelism on a mixture-of-experts model (issue 45):
# decode tokens/s of a synthetic Mixtral (random weights, `make_synthetic_llama --experts`)
# at world 1, and at world 2 with every expert split across the ranks (TP) and with whole
# experts per rank (`--ep`), in one run, the three alternating over rounds; then the medians,
# the ratios, and the collectives and bytes per decoded token each layout moved.
#
# usage: scripts/bench-moe.sh [--rounds N] [--new-tokens N] [--experts N] [--hidden N]
#                             [--intermediate N] [--layers N]
# The model is written once under $CANDLE_TP_HOME/models (default ~/.cache/candle-tp).
# Not yet here (issue 45): GGUF MoE files, llama-bench, serving, emulated hosts.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3 new_tokens=32 experts=8 hidden=1024 intermediate=1024 layers=4
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --new-tokens) new_tokens="$2"; shift 2 ;;
    --experts) experts="$2"; shift 2 ;;
    --hidden) hidden="$2"; shift 2 ;;
    --intermediate) intermediate="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
target_dir="${CARGO_TARGET_DIR:-target}"
echo "==> building (release)" >&2
cargo build --release --quiet --bin tprun --example bench_generate --example make_synthetic_llama
bin="$target_dir/release"
model="$home/models/mixtral-syn-h${hidden}-i${intermediate}-e${experts}-l${layers}"
if [ ! -f "$model/model.safetensors" ]; then
  echo "==> writing $model" >&2
  "$bin/examples/make_synthetic_llama" --out "$model" --hidden "$hidden" --heads 16 \
    --kv-heads 8 --intermediate "$intermediate" --layers "$layers" --experts "$experts" \
    --experts-per-tok 2 --vocab 32000 --seed 7 >&2
fi
out="$target_dir/bench-moe.jsonl"
: > "$out"
run() { # LABEL WORLD [FLAGS...]
  local label=$1 world=$2; shift 2
  "$bin/tprun" --standalone --nproc-per-node "$world" "$bin/examples/bench_generate" \
    --model "$model" --new-tokens "$new_tokens" --prompt-len 32 "$@" 2>/dev/null |
    sed 's/^\[rank 0\] //' | grep '^{' | tail -1 | python3 -c '
import json, sys
r = json.loads(sys.stdin.read()); r["label"] = sys.argv[1]; print(json.dumps(r))' "$label" >> "$out"
}
for r in $(seq 1 "$rounds"); do
  echo "==> round $r of $rounds" >&2
  # Alternate the order so that neither layout always runs first.
  if [ $((r % 2)) = 1 ]; then
    run world1 1; run tp2 2; run ep2 2 --ep
  else
    run ep2 2 --ep; run tp2 2; run world1 1
  fi
done
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
python3 - "$out" "$cpu" "$(nproc)" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["label"], []).append(r)
med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in by.items()}
ids = {k: {tuple(x["token_ids"]) for x in v} for k, v in by.items()}
print(f"CPU: {sys.argv[2]} ({sys.argv[3]} cores); model {rows[0]['model']}; "
      f"{len(by.get('tp2', []))} rounds")
print("| layout | decode tok/s (median) | vs world 1 | collectives/token | bytes/token (rank 0) |")
print("|---|---|---|---|---|")
for k, name in [("world1", "world 1"), ("tp2", "2 ranks, experts split (TP)"),
                ("ep2", "2 ranks, whole experts (EP)")]:
    if k not in by:
        continue
    c = by[k][-1].get("comm") or {}
    print(f"| {name} | {med[k]:.1f} | {med[k] / med['world1']:.2f}x | "
          f"{c.get('collectives_per_token', 0):.0f} | {c.get('bytes_per_token', 0):.0f} |")
print(f"EP / TP at 2 ranks: {med['ep2'] / med['tp2']:.2f}x")
same = ids["world1"] == ids["tp2"] == ids["ep2"] and len(ids["world1"]) == 1
print(f"greedy ids equal across layouts and rounds: {same}")
PY
