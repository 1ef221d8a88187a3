#!/usr/bin/env bash
# The seeds' study in one run: the MLP (d -> 4d -> d, batch 1) with one process x 1 thread,
# one process x all cores, and R = 2, 3, 4 ranks x (cores / R) threads under tprun; then the
# ratio table, a CSV and an SVG plot of TP efficiency against d_model for each R.
#
#   scripts/bench-mlp.sh                                  # everything (several minutes)
#   scripts/bench-mlp.sh --d-model 1024,2048 --seq-len 128 --ranks "2"
#   scripts/bench-mlp.sh --mkl                            # also the MKL build, side by side
set -euo pipefail
cd "$(dirname "$0")/.."

d_model="512,1024,2048,4096"
seq_len="1,128"
ranks="2 3 4"
seconds="1.0"
backends="gemm"
while [ $# -gt 0 ]; do
  case "$1" in
    --d-model) d_model="$2"; shift 2 ;;
    --seq-len) seq_len="$2"; shift 2 ;;
    --ranks) ranks="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --mkl) backends="gemm mkl"; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

cores=$(nproc)
target_dir="${CARGO_TARGET_DIR:-target}"
out="${OUT_DIR:-$target_dir/bench-mlp}"
mkdir -p "$out"
: > "$out/results.jsonl"
args=(--d-model "$d_model" --seq-len "$seq_len" --seconds "$seconds")

for backend in $backends; do
  if [ "$backend" = mkl ]; then
    # shellcheck disable=SC1091
    . scripts/setup-mkl.sh >/dev/null
    bin_dir="$target_dir/mkl"
    echo "==> building with MKL" >&2
    CARGO_TARGET_DIR="$bin_dir" cargo build --release --quiet --features mkl --bin tprun --example bench_mlp
  else
    bin_dir="$target_dir"
    echo "==> building (release)" >&2
    cargo build --release --quiet --bin tprun --example bench_mlp
  fi
  bench="$bin_dir/release/examples/bench_mlp"
  echo "==> [$backend] one process, 1 thread" >&2
  RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$bench" "${args[@]}" | tee -a "$out/results.jsonl" >&2
  echo "==> [$backend] one process, $cores threads" >&2
  RAYON_NUM_THREADS=$cores OMP_NUM_THREADS=$cores MKL_NUM_THREADS=$cores "$bench" "${args[@]}" | tee -a "$out/results.jsonl" >&2
  for r in $ranks; do
    echo "==> [$backend] $r ranks" >&2
    env -u RAYON_NUM_THREADS -u OMP_NUM_THREADS -u MKL_NUM_THREADS \
      "$bin_dir/release/tprun" --standalone --nproc-per-node "$r" "$bench" "${args[@]}" \
      | sed -n 's/^\[rank 0\] //p' | tee -a "$out/results.jsonl" >&2
  done
done

python3 benches/mlp_report.py "$out/results.jsonl" "$out" "$cores"
