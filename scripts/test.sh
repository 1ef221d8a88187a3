#!/usr/bin/env bash
# Runs every test: unit, integration (threads backend and real processes through tprun),
# doc tests, then the README's multi-process acceptance run of the MLP example.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -x scripts/fetch-models.sh ]; then
  echo "==> fetching the demo models (idempotent)"
  CANDLE_TP_CONVERT_PROFILE="${CANDLE_TP_CONVERT_PROFILE:-dev}" scripts/fetch-models.sh
fi

echo "==> cargo test"
cargo test --no-fail-fast "$@"

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
