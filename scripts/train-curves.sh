#!/usr/bin/env bash
# Loss curves of examples/train for TP=1, TP=2, TP=2+SP and DP=2 x TP=2 (4 processes), side by
# side, checked against TP=1 within a relative tolerance at every step (f32).
#
#   scripts/train-curves.sh                 # 50 steps, release build, tolerance 1e-4
#   STEPS=5 PROFILE=debug scripts/train-curves.sh --layers 2 --hidden 64 --heads 4 --kv-heads 2
#
# Extra arguments go to every run of the example. Environment: STEPS (50), PROFILE (release),
# TOL (1e-4), CARGO_TARGET_DIR (target).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-50}
PROFILE=${PROFILE:-release}
TOL=${TOL:-1e-4}
TARGET=${CARGO_TARGET_DIR:-target}
flag=(); [ "$PROFILE" = release ] && flag=(--release)
cargo build "${flag[@]}" --bin tprun --example train >&2
BIN="$TARGET/$PROFILE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM

run() { # name nproc args...
    local name=$1 n=$2; shift 2
    echo "== $name ($n processes)" >&2
    "$BIN/tprun" --standalone --nproc-per-node "$n" "$BIN/examples/train" \
        --steps "$STEPS" --quiet "$@" "${EXTRA[@]}" >"$work/$name.log"
    sed -n 's/^\(\[rank 0\] \)\{0,1\}\({"loss".*\)$/\2/p' "$work/$name.log" >"$work/$name.jsonl"
    grep -h activation_bytes "$work/$name.log" | sed 's/^\[rank 0\] //' >&2 || true
}
EXTRA=("$@")
run tp1 1 --tp 1
run tp2 2 --tp 2
run tp2_sp 2 --tp 2 --sequence-parallel
run dp2_tp2 4 --tp 2 --dp 2 --sequence-parallel

python3 - "$work" "$TOL" <<'PY'
import json, sys
work, tol = sys.argv[1], float(sys.argv[2])
names = ["tp1", "tp2", "tp2_sp", "dp2_tp2"]
curves = {n: [json.loads(l)["loss"] for l in open(f"{work}/{n}.jsonl")] for n in names}
steps = len(curves["tp1"])
print("step " + " ".join(f"{n:>12}" for n in names) + "  max_rel_diff")
worst, bad = 0.0, []
for i in range(steps):
    ref = curves["tp1"][i]
    row = [curves[n][i] if i < len(curves[n]) else float("nan") for n in names]
    rel = max(abs(v - ref) / abs(ref) if v == v else float("inf") for v in row[1:])
    worst = max(worst, rel)
    if not rel <= tol:
        bad.append(i)
    print(f"{i:4d} " + " ".join(f"{v:12.6f}" for v in row) + f"  {rel:.2e}")
for n in names:
    if len(curves[n]) != steps:
        print(f"{n}: {len(curves[n])} steps, expected {steps}"); bad.append(-1)
print(f"worst relative difference to TP=1: {worst:.2e} (tolerance {tol:g})")
if bad:
    print(f"FAIL at steps {bad}"); sys.exit(1)
print("OK: every curve equals TP=1 within tolerance")
PY
