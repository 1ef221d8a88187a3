#!/usr/bin/env bash
# The GGUF files that scripts/bench-llama-cpp.sh measures, made by llama.cpp's own
# `llama-quantize` (built by scripts/lib/llama-cpp.sh) into $CANDLE_TP_HOME/models/gguf:
#
#   smollm2-135m-instruct.TYPE.gguf   SmolLM2-135M-Instruct. Its f32 source is the shipped Q4_1
#                                     file dequantized (examples/quantize_gguf --dtype F32): the
#                                     only SmolLM2 weights we have, so every type here is a
#                                     requantization of Q4_1 values, not of the original bf16.
#   synthetic-llama-1b.TYPE.gguf      a random-weight Llama of 1.07 B parameters (Llama 3.2 1B's
#                                     shape: hidden 2048, 16 layers, 32 heads, 8 KV heads,
#                                     intermediate 8192; SmolLM2's tokenizer, vocab 49152;
#                                     tied embeddings), from an F16 file written by
#                                     examples/make_synthetic_llama --gguf-out. Its weights
#                                     (0.6-1.1 GB quantized) do not fit in any cache.
#
# TYPE: Q4_0 Q4_1 Q5_K_M Q4_K_M Q6_K Q8_0 (llama-quantize's names). On SmolLM2 (576-wide rows,
# not a multiple of 256) the k-quant mixes fall back to Q5_0/Q5_1/Q8_0 for most matrices, as
# they do for anyone who downloads such a file.
#
#   scripts/make-gguf-models.sh [--models "smollm2 synthetic-1b"] [--types "Q4_0 Q8_0"]
#
# Idempotent: an existing file is kept; each is written under a temporary name and renamed.
# Prints the directory. About 8 GB on disk for everything (the synthetic F16 source is 2.1 GB).
set -euo pipefail
cd "$(dirname "$0")/.."

models="smollm2 synthetic-1b"
types="Q4_0 Q4_1 Q5_K_M Q4_K_M Q6_K Q8_0"
while [ $# -gt 0 ]; do
  case "$1" in
    --models) models="$2"; shift 2 ;;
    --types) types="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
for t in $types; do
  case "$t" in
    Q4_0|Q4_1|Q5_0|Q5_1|Q8_0|Q2_K|Q3_K_S|Q3_K_M|Q3_K_L|Q4_K_S|Q4_K_M|Q5_K_S|Q5_K_M|Q6_K) ;;
    *) echo "unknown type $t (llama-quantize's names: Q4_0 Q4_1 Q5_K_M Q4_K_M Q6_K Q8_0 ...)" >&2; exit 2 ;;
  esac
done
for m in $models; do
  case "$m" in smollm2|synthetic-1b) ;; *) echo "unknown model $m (smollm2, synthetic-1b)" >&2; exit 2 ;; esac
done

home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
out="$home/models/gguf"
mkdir -p "$out"
# shellcheck source=scripts/lib/llama-cpp.sh
. scripts/lib/llama-cpp.sh
lbin=$(install_llama_cpp_tools)
target_dir="${CARGO_TARGET_DIR:-target}"
ebin="$target_dir/release/examples"

tmp=""
cleanup() { [ -z "$tmp" ] || rm -f "$tmp"; }
trap cleanup EXIT

# $1 source, $2 destination, $3 type: llama-quantize into a temporary name, then rename.
quantize() {
  [ -f "$2" ] && return 0
  echo "==> llama-quantize $(basename "$1") -> $3" >&2
  tmp="$2.partial.$$"
  # --allow-requantize: the SmolLM2 f32 comes from a quantized file (llama-quantize only
  # warns otherwise, the flag keeps it quiet about the F32 source's file_type).
  "$lbin/llama-quantize" --allow-requantize "$1" "$tmp" "$3" >"$tmp.log" 2>&1 \
    || { tail -20 "$tmp.log" >&2; rm -f "$tmp.log"; exit 1; }
  rm -f "$tmp.log"
  mv "$tmp" "$2"
  tmp=""
}

need_examples=0
for m in $models; do
  case "$m" in
    smollm2) [ -f "$out/smollm2-135m-instruct.F32.gguf" ] || need_examples=1 ;;
    synthetic-1b) [ -f "$out/synthetic-llama-1b.F16.gguf" ] || need_examples=1 ;;
  esac
done
if [ "$need_examples" = 1 ]; then
  echo "==> building quantize_gguf and make_synthetic_llama (release)" >&2
  CARGO_TARGET_DIR="$target_dir" cargo build --release --quiet --example quantize_gguf --example make_synthetic_llama
fi
shipped="$home/models/smollm2-135m-instruct.Q4_1.gguf"
[ -f "$shipped" ] || scripts/fetch-models.sh >&2

for m in $models; do
  case "$m" in
    smollm2)
      src="$out/smollm2-135m-instruct.F32.gguf"
      if [ ! -f "$src" ]; then
        echo "==> $src (the shipped Q4_1 dequantized)" >&2
        tmp="$src.partial.$$"
        "$ebin/quantize_gguf" --src "$shipped" --out "$tmp" --dtype F32 >&2
        mv "$tmp" "$src"; tmp=""
      fi
      stem=smollm2-135m-instruct ;;
    synthetic-1b)
      src="$out/synthetic-llama-1b.F16.gguf"
      if [ ! -f "$src" ]; then
        echo "==> $src (random weights, about a minute)" >&2
        tmp="$src.partial.$$"
        "$ebin/make_synthetic_llama" --gguf-out "$tmp" --tokenizer-gguf "$shipped" \
          --hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 --layers 16 >&2
        mv "$tmp" "$src"; tmp=""
      fi
      stem=synthetic-llama-1b ;;
  esac
  for t in $types; do quantize "$src" "$out/$stem.$t.gguf" "$t"; done
done
echo "$out"
