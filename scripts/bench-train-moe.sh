#!/usr/bin/env bash
# Training throughput of a Mixtral-style model (examples/train --experts): one process against
# 2 ranks with every expert split column/row (TP) and with whole experts per rank (EP), in
# interleaved rounds, medians of each run's steps after the first two (the first steps
# allocate), and the ratios within each round.
#
#   scripts/bench-train-moe.sh                  # 3 rounds of 8 steps, 8 experts, top-2
#   ROUNDS=5 STEPS=10 scripts/bench-train-moe.sh --experts 16 --top-k 4
#
# Extra arguments go to every run (after the defaults below, so they override them).
# Environment: ROUNDS (3), STEPS (8), CARGO_TARGET_DIR (target).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-8}
TARGET=${CARGO_TARGET_DIR:-target}
cargo build --release --bin tprun --example train >&2
BIN="$TARGET/release"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM
MODEL=(--experts 8 --top-k 2 --router-aux-loss-coef 0.01 --layers 4 --hidden 512 --heads 8
    --kv-heads 4 --intermediate 1024 --seq 128 --batch 8)

run() { # name nproc args...
    local name=$1 n=$2; shift 2
    "$BIN/tprun" --standalone --nproc-per-node "$n" "$BIN/examples/train" --steps "$STEPS" \
        --quiet "${MODEL[@]}" "$@" "${EXTRA[@]}" >"$work/$name.log"
    sed -n 's/^\(\[rank 0\] \)\{0,1\}\({"loss".*\)$/\2/p' "$work/$name.log" >"$work/$name.jsonl"
}
EXTRA=("$@")
grep -m1 "model name" /proc/cpuinfo | sed 's/^/cpu: /' >&2
echo "cores: $(nproc)" >&2
for r in $(seq "$ROUNDS"); do
    echo "== round $r" >&2
    run "world1_$r" 1 --tp 1
    run "tp2_$r" 2 --tp 2
    run "ep2_$r" 2 --tp 2 --ep 2
done

python3 - "$work" "$ROUNDS" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def tps(name):
    steps = [json.loads(l) for l in open(f"{work}/{name}.jsonl")]
    rates = [s["tokens_per_s"] for s in steps[2:]] or [s["tokens_per_s"] for s in steps]
    return statistics.median(rates)
rows = []
print("| round | world 1 tok/s | TP 2 ranks | EP 2 ranks | TP / world 1 | EP / world 1 | EP / TP |")
print("|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    w, t, e = (tps(f"{n}_{r}") for n in ("world1", "tp2", "ep2"))
    rows.append((w, t, e))
    print(f"| {r} | {w:.0f} | {t:.0f} | {e:.0f} | {t / w:.2f} | {e / w:.2f} | {e / t:.2f} |")
med = [statistics.median(c) for c in zip(*rows)]
print(f"| median | {med[0]:.0f} | {med[1]:.0f} | {med[2]:.0f} | {med[1] / med[0]:.2f} "
      f"| {med[2] / med[0]:.2f} | {med[2] / med[1]:.2f} |")
PY
