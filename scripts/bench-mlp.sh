#!/usr/bin/env bash
# The seeds' study in one run: the MLP (d -> 4d -> d, batch 1) with one process x 1 thread,
# one process x all cores, and R = 2, 3, 4 ranks x (cores / R) threads under tprun; then the
# ratio table, a CSV and two plots (matplotlib, PNG and SVG; matplotlib is installed once into a
# venv under $CANDLE_TP_HOME): tp_speedup (R ranks against one process with every core) and
# tp_efficiency (against one thread), both per d_model.
#
#   scripts/bench-mlp.sh                                  # everything, 3 rounds (~15 min)
#   scripts/bench-mlp.sh --d-model 1024,2048 --seq-len 128 --pass fwd --ranks "2"
#   scripts/bench-mlp.sh --mkl                            # also the MKL build, side by side
#   scripts/bench-mlp.sh --rounds 5                       # all modes 5 times, interleaved
#
# With several rounds every mode runs once per round, so a slow spell of this shared machine
# hits all modes alike; the report gives each ratio's median over rounds and its range, each
# round's ratio taken between runs of the same round.
set -euo pipefail
cd "$(dirname "$0")/.."

d_model="512,1024,2048,4096"
seq_len="1,128"
pass="fwd,fwd_bwd"
ranks="2 3 4"
seconds="1.0"
rounds=3
backends="gemm"
while [ $# -gt 0 ]; do
  case "$1" in
    --d-model) d_model="$2"; shift 2 ;;
    --seq-len) seq_len="$2"; shift 2 ;;
    --pass) pass="$2"; shift 2 ;;
    --ranks) ranks="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --mkl) backends="gemm mkl"; shift ;;
    --rounds) rounds="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

cores=$(nproc)
target_dir="${CARGO_TARGET_DIR:-target}"
out="${OUT_DIR:-$target_dir/bench-mlp}"
mkdir -p "$out"
: > "$out/results.jsonl"
args=(--d-model "$d_model" --seq-len "$seq_len" --pass "$pass" --seconds "$seconds")

# Build everything first, so that no compilation runs between timed modes.
for backend in $backends; do
  if [ "$backend" = mkl ]; then
    # shellcheck disable=SC1091
    . scripts/setup-mkl.sh >/dev/null
    echo "==> building with MKL" >&2
    CARGO_TARGET_DIR="$target_dir/mkl" cargo build --release --quiet --features mkl --bin tprun --example bench_mlp
  else
    echo "==> building (release)" >&2
    cargo build --release --quiet --bin tprun --example bench_mlp
  fi
done

# The core's peak f32 multiply-add rate, to judge the GEMMs' efficiency against (needs gcc).
if command -v gcc >/dev/null && gcc -O2 -march=native benches/fma_peak.c -o "$target_dir/fma_peak" 2>/dev/null; then
  "$target_dir/fma_peak" > "$out/peak.json"
  echo "==> FMA peak of one core: $(cat "$out/peak.json")" >&2
fi

# The machine's load, printed under the plots' title (this machine is often shared).
load_start=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")

# Tags each JSON line with its round.
tag() { sed -u "s/^{/{\"round\":$1,/"; }

for round in $(seq "$rounds"); do
  for backend in $backends; do
    if [ "$backend" = mkl ]; then bin_dir="$target_dir/mkl"; else bin_dir="$target_dir"; fi
    bench="$bin_dir/release/examples/bench_mlp"
    echo "==> round $round/$rounds [$backend] one process, 1 thread" >&2
    RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$bench" "${args[@]}" | tag "$round" | tee -a "$out/results.jsonl" >&2
    echo "==> round $round/$rounds [$backend] one process, $cores threads" >&2
    RAYON_NUM_THREADS=$cores OMP_NUM_THREADS=$cores MKL_NUM_THREADS=$cores "$bench" "${args[@]}" | tag "$round" | tee -a "$out/results.jsonl" >&2
    for r in $ranks; do
      echo "==> round $round/$rounds [$backend] $r ranks" >&2
      env -u RAYON_NUM_THREADS -u OMP_NUM_THREADS -u MKL_NUM_THREADS \
        "$bin_dir/release/tprun" --standalone --nproc-per-node "$r" "$bench" "${args[@]}" \
        | sed -n 's/^\[rank 0\] //p' | tag "$round" | tee -a "$out/results.jsonl" >&2
    done
  done
done

python3 benches/mlp_report.py "$out/results.jsonl" "$out" "$cores"

# The plot: matplotlib (pinned) in its own venv, made once.
MATPLOTLIB_VERSION=3.11.2
plot_venv="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/venv-plot-$MATPLOTLIB_VERSION"
if [ ! -f "$plot_venv/.complete" ]; then
  echo "==> installing matplotlib==$MATPLOTLIB_VERSION into $plot_venv (once)" >&2
  rm -rf "$plot_venv"
  if python3 -m venv "$plot_venv" &&
    "$plot_venv/bin/pip" install --quiet --disable-pip-version-check "matplotlib==$MATPLOTLIB_VERSION" >&2; then
    touch "$plot_venv/.complete"
  fi
fi
if [ -f "$plot_venv/.complete" ]; then
  load_end=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
  "$plot_venv/bin/python" benches/mlp_plot.py "$out" \
    "$rounds round(s), $(date -u +%Y-%m-%d); 1-minute load average $load_start at the start, $load_end at the end"
else
  echo "no plot: matplotlib could not be installed (the table and CSV above are complete)" >&2
fi
