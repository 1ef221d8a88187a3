#!/usr/bin/env bash
# End-to-end decode speed, side by side in one run: candle-tp's tensor-parallel Llama at world
# 1 against candle-transformers' llama (same weights, same threads), and at world 2 against
# world 1 (same total cores), on SmolLM2-135M and on a synthetic Llama with realistic layer
# sizes (hidden 2048, 16 heads, 8 KV heads, intermediate 5632, 4 layers, random weights).
#
#   scripts/bench-generate.sh [--new-tokens 32] [--models "smollm2 synthetic"] [--mkl]
#
# With --gguf: SmolLM2 straight from GGUF files (the shipped Q4_1 and the Q8_0 and Q4_K files
# examples/quantize_gguf writes into the model cache), 2 threads in total for everyone, rounds
# interleaved: candle-tp world 1 (1 x 2 threads) and world 2 (2 x 1 thread, with the decode
# step's profile), candle-transformers' quantized_llama on the same file, candle-tp's f32
# checkpoint at world 2, and with --llama-cpp llama.cpp (llama-cpp-python, built once into
# $CANDLE_TP_HOME/venv-llama-cpp, ~15 min on 2 cores). JSON lines, then a table with ratios.
#
#   scripts/bench-generate.sh --gguf [--types "Q4_1 Q8_0 Q4_K"] [--rounds 3] [--llama-cpp]
set -euo pipefail
cd "$(dirname "$0")/.."

new_tokens=32
models="smollm2 synthetic"
features=()
gguf=0
llama_cpp=0
types="Q4_1 Q8_0 Q4_K"
rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --gguf) gguf=1; shift ;;
    --llama-cpp) llama_cpp=1; shift ;;
    --types) types="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --new-tokens) new_tokens="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --mkl) features=(--features mkl); shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
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
# llama-cpp-python 0.3.36 built for this CPU into a venv under $CANDLE_TP_HOME (once):
# install_llama_cpp.
# shellcheck source=scripts/lib/llama-cpp.sh
. scripts/lib/llama-cpp.sh

if [ "$gguf" = 1 ]; then
  py=""
  [ "$llama_cpp" = 1 ] && py=$(install_llama_cpp)
  echo "==> building (release)" >&2
  CARGO_TARGET_DIR="$target_dir" cargo build --release --quiet "${features[@]}" --bin tprun --example bench_generate --example quantize_gguf
  bin="$target_dir/release"
  [ -f "$home/models/smollm2-135m-instruct/model.safetensors" ] || scripts/fetch-models.sh >&2
  out="$target_dir/bench-generate-gguf.jsonl"
  : > "$out"
  f32dir="$home/models/smollm2-135m-instruct"
  common=(--new-tokens "$new_tokens")
  for r in $(seq "$rounds"); do
    for t in $types; do
      file=$("$bin/examples/quantize_gguf" --dtype "$t" | tail -1)
      echo "==> round $r, $t: quantized_llama, candle-tp world 1, world 2${py:+, llama.cpp}" >&2
      RAYON_NUM_THREADS=2 "$bin/examples/bench_generate" --impl quantized_llama --model "$file" "${common[@]}" | sed "s/^{/{\"round\": $r, \"type\": \"$t\", /" | tee -a "$out" >&2
      RAYON_NUM_THREADS=2 "$bin/examples/bench_generate" --impl candle-tp --model "$file" "${common[@]}" | sed "s/^{/{\"round\": $r, \"type\": \"$t\", /" | tee -a "$out" >&2
      env -u RAYON_NUM_THREADS "$bin/tprun" --standalone --nproc-per-node 2 "$bin/examples/bench_generate" --impl candle-tp --model "$file" --profile "${common[@]}" \
        | sed -n 's/^\[rank 0\] //p' | sed "s/^{/{\"round\": $r, \"type\": \"$t\", /" | tee -a "$out" >&2
      if [ -n "$py" ]; then
        "$py" scripts/llama_cpp_bench.py --model "$file" --threads 2 --new-tokens "$new_tokens" | sed "s/^{/{\"round\": $r, \"type\": \"$t\", /" | tee -a "$out" >&2
      fi
    done
    echo "==> round $r: candle-tp f32 checkpoint, world 2" >&2
    env -u RAYON_NUM_THREADS "$bin/tprun" --standalone --nproc-per-node 2 "$bin/examples/bench_generate" --impl candle-tp --model "$f32dir" "${common[@]}" \
      | sed -n 's/^\[rank 0\] //p' | sed "s/^{/{\"round\": $r, \"type\": \"F32\", /" | tee -a "$out" >&2
  done
  python3 scripts/bench_gguf_table.py "$out"
  exit 0
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
