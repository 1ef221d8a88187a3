#!/usr/bin/env bash
# candle-tp's shm collectives against Open MPI (shared memory), side by side in one run.
#
#   scripts/bench-collectives.sh                     # all_reduce f32, 2 3 4 ranks, 4K..64M
#   scripts/bench-collectives.sh --ranks "2" --sizes 4K,1M --ops all_reduce,all_gather
#   scripts/bench-collectives.sh --gloo              # also PyTorch gloo (installs torch: GBs)
#
# Both sides time the same way (see benches/mpi_collectives.c): per-iteration latency, the
# slowest rank per iteration, median over iterations. Prints one table of medians and the
# candle-tp / MPI time ratio per size, and keeps the JSON lines in $OUT_DIR (default
# target/bench-collectives).
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="2 3 4"
sizes="4K,16K,64K,256K,1M,4M,16M,64M"
ops="all_reduce"
gloo=0
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --ops) ops="$2"; shift 2 ;;
    --gloo) gloo=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "==> installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

target_dir="${CARGO_TARGET_DIR:-target}"
out="${OUT_DIR:-$target_dir/bench-collectives}"
mkdir -p "$out"
echo "==> building (release)" >&2
cargo build --release --quiet --bin tprun --example bench_collectives
mpicc -O2 -o "$out/mpi_collectives" benches/mpi_collectives.c

cores=$(nproc)
: > "$out/results.jsonl"
for n in $ranks; do
  echo "==> $n ranks ($cores cores)" >&2
  # Oversubscribed MPI must not busy-poll forever: let it yield, as candle-tp does.
  mpi_flags=(--allow-run-as-root --mca btl self,vader -np "$n")
  if [ "$n" -gt "$cores" ]; then mpi_flags+=(--oversubscribe --mca mpi_yield_when_idle 1); fi
  mpirun "${mpi_flags[@]}" "$out/mpi_collectives" "$ops" ${sizes//,/ } | tee -a "$out/results.jsonl" >&2
  "$target_dir/release/tprun" --standalone --nproc-per-node "$n" "$target_dir/release/examples/bench_collectives" \
    --ops "$ops" --dtypes f32 --sizes "$sizes" | sed -n 's/^\[rank 0\] //p' | tee -a "$out/results.jsonl" >&2
  if [ "$gloo" = 1 ]; then
    python3 -c "import torch" 2>/dev/null || pip install --quiet torch --index-url https://pypi.org/simple >&2
    python3 benches/gloo_collectives.py --world "$n" --ops "$ops" --sizes "$sizes" | tee -a "$out/results.jsonl" >&2
  fi
done

python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows:
    by.setdefault((r["op"], r["world_size"], r["bytes"]), {})[r["impl"]] = r
def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
impls = [i for i in ("candle-tp", "mpi", "gloo") if any(i in v for v in by.values())]
print()
print(f"| op | ranks | size | " + " | ".join(f"{i} median" for i in impls) + " | candle-tp / MPI | candle-tp busbw GB/s |")
print("|---|---|---|" + "---|" * len(impls) + "---|---|")
worst = {}
for (op, n, b), v in sorted(by.items()):
    cells = [f"{v[i]['median_us']:.1f} µs" if i in v else "-" for i in impls]
    ratio = v["candle-tp"]["median_us"] / v["mpi"]["median_us"] if "candle-tp" in v and "mpi" in v else None
    if ratio is not None:
        worst[(op, n)] = max(worst.get((op, n), 0), ratio)
    bw = f"{v['candle-tp']['busbw_gbps']:.2f}" if "candle-tp" in v else "-"
    rs = f"{ratio:.2f}" if ratio is not None else "-"
    print(f"| {op} | {n} | {size(b)} | " + " | ".join(cells) + f" | {rs} | {bw} |")
print()
for (op, n), r in sorted(worst.items()):
    print(f"worst candle-tp / MPI ratio, {op}, {n} ranks: {r:.2f}")
PY
