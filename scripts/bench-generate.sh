#!/usr/bin/env bash
# End-to-end decode speed, side by side in one run: candle-tp's tensor-parallel Llama at world
# 1 against candle-transformers' llama (same weights, same threads), and at world 2 against
# world 1 (same total cores), on SmolLM2-135M and on a synthetic Llama with realistic layer
# sizes (hidden 2048, 16 heads, 8 KV heads, intermediate 5632, 4 layers, random weights).
#
#   scripts/bench-generate.sh [--new-tokens 32] [--models "smollm2 synthetic"] [--mkl]
set -euo pipefail
cd "$(dirname "$0")/.."

new_tokens=32
models="smollm2 synthetic"
features=()
while [ $# -gt 0 ]; do
  case "$1" in
    --new-tokens) new_tokens="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --mkl) features=(--features mkl); shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
target_dir="${CARGO_TARGET_DIR:-target}"
if [ ${#features[@]} -gt 0 ]; then
  # shellcheck disable=SC1091
  . scripts/setup-mkl.sh
  target_dir="$target_dir/mkl"
fi
echo "==> building (release)" >&2
CARGO_TARGET_DIR="$target_dir" cargo build --release --quiet "${features[@]}" --bin tprun --example bench_generate --example make_synthetic_llama
bin="$target_dir/release"
cores=$(nproc)
out="$target_dir/bench-generate.jsonl"
: > "$out"
for m in $models; do
  case "$m" in
    smollm2)
      dir="$home/models/smollm2-135m-instruct"
      [ -f "$dir/model.safetensors" ] || scripts/fetch-models.sh >&2 ;;
    synthetic)
      dir="$home/models/synthetic-llama-2048"
      [ -f "$dir/model.safetensors" ] || "$bin/examples/make_synthetic_llama" --out "$dir" ;;
    *) echo "unknown model $m" >&2; exit 2 ;;
  esac
  common=(--model "$dir" --new-tokens "$new_tokens")
  echo "==> $m: candle-transformers, 1 process x $cores threads" >&2
  RAYON_NUM_THREADS=$cores "$bin/examples/bench_generate" --impl candle-transformers "${common[@]}" | tee -a "$out" >&2
  echo "==> $m: candle-tp, world 1 x $cores threads" >&2
  RAYON_NUM_THREADS=$cores "$bin/examples/bench_generate" --impl candle-tp "${common[@]}" | tee -a "$out" >&2
  echo "==> $m: candle-tp, world 2 x $((cores / 2 > 0 ? cores / 2 : 1)) threads" >&2
  env -u RAYON_NUM_THREADS "$bin/tprun" --standalone --nproc-per-node 2 "$bin/examples/bench_generate" --impl candle-tp "${common[@]}" \
    | sed -n 's/^\[rank 0\] //p' | tee -a "$out" >&2
done

python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("\n| model | candle-transformers tok/s | candle-tp world 1 tok/s | world 1 / candle-transformers | candle-tp world 2 tok/s | world 2 / world 1 | same tokens |")
print("|---|---|---|---|---|---|---|")
for m in dict.fromkeys(r["model"] for r in rows):
    ct = next(r for r in rows if r["model"] == m and r["impl"] == "candle-transformers")
    w1 = next(r for r in rows if r["model"] == m and r["impl"] == "candle-tp" and r["world_size"] == 1)
    w2 = next(r for r in rows if r["model"] == m and r["impl"] == "candle-tp" and r["world_size"] == 2)
    same = ct["token_ids"] == w1["token_ids"] == w2["token_ids"]
    print(f"| {m} | {ct['tokens_per_s']:.1f} | {w1['tokens_per_s']:.1f} | {w1['tokens_per_s']/ct['tokens_per_s']:.2f} | "
          f"{w2['tokens_per_s']:.1f} | {w2['tokens_per_s']/w1['tokens_per_s']:.2f} | {same} |")
PY
