#!/usr/bin/env bash
# The main job: builds the release binaries and runs the tensor-parallel MLP example on
# 2 ranks (one process per rank, shared memory between them), checked against the dense MLP.
#
#   scripts/run.sh                         # 2 ranks, d_model 256
#   scripts/run.sh --nproc-per-node 3      # any tprun flag
#   scripts/run.sh -- --d-model 1024       # arguments after -- go to the example
set -euo pipefail
cd "$(dirname "$0")/.."

launcher_args=()
example_args=()
nproc_given=0
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; example_args=("$@"); break ;;
    --nproc-per-node|--nproc_per_node) nproc_given=1; launcher_args+=("$1" "$2"); shift 2 ;;
    *) launcher_args+=("$1"); shift ;;
  esac
done
[ "$nproc_given" = 1 ] || launcher_args+=(--nproc-per-node 2)

echo "==> building (release)" >&2
cargo build --release --quiet --bin tprun --example mlp
target_dir="${CARGO_TARGET_DIR:-target}"
exec "$target_dir/release/tprun" --standalone "${launcher_args[@]}" "$target_dir/release/examples/mlp" "${example_args[@]}"
