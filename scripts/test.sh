#!/usr/bin/env bash
# Runs every test: unit, integration (threads backend, real processes through tprun, real
# checkpoints), doc tests, then the README's multi-process acceptance run of the MLP example.
#
#   scripts/test.sh                # everything, default build (Candle's gemm)
#   scripts/test.sh --mkl          # the layer and model tests on the MKL build (scripts/setup-mkl.sh)
#   CANDLE_TP_MKL=1 scripts/test.sh   # the same
#   scripts/test.sh --release      # also the release acceptance run (mlp under tprun, 2/3/4 ranks)
#   scripts/test.sh -- ARGS        # extra arguments for cargo test
set -euo pipefail
cd "$(dirname "$0")/.."

mkl="${CANDLE_TP_MKL:-0}"
release=0
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mkl) mkl=1; shift ;;
    --release) release=1; shift ;;
    --) shift; cargo_args=("$@"); break ;;
    *) cargo_args+=("$1"); shift ;;
  esac
done

if [ -x scripts/fetch-models.sh ]; then
  echo "==> fetching the demo models (idempotent)"
  CANDLE_TP_CONVERT_PROFILE="${CANDLE_TP_CONVERT_PROFILE:-dev}" scripts/fetch-models.sh
fi

if [ "$mkl" = 1 ]; then
  # shellcheck disable=SC1091
  . scripts/setup-mkl.sh
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/mkl"
  echo "==> cargo test --features mkl (layers, mappings, vocabulary, Llama and BERT against candle-transformers)"
  cargo test --no-fail-fast --features mkl --test layers --test mappings --test vocab_parallel \
    --test llama --test bert --test sampling "${cargo_args[@]}"
  echo "==> all MKL tests passed"
  exit 0
fi

echo "==> cargo test"
cargo test --no-fail-fast "${cargo_args[@]}"

if [ "$release" = 0 ]; then
  # tests/multiprocess.rs already ran the same check on debug binaries (2, 3 and 4 ranks).
  echo "==> all tests passed"
  exit 0
fi
echo "==> acceptance: the MLP example under tprun (release), 2, 3 and 4 ranks"
cargo build --release --quiet --bin tprun --example mlp
target_dir="${CARGO_TARGET_DIR:-target}"
for n in 2 3 4; do
  out=$("$target_dir/release/tprun" --standalone --nproc-per-node "$n" "$target_dir/release/examples/mlp")
  json=$(printf '%s\n' "$out" | sed -n 's/^\[rank 0\] \({.*}\)$/\1/p' | tail -n 1)
  python3 - "$n" "$json" <<'PY'
import json, sys
n, v = int(sys.argv[1]), json.loads(sys.argv[2])
keys = ["max_abs_err_out", "max_abs_err_grad_input", "max_abs_err_grad_weight", "max_abs_err_grad_bias"]
bad = [k for k in keys if not v[k] <= 1e-5]
assert v["world_size"] == n, v
print(f"   {n} ranks: " + ", ".join(f"{k}={v[k]:.2e}" for k in keys))
sys.exit(1 if bad else 0)
PY
done
echo "==> all tests passed"
